"""A tour of flexlite, following attention-gym's FlexAttention notebook (examples/flex_attn.ipynb): for each
attention variant, its block mask, a check against the fp64 reference (forward, and backward where
flexlite has one) and, on a GPU, a timing table of flexlite vs torch's FlexAttention (torch.compile) vs
SDPA with a dense mask vs SDPA causal (FlashAttention-2).

    python gym_examples/tour.py            # GPU: B16 H16 S8192 D64 fp16, as the notebook
    python gym_examples/tour.py --small    # tiny sizes (automatic on CPU, through Triton's interpreter)
    python gym_examples/tour.py --only causal_mask,document_causal_mask --no-torch-flex
"""

# %% [markdown]
# ## Setup

# %%
import random

import torch
import torch.nn.functional as F
from tabulate import tabulate

from _common import check, setup
from flexlite import create_block_mask, create_mask, flex_attention
from flexlite.bench import flops, time_ms
from flexlite.masks import (causal_mask, generate_doc_mask_mod, generate_natten, generate_prefix_lm_mask,
                            generate_sasa_mask, generate_sliding_window, generate_tiled_natten,
                            generate_vision_cross_attention_mask_mod, image_intervals_from_tokens,
                            length_to_offsets)
from flexlite.mods import generate_alibi_bias, generate_tanh_softcap


def tour_arguments(p):
    p.add_argument("--only", help="comma-separated case names (as printed after ###) to run")
    p.add_argument("--no-torch-flex", action="store_true", help="skip torch.compile'd flex_attention in the timings")


cfg = setup(__doc__, tour_arguments)
args = cfg.args
only = set(args.only.split(",")) if args.only else None
timing = cfg.device.type == "cuda"
torch_flex = timing and not args.no_torch_flex

B, H, S, D = (16, 16, 8192, 64) if not cfg.small else (1, 2, 128, 16)
BLOCK = cfg.size(128, 32)  # sparse block size (the notebook's default, 128, on the GPU)
print(f"sizes: B{B} H{H} S{S} D{D} {str(cfg.dtype).replace('torch.', '')}, BLOCK_SIZE {BLOCK}")
if not timing:
    print("timing: skipped (CPU: Triton interpreter timings mean nothing; torch.compile'd flex_attention "
          "skipped too)")

# %% [markdown]
# FLOPs are counted for the work the mask leaves (density = fraction of non-empty blocks), as in the
# notebook: forward 4 * B*H*S^2*D * density (two matmuls, QK^T and PV, each 2 flops per multiply-add),
# backward 2.5x that, i.e. 10 * B*H*S^2*D * density (five matmuls: QK^T recomputed, dV, dP, dQ, dK).
# SDPA causal is counted at density 0.5. SDPA with a dense mask computes every block; its TFLOP/s are
# the same useful work over its time. flexlite.bench's flops and time_ms (do_bench medians) do the counting.

# %%
print("TFLOP/s = flops / time: fwd 4*B*H*S^2*D*density (2 matmuls x 2 flops per MAC), "
      "bwd 10*B*H*S^2*D*density (2.5x fwd)")

if torch_flex:
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask
    from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention
    torch._dynamo.config.cache_size_limit = 1000
    compiled_flex = torch.compile(torch_flex_attention, dynamic=False)


def _time_fwd_bwd(fn, grad_out):
    """(fwd ms, bwd ms), medians from flexlite.bench.time_ms; bwd None if the output has no grad_fn."""
    fwd = time_ms(fn)
    out = fn()
    bwd = time_ms(lambda: out.backward(grad_out, retain_graph=True)) if out.requires_grad else None
    return fwd, bwd


