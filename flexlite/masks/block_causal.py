"""Block-causal masks (block diffusion, BD3-LM https://arxiv.org/abs/2503.09573; also chunked prefill):
tokens are grouped in blocks of ``block_size``; a token sees every token of its own block and of earlier
blocks."""

import torch

from ._checks import check_int


def generate_block_causal_mask(block_size: int):
    """Keep ``q_idx // block_size >= kv_idx // block_size``. Named ``block_causal_<block_size>``."""
    block_size = check_int("generate_block_causal_mask", "block_size", block_size, 1)

    def block_causal(b, h, q_idx, kv_idx):
        return q_idx // block_size >= kv_idx // block_size

    block_causal.__name__ = f"block_causal_{block_size}"
    return block_causal


def generate_block_diffusion_mask(seq_len: int, block_size: int):
    """BD3-LM's training mask over ``[x_t | x_0]`` (length ``2 * seq_len``: the noised sequence, then the clean
    one), with blocks of ``block_size`` counted within each half (arguments in attention-gym's order):

    * block diagonal: a token sees its own block in its own half;
    * offset block causal: an ``x_t`` token sees the ``x_0`` blocks before its block;
    * block causal: an ``x_0`` token sees the ``x_0`` blocks up to its own.

    Named ``block_diffusion_<block_size>_<seq_len>``.
    """
    caller = "generate_block_diffusion_mask"
    seq_len = check_int(caller, "seq_len", seq_len, 1)
    block_size = check_int(caller, "block_size", block_size, 1)

    def block_diffusion(b, h, q_idx, kv_idx):
        q_clean, kv_clean = q_idx >= seq_len, kv_idx >= seq_len
        q_block = torch.where(q_clean, q_idx - seq_len, q_idx) // block_size
        kv_block = torch.where(kv_clean, kv_idx - seq_len, kv_idx) // block_size
        block_diagonal = (q_block == kv_block) & (q_clean == kv_clean)
        offset_block_causal = (q_block > kv_block) & kv_clean & ~q_clean
        block_causal = (q_block >= kv_block) & kv_clean & q_clean
        return block_diagonal | offset_block_causal | block_causal

    block_diffusion.__name__ = f"block_diffusion_{block_size}_{seq_len}"
    return block_diffusion


def main(seq_len: int = 1024):
    from flexlite import create_block_mask
    mask = generate_block_causal_mask(128)
    print(f"{mask.__name__}:\n{create_block_mask(mask, None, None, seq_len, seq_len, device='cpu', BLOCK_SIZE=64)}")
    mask = generate_block_diffusion_mask(seq_len // 2, 128)
    print(f"{mask.__name__}:\n{create_block_mask(mask, None, None, seq_len, seq_len, device='cpu', BLOCK_SIZE=64)}")


if __name__ == "__main__":
    main()
