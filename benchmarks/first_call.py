"""First-call latency of a new mod, each in a fresh process: with cold caches (its kernel is traced,
generated, written and compiled by Triton) and then again with the on-disk caches warm (flexlite's kernel
file and Triton's compiled binary exist; tracing and code generation still run). Prints a table.

The last column: a second new mod in the same process, once CUDA, torch's kernels and Triton are warm (what
a user defining mods in a notebook sees). ``--profile``: cProfile of that call in both processes (stderr);
``--profile-first``: of the process's first call instead.

Usage: python benchmarks/first_call.py [--profile | --profile-first]  (CUDA; uses a temporary FLEXLITE_CACHE_DIR / TRITON_CACHE_DIR)
"""

import os
import subprocess
import sys
import tempfile

from tabulate import tabulate

CHILD = r"""
import os, time, torch
PROFILE = os.environ.get("FIRST_CALL_PROFILE") == "1"  # the second mod ("first": the first call)
t0 = time.perf_counter()
from flexlite import create_block_mask, flex_attention
def mod(score, b, h, q_idx, kv_idx):
    return score + 0.125 * (q_idx - kv_idx)
def mask(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 512)
q, k, v = [torch.randn(1, 8, 2048, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
torch.cuda.synchronize()
first = None
if os.environ.get("FIRST_CALL_PROFILE") == "first":
    import cProfile
    first = cProfile.Profile()
    first.enable()
import sys, threading
prewarming = any(t.name == "flexlite-prewarm" and t.is_alive() for t in threading.enumerate())
print(f"flexlite's prewarm thread still running at the first call: {prewarming}", file=sys.stderr)
t1 = time.perf_counter()
bm = create_block_mask(mask, None, None, 2048, 2048, device="cuda")
flex_attention(q, k, v, score_mod=mod, block_mask=bm)
torch.cuda.synchronize()
t2 = time.perf_counter()
if first is not None:
    import pstats, sys
    first.disable()
    pstats.Stats(first, stream=sys.stderr).sort_stats("cumulative").print_stats(45)
flex_attention(q, k, v, score_mod=mod, block_mask=bm)
torch.cuda.synchronize()
t3 = time.perf_counter()
# a second new mod in this process, now that CUDA, torch's kernels and Triton are warm
def mod2(score, b, h, q_idx, kv_idx):
    return score - 0.0625 * (q_idx - kv_idx)
def mask2(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 256)
prof = None
if PROFILE:
    import cProfile
    prof = cProfile.Profile()
    prof.enable()
t4 = time.perf_counter()
bm2 = create_block_mask(mask2, None, None, 2048, 2048, device="cuda")
flex_attention(q, k, v, score_mod=mod2, block_mask=bm2)
torch.cuda.synchronize()
t5 = time.perf_counter()
print(f"{t1 - t0:.3f} {t2 - t1:.3f} {t3 - t2:.4f} {t5 - t4:.3f}")
if prof is not None:
    import pstats, sys
    prof.disable()
    pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(45)
"""


def main():
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, FLEXLITE_CACHE_DIR=os.path.join(tmp, "flexlite"),
                   TRITON_CACHE_DIR=os.path.join(tmp, "triton"))
        for label in ("cold caches", "warm on-disk caches"):
            if "--profile" in sys.argv or "--profile-first" in sys.argv:
                env["FIRST_CALL_PROFILE"] = "1" if "--profile" in sys.argv else "first"
            out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
            rows.append([label, *out.stdout.split()])
            if out.stderr:
                print(f"== {label}\n{out.stderr[-12000:]}", file=sys.stderr)
    print(tabulate(rows, headers=["process", "import + inputs s", "first call s (mask + attention)",
                                  "second call s", "a second new mod's first call s (warm process)"],
                   tablefmt="github"))


if __name__ == "__main__":
    main()
