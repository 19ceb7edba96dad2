"""GPU probe for the forward without a block mask: the block-sparse walk (index loads, two loops) against one
plain loop over every kv tile (launch.DENSE_FORWARD), with and without tensor descriptors and Triton's warp
specialization (launch.FWD_WARP_SPECIALIZE), over a few tiles; torch's flex and SDPA (cuDNN) in the same
process. Each variant is first checked against the fp64 reference. Prints a table; benchmarks/NOTES.md records
what it showed.

Usage: python benchmarks/probe_dense.py [D,D,...]"""

import sys

import torch
from tabulate import tabulate

from flexlite import attention_reference, flex_attention
from flexlite.bench import _median_ms
from flexlite.runtime import launch

TILES = {128: [(128, 64, 4, 3), (128, 128, 4, 2), (128, 64, 4, 2), (128, 128, 8, 2)],
         64: [(128, 128, 4, 3), (128, 128, 4, 4), (128, 64, 4, 3), (128, 128, 8, 2)]}
# label: (DENSE_FORWARD, USE_TMA, FWD_WARP_SPECIALIZE)
VARIANTS = {"block walk": (False, False, False), "dense": (True, False, False), "dense+tma": (True, True, False),
            "dense+ws": (True, False, True), "dense+tma+ws": (True, True, True)}


def _error(D: int, opts: dict) -> float:
    g = torch.Generator().manual_seed(0)
    q, k, v = [torch.randn(1, 2, 1024, D, generator=g).to("cuda", torch.bfloat16) for _ in range(3)]
    out = torch.full_like(q, float("nan"))
    out.copy_(flex_attention(q, k, v, kernel_options=opts))
    ref, _ = attention_reference(q, k, v)
    return float((out.double() - ref).abs().max())


def main():
    dims = [int(d) for d in sys.argv[1].split(",")] if len(sys.argv) > 1 else [128, 64]
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention
    compiled = torch.compile(torch_flex_attention, dynamic=False)
    defaults = launch.DENSE_FORWARD, launch.FWD_WARP_SPECIALIZE
    rows = []
    for (B, H, S, D) in [(4, 16, 8192, 128), (16, 16, 8192, 64)]:
        if D not in dims:
            continue
        q, k, v = [torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        torch_ms = _median_ms(lambda: compiled(q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cudnn_ms = _median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
        rows.append(["torch flex", f"D{D}", "", "", round(torch_ms, 3), 1.0, ""])
        rows.append(["sdpa cudnn", f"D{D}", "", "", round(cudnn_ms, 3), round(torch_ms / cudnn_ms, 3), ""])
        for label, (dense, tma, ws) in VARIANTS.items():
            launch.DENSE_FORWARD, launch.FWD_WARP_SPECIALIZE = dense, ws
            for m, n, w, st in TILES[D]:
                opts = dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=st, USE_TMA=tma)
                tile = f"{m}x{n} {w}w {st}s"
                try:
                    err = _error(D, opts)
                    ms = _median_ms(lambda: flex_attention(q, k, v, kernel_options=opts))
                    row = [label, f"D{D}", tile, f"{err:.1e}", round(ms, 3), round(torch_ms / ms, 3),
                           round(cudnn_ms / ms, 3)]
                except Exception as e:  # noqa: BLE001 - a variant that fails to compile is a finding
                    row = [label, f"D{D}", tile, f"{type(e).__name__}: {str(e).splitlines()[0][:80]}", "", "", ""]
                rows.append(row)
                print(row, flush=True)
    launch.DENSE_FORWARD, launch.FWD_WARP_SPECIALIZE = defaults
    print(tabulate(rows, headers=["variant", "D", "tile", "max err vs fp64", "fwd ms", "speedup vs torch flex",
                                  "vs cuDNN"], tablefmt="github"))


if __name__ == "__main__":
    main()
