"""Sliding-window attention (Mistral): each token sees the last ``window`` tokens; bidirectional: the
``window`` tokens on either side. Built by composing masks with and_masks.

    python gym_examples/sliding_window.py [--small] [--png DIR]
"""

# %%
from _common import check, draw, setup
from flexlite import and_masks, create_block_mask, create_mask
from flexlite.masks import causal_mask, generate_sliding_window

cfg = setup(__doc__)
S, WINDOW = cfg.size(8192, 128), cfg.size(1024, 24)
BLOCK = cfg.size(128, 32)

# %% [markdown]
# Write the window and compose it with causal rather than repeating the causal logic. The window only
# needs its left edge: causal_mask removes the future.


# %%
def window(b, h, q_idx, kv_idx):
    return q_idx - kv_idx <= WINDOW


sliding_window_causal = and_masks(causal_mask, window)
library = generate_sliding_window(WINDOW)
assert create_mask(sliding_window_causal, 1, 1, S, S, "cpu").equal(create_mask(library, 1, 1, S, S, "cpu"))

block_mask = create_block_mask(library, None, None, S, S, device=cfg.device, BLOCK_SIZE=BLOCK)
print(f"{library.__name__}:\n{block_mask}")
check(cfg, library.__name__, S, block_mask=block_mask)
draw(cfg, "sliding_window_3", mask_mod=generate_sliding_window(3))

# %%
bidirectional = generate_sliding_window(WINDOW, causal=False)
block_mask = create_block_mask(bidirectional, None, None, S, S, device=cfg.device, BLOCK_SIZE=BLOCK)
print(f"{bidirectional.__name__}:\n{block_mask}")
check(cfg, bidirectional.__name__, S, block_mask=block_mask)
draw(cfg, "sliding_window_3_bidirectional", mask_mod=generate_sliding_window(3, causal=False))

cfg.finish()
