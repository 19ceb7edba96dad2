"""The "DIY FlashAttention" kernels on flexlite: ``flash_attention`` and ``reference_attention``
(flexlite's block-sparse attention with causal / per-sample lengths) and ``triton_matmul`` (a Triton
GEMM). The architecture-adaptive helpers live in :mod:`flexlite.utils` and are re-exported here, as the
original ``kernels`` package did. Reference: docs/API.md.
"""

try:
    import triton  # noqa: F401
except ImportError as e:  # pragma: no cover - triton is a dependency; this names the fix
    raise ImportError("flexlite.kernels needs Triton: pip install triton") from e

from .attention import flash_attention, reference_attention
from .matmul import MATMUL_CONFIGS, triton_matmul
from ..utils.gpu import check_hopper_features, supports_fp8
from ..utils.selector import (AdaptiveKernelSelector, get_attention_config, get_matmul_config, get_optimal_attention,
                              get_optimal_matmul)

__all__ = [
    "flash_attention", "reference_attention", "triton_matmul", "MATMUL_CONFIGS",
    "AdaptiveKernelSelector", "get_matmul_config", "get_attention_config", "get_optimal_matmul",
    "get_optimal_attention", "check_hopper_features", "supports_fp8",
]
