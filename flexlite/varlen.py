"""Packed variable-length batches (flash-attn's ``cu_seqlens`` style) on top of document masks.

A padded batch [B, H, Lmax, D] with per-sample lengths becomes one packed sequence [1, H, sum(L), D]
plus ``cu_seqlens`` = [0, L0, L0+L1, ...] (int32, B + 1 entries); :func:`varlen_block_mask` builds the
document mask over it, whose empty cross-document blocks are skipped, so attention over the packed batch
costs about what per-sample attention would.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch

from .block_mask import BlockMask, _is_int, check_bool, check_device, create_block_mask, noop_mask
from .masks.causal import causal_mask
from .masks._checks import check_device_arg
from .masks.document import generate_doc_mask_mod


def _lengths(lengths: Union[Sequence[int], torch.Tensor], batch: int, max_len: int) -> list:
    if isinstance(lengths, torch.Tensor):
        if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
            raise TypeError(f"pack: lengths must be an integer tensor or a sequence of ints; got a {lengths.dtype} "
                            f"tensor")
        if lengths.dim() != 1:
            raise ValueError(f"pack: lengths must be 1-D (one length per sample); got shape {tuple(lengths.shape)}")
        values = lengths.tolist()
    elif isinstance(lengths, Sequence) and not isinstance(lengths, str) or hasattr(lengths, "tolist"):
        values = lengths.tolist() if hasattr(lengths, "tolist") else list(lengths)
    else:
        raise TypeError(f"pack: lengths must be a sequence of ints or an integer tensor (one per sample); got "
                        f"{type(lengths).__name__}")
    bad = [n for n in values if not _is_int(n)]
    if bad:
        raise TypeError(f"pack: lengths must be ints; got {bad[0]!r} ({type(bad[0]).__name__}) in {values}")
    if len(values) != batch or any(n < 0 or n > max_len for n in values):
        raise ValueError(f"pack: lengths must be {batch} ints in [0, {max_len}] (one per sample); got {values}")
    return [int(n) for n in values]


def _cu_seqlens(caller: str, cu_seqlens, name: str = "cu_seqlens") -> torch.Tensor:
    """``cu_seqlens`` (an integer tensor, a sequence of ints or an integer numpy array, as pack's lengths; the
    argument ``name``) as a 1-D integer tensor [0, ..., total]: at least one entry, starting at 0, never
    decreasing."""
    if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.device.type == "meta":
        raise ValueError(f"{caller}: {name} is a meta tensor, whose values are not there to read; pass it on the "
                         f"CPU or the GPU")
    if not isinstance(cu_seqlens, torch.Tensor):
        values = cu_seqlens.tolist() if hasattr(cu_seqlens, "tolist") else cu_seqlens  # (numpy arrays)
        if not (isinstance(values, Sequence) and not isinstance(values, str) and all(_is_int(x) for x in values)):
            raise TypeError(f"{caller}: {name} must be an int32 tensor [0, L0, L0 + L1, ...] (or a list of ints); "
                            f"got {type(cu_seqlens).__name__} {cu_seqlens!r}")
        cu_seqlens = torch.tensor(list(values), dtype=torch.int32)
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex or cu_seqlens.dtype == torch.bool:
        raise TypeError(f"{caller}: {name} must be an integer (int32) tensor; got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() == 0:
        raise ValueError(f"{caller}: {name} must be 1-D with batch + 1 entries [0, L0, L0 + L1, ...]; got shape "
                         f"{tuple(cu_seqlens.shape)}")
    starts = cu_seqlens.tolist()
    if starts[0] != 0 or any(b < a for a, b in zip(starts, starts[1:])):
        raise ValueError(f"{caller}: {name} must rise from 0 (start at 0, never decrease: [0, L0, L0 + L1, "
                         f"...]); got {starts[:16]}")
    return cu_seqlens


def pack(padded: torch.Tensor, lengths: Union[Sequence[int], torch.Tensor]) -> tuple:
    """[B, H, Lmax, D] + lengths -> (packed [1, H, sum(lengths), D], cu_seqlens int32 [B + 1])."""
    if not isinstance(padded, torch.Tensor) or padded.dim() != 4:
        raise ValueError("pack: padded must be a 4-D tensor [B, H, Lmax, D]")
    B, H, L, D = padded.shape
    values = _lengths(lengths, B, L)
    cu_seqlens = torch.tensor([0] + values, dtype=torch.int32, device=padded.device).cumsum(0).to(torch.int32)
    if B == 0:  # (a view of padded, so that autograd reaches it as through the slices below)
        return padded[:, :, :0].reshape(1, H, 0, D), cu_seqlens
    packed = torch.cat([padded[b:b + 1, :, :n] for b, n in enumerate(values)], dim=2)
    return packed, cu_seqlens


def unpack(packed: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int) -> torch.Tensor:
    """(packed [1, H, total, D], cu_seqlens [B + 1], max_len) -> [B, H, max_len, D], zeros past each length."""
    if not isinstance(packed, torch.Tensor) or packed.dim() != 4 or packed.shape[0] != 1:
        raise ValueError("unpack: packed must be [1, H, total, D]")
    if not _is_int(max_len):
        raise TypeError(f"unpack: max_len must be an int; got {type(max_len).__name__} {max_len!r}")
    if max_len < 0:
        raise ValueError(f"unpack: max_len must be >= 0; got {max_len}")
    starts = _cu_seqlens("unpack", cu_seqlens).tolist()
    if starts[-1] != packed.shape[2]:
        raise ValueError(f"unpack: cu_seqlens must rise from 0 to the packed length {packed.shape[2]}; got {starts}")
    longest = max((b - a for a, b in zip(starts, starts[1:])), default=0)
    if longest > max_len:
        raise ValueError(f"unpack: a sequence is longer than max_len={max_len} (the longest has {longest} tokens)")
    out = packed.new_zeros((len(starts) - 1, packed.shape[1], max_len, packed.shape[3]))
    for i, (a, b) in enumerate(zip(starts, starts[1:])):
        out[i, :, :b - a] = packed[0, :, a:b]
    return out


def varlen_block_mask(cu_seqlens: torch.Tensor, causal: bool = True, H=None, BLOCK_SIZE=128,
                      device=None, cu_seqlens_k=None) -> BlockMask:
    """The BlockMask of a packed batch: attention within each sample (causal or not), nothing across.

    ``cu_seqlens_k``: the keys packed by their own lengths (flash-attn's ``cu_seqlens_k``: a query chunk over a longer
    KV cache, chunked prefill, packed cross-attention), one sample per entry as ``cu_seqlens``; the mask is then
    [sum(Lq), sum(Lk)] and causal is aligned to the bottom right within each sample, as flash-attn's: query i of a
    sample with Lq queries and Lk keys sees its keys 0 .. i + Lk - Lq (a sample with no keys leaves its queries' rows
    empty: out 0). None: the queries' packing."""
    caller = "varlen_block_mask"
    cu_seqlens = _cu_seqlens(caller, cu_seqlens)
    causal = check_bool(caller, "causal", causal)
    total = int(cu_seqlens[-1])
    if total == 0:
        raise ValueError(f"{caller}: cu_seqlens {cu_seqlens.tolist()} has no tokens (total length 0); "
                         f"there is nothing to attend to")
    if device is not None:
        device = check_device_arg(caller, device)  # (an int: GPU N; "meta" passes here, as torch's factories take it)
        if device.type == "meta":
            raise ValueError(f"{caller}: device is meta, but a meta device cannot hold a block mask built from lengths "
                             f"(its block lists are computed from cu_seqlens' values); use a real device such as "
                             f"'cpu' or 'cuda'")
    device = cu_seqlens.device if device is None else check_device(caller, device)  # (create_block_mask's rules)
    if cu_seqlens_k is None:
        inner = causal_mask if causal else noop_mask
        mask_mod = generate_doc_mask_mod(inner, offsets=cu_seqlens.to(device))
        return create_block_mask(mask_mod, None, H, total, total, device=device, BLOCK_SIZE=BLOCK_SIZE)
    cu_seqlens_k = _cu_seqlens(caller, cu_seqlens_k, "cu_seqlens_k")
    if cu_seqlens_k.numel() != cu_seqlens.numel():
        raise ValueError(f"{caller}: cu_seqlens_k must have one entry per sample as cu_seqlens ({cu_seqlens.numel()} "
                         f"entries); got {cu_seqlens_k.numel()}")
    total_k = int(cu_seqlens_k[-1])
    if total_k == 0:
        raise ValueError(f"{caller}: cu_seqlens_k {cu_seqlens_k.tolist()} has no keys (total length 0); there is "
                         f"nothing to attend to")
    q_doc, q_start = _positions(cu_seqlens, total)
    kv_doc, _ = _positions(cu_seqlens_k, total_k)
    # the last key (packed) that each query sees: its sample's first key + its own offset + Lk - Lq
    starts_q, starts_k = cu_seqlens.cpu().long(), cu_seqlens_k.cpu().long()
    last_kv = starts_k[q_doc] + (torch.arange(total) - q_start) + (starts_k.diff() - starts_q.diff())[q_doc]
    q_doc, kv_doc, last_kv = (t.to(device=device, dtype=torch.int32) for t in (q_doc, kv_doc, last_kv))

    def packed_mask(b, h, q_idx, kv_idx):
        same = q_doc[q_idx] == kv_doc[kv_idx]
        return same & (kv_idx <= last_kv[q_idx]) if causal else same

    return create_block_mask(packed_mask, None, H, total, total_k, device=device, BLOCK_SIZE=BLOCK_SIZE)


def _positions(cu_seqlens: torch.Tensor, total: int) -> tuple:
    """Per packed position: its sample (int64 [total]) and its sample's first packed position (in that packing)."""
    starts = cu_seqlens.cpu().long()
    doc = torch.bucketize(torch.arange(total), starts[1:], right=True)
    return doc, starts[doc]
