"""Dilated sliding window: a sliding window that keeps only every ``dilation``-th key."""

from ..block_mask import and_masks
from ._checks import check_int
from .sliding_window import generate_sliding_window


def generate_dilated_sliding_window(window_size: int, dilation: int, causal: bool = False):
    """Keep ``|q_idx - kv_idx| <= window_size`` and ``(q_idx - kv_idx) % dilation == 0`` (and, if
    ``causal``, ``kv_idx <= q_idx``). Named ``dilated_sliding_window_<w>_dilation_<d>``."""
    caller = "generate_dilated_sliding_window"
    window_size = check_int(caller, "window_size", window_size)
    dilation = check_int(caller, "dilation", dilation, 1)

    def dilated(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx) % dilation == 0

    mask = and_masks(generate_sliding_window(window_size, causal=causal), dilated)
    mask.__name__ = f"dilated_sliding_window_{window_size}_dilation_{dilation}" + ("_causal" if causal else "")
    return mask


def main(seq_len: int = 1024):
    from flexlite import create_block_mask
    mask = generate_dilated_sliding_window(256, 4)
    print(f"{mask.__name__}:\n{create_block_mask(mask, None, None, seq_len, seq_len, device='cpu', BLOCK_SIZE=32)}")


if __name__ == "__main__":
    main()
