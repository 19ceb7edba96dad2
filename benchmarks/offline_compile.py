"""Compile flexlite's forward kernel for Hopper (sm_90a) on a machine without a GPU, through the real launch path,
and report what the compiler made of it: whether it compiled, registers and spill bytes (ptxas), and a few SASS
instruction counts (STL / LDL: spill traffic).

Triton's wheel ships its CUDA backend, ptxas and cuobjdump, so compiling needs no GPU: a stand-in driver answers
JITFunction.run's questions (target sm_90, device 0, stream 0) and every launch becomes a compile-only warmup.
The arguments are CPU tensors with the same dtypes, strides and 16-byte alignment as the GPU run's, so Triton
specializes the kernel the same way. Costs no device time; times nothing (use the probes for that).

Usage: python benchmarks/offline_compile.py [D,...] [--backward | --ws]
(--ws: the warp-specialized kernels' tile loops, and the Triton forward's with softcap, per loop: SASS instructions
per warp and tile, spill stores / loads, global loads, with and without their optional variants: NOTES 42-46)"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import subprocess
import sys
import tempfile
from typing import Optional

import torch
import triton
from tabulate import tabulate
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import JITFunction

from flexlite import create_block_mask
from flexlite.block_mask import item_lists
from flexlite.api import _block_tensors, _float_index, _generate, _q_block_tensors
from flexlite.codegen.kernel import generate_backward
from flexlite.masks import causal_mask
from flexlite.runtime import launch
from flexlite.runtime.compile import load_module
from flexlite.runtime.compile_server import TargetDriver

_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
_SASS_OPS = ("MUFU", "HGMMA", "FFMA", "FMUL", "FADD", "FMNMX", "LDG", "STL", "LDL")


def _compiled_lang_helpers() -> list:
    """(module, name, interpreted helper, compiled twin) for triton.language's own ``@jit`` helpers (``tl.sum``,
    ``tl.zeros``, ...) when Triton was imported under ``TRITON_INTERPRET=1`` (as the CPU test suite does): compiling
    needs them as JITFunctions (the reverse of flexlite.runtime.compile.interpreter_scope)."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    return [(mod, name, value, JITFunction(value.fn)) for mod in {tl, tl.core, tl.standard, tl.math}
            for name, value in list(vars(mod).items()) if isinstance(value, InterpretedFunction)]


