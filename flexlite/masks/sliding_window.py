"""Sliding-window masks: each query sees the last ``window`` keys (and, bidirectional, the next ones)."""

from .causal import causal_mask


def generate_sliding_window(window_size: int, causal: bool = True):
    """Causal: ``0 <= q - kv <= window_size``; bidirectional: ``|q - kv| <= window_size``."""
    if causal:
        def sliding_window(b, h, q_idx, kv_idx):
            return causal_mask(b, h, q_idx, kv_idx) & (q_idx - kv_idx <= window_size)
    else:
        def sliding_window(b, h, q_idx, kv_idx):
            return (q_idx - kv_idx).abs() <= window_size
    sliding_window.__name__ = f"sliding_window_{window_size}" + ("" if causal else "_bidirectional")
    return sliding_window


def main(seq_len: int = 1024):
    from flexlite import create_block_mask
    print(create_block_mask(generate_sliding_window(256), None, None, seq_len, seq_len, device="cpu"))


if __name__ == "__main__":
    main()
