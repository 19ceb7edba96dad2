"""Numerics table: flexlite's max error vs the fp64 reference, next to the error of eager attention
computed in the same dtype (``attention_reference(..., dtype=...)``), over the test catalog.
Writes docs/NUMERICS.md. Runs on CPU (the interpreter computes what the GPU kernels compute, up to
accumulation order) or, with FLEXLITE_TEST_DEVICE=cuda, on a GPU.

    python benchmarks/numerics.py
"""

import os
import sys
from pathlib import Path

import torch
from tabulate import tabulate

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the shared catalog of mods lives with the tests
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from catalog import CATALOG, USES_BH  # noqa: E402
from helpers import DEVICE, rand_qkv  # noqa: E402

from flexlite import attention_reference, create_block_mask, flex_attention  # noqa: E402

B, HQ, HKV, LQ, LKV, D = 1, 4, 2, 200, 256, 64


def main():
    rows = []
    for name in sorted(CATALOG):
        case = CATALOG[name](B, HQ, LQ, LKV, DEVICE)
        bm = None
        if case.mask_mod is not None:
            mb, mh = (B, HQ) if name in USES_BH else (None, None)
            bm = create_block_mask(case.mask_mod, mb, mh, LQ, LKV, device=DEVICE)
        row = [name]
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            q, k, v = rand_qkv(B, HQ, HKV, LQ, LKV, D, dtype=dtype, seed=1)
            kw = dict(score_mod=case.score_mod, block_mask=bm, enable_gqa=True)
            ref, _ = attention_reference(q, k, v, **kw)
            ours = (flex_attention(q, k, v, **kw).double() - ref).abs().max().item()
            eager = (attention_reference(q, k, v, dtype=dtype, **kw)[0].double() - ref).abs().max().item()
            row += [f"{ours:.2e}", f"{eager:.2e}", f"{ours / eager:.2f}" if eager else "-"]
        rows.append(row)
        print(row, flush=True)
    heads = ["mods"] + [f"{d} {w}" for d in ("fp16", "bf16", "fp32") for w in ("flexlite", "eager", "ratio")]
    table = tabulate(rows, headers=heads, tablefmt="github")
    text = (f"# Numerics\n\nMax |error| of the output vs the fp64 reference, B{B} Hq{HQ} Hkv{HKV} Lq{LQ} Lkv{LKV} "
            f"D{D}, random normal inputs, device `{DEVICE}`; 'eager' is the same attention computed in the "
            f"input dtype by torch ops (`attention_reference(..., dtype=...)`), 'ratio' = flexlite / eager "
            f"(torch's rule of thumb for its flex kernels: <= 1.1 in fp16/bf16). flexlite accumulates in fp32 "
            f"and rounds only P (to the input dtype) before the PV matmul, so it is usually well under eager "
            f"(on CPU the interpreter rounds fp32 -> bf16 toward zero, the GPU to nearest: GPU bf16 errors "
            f"are a little smaller). "
            f"Produced by `python benchmarks/numerics.py`.\n\n{table}\n")
    (ROOT / "docs" / "NUMERICS.md").write_text(text)
    print(table)


if __name__ == "__main__":
    main()
