"""Stand-alone self-attention (SASA) on a 2-D image flattened row-major: each pixel attends to the pixels
within ``WINDOW`` rows and columns (a window that is cut at the edges, unlike NATTEN's).

    python gym_examples/sasa.py [--small] [--png DIR]
"""

# %%
from _common import check, draw, setup
from flexlite import create_block_mask
from flexlite.masks import generate_sasa_mask

cfg = setup(__doc__)
W = H = cfg.size(128, 12)
WINDOW = cfg.size(8, 2)
S = W * H
BLOCK = cfg.size(128, 32)

# %%
mask = generate_sasa_mask(W, H, WINDOW)
block_mask = create_block_mask(mask, None, None, S, S, device=cfg.device, BLOCK_SIZE=BLOCK)
print(f"{mask.__name__}:\n{block_mask}")
check(cfg, mask.__name__, S, block_mask=block_mask)
draw(cfg, "sasa_c6x6_w1", mask_mod=generate_sasa_mask(6, 6, 1), q_len=36)

cfg.finish()
