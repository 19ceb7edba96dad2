"""GPU probe for the forward without a block mask: the block walk (a BlockMask whose blocks are all full: index
loads, block lists) against the dense walk that ``block_mask=None`` takes (one loop over every kv tile), each
with and without tensor descriptors (kernel_options USE_TMA), over a few tiles; torch's flex and SDPA (cuDNN) in
the same process. Each variant is first checked against the fp64 reference. Prints a table; benchmarks/NOTES.md
(25) records what it showed. (The run in NOTES 25 also tried Triton's warp specialization on the dense loop
through a switch that was removed since: it did not compile at 4 warps.)

Usage: python benchmarks/probe_dense.py [D,D,...]"""

import sys

import torch
from tabulate import tabulate

from flexlite import attention_reference, create_block_mask, flex_attention
from flexlite.bench import _median_ms

TILES = {128: [(128, 64, 4, 3), (128, 128, 4, 2), (128, 64, 4, 2), (128, 128, 8, 2)],
         64: [(128, 128, 4, 3), (128, 128, 4, 4), (128, 64, 4, 3), (128, 128, 8, 2)]}
# label: (walk the blocks of an all-full BlockMask, USE_TMA)
VARIANTS = {"block walk": (True, False), "block walk+tma": (True, True), "dense": (False, False),
            "dense+tma": (False, True)}


def _keep_all(b, h, q_idx, kv_idx):
    return q_idx >= 0


def _error(D: int, opts: dict, block_walk: bool) -> float:
    g = torch.Generator().manual_seed(0)
    q, k, v = [torch.randn(1, 2, 1024, D, generator=g).to("cuda", torch.bfloat16) for _ in range(3)]
    bm = create_block_mask(_keep_all, None, None, 1024, 1024, device="cuda") if block_walk else None
    out = flex_attention(q, k, v, block_mask=bm, kernel_options=opts)
    ref, _ = attention_reference(q, k, v)
    return float((out.double() - ref).abs().max())


def main():
    dims = [int(d) for d in sys.argv[1].split(",")] if len(sys.argv) > 1 else [128, 64]
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention
    compiled = torch.compile(torch_flex_attention, dynamic=False)
    rows = []
    for (B, H, S, D) in [(4, 16, 8192, 128), (16, 16, 8192, 64)]:
        if D not in dims:
            continue
        q, k, v = [torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        full = create_block_mask(_keep_all, None, None, S, S, device="cuda")
        torch_ms = _median_ms(lambda: compiled(q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cudnn_ms = _median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
        rows.append(["torch flex", f"D{D}", "", "", round(torch_ms, 3), 1.0, ""])
        rows.append(["sdpa cudnn", f"D{D}", "", "", round(cudnn_ms, 3), round(torch_ms / cudnn_ms, 3), ""])
        for label, (block_walk, tma) in VARIANTS.items():
            bm = full if block_walk else None
            for m, n, w, st in TILES[D]:
                opts = dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=st, USE_TMA=tma)
                tile = f"{m}x{n} {w}w {st}s"
                try:
                    err = _error(D, opts, block_walk)
                    ms = _median_ms(lambda: flex_attention(q, k, v, block_mask=bm, kernel_options=opts))
                    row = [label, f"D{D}", tile, f"{err:.1e}", round(ms, 3), round(torch_ms / ms, 3),
                           round(cudnn_ms / ms, 3)]
                except Exception as e:  # noqa: BLE001 - a variant that fails to compile is a finding
                    row = [label, f"D{D}", tile, f"{type(e).__name__}: {str(e).splitlines()[0][:80]}", "", "", ""]
                rows.append(row)
                print(row, flush=True)
    print(tabulate(rows, headers=["variant", "D", "tile", "max err vs fp64", "fwd ms", "speedup vs torch flex",
                                  "vs cuDNN"], tablefmt="github"))


if __name__ == "__main__":
    main()
