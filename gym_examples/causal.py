"""Causal attention: each token sees itself and the past.

Also: the same thing written as a score_mod (works, but every block is computed), and bottom-right causal
for fewer queries than keys (decoding with a KV cache).

    python gym_examples/causal.py [--small] [--png DIR]
"""

# %%
import torch

from _common import check, draw, setup
from flexlite import create_block_mask, create_mask
from flexlite.masks import causal_mask, generate_causal_bottom_right

cfg = setup(__doc__)
S = cfg.size(8192, 128)
BLOCK = cfg.size(128, 32)  # sparse block size: small enough to show a picture at tiny sizes

# %% [markdown]
# A mask_mod returns True where a query may attend to a key. Blocks where it is False everywhere are
# skipped, so causal attention does about half the work.

# %%
block_mask = create_block_mask(causal_mask, None, None, S, S, device=cfg.device, BLOCK_SIZE=BLOCK)
print(block_mask)
check(cfg, "causal_mask", S, block_mask=block_mask)
draw(cfg, "causal_mask", mask_mod=causal_mask)

# %% [markdown]
# The same mask as a score_mod: correct, but FlexAttention cannot know which blocks are all -inf, so it
# computes all of them. Use a score_mod to change score values, a mask_mod to remove positions.


# %%
def causal_bias(score, b, h, q_idx, kv_idx):
    return torch.where(q_idx >= kv_idx, score, -float("inf"))


# create_mask also takes a score_mod: True where it is not -inf
assert create_mask(causal_bias, 1, 1, 64, 64, device="cpu").equal(create_mask(causal_mask, 1, 1, 64, 64, device="cpu"))
check(cfg, "causal_bias (score_mod, no block mask)", S, score_mod=causal_bias)

# %% [markdown]
# Fewer queries than keys (the last S/4 tokens of a sequence against all of it): align the queries to
# the end of the keys.

# %%
bottom_right = generate_causal_bottom_right(S // 4, S)
block_mask = create_block_mask(bottom_right, None, None, S // 4, S, device=cfg.device, BLOCK_SIZE=BLOCK)
print(f"{bottom_right.__name__}:\n{block_mask}")
check(cfg, bottom_right.__name__, S // 4, S, block_mask=block_mask)
draw(cfg, bottom_right.__name__, mask_mod=generate_causal_bottom_right(8, 24), q_len=8, kv_len=24)

cfg.finish()
