"""A process's first flexlite call at the harness's D64 full shape (B16 H16 S8192 D64, bf16), each mode in a fresh
process with empty flexlite and Triton caches (NOTES 105): where the first call's time goes.

Modes (comma-separated):
- ``plain``: the first call right after the inputs are made (as the harness before NOTES 105);
- ``mm``: after a small matmul (cuBLAS up, as the harness's ``bench.warm_torch`` since NOTES 105);
- ``prof``: ``plain`` under cProfile (the main thread's top functions by own time);
- ``eager``: ``eager.forward`` three times first (its GPU work cold and warm), then the first call.
Each prints the CUDA context's start, flexlite's import, the first call (``eager=1``: it ran in torch ops while its
kernels compiled), the worker's remaining compile time and a second call.

Usage: python benchmarks/probe_first_process.py [plain,mm,prof,eager]   (CUDA)"""

import os
import subprocess
import sys
import tempfile

CHILD = r'''
import io, sys, time, cProfile, pstats
import torch
mode = sys.argv[1]
t0 = time.perf_counter()
torch.ones(1, device="cuda")
torch.cuda.synchronize()
t_ctx = time.perf_counter() - t0
from flexlite import eager, first_calls, flex_attention
t_import = time.perf_counter() - t0 - t_ctx
warm = 0.0
if mode == "mm":
    t = time.perf_counter()
    torch.ones(64, 64, device="cuda").matmul(torch.ones(64, 64, device="cuda"))
    torch.cuda.synchronize()
    warm = time.perf_counter() - t
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = [torch.randn(16, 16, 8192, 64, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
torch.cuda.synchronize()
if mode == "eager":
    for i in range(3):
        t = time.perf_counter()
        eager.forward(q, k, v, None, None, 64 ** -0.5)
        torch.cuda.synchronize()
        print(mode, "eager.forward %d: %.3f s" % (i, time.perf_counter() - t))
prof = cProfile.Profile() if mode == "prof" else None
e0 = first_calls.ran_eager()
t = time.perf_counter()
if prof:
    prof.enable()
flex_attention(q, k, v)
torch.cuda.synchronize()
if prof:
    prof.disable()
first = time.perf_counter() - t
print(mode, "CUDA context %.3f s, flexlite import %.3f s, matmul warm-up %.3f s, first call %.3f s, eager=%d"
      % (t_ctx, t_import, warm, first, first_calls.ran_eager() - e0), flush=True)
if prof:
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(15)
    print(s.getvalue())
t = time.perf_counter()
first_calls.wait()
print(mode, "worker done %.2f s later" % (time.perf_counter() - t))
t = time.perf_counter()
flex_attention(q, k, v)
torch.cuda.synchronize()
print(mode, "second call %.3f s" % (time.perf_counter() - t))
'''


def main():
    modes = sys.argv[1] if len(sys.argv) > 1 else "plain,mm,prof,eager"
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for mode in modes.split(","):
        with tempfile.TemporaryDirectory() as d:
            env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(d, "triton"), FLEXLITE_CACHE_DIR=os.path.join(d, "f"),
                       PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
            subprocess.run([sys.executable, "-c", CHILD, mode], env=env, cwd=d, check=False)  # (cwd: no ./flexlite)


if __name__ == "__main__":
    main()
