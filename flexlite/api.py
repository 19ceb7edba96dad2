"""flex_attention: validation, dispatch, autograd.Function. A drop-in for torch's FlexAttention."""

from __future__ import annotations

import functools
import math
from typing import Callable, Optional

import torch

from .codegen.kernel import GeneratedKernel, generate
from .codegen.trace import check_arity
from .runtime.compile import load_module, write_source
from .runtime.launch import CONFIG_KEYS, TORCH_PERF_HINTS, forward_config, launch_forward

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
DEFAULT_SPARSE_BLOCK = 128


def _fail(msg: str, exc=ValueError):
    raise exc(f"flex_attention: {msg}")


def _validate(query, key, value, score_mod, block_mask, scale, enable_gqa, kernel_options):
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}", TypeError)
        if t.dim() != 4:
            _fail(f"{name} must be 4-D (batch, heads, seq_len, head_dim); got shape {tuple(t.shape)}")
    for name, t in (("key", key), ("value", value)):
        if t.dtype != query.dtype:
            _fail(f"{name} dtype {t.dtype} differs from query dtype {query.dtype}; cast them to one dtype",
                  TypeError)
        if t.device != query.device:
            _fail(f"{name} is on {t.device} but query is on {query.device}; move them to one device")
    if query.dtype not in SUPPORTED_DTYPES:
        _fail(f"dtype {query.dtype} is not supported; use float16, bfloat16 or float32", TypeError)
    (B, Hq, Lq, E), (Bk, Hkv, Lkv, Ek), (Bv, Hv, Lv, Ev) = query.shape, key.shape, value.shape
    if not (B == Bk == Bv):
        _fail(f"batch sizes differ: query {B}, key {Bk}, value {Bv}")
    if Hkv != Hv:
        _fail(f"key has {Hkv} heads but value has {Hv}; they must match")
    if Lkv != Lv:
        _fail(f"key has sequence length {Lkv} but value has {Lv}; they must match")
    if E != Ek:
        _fail(f"query and key head_dim differ ({E} vs {Ek})")
    for name, d in (("query/key", E), ("value", Ev)):
        if not 1 <= d <= MAX_HEAD_DIM:
            _fail(f"{name} head_dim {d} is out of range; flexlite supports 1..{MAX_HEAD_DIM}")
    if Hq != Hkv:
        if Hkv == 0 or Hq % Hkv:
            _fail(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv}) for grouped-query attention")
        if not enable_gqa:
            _fail(f"query has {Hq} heads but key/value have {Hkv}; pass enable_gqa=True for grouped-query "
                  f"attention, or repeat the key/value heads")
    if score_mod is not None:
        check_arity(score_mod, "score_mod")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        _fail(f"scale must be a Python float or None, got {type(scale).__name__}", TypeError)
    if kernel_options is not None:
        if not isinstance(kernel_options, dict):
            _fail(f"kernel_options must be a dict, got {type(kernel_options).__name__}", TypeError)
        unknown = set(kernel_options) - set(CONFIG_KEYS) - TORCH_PERF_HINTS
        if unknown:
            _fail(f"unknown kernel_options {sorted(unknown)}; flexlite understands {list(CONFIG_KEYS)} "
                  f"(torch's performance hints {sorted(TORCH_PERF_HINTS)} are accepted and ignored)")
    if block_mask is not None:
        _validate_block_mask(block_mask, query, key)


def _validate_block_mask(block_mask, query, key):
    from .block_mask import BlockMask

    if not isinstance(block_mask, BlockMask):
        _fail(f"block_mask must be a flexlite BlockMask (from create_block_mask), got "
              f"{type(block_mask).__name__}", TypeError)
    B, Hq, Lq = query.shape[:3]
    Lkv = key.shape[2]
    mq, mkv = block_mask.seq_lengths
    if (mq, mkv) != (Lq, Lkv):
        _fail(f"block_mask was built for Q_LEN={mq}, KV_LEN={mkv} but query has length {Lq} and key {Lkv}; "
              f"build it with create_block_mask(mask_mod, B, H, {Lq}, {Lkv}, ...)")
    mb, mh = block_mask.kv_num_blocks.shape[:2]
    if mb not in (1, B):
        _fail(f"block_mask has batch size {mb} but query has {B}; build it with B={B} or B=None (broadcast)")
    if mh not in (1, Hq):
        _fail(f"block_mask has {mh} heads but query has {Hq}; build it with H={Hq} or H=None (broadcast)")
    if block_mask.kv_num_blocks.device != query.device:
        _fail(f"block_mask is on {block_mask.kv_num_blocks.device} but query is on {query.device}; build it "
              f"with device=query.device or call block_mask.to(query.device)")
    if block_mask.mask_mod is not None:
        check_arity(block_mask.mask_mod, "mask_mod", "block_mask.mask_mod")


def _check_captured(kernel: GeneratedKernel, device: torch.device):
    for t in kernel.captured:
        if t.device != device:
            _fail(f"a tensor captured by a mod is on {t.device} but the inputs are on {device}; create it on "
                  f"{device} (tensor.to(query.device)) before defining the mod")


