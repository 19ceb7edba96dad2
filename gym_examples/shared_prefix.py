"""Shared prefix: several continuations of one prompt packed as ``[prefix | suffix_0 | suffix_1 | ...]``
(parallel sampling, best-of-n, tree decoding). Causal; a suffix token sees the prefix and its own
suffix. The prefix is stored and computed once instead of once per continuation.

    python gym_examples/shared_prefix.py [--small] [--png DIR]
"""

# %%
import torch

from _common import check, draw, setup
from flexlite import attention_reference, create_block_mask, create_mask, flex_attention
from flexlite.masks import causal_mask, generate_shared_prefix_mask

cfg = setup(__doc__)
PREFIX, SUFFIXES = cfg.size(4096, 48), cfg.size([1024] * 4, [24, 32, 24])
S = PREFIX + sum(SUFFIXES)
BLOCK = cfg.size(128, 32)

# %%
mask = generate_shared_prefix_mask(PREFIX, SUFFIXES, device=cfg.device)
block_mask = create_block_mask(mask, None, None, S, S, device=cfg.device, BLOCK_SIZE=BLOCK)
print(f"{mask.__name__}:\n{block_mask}")
check(cfg, mask.__name__, S, block_mask=block_mask)
draw(cfg, "shared_prefix_6_3_suffixes", mask_mod=generate_shared_prefix_mask(6, [5, 4, 5]), q_len=20)

# %% [markdown]
# The packed result for continuation i equals causal attention over ``prefix + suffix_i`` alone.

# %%
g = torch.Generator().manual_seed(1)
q, k, v = (torch.randn(1, 2, S, 16, generator=g).to(cfg.device, cfg.dtype) for _ in range(3))
packed = flex_attention(q, k, v, block_mask=block_mask)
start = PREFIX
for i, n in enumerate(SUFFIXES[:2]):
    rows = list(range(PREFIX)) + list(range(start, start + n))
    alone = create_block_mask(causal_mask, None, None, len(rows), len(rows), device=cfg.device)
    ref, _ = attention_reference(q[:, :, rows], k[:, :, rows], v[:, :, rows], block_mask=alone)
    err = (packed[:, :, start:start + n].double() - ref[:, :, PREFIX:]).abs().max().item()
    print(f"  suffix {i} packed vs alone: max abs err {err:.1e}")
    if err > 50 * {torch.float32: 1e-5}.get(cfg.dtype, 1e-3):
        cfg.failures.append(f"shared prefix suffix {i}")
    start += n
assert create_mask(mask, 1, 1, S, S, device=cfg.device)[0, 0, PREFIX:, :PREFIX].all()

cfg.finish()
