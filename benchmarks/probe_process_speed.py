"""GPU probe: does flexlite's Gluon forward at D128 change speed within a process after other work runs (NOTES 61:
one speed per process, different between processes)?

In one process: the forward of each mask timed (do_bench median), then WORKLOAD run, then the forwards timed again,
for three cycles. Run once per workload, each in a fresh process, to see which, if any, moves the next timings:
``none`` (nothing), ``torch_flex`` (torch's compiled flex_attention on the same inputs, as the harness runs it),
``cudnn`` (SDPA's cuDNN backend, causal), ``backward`` (flexlite's forward and backward), ``reference`` (the
harness's fp64 check, bench.check_against_reference). Prints a table: workload, cycle, mask, ms, and the wall
clock at the timing's start and end (to line up with an ``nvidia-smi --query-gpu=timestamp,clocks.sm,... -lms``
log taken beside it).

Usage: python benchmarks/probe_process_speed.py WORKLOAD [mask,mask,...] [--cycles=N]"""

import sys
import time

import torch
from tabulate import tabulate

from flexlite import flex_attention
from flexlite.bench import _median_ms, check_against_reference, probe_cases

WORKLOADS = ("none", "torch_flex", "cudnn", "backward", "reference")


def workload(name: str, cases: list):
    """Run ``name`` once over ``cases`` ((D, q, k, v, case, block mask) of bench.probe_cases)."""
    if name == "torch_flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention as torch_flex
        compiled = torch.compile(torch_flex, dynamic=False)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        for _, q, k, v, case, _ in cases:
            S = q.shape[-2]
            tbm = create_block_mask(case.mask_mod, None, None, S, S, device="cuda") if case.mask_mod else None
            for _ in range(20):
                compiled(q, k, v, score_mod=case.torch_score_mod, block_mask=tbm)
    elif name == "cudnn":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        _, q, k, v, _, _ = cases[0]
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            for _ in range(20):
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    elif name == "backward":
        for _, q, k, v, case, bm in cases:
            for _ in range(5):
                out = flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm)
                torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    elif name == "reference":
        for D, _, _, _, case, _ in cases:
            check_against_reference(case, D, "cuda", backward=True)
    elif name != "none":
        raise ValueError(f"WORKLOAD must be one of {WORKLOADS}; got {name!r}")
    torch.cuda.synchronize()


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    name = args[0] if args else "none"
    masks = args[1].split(",") if len(args) > 1 else ["document_8_causal", "causal", "prefix_lm_2048"]
    cycles = next((int(a.split("=", 1)[1]) for a in sys.argv if a.startswith("--cycles=")), 3)
    cases = list(probe_cases(masks, [128]))
    rows = []
    for cycle in range(cycles):
        for D, q, k, v, case, bm in cases:
            start = time.time()
            with torch.no_grad():
                ms = _median_ms(lambda: flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm))
            rows.append([name, cycle, case.name, round(ms, 4), time.strftime("%H:%M:%S", time.localtime(start))
                         + f".{int(start % 1 * 1000):03d}", f"{time.time() % 60:06.3f}"])
            print(rows[-1], flush=True)
        workload(name, cases)
    print(tabulate(rows, headers=["workload", "cycle (after that many runs of it)", "mask", "forward ms", "start",
                                  "end (s)"], tablefmt="github"), flush=True)


if __name__ == "__main__":
    main()
