"""GPU probe for forward tuning: per mask and shape, flexlite's CUDA-graph time under several tile configs,
with pointer loads or tensor descriptors (USE_TMA); first a correctness check of the TMA path at odd sizes against the fp64 reference. Prints tables;
benchmarks/NOTES.md records what they showed.

Usage: python benchmarks/probe_fwd.py [mask,mask,...] [D,D,...]"""

import sys

import torch
import triton.testing
from tabulate import tabulate

from flexlite import attention_reference, create_block_mask, flex_attention
from flexlite.bench import mask_cases
from flexlite.masks import causal_mask

CONFIGS = [(128, 64, 4, 2), (128, 64, 4, 3), (128, 128, 4, 2), (128, 128, 4, 3)]
# tl.range(..., warp_specialize=True) of the kv loop was tried too: Triton 3.6 fails to compile it for this
# kernel (NVGPUWarpSpecialization pass), see benchmarks/NOTES.md
VARIANTS = [{}, {"USE_TMA": True}]


def check_tma():
    rows = []
    for (Lq, Lkv, D) in [(1000, 777, 128), (200, 300, 80), (129, 129, 64), (64, 64, 20), (333, 100, 256)]:
        q = torch.randn(2, 4, Lq, D, device="cuda", dtype=torch.bfloat16)
        k, v = [torch.randn(2, 2, Lkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        bm = create_block_mask(causal_mask, None, None, Lq, Lkv, device="cuda")
        ref, _ = attention_reference(q, k, v, block_mask=bm, enable_gqa=True)
        row = [f"Lq{Lq} Lkv{Lkv} D{D}"]
        for opts in VARIANTS[1:]:
            try:
                out = flex_attention(q, k, v, block_mask=bm, enable_gqa=True, kernel_options=opts)
                row.append(f"{(out.double() - ref).abs().max().item():.2e}")
            except Exception as e:  # noqa: BLE001 - report and go on
                row.append(f"{type(e).__name__}: {str(e)[:60]}")
        rows.append(row)
    print(tabulate(rows, headers=["check: max |err| vs fp64 (bf16)"] + [variant_name(o) for o in VARIANTS[1:]],
                   tablefmt="github"), flush=True)


def variant_name(opts: dict) -> str:
    return "+".join({"USE_TMA": "tma"}[k] for k in opts) or "ptr"


def main():
    check_tma()
    masks = sys.argv[1].split(",") if len(sys.argv) > 1 else ["full", "causal", "sliding_window_1024",
                                                              "document_8_causal", "softcap30_causal"]
    dims = [int(d) for d in sys.argv[2].split(",")] if len(sys.argv) > 2 else [128, 64]
    rows = []
    for (B, H, S, D) in [(4, 16, 8192, 128), (16, 16, 8192, 64)]:
        if D not in dims:
            continue
        q, k, v = [torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        cases = mask_cases(S, H, "cuda")
        for name in masks:
            case = cases[name]
            bm = create_block_mask(case.mask_mod, None, None, S, S, device="cuda") if case.mask_mod else None
            row = [name, f"D{D}"]
            for variant in VARIANTS:
                for cfg in CONFIGS:
                    opts = dict(variant)
                    if cfg:
                        opts.update(zip(("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"), cfg))
                    f = lambda: flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm, kernel_options=opts)  # noqa
                    try:
                        row.append(round(triton.testing.do_bench_cudagraph(f), 3))
                    except Exception as e:  # noqa: BLE001 - a config that does not fit: note it and go on
                        row.append(type(e).__name__[:12])
            rows.append(row)
            print(row, flush=True)
    heads = [variant_name(o) + " " + ("default" if c is None else "x".join(map(str, c))) for o in VARIANTS
             for c in CONFIGS]
    print(tabulate(rows, headers=["mask", "D"] + heads, tablefmt="github"))


if __name__ == "__main__":
    main()