@contextlib.contextmanager
def offline_cuda(capability: int = 90, compiled_launches: bool = False):
    """Kernel launches inside compile for ``sm_<capability>`` and return the compiled kernel without running: each
    through Triton's launch (launch.COMPILED_LAUNCHES off: a compiled launch would run a kernel it has seen), or with
    ``compiled_launches`` through flexlite's, on device 0 and stream 0 (the caller stubs their driver calls)."""
    compiled = []
    run = JITFunction.run
    helpers = _compiled_lang_helpers()
    interpret = os.environ.get("TRITON_INTERPRET")

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append(kernel)
        return kernel

    saved = (launch.tma_ok, launch._ensure_allocator, launch.interpreter_scope, launch._device_facts,
             launch.COMPILED_LAUNCHES, launch._current_device_and_stream)
    active = triton.runtime.driver._active  # None until a driver is asked for (reset_active would create one)
    triton.runtime.driver.set_active(TargetDriver(GPUTarget("cuda", capability, 32)))
    JITFunction.run = compile_only
    launch.tma_ok = lambda *tensors: all(t.stride(-1) == 1 for t in tensors)
    launch._ensure_allocator = lambda: None
    launch.interpreter_scope = lambda interpret: contextlib.nullcontext()
    launch._device_facts = lambda device: (132, capability // 10)  # (persistent grids: as on an H100 / H200)
    launch.COMPILED_LAUNCHES = compiled_launches
    if compiled_launches:
        launch._current_device_and_stream = lambda: (0, 0)
    os.environ["TRITON_INTERPRET"] = "0"
    for mod, name, _, jit in helpers:
        setattr(mod, name, jit)
    try:
        yield compiled
    finally:
        for mod, name, interpreted, _ in helpers:
            setattr(mod, name, interpreted)
        if interpret is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = interpret
        JITFunction.run = run
        (launch.tma_ok, launch._ensure_allocator, launch.interpreter_scope, launch._device_facts,
         launch.COMPILED_LAUNCHES, launch._current_device_and_stream) = saved
        triton.runtime.driver._active = active


def _disassemble(cubin_path: str) -> str:
    """The SASS of a cubin, from the wheel's cuobjdump."""
    return subprocess.run([os.path.join(_BIN, "cuobjdump"), "-sass", cubin_path], capture_output=True,
                          text=True).stdout


def ptxas_report(ptx: str) -> dict:
    """Registers, spill bytes and SASS op counts of one kernel's PTX, from the wheel's ptxas and cuobjdump."""
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "k.ptx"), "w") as f:
            f.write(ptx)
        info = subprocess.run([os.path.join(_BIN, "ptxas"), "-arch=sm_90a", "-v", f.name, "-o",
                               os.path.join(d, "k.cubin")], capture_output=True, text=True).stderr
        sass = _disassemble(os.path.join(d, "k.cubin"))
    regs = re.search(r"Used (\d+) registers", info)
    spills = re.search(r"(\d+) bytes spill stores", info)
    ops = collections.Counter(re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", sass, re.M))
    return dict(regs=int(regs.group(1)) if regs else None, spill_bytes=int(spills.group(1)) if spills else None,
                **{op: ops.get(op, 0) for op in _SASS_OPS})


def sass_loops(ck) -> list:
    """The innermost loops of a compiled kernel that issue wgmma (its tile loops; each warp-specialized partition
    has its own), in address order: per loop its SASS instruction count and counts of a few ops (spill traffic
    STL / LDL, global loads LDG, MUFU, ISETP)."""
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "k.cubin"), "wb") as f:
            f.write(ck.asm["cubin"])
        sass = _disassemble(f.name)
    ins = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in
           re.finditer(r"^\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)\s*([^;]*)", sass, re.M)]
    # backward branches: loops (a branch's target is its last operand: ``BRA 0x...`` or ``BRA P1, 0x...``)
    targets = [(int(re.findall(r"0x[0-9a-f]+", arg)[-1], 16), addr) for addr, op, arg in ins
               if op.split(".")[0] == "BRA" and re.search(r"0x[0-9a-f]+", arg)]
    spans = [(target, addr) for target, addr in targets if target < addr]
    ops = {span: collections.Counter(op.split(".")[0] for addr, op, _ in ins if span[0] <= addr <= span[1])
           for span in set(spans)}
    tile = [span for span, c in ops.items() if c["HGMMA"]]
    inner = sorted(span for span in tile if not any(o != span and span[0] <= o[0] and o[1] <= span[1] for o in tile))
    return [dict(start=hex(a), instructions=sum(ops[(a, b)].values()),
                 **{op: ops[(a, b)][op] for op in ("HGMMA", "STL", "LDL", "LDG", "MUFU", "ISETP", "PRMT")})
            for a, b in inner]


def compile_forward(score_mod, block_mask, D: int, tile: tuple, use_tma: bool, L: int = 1024,
                    dtype=torch.bfloat16, split_partial: bool = False):
    """The compiled forward kernel for these mods at head dim ``D`` and ``tile`` (BLOCK_M, BLOCK_N, warps,
    stages); the block mask's tensors must already exist (they are built on the CPU, before going offline)."""
    q, k, v = [torch.randn(1, 2, L, D, dtype=dtype) for _ in range(3)]
    kernel = _generate(score_mod, block_mask, torch.device("cuda"), "fwd.py.jinja", _float_index("fwd.py.jinja", L, L))
    module = load_module(kernel.source, interpret=False)
    num, idx, full_num, full_idx, sparse = _block_tensors(block_mask, L, L, torch.device("cpu"))
    config = launch.TileConfig(*tile)
    with offline_cuda() as compiled:
        launch.launch_forward(module, kernel.mod_args(), q, k, v, num, idx, full_num, full_idx, sparse, D ** -0.5,
                              kernel.has_score_mod, config, pinned=True, use_tma=use_tma,
                              dense=block_mask is None, split_partial=split_partial)
    return compiled[-1]


