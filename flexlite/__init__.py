"""flexlite: FlexAttention without torch.compile.

Plain Python ``score_mod`` / ``mask_mod`` callables are traced with torch.fx, lowered to Triton
expressions, spliced into Jinja-templated FlashAttention kernels and run block-sparsely from a
:class:`BlockMask`. CUDA tensors run compiled kernels; CPU tensors run the same kernels through
Triton's interpreter.
"""

from .api import flex_attention, kernel_path, kernel_source
from .block_mask import BlockMask, and_masks, create_block_mask, create_mask, noop_mask, or_masks
from .codegen.trace import UntraceableModError
from .reference import attention_reference

__all__ = [
    "flex_attention", "create_block_mask", "create_mask", "BlockMask", "and_masks", "or_masks", "noop_mask",
    "attention_reference", "kernel_source", "kernel_path", "UntraceableModError",
]
__version__ = "0.1.0"

# the "DIY FlashAttention" API (docs/API.md): kernels here and in flexlite.kernels, the rest in flexlite.utils
from .kernels import flash_attention, reference_attention, triton_matmul  # noqa: E402
from .utils import detect_gpu  # noqa: E402

__all__ += ["flash_attention", "reference_attention", "triton_matmul", "detect_gpu"]
