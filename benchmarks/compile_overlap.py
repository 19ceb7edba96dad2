"""A new mod's first training step compiles two kernels, the forward's and the backward's: one after the other, or
the backward in a thread while the forward compiles? Offline (sm_90a, no GPU: benchmarks/offline_compile.py), the
Gluon forward and dK / dV kernels of a causal document mask at D128, each way in its own process with an empty
Triton cache; wall times of the forward's compile and of both (NOTES 66: not kept, the forward's own compile gets
slower, Triton's front end and LLVM passes holding the GIL).

Usage: python benchmarks/compile_overlap.py   (runs both ways, each in a child process)"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time


def measure(together: bool) -> str:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from offline_compile import compile_backward_ws, compile_forward_ws, offline_cuda

    from flexlite import create_block_mask
    from flexlite.masks import generate_causal_document_mask

    L = 2048
    bm = create_block_mask(generate_causal_document_mask([L // 8] * 8), None, None, L, L, device="cpu")
    with offline_cuda():  # entered once here: the compiles' own (nested) contexts then leave the patches in place
        t0 = time.perf_counter()
        if together:
            backward = threading.Thread(target=compile_backward_ws, args=(None, bm, 128), kwargs=dict(L=L))
            backward.start()
            compile_forward_ws(None, bm, 128, L=L)
            forward_s = time.perf_counter() - t0
            backward.join()
        else:
            compile_forward_ws(None, bm, 128, L=L)
            forward_s = time.perf_counter() - t0
            compile_backward_ws(None, bm, 128, L=L)
        both_s = time.perf_counter() - t0
    mode = "together" if together else "one after the other"
    return f"| {mode} | {forward_s:.2f} | {both_s:.2f} |"


def main():
    if len(sys.argv) > 1:  # the child: one way, with the cache directory its parent made
        print(measure(sys.argv[1] == "together"))
        return
    print("| compiles | forward's compile (s) | both (s) |\n|---|---|---|")
    for mode in ("after", "together"):
        with tempfile.TemporaryDirectory() as cache:
            out = subprocess.run([sys.executable, __file__, mode], capture_output=True, text=True,
                                 env=dict(os.environ, TRITON_CACHE_DIR=cache))
            print(out.stdout.strip().splitlines()[-1] if out.returncode == 0 else out.stderr[-2000:], flush=True)


if __name__ == "__main__":
    main()
