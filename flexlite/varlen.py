"""Packed variable-length batches (flash-attn's ``cu_seqlens`` style) on top of document masks.

A padded batch [B, H, Lmax, D] with per-sample lengths becomes one packed sequence [1, H, sum(L), D]
plus ``cu_seqlens`` = [0, L0, L0+L1, ...] (int32, B + 1 entries); :func:`varlen_block_mask` builds the
document mask over it, whose empty cross-document blocks are skipped, so attention over the packed batch
costs about what per-sample attention would.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch

from .block_mask import BlockMask, create_block_mask, noop_mask
from .masks.causal import causal_mask
from .masks.document import generate_doc_mask_mod, length_to_offsets


def _lengths(lengths: Union[Sequence[int], torch.Tensor], batch: int, max_len: int) -> list:
    values = lengths.tolist() if isinstance(lengths, torch.Tensor) else list(lengths)
    if len(values) != batch or any(not isinstance(n, int) or n < 0 or n > max_len for n in values):
        raise ValueError(f"lengths must be {batch} ints in [0, {max_len}] (one per sample); got {values}")
    return values


def pack(padded: torch.Tensor, lengths: Union[Sequence[int], torch.Tensor]) -> tuple:
    """[B, H, Lmax, D] + lengths -> (packed [1, H, sum(lengths), D], cu_seqlens int32 [B + 1])."""
    if not isinstance(padded, torch.Tensor) or padded.dim() != 4:
        raise ValueError("pack: padded must be a 4-D tensor [B, H, Lmax, D]")
    B, _, L, _ = padded.shape
    values = _lengths(lengths, B, L)
    packed = torch.cat([padded[b:b + 1, :, :n] for b, n in enumerate(values)], dim=2)
    return packed, length_to_offsets(values, device=padded.device)


def unpack(packed: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int) -> torch.Tensor:
    """(packed [1, H, total, D], cu_seqlens [B + 1], max_len) -> [B, H, max_len, D], zeros past each length."""
    if not isinstance(packed, torch.Tensor) or packed.dim() != 4 or packed.shape[0] != 1:
        raise ValueError("unpack: packed must be [1, H, total, D]")
    starts = cu_seqlens.tolist()
    if starts[0] != 0 or starts[-1] != packed.shape[2] or any(b < a for a, b in zip(starts, starts[1:])):
        raise ValueError(f"unpack: cu_seqlens must rise from 0 to the packed length {packed.shape[2]}; got {starts}")
    if max(b - a for a, b in zip(starts, starts[1:])) > max_len:
        raise ValueError(f"unpack: a sequence is longer than max_len={max_len}")
    out = packed.new_zeros((len(starts) - 1, packed.shape[1], max_len, packed.shape[3]))
    for i, (a, b) in enumerate(zip(starts, starts[1:])):
        out[i, :, :b - a] = packed[0, :, a:b]
    return out


def varlen_block_mask(cu_seqlens: torch.Tensor, causal: bool = True, H=None, BLOCK_SIZE=128,
                      device=None) -> BlockMask:
    """The BlockMask of a packed batch: attention within each sample (causal or not), nothing across."""
    device = cu_seqlens.device if device is None else device
    inner = causal_mask if causal else noop_mask
    mask_mod = generate_doc_mask_mod(inner, offsets=cu_seqlens.to(device))
    total = int(cu_seqlens[-1])
    return create_block_mask(mask_mod, None, H, total, total, device=device, BLOCK_SIZE=BLOCK_SIZE)
