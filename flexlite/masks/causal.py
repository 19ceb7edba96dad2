"""Causal masks: each query sees itself and the past."""

from ._checks import check_int


def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def generate_causal_bottom_right(q_len: int, kv_len: int):
    """Causal for Lq != Lkv with the queries aligned to the end of the keys (KV-cache style):
    query ``i`` sees keys ``0 .. i + kv_len - q_len``."""
    q_len = check_int("generate_causal_bottom_right", "q_len", q_len, 1)
    kv_len = check_int("generate_causal_bottom_right", "kv_len", kv_len, 1)
    offset = kv_len - q_len

    def causal_bottom_right(b, h, q_idx, kv_idx):
        return q_idx + offset >= kv_idx

    causal_bottom_right.__name__ = f"causal_bottom_right_{offset}"
    return causal_bottom_right


def main(seq_len: int = 1024):
    from flexlite import create_block_mask
    print(create_block_mask(causal_mask, None, None, seq_len, seq_len, device="cpu"))
    print(create_block_mask(generate_causal_bottom_right(seq_len // 4, seq_len), None, None, seq_len // 4,
                            seq_len, device="cpu"))


if __name__ == "__main__":
    main()
