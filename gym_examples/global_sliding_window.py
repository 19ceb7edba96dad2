"""Global tokens + sliding window (Longformer / BigBird; causal: StreamingLLM's attention sinks): a few
global tokens see and are seen by everything, the rest attend within a window.

    python gym_examples/global_sliding_window.py [--small] [--png DIR]
"""

# %%
from _common import check, draw, setup
from flexlite import create_block_mask
from flexlite.masks import generate_global_sliding_window

cfg = setup(__doc__)
S, WINDOW, GLOBAL = cfg.size(8192, 128), cfg.size(512, 16), cfg.size(128, 8)
BLOCK = cfg.size(128, 32)

# %%
for causal in (False, True):
    mask = generate_global_sliding_window(WINDOW, GLOBAL, causal=causal)
    block_mask = create_block_mask(mask, None, None, S, S, device=cfg.device, BLOCK_SIZE=BLOCK)
    print(f"{mask.__name__}:\n{block_mask}")
    check(cfg, mask.__name__, S, block_mask=block_mask)
    draw(cfg, f"global_2_sliding_window_3{'_causal' if causal else ''}",
         mask_mod=generate_global_sliding_window(3, 2, causal=causal))

cfg.finish()
