"""First-call latency of a new mod, each in a fresh process: with cold caches (its kernel is traced,
generated, written and compiled by Triton) and then again with the on-disk caches warm (flexlite's kernel
file and Triton's compiled binary exist; tracing and code generation still run). Prints a table.

Usage: python benchmarks/first_call.py  (CUDA; uses a temporary FLEXLITE_CACHE_DIR / TRITON_CACHE_DIR)
"""

import os
import subprocess
import sys
import tempfile

from tabulate import tabulate

CHILD = r"""
import time, torch
t0 = time.perf_counter()
from flexlite import create_block_mask, flex_attention
def mod(score, b, h, q_idx, kv_idx):
    return score + 0.125 * (q_idx - kv_idx)
def mask(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 512)
q, k, v = [torch.randn(1, 8, 2048, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
torch.cuda.synchronize()
t1 = time.perf_counter()
bm = create_block_mask(mask, None, None, 2048, 2048, device="cuda")
flex_attention(q, k, v, score_mod=mod, block_mask=bm)
torch.cuda.synchronize()
t2 = time.perf_counter()
flex_attention(q, k, v, score_mod=mod, block_mask=bm)
torch.cuda.synchronize()
print(f"{t1 - t0:.3f} {t2 - t1:.3f} {time.perf_counter() - t2:.4f}")
"""


def main():
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, FLEXLITE_CACHE_DIR=os.path.join(tmp, "flexlite"),
                   TRITON_CACHE_DIR=os.path.join(tmp, "triton"))
        for label in ("cold caches", "warm on-disk caches"):
            out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
            imports, first, second = out.stdout.split()
            rows.append([label, imports, first, second])
    print(tabulate(rows, headers=["process", "import + inputs s", "first call s (mask + attention)",
                                  "second call s"], tablefmt="github"))


if __name__ == "__main__":
    main()
