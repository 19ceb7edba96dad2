"""The "DIY FlashAttention" utilities on flexlite: GPU detection, the architecture-adaptive kernel
selector (backed by the kernels' real heuristics), benchmarking on flexlite's harness, and numerical
validation. Reference: docs/API.md.
"""

from .benchmark import BenchmarkResult, BenchmarkRunner, benchmark_fn
from .gpu import GPUArch, GPUCapabilities, check_hopper_features, detect_gpu, supports_fp8
from .selector import (AdaptiveKernelSelector, get_attention_config, get_matmul_config, get_optimal_attention,
                       get_optimal_matmul)
from .validation import validate_attention, validate_matmul

__all__ = [
    "GPUArch", "GPUCapabilities", "detect_gpu", "check_hopper_features", "supports_fp8",
    "AdaptiveKernelSelector", "get_matmul_config", "get_attention_config", "get_optimal_matmul",
    "get_optimal_attention", "BenchmarkRunner", "BenchmarkResult", "benchmark_fn",
    "validate_matmul", "validate_attention",
]
