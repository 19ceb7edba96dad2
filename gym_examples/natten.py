"""Neighbourhood attention (NATTEN) on a 2-D canvas: each pixel attends to the kernel around it, the window
shifted to stay inside the canvas. Row-major order scatters a 2-D neighbourhood over many 1-D blocks; a
tiled order (or Morton order) keeps neighbours together and the block mask sparser. The outputs are the
same once the tokens are put back in place.

    python gym_examples/natten.py [--small] [--png DIR]
"""

# %%
import torch

from _common import check, draw, setup
from flexlite import create_block_mask, flex_attention
from flexlite.masks import generate_morton_natten, generate_natten, generate_tiled_natten, tiled_natten_permutation

cfg = setup(__doc__)
W = H = cfg.size(128, 16)  # Morton order needs a power-of-two side
K = cfg.size(13, 5)
T = cfg.size(8, 4)
S = W * H
BLOCK = cfg.size(128, 64)

# %%
naive = generate_natten(W, H, K, K)
tiled = generate_tiled_natten(W, H, K, K, T, T)
morton = generate_morton_natten(W, H, K, K)
block_masks = {}
for mask in (naive, tiled, morton):
    block_masks[mask] = create_block_mask(mask, None, None, S, S, device=cfg.device, BLOCK_SIZE=BLOCK)
    print(f"{mask.__name__}: density {100 - block_masks[mask].sparsity():.1f}% of blocks "
          f"(the mask itself: {100 * K * K / S:.1f}%)\n{block_masks[mask]}")
    check(cfg, mask.__name__, S, block_mask=block_masks[mask])
draw(cfg, "natten_c6x6_k3x3", mask_mod=generate_natten(6, 6, 3, 3), q_len=36)
draw(cfg, "tiled_natten_c6x6_k3x3_t2x2", mask_mod=generate_tiled_natten(6, 6, 3, 3, 2, 2), q_len=36)

# %% [markdown]
# Same attention, different token order: permute the inputs into tiled order, run, permute back.

# %%
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 2, S, 16, generator=g).to(cfg.device, cfg.dtype) for _ in range(3))
perm = tiled_natten_permutation(W, H, T, T, device=cfg.device)
out_naive = flex_attention(q, k, v, block_mask=block_masks[naive])
out_tiled = torch.empty_like(out_naive)
out_tiled[:, :, perm] = flex_attention(q[:, :, perm], k[:, :, perm], v[:, :, perm], block_mask=block_masks[tiled])
err = (out_naive.float() - out_tiled.float()).abs().max().item()
print(f"natten vs tiled natten (un-permuted): max abs diff {err:.1e}")
if err > {torch.float32: 1e-5}.get(cfg.dtype, 1e-2):
    cfg.failures.append("natten vs tiled natten")

cfg.finish()
