"""GPU probe for the warp-specialized forward (fwd_ws.py.jinja, Gluon): the forward's time through it and through the
Triton forward, for every harness mask at both harness shapes, in one process, with its tensor descriptors made per
program on the device and made on the host (launch.WS_HOST_DESCRIPTORS); each first checked against the fp64
reference (bf16). NOTES 36 measured the unmasked form of this schedule standalone (1.05-1.09x at D128); this is
the kernel flex_attention runs, with the block walk and the mods. Prints a table; benchmarks/NOTES.md (38) records
what it showed.

Usage: python benchmarks/probe_ws.py [mask,mask,...] [D,D,...] [--stages 2,3]   (--stages: the K / V ring depths
to compare, descriptors made on the host)"""

import sys

from tabulate import tabulate

import flexlite.api
from flexlite import flex_attention
from flexlite.bench import _median_ms, check_against_reference, probe_args, probe_cases
from flexlite.runtime import launch

def main():
    masks, dims = probe_args(sys.argv)
    stages = [int(s) for s in sys.argv[sys.argv.index("--stages") + 1].split(",")] if "--stages" in sys.argv else []
    rows = []
    heuristic, host, tiles = flexlite.api._warp_specialize, launch.WS_HOST_DESCRIPTORS, launch.WS_TILES
    # (label, warp-specialized, host descriptors, K / V ring stages): the Triton forward; the warp-specialized one
    # with descriptors made per program on the device, and made on the host (the harness's inputs are contiguous and
    # its lengths multiples of the tiles); with --stages, the host-descriptor form at each ring depth instead
    variants = [("Triton", False, False, None)] + (
        [(f"ws {n} stages", True, True, n) for n in stages] if stages else
        [("ws, device desc.", True, False, None), ("ws, host desc.", True, True, None)])
    for D, q, k, v, case, bm in probe_cases(masks, dims, requires_grad=False):
        row = [case.name, f"D{D}"]
        outs = []
        for _, ws, host_desc, n in variants:
            flexlite.api._warp_specialize = lambda *args, ws=ws: ws
            launch.WS_HOST_DESCRIPTORS = host_desc
            launch.WS_TILES = {d: dict(t, STAGES=n or t["STAGES"]) for d, t in tiles.items()}
            err = check_against_reference(case, D, "cuda", backward=False)
            fwd = lambda: flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm)  # noqa: E731
            outs.append(fwd())
            row += [f"{max(err.values()):.1e}", round(_median_ms(fwd), 3)]
        row.append(f"{max(float((o.float() - outs[0].float()).abs().max()) for o in outs[1:]):.1e}")
        row += [round(row[3] / row[5 + 2 * i], 3) for i in range(len(variants) - 1)]
        rows.append(row)
        print(row, flush=True)
    flexlite.api._warp_specialize, launch.WS_HOST_DESCRIPTORS, launch.WS_TILES = heuristic, host, tiles
    headers = ["mask", "D"] + [h for label, *_ in variants for h in (f"max err ({label})", "fwd ms")]
    print(tabulate(rows, headers=headers + ["max |ws - Triton|"] + [f"speedup ({label})" for label, *_ in
                                                                    variants[1:]], tablefmt="github"))


if __name__ == "__main__":
    main()
