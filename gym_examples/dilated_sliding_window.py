"""Dilated sliding window: within a window of ``window`` tokens on each side, attend to every
``dilation``-th token (a wider receptive field for the same work). Every block is partial: the dilation
shows up inside blocks, not between them.

    python gym_examples/dilated_sliding_window.py [--small] [--png DIR]
"""

# %%
from _common import check, draw, setup
from flexlite import create_block_mask
from flexlite.masks import generate_dilated_sliding_window

cfg = setup(__doc__)
S, WINDOW, DILATION = cfg.size(8192, 128), cfg.size(1024, 24), 4
BLOCK = cfg.size(128, 32)

# %%
for causal in (False, True):
    mask = generate_dilated_sliding_window(WINDOW, DILATION, causal=causal)
    block_mask = create_block_mask(mask, None, None, S, S, device=cfg.device, BLOCK_SIZE=BLOCK)
    print(f"{mask.__name__}:\n{block_mask}")
    check(cfg, mask.__name__, S, block_mask=block_mask)
    draw(cfg, f"dilated_sliding_window_4_dilation_2{'_causal' if causal else ''}",
         mask_mod=generate_dilated_sliding_window(4, 2, causal=causal))

cfg.finish()
