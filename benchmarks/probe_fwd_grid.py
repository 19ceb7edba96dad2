"""GPU probe: the warp-specialized forward's grid (launch.WS_FWD_PERSISTENT) and K / V stages, in one process.

For each harness mask and head dim (``flexlite.bench.probe_cases``), the Triton forward, the warp-specialized
(Gluon) forward with a program per q block, and the Gluon forward on its persistent grid (with each of the ring
depths given by --stages, default the launch's): the Gluon outputs compared with the per-q-block one bit for bit
(the same tiles in the same order per q block), the Triton one's largest difference from it shown; then each timed
(do_bench medians) in rounds of rotating order, the best round of each kept. Prints a table: ms per variant and
the ratios to the Gluon per-q-block grid. (NOTES 54 also measured q blocks claimed from a counter: commit 553dd2c's
template.)

Usage: python benchmarks/probe_fwd_grid.py [mask,mask,...] [D,D,...] [--rounds=N] [--stages=S,S,...]"""

import sys
import unittest.mock

import torch
from tabulate import tabulate

from flexlite import flex_attention
from flexlite.bench import _median_ms, probe_args, probe_cases
from flexlite.runtime import launch


def variants(D: int, stages: list) -> list:
    """(label, kernel_options, launch settings) per variant at head dim D."""
    tiles = launch.WS_TILES[D]
    out = [("triton", {"WARP_SPECIALIZE": False}, {"WS_FWD_PERSISTENT": False}),
           ("per q block", {"WARP_SPECIALIZE": True}, {"WS_FWD_PERSISTENT": False})]
    for s in stages or [tiles["STAGES"]]:
        out.append((f"persistent, {s} stages", {"WARP_SPECIALIZE": True},
                    {"WS_FWD_PERSISTENT": True, "WS_TILES": {**launch.WS_TILES, D: {**tiles, "STAGES": s}}}))
    return out


def main():
    rounds = next((int(a.split("=", 1)[1]) for a in sys.argv if a.startswith("--rounds=")), 3)
    stages = next(([int(s) for s in a.split("=", 1)[1].split(",")] for a in sys.argv if a.startswith("--stages=")),
                  [])
    masks, dims = probe_args(sys.argv)
    rows = []
    for D, q, k, v, case, bm in probe_cases(masks, dims, requires_grad=False):
        runs = variants(D, stages)

        def forward(options, settings):
            with unittest.mock.patch.multiple(launch, **settings):
                return flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm, kernel_options=options)
        outs = {label: forward(options, settings) for label, options, settings in runs}
        base = outs["per q block"]
        same = all(torch.equal(outs[label], base) for label, _, _ in runs[2:])
        triton_diff = float((outs["triton"].float() - base.float()).abs().max())
        best = {}
        for r in range(rounds):
            for label, options, settings in runs[r % len(runs):] + runs[:r % len(runs)]:
                ms = _median_ms(lambda: forward(options, settings))
                best[label] = min(best.get(label, ms), ms)
        rows.append([case.name, f"D{D}", same, f"{triton_diff:.1e}"] + [round(best[label], 4) for label, _, _ in runs]
                    + [round(best[label] / best["per q block"], 4) for label, _, _ in runs if label != "per q block"])
        print(rows[-1], flush=True)
        headers = ["mask", "D", "Gluon outputs equal", "Triton's max diff"] + [f"ms {label}" for label, _, _ in runs] \
            + [f"{label} / per q block" for label, _, _ in runs if label != "per q block"]
    print(tabulate(rows, headers=headers, tablefmt="github"), flush=True)


if __name__ == "__main__":
    main()
