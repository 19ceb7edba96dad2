"""What ptxas makes of the packed (two-value) SFU instructions on Hopper, offline (no GPU): each of
``ex2.approx.f16x2``, ``ex2.approx.ftz.bf16x2``, ``tanh.approx.f16x2`` and ``tanh.approx.bf16x2`` against its f32
form, in a kernel where every thread computes ``PAIRS`` pairs; the SASS MUFU ops per thread (NOTES 58).

If a packed instruction were one MUFU op, the softmax's exponentials (and softcap's tanh) would cost half the SFU
issue slots; ptxas splits it into two (``MUFU.EX2.F16`` on each half), so the packing only adds conversions.

Usage: python benchmarks/sfu_packed.py"""

from __future__ import annotations

import collections
import os
import re
import sys
import tempfile

import triton
import triton.language as tl
from tabulate import tabulate
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(__file__))
from offline_compile import _disassemble  # noqa: E402

PAIRS = 4  # per thread: 4 warps x 32 threads x 2 x PAIRS values
N = 128 * 2 * PAIRS


@triton.jit
def _packed(X, Y, N: tl.constexpr, ASM: tl.constexpr, F16: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(X + offs)
    ty = tl.float16 if F16 else tl.bfloat16
    y = tl.inline_asm_elementwise(ASM, "=r,r", [x.to(ty)], dtype=ty, is_pure=True, pack=2)
    tl.store(Y + offs, y.to(tl.float32))


@triton.jit
def _single(X, Y, N: tl.constexpr, ASM: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(X + offs)
    tl.store(Y + offs, tl.inline_asm_elementwise(ASM, "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1))


def sass_ops(kernel, constexprs: dict) -> collections.Counter:
    """SASS op counts (full names, e.g. MUFU.EX2.F16) of ``kernel`` compiled for sm_90a with these constants."""
    signature = {"X": "*fp32", "Y": "*fp32", **{name: "constexpr" for name in constexprs}}
    compiled = triton.compile(ASTSource(kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32))
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = _disassemble(path)
    return collections.Counter(re.findall(r"^\s+/\*[0-9a-f]+\*/\s+([A-Z0-9_.]+)", sass, re.M))


def main():
    rows = []
    for op in ("ex2", "tanh"):
        ops = sass_ops(_single, {"N": N, "ASM": f"{op}.approx.f32 $0, $1;"})
        mufu = {k: v for k, v in ops.items() if k.startswith("MUFU")}
        rows.append([f"{op}.approx.f32", 2 * PAIRS, sum(mufu.values()), ", ".join(mufu), 0])
        for suffix, f16 in (("f16x2", True), ("ftz.bf16x2" if op == "ex2" else "bf16x2", False)):
            ops = sass_ops(_packed, {"N": N, "ASM": f"{op}.approx.{suffix} $0, $1;", "F16": f16})
            mufu = {k: v for k, v in ops.items() if k.startswith("MUFU")}
            convert = sum(v for k, v in ops.items() if k.startswith(("F2FP", "HADD2", "PRMT", "F2F")))
            rows.append([f"{op}.approx.{suffix}", 2 * PAIRS, sum(mufu.values()), ", ".join(mufu), convert])
    print(tabulate(rows, headers=["PTX", "values / thread", "MUFU ops / thread", "SASS", "conversions"],
                   tablefmt="github"))


if __name__ == "__main__":
    main()
