"""Document masking for packed sequences: tokens attend only within their own document."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .causal import causal_mask


def document_ids_from_lengths(lengths: Sequence[int] | torch.Tensor, device=None) -> torch.Tensor:
    """[sum(lengths)] int32 document id per token, e.g. (2, 3) -> [0, 0, 1, 1, 1]."""
    lengths = torch.as_tensor(lengths, device=device)
    if lengths.dim() != 1 or (lengths < 0).any():
        raise ValueError(f"lengths must be a 1-D sequence of non-negative ints; got {lengths.tolist()}")
    return torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device, dtype=torch.int32), lengths)


def generate_doc_mask_mod(mask_mod: Callable, document_id: torch.Tensor) -> Callable:
    """Wrap ``mask_mod`` so it applies within each document, with positions relative to the document
    start; ``document_id`` [total_len] gives each token's document (sorted, as in a packed batch)."""
    if not isinstance(document_id, torch.Tensor) or document_id.dim() != 1:
        raise TypeError("document_id must be a 1-D tensor of per-token document ids")
    counts = torch.bincount(document_id.long())
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)[:-1]]).to(torch.int32)

    def doc_mask(b, h, q_idx, kv_idx):
        same_doc = document_id[q_idx] == document_id[kv_idx]
        q_logical = q_idx - offsets[document_id[q_idx]]
        kv_logical = kv_idx - offsets[document_id[kv_idx]]
        return same_doc & mask_mod(b, h, q_logical, kv_logical)

    doc_mask.__name__ = f"document_{getattr(mask_mod, '__name__', 'mask')}"
    return doc_mask


def generate_causal_document_mask(lengths: Sequence[int], device=None) -> Callable:
    """Causal attention inside each packed document of the given lengths."""
    return generate_doc_mask_mod(causal_mask, document_ids_from_lengths(lengths, device=device))


def main(seq_len: int = 1024):
    from flexlite import create_block_mask
    mask = generate_causal_document_mask([seq_len // 4, seq_len // 2, seq_len // 4])
    print(create_block_mask(mask, None, None, seq_len, seq_len, device="cpu"))


if __name__ == "__main__":
    main()
