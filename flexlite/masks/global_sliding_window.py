"""Global tokens + sliding window (Longformer, BigBird; with ``causal=True`` the attention sinks of
StreamingLLM): the first ``num_global_tokens`` tokens attend to and are attended by every token, all
others attend within a sliding window."""

from ..block_mask import and_masks, check_bool, or_masks
from ._checks import check_int
from .causal import causal_mask
from .sliding_window import generate_sliding_window


def generate_global_sliding_window(window_size: int, num_global_tokens: int, causal: bool = False):
    """Keep ``|q_idx - kv_idx| <= window_size``, or ``kv_idx < num_global_tokens``, or
    ``q_idx < num_global_tokens``; with ``causal``, only where ``kv_idx <= q_idx`` as well.
    Named ``global_<g>_sliding_window_<w>`` (``_causal``)."""
    caller = "generate_global_sliding_window"
    window_size = check_int(caller, "window_size", window_size)
    num_global_tokens = check_int(caller, "num_global_tokens", num_global_tokens)
    causal = check_bool(caller, "causal", causal)

    def global_key(b, h, q_idx, kv_idx):
        return kv_idx < num_global_tokens

    def global_query(b, h, q_idx, kv_idx):
        return q_idx < num_global_tokens

    mask = or_masks(generate_sliding_window(window_size, causal=False), global_key, global_query)
    if causal:
        mask = and_masks(causal_mask, mask)
    mask.__name__ = f"global_{num_global_tokens}_sliding_window_{window_size}" + ("_causal" if causal else "")
    return mask


def main(seq_len: int = 1024):
    from flexlite import create_block_mask
    for causal in (False, True):
        mask = generate_global_sliding_window(128, 64, causal=causal)
        print(f"{mask.__name__}:\n{create_block_mask(mask, None, None, seq_len, seq_len, device='cpu', BLOCK_SIZE=64)}")


if __name__ == "__main__":
    main()
