"""exp2 on the FMA pipes: a polynomial that the warp-specialized forward can compute one of every N of P's
exponentials with (launch.WS_FWD_POLY_EXP2), the others on the SFU (``ex2.approx.ftz.f32``, as ``gl.exp2``).

At D64 the softcap forward asks the SFU for two results per score (tanh, exp2) against one score's worth of matmul
per SFU result (benchmarks/NOTES.md 70). FA4 moves part of the exponentials to the FMA pipes this way; on an H100 it
made that forward no faster (NOTES 71), so the setting is off. The polynomial: x clamped below at -127 (NaN kept),
rounded to an integer j by adding 1.5 * 2**23 (j lands in the low mantissa bits), 2 ** (x - j) by a degree-3
polynomial, times 2 ** j built in the exponent bits.
"""

from __future__ import annotations

import functools
import struct

import torch

# 2 ** f on [-0.5, 0.5] as 1 + f * (C1 + f * (C2 + f * C3)): minimax in relative error with p(0) = 1 exactly,
# 1.0e-4 at most in fp32 (bf16's P is 2 ** -9 apart)
C1, C2, C3 = 0.6932829022407532, 0.2422105371952057, 0.05500870570540428
MAGIC = 12582912.0  # 1.5 * 2 ** 23: x + MAGIC holds round(x) in its low mantissa bits
FLOOR = -127.0  # x at or below (-inf too) gives 0: 2 ** -127's exponent bits are 0
ONE_BITS = 0x3F800000  # 1.0's bits: (j << 23) + ONE_BITS are 2 ** j's


def _ptx_float(value: float) -> str:
    return "0f%08X" % struct.unpack("<I", struct.pack("<f", value))[0]


def poly_exp2_asm(one_in: int) -> str:
    """PTX for ``gl.inline_asm_elementwise(..., pack=one_in)`` (outputs $0.., inputs after them, 32-bit registers):
    the first ``one_in - 1`` values by ``ex2.approx.ftz.f32``, the last by the polynomial."""
    if one_in < 2 or one_in & (one_in - 1):
        raise ValueError(f"one_in must be a power of two of at least 2 (one exponential in one_in on the FMA pipes); "
                         f"got {one_in!r}")
    sfu = [f"ex2.approx.ftz.f32 ${i}, ${one_in + i};" for i in range(one_in - 1)]
    last_in, last_out = f"${2 * one_in - 1}", f"${one_in - 1}"
    magic, c1, c2, c3, one = (_ptx_float(v) for v in (MAGIC, C1, C2, C3, 1.0))
    return " ".join(["{", ".reg .f32 x, t, r, f, p, s;", ".reg .b32 tb;", *sfu,
                     f"max.NaN.f32 x, {last_in}, {_ptx_float(FLOOR)};",
                     f"add.rn.f32 t, x, {magic};",  # round(x) in t's low bits
                     f"sub.rn.f32 r, t, {magic};",
                     "sub.rn.f32 f, x, r;",  # x - round(x), in [-0.5, 0.5]
                     f"fma.rn.f32 p, f, {c3}, {c2};",
                     f"fma.rn.f32 p, p, f, {c1};",
                     f"fma.rn.f32 p, p, f, {one};",
                     "shl.b32 tb, t, 23;",  # round(x) << 23 (t's own exponent bits shift out)
                     f"add.s32 tb, tb, {ONE_BITS};",  # 2 ** round(x): 0.0 at -127
                     "mov.b32 s, tb;",
                     f"mul.rn.f32 {last_out}, p, s;",  # (NaN stays NaN)
                     "}"])


def poly_exp2_constraints(one_in: int) -> str:
    return ",".join(["=r"] * one_in + ["r"] * one_in)


def poly_exp2_reference(x: torch.Tensor) -> torch.Tensor:
    """What the polynomial lane of :func:`poly_exp2_asm` computes, step for step in fp32 on torch (the FMAs rounded
    twice here; x: float32, at most 0 in the kernels): for the tests."""
    fp32 = functools.partial(torch.tensor, dtype=torch.float32)
    x = torch.where(torch.isnan(x), x, torch.clamp(x, min=FLOOR))
    t = x + fp32(MAGIC)
    f = x - (t - fp32(MAGIC))
    p = ((f * fp32(C3) + fp32(C2)) * f + fp32(C1)) * f + fp32(1.0)
    # (t's bits << 23) + 1.0's bits in 32-bit two's complement, as shl.b32 and add.s32 wrap
    bits = ((t.view(torch.int32).to(torch.int64) << 23) + ONE_BITS) % 2 ** 32
    scale = torch.where(bits >= 2 ** 31, bits - 2 ** 32, bits).to(torch.int32).view(torch.float32)
    return p * scale
