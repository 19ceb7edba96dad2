"""``flash_attention`` (causal and per-sample lengths) on flexlite's block-sparse kernels, and
``reference_attention`` on flexlite's fp64 reference.

Causal and ``seq_lens`` are mask_mods: ``seq_lens`` is captured by the mod, so it becomes a kernel
argument (new lengths, no recompile) and a per-batch block mask (``B = batch``) skips the tiles past
each sample's length.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from ..api import MAX_HEAD_DIM, SUPPORTED_DTYPES, flex_attention
from ..block_mask import and_masks, check_bool, create_block_mask
from ..masks.causal import causal_mask
from ..reference import attention_reference


# q and k have one length here, so flexlite's split-KV decode kernel (short queries over a long KV) has
# nothing to gain: always the forward kernel, whose tiles get_attention_config reports (torch's option name)
KERNEL_OPTIONS = {"FORCE_USE_FLEX_ATTENTION": True}


def _fail(fn: str, msg: str, exc=ValueError):
    raise exc(f"{fn}: {msg}")


def _validate(fn: str, q, k, v, sm_scale=None, seq_lens=None, causal=False, kernels=True):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            _fail(fn, f"{name} must be a torch.Tensor, got {type(t).__name__}", TypeError)
        if t.dim() not in (3, 4):
            _fail(fn, f"expected 3-D (batch*heads, seq_len, head_dim) or 4-D (batch, heads, seq_len, head_dim) "
                      f"tensors; {name} has shape {tuple(t.shape)} ({t.dim()}-D)")
    if not q.shape == k.shape == v.shape:
        _fail(fn, f"shape mismatch: q, k and v must have one shape; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                  f"v {tuple(v.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in SUPPORTED_DTYPES:
            _fail(fn, f"unsupported dtype {t.dtype} for {name}; use float16, bfloat16 or float32", TypeError)
    if not q.dtype == k.dtype == v.dtype:
        _fail(fn, f"dtypes must match: q {q.dtype}, k {k.dtype}, v {v.dtype}", TypeError)
    if not q.device == k.device == v.device:
        _fail(fn, f"q, k and v must be on one device; got {q.device}, {k.device}, {v.device}")
    if kernels and q.device.type not in ("cuda", "cpu"):
        _fail(fn, f"the inputs are on {q.device}; flexlite's kernels run CUDA tensors (compiled) and CPU tensors "
                  f"(Triton's interpreter) only: move them with .to('cuda') or .to('cpu')", NotImplementedError)
    check_bool(fn, "causal", causal)
    head_dim = q.shape[-1]
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        _fail(fn, f"unsupported head_dim {head_dim}: flexlite supports 1..{MAX_HEAD_DIM}")
    from ..api import check_scale
    check_scale(sm_scale, lambda message, exc: _fail(fn, message, exc), "sm_scale")
    if seq_lens is not None:
        _validate_seq_lens(fn, seq_lens, q.shape[0], q.shape[-2])


def _validate_seq_lens(fn: str, seq_lens, batch: int, seq_len: int):
    if not isinstance(seq_lens, torch.Tensor):
        _fail(fn, f"seq_lens must be an int32 tensor of shape (batch,), got {type(seq_lens).__name__}", TypeError)
    if seq_lens.dtype.is_floating_point or seq_lens.dtype.is_complex or seq_lens.dtype == torch.bool:
        _fail(fn, f"seq_lens must be an integer (int32) tensor, got {seq_lens.dtype}", TypeError)
    if seq_lens.device.type not in ("cuda", "cpu"):
        _fail(fn, f"seq_lens is on {seq_lens.device}; give it on CUDA or CPU (any of them: it is moved to q's device)")
    if seq_lens.dim() != 1:
        _fail(fn, f"seq_lens must be 1-D (batch,); got shape {tuple(seq_lens.shape)}")
    if seq_lens.numel() != batch:
        _fail(fn, f"seq_lens has {seq_lens.numel()} entries but the batch size is {batch} (for 3-D inputs the batch "
                  f"is the first dimension, batch*heads)")
    if batch and (int(seq_lens.min()) < 0 or int(seq_lens.max()) > seq_len):
        _fail(fn, f"seq_lens values must be in [0, {seq_len}] (the sequence length); got "
                  f"{seq_lens.tolist() if batch <= 16 else (int(seq_lens.min()), int(seq_lens.max()))}")


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    return t.unsqueeze(1) if t.dim() == 3 else t


def generate_seq_lens_mask(seq_lens: torch.Tensor):
    """mask_mod keeping query and key positions below ``seq_lens[b]``: a query row past its sample's
    length has no key left, so its output is 0."""
    def seq_lens_mask(b, h, q_idx, kv_idx):
        return (q_idx < seq_lens[b]) & (kv_idx < seq_lens[b])

    return seq_lens_mask


@functools.lru_cache(maxsize=32)
def _causal_block_mask(seq_len: int, device: torch.device):
    return create_block_mask(causal_mask, None, None, seq_len, seq_len, device=device)


def block_mask_for(q4: torch.Tensor, causal: bool, seq_lens: Optional[torch.Tensor]):
    """The BlockMask flash_attention uses for 4-D ``q4``: None, causal (cached per length and device), or
    per batch (B = batch) from ``seq_lens``, combined with causal by and_masks."""
    batch, _, seq_len, _ = q4.shape
    if seq_lens is None:
        return _causal_block_mask(seq_len, q4.device) if causal else None
    mask_mod = generate_seq_lens_mask(seq_lens.to(device=q4.device, dtype=torch.int32))
    if causal:
        mask_mod = and_masks(causal_mask, mask_mod)
    return create_block_mask(mask_mod, batch, None, seq_len, seq_len, device=q4.device)


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    sm_scale: Optional[float] = None,
    seq_lens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """FlashAttention forward: ``softmax(q @ k^T * sm_scale) @ v`` without materialising the scores.

    Args:
        q, k, v: one shape, (batch, heads, seq_len, head_dim) or (batch*heads, seq_len, head_dim) (3-D is
            taken as batch = batch*heads, heads = 1); head_dim 1..256; float16, bfloat16 or float32, one
            dtype, one device (CUDA: compiled kernels; CPU: the same kernels through Triton's interpreter).
        causal: query i attends to keys 0..i.
        sm_scale: score scale, default ``1 / sqrt(head_dim)``; a number, or a real 0-d tensor (read on the host).
        seq_lens: integer tensor (int32 preferred) of shape (batch,), values in [0, seq_len]: sample b
            is valid for positions < seq_lens[b]. Keys past it are masked and query rows past it are 0;
            the valid rows equal attention over the valid prefix alone.

    Returns:
        Output of q's shape and dtype (float32 stays float32; the softmax and accumulation are fp32).
        Differentiable w.r.t. q, k, v through flexlite's autograd.

    Raises:
        ValueError: not 3-D/4-D, shape mismatch, devices differ, unsupported head_dim, bad seq_lens shape
            or values.
        TypeError: not a tensor, unsupported dtype, dtypes differ, non-integer seq_lens, non-float sm_scale.
    """
    _validate("flash_attention", q, k, v, sm_scale, seq_lens, causal)
    q4, k4, v4 = _as_4d(q), _as_4d(k), _as_4d(v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)
    # empty inputs (no batch, head or position): no block mask (create_block_mask takes no length 0) and nothing it
    # would mask; flex_attention still returns its output differentiable in q, k, v (zeros_like(q) was not)
    block_mask = block_mask_for(q4, causal, seq_lens) if q.numel() else None
    out = flex_attention(q4, k4, v4, block_mask=block_mask, scale=scale, kernel_options=dict(KERNEL_OPTIONS))
    return out.reshape(q.shape)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                        sm_scale: Optional[float] = None) -> torch.Tensor:
    """Dense O(seq_len²) attention for checking :func:`flash_attention`: :func:`flexlite.attention_reference`
    in float64, rounded once to the input dtype. Same shapes, dtypes and errors as flash_attention."""
    _validate("reference_attention", q, k, v, sm_scale, causal=causal, kernels=False)
    q4 = _as_4d(q)
    block_mask = block_mask_for(q4, causal, None) if q.numel() else None  # (as flash_attention: differentiable)
    out, _ = attention_reference(q4, _as_4d(k), _as_4d(v), block_mask=block_mask,
                                 scale=None if sm_scale is None else float(sm_scale))
    return out.to(q.dtype).reshape(q.shape)
