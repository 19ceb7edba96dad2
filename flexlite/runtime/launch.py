"""Grids, strides, tile configs and launches. Knows nothing about mods: a kernel module and the
runtime values of its captured-tensor parameters come in from the codegen pipeline."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton

from .compile import interpreter_scope

# kernel_options keys of torch's FlexAttention that only tune performance there; accepted, no effect
TORCH_PERF_HINTS = frozenset({
    "PRESCALE_QK", "ROWS_GUARANTEED_SAFE", "BLOCKS_ARE_CONTIGUOUS", "OUTPUT_LOGSUMEXP", "OUTPUT_MAX",
    "FORCE_USE_FLEX_ATTENTION", "USE_TMA", "WRITE_DQ", "BACKEND", "fwd_num_warps", "fwd_num_stages"})
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")


@dataclasses.dataclass(frozen=True)
class TileConfig:
    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int


def _pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two <= cap that divides n."""
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


def head_dim_pad(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def forward_config(q: torch.Tensor, v: torch.Tensor, sparse_block: tuple, kernel_options: dict) -> TileConfig:
    """Tile sizes: heuristic defaults per head dim, dtype and device, then ``kernel_options`` pins."""
    d = max(head_dim_pad(q.shape[-1]), head_dim_pad(v.shape[-1]))
    if q.device.type != "cuda":
        # the interpreter's cost is per op, not per element: big tiles, but not far past the length
        cap_m = max(16, triton.next_power_of_2(q.shape[-2]))
        cap_n = max(16, triton.next_power_of_2(v.shape[-2]))
        bm, bn, warps, stages = min(128, cap_m), min(128, cap_n), 4, 1
    elif d <= 64:
        bm, bn, warps, stages = 128, 128, 4, 3
    elif d <= 128:
        bm, bn, warps, stages = 128, 64, 4, 3
    else:
        bm, bn, warps, stages = 64, 32, 4, 2
    if q.dtype == torch.float32 and q.device.type == "cuda":
        bn = max(16, bn // 2)
    bm = _pow2_divisor(sparse_block[0], bm)
    bn = _pow2_divisor(sparse_block[1], bn)
    cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
    for key in CONFIG_KEYS:
        if key in kernel_options:
            cfg[key] = kernel_options[key]
    for key, sparse in (("BLOCK_M", sparse_block[0]), ("BLOCK_N", sparse_block[1])):
        value = cfg[key]
        if not isinstance(value, int) or value < 16 or value & (value - 1) or sparse % value:
            raise ValueError(f"kernel_options[{key!r}]={value!r}: must be a power of two >= 16 that divides the "
                             f"block mask's BLOCK_SIZE {sparse}")
    return TileConfig(**cfg)


def _mask_strides(t: torch.Tensor) -> tuple:
    """Strides of a [ZM, HM, n, ...] block-mask tensor, 0 along broadcast (size-1) batch/head dims."""
    return tuple(0 if t.shape[i] == 1 else t.stride(i) for i in range(3))


def launch_forward(module, mod_args: list, q, k, v, kv_num_blocks, kv_indices,
                   full_kv_num_blocks: Optional[torch.Tensor], full_kv_indices: Optional[torch.Tensor],
                   sparse_block: tuple, scale: float, has_score_mod: bool, config: TileConfig):
    """Run ``module.flex_fwd_kernel``; returns out [B, Hq, Lq, Dv] (q.dtype) and lse [B, Hq, Lq] fp32."""
    B, Hq, Lq, D = q.shape
    Hkv, Lkv, Dv = k.shape[1], k.shape[2], v.shape[-1]
    out = torch.empty((B, Hq, Lq, Dv), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, Lq), dtype=torch.float32, device=q.device)
    kv_indices = kv_indices.contiguous()
    has_full = full_kv_num_blocks is not None
    if has_full:
        full_kv_num_blocks = full_kv_num_blocks.contiguous()
        full_kv_indices = full_kv_indices.contiguous()
    else:
        full_kv_num_blocks, full_kv_indices = kv_num_blocks, kv_indices
    kv_num_blocks = kv_num_blocks.contiguous()
    allow_tf32 = q.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32
    grid = (triton.cdiv(Lq, config.BLOCK_M), B * Hq)
    with interpreter_scope(q.device.type != "cuda"):
        module.flex_fwd_kernel[grid](
            q, k, v, out, lse, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(),
            *_mask_strides(kv_num_blocks), *_mask_strides(kv_indices),
            Hq, Hq // Hkv, Lq, Lkv, float(scale),
            *mod_args,
            BLOCK_M=config.BLOCK_M, BLOCK_N=config.BLOCK_N,
            SPARSE_Q_BLOCK=sparse_block[0], SPARSE_KV_BLOCK=sparse_block[1],
            D=D, DV=Dv, D_PAD=head_dim_pad(D), DV_PAD=head_dim_pad(Dv),
            EVEN_M=Lq % config.BLOCK_M == 0, EVEN_N=Lkv % config.BLOCK_N == 0, HAS_FULL_BLOCKS=has_full,
            HAS_SCORE_MOD=has_score_mod, FP32_PRECISION="tf32" if allow_tf32 else "ieee",
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
    return out, lse
