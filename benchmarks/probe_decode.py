"""GPU probe for decode tuning (``--splits``: the split count instead): one-token decoding (bf16, D128, 32 query / 8 KV heads) under several decode
tile settings (launch.DECODE_TILES: keys per step, warps, stages, programs per SM), next to SDPA; each
setting is first checked against the fp64 reference. Prints a table; benchmarks/NOTES.md records what it showed.
"""

import itertools
import sys

import torch
import triton.testing
from tabulate import tabulate

from flexlite import attention_reference, flex_attention
from flexlite.bench import copy_bandwidth_gbps
from flexlite.runtime import launch

SHAPES = [(8, 32, 8, 32768, 128), (1, 32, 8, 131072, 128)]
SPACE = [dict(BLOCK_N=bn, num_warps=w, num_stages=s, waves=waves)
         for bn, w, s, waves in itertools.product((64, 128), (4, 8), (2, 3, 4), (2, 4))]
SPLITS = [None, 8, 9, 12, 16, 17, 24, 33, 48, 66, 99, 132]  # DECODE_SPLITS pins, under the default tiles


def decode_shapes():
    """Per shape: its label, q, k, v, the fp64 reference, the bytes a decode step must read and SDPA's ms."""
    for (B, Hq, Hkv, Lkv, D) in SHAPES:
        q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
        k, v = [torch.randn(B, Hkv, Lkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        ref, _ = attention_reference(q, k, v, enable_gqa=True)
        nbytes = (q.numel() * 2 + k.numel() + v.numel()) * q.element_size()
        sdpa = triton.testing.do_bench(
            lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True), rep=50)
        yield f"B{B} Lkv{Lkv}", q, k, v, ref, nbytes, sdpa


def splits_rows(copy_bw: float) -> list:
    """Under the default tiles: the split count the heuristic picks against pinned ones."""
    rows = []
    for label, q, k, v, ref, nbytes, sdpa in decode_shapes():
        for splits in SPLITS:
            opts = {} if splits is None else {"DECODE_SPLITS": splits}
            err = (flex_attention(q, k, v, enable_gqa=True, kernel_options=opts).double() - ref).abs().max().item()
            ms = triton.testing.do_bench(lambda: flex_attention(q, k, v, enable_gqa=True, kernel_options=opts),
                                         rep=50)
            graph_ms = triton.testing.do_bench_cudagraph(
                lambda: flex_attention(q, k, v, enable_gqa=True, kernel_options=opts))
            rows.append([label, f"splits {splits or 'default'}", f"{err:.1e}", round(ms, 4),
                         round(graph_ms, 4), round(sdpa, 4), round(sdpa / ms, 3),
                         round(100 * nbytes / ms / 1e6 / copy_bw, 1)])
            print(rows[-1], flush=True)
    return rows


def main():
    copy_bw = copy_bandwidth_gbps()
    if "--splits" in sys.argv:
        rows = splits_rows(copy_bw)
        print(tabulate(rows, headers=["shape", "splits", "max err", "flexlite ms", "cuda-graph ms", "sdpa ms",
                                      "x sdpa", "% copy bw"], tablefmt="github"))
        return
    default = dict(launch.DECODE_TILES)
    rows = []
    for label, q, k, v, ref, nbytes, sdpa in decode_shapes():
        for tiles in SPACE:
            launch.DECODE_TILES.clear()
            launch.DECODE_TILES.update(tiles)
            name = "BN{BLOCK_N} w{num_warps} s{num_stages} waves{waves}".format(**tiles)
            try:
                err = (flex_attention(q, k, v, enable_gqa=True).double() - ref).abs().max().item()
                ms = triton.testing.do_bench(lambda: flex_attention(q, k, v, enable_gqa=True), rep=50)
                rows.append([label, name, f"{err:.1e}", round(ms, 4), round(sdpa, 4),
                             round(sdpa / ms, 3), round(100 * nbytes / ms / 1e6 / copy_bw, 1)])
            except Exception as e:  # noqa: BLE001 - a setting that does not compile or fit: note it, go on
                rows.append([label, name, type(e).__name__, "", "", "", ""])
            print(rows[-1], flush=True)
    launch.DECODE_TILES.clear()
    launch.DECODE_TILES.update(default)
    print(f"copy bandwidth {copy_bw:.0f} GB/s")
    print(tabulate(rows, headers=["shape", "tiles", "max err", "flexlite ms", "sdpa ms", "x sdpa", "% copy bw"],
                   tablefmt="github"))


if __name__ == "__main__":
    main()
