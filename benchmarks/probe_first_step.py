"""First training steps of new mods on a GPU, each process with its own caches (NOTES 73).

1. ``cold on`` / ``cold thread`` / ``cold bits`` / ``cold off``: a fresh process with empty flexlite and Triton
   caches, ``first_calls.ENABLED`` True / True / True / False, ``first_calls.EAGER`` True / True / False / False
   (NOTES 78: calls whose kernels are not compiled and that no bits serve run in torch ops), the worker's compiles in
   compile servers but for ``cold thread`` (``first_calls.COMPILE_PROCESSES = 0``: in the worker thread, NOTES 79);
   a training step (forward, ``out.sum().backward()``) of
   a. causal (the process's first mask_mod: its own kernels compile in the call; with first_calls on its backward
      compiles in the worker beside the forward's compile),
   b. a sliding window of 512 (with first_calls on: the bits' kernels, its own compiling in the worker),
   c. causal with a new score_mod (a distance bias: its own kernels compile; the backward beside).
   The worker is waited for between steps (not counted), the main thread meanwhile running a host loop (200 small
   torch ops on the GPU, ~2 ms alone) again and again: how long the worker's compiles stall a training loop beside
   them (``loop_max_ms``, and ``loop_mean_x``: the mean loop's time over its time alone).
2. ``later``: a fresh process on the caches ``cold on`` left: a new mask_mod (prefix-LM 777 | causal) and a step;
   its first calls should take the bits' kernels from Triton's disk cache (the markers); then a block mask's flags
   at 8192 x 8192 in torch (a new mask_mod's, while its kernel compiles: NOTES 74) and by the kernel, warm.
3. ``graph``: a fresh process on the same caches: a new mask_mod's call (the worker then compiles its own kernels),
   and at once a CUDA graph captured of a call with a known mask (causal), replayed and compared with an eager call;
   prints whether the worker was compiling while the capture ran and whether its compile failed.

Usage: python benchmarks/probe_first_step.py [--out DIR] [--only cold_on,later] [--threads 2,4]
(``--threads``: also ``cold on`` with that many worker threads, ``first_calls.COMPILE_THREADS``, each on its own caches)   (CUDA; temporary caches;
FIRST_STEP_PROFILE=1: cProfile of each create_block_mask, forward and backward, to DIR/first_step-<mode>.txt)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from tabulate import tabulate

CHILD = r"""
import json, os, sys, time, torch
mode = sys.argv[1]
torch.ones(1, device="cuda").matmul(torch.ones(1, 1, device="cuda"))  # CUDA and cuBLAS up before any timing
torch.cuda.synchronize()
from flexlite import create_block_mask, first_calls, flex_attention
first_calls.ENABLED = mode != "cold off"
first_calls.EAGER = mode not in ("cold off", "cold bits")
if mode == "cold thread":
    first_calls.COMPILE_PROCESSES = 0
if mode.startswith("cold on ") and mode.endswith(" threads"):
    first_calls.COMPILE_THREADS = int(mode.split()[2])
small = torch.ones(64, device="cuda")
def host_loop():
    t, x = time.perf_counter(), small
    for _ in range(200):
        x = x * 1.0001 + 0.1
    torch.cuda.synchronize()
    return time.perf_counter() - t