def _timing_table(score_mod, mask_mod, block_mask, S_=None, torch_score_mod=None):
    S_ = S_ or S
    g = torch.Generator(device=cfg.device).manual_seed(0)
    q, k, v, grad_out = (torch.randn(B, H, S_, D, generator=g, device=cfg.device, dtype=cfg.dtype)
                         for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    density = 1.0 - block_mask.sparsity() / 100 if block_mask is not None else 1.0
    dense_mask = create_mask(mask_mod or score_mod, 1, 1, S_, S_, device=cfg.device)
    impls = {"flexlite": lambda: flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)}
    if torch_flex:
        torch_block_mask = (torch_create_block_mask(mask_mod, None, None, S_, S_, device=cfg.device)
                            if mask_mod is not None else None)
        impls["torch flex (compiled)"] = lambda: compiled_flex(q, k, v, score_mod=torch_score_mod or score_mod,
                                                               block_mask=torch_block_mask)
    impls["SDPA + dense mask"] = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask)
    impls["SDPA causal (FA2)"] = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    rows, errors = [], []
    for label, fn in impls.items():
        work = 0.5 if label.startswith("SDPA causal") else density
        try:
            fwd, bwd = _time_fwd_bwd(fn, grad_out)
        except Exception as e:  # e.g. a mod that torch.compile cannot lower: say so, keep going
            rows.append([label, f"failed ({type(e).__name__})", "", "", ""])
            errors.append(f"{label}: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}")
            continue
        tflops_bwd = f"{flops(B, H, S_, D, work, 'bwd') / bwd / 1e9:.2f}" if bwd else "n/a"
        rows.append([label, f"{fwd:.4f}", f"{flops(B, H, S_, D, work, 'fwd') / fwd / 1e9:.2f}",
                     f"{bwd:.4f}" if bwd else "n/a", tflops_bwd])
        q.grad = k.grad = v.grad = None
    print(tabulate(rows, headers=["Operation", "FW Time (ms)", "FW FLOPS (TF/s)", "BW Time (ms)", "BW FLOPS (TF/s)"],
                   tablefmt="grid"))
    print(f"(density {100 * density:.1f}% of blocks; B{B} H{H} S{S_} D{D})")
    for line in errors:
        print(f"  failed: {line}")


def test_mask(name, score_mod=None, mask_mod=None, S_=None, print_mask=True, time_it=True, torch_score_mod=None,
              check_score_mod=None):
    """The notebook's test_mask: block mask, correctness vs the fp64 reference, timings. ``torch_score_mod``
    stands in for ``score_mod`` in torch's flex where ours uses a flexlite-only op (tanh_approx);
    ``check_score_mod`` for the check (on fewer heads than the timings) where score_mod is made for H heads."""
    if only is not None and name not in only:
        return
    S_ = S_ or S
    print(f"\n### {name}")
    block_mask = (create_block_mask(mask_mod, None, None, S_, S_, device=cfg.device, BLOCK_SIZE=BLOCK)
                  if mask_mod is not None else None)
    if print_mask and block_mask is not None:
        print(block_mask)
    check(cfg, name, S_, score_mod=check_score_mod or score_mod, block_mask=block_mask,
          H=cfg.size(2 if S_ <= 8192 else 1, 1), D=D)
    if timing and time_it:
        _timing_table(score_mod, mask_mod, block_mask, S_, torch_score_mod)
        torch.cuda.empty_cache()


# %% [markdown]
# ## Basic usage: a score_mod


# %%
def checkerboard(score, batch, head, token_q, token_kv):
    score = torch.where(torch.abs(token_kv - token_q) % 2 == 1, score * 0.5, score)
    score = torch.where(torch.abs(token_kv - token_q) % 2 == 0, score * 2.0, score)
    return score


test_mask("checkerboard", score_mod=checkerboard, time_it=False)

# %% [markdown]
# ## Full attention (no-op score_mod)


# %%
def noop(score, b, h, q_idx, kv_idx):
    return score


test_mask("noop", score_mod=noop)

# %% [markdown]
# ## Causal: as a score_mod (every block computed) and as a mask_mod (empty blocks skipped)


# %%
def causal_bias(score, b, h, q_idx, kv_idx):
    return torch.where(q_idx >= kv_idx, score, -float("inf"))


