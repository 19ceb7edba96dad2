"""GPU probe: the warp-specialized forward's grid (launch.WS_FWD_PERSISTENT), in one process.

For each harness mask at D128 (``flexlite.bench.probe_cases``), the forward with a program per q block, on the
persistent grid taking q blocks in static passes, and on the persistent grid claiming them from a counter: each
output compared with the per-q-block one bit for bit (the same tiles in the same order per q block), then timed
(do_bench medians) in rounds of rotating order, the best round of each kept. Prints a table: ms per grid and their
ratios to the per-q-block grid.

Usage: python benchmarks/probe_fwd_grid.py [mask,mask,...] [D,D,...] [--rounds=N]"""

import sys

import torch
from tabulate import tabulate

from flexlite import flex_attention
from flexlite.bench import _median_ms, _timed, probe_args, probe_cases
from flexlite.runtime import launch

GRIDS = (False, "static", "claim")


def main():
    rounds = next((int(a.split("=", 1)[1]) for a in sys.argv if a.startswith("--rounds=")), 3)
    masks, dims = probe_args(sys.argv)
    rows = []
    for D, q, k, v, case, bm in probe_cases(masks, dims, requires_grad=False):
        def forward():
            return flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm)
        outs, best = {}, {}
        for grid in GRIDS:
            launch.WS_FWD_PERSISTENT = grid
            outs[grid] = forward()
        same = all(torch.equal(outs[g], outs[False]) for g in GRIDS)
        for r in range(rounds):
            for grid in GRIDS[r % len(GRIDS):] + GRIDS[:r % len(GRIDS)]:
                launch.WS_FWD_PERSISTENT = grid
                ms = _median_ms(_timed(forward, "fwd"))
                best[grid] = min(best.get(grid, ms), ms)
        rows.append([case.name, f"D{D}", same] + [round(best[g], 4) for g in GRIDS]
                    + [round(best[g] / best[False], 4) for g in GRIDS[1:]])
        print(rows[-1], flush=True)
    print(tabulate(rows, headers=["mask", "D", "outputs equal", "ms per q block", "ms static", "ms claim",
                                  "static / per q block", "claim / per q block"], tablefmt="github"), flush=True)


if __name__ == "__main__":
    main()
