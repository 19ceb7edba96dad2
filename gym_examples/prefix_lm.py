"""Prefix LM (T5, PaLI): bidirectional attention over a prefix (the prompt, an image), causal after it.
Composed as or_masks(prefix, causal_mask).

    python gym_examples/prefix_lm.py [--small] [--png DIR]
"""

# %%
from _common import check, draw, setup
from flexlite import create_block_mask, create_mask, or_masks
from flexlite.masks import causal_mask, generate_prefix_lm_mask

cfg = setup(__doc__)
S, PREFIX = cfg.size(8192, 128), cfg.size(2048, 40)
BLOCK = cfg.size(128, 32)


# %%
def prefix(b, h, q_idx, kv_idx):
    return kv_idx < PREFIX


mask = generate_prefix_lm_mask(PREFIX)
assert create_mask(or_masks(prefix, causal_mask), 1, 1, S, S, "cpu").equal(create_mask(mask, 1, 1, S, S, "cpu"))
block_mask = create_block_mask(mask, None, None, S, S, device=cfg.device, BLOCK_SIZE=BLOCK)
print(f"{mask.__name__}:\n{block_mask}")
check(cfg, mask.__name__, S, block_mask=block_mask)
draw(cfg, "prefix_lm_8", mask_mod=generate_prefix_lm_mask(8))

cfg.finish()