test_mask("causal_bias", score_mod=causal_bias)
test_mask("causal_mask", mask_mod=causal_mask)

# %% [markdown]
# ## Sliding window + causal, prefix LM

# %%
SLIDING_WINDOW = cfg.size(1024, 24)
test_mask("sliding_window", mask_mod=generate_sliding_window(SLIDING_WINDOW))
test_mask("prefix_lm", mask_mod=generate_prefix_lm_mask(cfg.size(2048, 40)))

# %% [markdown]
# ## Document masking (packed sequences)
# The document layout is a captured tensor, so a new layout needs a new BlockMask but no new kernel.

# %%
doc_lengths = [S // 8] + [S // 8] + [S // 4] * 3  # the notebook: 4096, 4096, then 8192s, at S/4 scale
test_mask("document_causal_mask", mask_mod=generate_doc_mask_mod(
    causal_mask, offsets=length_to_offsets(doc_lengths, device=cfg.device)))

# %% [markdown]
# ## Packed variable-length sequences (the notebook's nested-jagged-tensor section)
# Random lengths packed back to back, causal within each: the same document mask, built from offsets.

# %%
random.seed(0)
lengths = [random.randint(1, S // 8) for _ in range(7)]
lengths.append(S - sum(lengths))
test_mask("packed_causal", mask_mod=generate_doc_mask_mod(causal_mask, offsets=length_to_offsets(lengths, cfg.device)))

# %% [markdown]
# ## 2-D masks: SASA, NATTEN, tiled NATTEN (on a W x W image, S = W^2)

# %%
W = cfg.size(128, 12)
test_mask("sasa", mask_mod=generate_sasa_mask(W, W, cfg.size(8, 2)), S_=W * W)
K = cfg.size(13, 5)
test_mask("natten", mask_mod=generate_natten(W, W, K, K), S_=W * W)
test_mask("tiled_natten", mask_mod=generate_tiled_natten(W, W, K, K, cfg.size(8, 4), cfg.size(8, 4)), S_=W * W)

# %% [markdown]
# ## ALiBi, tanh soft-capping (score_mod + causal mask)

# %%
test_mask("alibi_causal", score_mod=generate_alibi_bias(H, device=cfg.device), mask_mod=causal_mask,
          print_mask=False, check_score_mod=generate_alibi_bias(cfg.size(2, 1), device=cfg.device))
# flexlite's softcap uses the GPU's tanh.approx (as FlashAttention does); torch's flex gets the exact tanh,
# since torch.compile cannot lower flexlite's op
test_mask("softcap_causal", score_mod=generate_tanh_softcap(2.0), mask_mod=causal_mask, print_mask=False,
          torch_score_mod=generate_tanh_softcap(2.0, approx=False))

# %% [markdown]
# ## Flamingo cross-attention
# Text tokens attend to the images before them (until the next image); Q_LEN != KV_LEN.

# %%
if only is None or "flamingo" in only:
    print("\n### flamingo")
    tokens = [1, 1, 9673, 527, 1403, 12875, 13, 1, 1115, 374, 264, 8415]
    mask = generate_vision_cross_attention_mask_mod(image_intervals_from_tokens(tokens, 1), 3)
    print(create_mask(mask, 1, 1, len(tokens), 9, device="cpu")[0, 0].int())
    text, per_image = S, cfg.size(1024, 32)
    image_at = [0, 1, text // 2, 3 * text // 4]
    intervals = image_intervals_from_tokens([1 if i in image_at else 7 for i in range(text)], 1)
    mask = generate_vision_cross_attention_mask_mod(intervals, per_image, device=cfg.device)
    block_mask = create_block_mask(mask, None, None, text, len(image_at) * per_image, device=cfg.device,
                                   BLOCK_SIZE=BLOCK)
    print(block_mask)
    check(cfg, "flamingo", text, len(image_at) * per_image, block_mask=block_mask, D=D)
    if timing:
        print("timing: skipped for cross-attention (the FLOP helper counts S x S)")

cfg.finish()
