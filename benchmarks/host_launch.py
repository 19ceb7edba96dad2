"""Host time of the warp-specialized kernels' launches on a machine without a GPU: Triton's launch (JITFunction.run:
binding, specialization, cache key) against flexlite's compiled launch (launch.compiled_launch: the compiled kernel
looked up by the arguments' properties), both without the driver call (NOTES 66).

The kernels are compiled for sm_90a offline (benchmarks/offline_compile.py), then each launcher is called back to
back: `launch_forward_ws` whole (its descriptors and outputs included) and the dK / dV kernel's `_launch_dkdv_ws`.
Triton's launch stops at its warmup return (kernel found, nothing launched); the compiled launch's driver call is
replaced by a no-op, its host descriptors expanded once per address, shape and strides as on a GPU but without the
encoding (which needs the driver; NOTES 67). CPU tensors get a new address at almost every allocation, so the
forward's output descriptor is expanded at every call here, where the CUDA caching allocator hands the same block
back. Times nothing on a GPU: the GPU host's CPU is slower and moves (NOTES 65).

Usage: python benchmarks/host_launch.py [calls]   (from the checkout; TRITON_CACHE_DIR keeps the compiles)"""

from __future__ import annotations

import os
import sys
import time
from types import SimpleNamespace

import torch
from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from offline_compile import offline_cuda  # noqa: E402

from flexlite import create_block_mask  # noqa: E402
from flexlite.api import _block_tensors, _generate, _float_index, _q_block_tensors  # noqa: E402
from flexlite.codegen.kernel import generate_backward  # noqa: E402
from flexlite.masks import generate_causal_document_mask  # noqa: E402
from flexlite.runtime import launch  # noqa: E402
from flexlite.runtime.compile import load_module  # noqa: E402


class _NoDriverCall(dict):
    """A compiled launch's kernels, each kept with a no-op driver call, its host descriptors' tensor maps each
    expanded once per address, shape and strides as on a GPU (without the encoding, which needs the driver)."""

    def __setitem__(self, key, direct):
        noop = lambda *a: None  # noqa: E731
        direct.ck = SimpleNamespace(run=noop, function=None, packed_metadata=None, launch_metadata=noop)
        direct.raw, direct.metas, direct.coop, direct.pdl = noop, [None] * 8, False, False
        super().__setitem__(key, direct)


def stub_drivers():
    """Every compiled launch's kernels kept with a no-op driver call from now on. (CPU tensors' addresses vary
    modulo 256, as the CUDA caching allocator's do not: each new combination goes through Triton's launch once.)"""
    for compiled in launch._LAUNCHES.values():
        compiled.compiled = _NoDriverCall()


def per_call(fn, calls: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main():
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    B, H, L, D = 1, 2, 1024, 128
    bm = create_block_mask(generate_causal_document_mask([L // 4] * 4, device="cpu"), None, None, L, L, device="cpu")
    q, k, v, out, grad_out = [torch.randn(B, H, L, D, dtype=torch.bfloat16) for _ in range(5)]
    lse, delta = torch.randn(B, H, L), torch.randn(B, H, L)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    fwd = _generate(None, bm, torch.device("cuda"), "fwd_ws.py.jinja", _float_index("fwd_ws.py.jinja", L, L),
                    dtype=torch.bfloat16)
    bwd = generate_backward(None, bm.mask_mod, interpret=False, template="bwd_ws.py.jinja",
                            query_values=launch.WS_BWD_QUERY_VALUES, llvm_opt_levels=launch.WS_BWD_LLVM_OPT_LEVELS)
    fwd_module, bwd_module = (load_module(kernel.source, interpret=False) for kernel in (fwd, bwd))
    num, idx, full_num, full_idx, sparse = _block_tensors(bm, L, L, torch.device("cpu"))
    q_blocks, _, _ = launch._block_args(*_q_block_tensors(bm, L, L, torch.device("cpu")))
    launchers = {
        "launch_forward_ws": lambda: launch.launch_forward_ws(
            fwd_module, fwd.mod_args(), q, k, v, num, idx, full_num, full_idx, sparse, D ** -0.5, False),
        "_launch_dkdv_ws": lambda: launch._launch_dkdv_ws(
            bwd_module, bwd.mod_args(), bwd.grad_args([]), q, k, v, grad_out, lse, delta, dk, dv, q_blocks, sparse,
            D ** -0.5, False, True, False),
    }
    rows = []
    for name, fn in launchers.items():
        with offline_cuda():  # Triton's launches
            triton_us = per_call(fn, calls)
        with offline_cuda(compiled_launches=True):
            fn()  # the compiled launch made
            stub_drivers()
            for _ in range(200):  # every output address modulo 256 seen
                fn()
            rows.append([name, f"{triton_us:.1f}", f"{per_call(fn, calls):.1f}"])
        print(rows[-1], flush=True)
    print(tabulate(rows, headers=["launcher (host work, no driver call)", "Triton's launch (us)",
                                  "compiled launch (us)"], tablefmt="github"))


if __name__ == "__main__":
    main()
