"""Launch of the generated block-mask kernel (templates/block_mask.py.jinja)."""

from __future__ import annotations

import torch

from .compile import interpreter_scope
from .launch import _launch, _pow2_divisor, cdiv, scalars_to

# CUDA: largest tile edge (a block is evaluated tile by tile) and warps per program
MASK_TILES = dict(cap=32, num_warps=4)


def launch_block_mask(module, mod_args: list, B: int, H: int, Q_LEN: int, KV_LEN: int, block_size: tuple,
                      device: torch.device) -> tuple:
    """(any, all): bool [B, H, nQ, nKV] — whether the mask is True at any / at all in-range positions of
    each block. Memory: two int8 flags per block. Inside ``launch.compile_only`` it compiles and runs nothing (the
    flags then mean nothing)."""
    n_q, n_kv = cdiv(Q_LEN, block_size[0]), cdiv(KV_LEN, block_size[1])
    any_flags = torch.empty((B, H, n_q, n_kv), dtype=torch.int8, device=device)
    all_flags = torch.empty_like(any_flags)
    # one program per block; on a GPU the tile size keeps registers modest, the interpreter wants few steps
    cap = MASK_TILES["cap"] if device.type == "cuda" else max(block_size)
    tile_m, tile_n = _pow2_divisor(block_size[0], cap), _pow2_divisor(block_size[1], cap)
    with interpreter_scope(device.type != "cuda"):
        _launch(module.flex_block_mask_kernel, (n_q, n_kv, B * H),
                (any_flags, all_flags, H, Q_LEN, KV_LEN, *scalars_to(mod_args, device)),
                dict(SPARSE_Q=block_size[0], SPARSE_KV=block_size[1], TILE_M=tile_m, TILE_N=tile_n,
                     EVEN_Q=Q_LEN % block_size[0] == 0, EVEN_KV=KV_LEN % block_size[1] == 0,
                     num_warps=MASK_TILES["num_warps"] if device.type == "cuda" else 4))
    return any_flags.bool(), all_flags.bool()
