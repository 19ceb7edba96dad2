"""Numerical checks of a matmul or attention function on random inputs: ``(ok, max_diff)``."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..reference import TOLERANCES

# (rtol, atol) per input dtype. Matmul: the output rounding (fp16 for fp16/fp32 inputs, bf16 for bf16)
# dominates. Attention: as flexlite's tests, which compare to the same fp64 reference.
MATMUL_TOLERANCES = {torch.float16: (1e-3, 1e-3), torch.float32: (1e-3, 1e-3), torch.bfloat16: (1e-2, 1e-2)}
ATTENTION_TOLERANCES = {dtype: (rtol, atol) for dtype, (atol, rtol) in TOLERANCES.items()}


def _device(device) -> torch.device:
    return torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")


def _tolerances(table: dict, dtype, rtol, atol) -> tuple[float, float]:
    if dtype not in table:
        raise TypeError(f"unsupported dtype {dtype}; use float16, bfloat16 or float32")
    default_rtol, default_atol = table[dtype]
    return (default_rtol if rtol is None else rtol), (default_atol if atol is None else atol)


def _compare(what: str, out, ref: torch.Tensor, rtol: float, atol: float, verbose: bool) -> tuple[bool, float]:
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(ref.shape):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        if verbose:
            print(f"{what}: FAIL, output {shape} but expected shape {tuple(ref.shape)}")
        return False, float("inf")
    diff = (out.detach().double().cpu() - ref).abs()
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
    max_diff = float(diff.max()) if diff.numel() else 0.0
    ok = bool((diff <= atol + rtol * ref.abs()).all())
    if verbose:
        print(f"{what}: {'PASS' if ok else 'FAIL'}, max |diff| {max_diff:.3g} (rtol {rtol}, atol {atol})")
    return ok, max_diff


def validate_matmul(triton_fn: Callable, m: int, n: int, k: int, rtol: Optional[float] = None,
                    atol: Optional[float] = None, dtype: torch.dtype = torch.float16, device=None,
                    verbose: bool = False) -> tuple[bool, float]:
    """Check ``triton_fn(a, b)`` for random a (m, k), b (k, n) against ``torch.matmul`` in float64.

    The inputs are standard normal values rounded to ``dtype`` — for float32, rounded through float16,
    so that a kernel that computes float32 inputs in float16 (as ``triton_matmul``) sees them exactly.
    ``ok``: every element satisfies ``|out - ref| <= atol + rtol * |ref|`` (no NaN); default tolerances
    per dtype in :data:`MATMUL_TOLERANCES`. ``device``: default CUDA if available, else CPU.
    Returns ``(ok, max_diff)``.
    """
    rtol, atol = _tolerances(MATMUL_TOLERANCES, dtype, rtol, atol)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    if dtype == torch.float32:
        a, b = a.half().float(), b.half().float()
    a, b = a.to(dtype), b.to(dtype)
    ref = a.double() @ b.double()
    dev = _device(device)
    out = triton_fn(a.to(dev), b.to(dev))
    return _compare(f"validate_matmul M={m} N={n} K={k} {dtype}", out, ref, rtol, atol, verbose)


def validate_attention(flash_fn: Callable, batch: int, heads: int, seq_len: int, head_dim: int,
                       causal: bool = False, rtol: Optional[float] = None, atol: Optional[float] = None,
                       dtype: torch.dtype = torch.float16, device=None, verbose: bool = False) -> tuple[bool, float]:
    """Check ``flash_fn(q, k, v, causal=causal)`` on random (batch, heads, seq_len, head_dim) inputs against
    flexlite's fp64 reference (:func:`flexlite.attention_reference`).

    ``ok`` as in :func:`validate_matmul`, default tolerances in :data:`ATTENTION_TOLERANCES`; ``device``:
    default CUDA if available, else CPU. Returns ``(ok, max_diff)``.
    """
    from ..kernels.attention import block_mask_for
    from ..reference import attention_reference

    rtol, atol = _tolerances(ATTENTION_TOLERANCES, dtype, rtol, atol)
    g = torch.Generator().manual_seed(0)
    dev = _device(device)
    q, k, v = (torch.randn(batch, heads, seq_len, head_dim, generator=g).to(dev, dtype) for _ in range(3))
    ref, _ = attention_reference(q, k, v, block_mask=block_mask_for(q, causal, None))
    out = flash_fn(q, k, v, causal=causal)
    what = f"validate_attention B={batch} H={heads} S={seq_len} D={head_dim} causal={causal} {dtype}"
    return _compare(what, out, ref.cpu(), rtol, atol, verbose)
