"""GPU probe for forward tuning: per mask and shape, flexlite's time under several tile configs, with
and without CUDA-graph replay (the difference is host overhead). Prints a table;
the notes in benchmarks/NOTES.md come from its output."""

import sys

import torch
import triton.testing
from tabulate import tabulate

from flexlite import create_block_mask, flex_attention
from flexlite.bench import mask_cases

CONFIGS = [(128, 64, 4, 3), (128, 64, 4, 2), (128, 128, 4, 2), (128, 128, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3),
           (128, 32, 4, 3), (128, 128, 4, 3)]


def main():
    masks = sys.argv[1].split(",") if len(sys.argv) > 1 else ["full", "causal", "sliding_window_1024",
                                                              "document_8_causal", "softcap30_causal"]
    rows = []
    for (B, H, S, D) in [(4, 16, 8192, 128), (16, 16, 8192, 64)]:
        q, k, v = [torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        cases = mask_cases(S, H, "cuda")
        for name in masks:
            case = cases[name]
            bm = create_block_mask(case.mask_mod, None, None, S, S, device="cuda") if case.mask_mod else None
            fn = lambda: flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm)  # noqa: E731
            row = [name, f"D{D}", round(triton.testing.do_bench(fn, return_mode="median"), 3),
                   round(triton.testing.do_bench_cudagraph(fn), 3)]
            for cfg in CONFIGS:
                opts = dict(zip(("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"), cfg))
                f = lambda: flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm, kernel_options=opts)  # noqa
                try:
                    row.append(round(triton.testing.do_bench_cudagraph(f), 3))
                except Exception as e:  # noqa: BLE001 - a config that does not fit: note it and go on
                    row.append(type(e).__name__[:12])
            rows.append(row)
            print(row, flush=True)
    print(tabulate(rows, headers=["mask", "D", "flexlite", "flexlite graph"] + ["x".join(map(str, c)) + " graph"
                                                                          for c in CONFIGS], tablefmt="github"))


if __name__ == "__main__":
    main()
