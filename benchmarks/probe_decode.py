"""GPU probe for decode tuning: one-token decoding (bf16, D128, 32 query / 8 KV heads) under several decode
tile settings (launch.DECODE_TILES: keys per step, warps, stages, programs per SM), next to SDPA; each
setting is first checked against the fp64 reference. Prints a table; benchmarks/NOTES.md records what it showed.

``--splits``: the split count instead. ``--variants``: tensor-descriptor loads and programmatic dependent
launch of the combine kernel, eager and CUDA-graph times. ``--host``: host time per call at a size where the
GPU is idle most of the time, and where it goes (cProfile). ``--kernels``: each GPU kernel's time per step
(torch.profiler), flexlite's against SDPA's, to place the gap between the two.
"""

import cProfile
import itertools
import pstats
import sys
import time

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


# (run at commit eb8953b, PDL off by default then: pdl, tma, tma+pdl, and tma+pdl with 3 stages / 128-wide tiles)
VARIANTS = [dict(), dict(use_pdl=False), dict(use_tma=True)]


def variant_rows(copy_bw: float) -> list:
    default = dict(launch.DECODE_TILES)
    rows = []
    for label, q, k, v, ref, nbytes, sdpa in decode_shapes():
        sdpa_graph = triton.testing.do_bench_cudagraph(
            lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        for variant in VARIANTS:
            launch.DECODE_TILES.update(default, **variant)
            name = ",".join(f"{k}={v}" for k, v in variant.items()) or "default"
            try:
                out = torch.full_like(q, float("nan"))
                out.copy_(flex_attention(q, k, v, enable_gqa=True))
                err = (out.double() - ref).abs().max().item()
                ms = triton.testing.do_bench(lambda: flex_attention(q, k, v, enable_gqa=True), rep=100)
                graph_ms = triton.testing.do_bench_cudagraph(lambda: flex_attention(q, k, v, enable_gqa=True))
                rows.append([label, name, f"{err:.1e}", round(ms, 4), round(sdpa, 4), round(graph_ms, 4),
                             round(sdpa_graph, 4), round(sdpa_graph / graph_ms, 3),
                             round(100 * nbytes / graph_ms / 1e6 / copy_bw, 1)])
            except Exception as e:  # noqa: BLE001 - a setting that does not compile: note it, go on
                rows.append([label, name, f"{type(e).__name__}: {str(e)[:80]}"] + [""] * 6)
            print(rows[-1], flush=True)
    launch.DECODE_TILES.clear()
    launch.DECODE_TILES.update(default)
    return rows


def host_report():
    """Host microseconds per call (GPU work ~10 us, so the host is the limit), flexlite vs SDPA, then the
    cProfile top of flexlite's calls."""
    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k, v = [torch.randn(1, 8, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    calls = {"flexlite": lambda: flex_attention(q, k, v, enable_gqa=True),
             "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True),
             "torch.empty x4": lambda: [torch.empty(4096, device="cuda") for _ in range(4)]}
    for name, fn in calls.items():
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(500):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        print(f"host {name}: {(t1 - t0) / 500 * 1e6:.1f} us per call", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(500):
        calls["flexlite"]()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


def kernel_report():
    """Per shape: each CUDA kernel's average time over 50 steps of flexlite and of SDPA (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    for label, q, k, v, ref, nbytes, sdpa in decode_shapes():
        calls = {"flexlite": lambda: flex_attention(q, k, v, enable_gqa=True),
                 "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)}
        for name, fn in calls.items():
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(50):
                    fn()
                torch.cuda.synchronize()
            rows = [[label, name, e.key[:70], e.count, round(e.device_time_total / e.count, 1)]
                    for e in prof.key_averages() if e.device_time_total > 0]
            print(tabulate(rows, headers=["shape", "call", "kernel", "launches", "us each"], tablefmt="github"),
                  flush=True)


def main():
    copy_bw = copy_bandwidth_gbps()
    if "--kernels" in sys.argv:
        kernel_report()
        return
    if "--host" in sys.argv:
        host_report()
        return
    if "--variants" in sys.argv:
        rows = variant_rows(copy_bw)
        print(tabulate(rows, headers=["shape", "variant", "max err", "flexlite ms", "sdpa ms", "graph ms",
                                      "sdpa graph ms", "graph x sdpa", "graph % copy bw"], tablefmt="github"))
        return
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