def compile_forward_ws(score_mod, block_mask, D: int, L: int = 1024, Lkv: Optional[int] = None, dtype=torch.bfloat16,
                       heads: tuple = (2, 2), persistent: Optional[bool] = None, max_scores: bool = False,
                       wide: bool = False):
    """The compiled warp-specialized (Gluon) forward kernel for these mods at head dim ``D``, ``L`` queries and
    ``Lkv`` keys (default ``L``), ``heads`` = (query heads, kv heads); ``persistent``: with its persistent grid or
    without (launch.WS_FWD_PERSISTENT; None: its default); ``max_scores``: storing the row maxima (STORE_MAX);
    ``wide``: in the wide items of launch.WS_FWD_WIDE_TILES (three consumer warpgroups, the block mask's lists for
    their q blocks), whatever it spills, else in 128-row items. The source is the one flex_attention would run for
    ``dtype`` and ``max_scores`` (api._generate)."""
    Lkv = L if Lkv is None else Lkv
    q = torch.randn(1, heads[0], L, D, dtype=dtype)
    k, v = [torch.randn(1, heads[1], Lkv, D, dtype=dtype) for _ in range(2)]
    kernel = _generate(score_mod, block_mask, torch.device("cuda"), "fwd_ws.py.jinja",
                       _float_index("fwd_ws.py.jinja", L, Lkv), dtype=dtype, max_scores=max_scores, lengths=(L, Lkv))
    module = load_module(kernel.source, interpret=False)
    num, idx, full_num, full_idx, sparse = _block_tensors(block_mask, L, Lkv, torch.device("cpu"))
    saved = launch.WS_FWD_PERSISTENT, launch.CompiledLaunch.local_bytes
    launch.WS_FWD_PERSISTENT = saved[0] if persistent is None else persistent
    launch.CompiledLaunch.local_bytes = lambda self, grid, args: 0  # (no driver to load the kernel and ask)
    try:
        with offline_cuda() as compiled:
            launch.launch_forward_ws(module, kernel.mod_args(), q, k, v, num, idx, full_num, full_idx, sparse,
                                     D ** -0.5, kernel.has_score_mod, dense=block_mask is None, max_scores=max_scores,
                                     wide=wide and (block_mask is None
                                                    or item_lists(block_mask, launch.WS_FWD_WIDE_TILES[D]["BLOCK_M"])))
    finally:
        launch.WS_FWD_PERSISTENT, launch.CompiledLaunch.local_bytes = saved
    return compiled[-1]


def compile_backward(score_mod, block_mask, D: int, config, use_tma: bool = False, L: int = 1024,
                     dtype=torch.bfloat16) -> dict:
    """The compiled backward kernels (name -> kernel: preprocess, dK/dV, dQ) for these mods at head dim ``D`` with
    ``config`` (a launch.BackwardTileConfig)."""
    q, k, v, out, grad_out = [torch.randn(1, 2, L, D, dtype=dtype) for _ in range(5)]
    lse = torch.randn(1, 2, L)
    mask_mod = block_mask.mask_mod if block_mask is not None else None
    kernel = generate_backward(score_mod, mask_mod, interpret=False)
    module = load_module(kernel.source, interpret=False)
    *kv_blocks, sparse = _block_tensors(block_mask, L, L, torch.device("cpu"))
    q_blocks = _q_block_tensors(block_mask, L, L, torch.device("cpu"))
    with offline_cuda() as compiled:
        launch.launch_backward(module, kernel.mod_args(), kernel.grad_args([]), q, k, v, out, lse, grad_out, None,
                               tuple(kv_blocks), q_blocks, sparse, D ** -0.5, kernel.has_score_mod, config,
                               pinned=True, dense=block_mask is None, use_tma=use_tma)
    return {ck.name: ck for ck in compiled}


