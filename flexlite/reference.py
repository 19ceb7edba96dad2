"""Dense fp64 attention with mods applied through vmap: THE reference for tests, examples, benchmarks.

Semantics (the same as torch's FlexAttention and as flexlite's kernels):

* ``score = (q @ k^T) * scale``, then ``score_mod(score, b, h, q_idx, kv_idx)``;
* a position is kept if its block is a *full* block of ``block_mask``, or its block is a *partial*
  block and ``block_mask.mask_mod(b, h, q_idx, kv_idx)`` is True; everything else is -inf;
* softmax over kv; a query row with nothing kept gives output 0 and LSE -inf (never NaN);
* gradients flow from the kept positions alone (with autograd recording, score_mod runs on those only: a mod whose
  derivative is infinite at a masked position, sqrt at 0, leaves no NaN behind, as in the kernels);
* the LSE is in natural log.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from ._vmap import index_vectors, vmap_bhqkv, vmap_positions
from .block_mask import from_torch_block_mask, is_torch_block_mask

# (atol, rtol) of flexlite's output against this reference, per input dtype: the tests' policy and the
# default of flexlite.utils.validate_attention (fp32 accumulation; P rounded to the input dtype)
TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (2.5e-2, 2.5e-2),
}


def _expand_blocks(blocks: torch.Tensor, block_size: tuple[int, int], q_len: int, kv_len: int) -> torch.Tensor:
    """[B, H, nQ, nKV] block flags -> [B, H, Q_LEN, KV_LEN] element flags."""
    return (blocks.repeat_interleave(block_size[0], dim=-2)
                  .repeat_interleave(block_size[1], dim=-1)[..., :q_len, :kv_len])


def reference_mask(block_mask, B: int, H: int, device) -> torch.Tensor:
    """Dense bool [B, H, Q_LEN, KV_LEN] of the positions ``block_mask`` keeps (kernel semantics); a torch BlockMask
    as flex_attention takes it."""
    if is_torch_block_mask(block_mask):
        block_mask = from_torch_block_mask(block_mask)
    q_len, kv_len = block_mask.seq_lengths
    full = torch.zeros(block_mask.kv_num_blocks.shape + (block_mask.kv_indices.shape[-1],),
                       dtype=torch.bool, device=device)
    partial = block_mask.dense_blocks(full=False).to(device)
    if block_mask.full_kv_num_blocks is not None:
        full = block_mask.dense_blocks(full=True).to(device)
    keep = _expand_blocks(full, block_mask.BLOCK_SIZE, q_len, kv_len)
    partial = _expand_blocks(partial, block_mask.BLOCK_SIZE, q_len, kv_len)
    if block_mask.mask_mod is not None:
        # the kernels call mask_mod with the real (b, h) even where the block structure broadcasts
        mask = vmap_bhqkv(block_mask.mask_mod)(*index_vectors(B, H, q_len, kv_len, device))
        partial = partial & mask.to(torch.bool)
    return keep | partial


def _check_inputs(query, key, value) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"attention_reference: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"attention_reference: {name} must be 4-D (batch, heads, seq_len, head_dim); got shape "
                             f"{tuple(t.shape)}")
    (B, Hq, _, E), (Bk, Hkv, Lkv, Ek), (Bv, Hv, Lv, _) = query.shape, key.shape, value.shape
    if not (B == Bk == Bv or Bk == Bv == 1) or Hkv != Hv or Lkv != Lv or E != Ek:
        raise ValueError(f"attention_reference: shapes do not fit: query {tuple(query.shape)}, key {tuple(key.shape)}, "
                         f"value {tuple(value.shape)} (batch must match, or be 1 for key and value; key and value "
                         f"must agree on heads and length, query and key on head_dim)")
    if Hq != Hkv and (Hkv == 0 or Hq % Hkv):
        raise ValueError(f"attention_reference: query heads ({Hq}) must be a multiple of key/value heads ({Hkv})")


def attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    score_mod: Optional[Callable] = None,
    block_mask=None,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    dtype: torch.dtype = torch.float64,
    return_max: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Dense attention in fp64 (``dtype``: compute in another dtype instead, e.g. bfloat16 for the
    error an eager low-precision implementation makes, the baseline of docs/NUMERICS.md).

    Args:
        query: [B, Hq, Lq, E]; key: [B, Hkv, Lkv, E]; value: [B, Hkv, Lkv, Ev] (key and value may have batch 1).
        score_mod, block_mask, scale, enable_gqa: as in :func:`flexlite.flex_attention`.

    Returns:
        ``(out, lse)``: out [B, Hq, Lq, Ev], lse [B, Hq, Lq] (natural log), in ``dtype``; with ``return_max``
        also each row's largest score after score_mod and masking [B, Hq, Lq] (-inf where all is masked; NaN in a
        row with a NaN score, where the kernels' may give the largest of its other scores), as flex_attention's
        ``return_aux=AuxRequest(max_scores=True)``.
        Differentiable: gradients flow back to the inputs and to tensors captured by score_mod.
    """
    _check_inputs(query, key, value)
    B, Hq, Lq, E = query.shape
    Hkv, Lkv = key.shape[1], key.shape[2]
    q, k, v = query.to(dtype), key.to(dtype), value.to(dtype)
    k, v = k.expand(B, *k.shape[1:]), v.expand(B, *v.shape[1:])  # key / value of batch 1: shared by every batch
    if Hq != Hkv:
        if not enable_gqa:
            raise ValueError(f"attention_reference: Hq={Hq} != Hkv={Hkv}; pass enable_gqa=True")
        k = k.repeat_interleave(Hq // Hkv, dim=1)
        v = v.repeat_interleave(Hq // Hkv, dim=1)
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    keep = None if block_mask is None else reference_mask(block_mask, B, Hq, q.device).expand(B, Hq, Lq, Lkv)
    if score_mod is not None and keep is not None and torch.is_grad_enabled():
        # score_mod at the kept positions alone, as the kernels: its gradient at a masked one (0 times a derivative
        # that may be infinite there, e.g. sqrt's at 0) would be NaN and reach q, k and captured tensors
        kept = keep.nonzero(as_tuple=True)
        # (a mask that keeps nothing: no score for score_mod, and torch.vmap takes no empty batch)
        modded = (vmap_positions(score_mod)(scores[kept], *(i.to(torch.int32) for i in kept)) if kept[0].numel()
                  else scores[kept])
        scores = scores.new_full(scores.shape, float("-inf")).index_put(kept, modded.to(dtype))
    else:
        if score_mod is not None and scores.numel():  # (no scores: torch.vmap takes no empty dimension)
            scores = vmap_bhqkv(score_mod, prefix=(0,))(scores, *index_vectors(B, Hq, Lq, Lkv, q.device))
            scores = scores.to(dtype)
        if keep is not None:
            scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    # [Note] fully masked rows: lse is -inf there; subtract 0 instead so p is 0, not NaN. (Only -inf: a row
    # whose lse is +inf or NaN has an infinite or NaN score, and gives NaN, as in torch's SDPA.)
    safe_lse = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(scores - safe_lse.unsqueeze(-1))
    if return_max:
        return p @ v, lse, scores.amax(dim=-1)
    return p @ v, lse