@functools.lru_cache(maxsize=64)
def _all_full_blocks(Lq: int, Lkv: int, device: torch.device):
    """Block-sparse tensors of 'no mask': every kv block is full for every q block."""
    nq, nkv = -(-Lq // DEFAULT_SPARSE_BLOCK), -(-Lkv // DEFAULT_SPARSE_BLOCK)
    zeros = torch.zeros((1, 1, nq), dtype=torch.int32, device=device)
    idx = torch.arange(nkv, dtype=torch.int32, device=device).expand(1, 1, nq, nkv).contiguous()
    return zeros, idx, torch.full_like(zeros, nkv), idx, (DEFAULT_SPARSE_BLOCK, DEFAULT_SPARSE_BLOCK)


def _block_tensors(block_mask, Lq, Lkv, device):
    if block_mask is None:
        return _all_full_blocks(Lq, Lkv, device)
    return (block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
            block_mask.full_kv_indices, tuple(block_mask.BLOCK_SIZE))


def _generate(score_mod, block_mask, device: torch.device, template: str = "fwd.py.jinja") -> GeneratedKernel:
    mask_mod = block_mask.mask_mod if block_mask is not None else None
    return generate(template, score_mod, mask_mod, interpret=device.type != "cuda")


def kernel_source(score_mod: Optional[Callable] = None, block_mask=None, *, device=None) -> str:
    """The generated Triton source flex_attention runs for these mods (also written to the kernel cache;
    ``FLEXLITE_SHOW_KERNELS=1`` prints each kernel as it is first loaded).

    ``device`` picks the CUDA or the interpreter (CPU) variant; by default the block mask's device,
    else CUDA when available.
    """
    if device is None:
        device = block_mask.kv_num_blocks.device if block_mask is not None else (
            "cuda" if torch.cuda.is_available() else "cpu")
    return _generate(score_mod, block_mask, torch.device(device)).source


def kernel_path(score_mod: Optional[Callable] = None, block_mask=None, *, device=None) -> str:
    """Path of the file holding :func:`kernel_source` for these mods."""
    return str(write_source(kernel_source(score_mod, block_mask, device=device)))


def _forward(query, key, value, score_mod, block_mask, scale, kernel_options):
    B, Hq, Lq, E = query.shape
    Lkv = key.shape[2]
    if B * Hq * Lq == 0 or Lkv == 0:
        out = query.new_zeros((B, Hq, Lq, value.shape[-1]))
        return out, torch.full((B, Hq, Lq), float("-inf"), dtype=torch.float32, device=query.device)
    kernel = _generate(score_mod, block_mask, query.device)
    _check_captured(kernel, query.device)
    module = load_module(kernel.source, interpret=query.device.type != "cuda")
    num, idx, full_num, full_idx, sparse = _block_tensors(block_mask, Lq, Lkv, query.device)
    config = forward_config(query, value, sparse, kernel_options or {})
    return launch_forward(module, kernel.mod_args(), query, key, value, num, idx, full_num, full_idx,
                          sparse, scale, kernel.has_score_mod, config)


class FlexAttentionFunction(torch.autograd.Function):
    """Forward: the generated block-sparse FlashAttention kernel. Returns (out, lse)."""

    @staticmethod
    def forward(ctx, query, key, value, score_mod, block_mask, scale, kernel_options):
        out, lse = _forward(query, key, value, score_mod, block_mask, scale, kernel_options)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        raise NotImplementedError(
            "flex_attention: the backward pass is not implemented yet in this flexlite version; run the "
            "forward under torch.no_grad() or detach the inputs")


def flex_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    score_mod: Optional[Callable] = None,
    block_mask=None,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options: Optional[dict] = None,
):
    """Attention with a user score_mod and a block-sparse mask; the same API as torch's flex_attention.

    Args:
        query: [B, Hq, Lq, E]; key: [B, Hkv, Lkv, E]; value: [B, Hkv, Lkv, Ev]. float16, bfloat16 or
            float32, all on one device: CUDA runs compiled Triton kernels, CPU the same kernels through
            Triton's interpreter (exact but slow: for debugging and tests).
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, applied to the scaled score.
        block_mask: a :class:`flexlite.BlockMask` from :func:`flexlite.create_block_mask`; None = no mask.
        scale: multiplies ``q @ k^T``; default ``1 / sqrt(E)``.
        enable_gqa: allow Hq to be a multiple of Hkv (query head h uses kv head ``h // (Hq // Hkv)``).
        return_lse: also return the log-sum-exp [B, Hq, Lq] (fp32, natural log).
        kernel_options: pin tile sizes: ``BLOCK_M``, ``BLOCK_N``, ``num_warps``, ``num_stages``.

    Returns:
        out [B, Hq, Lq, Ev] in the input dtype, and ``lse`` if ``return_lse``. A query row that every
        position is masked for gives out 0 and LSE -inf.
    """
    _validate(query, key, value, score_mod, block_mask, scale, enable_gqa, kernel_options)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    out, lse = FlexAttentionFunction.apply(query, key, value, score_mod, block_mask, float(scale), kernel_options)
    return (out, lse) if return_lse else out
