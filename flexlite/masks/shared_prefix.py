"""Shared prefix: several sequences that continue one common prefix, packed as
``[prefix | suffix_0 | suffix_1 | ...]`` (parallel sampling, tree / beam decoding, multiple answers to
one prompt). Attention is causal; a suffix token sees the whole prefix and its own suffix, never another
suffix, so the prefix is computed once instead of once per sequence."""

from __future__ import annotations

from typing import Sequence

from ..block_mask import and_masks, noop_mask, or_masks
from ._checks import check_int, check_lengths
from .causal import causal_mask
from .document import generate_doc_mask_mod


def generate_shared_prefix_mask(prefix_length: int, suffix_lengths: Sequence[int], device=None):
    """Causal mask over ``prefix_length + sum(suffix_lengths)`` tokens where suffix tokens see the prefix
    and their own suffix only. ``device``: where the captured document ids live.
    Named ``shared_prefix_<p>_<n>_suffixes``."""
    caller = "generate_shared_prefix_mask"
    prefix_length = check_int(caller, "prefix_length", prefix_length)
    suffix_lengths = check_lengths(caller, "suffix_lengths", suffix_lengths, minimum=0)

    def in_prefix(b, h, q_idx, kv_idx):
        return kv_idx < prefix_length

    same_sequence = generate_doc_mask_mod(noop_mask, lengths=[prefix_length] + suffix_lengths, device=device)
    mask = and_masks(causal_mask, or_masks(in_prefix, same_sequence))
    mask.__name__ = f"shared_prefix_{prefix_length}_{len(suffix_lengths)}_suffixes"
    return mask


def main(seq_len: int = 1024):
    from flexlite import create_block_mask
    prefix = seq_len // 4
    third = (seq_len - prefix) // 3
    mask = generate_shared_prefix_mask(prefix, [third, third, seq_len - prefix - 2 * third])
    print(f"{mask.__name__}:\n{create_block_mask(mask, None, None, seq_len, seq_len, device='cpu', BLOCK_SIZE=64)}")


if __name__ == "__main__":
    main()
