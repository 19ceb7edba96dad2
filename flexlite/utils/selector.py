"""Architecture-adaptive kernel choice, backed by the heuristics the kernels really use: matmul configs
from :data:`flexlite.kernels.matmul.MATMUL_CONFIGS` (:func:`~flexlite.kernels.matmul.matmul_config`),
attention tiles from flexlite's forward heuristic (:func:`flexlite.runtime.launch.forward_config`)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import torch

from ..runtime.launch import default_use_tma, forward_config
from .gpu import GPUCapabilities, detect_gpu

_SPARSE_BLOCK = (128, 128)  # flash_attention's block masks use create_block_mask's default BLOCK_SIZE


@dataclasses.dataclass(frozen=True)
class _TensorSpec:
    """What forward_config reads of a tensor: shape, dtype, device (no storage needed)."""

    shape: tuple
    dtype: torch.dtype
    device: torch.device


class AdaptiveKernelSelector:
    """Kernel configs and kernels for one device.

    ``device``: ``"cuda"`` / ``"cuda:N"`` / ``"cpu"``, default CUDA when available, else CPU. On CUDA the
    GPU is detected lazily (:func:`detect_gpu`) on first use and kept. Configs are what the kernels run:
    on CPU, the interpreter configs.
    """

    def __init__(self, device=None):
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self._caps: Optional[GPUCapabilities] = None

    @property
    def capabilities(self) -> Optional[GPUCapabilities]:
        """The detected GPU (None on CPU)."""
        if self._caps is None and self.device.type == "cuda":
            self._caps = detect_gpu(self.device.index or 0)
        return self._caps

    def get_matmul_config(self, M: int = 4096, N: int = 4096, K: int = 4096) -> dict:
        """The config ``triton_matmul(..., use_autotune=False)`` runs for (M, K) @ (K, N) here:
        BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, plus ``use_tma`` and ``use_fp8``
        (both False: the GEMM uses neither) and ``arch``."""
        from ..kernels.matmul import matmul_config

        caps = self.capabilities
        config = matmul_config(M, N, K, self.device, caps=caps)
        return dict(config, use_tma=False, use_fp8=False, arch=caps.arch.value if caps else "cpu")

    def get_attention_config(self, seq_len: int = 4096, head_dim: int = 64, dtype: torch.dtype = torch.float16,
                             causal: bool = False, varlen: bool = False) -> dict:
        """The forward tiles ``flash_attention`` launches here: BLOCK_M, BLOCK_N, num_warps, num_stages
        from flexlite's heuristic for this head_dim, dtype and masking (``varlen``: ``seq_lens`` given),
        plus ``use_tma`` (K / V through tensor descriptors: unmasked at head dims up to 128 on Hopper or newer)
        and ``arch``."""
        from ..kernels.attention import KERNEL_OPTIONS

        q = _TensorSpec((1, 1, seq_len, head_dim), dtype, self.device)
        tile = forward_config(q, q, _SPARSE_BLOCK, dict(KERNEL_OPTIONS), gathers=varlen)
        caps = self.capabilities
        use_tma = caps is not None and caps.compute_capability >= (9, 0) and \
            default_use_tma(not (causal or varlen), head_dim, head_dim)
        return dict(dataclasses.asdict(tile), use_tma=use_tma, arch=caps.arch.value if caps else "cpu")

    def select_matmul_kernel(self) -> Callable:
        """``triton_matmul`` with ``use_autotune=False``: each call runs :meth:`get_matmul_config`'s
        config for its shape (no timing). Call ``triton_matmul`` itself to autotune."""
        from ..kernels.matmul import triton_matmul

        return functools.partial(triton_matmul, use_autotune=False)

    def select_attention_kernel(self) -> Callable:
        """``flash_attention``: each call runs :meth:`get_attention_config`'s tiles for its shape."""
        from ..kernels.attention import flash_attention

        return flash_attention


_DEFAULT: Optional[AdaptiveKernelSelector] = None


def _default() -> AdaptiveKernelSelector:
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = AdaptiveKernelSelector()
    return _DEFAULT


def get_matmul_config(M: int = 4096, N: int = 4096, K: int = 4096) -> dict:
    """:meth:`AdaptiveKernelSelector.get_matmul_config` of the default device."""
    return _default().get_matmul_config(M, N, K)


def get_attention_config(seq_len: int = 4096, head_dim: int = 64, dtype: torch.dtype = torch.float16,
                         causal: bool = False, varlen: bool = False) -> dict:
    """:meth:`AdaptiveKernelSelector.get_attention_config` of the default device."""
    return _default().get_attention_config(seq_len, head_dim, dtype, causal, varlen)


def get_optimal_matmul() -> Callable:
    """:meth:`AdaptiveKernelSelector.select_matmul_kernel` of the default device."""
    return _default().select_matmul_kernel()


def get_optimal_attention() -> Callable:
    """:meth:`AdaptiveKernelSelector.select_attention_kernel` of the default device."""
    return _default().select_attention_kernel()
