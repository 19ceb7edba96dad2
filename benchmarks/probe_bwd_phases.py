"""GPU probe: where a tile's and a work item's time goes inside the Gluon backward's consumers (NOTES 52).

The package's bwd_ws.py.jinja with clock stamps inserted after its phase boundaries (the insertion points are found
by their source lines; the probe fails if one is missing): each consumer warpgroup of the first NPROG programs writes
the SM clock (%clock64) of each of its first NSLOT tiles into a buffer at
- ``tile``: the tile's Q landed; ``qk``: S^T and dP^T done; ``scores``: P^T and dS^T computed (the element-wise part);
  ``ds``: both warpgroups' dS^T staged (ds_bar); ``mm``: dV, dK and dQ done; ``dq``: the dQ reduce-add issued;
- per work item, at its first tile's slot: ``item``: before waiting for K / V, ``kv``: K / V landed; at its last
  tile's slot: ``end``: dK / dV stored.
Printed per mask (a harness shape at D128, the default grid for it): each phase's median clocks per tile and
warpgroup, the two warpgroups' offset at a tile's start, and per item the clocks from the previous item's last tile
to the first tile's start (the item boundary), next to a tile's.

Usage: python benchmarks/probe_bwd_phases.py [mask,mask,...]"""

import sys
from pathlib import Path

import torch
from tabulate import tabulate

from flexlite import flex_attention
from flexlite.bench import probe_args, probe_cases

sys.path.insert(0, str(Path(__file__).parent))
import phase_stamps  # noqa: E402
from phase_stamps import NPROG  # noqa: E402
from probe_against import templates_from  # noqa: E402

NSLOT = 256
FIELDS = ("tile", "qk", "scores", "ds", "mm", "dq", "item", "kv", "end")
# (source line, indentation, field, slot expression) the stamps go after
POINTS = (
    ("        mbarrier.wait(q_full.index(s), phase=phase)\n", 8, "tile", "i"),
    ("        qkT, dpT = warpgroup_mma_wait(num_outstanding=0, deps=(qkT, dpT))\n", 8, "qk", "i"),
    ("        pa = gl.convert_layout(pT.to(dtype), pa_layout)\n", 8, "scores", "i"),
    ("            mbarrier.wait(ds_bar.index(b), phase=(i // 2) & 1)\n", 12, "ds", "i"),
    ("            dv, dk, dq, pa = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk, dq, pa))\n", 12, "mm", "i"),
    ("            tma_reduce_add(desc_dq, [dq_row0 + start_m, WG * DQ_COLS], dq_smem)\n", 12, "dq", "i"),
    ("    bws_store_rows(GRAD_V, kv_row0 + WG * HALF, dv)\n", 4, "end", "i - 1"),
    ("    mbarrier.wait(kv_bar, phase=j & 1)\n", 4, "kv", "i"),
)
BEFORE = (("    mbarrier.wait(kv_bar, phase=j & 1)\n", 4, "item", "i"),)


def stamped_template(base: int) -> str:
    return phase_stamps.stamped_template("bwd_ws.py.jinja", FIELDS, POINTS, BEFORE, "\n\n@gluon.jit\ndef bws_walk(",
                                         NSLOT, base)


def main():
    masks, _ = probe_args(sys.argv)
    rows = []
    for D, q, k, v, case, bm in probe_cases(masks, [128]):
        buf = torch.zeros(NPROG, 2, NSLOT, len(FIELDS), dtype=torch.int64, device="cuda")
        path = Path(f"/tmp/bwd_ws_stamped_{case.name}.py.jinja")
        path.write_text(stamped_template(buf.data_ptr()))
        out = flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm)
        dout = torch.randn_like(out)
        with templates_from({"bwd_ws.py.jinja": str(path)}):
            for _ in range(3):  # (the last run's stamps are kept: warm caches)
                buf.zero_()
                out.backward(dout, retain_graph=True)
            torch.cuda.synchronize()
        t = buf.cpu().double()
        f = phase_stamps.fields_of(t, FIELDS)
        tiles = f["tile"] > 0
        phase = phase_stamps.phase_medians(f, FIELDS[:6], tiles)
        nxt = torch.roll(f["tile"], -1, dims=2)
        ok = tiles & (nxt > 0) & (f["end"] == 0)
        tile_clocks = float((nxt - f["tile"])[ok].median())
        items = f["item"] > 0
        prev_end = torch.roll(f["mm"], 1, dims=2)  # the previous tile's matmuls done
        first = items & (prev_end > 0) & (torch.arange(NSLOT, device="cpu") > 0)
        boundary = float((f["tile"] - prev_end)[first].median()) if first.any() else float("nan")
        kv_wait = float((f["kv"] - f["item"])[items].median())
        end_store = float((f["end"] - f["mm"])[f["end"] > 0].median())
        offset = float((f["tile"][:, 1] - f["tile"][:, 0])[tiles[:, 0] & tiles[:, 1]].abs().median())
        rows.append([case.name] + [round(x) if x == x else "" for x in (tile_clocks, *phase.values(), offset, kv_wait,
                                                                          end_store, boundary)])
        print(rows[-1], flush=True)
    print(tabulate(rows, headers=["mask", "clocks per tile (median)", *phase, "|WG1 - WG0| at tile start",
                                  "item: wait for K / V", "item: dK / dV stores", "item boundary (mm -> next tile)"],
                   tablefmt="github"), flush=True)


if __name__ == "__main__":
    main()
