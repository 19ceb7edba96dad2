"""Timing and comparison tables for the DIY API, on flexlite's harness (:func:`flexlite.bench.time_ms`):
``triton.testing.do_bench`` on CUDA, a ``time.perf_counter`` loop (wall time) on CPU."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch


@dataclasses.dataclass
class BenchmarkResult:
    """One timing.

    ``size``: (M, N, K) for matmul, (batch, heads, seq_len, head_dim) for attention. ``time_ms``: the
    median. ``tflops``: useful FLOPs / time (matmul 2·M·N·K; attention 4·B·H·S²·D, half of it when
    causal). ``memory_mb``: peak CUDA memory allocated during one call beyond what was allocated before
    (0.0 on CPU). ``block_config``: the block sizes passed to the kernel, if any.
    """

    name: str
    size: tuple
    time_ms: float
    tflops: float
    memory_mb: float = 0.0
    block_config: Optional[dict] = None


def benchmark_fn(fn: Callable, *args, warmup: float = 25, rep: float = 100, quantiles: Optional[tuple] = None,
                 **kwargs) -> tuple:
    """Time ``fn(*args, **kwargs)``; returns ``(median_ms, p20_ms, p80_ms)``, or one value per entry of
    ``quantiles`` if given.

    ``warmup`` and ``rep`` are time budgets in ms (``triton.testing.do_bench``'s meaning). With CUDA
    available the timing is ``do_bench`` (CUDA events, L2 flushed between calls); without CUDA it is
    wall time from ``time.perf_counter`` around each call (at least one warm-up and one timed call).
    """
    from ..bench import time_ms

    qs = (0.5, 0.2, 0.8) if quantiles is None else tuple(quantiles)
    return tuple(time_ms(lambda: fn(*args, **kwargs), warmup=warmup, rep=rep, quantiles=qs))


def _block_kwargs(config: dict) -> dict:
    """``{"BLOCK_M": 64, ...}`` or ``{"block_m": 64, ...}`` -> triton_matmul's keyword arguments."""
    return {k.lower(): v for k, v in config.items() if k.lower() in ("block_m", "block_n", "block_k")}


class BenchmarkRunner:
    """Times implementations against torch and collects :class:`BenchmarkResult` rows in ``results``.

    ``device``: ``"cuda"`` (the default; RuntimeError if CUDA is not available) or ``"cpu"`` (wall time
    of Triton's interpreter: for trying the API, not for performance claims). ``warmup`` / ``rep``:
    time budgets in ms per timing.
    """

    def __init__(self, device="cuda", warmup: float = 25, rep: float = 100):
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("BenchmarkRunner: CUDA is not available; use BenchmarkRunner(device='cpu') to time "
                               "on CPU (wall time of Triton's interpreter)")
        self.warmup, self.rep = warmup, rep
        self.results: list[BenchmarkResult] = []

    def _measure(self, fn: Callable) -> tuple[float, float]:
        """(median ms, peak extra memory MB) of ``fn()``."""
        from ..bench import time_ms

        cuda = self.device.type == "cuda"
        memory_mb = 0.0
        if cuda:
            fn()  # compiles and autotunes first: their buffers are not the call's memory
            torch.cuda.synchronize(self.device)
            before = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            fn()
            torch.cuda.synchronize(self.device)
            memory_mb = (torch.cuda.max_memory_allocated(self.device) - before) / 2 ** 20
        return time_ms(fn, warmup=self.warmup, rep=self.rep, wall_clock=not cuda), memory_mb

    def _add(self, name, size, fn, flop, block_config=None) -> BenchmarkResult:
        ms, memory_mb = self._measure(fn)
        result = BenchmarkResult(name, tuple(size), ms, flop / ms / 1e9, memory_mb, block_config)
        self.results.append(result)
        return result

    def benchmark_matmul(self, triton_fn: Callable, sizes: list, block_configs: Optional[list] = None,
                         dtype: torch.dtype = torch.float16) -> list:
        """Time ``torch.matmul`` and ``triton_fn(a, b)`` for each (M, N, K) in ``sizes``; with
        ``block_configs`` (dicts with block_m/block_n/block_k or BLOCK_M/BLOCK_N/BLOCK_K), once per config,
        passed as ``triton_fn(a, b, block_m=..., block_n=..., block_k=...)``. Returns this call's results."""
        name = getattr(triton_fn, "__name__", "triton")
        out = []
        g = torch.Generator().manual_seed(0)
        for M, N, K in sizes:
            a = torch.randn(M, K, generator=g).to(self.device, dtype)
            b = torch.randn(K, N, generator=g).to(self.device, dtype)
            flop = 2.0 * M * N * K
            out.append(self._add("torch.matmul", (M, N, K), lambda: torch.matmul(a, b), flop))
            for config in block_configs or [None]:
                kwargs = _block_kwargs(config) if config else {}
                out.append(self._add(name, (M, N, K), lambda: triton_fn(a, b, **kwargs), flop,
                                     dict(config) if config else None))
        return out

    def benchmark_attention(self, flash_fn: Callable, seq_lengths: list, batch_size: int = 4, num_heads: int = 8,
                            head_dim: int = 64, causal: bool = False, dtype: torch.dtype = torch.float16) -> list:
        """Time torch's ``scaled_dot_product_attention`` and ``flash_fn(q, k, v, causal=causal)`` for each
        sequence length (inputs (batch_size, num_heads, seq_len, head_dim)). Returns this call's results."""
        from ..bench import flops

        name = getattr(flash_fn, "__name__", "flash_attention")
        sdpa = torch.nn.functional.scaled_dot_product_attention
        out = []
        g = torch.Generator().manual_seed(0)
        for S in seq_lengths:
            shape = (batch_size, num_heads, S, head_dim)
            q, k, v = (torch.randn(*shape, generator=g).to(self.device, dtype) for _ in range(3))
            flop = flops(batch_size, num_heads, S, head_dim, 0.5 if causal else 1.0, "fwd")
            out.append(self._add("torch SDPA", shape, lambda: sdpa(q, k, v, is_causal=causal), flop))
            out.append(self._add(name, shape, lambda: flash_fn(q, k, v, causal=causal), flop))
        return out

    def print_comparison_table(self, results: Optional[list] = None, title: str = "Benchmark Results") -> str:
        """Print ``results`` (default: all collected) as a table with each row's speedup over the torch
        row of the same size (torch.matmul / torch SDPA; >1 means faster than torch). Returns the text."""
        from tabulate import tabulate

        results = self.results if results is None else results
        baseline = {}
        for r in results:
            if r.name.startswith("torch"):
                baseline.setdefault(r.size, r.time_ms)
        rows = []
        for r in results:
            base = baseline.get(r.size)
            rows.append([r.name, "x".join(map(str, r.size)), r.time_ms, r.tflops, r.memory_mb,
                         _format_config(r.block_config), base / r.time_ms if base else ""])
        headers = ["name", "size", "time (ms)", "TFLOP/s", "memory (MB)", "blocks", "speedup vs torch"]
        clock = "do_bench, CUDA" if self.device.type == "cuda" else "wall clock, CPU (Triton interpreter)"
        text = f"{title} [{clock}]\n" + tabulate(rows, headers=headers, tablefmt="github", floatfmt=".4g")
        print(text)
        return text

    def clear_results(self) -> None:
        """Forget the collected results."""
        self.results.clear()


def _format_config(config: Optional[dict]) -> str:
    if not config:
        return ""
    kwargs = _block_kwargs(config)
    return "x".join(str(kwargs[k]) for k in ("block_m", "block_n", "block_k") if k in kwargs)
