"""GPU check of the kernels' approximate tanh (the softcap's): max absolute and relative error of flexlite's
``tanh_approx`` lowering against float64 tanh over a dense grid, next to torch's float32 tanh. Prints one line
per function."""

import torch

from flexlite import create_block_mask, flex_attention
from flexlite.ops import tanh_approx


def main():
    # the kernel's tanh on every score: score_mod tanh_approx(score) over q = grid values, k = one-hot
    x = torch.linspace(-12, 12, 1 << 16, dtype=torch.float64)
    q = x.float().reshape(1, 1, -1, 1).expand(1, 1, -1, 16).contiguous().cuda()
    k = torch.zeros(1, 1, 16, 16, device="cuda")
    k[0, 0, 0, 0] = 1.0  # with scale 1 key 0 scores x; the mask keeps key 0 alone
    v = torch.zeros(1, 1, 16, 16, device="cuda")
    bm = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx == 0, None, None, q.shape[2], 16, device="cuda")
    _, lse = flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: tanh_approx(s), block_mask=bm,
                            scale=1.0, return_lse=True)
    got = lse[0, 0].double().cpu()  # one unmasked key: LSE = its score = tanh_approx(x)
    want = torch.tanh(x)
    rel = ((got - want).abs() / want.abs().clamp_min(1e-30))[want.abs() > 1e-3]
    print(f"kernel tanh_approx: max abs err {(got - want).abs().max().item():.2e}, max rel err (|tanh| > 1e-3) "
          f"{rel.max().item():.2e}")
    f32 = torch.tanh(x.float().cuda()).double().cpu()
    print(f"torch float32 tanh: max abs err {(f32 - want).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
