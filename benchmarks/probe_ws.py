"""GPU probe for the warp-specialized forward (fwd_ws.py.jinja, Gluon): the forward's time through it and through the
Triton forward, for every harness mask at both harness shapes, in one process, with its tensor descriptors made per
program on the device and made on the host (launch.WS_HOST_DESCRIPTORS); each first checked against the fp64
reference (bf16). NOTES 36 measured the unmasked form of this schedule standalone (1.05-1.09x at D128); this is
the kernel flex_attention runs, with the block walk and the mods. Prints a table; benchmarks/NOTES.md (38) records
what it showed.

Usage: python benchmarks/probe_ws.py [mask,mask,...] [D,D,...]"""

import sys

from tabulate import tabulate

import flexlite.api
from flexlite import flex_attention
from flexlite.bench import _median_ms, check_against_reference, probe_cases
from flexlite.runtime import launch

MASKS = ["full", "causal", "sliding_window_1024", "prefix_lm_2048", "document_8_causal", "alibi_causal",
         "softcap30_causal"]


def main():
    masks = sys.argv[1].split(",") if len(sys.argv) > 1 else MASKS
    dims = [int(d) for d in sys.argv[2].split(",")] if len(sys.argv) > 2 else [128, 64]
    rows = []
    heuristic, host = flexlite.api._warp_specialize, launch.WS_HOST_DESCRIPTORS
    # the Triton forward; the warp-specialized one with descriptors made per program on the device; with
    # descriptors made on the host (the harness's inputs are contiguous and its lengths multiples of the tiles)
    variants = [(False, False), (True, False), (True, True)]
    for D, q, k, v, case, bm in probe_cases(masks, dims, requires_grad=False):
        row = [case.name, f"D{D}"]
        outs = []
        for ws, host_desc in variants:
            flexlite.api._warp_specialize = lambda *args, ws=ws: ws
            launch.WS_HOST_DESCRIPTORS = host_desc
            err = check_against_reference(case, D, "cuda", backward=False)
            fwd = lambda: flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm)  # noqa: E731
            outs.append(fwd())
            row += [f"{max(err.values()):.1e}", round(_median_ms(fwd), 3)]
        row += [f"{max(float((o.float() - outs[0].float()).abs().max()) for o in outs[1:]):.1e}",
                round(row[3] / row[5], 3), round(row[3] / row[7], 3)]
        rows.append(row)
        print(row, flush=True)
    flexlite.api._warp_specialize, launch.WS_HOST_DESCRIPTORS = heuristic, host
    print(tabulate(rows, headers=["mask", "D", "max err (Triton)", "fwd ms", "max err (ws, device desc.)", "fwd ms",
                                  "max err (ws, host desc.)", "fwd ms", "max |ws - Triton|", "speedup (device desc.)",
                                  "speedup (host desc.)"], tablefmt="github"))


if __name__ == "__main__":
    main()
