"""GPU probe for the warp-specialized forward (fwd_ws.py.jinja, Gluon): the forward's time through it and through the
Triton forward, for every harness mask at both harness shapes, in one process; each first checked against the fp64
reference (bf16). NOTES 36 measured the unmasked form of this schedule standalone (1.05-1.09x at D128); this is
the kernel flex_attention runs, with the block walk and the mods. Prints a table; benchmarks/NOTES.md (38) records
what it showed.

Usage: python benchmarks/probe_ws.py [mask,mask,...] [D,D,...]"""

import sys

from tabulate import tabulate

import flexlite.api
from flexlite import flex_attention
from flexlite.bench import _median_ms, check_against_reference, probe_cases

MASKS = ["full", "causal", "sliding_window_1024", "prefix_lm_2048", "document_8_causal", "alibi_causal",
         "softcap30_causal"]


def main():
    masks = sys.argv[1].split(",") if len(sys.argv) > 1 else MASKS
    dims = [int(d) for d in sys.argv[2].split(",")] if len(sys.argv) > 2 else [128, 64]
    rows = []
    heuristic = flexlite.api._warp_specialize
    for D, q, k, v, case, bm in probe_cases(masks, dims, requires_grad=False):
        row = [case.name, f"D{D}"]
        outs = []
        for ws in (False, True):
            flexlite.api._warp_specialize = lambda *args, ws=ws: ws
            err = check_against_reference(case, D, "cuda", backward=False)
            fwd = lambda: flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm)  # noqa: E731
            outs.append(fwd())
            row += [f"{max(err.values()):.1e}", round(_median_ms(fwd), 3)]
        row += [f"{float((outs[0].float() - outs[1].float()).abs().max()):.1e}", round(row[3] / row[5], 3)]
        rows.append(row)
        print(row, flush=True)
    flexlite.api._warp_specialize = heuristic
    print(tabulate(rows, headers=["mask", "D", "max err (Triton)", "fwd ms", "max err (warp-specialized)", "fwd ms",
                                  "max |ws - Triton|", "speedup of ws"], tablefmt="github"))


if __name__ == "__main__":
    main()
