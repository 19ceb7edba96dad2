"""``triton_matmul``: C = A @ B with the Triton GEMM of ``matmul_kernel.py``; config table and heuristics.

The tile configs live in one table, :data:`MATMUL_CONFIGS`. ``use_autotune=True`` on a GPU times the
table's entries that fit the problem and the device (once per device, dtype and shape);
``use_autotune=False`` takes :func:`matmul_config`'s pick, the first entry whose pipeline fits the
GPU's shared memory. CPU tensors run the same kernel through Triton's interpreter with one fixed
config (:data:`INTERPRETER_MATMUL_CONFIG`), never timed.
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path
from typing import Optional

import torch

from ..block_mask import check_bool
from ..runtime.compile import import_kernel_file, interpreter_scope
from ..runtime.guards import on_device
from ..runtime.launch import cdiv
from ..utils.gpu import GPUCapabilities, detect_gpu

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# the autotune space, largest tiles first; matmul_config takes the first that fits shared memory
MATMUL_CONFIGS = (
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=4),
)
# the interpreter's cost is per tile operation, not per element: few, large tiles
INTERPRETER_MATMUL_CONFIG = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=1)
_SMEM_RESERVE = 1024  # bytes the compiler keeps for itself per block, roughly

_KERNEL_FILE = Path(__file__).with_name("matmul_kernel.py")
_LOCK = threading.Lock()
_KERNELS: dict = {}
_TUNED: dict = {}  # (device, dtype, M, N, K) -> config chosen by timing


def padded_dim(n: int) -> int:
    """``n`` rounded up to a multiple of 16 (at least 16): the largest block size allowed along it."""
    return max(16, -(-n // 16) * 16)


def _clip_block(block: int, n: int) -> int:
    """Largest power of two <= ``block`` and <= :func:`padded_dim` (n), at least 16."""
    limit = min(block, padded_dim(n))
    return max(16, 1 << (limit.bit_length() - 1))


def clip_config(config: dict, M: int, N: int, K: int) -> dict:
    """``config`` with each block size shrunk to fit the problem (see :func:`_clip_block`)."""
    return dict(config, BLOCK_M=_clip_block(config["BLOCK_M"], M), BLOCK_N=_clip_block(config["BLOCK_N"], N),
                BLOCK_K=_clip_block(config["BLOCK_K"], K))


def smem_bytes(config: dict, element_size: int = 2) -> int:
    """Shared memory of a config's software pipeline: num_stages A and B tiles."""
    tile = config["BLOCK_M"] * config["BLOCK_K"] + config["BLOCK_K"] * config["BLOCK_N"]
    return config["num_stages"] * tile * element_size


def _fits(config: dict, caps: GPUCapabilities) -> bool:
    return smem_bytes(config) <= caps.sram_per_sm - _SMEM_RESERVE