def compile_backward_ws(score_mod, block_mask, D: int, L: int = 1024, dtype=torch.bfloat16,
                        heads: tuple = (2, 2), fused_dq: bool = True, persistent: bool = False,
                        query_values: bool = False, decide_mask_terms=()) -> dict:
    """The compiled backward kernels (name -> kernel) with the warp-specialized (Gluon) dK / dV kernel, for these
    mods at head dim ``D``, ``L`` queries and keys, ``heads`` = (query heads, kv heads); ``fused_dq``: dQ added by
    its programs (launch.WS_BWD_FUSED_DQ), else by the dQ kernel; ``persistent``: with its persistent grid
    (launch_backward's ws_persistent, for 132 SMs as on an H100 or H200); ``query_values``: mask_mod's values along
    the queries on a compact vector (launch.WS_BWD_QUERY_VALUES); ``decide_mask_terms``: the backward templates
    that leave out the terms a partial tile decides (launch.DECIDE_MASK_TERMS)."""
    q, out, grad_out = [torch.randn(1, heads[0], L, D, dtype=dtype) for _ in range(3)]
    k, v = [torch.randn(1, heads[1], L, D, dtype=dtype) for _ in range(2)]
    lse = torch.randn(1, heads[0], L)
    mask_mod = block_mask.mask_mod if block_mask is not None else None
    kernel = generate_backward(score_mod, mask_mod, interpret=False, decide_mask_terms=decide_mask_terms)
    ws_kernel = generate_backward(score_mod, mask_mod, interpret=False, template="bwd_ws.py.jinja",
                                  query_values=query_values, llvm_opt_levels=launch.WS_BWD_LLVM_OPT_LEVELS,
                                  decide_mask_terms=decide_mask_terms)
    module, ws_module = (load_module(k.source, interpret=False) for k in (kernel, ws_kernel))
    *kv_blocks, sparse = _block_tensors(block_mask, L, L, torch.device("cpu"))
    q_blocks = _q_block_tensors(block_mask, L, L, torch.device("cpu"))
    config = launch.BackwardTileConfig(64, 64, 64, 64, 4, 2)  # the dQ kernel's (the CUDA defaults at D128)
    saved = launch.WS_BWD_FUSED_DQ
    launch.WS_BWD_FUSED_DQ = fused_dq
    try:
        with offline_cuda() as compiled:
            launch.launch_backward(module, kernel.mod_args(), kernel.grad_args([]), q, k, v, out, lse, grad_out,
                                   None, tuple(kv_blocks), q_blocks, sparse, D ** -0.5, kernel.has_score_mod, config,
                                   pinned=True, dense=block_mask is None, ws_module=ws_module, ws_persistent=persistent)
    finally:
        launch.WS_BWD_FUSED_DQ = saved
    return {ck.name: ck for ck in compiled}


