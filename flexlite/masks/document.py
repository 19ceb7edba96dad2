"""Document masking for packed sequences: several documents concatenated into one sequence, each token
attending only within its own document, under any inner mask applied in document-local positions.

A layout is given by one of (documents of lengths 2, 3, 4):

* ``lengths``: ``[2, 3, 4]``;
* ``offsets``: ``[0, 2, 5, 9]`` (attention-gym's form: cumulative starts, then the total);
* ``document_id``: ``[0, 0, 1, 1, 1, 2, 2, 2, 2]`` (one id per token, ids 0, 1, 2, ... in order).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch

from ..block_mask import noop_mask
from ._checks import check_callable, check_device_arg, check_index_tensor, check_lengths
from .causal import causal_mask

Lengths = Union[Sequence[int], torch.Tensor]


def document_ids_from_lengths(lengths: Lengths, device=None) -> torch.Tensor:
    """[sum(lengths)] int32 document id per token, e.g. (2, 3) -> [0, 0, 1, 1, 1]; on ``device`` (default:
    that of ``lengths`` if it is a tensor, else CPU)."""
    if device is None and isinstance(lengths, torch.Tensor):
        device = lengths.device
    lengths = check_lengths("document_ids_from_lengths", "lengths", lengths, minimum=0)
    counts = torch.tensor(lengths, device=device)
    return torch.repeat_interleave(torch.arange(len(lengths), device=device, dtype=torch.int32), counts,
                                   output_size=sum(lengths))  # (the size known: a "meta" device takes it too)


def length_to_offsets(lengths: Lengths, device=None) -> torch.Tensor:
    """[len(lengths) + 1] int32 offsets, e.g. (2, 3) -> [0, 2, 5] (attention-gym's name)."""
    lengths = check_lengths("length_to_offsets", "lengths", lengths, minimum=0)
    return torch.tensor([0] + lengths, device=device, dtype=torch.int32).cumsum(0).to(torch.int32)


def offsets_to_document_ids(offsets: torch.Tensor) -> torch.Tensor:
    """[offsets[-1]] int32 document id per token, on ``offsets``' device, e.g. [0, 2, 5] -> [0, 0, 1, 1, 1]."""
    offsets = _check_offsets("offsets_to_document_ids", offsets)
    return document_ids_from_lengths(offsets.diff(), device=offsets.device)


def _check_offsets(caller: str, offsets) -> torch.Tensor:
    offsets = check_index_tensor(caller, "offsets", offsets, dim=1)
    values = offsets.tolist()
    if len(values) < 2 or values[0] != 0 or any(b < a for a, b in zip(values, values[1:])):
        raise ValueError(f"{caller}: offsets must start at 0 and be non-decreasing, with the total length last "
                         f"(e.g. [0, 2, 5] for documents of lengths 2 and 3); got {values[:16]}")
    return offsets


def _check_document_id(caller: str, document_id) -> torch.Tensor:
    document_id = check_index_tensor(caller, "document_id", document_id, dim=1)
    if document_id.numel() == 0:
        raise ValueError(f"{caller}: document_id must not be empty")
    steps = document_id.diff()
    bad = (steps < 0) | (steps > 1)
    if document_id[0].item() != 0 or bad.any():
        where = 0 if document_id[0].item() != 0 else int(bad.nonzero()[0]) + 1
        raise ValueError(
            f"{caller}: document_id must hold one id per token, 0, 1, 2, ... in order (packed documents); "
            f"got {document_id[max(0, where - 2):where + 3].tolist()} around position {where}. For offsets "
            f"[0, l0, l0 + l1, ...] (attention-gym's generate_doc_mask_mod) pass offsets=..., for lengths "
            f"lengths=...")
    return document_id


def _document_ids(caller: str, document_id, offsets, lengths, device) -> tuple:
    """(the document ids, on a device that holds values: ``device`` but for "meta", where they are on the CPU; the
    device they go to: ``device``, None for theirs)."""
    given = [name for name, v in (("document_id", document_id), ("offsets", offsets), ("lengths", lengths))
             if v is not None]
    if len(given) != 1:
        raise TypeError(f"{caller}: pass exactly one of document_id, offsets, lengths; got "
                        f"{', '.join(given) or 'none'}")
    device = check_device_arg(caller, device)
    if lengths is not None:
        ids = document_ids_from_lengths(lengths, device=None if device is not None and device.type == "meta"
                                        else device)
    elif offsets is not None:
        ids = offsets_to_document_ids(offsets)
    else:
        ids = _check_document_id(caller, document_id)
    if ids.numel() == 0:
        raise ValueError(f"{caller}: the documents have no tokens (total length 0); there is nothing to mask")
    return (ids if device is None or device.type == "meta" else ids.to(device)), device


def generate_doc_mask_mod(mask_mod: Callable, document_id: Optional[torch.Tensor] = None, *,
                          offsets: Optional[torch.Tensor] = None, lengths: Optional[Lengths] = None,
                          device=None) -> Callable:
    """Wrap ``mask_mod`` so it applies within each packed document, in positions relative to the
    document's start; tokens of different documents never attend to each other.

    Args:
        mask_mod: the inner mask, e.g. :func:`causal_mask` or :func:`flexlite.noop_mask`.
        document_id: [total_len] int, one document id per token (0, 1, 2, ... in order); or, keyword-only,
        offsets: [n_docs + 1] int, ``[0, l0, l0 + l1, ..., total_len]``; or
        lengths: n_docs ints.
        device: where the captured tensors live (default: that of ``document_id`` / ``offsets``; CPU for
            ``lengths``); it must be the device of the block mask and of the attention inputs.

    Named ``document_<inner name>``. The sequence length must be ``total_len``.
    """
    caller = "generate_doc_mask_mod"
    check_callable(caller, "mask_mod", mask_mod)
    document_id, device = _document_ids(caller, document_id, offsets, lengths, device)
    counts = torch.bincount(document_id.long())
    starts = (counts.cumsum(0) - counts).to(torch.int32)
    if device is not None:  # (the ids are there but on "meta", which holds no values to compute the starts from)
        document_id, starts = document_id.to(device), starts.to(device)

    def doc_mask(b, h, q_idx, kv_idx):
        same_doc = document_id[q_idx] == document_id[kv_idx]
        q_logical = q_idx - starts[document_id[q_idx]]
        kv_logical = kv_idx - starts[document_id[kv_idx]]
        return same_doc & mask_mod(b, h, q_logical, kv_logical)

    doc_mask.__name__ = f"document_{getattr(mask_mod, '__name__', 'mask')}"
    return doc_mask


def generate_causal_document_mask(lengths: Lengths, device=None) -> Callable:
    """Causal attention inside each packed document of the given lengths."""
    return generate_doc_mask_mod(causal_mask, lengths=lengths, device=device)


def generate_document_mask(lengths: Lengths, device=None) -> Callable:
    """Bidirectional attention inside each packed document of the given lengths."""
    return generate_doc_mask_mod(noop_mask, lengths=lengths, device=device)


def main(seq_len: int = 1024):
    from flexlite import create_block_mask
    mask = generate_causal_document_mask([seq_len // 4, seq_len // 2, seq_len - 3 * (seq_len // 4)])
    print(f"{mask.__name__}:\n{create_block_mask(mask, None, None, seq_len, seq_len, device='cpu')}")


if __name__ == "__main__":
    main()
