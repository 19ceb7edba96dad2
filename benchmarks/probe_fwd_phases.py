"""GPU probe: where a tile's and a q block's time goes inside the Gluon forward's consumers (NOTES 57).

The package's fwd_ws.py.jinja with clock stamps inserted after its phase boundaries (the insertion points are found
by their source lines; the probe fails if one is missing): each consumer warpgroup of the first NPROG programs writes
the SM clock (%clock64) of each of its first NSLOT ring slot uses (tiles, over the program's q blocks) into a buffer at
- per tile of the walk's loops: ``top``: the iteration starts; ``issue``: K(j), V(j-1) landed and this warpgroup's
  turn (ping-pong) came; ``s``: S(j) done; ``sm``: its softmax done; ``pv``: P V(j-1) done;
- per q block, at its first tile's slot: ``item``: before waiting for Q, ``q``: Q landed, ``first``: the first tile's
  S and softmax done; at its last tile's slot: ``last``: the last P V done, ``out``: OUT / LSE stored.
Printed per mask and head dim (the harness shapes, the default grid): each phase's median clocks per tile and warpgroup,
the warpgroups' largest offset from the first, and per q block the clocks of its parts outside the loop, its span
beyond its tiles (span - tiles x the median tile) in clocks and in tiles, and its tile count. Two consumer warpgroups
everywhere: D64 without its wide items of three (launch.WS_FWD_WIDE_TILES off); with --wide D64 in the wide items
wherever their lists can be made (whatever the kernel spills with its stamps, and however many tiles they walk:
launch.WS_FWD_WIDE_MAX_LOCAL and WS_FWD_WIDE_MAX_WORK lifted), three warpgroups' stamps. --save=DIR: each case's
stamps (int64 [NPROG, warpgroups, NSLOT, FIELDS]) saved to DIR/fwd_phases_<mask>_D<D>.pt, for tables the summary does
not print (per tile of an item, per warpgroup). The stamps cost registers: a kernel near its limit may run its loops
differently stamped (NOTES 97: sliding window's wide items, whose full tiles' softmax doubled stamped).

Usage: python benchmarks/probe_fwd_phases.py [mask,mask,...] [D,D,...] [--wide] [--save=DIR]"""

import sys
import unittest.mock
from pathlib import Path

import torch
from tabulate import tabulate

from flexlite import first_calls, flex_attention
from flexlite.bench import probe_args, probe_cases
from flexlite.runtime import launch

sys.path.insert(0, str(Path(__file__).parent))
import phase_stamps  # noqa: E402
from phase_stamps import NPROG  # noqa: E402
from probe_against import templates_from  # noqa: E402

NSLOT = 1024
FIELDS = ("top", "issue", "s", "sm", "pv", "item", "q", "first", "last", "out")
# (source text, indentation, field, slot expression) the stamps go after (after its first line)
AFTER = (
    ("        next_n = ws_walk_tile(IDX, j + 1 - n_skip, hi - n_skip, SPARSE_KV_BLOCK, BLOCK_N, DENSE)\n", 8, "top",
     "i0 + j"),
    ("        ws_wait_turn(turn, WG, r0 + j, TURNS)  # ping-pong: this warpgroup's turn to issue\n", 8, "issue",
     "i0 + j"),
    ("        s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))  # P V(j-1) may still run\n", 8, "s", "i0 + j"),
    ("                                        MASKED, HAS_SCORE_MOD, EVEN_N{{ exp2_one_in }})\n", 8, "sm", "i0 + j"),
    ("        o = warpgroup_mma_wait(num_outstanding=0, deps=(o, ))\n"
     "        mbarrier.arrive(kv_empty.index(sp), count=1)  # this warpgroup is done with tile j-1\n", 8, "pv",
     "i0 + j"),
    ("    mbarrier.wait(q_bar.index(qb), phase=(jj // Q_BUFFERS) & 1)\n", 4, "q", "i"),
    ("            mbarrier.arrive(kv_empty.index(last), count=1)\n        else:\n", 12, "out", "i_last"),
    # (three warpgroups: OUT staged in Q's buffer)
    ("            mbarrier.arrive(q_empty.index(qb), count=1)  # the producer may load Q into this buffer\n"
     "        r_next = r + n_tiles + 1\n", 12, "out", "i_last"),
)
BEFORE = (("    mbarrier.wait(q_bar.index(qb), phase=(jj // Q_BUFFERS) & 1)\n", 4, "item", "i"),
          ("        # partial tiles lead + 1 .. n_part - 1, then full tiles", 8, "first", "i"),
          ("            # OUT in the last slot's K buffer", 12, "last", "i_last"),
          ("            mbarrier.arrive(kv_empty.index(last), count=1)\n"
           "            # (the last item of a head", 12, "last", "i_last"))


