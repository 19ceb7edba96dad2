"""GPU probe for the order of q-block programs: the forward's and the backward's times with the q blocks
taken last to first (launch.REVERSE_Q_BLOCKS, the heaviest first under causal-like masks) and first to last,
in one process; each order first checked against the fp64 reference (bf16, out and gradients). Prints a
table; benchmarks/NOTES.md records what it showed.

Usage: python benchmarks/probe_order.py [mask,mask,...] [D,D,...]"""

import sys

from tabulate import tabulate

from flexlite import flex_attention
from flexlite.bench import _median_ms, _timed, check_against_reference, probe_cases
from flexlite.runtime import launch


def main():
    masks = sys.argv[1].split(",") if len(sys.argv) > 1 else ["causal", "prefix_lm_2048", "full",
                                                              "document_8_causal", "sliding_window_1024"]
    dims = [int(d) for d in sys.argv[2].split(",")] if len(sys.argv) > 2 else [128, 64]
    rows = []
    for D, q, k, v, case, bm in probe_cases(masks, dims):
        row = [case.name, f"D{D}"]
        for reverse in (False, True):
            launch.REVERSE_Q_BLOCKS = reverse
            err = check_against_reference(case, D, "cuda", backward=True)
            fwd = lambda: flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm)  # noqa: E731
            row += [f"{max(err.values()):.1e}", round(_median_ms(fwd), 3),
                    round(_median_ms(_timed(fwd, "bwd"), grad_to_none=[q, k, v]), 3)]
        row += [round(row[3] / row[6], 3), round(row[4] / row[7], 3)]
        rows.append(row)
        print(row, flush=True)
    launch.REVERSE_Q_BLOCKS = True
    print(tabulate(rows, headers=["mask", "D", "max err (first to last)", "fwd ms", "bwd ms",
                                  "max err (last to first)", "fwd ms", "bwd ms", "fwd gain", "bwd gain"],
                   tablefmt="github"))


if __name__ == "__main__":
    main()
