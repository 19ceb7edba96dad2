"""Block-causal attention: tokens in blocks, a block sees itself and all earlier blocks (block diffusion,
semi-autoregressive decoding, chunked prefill). And BD3-LM's training mask over ``[x_t | x_0]``.

    python gym_examples/block_causal.py [--small] [--png DIR]
"""

# %%
from _common import check, draw, setup
from flexlite import create_block_mask
from flexlite.masks import generate_block_causal_mask, generate_block_diffusion_mask

cfg = setup(__doc__)
S, BLOCK_LEN = cfg.size(8192, 128), cfg.size(1024, 24)
BLOCK = cfg.size(128, 32)

# %%
mask = generate_block_causal_mask(BLOCK_LEN)
block_mask = create_block_mask(mask, None, None, S, S, device=cfg.device, BLOCK_SIZE=BLOCK)
print(f"{mask.__name__}:\n{block_mask}")
check(cfg, mask.__name__, S, block_mask=block_mask)
draw(cfg, "block_causal_4", mask_mod=generate_block_causal_mask(4))

# %% [markdown]
# Block diffusion (BD3-LM): the noised sequence x_t and the clean x_0 side by side. x_t tokens see their
# own noised block and the clean blocks before it; x_0 tokens are block-causal among themselves.

# %%
mask = generate_block_diffusion_mask(S // 2, BLOCK_LEN)
block_mask = create_block_mask(mask, None, None, S, S, device=cfg.device, BLOCK_SIZE=BLOCK)
print(f"{mask.__name__}:\n{block_mask}")
check(cfg, mask.__name__, S, block_mask=block_mask)
draw(cfg, "block_diffusion_4_12", mask_mod=generate_block_diffusion_mask(12, 4))

cfg.finish()