def stamped_template(base: int, warpgroups: int = 2) -> str:
    return phase_stamps.stamped_template("fwd_ws.py.jinja", FIELDS, AFTER, BEFORE, "\n\n@gluon.jit\ndef ws_walk(",
                                         NSLOT, base, warpgroups)


def _median(values) -> float:
    return float(torch.tensor(values, dtype=torch.float64).median()) if values else float("nan")


def summarize(t: torch.Tensor) -> list:
    """[tile clocks, the loop's phases, WG offset, per q block: Q wait, first tile, last P V, OUT, span beyond the
    tiles (clocks, tiles), tiles per q block] from the stamps t [NPROG, warpgroups, NSLOT, fields] (medians)."""
    f = phase_stamps.fields_of(t, FIELDS)
    loop = f["top"] > 0
    phases = phase_stamps.phase_medians(f, FIELDS[:5], loop)
    nxt = torch.roll(f["top"], -1, dims=2)
    ok = loop & (nxt > 0) & (torch.roll(f["item"], -1, dims=2) == 0)
    tile = float((nxt - f["top"])[ok].median())
    offset = max([float((f["issue"][:, w] - f["issue"][:, 0])[loop[:, 0] & loop[:, w]].abs().median())
                  for w in range(1, t.shape[1]) if (loop[:, 0] & loop[:, w]).any()], default=float("nan"))
    parts = {"q": [], "first": [], "lastpv": [], "out": [], "beyond": [], "tiles": []}
    for p in range(t.shape[0]):
        for wg in range(t.shape[1]):
            starts = [int(s) for s in torch.nonzero(f["item"][p, wg] > 0).flatten()]
            for s, e in zip(starts, starts[1:] + [None]):
                ends = torch.nonzero(f["out"][p, wg, s:e] > 0).flatten()
                if len(ends) == 0:
                    continue
                last = s + int(ends[0])
                n = last - s + 1
                item, out = float(f["item"][p, wg, s]), float(f["out"][p, wg, last])
                parts["q"].append(float(f["q"][p, wg, s]) - item)
                parts["first"].append(float(f["first"][p, wg, s] - f["q"][p, wg, s]))
                if n > 1 and f["pv"][p, wg, last] > 0:
                    parts["lastpv"].append(float(f["last"][p, wg, last] - f["pv"][p, wg, last]))
                parts["out"].append(out - float(f["last"][p, wg, last]))
                parts["beyond"].append(out - item - n * tile)
                parts["tiles"].append(n)
    beyond = _median(parts["beyond"])
    return [tile, *phases.values(), offset, _median(parts["q"]), _median(parts["first"]), _median(parts["lastpv"]),
            _median(parts["out"]), beyond, beyond / tile, _median(parts["tiles"])]


HEADERS = ["clocks per tile (median)", "top->issue", "issue->s", "s->sm", "sm->pv", "max |WGi - WG0| at issue",
           "q block: Q wait", "first tile", "last P V", "OUT store", "span beyond its tiles", "... in tiles",
           "tiles per q block"]


def main():
    masks, dims = probe_args(sys.argv)
    wide = "--wide" in sys.argv
    nwg = 3 if wide else 2
    items = (dict(WS_FWD_WIDE_MAX_LOCAL=1 << 30, WS_FWD_WIDE_MAX_WORK=float("inf")) if wide else
             dict(WS_FWD_WIDE_TILES={}))
    save = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--save=")), None)
    rows = []
    for D, q, k, v, case, bm in probe_cases(masks, dims, requires_grad=False):
        buf = torch.zeros(NPROG, nwg, NSLOT, len(FIELDS), dtype=torch.int64, device="cuda")
        path = Path(f"/tmp/fwd_ws_stamped_{case.name}.py.jinja")
        path.write_text(stamped_template(buf.data_ptr(), nwg))
        with templates_from({"fwd_ws.py.jinja": str(path)}), unittest.mock.patch.multiple(launch, **items):
            for _ in range(3):  # (the last run's stamps are kept: warm caches)
                buf.zero_()
                flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm)
                first_calls.wait()  # (a first call may run in torch ops while its kernel compiles: NOTES 78)
            torch.cuda.synchronize()
        if save:
            torch.save(buf.cpu(), Path(save) / f"fwd_phases_{case.name}_D{D}.pt")
        rows.append([case.name, f"D{D}"] + [round(x, 1) if x == x else "" for x in summarize(buf.cpu().double())])
        print(rows[-1], flush=True)
    print(tabulate(rows, headers=["mask", "D", *HEADERS], tablefmt="github"), flush=True)


if __name__ == "__main__":
    main()
