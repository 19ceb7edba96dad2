"""How long a kernel compile beside the calling thread stalls it: in a thread of this process, and through a compile
server (flexlite/runtime/compile_processes.py). No GPU: the Gluon forward compiles for sm_90a through
benchmarks/offline_compile.py's stand-in driver, while the main thread runs a host loop of small torch ops (one
torch thread, as a training loop's host side) again and again until the compile is done (NOTES 79).

Usage: python benchmarks/probe_compile_gil.py [--out DIR]   (a fresh Triton cache per run; prints a table, and with
--out writes DIR/compile_gil.json)"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time

os.environ.pop("TRITON_INTERPRET", None)
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="flexlite-gil-")

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import offline_compile  # noqa: E402

from flexlite import create_block_mask  # noqa: E402
from flexlite.masks import causal_mask  # noqa: E402
from flexlite.mods import generate_alibi_bias, generate_tanh_softcap  # noqa: E402
from flexlite.runtime import compile_processes  # noqa: E402


def host_loop(n: int = 2000) -> float:
    x = torch.randn(64, 64)
    t = time.perf_counter()
    for _ in range(n):
        x = torch.tanh(x * 1.0001 + 0.1)
    return time.perf_counter() - t


def main():
    torch.set_num_threads(1)
    blocks = create_block_mask(causal_mask, 1, 1, 1024, 1024, device="cpu")
    alone = min(host_loop() for _ in range(5))
    rows = []
    # (a different mod each, so that neither finds the other's kernel in the cache)
    for where, processes, score_mod in (("worker thread", 0, generate_tanh_softcap(30.0)),
                                        ("compile server", 1, generate_alibi_bias(4))):
        took = []

        def compile_():
            t = time.perf_counter()
            compile_processes.run(lambda: offline_compile.compile_forward_ws(score_mod, blocks, 64), processes)
            took.append(time.perf_counter() - t)
        worker = threading.Thread(target=compile_)
        worker.start()
        loops = []
        while worker.is_alive():
            loops.append(host_loop())
        worker.join()
        rows.append({"compile in": where, "compile_s": round(took[0], 2), "loops": len(loops),
                     "loop_alone_ms": round(1e3 * alone, 1), "loop_max_ms": round(1e3 * max(loops), 1),
                     "stalled_s": round(sum(loops) - alone * len(loops), 2)})
    print(tabulate(rows, headers="keys", tablefmt="github"))
    if "--out" in sys.argv:
        with open(os.path.join(sys.argv[sys.argv.index("--out") + 1], "compile_gil.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
