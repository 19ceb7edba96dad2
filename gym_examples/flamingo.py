"""Flamingo vision cross-attention: text tokens (queries) attend to the tokens of the images they follow
(keys), looked up through captured tensors as ``intervals[image_of[kv_idx]]``. Text before the first image
sees no image at all: those rows are fully masked and give 0 (never NaN).

    python gym_examples/flamingo.py [--small] [--png DIR]
"""

# %%
import torch

from _common import check, draw, setup
from flexlite import create_block_mask, create_mask, flex_attention
from flexlite.masks import generate_vision_cross_attention_mask_mod, image_intervals_from_tokens

cfg = setup(__doc__)

# %% [markdown]
# torchtune's example: "<img1><img2>These are two dogs. <img3>This is a cat.", image token 1.

# %%
tokens = [1, 1, 9673, 527, 1403, 12875, 13, 1, 1115, 374, 264, 8415]
intervals = image_intervals_from_tokens(tokens, image_token_id=1)
print(f"intervals: {intervals}")
mask = generate_vision_cross_attention_mask_mod(intervals, image_token_length=3)
for token, row in zip(tokens, create_mask(mask, 1, 1, len(tokens), 9, device="cpu")[0, 0].tolist()):
    print(f"{token:>6}  " + " | ".join(" ".join("█" if x else "░" for x in row[i:i + 3]) for i in (0, 3, 6)))
draw(cfg, "vision_cross_attention_3x3", mask_mod=mask, q_len=len(tokens), kv_len=9)

# %% [markdown]
# At scale: text with a few images, each image's tokens visible from its position until the next image
# (two images back to back share their text). The first TEXT0 tokens come before any image.

# %%
TEXT, IMAGE_TOKENS, TEXT0 = cfg.size(8192, 128), cfg.size(1024, 16), cfg.size(100, 20)
image_at = [TEXT0, TEXT0 + 1, TEXT // 2, 3 * TEXT // 4]
big_tokens = [1 if i in image_at else 7 for i in range(TEXT)]
mask = generate_vision_cross_attention_mask_mod(image_intervals_from_tokens(big_tokens, 1), IMAGE_TOKENS,
                                                device=cfg.device)
KV = len(image_at) * IMAGE_TOKENS
block_mask = create_block_mask(mask, None, None, TEXT, KV, device=cfg.device, BLOCK_SIZE=cfg.size(128, 32))
print(f"{mask.__name__}: Q_LEN={TEXT} text tokens, KV_LEN={KV} image tokens\n{block_mask}")
check(cfg, mask.__name__, TEXT, KV, block_mask=block_mask)

# %%
g = torch.Generator().manual_seed(0)
q = torch.randn(1, 2, TEXT, 16, generator=g).to(cfg.device, cfg.dtype)
k, v = (torch.randn(1, 2, KV, 16, generator=g).to(cfg.device, cfg.dtype) for _ in range(2))
out = flex_attention(q, k, v, block_mask=block_mask)
no_image = out[:, :, :TEXT0]
print(f"text before the first image: output all zero: {bool((no_image == 0).all())}, "
      f"NaN: {bool(no_image.isnan().any())}")
if not (no_image == 0).all():
    cfg.failures.append("flamingo fully masked rows")

cfg.finish()