host_loop()
LOOP_ALONE = min(host_loop() for _ in range(5))
L, D = 4096, 128
def inputs():
    return [torch.randn(1, 16, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
q, k, v = inputs()
def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx
def window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 512)
def prefix(b, h, q_idx, kv_idx):
    return (kv_idx < 777) | (q_idx >= kv_idx)
def bias(score, b, h, q_idx, kv_idx):
    return score - 0.01 * (q_idx - kv_idx)
PROFILE = os.environ.get("FIRST_STEP_PROFILE") == "1"
def profiled(name, fn):
    if not PROFILE:
        return fn()
    import cProfile, pstats
    prof = cProfile.Profile()
    try:
        return prof.runcall(fn)
    finally:
        print(f"===== {mode}: {name}", file=sys.stderr)
        pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(40)
def step(mask, score_mod=None):
    bits0, eager0 = first_calls.ran_bits(), first_calls.ran_eager()
    t0 = time.perf_counter()
    bm = profiled(f"{mask.__name__} create_block_mask",
                  lambda: create_block_mask(mask, None, None, L, L, device="cuda"))
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    out = profiled(f"{mask.__name__} forward", lambda: flex_attention(q, k, v, score_mod=score_mod, block_mask=bm))
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    profiled(f"{mask.__name__} backward", lambda: out.sum().backward())
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    loops = []
    while first_calls._pending:
        loops.append(host_loop())
    first_calls.wait()
    t4 = time.perf_counter()
    stalls = {"loop_max_ms": round(1e3 * max(loops), 1), "loop_mean_x": round(sum(loops) / len(loops) / LOOP_ALONE, 2)
              } if loops else {}
    return {"mask_s": round(t1 - t0, 3), "fwd_s": round(t2 - t1, 3), "bwd_s": round(t3 - t2, 3),
            "step_s": round(t3 - t0, 3), "worker_after_s": round(t4 - t3, 3),
            "bits_calls": first_calls.ran_bits() - bits0, "eager_calls": first_calls.ran_eager() - eager0, **stalls}
rows = {}
if mode.startswith("cold"):
    rows["a causal (first mask_mod)"] = step(causal)
    rows["b sliding window 512"] = step(window)
    rows["c causal + new score_mod"] = step(causal, bias)
elif mode == "later":
    rows["new mask_mod, later process"] = step(prefix)
    # a new mask_mod's block mask in torch (first_calls.MAX_TORCH_POSITIONS = 2**26 positions: 8192 x 8192) against
    # the compiled kernel, each warm, and the torch path's extra peak memory
    import flexlite.block_mask as bmm
    def timed(fn):
        fn()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return round(time.perf_counter() - t0, 4), round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
    args = (prefix, 1, 1, 8192, 8192, torch.device("cuda", torch.cuda.current_device()), (128, 128))
    (torch_s, torch_mb), (kernel_s, kernel_mb) = (timed(lambda: bmm._block_flags_vmap(*args, bmm._CUDA_CHUNK_ELEMENTS)),
                                                  timed(lambda: bmm._block_flags_kernel(*args)))
    rows["block flags 8192 x 8192, torch / kernel"] = {"torch_s": torch_s, "torch_peak_mb": torch_mb,
                                                       "kernel_s": kernel_s, "kernel_peak_mb": kernel_mb}
else:  # graph
    known = create_block_mask(causal, None, None, L, L, device="cuda")
    q2, k2, v2 = [t.detach() for t in inputs()]
    flex_attention(q2, k2, v2, block_mask=known)  # known kernels (from the disk caches)
    torch.cuda.synchronize()
    first_calls.wait()
    new = create_block_mask(lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx < 333), None, None, L, L,
                            device="cuda")
    flex_attention(q2, k2, v2, block_mask=new)  # bits; the worker compiles its own now
    compiling_at_start = bool(first_calls._pending)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        flex_attention(q2, k2, v2, block_mask=known)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    err = None
    try:
        with torch.cuda.graph(graph):
            out = flex_attention(q2, k2, v2, block_mask=known)
        graph.replay()
        torch.cuda.synchronize()
        same = bool(torch.equal(out, flex_attention(q2, k2, v2, block_mask=known)))
    except Exception as e:  # what a user would see
        err, same = f"{type(e).__name__}: {str(e)[:200]}", None
    compiling_at_end = bool(first_calls._pending)
    try:
        first_calls.wait()
        worker_error = None
    except Exception as e:
        worker_error = f"{type(e).__name__}: {str(e)[:200]}"
    rows["graph capture while the worker compiles"] = {
        "worker_compiling_at_capture_start": compiling_at_start, "worker_compiling_at_capture_end": compiling_at_end,
        "capture_error": err, "replay_equals_eager": same, "worker_failed_keys": len(first_calls._failed),
        "worker_error": worker_error}
print(json.dumps(rows))
"""


THREADS = sys.argv[sys.argv.index("--threads") + 1].split(",") if "--threads" in sys.argv else []
ONLY = [m.replace("_", " ") for m in sys.argv[sys.argv.index("--only") + 1].split(",")] if "--only" in sys.argv else []


def main():
    out_dir = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else None
    table, results = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        threads = [f"cold on {n} threads" for n in THREADS]
        modes = [m for m in ("cold off", "cold bits", "cold thread", "cold on", *threads, "later", "graph")
                 if not ONLY or m in ONLY or m in threads]
        for mode in modes:
            caches = {"cold off": "off", "cold bits": "bits", "cold thread": "thread"}.get(
                mode, mode.replace(" ", "_") if mode.endswith("threads") else "on")
            env = dict(os.environ, FLEXLITE_CACHE_DIR=os.path.join(tmp, caches, "flexlite"),
                       TRITON_CACHE_DIR=os.path.join(tmp, caches, "triton"))
            proc = subprocess.run([sys.executable, "-c", CHILD, mode], env=env, capture_output=True, text=True)
            if out_dir and proc.stderr:
                with open(os.path.join(out_dir, f"first_step-{mode.replace(' ', '_')}.txt"), "w") as f:
                    f.write(proc.stderr)
            if proc.returncode:
                print(f"== {mode}: exit {proc.returncode}\n{proc.stderr[-6000:]}", file=sys.stderr)
                continue
            rows = json.loads(proc.stdout.strip().splitlines()[-1])
            results[mode] = rows
            for name, r in rows.items():
                table.append([mode, name, *(f"{k}={v}" for k, v in r.items())])
    text = tabulate(table, tablefmt="github")
    print(text)
    if out_dir:
        with open(os.path.join(out_dir, "first_step.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
