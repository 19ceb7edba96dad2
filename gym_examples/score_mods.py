"""Score mods from flexlite.mods, each with a causal mask: ALiBi, tanh soft-capping, a relative-position
bias table and a per-head bias. Captured tensors (slopes, tables, biases) are kernel arguments; when they
require grad, their gradients come out of the backward pass.

    python gym_examples/score_mods.py [--small] [--png DIR]
"""

# %%
import torch

from _common import check, draw, setup
from flexlite import create_block_mask, flex_attention
from flexlite.masks import causal_mask
from flexlite.mods import (alibi_slopes, generate_alibi_bias, generate_head_bias, generate_relative_bias,
                           generate_tanh_softcap)

cfg = setup(__doc__)
S, H = cfg.size(8192, 128), 2  # the checks run the fp64 reference: two heads are enough
BLOCK = cfg.size(128, 32)
block_mask = create_block_mask(causal_mask, None, None, S, S, device=cfg.device, BLOCK_SIZE=BLOCK)
g = torch.Generator().manual_seed(0)

# %% [markdown]
# ## ALiBi (Press et al.)
# A per-head linear penalty on the query-key distance. The slopes are a captured tensor; the same bias
# can be computed from ``h`` inside the score_mod instead.

# %%
alibi = generate_alibi_bias(H, device=cfg.device)


def alibi_functional(score, b, h, q_idx, kv_idx):
    slope = torch.exp2(-((h + 1) * 8.0 / H))
    return score + slope * (kv_idx - q_idx)


check(cfg, f"{alibi.__name__} + causal (captured slopes)", S, score_mod=alibi, block_mask=block_mask, H=H)
check(cfg, "alibi_functional + causal (slopes from h)", S, score_mod=alibi_functional, block_mask=block_mask, H=H)
slopes = alibi_slopes(H, device=cfg.device).requires_grad_()
check(cfg, "alibi (learnable slopes) + causal", S, score_mod=generate_alibi_bias(H, slopes=slopes),
      block_mask=block_mask, H=H, captured=(slopes,))
draw(cfg, "alibi_causal_head0", score_mod=generate_alibi_bias(1), mask_mod=causal_mask)

# %% [markdown]
# ## Tanh soft-capping (Gemma 2, Grok)
# ``cap * tanh(score / cap)``. By default the GPU's fast ``tanh.approx.f32`` (as FlashAttention; about
# 2**-11 relative error), exact on CPU and in the reference; ``approx=False`` for the exact tanh.

# %%
CAP = 2.0  # small enough that tanh bends the O(1) scores of random inputs
for approx in (True, False):
    softcap = generate_tanh_softcap(CAP, approx=approx)
    check(cfg, f"{softcap.__name__} + causal", S, score_mod=softcap, block_mask=block_mask)
draw(cfg, "tanh_softcap_2", score_mod=generate_tanh_softcap(CAP, approx=False))

# %% [markdown]
# ## Relative-position bias (T5, Swin)
# ``score + table[h, q_idx - kv_idx + L - 1]`` from a learned table; a short table clips far distances
# to its edge entries.

# %%
table = (0.5 * torch.randn(H, 2 * S - 1, generator=g)).to(cfg.device).requires_grad_()
bias = generate_relative_bias(table)
check(cfg, f"{bias.__name__} (learnable table) + causal", S, score_mod=bias, block_mask=block_mask, H=H,
      captured=(table,))
short = generate_relative_bias((0.5 * torch.randn(2 * 32 - 1, generator=g)).to(cfg.device))
check(cfg, f"{short.__name__} (no mask)", S, score_mod=short, H=H)
draw(cfg, "relative_bias_8_causal", score_mod=generate_relative_bias(torch.linspace(-2, 2, 15)), mask_mod=causal_mask)

# %% [markdown]
# ## Per-head bias
# ``score + bias[h]`` adds a constant to a whole row: softmax, and so the output, is unchanged; only the
# log-sum-exp moves, by ``bias[h]``. Easy to get wrong, so here is the check.

# %%
bias_h = torch.linspace(-2.0, 3.5, H, device=cfg.device)
head_bias = generate_head_bias(bias_h)
check(cfg, f"{head_bias.__name__} + causal", S, score_mod=head_bias, block_mask=block_mask, H=H)
q, k, v = (torch.randn(1, H, S, 16, generator=g).to(cfg.device, cfg.dtype) for _ in range(3))
out, lse = flex_attention(q, k, v, score_mod=head_bias, block_mask=block_mask, return_lse=True)
out0, lse0 = flex_attention(q, k, v, block_mask=block_mask, return_lse=True)
shift = (lse - lse0).mean(dim=(0, 2))
print(f"  per-head bias: output unchanged (max diff {(out.float() - out0.float()).abs().max().item():.1e}), "
      f"LSE shift per head {[round(x, 3) for x in shift.tolist()]} = bias {[round(x, 3) for x in bias_h.tolist()]}")
if not torch.allclose(shift, bias_h, atol=1e-2):
    cfg.failures.append("head bias LSE shift")

cfg.finish()
