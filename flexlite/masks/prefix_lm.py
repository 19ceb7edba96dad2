"""Prefix-LM: bidirectional attention over a prefix, causal after it."""

from ..block_mask import or_masks
from ._checks import check_int
from .causal import causal_mask


def generate_prefix_lm_mask(prefix_length: int):
    """Every query sees the first ``prefix_length`` keys and, causally, the rest. Named ``prefix_lm_<n>``."""
    prefix_length = check_int("generate_prefix_lm_mask", "prefix_length", prefix_length)

    def prefix(b, h, q_idx, kv_idx):
        return kv_idx < prefix_length

    prefix_lm = or_masks(prefix, causal_mask)
    prefix_lm.__name__ = f"prefix_lm_{prefix_length}"
    return prefix_lm


def main(seq_len: int = 1024):
    from flexlite import create_block_mask
    print(create_block_mask(generate_prefix_lm_mask(256), None, None, seq_len, seq_len, device="cpu"))


if __name__ == "__main__":
    main()
