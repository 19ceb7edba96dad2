"""NOTES 101's A/B on a GPU: the tile loops' P V wait held after the softmax (``launch.WS_FWD_HOLD_PV_WAIT``, which
exists only with ``benchmarks/experiments/fwd_ws_hold_pv_wait.patch`` applied), D64 forward, B16 H16 S8192 bf16, one
process, the configurations by launch settings (K / V stages of the 128-row items, turns), each output against the
first's and the smaller of two do_bench medians.

Usage: python benchmarks/experiments/hold_pv_ab.py [sliding|causal|full ...]"""
import sys
import torch
import triton.testing
from flexlite import create_block_mask, first_calls, flex_attention
from flexlite.masks import causal_mask, generate_sliding_window
from flexlite.runtime import launch

first_calls.EAGER = False
S, D = 8192, 64
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = [torch.randn(16, 16, S, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]
base_tiles = dict(launch.WS_TILES)
configs = {
    "A base": dict(hold=frozenset(), stages=2),
    "B hold+3st": dict(hold=frozenset({64}), stages=3),
    "D +noturns": dict(hold=frozenset({64}), stages=3, turns=()),
    "E noturns": dict(hold=frozenset(), stages=2, turns=()),
}
masks = [m for m in sys.argv[1:] if not m.startswith("--")] or ["sliding", "causal"]
for mname in masks:
    mm = {"sliding": generate_sliding_window(1024), "causal": causal_mask, "full": None}[mname]
    bm = None if mm is None else create_block_mask(mm, None, None, S, S, device="cuda")
    ref = None
    for cname, c in configs.items():
        launch.WS_FWD_HOLD_PV_WAIT = c["hold"]
        launch.WS_FWD_TURNS_PLAIN_HEAD_DIMS = c.get("turns", frozenset({64}))
        launch.WS_TILES = {**base_tiles, 64: {**base_tiles[64], "STAGES": c["stages"]}}
        run = lambda: flex_attention(q, k, v, block_mask=bm)
        out = run()
        first_calls.wait()
        out = run()
        torch.cuda.synchronize()
        err = 0.0 if ref is None else (out.float() - ref.float()).abs().max().item()
        ref = out if ref is None else ref
        ms = min(triton.testing.do_bench(run, warmup=100, rep=400) for _ in range(2))
        print(f"{mname:8s} {cname:12s} {ms:.4f} ms  max|diff vs A| {err:.2e}", flush=True)
