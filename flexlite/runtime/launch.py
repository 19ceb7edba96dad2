"""Grids, strides, tile configs and launches. Knows nothing about mods: a kernel module and the
runtime values of its captured-tensor parameters come in from the codegen pipeline."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import sys
import threading
import types
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.4; CompiledLaunch launches directly only on 3.6
    from triton import knobs as _triton_knobs
except ImportError:
    _triton_knobs = None

from . import autotune
from .autotune import length_bucket
from .compile import interpreter_scope
from .llvm_level import llvm_opt_level

# kernel_options keys of torch's FlexAttention that only tune performance there; accepted, no effect
TORCH_PERF_HINTS = frozenset({
    "PRESCALE_QK", "ROWS_GUARANTEED_SAFE", "BLOCKS_ARE_CONTIGUOUS", "OUTPUT_LOGSUMEXP", "OUTPUT_MAX", "WRITE_DQ",
    "kpack", "matrix_instr_nonkdim", "waves_per_eu"})
# kernel_options keys with a meaning in flexlite besides the tile config (BLOCK_M1..N2: backward tiles)
FLEXLITE_OPTIONS = frozenset({"AUTOTUNE", "USE_TMA", "DETERMINISTIC_CAPTURED_GRADS", "DECODE", "DECODE_SPLITS",
                              "FORCE_USE_FLEX_ATTENTION", "BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2",
                              "WARP_SPECIALIZE", "BACKEND"})
# torch's kernel_options BACKEND values, as flexlite's DECODE: "TRITON" its attention kernel, "TRITON_DECODE" its
# decoding one; "AUTO" and "FLASH" (torch's CuTe kernel) flexlite's choice
BACKENDS = {"AUTO": None, "TRITON": False, "TRITON_DECODE": True, "FLASH": None}
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
# the forward and dQ kernels take their q blocks last to first (the heaviest first under causal-like masks;
# benchmarks/NOTES.md 23); False: first to last
REVERSE_Q_BLOCKS = True
# the forward's partial blocks (mask_mod evaluated) in steps of BLOCK_N // 2 keys where the caller asks for it
# (launch_forward's split_partial; benchmarks/NOTES.md 37); False: never
SPLIT_PARTIAL_TILES = True


@dataclasses.dataclass(frozen=True)
class TileConfig:
    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int


# Host-side integer helpers. triton.cdiv / triton.next_power_of_2 are constexpr functions (a few microseconds
# of argument unwrapping per call from Python): on a per-call path like decoding that adds up to ~100 us.
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


@functools.lru_cache(maxsize=None)
def _has_gdc() -> bool:
    """Whether this Triton has grid dependency control (programmatic dependent launch)."""
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def _device_facts(device: torch.device) -> tuple:
    """(SM count, compute capability major) of a CUDA device (utils.gpu.detect_gpu); cached: the query costs host
    time per call."""
    from ..utils.gpu import detect_gpu
    caps = detect_gpu(device.index if device.index is not None else torch.cuda.current_device())
    return caps.num_sms, caps.compute_capability[0]


def _pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two <= cap that divides n."""
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


def head_dim_pad(d: int) -> int:
    return max(16, next_pow2(d))


