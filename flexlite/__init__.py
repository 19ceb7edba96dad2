"""flexlite: FlexAttention without torch.compile.

Plain Python ``score_mod`` / ``mask_mod`` callables are traced with torch.fx, lowered to Triton
expressions, spliced into Jinja-templated FlashAttention kernels and run block-sparsely from a
:class:`BlockMask`. CUDA tensors run compiled kernels; CPU tensors run the same kernels through
Triton's interpreter.
"""

from .api import AuxOutput, AuxRequest, FlexKernelOptions, flex_attention, kernel_path, kernel_source
from .block_mask import BlockMask, and_masks, create_block_mask, create_mask, noop_mask, or_masks
# torch's private names that attention-gym code imports from torch.nn.attention.flex_attention
from .block_mask import _DEFAULT_SPARSE_BLOCK_SIZE, _mask_mod_signature, _score_mod_signature  # noqa: F401
from .codegen.trace import UntraceableModError
from .reference import attention_reference

__all__ = [
    "flex_attention", "AuxRequest", "AuxOutput", "FlexKernelOptions", "create_block_mask", "create_mask", "BlockMask", "and_masks",
    "or_masks", "noop_mask", "attention_reference", "kernel_source", "kernel_path", "UntraceableModError",
]
__version__ = "0.1.0"

from .runtime.compile import prewarm_triton_key as _prewarm

_prewarm()  # Triton's per-process cache key, hashed in the background (runtime/compile.py)

# the "DIY FlashAttention" API (docs/API.md): flexlite.kernels and flexlite.utils, re-exported here on first
# use so that `import flexlite` (and `python -m flexlite.masks.<family>`) does not load them
_LAZY = {"flash_attention": "kernels", "reference_attention": "kernels", "triton_matmul": "kernels",
         "detect_gpu": "utils"}
__all__ += list(_LAZY)


# helpers of torch's that attention-gym imports from torch.nn.attention.flex_attention (pure torch): torch's own
_FROM_TORCH = ("_ModificationType", "_vmap_for_bhqkv", "_identity")


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    if name in _FROM_TORCH:
        from torch.nn.attention import flex_attention as torch_flex_attention
        if hasattr(torch_flex_attention, name):
            return getattr(torch_flex_attention, name)
    raise AttributeError(f"module 'flexlite' has no attribute {name!r}")
