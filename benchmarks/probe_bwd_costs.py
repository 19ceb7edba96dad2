"""GPU probe: where the Gluon backward's time goes beyond its tiles (NOTES 42), in one process:

1. per harness mask and head dim, the backward's kernels' GPU time per call (torch.profiler): the Delta preprocess,
   zeroing the fp32 dQ buffer, the warp-specialized dK / dV / dQ kernel, the cast to dq; for each of VARIANTS (a
   program per key block, a persistent grid, or either by the walk's length: launch.WS_BWD_PERSISTENT; runs 4 and 5
   of results/probes/bwd_costs-H200.md compared the walk orders, launch.WS_BWD_FULL_FIRST, and mask_mod's query
   values in the tile's layout or on a compact vector, launch.WS_BWD_QUERY_VALUES, in the same way);
2. at D128 without a mask, the kernel's time against its walk's length (queries 512 ... 8192 for 8192 keys: the same
   programs walking 8 ... 128 tiles; the intercept of a fit is the per-program cost), with the persistent grid too,
   and the same walks through block lists of full blocks only and of partial blocks only (a mask that keeps every
   score): what the masked kernels' full and partial tiles cost against the dense kernel's.

Gradients are checked by the harness and the GPU tests, not here (the timings are of the same kernels).

Usage: python benchmarks/probe_bwd_costs.py [mask,mask,...] [D,D,...] [--no-walks] [--shapes=BxHxSxD,...]
(``--shapes``: other shapes than the harness's; ``--triton``: the Triton kernels as a variant too, kernel_options
WARP_SPECIALIZE=False)"""

import sys

import torch
from tabulate import tabulate

from flexlite import BlockMask, first_calls, flex_attention
from flexlite.bench import _median_ms, probe_args, probe_cases, probe_shapes
from flexlite.runtime import launch

KINDS = (("preprocess", "preprocess"), ("dK/dV/dQ kernel", "ws_dkdv"), ("dQ kernel", "bwd_dq"),
         ("zero dQ buffer", "fill"), ("cast dq", "copy"))


def kernel_ms(fn, calls: int = 5) -> dict:
    """GPU time per call of ``fn`` by kind of kernel (KINDS; anything else under its own name)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if not us:
            continue
        kind = next((label for label, key in KINDS if key in e.key.lower()), e.key[:40])
        times[kind] = times.get(kind, 0.0) + us / 1e3 / calls
    return times


# the kernel variants compared (launch settings): the grids of NOTES 43, 47 (run 5 of results/probes/bwd_costs-H200.md
# compared mask_mod's query values, launch.WS_BWD_QUERY_VALUES, the same way)
VARIANTS = (("per key block", {"WS_BWD_PERSISTENT": False}), ("persistent", {"WS_BWD_PERSISTENT": True}),
            ("by walk (default)", {"WS_BWD_PERSISTENT": None}))


def costs(masks, dims, shapes, triton: bool = False):
    saved = {name: getattr(launch, name) for _, settings in VARIANTS for name in settings}
    variants = [(label, settings, None) for label, settings in VARIANTS]
    if triton:
        variants.append(("Triton kernels", {}, {"WARP_SPECIALIZE": False}))
    rows = []
    for D, q, k, v, case, bm in probe_cases(masks, dims, shapes=shapes):
        for label, settings, options in variants:
            for name, value in saved.items():
                setattr(launch, name, settings.get(name, value))
            # (a new kind of call's first forward and backward: compiled, or run while their kernels compile)
            flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm, kernel_options=options).sum().backward()
            first_calls.wait()
            out = flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm, kernel_options=options)
            dout = torch.randn_like(out)

            def bwd():
                q.grad = k.grad = v.grad = None  # (not timing the gradients' accumulation)
                out.backward(dout, retain_graph=True)

            t = kernel_ms(bwd)
            total = _median_ms(bwd)
            rows.append([case.name, f"S{q.shape[2]} D{D}", label, round(total, 3)]
                        + [round(t.pop(label_, 0.0), 3) for label_, _ in KINDS]
                        + [", ".join(f"{n}: {ms:.3f}" for n, ms in t.items())])
            print(rows[-1], flush=True)
    for name, value in saved.items():
        setattr(launch, name, value)
    print(tabulate(rows, headers=["mask", "D", "variant", "bwd ms (do_bench)"] + [f"{label} ms" for label, _ in KINDS]
                   + ["other kernels (ms)"], tablefmt="github"), flush=True)


def walks():
    B, H, Lkv, D = 4, 16, 8192, 128
    k, v = [torch.randn(B, H, Lkv, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2)]
    rows, fits = [], {False: [], True: []}
    keep_all = lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + Lkv  # noqa: E731 (keeps every score)
    saved = launch.WS_BWD_PERSISTENT
    for Lq in (512, 1024, 2048, 4096, 8192):
        q = torch.randn(B, H, Lq, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        n_q, n_kv = Lq // 128, Lkv // 128
        every = torch.arange(n_kv, device="cuda", dtype=torch.int32).expand(B, H, n_q, n_kv).contiguous()
        counts = torch.full((B, H, n_q), n_kv, device="cuda", dtype=torch.int32)
        # the same walk as the dense one, through the block lists: every block full (the kernel with both kinds of
        # tile, walking full ones), every block partial (mask_mod on each tile)
        full = BlockMask.from_kv_blocks(torch.zeros_like(counts), every, counts, every, mask_mod=keep_all)
        partial = BlockMask.from_kv_blocks(counts, every, mask_mod=keep_all)
        row = [Lq, Lq // 64]
        for bm, persistent in ((None, False), (None, True), (full, False), (partial, False)):
            launch.WS_BWD_PERSISTENT = persistent
            out = flex_attention(q, k, v, block_mask=bm)
            dout = torch.randn_like(out)
            row.append(round(kernel_ms(lambda: out.backward(dout, retain_graph=True))["dK/dV/dQ kernel"], 3))
            if bm is None:
                fits[persistent].append((B * H * n_kv * Lq // 64, row[-1]))
        rows.append(row + [round(row[4] / row[2], 3), round(row[5] / row[2], 3)])
        print(rows[-1], flush=True)
    launch.WS_BWD_PERSISTENT = saved
    print(tabulate(rows, headers=["queries", "tiles per program", "kernel ms (dense)", "kernel ms (dense, persistent)",
                                  "kernel ms (full blocks)", "kernel ms (partial blocks)", "full blocks / dense",
                                  "partial blocks / dense"], tablefmt="github"))
    # t = a * tiles + b * key blocks (fixed: B * H * n_kv) -> per tile and per key block, per SM
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    blocks = B * H * (Lkv // 128)
    for persistent, fit in fits.items():
        x = torch.tensor([[tiles, 1.0] for tiles, _ in fit], dtype=torch.float64)
        y = torch.tensor([ms for _, ms in fit], dtype=torch.float64)
        a, b = torch.linalg.lstsq(x, y.unsqueeze(1)).solution.squeeze(1).tolist()
        print(f"fit (dense{', persistent' if persistent else ''}): {a * 1e3 * sms:.3f} us per tile and SM, "
              f"{b * 1e3 * sms / blocks:.3f} us per key block and SM ({blocks} key blocks, {sms} SMs)", flush=True)


def main():
    masks, dims = probe_args(sys.argv)
    costs(masks, dims, probe_shapes(sys.argv), triton="--triton" in sys.argv)
    if 128 in dims and "--no-walks" not in sys.argv:
        walks()


if __name__ == "__main__":
    main()
