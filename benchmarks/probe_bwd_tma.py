"""GPU probe for the backward's loads through tensor descriptors (Q / dO tiles in the dK/dV kernel, K / V tiles
in the dQ kernel; launch.default_use_tma is replaced for each variant) against pointer loads, at the default
tiles and at 8-warp 64x128 / 128x64 tiles; each variant first checked against the fp64 reference (bf16,
gradients). Prints a table; benchmarks/NOTES.md records what it showed.

Usage: python benchmarks/probe_bwd_tma.py [mask,mask,...] [D,D,...]"""

import sys

from tabulate import tabulate

from flexlite import flex_attention
from flexlite.bench import _median_ms, _timed, check_against_reference, probe_cases
from flexlite.runtime import launch

TILES = {"default": {}, "64x128 / 128x64 8w": dict(BLOCK_M1=64, BLOCK_N1=128, BLOCK_M2=128, BLOCK_N2=64,
                                                     num_warps=8, num_stages=2)}


def main():
    masks = sys.argv[1].split(",") if len(sys.argv) > 1 else ["full", "causal", "sliding_window_1024",
                                                              "document_8_causal", "alibi_causal"]
    dims = [int(d) for d in sys.argv[2].split(",")] if len(sys.argv) > 2 else [128, 64]
    default = launch.default_use_tma
    rows = []
    for D, q, k, v, case, bm in probe_cases(masks, dims):
        for tiles, opts in TILES.items():
            row = [case.name, f"D{D}", tiles]
            for tma in (False, True):
                launch.default_use_tma = lambda dense, D, Dv, tma=tma: tma
                err = max(v for k_, v in check_against_reference(case, D, "cuda", backward=True).items()
                          if k_ != "max_err_vs_fp64")
                fwd = lambda: flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm,  # noqa: E731
                                             kernel_options=opts)
                try:
                    row += [f"{err:.1e}", round(_median_ms(_timed(fwd, "bwd"), grad_to_none=[q, k, v]), 3)]
                except Exception as e:  # noqa: BLE001 - a variant that fails to compile is a finding
                    row += [f"{err:.1e}", f"{type(e).__name__}"]
            if all(isinstance(x, float) for x in row[4::2]):
                row.append(round(row[4] / row[6], 3))
            rows.append(row)
            print(row, flush=True)
    launch.default_use_tma = default
    print(tabulate(rows, headers=["mask", "D", "tiles", "max grad err (pointers)", "bwd ms (pointers)",
                                  "max grad err (descriptors)", "bwd ms (descriptors)", "gain"], tablefmt="github"))


if __name__ == "__main__":
    main()