def forward_config(q: torch.Tensor, v: torch.Tensor, sparse_block: tuple, kernel_options: dict,
                   gathers: bool = False) -> TileConfig:
    """Tile sizes: heuristic defaults, then ``kernel_options`` pins.

    The defaults come from benchmarks/probe_fwd.py on an H200 (see benchmarks/NOTES.md): per head dim;
    ``gathers`` (mask_mod reads captured tensors, as document masks do) favours smaller 64x64 tiles at D128,
    which keep the extra index math from spilling. With or without a block mask 2 stages are best at D128
    (without one the kernel walks its kv tiles in one loop, NOTES 25).
    """
    d = max(head_dim_pad(q.shape[-1]), head_dim_pad(v.shape[-1]))
    if q.device.type != "cuda":
        # the interpreter's cost is per op, not per element: big tiles, but not far past the length
        cap_m = max(16, next_pow2(q.shape[-2]))
        cap_n = max(16, next_pow2(v.shape[-2]))
        bm, bn, warps, stages = min(128, cap_m), min(128, cap_n), 4, 1
    elif d <= 64:
        bm, bn, warps, stages = 128, 128, 4, 3
    elif d <= 128:
        bm, bn, warps, stages = (64, 64, 4, 3) if gathers else (128, 64, 4, 2)
    else:
        bm, bn, warps, stages = 64, 32, 4, 2
    if q.dtype == torch.float32 and q.device.type == "cuda":
        bn = max(16, bn // 2)
    bm = _pow2_divisor(sparse_block[0], bm)
    bn = _pow2_divisor(sparse_block[1], bn)
    cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
    return TileConfig(**_pin(cfg, kernel_options, CONFIG_KEYS,
                             {"BLOCK_M": sparse_block[0], "BLOCK_N": sparse_block[1]}))


def _pin(cfg: dict, kernel_options: dict, keys: tuple, sides: dict) -> dict:
    """``cfg`` with the ``keys`` that ``kernel_options`` pins; each tile size in ``sides`` (key -> the block
    mask's BLOCK_SIZE on its side) must then be a power of two >= 16 that divides it. (flex_attention checks that
    first, in api._check_option_values, where a key prefixed fwd_ / bwd_ is named as written: here, one pass's
    options, it is not.)"""
    cfg.update({key: kernel_options[key] for key in keys if key in kernel_options})
    for key, sparse in sides.items():
        value = cfg[key]
        if not isinstance(value, int) or value < 16 or value & (value - 1) or sparse % value:
            raise ValueError(f"flex_attention: kernel_options[{key!r}]={value!r}: must be a power of two >= 16 that "
                             f"divides the block mask's BLOCK_SIZE {sparse}")
    return cfg


def fallback_configs(config: TileConfig, shrink_m: bool = True):
    """``config``, then cheaper ones: fewer pipeline stages, then narrower then (if ``shrink_m``) shorter
    tiles. Mods that gather from captured tensors pipeline those gathers too, which can pass shared memory."""
    seen = set()
    bm, bn = config.BLOCK_M, config.BLOCK_N
    while True:
        for stages in range(config.num_stages, 0, -1):
            cfg = TileConfig(bm, bn, config.num_warps, stages)
            if cfg not in seen:
                seen.add(cfg)
                yield cfg
        if bn > 16:
            bn //= 2
        elif bm > 16 and shrink_m:
            bm //= 2
        else:
            return


_WORKING_CONFIG: dict = {}  # (kernel, constexpr key, wanted config) -> config that fits

_THREAD = threading.local()


@contextlib.contextmanager
def compile_only():
    """Kernel launches in this thread, while inside, compile for their arguments (Triton's warmup: the compiled
    kernel kept as a launch would keep it) and run nothing; under Triton's interpreter they do nothing (flexlite's
    first_calls compiles a mod's kernels beside the calls this way)."""
    _THREAD.compile_only = True
    try:
        yield
    finally:
        _THREAD.compile_only = False


def compiling_only() -> bool:
    """Whether this thread is inside :func:`compile_only`."""
    return getattr(_THREAD, "compile_only", False)


def _launch(kernel, grid, args, kwargs: dict):
    """``kernel[grid](*args, **kwargs)``, or in :func:`compile_only` its compile alone (``args`` as
    :func:`_made` takes them)."""
    args = _made(args)
    if not compiling_only():
        return kernel[grid](*args, **kwargs)
    if isinstance(kernel, triton.runtime.jit.JITFunction):  # (not the interpreter's)
        compiled = kernel.run(*args, grid=grid, warmup=True, **kwargs)
        if compiled is not None:  # (None: the compile was captured for a compile server, compile_processes)
            _build_launcher(compiled)
    return None


def _build_launcher(compiled) -> None:
    """Build Triton's C launcher for a kernel compiled inside :func:`compile_only`. Triton builds one per kernel
    signature at a kernel's first launch (a C compiler run: a GPU probe's cProfile had one at 0.36 s in a backward,
    NOTES 73, 74) and caches it on disk; built here, beside, that first launch in the caller's thread finds it there.
    Host work only (the kernel's module is still loaded at its first launch). A failure leaves the build to that
    launch, which reports it."""
    try:
        triton.runtime.driver.active.launcher_cls(compiled.src, compiled.metadata)
    except Exception:  # noqa: BLE001 - an optimisation only: the first launch builds it (or raises) as it would
        pass


def run_with_fallback(kernel, grid, args: tuple, constexprs: dict, config: TileConfig, pinned: bool,
                      shrink_m: bool = True):
    """Launch ``kernel`` with ``config``; if it does not fit in shared memory, with the first fallback
    that does (remembered per kernel and constexprs). Pinned configs (kernel_options) never change.
    ``shrink_m=False``: BLOCK_M is not a free choice (the decode kernel's rows)."""
    from triton.runtime.errors import OutOfResources

    key = (id(kernel), tuple(constexprs.items()), config)  # each call site builds its dict in one order
    cfg = _WORKING_CONFIG.get(key)
    if cfg is not None:  # known to fit: launched without Triton's per-call binding (compiled_launch)
        launch_grid = grid(cfg)  # (which may set constexprs that depend on the config)
        compiled_launch(kernel, dict(constexprs, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, num_warps=cfg.num_warps,
                                     num_stages=cfg.num_stages))(launch_grid, args)
        return cfg
    error = None
    for cfg in fallback_configs(config, shrink_m):
        try:
            _launch(kernel, grid(cfg), args, dict(constexprs, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N,
                                                  num_warps=cfg.num_warps, num_stages=cfg.num_stages))
        except OutOfResources as e:  # raised while compiling, before anything runs
            if pinned:
                raise ValueError(f"kernel_options {dataclasses.asdict(config)} do not fit this GPU: {e}; pin "
                                 f"smaller BLOCK_M / BLOCK_N or fewer num_stages") from e
            error = e
            continue
        if not compiling_only():  # (a kernel's fit is known once it is loaded to run)
            _WORKING_CONFIG[key] = cfg
        return cfg
    raise error


def is_host_scalar(t: torch.Tensor) -> bool:
    """A 0-d CPU tensor without grad: torch lets one mix with CUDA tensors, and a mod that builds a constant
    (``torch.tensor(2.0)``, ``torch.ones((), dtype=torch.bool)``) captures one; :func:`scalars_to` moves it."""
    return t.dim() == 0 and t.device.type == "cpu" and not t.requires_grad


def scalars_to(args: list, device: torch.device) -> list:
    """Kernel arguments with captured host scalars (:func:`is_host_scalar`) moved to ``device``."""
    return [a.to(device) if isinstance(a, torch.Tensor) and device.type != "cpu" and is_host_scalar(a) else a
            for a in args]


def _mask_strides(t: torch.Tensor) -> tuple:
    """Strides of a [ZM, HM, n, ...] block-mask tensor, 0 along broadcast (size-1) batch/head dims."""
    (z, h, n), (sz, sh, sn) = t.shape[:3], t.stride()[:3]
    return (0 if z == 1 else sz, 0 if h == 1 else sh, 0 if n == 1 else sn)


def launch_forward(module, mod_args: list, q, k, v, kv_num_blocks, kv_indices,
                   full_kv_num_blocks: Optional[torch.Tensor], full_kv_indices: Optional[torch.Tensor],
                   sparse_block: tuple, scale: float, has_score_mod: bool, config: TileConfig,
                   pinned: bool = False, tune: bool = False, use_tma: Optional[bool] = None, dense: bool = False,
                   split_partial: bool = False, max_scores: bool = False):
    """Run ``module.flex_fwd_kernel``; returns out [B, Hq, Lq, Dv] (q.dtype), lse [B, Hq, Lq] fp32 and, if
    ``max_scores``, each row's largest score after score_mod and mask_mod [B, Hq, Lq] fp32 (else None).
    ``tune``: autotune the tile config (CUDA, not pinned) instead of taking ``config`` as it is.
    ``use_tma``: load K / V through tensor descriptors where :func:`tma_ok` allows; None: :func:`default_use_tma`.
    ``dense``: there is no block mask (the blocks are all full): one loop over every kv tile, no block-index
    loads. ``split_partial``: walk the partial blocks (where mask_mod is evaluated) BLOCK_N // 2 keys at a time
    (tiles of at least 64 keys, pointer loads)."""
    B, Hq, Lq, D = q.shape
    Hkv, Lkv, Dv = k.shape[1], k.shape[2], v.shape[-1]
    out = torch.empty((B, Hq, Lq, Dv), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, Lq), dtype=torch.float32, device=q.device)
    row_max = torch.empty_like(lse) if max_scores else None
    blocks, block_strides, has_full = _block_args(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)
    allow_tf32 = q.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32
    args = (q, k, v, out, lse, lse if row_max is None else row_max, *blocks, *q.stride(), *k.stride(), *v.stride(),
            *out.stride(), *block_strides, Hq, Hq // Hkv, Lq, Lkv, float(scale), *scalars_to(mod_args, q.device))
    constexprs = dict(
        SPARSE_Q_BLOCK=sparse_block[0], SPARSE_KV_BLOCK=sparse_block[1],
        D=D, DV=Dv, D_PAD=head_dim_pad(D), DV_PAD=head_dim_pad(Dv), HAS_FULL_BLOCKS=has_full,
        HAS_SCORE_MOD=has_score_mod, FP32_PRECISION="tf32" if allow_tf32 else "ieee", REVERSE_M=REVERSE_Q_BLOCKS,
        DENSE=dense, USE_TMA=tma_loads(use_tma, default_use_tma(dense, D, Dv), k, v), STORE_MAX=max_scores)

    def grid(cfg):
        # the kv walk covers whole sparse blocks: unchecked only if they all end inside KV_LEN
        split = (SPLIT_PARTIAL_TILES and split_partial and not dense and cfg.BLOCK_N >= 64
                 and not constexprs["USE_TMA"])
        constexprs.update(EVEN_M=Lq % cfg.BLOCK_M == 0, EVEN_N=Lkv % sparse_block[1] == 0,
                          PARTIAL_BLOCK_N=cfg.BLOCK_N // 2 if split else cfg.BLOCK_N)
        return (cdiv(Lq, cfg.BLOCK_M), B * Hq)

    if tune and not pinned:
        key = f"fwd|{_tuning_key(module, q, v, sparse_block, has_full, constexprs)}"
        config = _autotune(module.flex_fwd_kernel, grid, args, constexprs, config,
                           forward_candidates(q, v, sparse_block), key, q.device)
    with interpreter_scope(q.device.type != "cuda"):
        run_with_fallback(module.flex_fwd_kernel, grid, args, constexprs, config, pinned)
    return out, lse, row_max


# the warp-specialized forward (fwd_ws.py.jinja, Gluon, Hopper): 128 query rows per program (two consumer warpgroups),
# keys per tile, K / V ring stages and the second consumer warpgroup's registers, per head dim
# (benchmarks/probe_gluon.py and probe_ws.py on an H200, NOTES 36, 38, 39: three stages at D128 fit once OUT is staged in
# Q's buffer, and measured 7-11 % faster than two)
WS_BLOCK_M = 128
WS_HALF_M = 64  # query rows per consumer warpgroup (the template's HALF): Q's and OUT's descriptors' block rows
# (Q_BUFFERS: as WS_FWD_WIDE_TILES' below; two at D64: 98 KB of shared memory, no spills offline; on the H200 sliding
# window 0.6 % faster, ALiBi 0.5 % and document 1.2 % slower, within a run's spread: one, NOTES 92)
WS_TILES = {64: dict(BLOCK_N=128, STAGES=2, CONSUMER_REGS=232, Q_BUFFERS=1),
            128: dict(BLOCK_N=128, STAGES=3, CONSUMER_REGS=240, Q_BUFFERS=1)}
# per head dim, the warp-specialized forward's wide items: BLOCK_M query rows per item, a consumer warpgroup per
# WS_HALF_M (three: FlashAttention-3's D64 tile), K / V stages, and the consumers' registers (three consumer
# warpgroups, worker partitions, and the producer, the default partition's warpgroup at 32, fill the register file at
# 160; as the default partition at 168 the first consumer's tile loops spilled: NOTES 85). The dense walk may take
# them, and a block mask whose lists can be made for BLOCK_M-row q blocks (block_mask.item_lists: create_block_mask's,
# mask_mod deciding each position of a block partial for any of an item's q blocks) and whose wide items walk little
# more than its own (WS_FWD_WIDE_MAX_WORK; api offers them to launch_forward_ws, which takes them where the kernel
# spills little: WS_FWD_WIDE_MAX_LOCAL). H100, B16 H16 S8192 against two warpgroups (NOTES 84, 85): dense 15 %
# faster (LLVM O3), causal 11 %, prefix-LM 7 % (O0); two stages starve it (33 % slower). Q_BUFFERS: Q's buffers
# (every template's tiles name theirs): the wide items stage OUT in Q's buffer, so with one the next item's Q loads
# only once the last warpgroup has stored OUT; with two it loads while the item runs. Two on a block mask's walk on
# the persistent grid (H200, D64 forward, seeded A/B in one process: prefix-LM 3 % faster, causal even); one on the
# dense walk (full 2.4 % slower with two in probe_against) and on a grid of a program per item (one item each:
# nothing to load ahead; NOTES 89)
WS_FWD_WIDE_TILES = {64: dict(BLOCK_M=192, STAGES=3, CONSUMER_REGS=160, Q_BUFFERS=2)}
# in the wide items, each consumer warpgroup skips the first tiles of its walk (at most two) that keep none of its 64
# rows by mask_mod's terms decided per tile (codegen.decide; masks reading no captured tensors): its ring slots go back
# unread. The wide lists' partial tiles come from the last kv block down (block_mask.item_lists), so that a causal
# diagonal's tiles past a warpgroup's rows come first: 1.5 of an item's 6 partial warpgroup tiles skipped for causal
# and prefix-LM (H200: prefix-LM's D64 forward 1.5 % faster, causal even; NOTES 88). Where the wide kernel spills more
# than WS_FWD_WIDE_MAX_LOCAL with the skip (offline: sliding window's, not offered wide items anyway), the launch takes
# two warpgroups, as for any wide kernel that spills so: trying the wide kernel without the skip would compile it in
# the call for ALiBi's, which spills either way
WS_FWD_SKIP_EMPTY_LEAD = True
# where the warp-specialized forward's consumer warpgroups take turns issuing their matmuls (ping-pong, FA3's: one
# warpgroup's softmax under the others' matmuls): at these head dims always, at WS_FWD_TURNS_PLAIN_HEAD_DIMS without a
# score_mod only; elsewhere they issue as they come. H200, D64 forward, seeded A/B in one process (NOTES 90): with
# turns full 0.4-0.7 %, causal 1.3-1.6 %, prefix-LM 0.5-1.4 % (three warpgroups), sliding window 2.1 % faster (two);
# softcap 0.2 % and ALiBi 7.4 % slower (their score_mods). At D128 without turns ALiBi, softcap and sliding window
# were 4-9 % slower (NOTES 83)
WS_FWD_TURNS_HEAD_DIMS = frozenset({128})
WS_FWD_TURNS_PLAIN_HEAD_DIMS = frozenset({64})

# local memory a thread of the wide items' kernel may use (spilled registers) for a call to take it: at 160 registers
# and LLVM O0 (offline, L 2048, ptxas's spill stores, with Q's two buffers) the D64 kernels of causal and prefix-LM
# spill 16 bytes, values of an item reloaded once per item outside its tile loops, softcap + causal 36 (taken; on an
# H200 1.5 % faster than two warpgroups in probe_against, 6.16 against 6.27 ms across two harness runs: no seeded A/B,
# NOTES 89), the dense walk's (at O3) nothing; sliding window 76 (in its partial tiles' loops), ALiBi + causal 976 and
# the document mask 1,544 stay in two warpgroups (ALiBi's 168 bytes in its full-tile loop were 12 % slower than two
# warpgroups on an H100, NOTES 85)
WS_FWD_WIDE_MAX_LOCAL = 48
# the same for the dense walk's wide items at lengths multiples of 128 (dense_lengths_even): none (H200, D64 at LLVM
# O0: a relative-position bias's wide kernel, 24 bytes of spills in its tile loops, was 16 % slower than O3's two
# warpgroups, O0's two warpgroups 1.3 % faster; without a score_mod and with softcap the wide kernel spills nothing;
# NOTES 108); at other lengths WS_FWD_WIDE_MAX_LOCAL, as before (softcap's O3 kernel spills 16-36 bytes there)
WS_FWD_DENSE_WIDE_MAX_LOCAL = 0


def dense_lengths_even(Lq: int, Lkv: int) -> bool:
    """Whether the dense walk's forward takes :data:`WS_FWD_LLVM_OPT_LEVELS` and :data:`WS_FWD_DENSE_WIDE_MAX_LOCAL`
    (lengths multiples of 128, where they were measured) rather than :data:`WS_FWD_DENSE_RAGGED_LLVM_OPT_LEVELS` and
    :data:`WS_FWD_WIDE_MAX_LOCAL`."""
    return Lq % 128 == 0 and Lkv % 128 == 0
# a block mask's wide items are taken where their tiles, weighed by rows and a partial tile as
# WS_FWD_PARTIAL_TILE_COST full ones (D64: a partial tile's loop is 1.4-2.1x a full one's instructions), come to at
# most WS_FWD_WIDE_MAX_WORK times the mask's own items' (api._wide_work): banded masks' wider items walk more keys,
# more of them partial (at S8192 sliding window 1024 1.27x, 68 % slower in three warpgroups, document 1.52x; causal
# 1.06x and prefix-LM 1.05x: H100, NOTES 85)
WS_FWD_PARTIAL_TILE_COST = 2.0
WS_FWD_WIDE_MAX_WORK = 1.10
# the warp-specialized forward's tensor descriptors made on the host where the inputs allow (contiguous, lengths
# multiples of the tiles); False: always per (z, head) on the device
WS_HOST_DESCRIPTORS = True
# where flex_attention takes the warp-specialized forward unless kernel_options WARP_SPECIALIZE says (H200,
# benchmarks/probe_ws.py, probe_fwd_grid.py, NOTES 38, 54, 57): head dims (D128: 7-15 % faster than the Triton forward
# on every harness mask with host descriptors; D64: faster on five of the seven harness masks by 1.6-5 %, even on
# softcap, 1 % slower on the full mask, since its persistent grid and P carried in fp32), and, where its descriptors
# are made on the device, only at WS_DEVICE_DESC_HEAD_DIMS and where q blocks walk at least WS_MIN_WALK_KEYS keys on
# average (D128 faster from 2048, slower on the 1024 sliding window and 8-document masks; D64 slower, NOTES 38)
WS_DEFAULT_HEAD_DIMS = frozenset({64, 128})
WS_DEVICE_DESC_HEAD_DIMS = frozenset({128})
# a persistent grid for the warp-specialized forward where its descriptors are made on the host: a program per SM
# taking q blocks in passes over the grid (alternating in direction), its producer loading the next one's Q and first
# K / V tiles (its Q released once the last Q K^T is done) under the last P V and OUT's store (H200,
# benchmarks/probe_fwd_grid.py, NOTES 54: sliding window -9.5 %, document -7.6 %, full, causal, prefix-LM and softcap
# -1.8 to -3.4 %; q blocks claimed from a counter in their order measured no better); False: a program per q block
WS_FWD_PERSISTENT = True
WS_MIN_WALK_KEYS = 2048
# mask_mod's values from b, h, kv_idx and captured tensors alone (a document mask's gathers along the keys) computed
# once per partial tile on a compact key vector, a key per thread, then spread along the tile's columns (the backward's
# query values, WS_BWD_QUERY_VALUES, NOTES 45, with the sides swapped; NOTES 61); False: gathered in the tile's
# layout, each thread for its 32 columns
WS_FWD_KEY_VALUES = True
# return_aux max_scores from the warp-specialized forward too (its STORE_MAX: the consumers' tile loops unchanged,
# test_gpu_compile; matches the reference on an H200, test_warp_specialized); False: such calls run the Triton forward
WS_FWD_MAX_SCORES = True


# what fwd_ws.py.jinja and launch_forward_ws use of Gluon (Triton 3.6's names): where one is missing (an older or
# a newer Triton), flex_attention runs the Triton forward instead
_GLUON_NEEDS = (
    ("triton.experimental.gluon", ("jit",)),
    ("triton.experimental.gluon.language", ("warp_specialize", "NVMMADistributedLayout", "NVMMASharedLayout",
                                            "DotOperandLayout", "SliceLayout", "allocate_shared_memory")),
    ("triton.experimental.gluon.language.nvidia.hopper", ("fence_async_shared", "mbarrier", "tma", "warpgroup_mma",
                                                          "warpgroup_mma_wait")),
    ("triton.experimental.gluon.nvidia.hopper", ("TensorDescriptor",)),
)


@functools.lru_cache(maxsize=1)
def _gluon_available() -> bool:
    import importlib
    try:
        return all(hasattr(importlib.import_module(module), name) for module, names in _GLUON_NEEDS for name in names)
    except ImportError:
        return False


@functools.lru_cache(maxsize=1)
def _gluon_tma_reduce_available() -> bool:
    """Whether Gluon's op builder has the TMA reduce-add that bwd_ws.py.jinja's fused dQ issues (Triton 3.6 has it
    without a Gluon wrapper); without it the dQ kernel runs."""
    try:
        from triton._C.libtriton import gluon_ir, ir
    except ImportError:
        return False
    return hasattr(gluon_ir.GluonOpBuilder, "create_async_tma_reduce") and hasattr(ir, "DESCRIPTOR_REDUCE_KIND")


def _ws_unmet(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sparse_block: tuple, tiles: dict) -> Optional[str]:
    """What both warp-specialized kernels (forward, dK / dV) need that these inputs lack; ``tiles``: per head dim the
    kernel runs, its (queries, keys) per tile, which the block mask's blocks must be multiples of."""
    if not q.is_cuda or _device_facts(q.device)[1] != 9:
        return "a Hopper GPU (compute capability 9.x)"
    if not _gluon_available():
        return "Triton's Gluon dialect with Hopper support (Triton 3.5 or newer)"
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"bfloat16 or float16 query, key and value of one dtype (got {q.dtype}, {k.dtype}, {v.dtype})"
    if q.shape[-1] != v.shape[-1] or q.shape[-1] not in tiles:
        return f"query and value head dims equal and one of {sorted(tiles)} (got {q.shape[-1]}, {v.shape[-1]})"
    if not tma_ok(q, k, v):
        return "query, key and value with unit last stride and 16-byte aligned data and strides"
    tile = tiles[q.shape[-1]]
    if sparse_block[0] % tile[0] or sparse_block[1] % tile[1]:
        return f"a block mask whose BLOCK_SIZE is a multiple of {tile} (got {tuple(sparse_block)})"
    return None


def ws_forward_unmet(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sparse_block: tuple) -> Optional[str]:
    """What the warp-specialized forward needs that these inputs lack (None: it can run them)."""
    return _ws_unmet(q, k, v, sparse_block, {d: (WS_BLOCK_M, t["BLOCK_N"]) for d, t in WS_TILES.items()})


def is_compile_error(e: BaseException) -> bool:
    """Whether ``e`` is Triton failing to compile a kernel (its front end, an MLIR pass, or ptxas) or to fit it on
    this GPU (shared memory: the warp-specialized forward's three stages need 224 KB at D128)."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources
    return isinstance(e, (CompilationError, OutOfResources)) or (isinstance(e, RuntimeError) and any(
        s in str(e) for s in ("PassManager", "PTXAS", "ptxas")))


def ws_host_descriptors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sparse_block: tuple) -> bool:
    """Whether the warp-specialized forward's tensor descriptors can be made on the host, over [Z * H * LEN, D]
    views (no per-program set-up on the device, NOTES 38): contiguous inputs, rows countable in 32 bits, and a
    query length that is a multiple of the program's rows and a key length that is a multiple of the walk's sparse
    blocks (which it walks whole), so that no tile reaches into the next head's rows (its keys would be masked, but
    0 x a NaN or inf there is NaN)."""
    D = q.shape[-1]
    return (WS_HOST_DESCRIPTORS and q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
            and q.shape[-2] % WS_BLOCK_M == 0 and k.shape[-2] % WS_TILES[D]["BLOCK_N"] == 0
            and k.shape[-2] % sparse_block[1] == 0 and max(math.prod(q.shape), math.prod(k.shape)) // D < 2**31)


def _block_args(num_blocks, indices, full_num_blocks, full_indices) -> tuple:
    """A kernel's block-list arguments (one side's: kv blocks per q block, or q blocks per kv block): contiguous
    tensors (the partial ones stand in for absent full ones) and their strides; and whether there are full blocks."""
    has_full = full_num_blocks is not None
    if not has_full:
        full_num_blocks, full_indices = num_blocks, indices
    tensors = [t.contiguous() for t in (num_blocks, indices, full_num_blocks, full_indices)]
    return tensors, (*_mask_strides(tensors[0]), *_mask_strides(tensors[1])), has_full


@functools.lru_cache(maxsize=None)
def _ws_smem_layout(rows: int, D: int, dtype: torch.dtype):
    """The shared-memory layout of a [rows, D] tile, as the kernel allocates it (per call it costs host time)."""
    from triton.experimental.gluon import language as gl
    return gl.NVMMASharedLayout.get_default_for(
        [rows, D], {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[dtype])


def ws_fwd_turns(D: int, has_score_mod: bool) -> bool:
    """Whether the warp-specialized forward's consumers take turns issuing (the kernel's TURNS)."""
    return D in WS_FWD_TURNS_HEAD_DIMS or (D in WS_FWD_TURNS_PLAIN_HEAD_DIMS and not has_score_mod)


def launch_forward_ws(module, mod_args: list, q, k, v, kv_num_blocks, kv_indices,
                      full_kv_num_blocks: Optional[torch.Tensor], full_kv_indices: Optional[torch.Tensor],
                      sparse_block: tuple, scale: float, has_score_mod: bool, dense: bool = False,
                      max_scores: bool = False, wide=None):
    """Run ``module.flex_fwd_ws_kernel`` (the warp-specialized forward; the inputs must pass
    :func:`ws_forward_unmet`); returns out [B, Hq, Lq, D] (q.dtype), lse [B, Hq, Lq] fp32 and the row maxima (or
    None), as :func:`launch_forward`. ``wide``: where the items may take :data:`WS_FWD_WIDE_TILES` (three consumer
    warpgroups) at this head dim: True for the dense walk, for a block mask its four lists for q blocks of those
    tiles' rows (block_mask.item_lists); they are taken where that kernel spills at most
    :data:`WS_FWD_WIDE_MAX_LOCAL` bytes a thread (the dense walk :data:`WS_FWD_DENSE_WIDE_MAX_LOCAL` where
    :func:`dense_lengths_even`; its compile checked once), else the lists given, in items of
    :data:`WS_BLOCK_M` rows. Inside :func:`compile_only` both kernels compile."""
    B, Hq, Lq, D = q.shape
    Hkv, Lkv = k.shape[1], k.shape[2]
    out = torch.empty((B, Hq, Lq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, Lq), dtype=torch.float32, device=q.device)
    row_max = torch.empty_like(lse) if max_scores else None
    lists = (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)
    compiling = compiling_only()
    plan_key = None if compiling else (
        id(module), q.shape, k.shape, q.stride(), k.stride(), v.stride(), q.dtype, q.device, tuple(sparse_block),
        has_score_mod, dense, max_scores, full_kv_num_blocks is None,
        True if wide is True else ("lists", wide[2] is None) if isinstance(wide, tuple) else None, GENERATION,
        _device_facts(q.device))
    plan = None if plan_key is None else _WS_FWD_PLANS.get(plan_key)

    def kernel_args(descs, blocks, block_strides, work, n_qblocks, scalars) -> tuple:
        return (q, k, v, out, *descs, lse, lse if row_max is None else row_max, *blocks,
                Ints((*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], *block_strides, work,
                      n_qblocks, Hq, Hq // Hkv, Lq, Lkv)), float(scale), *scalars)
    if plan is not None and plan.module is module:  # (the choice below made before for such a call: its launch)
        blocks, block_strides, _ = _block_args(*(lists if plan.lists is None else wide))
        args = kernel_args(plan.descriptors(q, k, v, out), blocks, block_strides, plan.work, plan.n_qblocks,
                           scalars_to(mod_args, q.device))
        with llvm_opt_level(module.LLVM_OPT_LEVELS.get(D)):
            plan.launch((plan.programs,), args)
        return out, lse, row_max
    tiles = WS_TILES[D]
    host_desc = ws_host_descriptors(q, k, v, sparse_block)
    if host_desc:  # over [Z * H * LEN, D] views: a head's tiles never cross into the next head's rows
        descs = [RowsDescriptor(t, (rows, D), _ws_smem_layout(rows, D, q.dtype))
                 for t, rows in ((q, WS_HALF_M), (k, tiles["BLOCK_N"]), (v, tiles["BLOCK_N"]), (out, WS_HALF_M))]
    else:
        _ensure_allocator()  # the kernel makes its tensor descriptors on the device
        descs = [None] * 4
    persistent = WS_FWD_PERSISTENT and host_desc

    def q_buffers(tiles_: dict) -> int:  # the tiles' on a block mask's persistent walk, else one (nothing loads ahead)
        return tiles_["Q_BUFFERS"] if persistent and not dense else 1
    choices = [({**tiles, "BLOCK_M": WS_BLOCK_M, "Q_BUFFERS": q_buffers(tiles)}, lists, sparse_block)]
    wide_tiles = WS_FWD_WIDE_TILES.get(D) if wide is True or isinstance(wide, tuple) else None
    if wide_tiles:
        wide_tiles = {**wide_tiles, "SKIP_LEAD": WS_FWD_SKIP_EMPTY_LEAD and not dense,
                      "Q_BUFFERS": q_buffers(wide_tiles)}
        choices.insert(0, ({**tiles, **wide_tiles}, lists, sparse_block) if wide is True else
                       ({**tiles, **wide_tiles}, tuple(wide), (wide_tiles["BLOCK_M"], sparse_block[1])))
    scalars = scalars_to(mod_args, q.device)
    max_local = WS_FWD_DENSE_WIDE_MAX_LOCAL if dense and dense_lengths_even(Lq, Lkv) else WS_FWD_WIDE_MAX_LOCAL
    for n, (tiles_n, lists_n, sparse) in enumerate(choices):
        blocks, block_strides, has_full = _block_args(*lists_n)
        block_m = tiles_n["BLOCK_M"]
        n_qblocks = cdiv(Lq, block_m)
        work = n_qblocks * B * Hq
        programs = min(work, _device_facts(q.device)[0]) if persistent else work
        launch = compiled_launch(module.flex_fwd_ws_kernel, {**dict(
            D=D, SPARSE_Q_BLOCK=sparse[0], SPARSE_KV_BLOCK=sparse[1],
            EVEN_M=Lq % block_m == 0, EVEN_N=Lkv % sparse[1] == 0, HAS_FULL_BLOCKS=has_full,
            HAS_SCORE_MOD=has_score_mod, REVERSE_M=REVERSE_Q_BLOCKS, DENSE=dense, HOST_DESC=host_desc,
            PERSISTENT=persistent, STORE_MAX=max_scores, SKIP_LEAD=False,
            TURNS=ws_fwd_turns(D, has_score_mod), num_warps=4), **tiles_n})
        last = n == len(choices) - 1
        if not (last or compiling_only()) and (launch.local or 0) > max_local:
            continue  # (the wide kernel known not to fit: no arguments built for it)
        args = kernel_args(descs, blocks, block_strides, work, n_qblocks, scalars)
        with llvm_opt_level(module.LLVM_OPT_LEVELS.get(D)):  # the level its source names (llvm_level.llvm_opt_level)
            if compiling or last or launch.local_bytes((programs,), args) <= max_local:
                launch((programs,), args)
                if not compiling:
                    if plan_key is not None:
                        if len(_WS_FWD_PLANS) >= 256:
                            _WS_FWD_PLANS.clear()
                        _WS_FWD_PLANS[plan_key] = _WsForwardPlan(
                            module, launch, programs, work, n_qblocks, None if lists_n is lists else "wide",
                            (WS_HALF_M, tiles["BLOCK_N"]) if host_desc else False)
                    break
    return out, lse, row_max


class _WsForwardPlan(NamedTuple):
    """What :func:`launch_forward_ws` chose for a kind of call (its key: the module, the inputs' shapes, strides,
    dtype and device, the flags, which lists, the settings' :data:`GENERATION` and the device's SM count): the launch
    (the wide items' or not, their spills checked), its grid and work; ``lists``: None for the call's own lists,
    else the wide items'; ``rows``: the host descriptors' block rows (queries, keys), or False without host
    descriptors."""

    module: object  # (the key holds its id)
    launch: "CompiledLaunch"
    programs: int
    work: int
    n_qblocks: int
    lists: Optional[str]
    rows: "tuple | bool"

    def descriptors(self, q, k, v, out) -> list:
        if not self.rows:
            _ensure_allocator()  # the kernel makes its tensor descriptors on the device
            return [None] * 4
        D = q.shape[-1]
        layouts = [_ws_smem_layout(rows, D, q.dtype) for rows in self.rows]
        return [RowsDescriptor(q, (self.rows[0], D), layouts[0]), RowsDescriptor(k, (self.rows[1], D), layouts[1]),
                RowsDescriptor(v, (self.rows[1], D), layouts[1]), RowsDescriptor(out, (self.rows[0], D), layouts[0])]


_WS_FWD_PLANS: dict = {}


# the warp-specialized dK / dV kernel (bwd_ws.py.jinja, Gluon, Hopper): keys per program (two consumer warpgroups of
# half as many), and per head dim the queries per step, the Q / dO ring's stages and the consumers' registers
# (benchmarks/probe_bwd_ws.py on an H200, NOTES 40: 128 queries per step spill at both head dims, three stages
# measured even with two)
WS_BWD_BLOCK_N = 128
WS_BWD_TILES = {64: dict(BLOCK_M=64, STAGES=2, CONSUMER_REGS=240), 128: dict(BLOCK_M=64, STAGES=2, CONSUMER_REGS=240)}
# where flex_attention's backward takes it unless kernel_options say otherwise: with its fused dQ (below) the backward
# measured 1.15-1.27x the Triton kernels at D128 and 1.09-1.18x at D64 on the harness's masks but the document one
# (0.98x / 1.0x, taken all the same: NOTES 41)
WS_BWD_DEFAULT_HEAD_DIMS = frozenset({64, 128})
# dQ by the dK / dV programs (FA3's five-matmul backward: TMA reduce-adds into a zeroed fp32 buffer, then one cast)
# instead of the dQ kernel recomputing S and dP, unless torch.use_deterministic_algorithms(True) asks for
# reproducible sums (H200, benchmarks/probe_bwd_ws.py, NOTES 41)
WS_BWD_FUSED_DQ = True
# each query head's walk: its full tiles, then its partial ones (True), or the other way round: ptxas spills in the
# walk's second loop, and full tiles are most of a masked walk (H200, benchmarks/probe_bwd_costs.py: the kernel 6-12 %
# faster at D128 on the harness's masks, within noise at D64; NOTES 42)
WS_BWD_FULL_FIRST = True
# a persistent grid (a program per SM, taking a key block per pass over the grid, passes alternating in direction; its
# producer loads a key block's K / V while the consumers store the previous one's dK / dV) instead of a program per
# key block: True / False force it, None (the default) takes it where key blocks walk at most
# WS_BWD_PERSISTENT_MAX_WALK queries on average (flexlite.api._mean_walk: counted once per block mask, started by
# the forward, read by the backward without a device sync). H200
# (benchmarks/probe_bwd_costs.py, NOTES 47): 2-4 % faster on the short walks (sliding window 1024, document: ~1100 and
# ~600 queries), up to 4.5 % slower on long ones (prefix-LM, softcap: 4000+)
WS_BWD_PERSISTENT: Optional[bool] = None
WS_BWD_PERSISTENT_MAX_WALK = 2048
# mask_mod's values along the queries (what it computes from b, h, q_idx and captured tensors: a document mask's
# doc_id[q_idx] and the document's start) gathered on a compact vector, a query per thread, and spread along the
# tile's columns after the matmuls, instead of 16 gathers per thread in the tile's layout (H200: the document mask's
# backward 7 % faster at D128, 5 % at D64; masks without such gathers render the same source; NOTES 47)
WS_BWD_QUERY_VALUES = True
# the forward kernels (fwd.py.jinja, fwd_ws.py.jinja) fold a score_mod's constant input factor and positive output
# factor on tanh / sigmoid, up to 1024 (softcap's 30 * tanh(score / 30); NOTES 48 says why no more) into their own
# multiplies: per score one multiply before the mod and one FMA into exp2 instead of four multiplies and a subtraction
# (H200: softcap + causal's forward 4-5 % faster at both head dims; NOTES 47)
FOLD_SCORE_SCALES = True
# the forward kernels take a score_mod that is the score plus a bias of a query side and a key side (ALiBi's
# slopes[h] * (kv_idx - q_idx); lower_mod's separate) as the score plus the bias at the walk's first query row, one FMA
# per score with that key side computed along a tile's columns, and add the rest, constant along each row, to the
# row's LSE (and max_scores) once: a softmax does not see what is constant along a row (NOTES 62)
SEPARATE_SCORE_BIAS = True
# where that bias is affine in kv_idx (ALiBi's; lower_mod's affine_keys), the forward templates named here take its key
# side as a vector of a tile's columns computed once per walk, the same in every tile, plus the bias at the tile's first
# key, one scalar per tile added to the row max: no per-score bias arithmetic in the tile loop (H200: ALiBi + causal's
# warp-specialized forward 11.4 % faster at D64, WS_FWD_AFFINE_BIAS_HEAD_DIMS; the Triton forward takes it too, tested
# on CPU, offline at D64 shorter and at D128 spilling more, not measured on a GPU: off there; NOTES 86)
AFFINE_KEY_BIAS = frozenset({"fwd_ws.py.jinja"})
# head dims at which the warp-specialized forward computes a key side that is not affine (or all with AFFINE_KEY_BIAS
# off) on full tiles once per tile on a compact key vector, a key per thread, and spreads it along the tile's columns
# (as WS_FWD_KEY_VALUES does for mask_mod); elsewhere on the tile's column vector, 32 keys per thread (H200, ALiBi +
# causal's forward: 5.5 % faster at D128, 5.3 % slower at D64, NOTES 62)
WS_FWD_COMPACT_BIAS_HEAD_DIMS = frozenset({128})
# head dims at which the warp-specialized forward takes an affine key side so (AFFINE_KEY_BIAS), the vector held in
# registers through the walk (32 a thread; offline, ALiBi + causal's full-tile loop 654 -> 505 instructions at D64; at
# D128 its compact form's 571 against 564 with 16 spill loads a tile: NOTES 86)
WS_FWD_AFFINE_BIAS_HEAD_DIMS = frozenset({64})
# the forwards leave out of a partial tile's mask_mod the terms the tile's index ranges decide (a compare of index
# arithmetic that holds on the whole tile: sliding window's band on the diagonal tile, its causality on the window's
# edge; codegen.decide), choosing per tile among the mask's variants: the templates that do (H200, the warp-specialized
# forward: sliding window 3.9 % faster at D64, 6.7 % at D128; the Triton forward takes them too, tested on CPU and
# compiled offline, not measured on a GPU: off there; NOTES 87). The backward templates (bwd.py.jinja, bwd_ws.py.jinja)
# take them too, their partial tiles' P, dS and dS_in: on CPU the same bits as the whole mask, offline the
# warp-specialized dK / dV kernel without spills (sliding window's partial-tile loop 759 -> 1,051 instructions at
# D128 with every variant in it, one of them run per tile); not measured on a GPU: off (NOTES 90)
DECIDE_MASK_TERMS = frozenset({"fwd_ws.py.jinja"})
# each variant's kept terms rewritten where its dropped terms allow (codegen.decide._rewritten): |x| as x or -x where a
# dropped term gives x's sign, compares linear in the indices as a query side against a key side (sliding window's
# edge tile: one compare per score where it took a subtract, an abs and a compare). H200, warp-specialized forward:
# sliding window 1.1 % faster at D64 (two runs), even at D128 (NOTES 94)
DECIDE_REWRITE_TERMS = True
# the warp-specialized forward runs a bounded score_mod (softcap's cap * tanh, cap * log2(e) up to kernel.MAX_BOUND)
# against that bound instead of the running row max, with bf16 inputs and without max_scores: no row max, no rescale
# of O, P's row sums from the tensor cores (P times ones), so that l sums the bf16 weights P V multiplies (NOTES 64)
WS_FWD_BOUNDED_SOFTMAX = True
# per head dim the LLVM optimization level the warp-specialized forward compiles at (head dims not named: Triton's
# own, O3): at O3 LLVM's SLP vectorizer packs a partial tile's mask compares into a <64 x i1> vector that the NVPTX
# backend unpacks with ~200 shifts and logic ops per warp and tile (llvm_level.llvm_opt_level); at O0 the tile loops are
# what ptxas makes of the kernel alone (H200: the document mask's forward 9.8 % faster at D128, 5.9 % at D64, the
# other harness masks even or up to 4.7 % faster; NOTES 65). The dense walk's too where its lengths are multiples of
# 128 (no mask compares there): it was at O3 at D64 from NOTES 84 (then its O0 build spilled) to NOTES 108, where O0
# measured 2.6 % faster without a score_mod, 4 % with softcap, 1-3 % with ALiBi or a relative-position bias in two
# warpgroups (H200, B16 H16 S8192)
WS_FWD_LLVM_OPT_LEVELS = {64: "O0", 128: "O0"}
# the dense walk's at other lengths: at D64 Triton's O3 as before NOTES 108 (there O0's wide kernel spills 12-24 bytes
# in its tile loops, offline, and O3's none without a score_mod; not timed at O0)
WS_FWD_DENSE_RAGGED_LLVM_OPT_LEVELS = {128: "O0"}
# the same for the warp-specialized dK / dV kernel: at D128 O0 also ends O3's spills in its tile loops (H200: the
# backward 0.4-2.3 % faster, document's 13 %); at D64 its full-tile loops grow by ~45 instructions at O0 (2-3.4 %
# slower but for document and softcap; NOTES 65)
WS_BWD_LLVM_OPT_LEVELS = {128: "O0"}
# per head dim N: the warp-specialized forward computes one of every N of P's exponentials with a polynomial on the FMA
# pipes, the others on the SFU (flexlite.codegen.exp2; FA4's way). Off: on an H100 the softcap forward at D64 was no
# faster at N = 4 and 6.5 % slower at N = 2, plain causal 4.9-13.5 % slower (NOTES 70, 71)
WS_FWD_POLY_EXP2: dict = {}
# the same, over WS_FWD_POLY_EXP2, for a kernel that runs a bounded score_mod against its bound (softcap: its tanh
# shares the SFU with the exponentials; WS_FWD_BOUNDED_SOFTMAX). H200, D64 softcap + causal (the wide items):
# N = 8 8.3 % faster, 16 3.8 %, 4 4.1-5.6 %, 2 0.2-1.2 %; the same N = 4 made plain causal 12 %, full 8.5 % and
# ALiBi 4.5 % slower (NOTES 91). D128 (two warpgroups) at N = 8: 0.5 % slower (NOTES 92), so D64 only
WS_FWD_POLY_EXP2_BOUNDED = {64: 8}


def ws_backward_unmet(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sparse_block: tuple) -> Optional[str]:
    """What the warp-specialized dK / dV kernel needs that these inputs lack (None: it can run them): what the
    forward needs but its block sizes, and its descriptors made on the host: contiguous inputs, a query length that
    is a multiple of the block mask's q block and a key length that is a multiple of its kv block (whole blocks
    walked, no bounds checks)."""
    unmet = _ws_unmet(q, k, v, sparse_block, {d: (t["BLOCK_M"], WS_BWD_BLOCK_N) for d, t in WS_BWD_TILES.items()})
    if unmet:
        return unmet
    if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
        return "contiguous query, key and value"
    if q.shape[-2] % sparse_block[0] or k.shape[-2] % sparse_block[1]:
        return (f"a query length that is a multiple of the block mask's q block and a key length that is a multiple "
                f"of its kv block (got {q.shape[-2]}, {k.shape[-2]} for BLOCK_SIZE {tuple(sparse_block)})")
    if max(math.prod(q.shape), math.prod(k.shape)) // q.shape[-1] >= 2**31:
        return "fewer than 2**31 rows of query and of key (batch x heads x length)"
    return None


def _launch_dkdv_ws(module, mod_args: list, grad_args: list, q, k, v, grad_out, lse, delta, dk, dv, q_blocks: list,
                    sparse_block: tuple, scale: float, has_score_mod: bool, has_full: bool, dense: bool,
                    dq_acc: Optional[torch.Tensor] = None, persistent: bool = False):
    """Run ``module.flex_bwd_ws_dkdv_kernel`` (the inputs must pass :func:`ws_backward_unmet`) into dk, dv, and
    with ``dq_acc`` (a zeroed fp32 tensor shaped as q) add dQ into it as well; ``persistent``: a program per SM
    (:data:`WS_BWD_PERSISTENT`) instead of one per key block."""
    B, Hq, Lq, D = q.shape
    Hkv, Lkv = k.shape[1], k.shape[2]
    tiles = WS_BWD_TILES[D]
    half = WS_BWD_BLOCK_N // 2
    descs = [RowsDescriptor(t, (rows, D), _ws_smem_layout(rows, D, q.dtype))
             for t, rows in ((q, tiles["BLOCK_M"]), (k, half), (v, half), (grad_out.contiguous(), tiles["BLOCK_M"]))]
    if dq_acc is not None:  # a warpgroup's dQ tile: half the columns of BLOCK_M rows
        descs.append(RowsDescriptor(dq_acc, (tiles["BLOCK_M"], D // 2),
                                    _ws_smem_layout(tiles["BLOCK_M"], D // 2, torch.float32)))
    else:
        descs.append(descs[0])  # unused
    work = Lkv // WS_BWD_BLOCK_N * B * Hkv  # key blocks, each a work item (bws_work)
    programs = min(work, _device_facts(q.device)[0]) if persistent else work
    launch = compiled_launch(module.flex_bwd_ws_dkdv_kernel, dict(
        BLOCK_N=WS_BWD_BLOCK_N, D=D, DV=v.shape[-1], SPARSE_Q_BLOCK=sparse_block[0], SPARSE_KV_BLOCK=sparse_block[1],
        HAS_FULL_BLOCKS=has_full, HAS_SCORE_MOD=has_score_mod, DENSE=dense, FUSED_DQ=dq_acc is not None, **tiles,
        FULL_FIRST=WS_BWD_FULL_FIRST, PERSISTENT=persistent, num_warps=4))
    with llvm_opt_level(module.LLVM_OPT_LEVELS.get(D)):  # the level its source names (llvm_level.llvm_opt_level)
        launch((programs,), (
            *descs, lse, delta, dk, dv, *q_blocks,
            Ints((*_mask_strides(q_blocks[0]), *_mask_strides(q_blocks[1]), work, Hq, Hkv, Hq // Hkv, Lq, Lkv)),
            float(scale), *mod_args, *grad_args))


def decode_rows(q: torch.Tensor, k: torch.Tensor, sparse_block: tuple, mask_heads: int) -> int:
    """Query heads one decode program serves (GQA packing), or 0 when the decode kernel does not apply:
    it needs every query in the block mask's first q block and at most 128 tile rows."""
    Hq, Lq, Hkv = q.shape[1], q.shape[2], k.shape[1]
    if Lq > min(64, sparse_block[0]):
        return 0
    group = Hq // Hkv
    return group if mask_heads == 1 and group * Lq <= 128 else 1