def _caps_of(device: torch.device) -> GPUCapabilities:
    return _detect_gpu_cached(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _detect_gpu_cached(device_id: int) -> GPUCapabilities:
    """detect_gpu, once per device: the heuristic runs on every call."""
    return detect_gpu(device_id)


def matmul_config(M: int, N: int, K: int, device="cuda", caps: Optional[GPUCapabilities] = None) -> dict:
    """The config ``triton_matmul`` runs without autotuning, for an (M, K) @ (K, N) product on ``device``.

    CUDA: the first :data:`MATMUL_CONFIGS` entry whose pipeline fits the GPU's shared memory (``caps``,
    by default :func:`detect_gpu` of the device), block sizes clipped to the problem. CPU: the
    interpreter config, clipped. Keys: BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return clip_config(INTERPRETER_MATMUL_CONFIG, M, N, K)
    caps = caps or _caps_of(device)
    config = next((c for c in MATMUL_CONFIGS if _fits(c, caps)), MATMUL_CONFIGS[-1])
    return clip_config(config, M, N, K)


def autotune_candidates(M: int, N: int, K: int, caps: GPUCapabilities) -> list:
    """The configs ``use_autotune=True`` times on a GPU: the table, clipped, deduplicated, fitting memory."""
    out = []
    for config in MATMUL_CONFIGS:
        config = clip_config(config, M, N, K)
        if config not in out and _fits(config, caps):
            out.append(config)
    return out or [clip_config(MATMUL_CONFIGS[-1], M, N, K)]


def _explicit_config(block_m: int, block_n: int, block_k: int) -> dict:
    warps = 8 if block_m * block_n >= 128 * 256 else 4
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, num_warps=warps, num_stages=3)


def gemm_kernel(interpret: bool):
    """The ``matmul_kernel`` jit function, built for Triton's interpreter or for CUDA (cached)."""
    kernel = _KERNELS.get(interpret)
    if kernel is None:
        with _LOCK:
            kernel = _KERNELS.get(interpret)
            if kernel is None:
                module = import_kernel_file(_KERNEL_FILE, "flexlite.kernels._matmul_kernel", interpret)
                kernel = _KERNELS[interpret] = module.matmul_kernel
    return kernel


def _fail(msg: str, exc=ValueError):
    raise exc(f"triton_matmul: {msg}")


def _validate(a, b, blocks):
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}", TypeError)
        if t.dim() != 2:
            _fail(f"expected 2-D tensors; {name} has shape {tuple(t.shape)} ({t.dim()}-D)")
    if a.shape[1] != b.shape[0]:
        _fail(f"incompatible dimensions: a is {tuple(a.shape)} and b is {tuple(b.shape)}; a.shape[1] must equal "
              f"b.shape[0]")
    for name, t in (("a", a), ("b", b)):
        if t.dtype not in SUPPORTED_DTYPES:
            _fail(f"unsupported dtype {t.dtype} for {name}; use float16, bfloat16 or float32", TypeError)
    if a.dtype != b.dtype:
        _fail(f"dtypes must match: a is {a.dtype}, b is {b.dtype}", TypeError)
    if a.device != b.device:
        _fail(f"a is on {a.device} but b is on {b.device}; move them to one device")
    if a.device.type not in ("cuda", "cpu"):
        _fail(f"the inputs are on {a.device}; triton_matmul runs CUDA tensors (compiled) and CPU tensors (Triton's "
              f"interpreter) only: move them with .to('cuda') or .to('cpu')", NotImplementedError)
    given = [x is not None for x in blocks]
    if any(given) and not all(given):
        _fail("invalid block size: give block_m, block_n and block_k together, or none of them "
              f"(got block_m={blocks[0]}, block_n={blocks[1]}, block_k={blocks[2]})")
    if all(given):
        (M, K), N = a.shape, b.shape[1]
        for name, value, dim, n in (("block_m", blocks[0], "M", M), ("block_n", blocks[1], "N", N),
                                    ("block_k", blocks[2], "K", K)):
            ok = isinstance(value, int) and not isinstance(value, bool)
            if not ok or value < 16 or value & (value - 1) or value > padded_dim(n):
                _fail(f"invalid block size {name}={value!r}: must be a power of two >= 16 and at most "
                      f"{padded_dim(n)} ({dim}={n} rounded up to a multiple of 16)")


def _launch(a, b, c, config: dict, interpret: bool):
    (M, K), N = a.shape, b.shape[1]
    grid = (cdiv(M, config["BLOCK_M"]) * cdiv(N, config["BLOCK_N"]),)
    with interpreter_scope(interpret), on_device(a.device):
        gemm_kernel(interpret)[grid](
            a, b, c, M, N, K, *a.stride(), *b.stride(), *c.stride(),
            BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"],
            GROUP_M=config["GROUP_M"], DOT_IN_FP32=interpret,
            num_warps=config["num_warps"], num_stages=config["num_stages"])


