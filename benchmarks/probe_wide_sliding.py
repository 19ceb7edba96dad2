"""GPU probe: where the wide items' time goes on a sliding window (NOTES 96).

The three-consumer-warpgroup forward (launch.WS_FWD_WIDE_TILES, 192-row items) is kept off sliding window at D64
(launch.WS_FWD_WIDE_MAX_WORK, WS_FWD_WIDE_MAX_LOCAL). This runs one variant per process (the launch settings and the
kernel caches are per process), B16 H16 S8192 D64 bf16, forward only, and prints its do_bench median:

- ``two``: the defaults (two consumer warpgroups at window 1024; a longer window may take the wide items by itself);
- ``wide``: the wide items forced (WS_FWD_WIDE_MAX_WORK 2.0, WS_FWD_WIDE_MAX_LOCAL 400);
- ``causalcmp`` / ``true``: the wide items on the same block lists with the partial tiles' mask_mod swapped for
  ``q_idx >= kv_idx`` / always True (timing only: the outputs are not the window's);
- ``twotrue``: the defaults with the mask_mod swapped for always True.

Usage: python benchmarks/probe_wide_sliding.py VARIANT [S] [WINDOW] [launch.NAME=VALUE | wide.KEY=VALUE ...]
(launch.NAME: a setting of flexlite.runtime.launch given a Python literal, e.g. launch.WS_FWD_PERSISTENT=False;
wide.KEY: an entry of launch.WS_FWD_WIDE_TILES[64], e.g. wide.Q_BUFFERS=1; NOTES 100)"""

import ast
import sys

import torch
import triton.testing

from flexlite import create_block_mask, first_calls, flex_attention
from flexlite.block_mask import lists_key
from flexlite.masks import generate_sliding_window
from flexlite.runtime import launch
import flexlite.api as api

SWAPS = {"causalcmp": lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, "true": lambda b, h, q_idx, kv_idx: kv_idx >= 0,
         "twotrue": lambda b, h, q_idx, kv_idx: kv_idx >= 0}


def apply_settings(pairs: list) -> None:
    """``launch.NAME=VALUE`` and ``wide.KEY=VALUE`` (see the module's usage) applied for this process."""
    for pair in pairs:
        name, value = pair.split("=", 1)
        kind, key = name.split(".", 1)
        value = ast.literal_eval(value)
        if kind == "wide":
            launch.WS_FWD_WIDE_TILES = {**launch.WS_FWD_WIDE_TILES, 64: {**launch.WS_FWD_WIDE_TILES[64], key: value}}
        elif kind == "launch" and hasattr(launch, key):
            setattr(launch, key, value)
        else:
            raise SystemExit(f"unknown setting {pair!r}: launch.NAME=VALUE (a setting of flexlite.runtime.launch) or "
                             f"wide.KEY=VALUE (an entry of launch.WS_FWD_WIDE_TILES[64])")


def main(argv):
    settings = [a for a in argv if "=" in a]
    argv = [a for a in argv if "=" not in a]
    variant = argv[0]
    S = int(argv[1]) if len(argv) > 1 else 8192
    W = int(argv[2]) if len(argv) > 2 else 1024
    apply_settings(settings)
    if not variant.startswith("two"):
        launch.WS_FWD_WIDE_MAX_WORK, launch.WS_FWD_WIDE_MAX_LOCAL = 2.0, 400
    bm = create_block_mask(generate_sliding_window(W), None, None, S, S, device="cuda")
    if variant in SWAPS:  # the same lists, taken as create_block_mask's (item_lists needs that) with the new mask_mod
        bm.mask_mod = SWAPS[variant]
        bm._exact = (lists_key(bm), bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                     bm.mask_mod)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = [torch.randn(16, 16, S, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]
    offered = []
    launch_ws = api.launch_forward_ws

    def spy(*args, **kwargs):  # whether the call offered the wide items' lists
        offered.append(kwargs.get("wide") not in (None, False))
        return launch_ws(*args, **kwargs)
    api.launch_forward_ws = spy
    first_calls.EAGER = False

    def run():
        return flex_attention(q, k, v, block_mask=bm)
    run()
    first_calls.wait()  # its own kernel compiled: no first call's bits while timing
    run()
    torch.cuda.synchronize()
    ms = min(triton.testing.do_bench(run, warmup=200, rep=1000) for _ in range(2))
    print(f"{variant:10s} W{W} {' '.join(settings)} wide offered {offered[-1]} {ms:.4f} ms", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
