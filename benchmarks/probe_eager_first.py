"""A process's first calls in torch ops (flexlite.eager) for the harness's ALiBi and softcap at B16 H16 S8192 D64, on a
GPU: ``eager.forward`` called directly (the process's first torch-ops evaluation of each mod), then flex_attention's
first call (torch ops while the kernels compile beside, first_calls.EAGER). No torch.compile in the process, so that
nothing has imported torch._dynamo before (NOTES 79: a custom_op's first call imported it).

Usage: python benchmarks/probe_eager_first.py   (CUDA; set TRITON_CACHE_DIR / FLEXLITE_CACHE_DIR to empty directories)"""

import time

import torch

from flexlite import create_block_mask, eager, first_calls, flex_attention
from flexlite.bench import mask_cases


def main():
    S, D = 8192, 64
    cases = mask_cases(S, 16, torch.device("cuda"))
    q, k, v = [torch.randn(16, 16, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    for name in ("alibi_causal", "softcap30_causal"):
        case = cases[name]
        bm = create_block_mask(case.mask_mod, None, None, S, S, device="cuda")
        t = time.perf_counter()
        eager.forward(q, k, v, case.score_mod, bm, D ** -0.5)
        torch.cuda.synchronize()
        print(name, "eager.forward ok %.3f s" % (time.perf_counter() - t))
        e0 = first_calls.ran_eager()
        t = time.perf_counter()
        flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm)
        torch.cuda.synchronize()
        print(name, "first call %.3f s, eager %d" % (time.perf_counter() - t, first_calls.ran_eager() - e0))
        first_calls.wait()


if __name__ == "__main__":
    main()
