"""Benchmark harness: flexlite vs torch's FlexAttention (torch.compile) vs SDPA, in one process.

For each mask and shape: check flexlite against the fp64 reference on a reduced shape and against
torch's flex at the full shape, then time with ``triton.testing.do_bench`` medians. Writes
``benchmarks/results/<gpu>-<date>.json`` and a markdown table. By default every mask, the forward and the backward,
at B4 H16 S8192 D128 and B16 H16 S8192 D64 (``--masks``, ``--passes``, ``--shapes`` pick fewer);
``python -m flexlite bench --help``.

FLOPs are density-aware: 4·B·H·S²·D·density for the forward (two matmuls of 2·S²·D each), 2.5× that
for the backward (five matmuls, the dS·K / dSᵀ·Q pair counted with the recompute); density is the
fraction of non-empty blocks of the 128×128 block mask.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from . import first_calls
from .api import flex_attention
from .block_mask import create_block_mask
from .masks import causal_mask, generate_causal_document_mask, generate_prefix_lm_mask, generate_sliding_window
from .mods import generate_alibi_bias, generate_tanh_softcap
from .reference import attention_reference

RESULTS_DIR = Path("benchmarks/results")


@dataclasses.dataclass
class MaskCase:
    name: str
    mask_mod: Optional[Callable] = None
    score_mod: Optional[Callable] = None
    sdpa_causal: Optional[bool] = None  # SDPA runs only where it computes the same thing
    torch_score_mod: Optional[Callable] = None  # for torch's flex where ours uses a flexlite-only op

    def __post_init__(self):
        if self.torch_score_mod is None:
            self.torch_score_mod = self.score_mod


def mask_cases(S: int, H: int, device) -> dict:
    cases = [
        MaskCase("full", sdpa_causal=False),
        MaskCase("causal", causal_mask, sdpa_causal=True),
        MaskCase("sliding_window_1024", generate_sliding_window(1024)),
        MaskCase("prefix_lm_2048", generate_prefix_lm_mask(2048)),
        MaskCase("document_8_causal", generate_causal_document_mask([S // 8] * 8, device=device)),
        MaskCase("alibi_causal", causal_mask, generate_alibi_bias(H, device=device)),
        # flexlite's tanh.approx (FlashAttention's choice) vs torch's exact tanh: torch cannot compile our op
        MaskCase("softcap30_causal", causal_mask, generate_tanh_softcap(30.0),
                 torch_score_mod=generate_tanh_softcap(30.0, approx=False)),
    ]
    return {c.name: c for c in cases}


# the harness's two shapes (B, H, S, D), as the probes in benchmarks/ walk them
PROBE_SHAPES = ((4, 16, 8192, 128), (16, 16, 8192, 64))


def probe_args(argv: list) -> tuple:
    """A GPU probe's positional arguments ``[mask,mask,...] [D,D,...]``: (mask names, head dims); by default every
    harness mask and both harness head dims."""
    args = [a for a in argv[1:] if not a.startswith("--")]
    masks = args[0].split(",") if args else list(mask_cases(1024, 1, "cpu"))
    return masks, [int(d) for d in args[1].split(",")] if len(args) > 1 else [128, 64]


def parse_shapes(text: str) -> list:
    """``BxHxSxD`` or ``BxHxSxDxHKV`` shapes, comma-separated, as tuples of ints (a ValueError naming a bad one)."""
    shapes = []
    for item in text.split(","):
        parts = item.split("x")
        if len(parts) not in (4, 5) or not all(x.isdigit() and int(x) > 0 for x in parts):
            raise ValueError(f"--shapes takes comma-separated BxHxSxD or BxHxSxDxHKV of positive integers (e.g. "
                             f"4x16x8192x128, 2x32x4096x128x8); got {item!r}")
        if len(parts) == 5 and int(parts[1]) % int(parts[4]):
            raise ValueError(f"--shapes: H must be a multiple of HKV (each KV head shared by H / HKV query heads); "
                             f"got {item!r}")
        shapes.append(tuple(int(x) for x in parts))
    return shapes


def probe_shapes(argv: list) -> list:
    """A GPU probe's ``--shapes=BxHxSxD,...`` (no key / value heads of their own here), by default the harness's."""
    for a in argv:
        if a == "--shapes":  # (its value would be read as a positional argument: the masks)
            raise ValueError("a probe takes --shapes=BxHxSxD,... with '=' (e.g. --shapes=8x16x2048x64)")
        if a.startswith("--shapes="):
            shapes = parse_shapes(a.split("=", 1)[1])
            if any(len(s) != 4 for s in shapes):
                raise ValueError(f"a probe's --shapes takes BxHxSxD only; got {a!r}")
            return shapes
    return list(PROBE_SHAPES)


def probe_cases(masks: list, dims: list, requires_grad: bool = True, shapes=PROBE_SHAPES):
    """For the GPU probes in benchmarks/: per shape (the harness's by default) whose head dim is in ``dims`` (random
    bf16 q, k, v on CUDA) and per mask name in ``masks``, yield ``(D, q, k, v, case, block_mask)``."""
    for (B, H, S, D) in shapes:
        if D not in dims:
            continue
        q, k, v = [torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=requires_grad)
                   for _ in range(3)]
        cases = mask_cases(S, H, "cuda")
        for name in masks:
            case = cases[name]
            bm = create_block_mask(case.mask_mod, None, None, S, S, device="cuda") if case.mask_mod else None
            yield D, q, k, v, case, bm


def flops(B: int, H: int, S: int, D: int, density: float, pass_: str) -> float:
    f = 4.0 * B * H * S * S * D * density
    return f * 2.5 if pass_ == "bwd" else f


def time_ms(fn: Callable, warmup: float = 25, rep: float = 100, quantiles: Optional[tuple] = None,
            grad_to_none=None, wall_clock: Optional[bool] = None):
    """Time ``fn()`` in ms: the median, or a list with one value per ``quantiles`` entry (in [0, 1]).

    ``warmup`` and ``rep`` are time budgets in ms and ``grad_to_none`` tensors get ``.grad = None``
    before each call, as in ``triton.testing.do_bench``, which does the timing (CUDA events, L2 flushed
    between calls). ``wall_clock=True`` (the default when CUDA is not available) times each call with
    ``time.perf_counter`` instead: wall time including Python overhead, at least one warm-up and one
    timed call (on CPU that is Triton's interpreter: for comparing, not for performance claims).
    """
    qs = [0.5] if quantiles is None else list(quantiles)
    if wall_clock is None:
        wall_clock = not torch.cuda.is_available()
    if not wall_clock:
        import triton.testing
        ms = triton.testing.do_bench(fn, warmup=warmup, rep=rep, quantiles=qs, grad_to_none=grad_to_none)
        ms = [float(m) for m in (ms if isinstance(ms, (list, tuple)) else [ms])]
        return ms[0] if quantiles is None else ms

    def call() -> float:
        for t in grad_to_none or ():
            t.grad = None
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    estimate = max(1e-6, call())
    for _ in range(int(warmup / estimate) - 1):
        call()
    samples = torch.tensor([call() for _ in range(max(1, int(rep / estimate)))], dtype=torch.float64)
    ms = torch.quantile(samples, torch.tensor(qs, dtype=torch.float64)).tolist()
    return ms[0] if quantiles is None else ms


def _median_ms(fn: Callable, grad_to_none=None) -> float:
    return time_ms(fn, warmup=25, rep=100, grad_to_none=grad_to_none)


def _first_line(error: BaseException) -> str:
    """What a row records of an implementation that raised: the first line of its message."""
    return str(error).splitlines()[0][:120] if str(error) else type(error).__name__


# ms each implementation of a row runs, untimed, before its rounds (time_rounds, heat): a GPU that sat idle (through
# compiles and reference checks) may run its first timed calls at a higher clock than it keeps under load (the H200
# at its power cap: in the D64 harness runs at 0446c2a and a50cb74 causal's flexlite rounds, first in round one and
# last in round two, 4.70 / 5.30 and 4.78 / 5.57 ms, NOTES 89), which the best round credits to whichever
# implementation runs first
HEAT_MS = 500.0


def heat(fn: Callable, ms: float = HEAT_MS, grad_to_none=None) -> None:
    """``fn`` called for about ``ms`` ms, untimed (do_bench's warm-up; on CPU at least once), so that the GPU is at
    the clock it keeps under load before a timing."""
    time_ms(fn, warmup=ms, rep=1, grad_to_none=grad_to_none)


def time_rounds(fns: dict, rounds: int = 1, grad_to_none=None, heat_ms: float = HEAT_MS) -> tuple:
    """Each of ``fns`` (name -> callable) timed ``rounds`` times (:func:`_median_ms`), in order first to last, then
    last to first, and so on: a transient slowdown of the GPU or the host then falls on one round of one
    implementation, not on a whole comparison (a speed that a process keeps throughout, NOTES 61, it cannot
    remove: the forward rows' CUDA-graph times show it). Before the first round each runs ``heat_ms`` ms untimed
    (:func:`heat`; 0: not). Returns (name -> list of ms, one per round; name -> first line of the RuntimeError that a
    callable raised, after which it is not timed again: e.g. an SDPA backend not available for the shape)."""
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
        raise ValueError(f"rounds must be a positive int; got {rounds!r}")
    times = {name: [] for name in fns}
    errors = {}
    names = list(fns)

    def attempt(name, run):
        if name not in errors:
            try:
                run()
            except RuntimeError as e:
                errors[name] = _first_line(e)
    for name in names if heat_ms else ():
        attempt(name, lambda: heat(fns[name], heat_ms, grad_to_none=grad_to_none))
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            attempt(name, lambda: times[name].append(_median_ms(fns[name], grad_to_none=grad_to_none)))
    return times, errors


def host_us(fn: Callable, calls: int = 100, sync: Optional[Callable] = None) -> float:
    """The host's time per call of ``fn`` in us: ``calls`` calls back to back, timed on the host without waiting for
    the GPU (``sync``, default torch.cuda.synchronize, only before and after), so it is the call's Python and launch
    work alone where the GPU's queue does not fill up in ``calls`` calls; an eager time close to it is host-bound
    (NOTES 65, 66)."""
    sync = torch.cuda.synchronize if sync is None else sync
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e6
    sync()
    return round(host, 1)


def graph_ms(fn: Callable) -> float:
    """``fn``'s time replayed from a CUDA graph (triton.testing.do_bench_cudagraph): the GPU's own time, with no
    Python and no launch gaps in it, beside an eager time that a slow or busy host can lengthen."""
    import triton.testing
    return round(float(triton.testing.do_bench_cudagraph(fn)), 4)


def _timed(forward: Callable, pass_: str) -> Callable:
    """What to time for a pass: the forward call, or the backward of one forward's output (graph kept)."""
    if pass_ == "fwd":
        return forward
    out = forward()
    grad = torch.randn_like(out)
    return lambda: out.backward(grad, retain_graph=True)


def _git_commit() -> str:
    """The commit the results are of: ``FLEXLITE_COMMIT`` where set, else the checkout's HEAD, with ``+dirty`` where
    tracked files differ from it (a tree copied over a stale .git, as on the device machine, is labelled so rather
    than as HEAD: NOTES 68)."""
    if os.environ.get("FLEXLITE_COMMIT"):  # set where the checkout has no (or a stale) .git, as on the device
        return os.environ["FLEXLITE_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                 text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head}+dirty" if changed else head


def check_against_reference(case: MaskCase, D: int, device, dtype=torch.bfloat16, backward: bool = False,
                            kernel_options: Optional[dict] = None, S: int = 1024, gqa_group: int = 1) -> dict:
    """Max abs errors of flexlite's kernels (called with ``kernel_options``) vs the fp64 reference at B1 H2 ``S``
    (random inputs; ``gqa_group`` > 1: 2 KV heads, each shared by that many query heads, enable_gqa): out, and with
    ``backward`` also dq / dk / dv. The kernels', also where they are not compiled yet: not a first call's torch ops
    (first_calls.EAGER)."""
    B, Hkv = 1, 2
    H = Hkv * gqa_group
    g = torch.Generator().manual_seed(0)
    q, k, v = [torch.randn(B, h, S, D, generator=g).to(device, dtype).requires_grad_(backward)
               for h in (H, Hkv, Hkv)]
    small = mask_cases(S, H, device)[case.name]
    bm = create_block_mask(small.mask_mod, None, None, S, S, device=device) if small.mask_mod else None
    gqa = gqa_group > 1
    eager, first_calls.EAGER = first_calls.EAGER, False
    try:
        out = flex_attention(q, k, v, score_mod=small.score_mod, block_mask=bm, kernel_options=kernel_options,
                             enable_gqa=gqa)
        ref, _ = attention_reference(q, k, v, score_mod=small.score_mod, block_mask=bm, enable_gqa=gqa)
        errors = {"max_err_vs_fp64": float((out.double() - ref).detach().abs().max())}
        if backward:
            dout = torch.randn_like(out)
            got = torch.autograd.grad(out, (q, k, v), dout)
            want = torch.autograd.grad(ref, (q, k, v), dout.double())
            for name, a, b in zip(("dq", "dk", "dv"), got, want):
                errors[f"max_{name}_err_vs_fp64"] = float((a.double() - b.double()).abs().max())
    finally:
        first_calls.EAGER = eager
    return errors


def run(masks: list, shapes: list, passes: tuple = ("fwd",), dtype=torch.bfloat16,
        out_dir: Optional[Path] = RESULTS_DIR, torch_flex: bool = True, autotune: bool = False,
        rounds: int = 2) -> dict:
    """Check and time every (mask, shape, pass); write JSON + markdown under ``out_dir`` (None: print only).
    ``autotune`` adds a ``flexlite_tuned`` column (kernel_options AUTOTUNE). Each implementation's time is the
    best of ``rounds`` do_bench medians taken in alternating order (:func:`time_rounds`); each row keeps them all
    (``<impl>_ms_rounds``)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device = torch.device("cuda")
    warm_s = warm_torch(device, dtype)
    rows = []
    if torch_flex:
        from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask
        from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention
        compiled_flex = torch.compile(torch_flex_attention, dynamic=False)
        # each mask (a new score_mod / mask_mod) and shape is a recompile of the one compiled function: past
        # dynamo's default limit of 8 torch would silently run its unfused eager path (and run out of memory)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
    backward = "bwd" in passes
    for shape in shapes:
        B, H, S, D = shape[:4]
        Hkv = shape[4] if len(shape) > 4 else H  # fewer KV heads: grouped-query attention (enable_gqa)
        gqa = Hkv != H
        cases = mask_cases(S, H, device)
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v = [torch.randn(B, h, S, D, generator=g, device=device, dtype=dtype).requires_grad_(backward)
                   for h in (H, Hkv, Hkv)]
        for name in masks:
            case = cases[name]
            bm = create_block_mask(case.mask_mod, None, None, S, S, device=device) if case.mask_mod else None
            density = 1.0 - (bm.sparsity() / 100.0 if bm is not None else 0.0)
            bits_calls, eager_calls = first_calls.ran_bits(), first_calls.ran_eager()
            t0 = time.perf_counter()  # a new mod's first call: its forward compiled (before the check runs it), or
            flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm, enable_gqa=gqa)  # the bits', or torch
            torch.cuda.synchronize()
            first_call_s = time.perf_counter() - t0
            first_call_bits = first_calls.ran_bits() > bits_calls
            first_call_eager = first_calls.ran_eager() > eager_calls
            first_calls.wait()
            out = flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm,  # (its kernels, compiled now)
                                 enable_gqa=gqa)
            errors = check_against_reference(case, D, device, dtype, backward=backward, gqa_group=H // Hkv)
            impls = {"flexlite": lambda: flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm,
                                                        enable_gqa=gqa)}
            if autotune:
                impls["flexlite_tuned"] = lambda: flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm,
                                                                 enable_gqa=gqa, kernel_options={"AUTOTUNE": True})
            row_base = dict(mask=name, shape=f"B{B} H{H} S{S} D{D}" + (f" Hkv{Hkv}" if gqa else ""),
                            dtype=str(dtype).replace("torch.", ""),
                            density=round(density, 4), flexlite_first_call_s=round(first_call_s, 3),
                            flexlite_first_call_bits=first_call_bits, flexlite_first_call_eager=first_call_eager,
                            **errors)
            if torch_flex:
                tbm = torch_create_block_mask(case.mask_mod, None, None, S, S, device=device) if case.mask_mod else None
                impls["torch_flex"] = lambda: compiled_flex(q, k, v, score_mod=case.torch_score_mod, block_mask=tbm,
                                                            enable_gqa=gqa)
                row_base["max_diff_vs_torch_flex"] = float((impls["torch_flex"]().float() - out.float()).abs().max())
            if case.sdpa_causal is not None:
                for backend, label in ((SDPBackend.CUDNN_ATTENTION, "sdpa_cudnn"), (SDPBackend.FLASH_ATTENTION,
                                                                                    "sdpa_flash")):
                    def sdpa(backend=backend):
                        with sdpa_kernel(backend):
                            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=case.sdpa_causal,
                                                                                    enable_gqa=gqa)
                    impls[label] = sdpa
            if backward:  # this shape's first backward (which may run the bits' kernels while its own compile)
                flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm, enable_gqa=gqa).sum().backward()
                q.grad = k.grad = v.grad = None
            first_calls.wait()  # (and what the checks' calls compile beside them): nothing compiles while timing
            for pass_ in passes:
                row = dict(row_base, **{"pass": pass_})
                f = flops(B, H, S, D, density, pass_)
                fns = {}
                for impl, forward in impls.items():
                    try:
                        fns[impl] = _timed(forward, pass_)
                    except RuntimeError as e:  # e.g. an SDPA backend not available for this shape
                        row[f"{impl}_error"] = _first_line(e)
                times, errors = time_rounds(fns, rounds, grad_to_none=[q, k, v] if backward else None)
                row.update({f"{impl}_error": error for impl, error in errors.items()})
                for impl, ms_rounds in times.items():
                    if impl in errors:
                        continue
                    ms = min(ms_rounds)  # the best round's median
                    row[f"{impl}_ms"] = round(ms, 4)
                    row[f"{impl}_tflops"] = round(f / ms / 1e9, 1)
                    row[f"{impl}_ms_rounds"] = [round(t, 4) for t in ms_rounds]
                if pass_ == "fwd":  # the GPU's own time too (NOTES 61: eager rows that the host may have slowed),
                    for impl in ("flexlite", "torch_flex"):  # and the host's per call (NOTES 66)
                        if f"{impl}_ms" in row:
                            try:
                                row[f"{impl}_graph_ms"] = graph_ms(impls[impl])
                            except RuntimeError as e:  # a capture that fails: recorded, not fatal
                                row[f"{impl}_graph_error"] = _first_line(e)
                            try:
                                row[f"{impl}_host_us"] = host_us(impls[impl], calls=20)
                            except RuntimeError as e:  # recorded, not fatal, as above
                                row[f"{impl}_host_error"] = _first_line(e)
                if "torch_flex_ms" in row:
                    row["speedup_vs_torch_flex"] = round(row["torch_flex_ms"] / row["flexlite_ms"], 3)
                    if "flexlite_tuned_ms" in row:
                        row["tuned_speedup_vs_torch_flex"] = round(row["torch_flex_ms"] / row["flexlite_tuned_ms"], 3)
                rows.append(row)
                print(json.dumps(row), flush=True)
    return _write_results(rows, out_dir, "", ATTENTION_COLUMNS, torch_warm_s=round(warm_s, 3))


def warm_torch(device: torch.device, dtype: torch.dtype) -> float:
    """Bring the process's torch up on ``device`` before any first call is timed: CUDA's context, a matmul (cuBLAS)
    and a softmax, what a model's layers before its first attention call have done (a first call times a new mod,
    not the process: NOTES 105). Returns the seconds it took (the JSON's ``torch_warm_s``)."""
    t0 = time.perf_counter()
    x = torch.randn(256, 256, device=device, dtype=dtype)
    torch.softmax((x @ x).float(), dim=-1).sum().item()  # (the host waits for the device)
    return time.perf_counter() - t0


def _write_results(rows: list, out_dir: Optional[Path], suffix: str, columns: list, **facts) -> dict:
    """``{gpu, torch, triton, commit, date, heat_ms, **facts, rows}`` to ``<out_dir>/<gpu>-<date><suffix>.json``
    plus a markdown table beside it (``out_dir`` None: print only); ``heat_ms``: what each implementation ran
    untimed before its rounds (:data:`HEAT_MS`; runs before NOTES 89 have none)."""
    result = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": __import__("triton").__version__, "commit": _git_commit(),
        "date": datetime.date.today().isoformat(), "heat_ms": HEAT_MS, **facts, "rows": rows,
    }
    table = markdown_table(result, columns)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        stem = f"{result['gpu'].replace(' ', '_')}-{result['date']}{suffix}"
        (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1))
        (out_dir / f"{stem}.md").write_text(table)
    print(table)
    return result


def copy_bandwidth_gbps(nbytes: int = 2**30) -> float:
    """Device copy bandwidth (read + write bytes per second of a large clone), the decode ceiling."""
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    return 2 * nbytes / _median_ms(lambda: x.clone()) / 1e6


def run_decode(shapes: list = ((8, 32, 8, 32768, 128), (1, 32, 8, 131072, 128)), dtype=torch.bfloat16,
               out_dir: Optional[Path] = RESULTS_DIR, rounds: int = 2) -> dict:
    """One-token decoding (Lq = 1, no mask) over a long KV: flexlite's split-KV kernel vs SDPA and torch's
    flex; GB/s counts q, K, V and out once, against the measured copy bandwidth. Eager times: the best of
    ``rounds`` medians in alternating order (:func:`time_rounds`)."""
    from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention
    compiled_flex = torch.compile(torch_flex_attention, dynamic=False)
    copy_bw = copy_bandwidth_gbps()
    rows = []
    for (B, Hq, Hkv, Lkv, D) in shapes:
        q = torch.randn(B, Hq, 1, D, device="cuda", dtype=dtype)
        k, v = [torch.randn(B, Hkv, Lkv, D, device="cuda", dtype=dtype) for _ in range(2)]
        out = flex_attention(q, k, v, enable_gqa=True)
        ref, _ = attention_reference(q, k, v, enable_gqa=True)
        nbytes = (q.numel() * 2 + k.numel() + v.numel()) * q.element_size()
        row = dict(mask="decode (Lq=1)", shape=f"B{B} Hq{Hq} Hkv{Hkv} Lkv{Lkv} D{D}", **{"pass": "fwd"},
                   max_err_vs_fp64=float((out.double() - ref).abs().max()), copy_gbps=round(copy_bw, 1))
        impls = {
            "flexlite": lambda: flex_attention(q, k, v, enable_gqa=True),
            "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True),
            "torch_flex": lambda: compiled_flex(q, k, v, enable_gqa=True),
        }
        times, errors = time_rounds(impls, rounds)
        if errors:
            raise RuntimeError(f"decode benchmark: {errors}")
        for impl, ms_rounds in times.items():
            ms = min(ms_rounds)
            row[f"{impl}_ms"] = round(ms, 4)
            row[f"{impl}_gbps"] = round(nbytes / ms / 1e6, 1)
            row[f"{impl}_ms_rounds"] = [round(t, 4) for t in ms_rounds]
        row["flexlite_pct_of_copy_bw"] = round(100 * row["flexlite_gbps"] / copy_bw, 1)
        row["speedup_vs_sdpa"] = round(row["sdpa_ms"] / row["flexlite_ms"], 3)
        # at ~0.1 ms per call the host can be the limit of eager timings: the GPU's own time, replayed from a
        # CUDA graph (no Python, no launch gaps), for flexlite and SDPA alike
        for impl in ("flexlite", "sdpa"):
            row[f"{impl}_graph_ms"] = graph_ms(impls[impl])
        row["graph_speedup_vs_sdpa"] = round(row["sdpa_graph_ms"] / row["flexlite_graph_ms"], 3)
        row["flexlite_graph_pct_of_copy_bw"] = round(100 * nbytes / row["flexlite_graph_ms"] / 1e6 / copy_bw, 1)
        row["speedup_vs_torch_flex"] = round(row["torch_flex_ms"] / row["flexlite_ms"], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return _write_results(rows, out_dir, "-decode", DECODE_COLUMNS)


def run_block_mask(lengths: tuple = (32768, 131072), out_dir: Optional[Path] = RESULTS_DIR) -> dict:
    """create_block_mask time and extra peak memory, flexlite vs torch, for causal / sliding window /
    document masks at long lengths (torch's may run out of memory: recorded as such)."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask
    rows = []
    for S in lengths:
        for name, case in mask_cases(S, 1, "cuda").items():
            if case.mask_mod is None or case.score_mod is not None or name == "prefix_lm_2048":
                continue
            row = dict(mask=name, shape=f"S{S}")
            for impl, build in (("flexlite", create_block_mask), ("torch", torch_create_block_mask)):
                fn = lambda: build(case.mask_mod, None, None, S, S, device="cuda")  # noqa: E731
                try:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    fn()
                    torch.cuda.synchronize()
                    row[f"{impl}_peak_extra_mb"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
                    row[f"{impl}_ms"] = round(_median_ms(fn), 3)
                except torch.OutOfMemoryError:
                    row[f"{impl}_ms"] = "OOM"
                    torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps(row), flush=True)
    return _write_results(rows, out_dir, "-block_mask", BLOCK_MASK_COLUMNS)


ATTENTION_COLUMNS = ["mask", "shape", "pass", "flexlite_ms", "flexlite_graph_ms", "flexlite_host_us",
                     "torch_flex_ms", "torch_flex_graph_ms", "torch_flex_host_us", "speedup_vs_torch_flex",
                     "tuned_speedup_vs_torch_flex", "flexlite_tflops", "torch_flex_tflops", "sdpa_cudnn_tflops",
                     "sdpa_flash_tflops", "max_err_vs_fp64"]
DECODE_COLUMNS = ["mask", "shape", "flexlite_ms", "sdpa_ms", "torch_flex_ms", "speedup_vs_sdpa",
                  "speedup_vs_torch_flex", "flexlite_graph_ms", "sdpa_graph_ms", "graph_speedup_vs_sdpa",
                  "flexlite_pct_of_copy_bw", "flexlite_graph_pct_of_copy_bw", "max_err_vs_fp64"]
BLOCK_MASK_COLUMNS = ["mask", "shape", "flexlite_ms", "flexlite_peak_extra_mb", "torch_ms", "torch_peak_extra_mb"]


def markdown_table(result: dict, columns: list = ATTENTION_COLUMNS) -> str:
    """The rows of a results dict as a markdown table under a GPU / versions / commit line; a column that no
    row has (the tuned speedup of a run without autotuning, SDPA on masks it cannot run) is left out."""
    from tabulate import tabulate
    columns = [c for c in columns if any(c in r for r in result["rows"])]
    body = [[r.get(c, "") for c in columns] for r in result["rows"]]
    head = (f"GPU: {result['gpu']}, torch {result['torch']}, triton {result['triton']}, commit {result['commit']}, "
            f"{result['date']}\n\n")
    return head + tabulate(body, headers=columns, tablefmt="github", floatfmt=".3g") + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m flexlite bench", description=__doc__.splitlines()[0])
    names = list(mask_cases(8192, 16, "cpu"))
    p.add_argument("--masks", default="all", help="comma-separated names or 'all': " + ", ".join(names))
    p.add_argument("--shapes", default="4x16x8192x128,16x16x8192x64", help="comma-separated BxHxSxD (the attention "
                   "suite's shapes; default the issue's two), or BxHxSxDxHKV for HKV key / value heads (grouped-query "
                   "attention, enable_gqa; H a multiple of HKV)")
    p.add_argument("--passes", default="fwd,bwd", help="comma-separated: fwd, bwd (default both)")
    p.add_argument("--out", default=str(RESULTS_DIR))
    p.add_argument("--no-torch-flex", action="store_true")
    p.add_argument("--autotune", action="store_true", help="also time flexlite with kernel_options AUTOTUNE")
    p.add_argument("--suites", default="attention", help="comma-separated: attention, decode, block_mask")
    p.add_argument("--rounds", type=int, default=2, help="timing rounds per implementation, in alternating order; "
                   "the best round's median is kept (default 2)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1; got {args.rounds}")
    masks = names if args.masks == "all" else args.masks.split(",")
    if set(masks) - set(names):
        p.error(f"unknown --masks {sorted(set(masks) - set(names))}; choose from {', '.join(names)} or 'all'")
    passes = tuple(args.passes.split(","))
    if not passes or set(passes) - {"fwd", "bwd"}:
        p.error(f"--passes takes fwd, bwd or fwd,bwd; got {args.passes!r}")
    try:
        shapes = parse_shapes(args.shapes)
    except ValueError as e:
        p.error(str(e))
    suites = args.suites.split(",")
    unknown = set(suites) - {"attention", "decode", "block_mask"}
    if unknown:
        p.error(f"unknown --suites {sorted(unknown)}; choose from attention, decode, block_mask")
    if not torch.cuda.is_available():
        raise SystemExit("python -m flexlite bench needs a CUDA GPU (timings on the interpreter mean nothing)")
    if "attention" in suites:
        run(masks, shapes, passes, out_dir=Path(args.out), torch_flex=not args.no_torch_flex,
            autotune=args.autotune, rounds=args.rounds)
    if "decode" in suites:
        run_decode(out_dir=Path(args.out), rounds=args.rounds)
    if "block_mask" in suites:
        run_block_mask(out_dir=Path(args.out))


if __name__ == "__main__":
    main()