# the decode kernel's tiles on CUDA: keys per step, warps, pipeline stages, and programs per SM that the
# split count aims for
# (use_tma: K / V through tensor descriptors, no faster on the H100 (NOTES 17); use_pdl: the combine kernel
# launched as a programmatic dependent launch of the decode kernel, so its launch overlaps the decode tail;
# both only on Hopper or newer)
DECODE_TILES = dict(BLOCK_N=64, num_warps=4, num_stages=4, waves=4, use_tma=False, use_pdl=True)
# the interpreter's: one big tile per step, no pipelining
_INTERPRETER_DECODE_TILES = dict(BLOCK_N=128, num_warps=4, num_stages=1, waves=1)


@functools.lru_cache(maxsize=4096)
def decode_splits(programs: int, tiles: int, sms: int, waves: int) -> int:
    """KV splits for ``programs`` (batch x head groups) decode programs over ``tiles`` key tiles: about ``waves``
    programs per SM, then the count among the top quarter below that whose last wave is fullest (a decode
    program holds most of an SM's shared memory: a partly filled last wave idles bandwidth). H200: B8 x 8 KV
    heads picks 8 splits (3.9 waves) over 9 (4.4 waves), 3 % faster; benchmarks/NOTES.md."""
    want = max(1, min(tiles, cdiv(waves * sms, programs)))

    def fill(s):  # fraction of the launched waves' slots that hold a program
        return programs * s / (cdiv(programs * s, sms) * sms)
    return max(range(max(1, (3 * want) // 4), want + 1), key=lambda s: (round(fill(s), 2), s))


# launches of a kernel seen before through its compiled kernel (CompiledLaunch, compiled_launch: without Triton's
# per-call binding; a forward call's host time about a quarter shorter, NOTES 66); False: every launch through
# Triton's own (JITFunction.run)
COMPILED_LAUNCHES = True
# a direct launch passes each RowsDescriptor as the tensor map Triton's launcher would encode from it, kept per
# address, shape and strides (NOTES 67); False: the descriptor made and its tensor map encoded at every launch
CACHED_TENSOR_MAPS = True


class RowsDescriptor(NamedTuple):
    """A host tensor descriptor (Gluon's) over a contiguous tensor's rows, ``tensor.view(-1, tensor.shape[-1])``,
    with this block shape and shared layout: a kernel argument to :class:`CompiledLaunch`, which makes Gluon's
    TensorDescriptor of it where Triton launches, and where it launches directly passes the tensor map that Triton's
    launcher would encode from that descriptor, encoded once per address, shape and strides (a forward call's host
    time on the H100 machine 234-302 us against 242-436 with the descriptors made and encoded at every launch:
    results/probes/host_launch-H100.md run 2, NOTES 67)."""

    tensor: torch.Tensor
    block_shape: tuple
    layout: object

    def make(self):
        """Gluon's TensorDescriptor of it."""
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
        return TensorDescriptor.from_tensor(self.tensor.view(-1, self.tensor.shape[-1]), list(self.block_shape),
                                            self.layout)


class Ints(tuple):
    """A run of int kernel arguments (strides, lengths) passed to :class:`CompiledLaunch` as one: keyed as one tuple
    (hashed in C) and spread into the launch's arguments, instead of one key entry per int (a forward's ~20)."""

    __slots__ = ()


def _made(args) -> list:
    """``args`` as Triton's launch takes them: each :class:`RowsDescriptor` made into its TensorDescriptor, each
    :class:`Ints` spread."""
    made = []
    for a in args:
        if a.__class__ is Ints:
            made.extend(a)
        else:
            made.append(a.make() if a.__class__ is RowsDescriptor else a)
    return made


class CompiledLaunch:
    """``kernel[grid](*args, **kwargs)`` for repeated launches with one ``kwargs`` (constexprs and options),
    through the compiled kernel that Triton returned for the same arguments, without JITFunction.run's
    per-call binding, specialization and cache-key work (the decode path launches twice per step: on the
    H100's host 166 -> 139 us per step; with tensors passed as addresses, 100 us on the H200's host;
    benchmarks/NOTES.md 17, 19).

    A compiled kernel is reused only for arguments equal in every int, of the same kinds otherwise, with
    tensors of the same dtype and address modulo 256 and host tensor descriptors of the same dtype, block shape and
    layout: at least as fine as what Triton specializes on (ints equal to 1 or divisible by 16, 16-byte aligned
    pointers, a descriptor's type), so it was compiled for these very properties. :class:`RowsDescriptor` arguments
    go to Triton's launcher as the tensor maps it would encode from them (:class:`_Direct`).
    Anything new goes through Triton's own launch first; what Triton reads from its knobs at a launch (debug,
    instrumentation) is then that first launch's. Written against Triton 3.6's launcher; with another
    Triton, or a kernel whose constexpr parameters are not all after the others, every launch is Triton's."""

    def __init__(self, kernel, kwargs: dict):
        self.kernel, self.kwargs = kernel, kwargs
        params = getattr(kernel, "params", None)
        runtime = [p for p in params or () if not p.is_constexpr]
        self.tail = tuple(kwargs.get(p.name) for p in params or () if p.is_constexpr)
        self.direct = bool(params) and triton.__version__.startswith("3.6.") and all(
            p.is_constexpr == (i >= len(runtime)) for i, p in enumerate(params)) and all(
            p.name in kwargs for p in params if p.is_constexpr)
        self.compiled: dict = {}  # the arguments' properties -> _Direct
        self.local: Optional[int] = None  # (local_bytes)

    def local_bytes(self, grid: tuple, args: tuple) -> int:
        """The local memory (spilled registers) a thread of the kernel uses, compiled for these arguments (and
        loaded) here if it is not yet; the first answer is kept for every later call."""
        if self.local is None:
            ck = self.kernel.run(*_made(args), grid=grid, warmup=True, **self.kwargs)
            ck = ck.result() if hasattr(ck, "result") else ck
            ck._init_handles()
            self.local = 4 * ck.n_spills  # (Triton's n_spills: CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES / 4)
        return self.local

    def __call__(self, grid: tuple, args: tuple):
        if not (self.direct and COMPILED_LAUNCHES) or compiling_only():
            _launch(self.kernel, grid, args, self.kwargs)
            return
        # the current device too: Triton loads a compiled kernel per device and launches on the current one
        device, stream = _current_device_and_stream()
        # per argument: an int's value, a tensor's dtype and address mod 256, a float's kind, anything else's type
        # and value; tensors go to the launcher as their addresses (an int skips its data_ptr() call and driver
        # pointer query). Ints first: most arguments are (strides, lengths)
        key, flat, rows = [device], [], []
        add_key, add_arg = key.append, flat.append
        for a in args:
            cls = a.__class__
            if cls is int:
                add_key(a)
                add_arg(a)
            elif cls is Ints:  # (its values keyed as one tuple: Triton specializes on each, == 1 and % 16)
                add_key(a)
                flat.extend(a)
            elif cls is RowsDescriptor:  # as Triton specializes a host descriptor: dtype, block shape, layout
                add_key((cls, a.tensor.dtype, a.block_shape, a.layout))
                rows.append(len(flat))
                add_arg(a)
            elif isinstance(a, torch.Tensor):
                ptr = a.data_ptr()
                add_key((a.dtype, ptr & 255))
                add_arg(ptr)
            else:
                if cls is float:
                    add_key(float)
                elif getattr(a, "block_shape", None) is not None:  # a host tensor descriptor (Triton's or Gluon's)
                    # as Triton specializes one: its dtype, block shape and shared layout (its launcher encodes the
                    # tensor map from the base, shape and strides at every launch)
                    add_key((cls, a.base.dtype, tuple(a.block_shape), getattr(a, "layout", None), a.padding))
                else:  # a bool, None, ...
                    add_key((cls, a))
                add_arg(a)
        key = tuple(key)
        direct = self.compiled.get(key)
        if direct is None:
            ck = self.kernel[grid](*_made(args), **self.kwargs)
            if len(self.compiled) < 64:
                self.compiled[key] = _Direct(ck.result() if hasattr(ck, "result") else ck)
            return
        ck = direct.ck
        hooks = _triton_knobs.runtime
        enter, leave = _hook(hooks.launch_enter_hook), _hook(hooks.launch_exit_hook)
        grid3 = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        if (rows and CACHED_TENSOR_MAPS and direct.raw is not None and len(rows) == len(direct.metas)
                and enter is None and leave is None):  # (every descriptor argument a RowsDescriptor)
            for i in reversed(range(len(rows))):  # each descriptor as the tensor map and sizes it expands to
                at = rows[i]
                flat[at:at + 1] = direct.tensor_map(i, flat[at])
            direct.raw(*grid3, stream, ck.function, direct.coop, direct.pdl, None, None, ck.packed_metadata, None,
                       None, None, *flat, *self.tail)
            return
        if rows:
            flat = _made(flat)
        # as JITFunction.run: launch hooks see the launch metadata (with the tensors, as Triton's launch would)
        meta = None if enter is None and leave is None else ck.launch_metadata(grid, stream, *_made(args), *self.tail)
        ck.run(*grid3, stream, ck.function, ck.packed_metadata, meta, enter, leave, *flat, *self.tail)


class _Direct:
    """A compiled kernel as :class:`CompiledLaunch` launches it directly. With host tensor descriptors, Triton 3.6's
    launcher (``ck.run``) wraps the compiled launcher in a function that encodes each descriptor's tensor map
    (cuTensorMapEncodeTiled) and expands it into the map, shape and strides at every launch; ``raw`` is the launcher
    under that wrapper (None: no wrapper, a kernel that needs scratch memory, or a launcher not as Triton 3.6 builds
    it), and ``maps`` the expansions made, per descriptor argument, address, shape and strides (a tensor map holds
    those alone: memory freed and allocated again at an address gets the same map)."""

    MAX_MAPS = 1024  # expansions kept per kernel before they are dropped (a training loop cycles through a few)

    def __init__(self, ck):
        self.ck, self.raw, self.metas, self.maps = ck, None, None, {}
        run = getattr(ck, "run", None)
        inner = getattr(run, "launch", None)
        code = getattr(inner, "__code__", None)
        metas = getattr(getattr(ck, "metadata", None), "tensordesc_meta", None)
        if (code is not None and "launcher" in code.co_freevars and metas and all(metas)
                and run.global_scratch_size == 0 and run.profile_scratch_size == 0):
            self.raw = inner.__closure__[code.co_freevars.index("launcher")].cell_contents
            self.metas, self.coop, self.pdl = list(metas), run.launch_cooperative_grid, run.launch_pdl

    def tensor_map(self, i: int, desc: RowsDescriptor) -> list:
        """The ``i``-th descriptor argument as Triton's launcher expands it (driver.make_tensordesc_arg)."""
        t = desc.tensor
        key = (i, t.data_ptr(), t.shape, t.stride())
        expanded = self.maps.get(key)
        if expanded is None:
            from triton.backends.nvidia.driver import make_tensordesc_arg
            if len(self.maps) >= self.MAX_MAPS:
                self.maps.clear()
            expanded = self.maps[key] = make_tensordesc_arg(desc.make(), self.metas[i])
        return expanded


def _hook(hook):
    """A launch hook as the launcher takes it: None for none, also for Triton 3.6's empty HookChain (which the
    launcher would call, after the launch metadata had been built for it, at every launch)."""
    return None if hook is None or getattr(hook, "calls", True) == [] else hook


_LAUNCHES: dict = {}  # (id(kernel), kwargs' items) -> its CompiledLaunch (which keeps the kernel, and so its id)


def compiled_launch(kernel, kwargs: dict) -> CompiledLaunch:
    """The :class:`CompiledLaunch` of ``kernel`` with these constexprs and options, one per combination for the
    process (as the kernel modules are kept): ``compiled_launch(kernel, kwargs)(grid, args)`` launches as
    ``kernel[grid](*args, **kwargs)`` does, without Triton's per-call binding once it has compiled for these
    arguments' properties (~45 arguments in the warp-specialized forward: benchmarks/NOTES.md 66). Each call site
    builds ``kwargs`` in one order."""
    key = (id(kernel), tuple(kwargs.items()))
    launch = _LAUNCHES.get(key)
    if launch is None:
        launch = _LAUNCHES[key] = CompiledLaunch(kernel, dict(kwargs))
    return launch


def _current_device_and_stream() -> tuple:
    """The current CUDA device's index and its current stream's handle, as Triton's launch reads them."""
    device = torch.cuda.current_device()
    return device, torch._C._cuda_getCurrentRawStream(device)


class _DecodePlan:
    """What a decode call of one shape needs besides its tensors (see :func:`_decode_plan`); ``launch`` maps a
    decode kernel (one per pair of mods) to its :class:`CompiledLaunch` once a tile config is known to fit it."""

    def __init__(self, num_splits: int, programs: int, constexprs: dict, config: TileConfig, combine: dict):
        self.num_splits, self.programs, self.constexprs, self.config = num_splits, programs, constexprs, config
        self.combine = combine
        self.launch: dict = {}  # decode kernel -> CompiledLaunch with the tiles that fit it
        self.combine_launch: dict = {}  # combine kernel -> CompiledLaunch


@functools.lru_cache(maxsize=256)
def _decode_plan(device: torch.device, B: int, Hq: int, Lq: int, D: int, Hkv: int, Lkv: int, Dv: int,
                 sparse_block: tuple, rows: int, has_full: bool, has_score_mod: bool, num_splits: Optional[int],
                 use_tma: bool, allow_tf32: bool, tiles_items: tuple, max_scores: bool = False) -> _DecodePlan:
    """Split count, constexprs and tiles of a decode call: cached per shape (decoding repeats one shape per step,
    and working these out costs host time that a step of ~0.1 ms cannot hide)."""
    cuda = device.type == "cuda"
    tiles = dict(tiles_items)
    block_n = _pow2_divisor(sparse_block[1], tiles["BLOCK_N"])
    programs = B * Hq // rows
    if num_splits is None:
        sms = _device_facts(device)[0] if cuda else 2
        num_splits = decode_splits(programs, cdiv(Lkv, block_n), sms, tiles["waves"])
    else:  # (kernel_options DECODE_SPLITS) at most one split per key tile the block lists can name: the rest walk none
        pinned = num_splits
        num_splits = max(1, min(num_splits, cdiv(Lkv, sparse_block[1]) * (sparse_block[1] // block_n)))
        most = tl.TRITON_MAX_TENSOR_NUMEL // head_dim_pad(Dv)  # the combine step merges them in one [splits, Dv] tile
        if num_splits > most:
            raise ValueError(f"flex_attention: kernel_options DECODE_SPLITS={pinned} is more splits than the decode "
                             f"kernel's combine step merges at value head dim {Dv} (at most {most}); pin fewer")
    use_pdl = bool(tiles.get("use_pdl")) and cuda and _device_facts(device)[1] >= 9 and _has_gdc()
    constexprs = dict(
        ROWS=rows, SPARSE_KV_BLOCK=sparse_block[1], D=D, DV=Dv, D_PAD=head_dim_pad(D), DV_PAD=head_dim_pad(Dv),
        EVEN_N=Lkv % sparse_block[1] == 0, HAS_FULL_BLOCKS=has_full, HAS_SCORE_MOD=has_score_mod,
        FP32_PRECISION="tf32" if allow_tf32 else "ieee", USE_TMA=use_tma, USE_PDL=use_pdl, STORE_MAX=max_scores)
    config = TileConfig(max(16, next_pow2(rows * Lq)), block_n, tiles["num_warps"], tiles["num_stages"])
    combine = dict(DV=Dv, DV_PAD=head_dim_pad(Dv), SPLITS_PAD=max(2, next_pow2(num_splits)), USE_PDL=use_pdl,
                   STORE_MAX=max_scores, **(dict(launch_pdl=True) if use_pdl else {}))
    return _DecodePlan(num_splits, programs, constexprs, config, combine)


def launch_decode(module, mod_args: list, q, k, v, kv_num_blocks, kv_indices,
                  full_kv_num_blocks: Optional[torch.Tensor], full_kv_indices: Optional[torch.Tensor],
                  sparse_block: tuple, scale: float, has_score_mod: bool, rows: int, num_splits: Optional[int] = None,
                  use_tma: Optional[bool] = None, max_scores: bool = False):
    """Split-KV decoding (``module.flex_decode_kernel``) and the combine step; returns (out, lse, row maxima or None)
    as :func:`launch_forward` does. ``use_tma`` (kernel_options USE_TMA): tensor-descriptor loads where
    :func:`tma_ok` allows; None: ``DECODE_TILES["use_tma"]``."""
    B, Hq, Lq, D = q.shape
    Hkv, Lkv, Dv = k.shape[1], k.shape[2], v.shape[-1]
    cuda = q.device.type == "cuda"
    tiles = DECODE_TILES if cuda else _INTERPRETER_DECODE_TILES
    use_tma = tma_loads(use_tma, tiles.get("use_tma"), k, v)
    has_full = full_kv_num_blocks is not None
    plan = _decode_plan(q.device, B, Hq, Lq, D, Hkv, Lkv, Dv, tuple(sparse_block), rows, has_full, has_score_mod,
                        num_splits, use_tma, cuda and torch.backends.cuda.matmul.allow_tf32, tuple(tiles.items()),
                        max_scores)
    out_s = torch.empty((B, Hq, plan.num_splits, Lq, Dv), dtype=torch.float32, device=q.device)
    lse_s = torch.empty((B, Hq, plan.num_splits, Lq), dtype=torch.float32, device=q.device)
    max_s = torch.empty_like(lse_s) if max_scores else lse_s  # (unused stand-in without max_scores)
    if not has_full:
        full_kv_num_blocks, full_kv_indices = kv_num_blocks, kv_indices
    nb, idx = kv_num_blocks.contiguous(), kv_indices.contiguous()
    full_nb, full_idx = full_kv_num_blocks.contiguous(), full_kv_indices.contiguous()
    args = (q, k, v, out_s, lse_s, max_s, nb, idx, full_nb, full_idx,
            Ints((*q.stride(), *k.stride(), *v.stride(), *_mask_strides(nb)[:2], *_mask_strides(idx)[:2],
                  Hq, Hq // Hkv, Lq, Lkv)), float(scale), plan.num_splits, *scalars_to(mod_args, q.device))
    grid = (plan.num_splits, plan.programs)
    kernel, combine = module.flex_decode_kernel, module.flex_decode_combine_kernel
    with interpreter_scope(not cuda):
        launch = plan.launch.get(kernel)
        if launch is None:
            # a mod's gathers are pipelined too: with 4 stages they can pass shared memory, hence the fallback
            cfg = run_with_fallback(kernel, lambda cfg: grid, args, plan.constexprs, plan.config, pinned=False,
                                    shrink_m=False)
            plan.launch[kernel] = CompiledLaunch(kernel, dict(
                plan.constexprs, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages))
        else:
            launch(grid, args)
        out = torch.empty((B, Hq, Lq, Dv), dtype=q.dtype, device=q.device)
        lse = torch.empty((B, Hq, Lq), dtype=torch.float32, device=q.device)
        row_max = torch.empty_like(lse) if max_scores else None
        launch = plan.combine_launch.get(combine)
        if launch is None:
            launch = plan.combine_launch[combine] = CompiledLaunch(combine, plan.combine)
        launch((B * Hq * Lq,), (out_s, lse_s, max_s, out, lse, lse if row_max is None else row_max, *out.stride(),
                                Hq, Lq, plan.num_splits))
    return out, lse, row_max


def default_use_tma(dense: bool, D: int, Dv: int) -> bool:
    """Whether the forward and backward kernels load the walked side's tiles through tensor descriptors unless
    kernel_options USE_TMA says: on the dense walk (no block mask) at head dims up to 128, where they measured
    0-3 % faster; with a block mask they were slower, up to 12 % on short walks (NOTES 4, 25, 26). :func:`tma_ok`
    still has to allow them."""
    return dense and max(head_dim_pad(D), head_dim_pad(Dv)) <= 128


def tma_ok(*tensors: torch.Tensor) -> bool:
    """Tensor descriptors need Hopper or newer, a unit last stride and 16-byte aligned rows and bases."""
    if not tensors[0].is_cuda or _device_facts(tensors[0].device)[1] < 9:
        return False
    return all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and
               all(st * t.element_size() % 16 == 0 for st in t.stride()[:-1]) for t in tensors)


def tma_loads(use_tma: Optional[bool], default: bool, *tensors: torch.Tensor) -> bool:
    """Whether a launch loads through tensor descriptors: kernel_options USE_TMA (None: the launcher's
    ``default``), where :func:`tma_ok` allows ``tensors``; installs the scratch allocator descriptors need."""
    use = bool(default if use_tma is None else use_tma) and tma_ok(*tensors)
    if use:
        _ensure_allocator()
    return use


def _ensure_allocator():
    """Device-side tensor descriptors need scratch memory from an allocator; install torch's if none is."""
    from triton.runtime import _allocation
    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))


def forward_candidates(q: torch.Tensor, v: torch.Tensor, sparse_block: tuple) -> list:
    """The forward's autotuning space per head dim (from benchmarks/probe_fwd.py sweeps)."""
    d = max(head_dim_pad(q.shape[-1]), head_dim_pad(v.shape[-1]))
    if d <= 64:
        space = [(128, 128, 4, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2), (128, 128, 4, 2)]
    elif d <= 128:
        space = [(128, 64, 4, 2), (128, 64, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2), (128, 32, 4, 3)]
    else:
        space = [(64, 32, 4, 2), (64, 64, 4, 1), (32, 32, 4, 2), (64, 32, 8, 2)]
    if q.dtype == torch.float32:
        space = [(m, max(16, n // 2), w, s) for m, n, w, s in space]
    return list(dict.fromkeys(TileConfig(_pow2_divisor(sparse_block[0], m), _pow2_divisor(sparse_block[1], n), w, s)
                              for m, n, w, s in space))


def _tuning_key(module, q: torch.Tensor, v: torch.Tensor, sparse_block: tuple, has_full: bool,
                constexprs: dict) -> str:
    """What a tuned choice is remembered by besides the pass: the kernel source (its file's hash name), the
    walk and loads the launch picks among its variants (DENSE, USE_TMA), dtype, head dims, sparse block size,
    whether there are full blocks, and the lengths' buckets."""
    return (f"{Path(module.__file__).stem}|dense={constexprs['DENSE']}|tma={constexprs['USE_TMA']}|{q.dtype}|"
            f"D{q.shape[-1]}|DV{v.shape[-1]}|{tuple(sparse_block)}|"
            f"full={has_full}|L{length_bucket(q.shape[-2])}x{length_bucket(v.shape[-2])}")


def _autotune(kernel, grid, args: tuple, constexprs: dict, default: TileConfig, candidates: list, key: str,
              device: torch.device) -> TileConfig:
    """The fastest of ``default`` and ``candidates`` (timed on the GPU, cached on disk by ``key``); the kernel
    must only write outputs that a rerun rewrites. Triton's interpreter (CPU) keeps ``default``: its timings
    say nothing about a GPU."""
    if device.type != "cuda":
        return default
    candidates = [default] + [c for c in candidates if c != default]
    import triton.testing
    from triton.runtime.errors import OutOfResources

    def measure(cfg_dict: dict) -> float:
        cfg = TileConfig(**cfg_dict)

        def run():
            kernel[grid(cfg)](*args, **constexprs, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N,
                              num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        try:
            run()
        except OutOfResources:
            return math.inf
        return float(triton.testing.do_bench(run, warmup=5, rep=25, return_mode="median"))

    gpu = torch.cuda.get_device_name(device)
    best = autotune.tune(gpu, key, [dataclasses.asdict(c) for c in candidates], measure, label=key)
    return TileConfig(**best)


# ---------------------------------------------------------------------------------------------
# backward

@dataclasses.dataclass(frozen=True)
class BackwardTileConfig:
    """dK/dV programs own BLOCK_N1 keys and step over BLOCK_M1 queries; dQ programs own BLOCK_M2
    queries and step over BLOCK_N2 keys (torch's names, also the kernel_options keys). ``num_warps`` /
    ``num_stages`` apply to both kernels unless ``dq_num_warps`` / ``dq_num_stages`` set the dQ kernel's."""

    BLOCK_M1: int
    BLOCK_N1: int
    BLOCK_M2: int
    BLOCK_N2: int
    num_warps: int
    num_stages: int
    dq_num_warps: Optional[int] = None
    dq_num_stages: Optional[int] = None

    def dkdv_tiles(self) -> TileConfig:
        return TileConfig(self.BLOCK_M1, self.BLOCK_N1, self.num_warps, self.num_stages)

    def dq_tiles(self) -> TileConfig:
        return TileConfig(self.BLOCK_M2, self.BLOCK_N2, self.dq_num_warps or self.num_warps,
                          self.dq_num_stages or self.num_stages)


BACKWARD_CONFIG_KEYS = ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "num_warps", "num_stages")


def backward_candidates(q: torch.Tensor, v: torch.Tensor, sparse_block: tuple) -> tuple:
    """The backward's autotuning spaces per head dim (benchmarks/probe_bwd.py sweeps, NOTES 9): dK/dV tiles
    (BLOCK_M1 queries per step x BLOCK_N1 keys, warps, stages) and dQ tiles (BLOCK_M2 queries x BLOCK_N2 keys
    per step), tuned separately."""
    d = max(head_dim_pad(q.shape[-1]), head_dim_pad(v.shape[-1]))
    if d <= 64:
        dkdv = [(64, 64, 4, 3), (32, 128, 4, 3), (64, 64, 4, 2), (32, 64, 4, 3), (64, 128, 8, 2)]
        dq = [(64, 32, 4, 3), (64, 64, 4, 3), (64, 32, 4, 2), (128, 64, 8, 2)]
    elif d <= 128:
        dkdv = [(64, 64, 4, 2), (32, 64, 4, 2), (64, 64, 4, 3), (32, 128, 4, 2), (64, 128, 8, 2)]
        dq = [(64, 64, 4, 2), (64, 32, 4, 2), (64, 64, 4, 3), (32, 64, 4, 2), (128, 64, 8, 2)]
    else:
        dkdv = [(16, 32, 4, 1), (32, 32, 4, 1), (16, 64, 4, 1), (32, 32, 4, 2)]
        dq = [(32, 16, 4, 1), (32, 32, 4, 1), (16, 32, 4, 1)]
    shrink = 2 if q.dtype == torch.float32 else 1

    def tiles(space):
        return list(dict.fromkeys(TileConfig(_pow2_divisor(sparse_block[0], max(16, m // shrink)),
                                             _pow2_divisor(sparse_block[1], max(16, n // shrink)), w, st)
                                  for m, n, w, st in space))
    return tiles(dkdv), tiles(dq)


def backward_config(q: torch.Tensor, v: torch.Tensor, sparse_block: tuple, kernel_options: dict,
                    gathers: bool = False) -> BackwardTileConfig:
    """Backward tile sizes: heuristic defaults per head dim, dtype and device, then ``kernel_options`` pins
    (``BLOCK_M1``, ``BLOCK_N1``, ``BLOCK_M2``, ``BLOCK_N2``, ``num_warps``, ``num_stages``).
    ``gathers``: score_mod or mask_mod reads captured tensors (ALiBi's slopes, a bias table, document ids): at D128
    the dK/dV kernel then steps over 32 queries at a time, not 64 (NOTES 27, 34)."""
    d = max(head_dim_pad(q.shape[-1]), head_dim_pad(v.shape[-1]))
    if q.device.type != "cuda":
        # the interpreter's cost is per op, not per element: big tiles, but not far past the length
        bm = min(128, max(16, next_pow2(q.shape[-2])))
        bn = min(128, max(16, next_pow2(v.shape[-2])))
        m1, n1, m2, n2, warps, stages = bm, bn, bm, bn, 4, 1
    elif d <= 64:  # benchmarks/probe_bwd.py on an H200 (NOTES 9): best on causal + document together
        m1, n1, m2, n2, warps, stages = 64, 64, 64, 32, 4, 3
    elif d <= 128:
        m1, n1, m2, n2, warps, stages = 32 if gathers else 64, 64, 64, 64, 4, 2
    else:
        m1, n1, m2, n2, warps, stages = 16, 32, 32, 16, 4, 1
    if q.dtype == torch.float32 and q.device.type == "cuda":
        m1, n1, m2, n2 = (max(16, x // 2) for x in (m1, n1, m2, n2))
    cfg = dict(BLOCK_M1=_pow2_divisor(sparse_block[0], m1), BLOCK_N1=_pow2_divisor(sparse_block[1], n1),
               BLOCK_M2=_pow2_divisor(sparse_block[0], m2), BLOCK_N2=_pow2_divisor(sparse_block[1], n2),
               num_warps=warps, num_stages=stages)
    return BackwardTileConfig(**_pin(cfg, kernel_options, BACKWARD_CONFIG_KEYS, {
        "BLOCK_M1": sparse_block[0], "BLOCK_N1": sparse_block[1], "BLOCK_M2": sparse_block[0],
        "BLOCK_N2": sparse_block[1]}))


def launch_backward(module, mod_args: list, grad_args: list, q, k, v, out, lse, grad_out,
                    grad_lse: Optional[torch.Tensor], kv_blocks: tuple, q_blocks: tuple, sparse_block: tuple,
                    scale: float, has_score_mod: bool,
                    config: "BackwardTileConfig | Callable[[], BackwardTileConfig]", *, need_dq: bool = True,
                    ds: Optional[torch.Tensor] = None, scatter_captured_grads: bool = False, pinned: bool = False,
                    tune: bool = False, dense: bool = False, use_tma: Optional[bool] = None, ws_module=None,
                    ws_persistent: bool = False):
    """Run ``module``'s preprocess, dK/dV and dQ kernels; returns dq (None unless ``need_dq``), dk, dv in
    the input dtype. ``config``: the Triton kernels' tiles, or a function making them, called where those kernels
    run (with its fused dQ the warp-specialized kernel runs alone: backward_config's ~15 us of host time a call not
    spent, NOTES 104). ``tune``: autotune the dK/dV and the dQ tiles (GPU, not pinned; not the dK/dV tiles when
    they scatter captured-tensor gradients with atomics, which a timing rerun would add twice).

    ``kv_blocks`` / ``q_blocks``: (num_blocks, indices, full_num_blocks, full_indices) of each side (full
    ones may be None). ``grad_lse``: d loss / d lse [B, Hq, Lq] or None. ``ds``: a zeroed float32
    [B, Hq, Lq, Lkv] tensor to receive dS (d loss / d score_mod output), or None.
    ``scatter_captured_grads``: run the module's atomic captured-tensor gradient function.
    ``dense``: there is no block mask: both kernels walk every tile of the other side, no block-index loads.
    ``use_tma``: load the walked side's tiles (Q / dO for dK/dV, K / V for dQ) through tensor descriptors
    where :func:`tma_ok` allows; None: :func:`default_use_tma`.
    ``ws_module``: run dK / dV with its warp-specialized kernel instead (bwd_ws.py.jinja for the same mods; the
    inputs must pass :func:`ws_backward_unmet`; not with ``ds`` or ``scatter_captured_grads``), and dQ with it too
    (:data:`WS_BWD_FUSED_DQ`) unless ``torch.use_deterministic_algorithms(True)`` is on; ``ws_persistent``: with
    its persistent grid (:data:`WS_BWD_PERSISTENT`).
    """
    B, Hq, Lq, D = q.shape
    Hkv, Lkv, Dv = k.shape[1], k.shape[2], v.shape[-1]
    interpret = q.device.type != "cuda"
    allow_tf32 = not interpret and torch.backends.cuda.matmul.allow_tf32
    lse = lse.contiguous()
    mod_args = scalars_to(mod_args, q.device)
    delta = torch.empty((B, Hq, Lq), dtype=torch.float32, device=q.device)
    dk = torch.empty((B, Hkv, Lkv, D), dtype=k.dtype, device=q.device)
    dv = torch.empty((B, Hkv, Lkv, Dv), dtype=v.dtype, device=q.device)
    # dQ added by the warp-specialized kernel into an fp32 buffer (then cast), or by the dQ kernel
    fused_dq = (ws_module is not None and need_dq and WS_BWD_FUSED_DQ and _gluon_tma_reduce_available()
                and not torch.are_deterministic_algorithms_enabled())
    triton_dq = need_dq and not fused_dq
    dq = torch.empty((B, Hq, Lq, D), dtype=q.dtype, device=q.device) if triton_dq else None
    q_block_args, q_block_strides, has_full = _block_args(*q_blocks)
    # the Triton kernels' arguments: not where the warp-specialized kernel adds dQ too (unless tuning), which takes its
    # own (their building timed at ~50 us of a backward's host time on the H200 machine; the backwards' host time with
    # the plans measured within the host's noise but for the D128 document one's, NOTES 102)
    triton_kernels = ws_module is None or triton_dq or (tune and not pinned)
    if triton_kernels:
        kv_block_args, kv_block_strides, _ = _block_args(*kv_blocks)
        constexprs = dict(
            SPARSE_Q_BLOCK=sparse_block[0], SPARSE_KV_BLOCK=sparse_block[1], D=D, DV=Dv, D_PAD=head_dim_pad(D),
            DV_PAD=head_dim_pad(Dv), HAS_FULL_BLOCKS=has_full, HAS_SCORE_MOD=has_score_mod,
            FP32_PRECISION="tf32" if allow_tf32 else "ieee", DENSE=dense,
            USE_TMA=tma_loads(use_tma, default_use_tma(dense, D, Dv), q, k, v, grad_out))
        dkdv_args = (q, k, v, grad_out, lse, delta, dk, dv, ds if ds is not None else delta, *q_block_args,
                     *q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *dk.stride(), *dv.stride(),
                     *q_block_strides, Hq, Hkv, Hq // Hkv, Lq, Lkv, float(scale), *mod_args, *grad_args)
        dkdv_constexprs = dict(constexprs, WRITE_DS=ds is not None, SCATTER_CAPTURED_GRADS=scatter_captured_grads)

        def dkdv_grid(cfg):  # programs own BLOCK_N keys
            # the q walk covers whole sparse q blocks: unchecked only if they all end inside Q_LEN
            dkdv_constexprs.update(EVEN_M=Lq % sparse_block[0] == 0, EVEN_N=Lkv % cfg.BLOCK_N == 0)
            return (cdiv(Lkv, cfg.BLOCK_N), B * Hkv)

        dq_args = (q, k, v, grad_out, lse, delta, dq, *kv_block_args,
                   *q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *(q if dq is None else dq).stride(),
                   *kv_block_strides, Hq, Hq // Hkv, Lq, Lkv, float(scale), *mod_args, *grad_args)
        dq_constexprs = dict(constexprs, REVERSE_M=REVERSE_Q_BLOCKS)

        def dq_grid(cfg):  # programs own BLOCK_M queries
            dq_constexprs.update(EVEN_M=Lq % cfg.BLOCK_M == 0, EVEN_N=Lkv % sparse_block[1] == 0)
            return (cdiv(Lq, cfg.BLOCK_M), B * Hq)

    pre_block = min(64, max(16, next_pow2(Lq)))
    with interpreter_scope(interpret):
        compiled_launch(module.flex_bwd_preprocess_kernel, dict(
            BLOCK_M=pre_block, DV=Dv, DV_PAD=head_dim_pad(Dv), HAS_DLSE=grad_lse is not None))(
            (cdiv(Lq, pre_block), B * Hq), (out, grad_out, grad_lse.contiguous() if grad_lse is not None else lse,
                                            delta, *out.stride(), *grad_out.stride(), Hq, Lq))
        if triton_kernels:  # (the tiles made here: the warp-specialized kernel with its fused dQ takes none)
            config = config() if callable(config) else config
            dkdv_tiles, dq_tiles = config.dkdv_tiles(), config.dq_tiles()
        if tune and not pinned:
            key = f"{_tuning_key(module, q, v, sparse_block, has_full, constexprs)}|ds={ds is not None}"
            dkdv_space, dq_space = backward_candidates(q, v, sparse_block)
            if not scatter_captured_grads and ws_module is None:
                dkdv_tiles = _autotune(module.flex_bwd_dkdv_kernel, dkdv_grid, dkdv_args, dkdv_constexprs,
                                       dkdv_tiles, dkdv_space, f"bwd-dkdv|{key}", q.device)
            if triton_dq:
                dq_tiles = _autotune(module.flex_bwd_dq_kernel, dq_grid, dq_args, dq_constexprs, dq_tiles, dq_space,
                                     f"bwd-dq|{key}", q.device)
        if ws_module is not None:
            dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if fused_dq else None
            _launch_dkdv_ws(ws_module, mod_args, grad_args, q, k, v, grad_out, lse, delta, dk, dv, q_block_args,
                            sparse_block, scale, has_score_mod, has_full, dense, dq_acc=dq_acc,
                            persistent=ws_persistent)
            if fused_dq:
                dq = dq_acc.to(q.dtype)
        else:
            run_with_fallback(module.flex_bwd_dkdv_kernel, dkdv_grid, dkdv_args, dkdv_constexprs, dkdv_tiles, pinned)
        if triton_dq:
            run_with_fallback(module.flex_bwd_dq_kernel, dq_grid, dq_args, dq_constexprs, dq_tiles, pinned)
    return dq, dk, dv


class _Settings(types.ModuleType):
    """This module's type: assigning one of its upper-case names (a setting, as probes and tests do, monkeypatch's
    undo included) counts in :data:`GENERATION`, which keys what callers keep of decisions made under the settings
    (flexlite.api's forward plans). A setting changed in place (a dict's item) is not seen: assign a new value."""

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name[:1].isupper() and name != "GENERATION":
            super().__setattr__("GENERATION", self.GENERATION + 1)


GENERATION = 0  # (see _Settings)
sys.modules[__name__].__class__ = _Settings
