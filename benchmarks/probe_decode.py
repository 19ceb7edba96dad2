"""GPU probe for decode tuning: one-token decoding (bf16, D128, 32 query / 8 KV heads) under several decode
tile settings (launch.DECODE_TILES: keys per step, warps, stages, programs per SM), next to SDPA; each
setting is first checked against the fp64 reference. Prints a table; benchmarks/NOTES.md records what it showed.
"""

import itertools

import torch
import triton.testing
from tabulate import tabulate

from flexlite import attention_reference, flex_attention
from flexlite.bench import copy_bandwidth_gbps
from flexlite.runtime import launch

SHAPES = [(8, 32, 8, 32768, 128), (1, 32, 8, 131072, 128)]
SPACE = [dict(BLOCK_N=bn, num_warps=w, num_stages=s, waves=waves)
         for bn, w, s, waves in itertools.product((64, 128), (4, 8), (2, 3, 4), (2, 4))]


def main():
    copy_bw = copy_bandwidth_gbps()
    default = dict(launch.DECODE_TILES)
    rows = []
    for (B, Hq, Hkv, Lkv, D) in SHAPES:
        q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
        k, v = [torch.randn(B, Hkv, Lkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        ref, _ = attention_reference(q, k, v, enable_gqa=True)
        nbytes = (q.numel() * 2 + k.numel() + v.numel()) * q.element_size()
        sdpa = triton.testing.do_bench(
            lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True), rep=50)
        for tiles in SPACE:
            launch.DECODE_TILES.clear()
            launch.DECODE_TILES.update(tiles)
            name = "BN{BLOCK_N} w{num_warps} s{num_stages} waves{waves}".format(**tiles)
            try:
                err = (flex_attention(q, k, v, enable_gqa=True).double() - ref).abs().max().item()
                ms = triton.testing.do_bench(lambda: flex_attention(q, k, v, enable_gqa=True), rep=50)
                rows.append([f"B{B} Lkv{Lkv}", name, f"{err:.1e}", round(ms, 4), round(sdpa, 4),
                             round(sdpa / ms, 3), round(100 * nbytes / ms / 1e6 / copy_bw, 1)])
            except Exception as e:  # noqa: BLE001 - a setting that does not compile or fit: note it, go on
                rows.append([f"B{B} Lkv{Lkv}", name, type(e).__name__, "", "", "", ""])
            print(rows[-1], flush=True)
    launch.DECODE_TILES.clear()
    launch.DECODE_TILES.update(default)
    print(f"copy bandwidth {copy_bw:.0f} GB/s")
    print(tabulate(rows, headers=["shape", "tiles", "max err", "flexlite ms", "sdpa ms", "x sdpa", "% copy bw"],
                   tablefmt="github"))


if __name__ == "__main__":
    main()