def _launch_fitting(a, b, c, config: dict, pinned: bool) -> dict:
    """Launch on CUDA; if the pipeline does not fit shared memory, with fewer stages. Returns the config run."""
    from triton.runtime.errors import OutOfResources

    for stages in range(config["num_stages"], 0, -1):
        cfg = dict(config, num_stages=stages)
        try:
            _launch(a, b, c, cfg, interpret=False)
            return cfg
        except OutOfResources as e:  # raised while compiling, before anything runs
            error = e
    if pinned:
        _fail(f"invalid block size: block_m={config['BLOCK_M']}, block_n={config['BLOCK_N']}, "
              f"block_k={config['BLOCK_K']} do not fit this GPU even with one pipeline stage ({error}); "
              f"use smaller blocks")
    raise error


def _autotuned_config(a, b, c) -> dict:
    from ..bench import time_ms
    from triton.runtime.errors import OutOfResources

    (M, K), N = a.shape, b.shape[1]
    key = (str(a.device), a.dtype, M, N, K)
    config = _TUNED.get(key)
    if config is None:
        timed = []
        for cand in autotune_candidates(M, N, K, _caps_of(a.device)):
            try:
                _launch(a, b, c, cand, interpret=False)
            except OutOfResources:
                continue
            timed.append((time_ms(lambda: _launch(a, b, c, cand, interpret=False), warmup=5, rep=25), cand))
        config = min(timed, key=lambda t: t[0])[1] if timed else matmul_config(M, N, K, a.device)
        _TUNED[key] = config
    return config


def triton_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    block_m: Optional[int] = None,
    block_n: Optional[int] = None,
    block_k: Optional[int] = None,
    use_autotune: bool = True,
) -> torch.Tensor:
    """C = A @ B with a Triton GEMM (fp32 accumulation).

    Args:
        a: (M, K); b: (K, N). float16, bfloat16 or float32, one dtype, one device, any strides.
            CUDA tensors run the compiled kernel; CPU tensors the same kernel through Triton's
            interpreter (exact, slow).
        block_m, block_n, block_k: tile sizes, all three or none. Each a power of two >= 16 and at most
            the matching dimension rounded up to a multiple of 16 (:func:`padded_dim`): for M = 100,
            block_m may be 16, 32 or 64. Given block sizes take precedence over ``use_autotune``.
        use_autotune: without block sizes, on CUDA: time the :data:`MATMUL_CONFIGS` entries that fit
            (first call per device, dtype and shape) and keep the fastest; False: the heuristic
            :func:`matmul_config`. CPU tensors always use the interpreter config, untimed.

    Returns:
        C (M, N). float16 for float16 *and float32* inputs (float32 inputs are rounded to float16
        first, as in the original API: values beyond ±65504 become inf); bfloat16 for bfloat16.

    Raises:
        ValueError: not 2-D, incompatible dimensions, different devices, invalid block size.
        TypeError: not a tensor, unsupported dtype, dtypes differ.
    """
    blocks = (block_m, block_n, block_k)
    _validate(a, b, blocks)
    check_bool("triton_matmul", "use_autotune", use_autotune)
    compute = torch.float16 if a.dtype == torch.float32 else a.dtype
    a, b = a.to(compute), b.to(compute)
    (M, K), N = a.shape, b.shape[1]
    if M == 0 or N == 0 or K == 0:
        return torch.zeros((M, N), dtype=compute, device=a.device)
    c = torch.empty((M, N), dtype=compute, device=a.device)
    interpret = a.device.type != "cuda"
    pinned = block_m is not None
    if pinned:
        config = _explicit_config(*blocks)
    elif use_autotune and not interpret:
        config = _autotuned_config(a, b, c)
    else:
        config = matmul_config(M, N, K, a.device)
    if interpret:
        _launch(a, b, c, config, interpret=True)
    else:
        _launch_fitting(a, b, c, config, pinned)
    return c