def _softcap(score, b, h, q_idx, kv_idx):
    return 30.0 * torch.tanh(score / 30.0)


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    dims = [int(d) for d in args[0].split(",")] if args else [128, 64]
    backward = "--backward" in sys.argv
    if "--ws" in sys.argv:
        return _main_ws(dims)
    L = 1024
    doc = (torch.arange(L) // 256).to(torch.int32)

    def document(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    masks = {"none": None, "causal": create_block_mask(causal_mask, None, None, L, L, device="cpu"),
             "document": create_block_mask(document, None, None, L, L, device="cpu")}
    cases = [("full", None, "none"), ("causal", None, "causal"), ("document", None, "document"),
             ("softcap causal", _softcap, "causal")]
    tiles = {128: [(128, 64, 4, 2), (64, 64, 4, 3)], 64: [(128, 128, 4, 3)]}
    if backward:
        return _main_backward(dims, cases, masks, L)
    rows = []
    for D in dims:
        for name, score_mod, mask in cases:
            for tile in tiles[D]:
                for tma in (False, True):
                    label = [name, f"D{D}", "{}x{} {}w {}s".format(*tile), "tma" if tma else ""]
                    try:
                        ck = compile_forward(score_mod, masks[mask], D, tile, tma, L)
                        row = label + ["ok"] + list(ptxas_report(ck.asm["ptx"]).values())
                    except Exception as e:  # noqa: BLE001 - a variant that fails to compile is a finding
                        row = label + [f"{type(e).__name__}: {str(e).splitlines()[0][:60]}"]
                    print(row, flush=True)
                    rows.append(row)
    print(tabulate(rows, headers=["mods", "D", "tile", "tma", "compiled", "regs", "spill bytes", *_SASS_OPS],
                   tablefmt="github"))


def _main_backward(dims, cases, masks, L):
    # (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, warps, stages): the defaults first, then alternatives of the sweeps
    tiles = {128: [(64, 64, 64, 64, 4, 2), (32, 64, 64, 64, 4, 2), (64, 128, 128, 64, 8, 2)],
             64: [(64, 64, 64, 32, 4, 3), (32, 128, 64, 64, 4, 3)]}
    rows = []
    for D in dims:
        for name, score_mod, mask in cases:
            for tile in tiles[D]:
                label = [name, f"D{D}", "{}x{}/{}x{} {}w {}s".format(*tile)]
                try:
                    kernels = compile_backward(score_mod, masks[mask], D, launch.BackwardTileConfig(*tile), L=L)
                    for kname, ck in kernels.items():
                        if "preprocess" in kname:
                            continue
                        row = label + [kname] + list(ptxas_report(ck.asm["ptx"]).values())
                        print(row, flush=True)
                        rows.append(row)
                except Exception as e:  # noqa: BLE001 - a variant that fails to compile is a finding
                    row = label + [f"{type(e).__name__}: {str(e).splitlines()[0][:60]}"]
                    print(row, flush=True)
                    rows.append(row)
    print(tabulate(rows, headers=["mods", "D", "tiles (dK/dV, dQ)", "kernel", "regs", "spill bytes", *_SASS_OPS],
                   tablefmt="github"))


def _main_ws(dims):
    from flexlite.masks import generate_causal_document_mask
    from flexlite.mods import generate_alibi_bias, generate_tanh_softcap
    L = 1024
    masks = {name: create_block_mask(mask, None, None, L, L, device="cpu") for name, mask in
             (("causal", causal_mask), ("document", generate_causal_document_mask([L // 4] * 4, device="cpu")))}
    softcap, alibi = generate_tanh_softcap(30.0), generate_alibi_bias(2, device="cpu")
    rows = []

    def report(label, ck):
        spill = ptxas_report(ck.asm["ptx"])["spill_bytes"]
        for i, loop in enumerate(sass_loops(ck)):
            rows.append(label + [spill, i] + list(loop.values())[1:])
            print(rows[-1], flush=True)

    for D in dims:
        for name, score_mod, mask in (("causal", None, "causal"), ("softcap causal", softcap, "causal"),
                                      ("document", None, "document")):
            for fold in (False, True):
                saved, launch.FOLD_SCORE_SCALES = launch.FOLD_SCORE_SCALES, fold
                try:
                    variant = "factors folded" if fold else ""
                    report(["forward_ws", name, f"D{D}", variant], compile_forward_ws(score_mod, masks[mask], D, L=L))
                    if score_mod is not None:  # the Triton forward too (D64's), at its default tile there
                        report(["forward", name, f"D{D}", variant],
                               compile_forward(score_mod, masks[mask], D, (128, 128, 4, 3), use_tma=True, L=L))
                finally:
                    launch.FOLD_SCORE_SCALES = saved
        for name, score_mod, mask in (("causal", None, "causal"), ("ALiBi causal", alibi, "causal"),
                                      ("softcap causal", softcap, "causal"), ("document", None, "document")):
            for variant in ({}, {"query_values": True}, {"persistent": True}):
                ck = compile_backward_ws(score_mod, masks[mask], D, L=L, **variant)["flex_bwd_ws_dkdv_kernel"]
                report(["backward_ws", name, f"D{D}", ", ".join(variant)], ck)
    print(tabulate(rows, headers=["kernel", "mods", "D", "variant", "spill bytes", "loop", "instructions", "HGMMA",
                                  "STL", "LDL", "LDG", "MUFU", "ISETP"], tablefmt="github"))


if __name__ == "__main__":
    main()
