"""GPU probe for the forward's partial blocks in half-width steps: the forward's time with the partial (mask_mod)
blocks walked BLOCK_N // 2 keys at a time and BLOCK_N at a time, for every mask (flex_attention's own heuristic,
api._split_partial, overridden both ways), in one process; each first checked against the fp64 reference (bf16). Offline compiles (benchmarks/offline_compile.py) showed the
128x64 D128 partial loop spilling and packing the mask's predicates into registers; with 32-key steps it does not
spill. Prints a table; benchmarks/NOTES.md (37) records what it showed.

Usage: python benchmarks/probe_split.py [mask,mask,...] [D,D,...]"""

import sys

from tabulate import tabulate

import flexlite.api
from flexlite import flex_attention
from flexlite.bench import _median_ms, check_against_reference, probe_cases


def main():
    masks = sys.argv[1].split(",") if len(sys.argv) > 1 else ["causal", "sliding_window_1024", "prefix_lm_2048",
                                                              "document_8_causal", "alibi_causal", "softcap30_causal"]
    dims = [int(d) for d in sys.argv[2].split(",")] if len(sys.argv) > 2 else [128, 64]
    rows = []
    heuristic = flexlite.api._split_partial
    for D, q, k, v, case, bm in probe_cases(masks, dims):
        row = [case.name, f"D{D}"]
        for split in (False, True):
            flexlite.api._split_partial = lambda *args, split=split: split
            err = check_against_reference(case, D, "cuda", backward=False)
            fwd = lambda: flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm)  # noqa: E731
            row += [f"{max(err.values()):.1e}", round(_median_ms(fwd), 3)]
        row.append(round(row[3] / row[5], 3))
        rows.append(row)
        print(row, flush=True)
    flexlite.api._split_partial = heuristic
    print(tabulate(rows, headers=["mask", "D", "max err (whole tiles)", "fwd ms", "max err (half tiles)", "fwd ms",
                                  "speedup of half tiles"], tablefmt="github"))


if __name__ == "__main__":
    main()
