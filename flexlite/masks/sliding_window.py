"""Sliding-window masks: each query sees the last ``window_size`` keys (and, bidirectional, the next ones)."""

from ..block_mask import and_masks, check_bool
from ._checks import check_int
from .causal import causal_mask


def generate_sliding_window(window_size: int, causal: bool = True):
    """Causal: ``0 <= q_idx - kv_idx <= window_size``; bidirectional: ``|q_idx - kv_idx| <= window_size``.

    Named ``sliding_window_<w>`` (``..._bidirectional`` for the two-sided window).
    """
    window_size = check_int("generate_sliding_window", "window_size", window_size)
    causal = check_bool("generate_sliding_window", "causal", causal)

    def band(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= window_size

    sliding_window = and_masks(band, causal_mask) if causal else band
    sliding_window.__name__ = f"sliding_window_{window_size}" + ("" if causal else "_bidirectional")
    return sliding_window


def main(seq_len: int = 1024):
    from flexlite import create_block_mask
    for causal in (True, False):
        mask = generate_sliding_window(256, causal=causal)
        print(f"{mask.__name__}:\n{create_block_mask(mask, None, None, seq_len, seq_len, device='cpu')}")


if __name__ == "__main__":
    main()
