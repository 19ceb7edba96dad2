"""flex_attention: validation, dispatch, autograd.Function. A drop-in for torch's FlexAttention."""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import numbers
import weakref
from typing import Callable, Literal, NamedTuple, Optional, TypedDict

import torch
from torch.autograd import forward_ad

from . import eager as _eager
from . import first_calls
from .block_mask import (BlockMask, check_block_tensors, check_bool, check_captured_device, check_device,
                         check_mod_output, from_torch_block_mask, is_bool, is_torch_block_mask, item_lists, kept_on,
                         lists_key, q_sides, tensors_key)
from .codegen.kernel import GeneratedKernel, generate, generate_backward
from .codegen.lower import FLOAT32_EXACT_INT
from .codegen.trace import check_arity, trace_mod
from .runtime.compile import env_flag, load_module, write_source
from .runtime import launch as _launch
from .runtime.guards import autocast_on, opaque_to_compile, work_scope
from .runtime.autotune import autotune_enabled
from .runtime.launch import (BACKWARD_CONFIG_KEYS, CONFIG_KEYS, FLEXLITE_OPTIONS, TORCH_PERF_HINTS,
                             backward_config, cdiv, decode_rows, forward_config, head_dim_pad,
                             launch_backward, launch_decode, launch_forward, launch_forward_ws, ws_backward_unmet,
                             ws_forward_unmet, WS_BWD_DEFAULT_HEAD_DIMS, WS_DEFAULT_HEAD_DIMS, WS_DEVICE_DESC_HEAD_DIMS,
                             WS_MIN_WALK_KEYS, is_compile_error, ws_host_descriptors)

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
DEFAULT_SPARSE_BLOCK = 128


# the kernels offset within one (batch, head) slice, within block-mask tensors and within captured tensors of
# at most INDEX_LIMIT elements in 32 bits; across (batch, head) slices in 64 (see README, "Index limits")
INDEX_LIMIT = 2**31


class AuxRequest(NamedTuple):
    """Which auxiliary outputs flex_attention returns beside ``out`` (``return_aux=``), as torch's
    ``torch.nn.attention.flex_attention.AuxRequest`` (which flexlite accepts as well)."""

    lse: bool = False
    max_scores: bool = False


class AuxOutput(NamedTuple):
    """flex_attention's auxiliary outputs for ``return_aux``: a field is None unless it was requested."""

    lse: Optional[torch.Tensor] = None
    max_scores: Optional[torch.Tensor] = None


class FlexKernelOptions(TypedDict, total=False):
    """The keys ``kernel_options`` takes (every key is optional), as torch's ``FlexKernelOptions`` for type
    checkers: the tile config, flexlite's own options, and torch's performance hints (accepted, no effect).
    See :func:`flex_attention`'s ``kernel_options`` for what each does."""

    # the forward's tile config (pinned: no autotuning) and the backward's (dK / dV: M1 / N1, dQ: M2 / N2)
    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int
    BLOCK_M1: int
    BLOCK_N1: int
    BLOCK_M2: int
    BLOCK_N2: int
    # flexlite's
    AUTOTUNE: bool
    USE_TMA: bool
    WARP_SPECIALIZE: bool
    DECODE: bool
    DECODE_SPLITS: int
    FORCE_USE_FLEX_ATTENTION: bool
    DETERMINISTIC_CAPTURED_GRADS: bool
    BACKEND: Literal["AUTO", "TRITON", "TRITON_DECODE", "FLASH"]
    # torch's performance hints: accepted, no effect
    PRESCALE_QK: bool
    ROWS_GUARANTEED_SAFE: bool
    BLOCKS_ARE_CONTIGUOUS: bool
    WRITE_DQ: bool
    OUTPUT_LOGSUMEXP: bool
    OUTPUT_MAX: bool
    kpack: int
    matrix_instr_nonkdim: int
    waves_per_eu: int
    # any key above prefixed fwd_ or bwd_ applies to that pass alone (torch's); two as examples
    fwd_num_warps: int
    fwd_num_stages: int


def _fail(msg: str, exc=ValueError):
    raise exc(f"flex_attention: {msg}")


def check_scale(scale, fail: Callable, name: str = "scale") -> None:
    """``scale`` (the argument ``name``) as torch's flex_attention takes it: a real number (a Python or numpy one), a
    real 0-d tensor that does not require grad, or None; else ``fail(message, TypeError)``."""
    if isinstance(scale, torch.Tensor):
        if scale.dim() != 0 or scale.dtype == torch.bool or scale.is_complex() or scale.requires_grad:
            fail(f"{name} must be a Python float, a real 0-d tensor that does not require grad (no gradient flows to "
                 f"it), or None; got a tensor of shape {tuple(scale.shape)}, {scale.dtype}"
                 f"{', requiring grad' if scale.requires_grad else ''}", TypeError)
        if scale.device.type == "meta":
            fail(f"{name} is a tensor on the meta device, which holds no value; pass a Python float (or a 0-d tensor "
                 f"with its value)", ValueError)
    elif scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
        fail(f"{name} must be a Python float (or a real number: int, numpy float) or None, got "
             f"{type(scale).__name__}", TypeError)
    elif scale is not None:
        try:
            float(scale)
        except OverflowError:
            text = repr(scale) if len(repr(scale)) <= 40 else f"{repr(scale)[:20]}... ({len(repr(scale))} digits)"
            fail(f"{name}={text} does not fit a float; pass a float (float('inf') for an infinite one)", ValueError)


def _max_offset(shape, strides) -> int:
    """The largest element offset a tensor of this shape and these strides reaches (0 when empty)."""
    if any(n == 0 for n in shape):
        return 0
    return sum((n - 1) * abs(st) for n, st in zip(shape, strides))


def _check_slice_offsets(query, key, value):
    """Offsets within one (batch, head) slice are 32-bit in the kernels: the inputs as strided, and the
    contiguous tensors the kernels write (out [Lq, Ev]; the gradients, shaped as q, k, v), must stay below
    2**31 there."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        (n, e), (sn, se) = t.shape[2:], t.stride()[2:]
        span = (n - 1) * abs(sn) + (e - 1) * abs(se) if n and e else 0  # _max_offset, unrolled (per call)
        if span >= INDEX_LIMIT:
            _fail(f"{name} spans {span} elements within one (batch, head) slice (shape {tuple(t.shape)}, strides "
                  f"{t.stride()}); flexlite's kernels need < 2**31 there: make it contiguous or split the sequence")
        if t.shape[2] * t.shape[3] > INDEX_LIMIT:
            _fail(f"{name} has {t.shape[2]} x {t.shape[3]} = {t.shape[2] * t.shape[3]} elements per (batch, head) "
                  f"slice; flexlite's kernels (and its gradients) need at most 2**31 there: split the sequence")
    if query.shape[2] * value.shape[3] > INDEX_LIMIT:
        _fail(f"the output has {query.shape[2]} x {value.shape[3]} = {query.shape[2] * value.shape[3]} elements per "
              f"(batch, head) slice (query length x value head_dim); flexlite's kernels need at most 2**31 there: "
              f"split the query sequence")


# kernel_options' values: flags, ints with their least value, and tile sizes (powers of two >= 16; whether they
# divide the block mask's blocks is checked where the tiles are picked)
_FLAG_OPTIONS = ("AUTOTUNE", "USE_TMA", "DETERMINISTIC_CAPTURED_GRADS", "DECODE", "FORCE_USE_FLEX_ATTENTION",
                 "WARP_SPECIALIZE")
# torch's performance hints (no effect here): flags there too, constexprs of its kernels (a bool, or 0 / 1)
_HINT_FLAGS = ("PRESCALE_QK", "ROWS_GUARANTEED_SAFE", "BLOCKS_ARE_CONTIGUOUS", "OUTPUT_LOGSUMEXP", "OUTPUT_MAX",
               "WRITE_DQ")
_INT_OPTIONS = {"num_stages": 1, "DECODE_SPLITS": 1, "kpack": 1, "matrix_instr_nonkdim": 0, "waves_per_eu": 0}
# options of the forward alone (the decoding kernel's): not under a bwd_ prefix
_FORWARD_ONLY_OPTIONS = ("DECODE", "DECODE_SPLITS")
_TILE_OPTIONS = ("BLOCK_M", "BLOCK_N", "BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2")


_PASS_PREFIXES = ("fwd_", "bwd_")


def _pass_options(kernel_options: Optional[dict], prefix: str) -> Optional[dict]:
    """``kernel_options`` for one pass (``prefix`` "fwd_" or "bwd_"), as torch reads them: a key with the pass's
    prefix applies to that pass alone, over the same key unprefixed; the other pass's keys are dropped."""
    if not kernel_options or not any(k[:4] in _PASS_PREFIXES for k in kernel_options):
        return kernel_options
    options = {k: v for k, v in kernel_options.items() if k[:4] not in _PASS_PREFIXES}
    options.update({k[4:]: v for k, v in kernel_options.items() if k.startswith(prefix)})
    return options


def _check_option_values(kernel_options: dict, blocks: Optional[tuple]) -> None:
    """A clear error for a bad value of a kernel_options key flexlite uses (before anything compiles or runs; a
    string "False" would otherwise read as True, a DECODE_SPLITS of 0 as no keys at all). A key prefixed fwd_ or
    bwd_ is checked as the option it names, and the message names the key as given. ``blocks``: the block mask's
    BLOCK_SIZE (query side, key side), which each tile size must divide (None: not checked here)."""
    for key, value in kernel_options.items():
        name = key[4:] if key[:4] in _PASS_PREFIXES else key
        if name in _FLAG_OPTIONS:
            check_bool("flex_attention", f"kernel_options {key}", value)
        if name in _HINT_FLAGS and value not in (True, False):  # (0 and 1 are equal to them)
            _fail(f"kernel_options {key} must be a bool (or 0 / 1, as torch's kernels take it); got "
                  f"{type(value).__name__} {value!r}", TypeError)
        is_int = isinstance(value, int) and not isinstance(value, bool)
        if name in _INT_OPTIONS and not (is_int and value >= _INT_OPTIONS[name]):
            _fail(f"kernel_options {key} must be an int >= {_INT_OPTIONS[name]}; got {type(value).__name__} "
                  f"{value!r}", ValueError if is_int else TypeError)
        if name == "num_warps" and not (is_int and 1 <= value <= 32 and value & (value - 1) == 0):
            _fail(f"kernel_options {key} must be a power of two from 1 to 32 (4 or 8 usually); got "
                  f"{type(value).__name__} {value!r}", ValueError if is_int else TypeError)
        if name in _TILE_OPTIONS and not (is_int and value >= 16 and value & (value - 1) == 0):
            _fail(f"kernel_options {key} must be a power of two >= 16 (that divides the block mask's BLOCK_SIZE); "
                  f"got {type(value).__name__} {value!r}", ValueError if is_int else TypeError)
        kv_side = "_N" in name  # (BLOCK_N, BLOCK_N1, BLOCK_N2: tiles of keys)
        if name in _TILE_OPTIONS and blocks and blocks[kv_side] % value:
            _fail(f"kernel_options {key} must be a power of two >= 16 that divides the block mask's BLOCK_SIZE on "
                  f"the {'key' if kv_side else 'query'} side ({blocks[kv_side]}); got {value}")


def _check_device_type(query):
    if query.device.type not in ("cuda", "cpu"):
        _fail(f"the inputs are on {query.device}; flexlite runs CUDA tensors (compiled kernels) and CPU tensors "
              f"(Triton's interpreter) only: move them with .to('cuda') or .to('cpu')", NotImplementedError)


def _check_aux(return_aux, return_lse: bool, kernel_options) -> None:
    """``return_aux``: None or an AuxRequest (flexlite's or torch's: fields ``lse`` and ``max_scores``, bools)."""
    if return_aux is None:
        return
    if not all(is_bool(getattr(return_aux, f, None)) for f in AuxRequest._fields):
        _fail(f"return_aux must be None or an AuxRequest(lse=..., max_scores=...) with bool fields "
              f"(flexlite.AuxRequest or torch's); got {type(return_aux).__name__} {return_aux!r}", TypeError)
    if return_lse:
        _fail("return_lse=True and return_aux cannot be combined; pass return_aux=AuxRequest(lse=True) alone")
    if return_aux.max_scores and (kernel_options or {}).get("WARP_SPECIALIZE") and not _launch.WS_FWD_MAX_SCORES:
        _fail("return_aux max_scores comes from the Triton forward and decode kernels; kernel_options "
              "WARP_SPECIALIZE=True picks the warp-specialized one: drop that option or the max_scores request",
              NotImplementedError)


def _resolve_backend(kernel_options):
    """torch's kernel_options ``BACKEND`` (or ``fwd_BACKEND``: the forward is the pass with a choice, the decoding
    kernel) as flexlite's ``DECODE`` (:data:`launch.BACKENDS`); a bad value (``bwd_BACKEND``'s too, which picks
    nothing: the backward has one kernel family), or one combined with DECODE or FORCE_USE_FLEX_ATTENTION (which
    torch refuses too), is a ValueError."""
    if not isinstance(kernel_options, dict):
        return kernel_options
    for prefix in ("", "fwd_", "bwd_"):
        if prefix + "BACKEND" not in kernel_options:
            continue
        backend = kernel_options[prefix + "BACKEND"]
        if not isinstance(backend, str) or backend not in _launch.BACKENDS:  # (a list would not hash)
            _fail(f"kernel_options {prefix}BACKEND must be one of {list(_launch.BACKENDS)}; got {backend!r}")
        both = [prefix + k for k in ("DECODE", "FORCE_USE_FLEX_ATTENTION") if prefix + k in kernel_options]
        if both:
            _fail(f"kernel_options {prefix}BACKEND cannot be combined with {both[0]} (torch refuses the legacy "
                  f"knobs beside it too): keep one")
        decode = _launch.BACKENDS[backend]
        if decode is not None and prefix != "bwd_":
            kernel_options = {**kernel_options, prefix + "DECODE": decode}
    return kernel_options


def _validate(query, key, value, score_mod, block_mask, scale, enable_gqa, kernel_options, return_lse=False,
              return_aux=None) -> tuple:
    """TypeError / ValueError / NotImplementedError for what flex_attention cannot run; else the traces of score_mod
    and of the block mask's mask_mod (None for none), which the call hands on (each trace's cache check fingerprints
    what the mod captures: once per call, not once per use)."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}", TypeError)
        if t.is_nested:
            _fail(f"{name} is a nested (jagged) tensor, which flex_attention's kernels do not run: pad it "
                  f"(x.to_padded_tensor(0.0)), or pad and then pack the sequences into one (flexlite.varlen.pack, "
                  f"with varlen_block_mask)",
                  NotImplementedError)
        if t.layout != torch.strided:  # (sparse COO / CSR / ...: no strides or storage for the kernels to read)
            _fail(f"{name} is a {str(t.layout).replace('torch.', '')} tensor, which flex_attention's kernels do not "
                  f"read; pass a dense one ({name}.to_dense())", NotImplementedError)
        if torch._C._functorch.is_functorch_wrapped_tensor(t):
            _fail(f"{name} comes from a torch.func transform (vmap, grad, vjp, jacrev, ...), which flex_attention's "
                  f"kernels do not run under: fold a vmapped dimension into the batch (B), and take gradients with "
                  f"torch.autograd (loss.backward(), torch.autograd.grad)", NotImplementedError)
        if forward_ad._current_level >= 0 and forward_ad.unpack_dual(t).tangent is not None:
            _fail(f"{name} is a forward-mode AD dual tensor (torch.autograd.forward_ad), which flex_attention does "
                  f"not differentiate (its tangent would be dropped); use reverse mode (loss.backward(), "
                  f"torch.autograd.grad)", NotImplementedError)
        if t.dim() != 4:
            _fail(f"{name} must be 4-D (batch, heads, seq_len, head_dim); got shape {tuple(t.shape)}")
    for name, t in (("key", key), ("value", value)):
        if t.dtype != query.dtype:
            _fail(f"{name} dtype {t.dtype} differs from query dtype {query.dtype}; cast them to one dtype",
                  TypeError)
        if t.device != query.device:
            _fail(f"{name} is on {t.device} but query is on {query.device}; move them to one device")
    if query.dtype not in SUPPORTED_DTYPES + (torch.float64,):
        _fail(f"dtype {query.dtype} is not supported; use float16, bfloat16, float32 (the kernels) or float64 (torch "
              f"ops: for gradcheck and tests)", TypeError)
    (B, Hq, _, E), (Bk, Hkv, Lkv, Ek), (Bv, Hv, Lv, Ev) = query.shape, key.shape, value.shape
    if not (B == Bk == Bv or Bk == Bv == 1):
        _fail(f"batch sizes differ: query {B}, key {Bk}, value {Bv}; key and value need the query's batch size, or "
              f"both batch 1 (one key / value sequence shared by the whole batch)")
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
            _fail(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv}) for grouped-query attention "
                  f"(each kv head serves Hq // Hkv query heads): change the head counts, or repeat key/value heads "
                  f"(key.repeat_interleave(n, dim=1)) until they divide Hq")
        if not enable_gqa:
            _fail(f"query has {Hq} heads but key/value have {Hkv}; pass enable_gqa=True for grouped-query "
                  f"attention, or repeat the key/value heads")
    _check_slice_offsets(query, key, value)
    _check_device_type(query)  # after the offset checks: meta tensors show what those accept
    enable_gqa = check_bool("flex_attention", "enable_gqa", enable_gqa)
    return_lse = check_bool("flex_attention", "return_lse", return_lse)
    traced_score_mod = None
    if score_mod is not None:
        check_arity(score_mod, "score_mod")
        heads = getattr(score_mod, "flexlite_heads", None)  # (flexlite.mods' per-head tables: one entry per head)
        if heads is not None and heads != Hq:
            _fail(f"score_mod {getattr(score_mod, '__name__', '')!r} is made for {heads} heads (one table entry per "
                  f"head) but query has {Hq}; make it for {Hq} heads (its generator's head count, or table rows)")
        # (float64 runs the mods in torch ops, vmapped: one value per score, checked here; the kernels' lowering names
        # a value of another shape itself)
        traced_score_mod = check_mod_output(score_mod, "score_mod", "flex_attention",
                                            check_shape=query.dtype == torch.float64)
        for t in traced_score_mod.captured.values():
            if torch._C._functorch.is_functorch_wrapped_tensor(t):
                # (described, not named: the trace's name for it is fx's '_tensor_constant0', not the user's)
                _fail(f"score_mod captures a tensor (shape {tuple(t.shape)}, {t.dtype}) from a torch.func transform "
                      f"(vmap, grad, functional_call under vmap, ...), which "
                      f"flex_attention's kernels do not run under: take gradients of captured tensors with "
                      f"torch.autograd (they are differentiable there)", NotImplementedError)
    check_scale(scale, _fail)
    if kernel_options is not None:
        if not isinstance(kernel_options, dict):
            _fail(f"kernel_options must be a dict, got {type(kernel_options).__name__}", TypeError)
        named = [k for k in kernel_options if not isinstance(k, str)]
        if named:
            _fail(f"kernel_options keys must be str (option names such as 'BLOCK_M'); got {named[0]!r}", TypeError)
        known = set(CONFIG_KEYS) | TORCH_PERF_HINTS | FLEXLITE_OPTIONS
        unknown = {k for k in kernel_options if k not in known and not (k[:4] in _PASS_PREFIXES and k[4:] in known)}
        if unknown:
            _fail(f"unknown kernel_options {sorted(unknown)}; flexlite understands "
                  f"{list(CONFIG_KEYS) + sorted(FLEXLITE_OPTIONS)}, each also prefixed fwd_ or bwd_ for one pass "
                  f"(torch's performance hints {sorted(TORCH_PERF_HINTS)} are accepted and ignored)")
        backward_only = sorted(k for k in kernel_options if k[:4] == "bwd_" and k[4:] in _FORWARD_ONLY_OPTIONS)
        if backward_only:
            name = backward_only[0]
            _fail(f"kernel_options {name}: {name[4:]} chooses the forward's decoding kernel, which the backward does "
                  f"not have; drop the bwd_ prefix (or the option)")
        # (a block_mask that is not a BlockMask is refused below)
        _check_option_values(kernel_options, (DEFAULT_SPARSE_BLOCK,) * 2 if block_mask is None
                             else tuple(block_mask.BLOCK_SIZE) if isinstance(block_mask, BlockMask) else None)
        # (numpy bools as Python's: the options are constexprs and cache keys downstream)
        kernel_options = {k: bool(v) if is_bool(v) else v for k, v in kernel_options.items()}
        forward_options = _pass_options(kernel_options, "fwd_")

        def written(k):  # the forward's key as the user wrote it
            return "fwd_" + k if "fwd_" + k in kernel_options else k
        if forward_options.get("DECODE") and forward_options.get("FORCE_USE_FLEX_ATTENTION"):
            _fail(f"kernel_options {written('DECODE')}=True (or torch's BACKEND='TRITON_DECODE') cannot be combined "
                  f"with {written('FORCE_USE_FLEX_ATTENTION')}=True: one insists on the decoding kernel, the other "
                  f"forbids it; pass one of them")
        pinned = [written(k) for k in CONFIG_KEYS if k in forward_options]
        if forward_options.get("DECODE") and pinned:
            _fail(f"kernel_options {written('DECODE')}=True (or torch's BACKEND='TRITON_DECODE') picks the decoding "
                  f"kernel, which takes no tile config, so the forward's pinned {pinned} would be ignored (pinned "
                  f"tiles otherwise pick the regular kernel): drop one or the other, or prefix them bwd_ for the "
                  f"backward alone")
        if forward_options.get("WARP_SPECIALIZE") and (
                forward_options.get("DECODE") or forward_options.get("AUTOTUNE")
                or any(k in forward_options for k in CONFIG_KEYS)):
            _fail(f"kernel_options WARP_SPECIALIZE=True picks the warp-specialized forward, which has one tile "
                  f"config; it cannot be combined with DECODE=True, AUTOTUNE=True or pinned tiles "
                  f"{list(CONFIG_KEYS)}: drop one or the other")
    _check_aux(return_aux, return_lse, _pass_options(kernel_options, "fwd_"))
    return traced_score_mod, _validate_block_mask(block_mask, query, key) if block_mask is not None else None


# per block mask (held weakly), what its checks against a call's inputs were last passed with (_validate_block_mask)
_MASKS_CHECKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _validate_block_mask(block_mask, query, key):
    """As :func:`_validate`, for the block mask; returns its mask_mod's trace (None without a mask_mod). The checks
    of its tensors against the inputs' lengths, batch, heads and device run once per set of tensors (their ids and
    in-place versions), lengths, block size, input shape, device and index limit; mask_mod is traced at every call
    (the trace notices what it captures being rebound)."""
    if not isinstance(block_mask, BlockMask):
        _fail(f"block_mask must be a BlockMask (from flexlite's create_block_mask, or torch's), got "
              f"{type(block_mask).__name__}", TypeError)
    tensors = [getattr(block_mask, name) for name in BlockMask._TENSOR_ATTRS]
    checked = (tensors_key(tensors), tuple(block_mask.seq_lengths), tuple(block_mask.BLOCK_SIZE), query.shape[:3],
               key.shape[2], query.device, INDEX_LIMIT)
    if _MASKS_CHECKED.get(block_mask) != checked:
        _check_block_mask(block_mask, tensors, query, key)
        _MASKS_CHECKED[block_mask] = checked
    if block_mask.mask_mod is None:
        return None
    check_arity(block_mask.mask_mod, "mask_mod", "block_mask.mask_mod")
    return check_mod_output(block_mask.mask_mod, "mask_mod", "flex_attention",
                            check_shape=query.dtype == torch.float64)  # (as score_mod's: _validate)


def _check_block_mask(block_mask, tensors: list, query, key) -> None:
    """:func:`_validate_block_mask`'s checks of the mask's lengths, tensors, batch, heads and device."""
    B, Hq, Lq = query.shape[:3]
    Lkv = key.shape[2]
    mq, mkv = block_mask.seq_lengths
    if Lq == 0 or Lkv == 0:
        _fail(f"query has length {Lq} and key {Lkv}: there is nothing to mask (and no BlockMask of length 0); pass "
              f"block_mask=None for empty sequences")
    if (mq, mkv) != (Lq, Lkv):
        crop = (f", or crop it with block_mask._adjust({Lq}, {Lkv}) (keeps its upper-left corner: right for causal, "
                f"sliding-window and prefix masks, not for masks measured from the end)" if mq >= Lq and mkv >= Lkv
                else "")
        bq, bkv = block_mask.BLOCK_SIZE
        if tuple(block_mask.kv_indices.shape[-2:]) == (cdiv(Lq, bq), cdiv(Lkv, bkv)) != (cdiv(mq, bq), cdiv(mkv, bkv)):
            crop = (f"; its blocks cover these lengths (a BlockMask sliced over q blocks keeps the original "
                    f"seq_lengths): if they are the ones meant, set block_mask.seq_lengths = ({Lq}, {Lkv})")
        _fail(f"block_mask was built for Q_LEN={mq}, KV_LEN={mkv} but query has length {Lq} and key {Lkv}; "
              f"build it with create_block_mask(mask_mod, B, H, {Lq}, {Lkv}, ...){crop}")
    bq, bkv = block_mask.BLOCK_SIZE
    nq, nkv = block_mask.kv_indices.shape[-2:]
    if nq != cdiv(Lq, bq) or nkv != cdiv(Lkv, bkv):
        if nq >= cdiv(Lq, bq) and nkv >= cdiv(Lkv, bkv):
            fix = (f"a mask whose tensors were made for longer sequences: crop it with block_mask._adjust({Lq}, "
                   f"{Lkv}) (keeps the upper-left corner)")
        elif nkv == cdiv(Lkv, bkv):  # (fewer q blocks alone: what a slice over q blocks leaves)
            fix = ("a BlockMask sliced over q blocks keeps the original seq_lengths: set block_mask.seq_lengths to "
                   "the lengths its blocks cover")
        else:
            fix = f"its tensors cover only {nq * bq} x {nkv * bkv} positions (a mask made for other lengths)"
        _fail(f"block_mask has {nq} x {nkv} blocks of {bq} x {bkv} "
              f"(kv_num_blocks / kv_indices) but its seq_lengths ({mq}, {mkv}) need {cdiv(Lq, bq)} x "
              f"{cdiv(Lkv, bkv)}: {fix}; or rebuild it with create_block_mask")
    # checked once per set of tensor shapes and strides (kept on the mask): 8 offset sums were half of a decode
    # call's validation (NOTES 59)
    def check_offsets():
        for name, t in zip(BlockMask._TENSOR_ATTRS, tensors):
            if t is not None and _max_offset(t.shape, t.stride()) >= INDEX_LIMIT:
                _fail(f"block_mask.{name} (shape {tuple(t.shape)}) is too large: the kernels index block-mask "
                      f"tensors in 32 bits (< 2**31 elements); build it with B=None / H=None where the mask is the "
                      f"same across batch / heads, or with a larger BLOCK_SIZE")
        return True
    # (keyed by what the check reads, not the tensors' ids: a copied or unpickled mask's, or a tensor reusing an id)
    kept_on(block_mask, "_index_checked",
            (INDEX_LIMIT, *(None if t is None else (t.shape, t.stride()) for t in tensors)), check_offsets)
    # what the kernels read, once per set of tensors and their in-place changes (a block mask's tensors are public and
    # torch's are taken as they are: an index past the sequence read other memory); the values on CPU only, where the
    # host read costs nothing (on CUDA it would be a device sync per block mask)
    kept_on(block_mask, "_contents_checked", tensors_key(tensors),
            lambda: check_block_tensors(block_mask, "flex_attention: block_mask", values=query.device.type == "cpu")
            or True)
    mb, mh = block_mask.kv_num_blocks.shape[:2]
    if mb not in (1, B):
        _fail(f"block_mask has batch size {mb} but query has {B}; build it with B={B} or B=None (broadcast)")
    if mh not in (1, Hq):
        _fail(f"block_mask has {mh} heads but query has {Hq}; build it with H={Hq} or H=None (broadcast)")
    if block_mask.kv_num_blocks.device != query.device:
        _fail(f"block_mask is on {block_mask.kv_num_blocks.device} but query is on {query.device}; build it "
              f"with device=query.device or call block_mask.to(query.device)")


def check_captured(captured, device: torch.device, caller: str, what: str = "a mod"):
    """The tensors a kernel will gather from (``captured`` by ``what``): on ``device`` (or host scalars, which
    the launchers move there), and within the 32-bit offsets used for tensors of fewer than 2**31 elements
    (larger ones are gathered with 64-bit offsets); else a ValueError saying what to do."""
    for t in captured:
        reach = _max_offset(t.shape, t.stride())
        if t.numel() < INDEX_LIMIT and reach >= INDEX_LIMIT:
            raise ValueError(f"{caller}: a tensor captured by {what} (shape {tuple(t.shape)}, strides {t.stride()}) "
                             f"reaches offset {reach}; flexlite's kernels gather from captured tensors of fewer than "
                             f"2**31 elements with 32-bit offsets: capture tensor.contiguous() instead")
    check_captured_device(captured, device, caller, what, "the kernel runs on")


@functools.lru_cache(maxsize=64)
def _all_full_blocks(Lq: int, Lkv: int, device: torch.device):
    """Block-sparse tensors of 'no mask': every kv block is full for every q block."""
    nq, nkv = cdiv(Lq, DEFAULT_SPARSE_BLOCK), cdiv(Lkv, DEFAULT_SPARSE_BLOCK)
    zeros = torch.zeros((1, 1, nq), dtype=torch.int32, device=device)
    idx = torch.arange(nkv, dtype=torch.int32, device=device).expand(1, 1, nq, nkv).contiguous()
    return zeros, idx, torch.full_like(zeros, nkv), idx, (DEFAULT_SPARSE_BLOCK, DEFAULT_SPARSE_BLOCK)


def _block_tensors(block_mask, Lq, Lkv, device):
    if block_mask is None:
        return _all_full_blocks(Lq, Lkv, device)
    return (block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
            block_mask.full_kv_indices, tuple(block_mask.BLOCK_SIZE))


def _use_tma(options: dict) -> Optional[bool]:
    """kernel_options USE_TMA, or None: each launcher's default (:func:`flexlite.runtime.launch.default_use_tma`,
    the decode tiles' setting)."""
    return bool(options["USE_TMA"]) if "USE_TMA" in options else None


def _float_index(template: str, Lq: int, Lkv: int) -> bool:
    """Whether a kernel lowers index arithmetic that ends in float32 from float index vectors
    (:class:`flexlite.codegen.lower._Lowerer`): the forwards only (ALiBi's Triton forward measured faster,
    benchmarks/NOTES.md 28; the warp-specialized one's loop is 4 % shorter offline, not timed alone, NOTES 48; the
    backward measured slower and decoding reads memory), and only while positions are exact in float32."""
    return template in ("fwd.py.jinja", "fwd_ws.py.jinja") and max(Lq, Lkv) <= FLOAT32_EXACT_INT


def _split_partial(kernel: GeneratedKernel, query: torch.Tensor, value: torch.Tensor,
                   mask_gathers: Optional[bool] = None) -> bool:
    """Whether the forward walks its partial blocks half a tile at a time: on CUDA at head dims padded to 128, where
    the mask's compares made the 128x64 partial tile spill; measured 2 % faster for causal and prefix-LM masks and
    slower when a mod reads captured tensors (ALiBi, softcap, document masks: NOTES 37). ``mask_gathers``:
    :func:`_mask_gathers` (default: whether the kernel's mask_mod reads captured tensors)."""
    if mask_gathers is None:
        mask_gathers = bool(kernel.mask_mod.tensors)
    return (query.is_cuda and not kernel.has_score_mod and not mask_gathers
            and max(head_dim_pad(query.shape[-1]), head_dim_pad(value.shape[-1])) == 128)


def _mask_gathers(kernel: GeneratedKernel, block_mask) -> bool:
    """Whether the mask_mod the tiles are chosen for reads captured tensors: the kernel's, or for the bits of a new
    mask_mod's first calls (:class:`first_calls.BitsMask`) the original's, so that those walk as its own kernels do."""
    return block_mask.gathers if isinstance(block_mask, first_calls.BitsMask) else bool(kernel.mask_mod.tensors)


class _FirstCall:
    """A call's part in :mod:`flexlite.first_calls`. ``key``: the kernels it launches (pass, sources, signature);
    ``bits``: the :class:`first_calls.BitsMask` to run the call with instead, where its own kernels are not compiled
    yet and the bits' are (its own then compile in the worker), else None. :meth:`done`, after the call: its kernels
    are compiled, and the worker compiles the bits' for the next mask_mod if they are not (and ``other_bits``', (key,
    compile) pairs: the bits' kernels that a later mask_mod's walk may choose instead, :func:`_forward`). ``eager``:
    whether the call may run in torch ops (:mod:`flexlite.eager`); it does (:attr:`eager`) where no bits serve it and
    its kernels are not compiled, which the worker then compiles (and the bits', for the next mask_mod)."""

    def __init__(self, key: tuple, run: Callable, new: bool, bits=None, bits_key: Optional[tuple] = None,
                 of_bits: bool = False, other_bits: tuple = (), eager: bool = False):
        self.key, self._run, self._bits, self._bits_key, self._of_bits, self._other_bits, self.bits = \
            key, run, bits, bits_key, of_bits, other_bits, None
        self.new = new  # (its kernels to be compiled in this call or beside it)
        self.eager = False  # (the call runs in torch ops, flexlite.eager, while its kernels compile beside it)
        if (bits_key is not None and first_calls.ready(bits_key, on_disk=True) and not _launch.compiling_only()
                and first_calls.compile_beside(key, lambda: run(None))):
            self.bits = bits
            first_calls.count_bits_call()
            self._compile_other_bits()  # (the call runs the bits: done() is not called)
        elif new and eager and not first_calls.failed(key):
            self.eager = True  # (its kernels then compile beside: compile_beside, after the torch ops)

    def compile_beside(self):
        """An eager call's kernels (and the bits', for the next mask_mod) to the worker: after the call's torch ops,
        which would wait for the GIL while the worker runs the compile's Python (benchmarks/NOTES.md 78)."""
        first_calls.compile_beside(self.key, lambda: self._run(None))
        if self._bits_key is not None and not first_calls.ready(self._bits_key, on_disk=True):
            first_calls.compile_beside(self._bits_key, lambda: self._run(self._bits), persist=True)
            self._compile_other_bits()

    def done(self):
        if self.new:  # the bits' kernels serve every later mask_mod, in later processes too (Triton's disk cache)
            first_calls.mark_ready(self.key, persist=self._of_bits)
        if self._bits_key is not None and self.bits is None and not _launch.compiling_only():
            first_calls.compile_beside(self._bits_key, lambda: self._run(self._bits), persist=True)
            self._compile_other_bits()

    def _compile_other_bits(self):
        for key, compile_ in self._other_bits:
            if not first_calls.ready(key, on_disk=True):
                first_calls.compile_beside(key, compile_, persist=True)


def _first_call(kind: str, sources: tuple, query, key, value, block_mask, options, gathers: bool,
                bits_sources: Callable, run: Callable, *extra, other_bits: Optional[Callable] = None,
                with_bits: bool = True) -> Optional[_FirstCall]:
    """The :class:`_FirstCall` of a call (``kind``: "fwd" or "bwd") whose kernels have ``sources``, or None where
    :func:`first_calls.applies` says no. ``gathers``: whether its mask_mod reads captured tensors;
    ``bits_sources(bits)``: the sources of the kernels the call would run with block mask ``bits``; ``run(bits)``:
    the call with ``bits`` (None: with its own block mask), for the worker (which compiles only); ``extra``: what
    else picks the kernels (:func:`first_calls.signature`); ``other_bits(bits)``: (sources, compile) pairs of the
    bits' kernels another block mask of this kind of input may take instead (:func:`_forward`); ``with_bits``:
    whether the bits may serve the call (not a backward adding captured tensors' gradients). With
    :data:`first_calls.EAGER`, a call whose kernels are new, or still compiling in the worker, and that no bits serve
    runs in torch ops (:mod:`flexlite.eager`) instead of waiting for them; not under
    ``torch.use_deterministic_algorithms(True)``, where every call gives the kernels' results."""
    if not first_calls.applies(query, block_mask, options):
        return None
    sig = first_calls.signature(query, key, value, block_mask, *extra)
    own = (kind, sources, sig)
    if first_calls.ready(own):  # (a call of known kernels: one set lookup)
        return _FirstCall(own, run, False)
    eager = (first_calls.EAGER and not _launch.compiling_only() and not isinstance(block_mask, first_calls.BitsMask)
             and not torch.are_deterministic_algorithms_enabled() and _eager.fits(query, key, value))
    if not _launch.compiling_only() and not (eager and first_calls.pending(own)):
        first_calls.wait_for(own)  # (the worker compiling this call's kernels already: a backward's, say)
    new = not first_calls.ready(own)
    if (not new or not with_bits or block_mask is None or block_mask.mask_mod is None
            or isinstance(block_mask, first_calls.BitsMask) or _launch.compiling_only()):  # (no bits without a mask_mod)
        return _FirstCall(own, run, new, of_bits=isinstance(block_mask, first_calls.BitsMask), eager=eager)
    try:
        bits = first_calls.bits_mask(block_mask, query.shape[0], query.shape[1], gathers)
    except Exception:  # noqa: BLE001 - the bits are a shortcut: without them the call compiles its own, as it must
        bits = None
    if bits is None:
        return _FirstCall(own, run, True, eager=eager)
    others = tuple(((kind, other, sig), compile_) for other, compile_ in (other_bits(bits) if other_bits else ()))
    return _FirstCall(own, run, True, bits, (kind, bits_sources(bits), sig), other_bits=others, eager=eager)


def _run_eager(first: _FirstCall, run: Callable, *args):
    """``run(*args)`` (a pass of :mod:`flexlite.eager`), or None where it raised (a mod torch cannot vmap, or too
    little memory): the call then waits for its kernels, whose errors say what is wrong with a mod."""
    try:
        result = run(*args)
    except Exception:  # noqa: BLE001 - the torch ops are a shortcut; the kernels' path reports what is wrong
        result = None
    first.compile_beside()
    if result is None:
        first_calls.wait_for(first.key)
        return None
    first_calls.count_eager_call()
    return result


def _mask_forms() -> dict:
    """generate's and generate_backward's settings of the forms mask_mod's terms take (launch.DECIDE_MASK_TERMS,
    DECIDE_REWRITE_TERMS)."""
    return dict(decide_mask_terms=_launch.DECIDE_MASK_TERMS, decide_rewrite=_launch.DECIDE_REWRITE_TERMS)


def _generate(score_mod, block_mask, device: torch.device, template: str = "fwd.py.jinja",
              float_index: bool = False, dtype: Optional[torch.dtype] = None,
              max_scores: bool = False, traced: tuple = (None, None), lengths: tuple = (0, 0)) -> GeneratedKernel:
    """``dtype`` (the inputs') and ``max_scores``: the warp-specialized forward runs a bounded score_mod against its
    bound (launch.WS_FWD_BOUNDED_SOFTMAX) for bfloat16 inputs without max_scores only (fp16's P would lose the small
    weights; max_scores need the running row max). ``traced``: the mods' traces where this call has them
    (:func:`_validate`), used in place of the mods. ``lengths``: (Lq, Lkv), which pick the dense walk's LLVM levels
    (launch.dense_lengths_even)."""
    mask_mod = block_mask.mask_mod if block_mask is not None else None
    score_mod, mask_mod = traced[0] or score_mod, traced[1] or mask_mod
    return generate(template, score_mod, mask_mod, interpret=device.type != "cuda", float_index=float_index,
                    fold_scales=_launch.FOLD_SCORE_SCALES and template in ("fwd.py.jinja", "fwd_ws.py.jinja"),
                    key_values=_launch.WS_FWD_KEY_VALUES,
                    separate=_launch.SEPARATE_SCORE_BIAS, affine_keys=_launch.AFFINE_KEY_BIAS,
                    compact_bias_dims=_launch.WS_FWD_COMPACT_BIAS_HEAD_DIMS,
                    affine_bias_dims=_launch.WS_FWD_AFFINE_BIAS_HEAD_DIMS, **_mask_forms(),
                    bounded=_launch.WS_FWD_BOUNDED_SOFTMAX and dtype == torch.bfloat16 and not max_scores,
                    llvm_opt_levels=(_launch.WS_FWD_LLVM_OPT_LEVELS if block_mask is not None
                                     or _launch.dense_lengths_even(*lengths)
                                     else _launch.WS_FWD_DENSE_RAGGED_LLVM_OPT_LEVELS),
                    poly_exp2=_launch.WS_FWD_POLY_EXP2,
                    bounded_poly_exp2=_launch.WS_FWD_POLY_EXP2_BOUNDED)  # (generate keeps each for its templates)


_PASSES = {"forward": "fwd.py.jinja", "forward_ws": "fwd_ws.py.jinja", "decode": "decode.py.jinja",
           "backward": "bwd.py.jinja", "backward_ws": "bwd_ws.py.jinja"}


def kernel_source(score_mod: Optional[Callable] = None, block_mask=None, *, device=None,
                  kernel: str = "forward", dtype: torch.dtype = torch.bfloat16) -> str:
    """The generated Triton source flex_attention runs for these mods (also written to the kernel cache;
    ``FLEXLITE_SHOW_KERNELS=1`` prints each kernel as it is first loaded).

    ``kernel``: ``"forward"``, ``"forward_ws"`` (the warp-specialized Gluon forward flex_attention runs on Hopper
    where it can: CUDA only), ``"decode"`` (queries <= 64), ``"backward"`` (without captured-tensor
    gradients) or ``"backward_ws"`` (the warp-specialized Gluon dK / dV and dQ kernel: CUDA only). ``device``
    picks the CUDA or the interpreter (CPU) variant; by default the block mask's device, else CUDA when available.
    ``dtype``: the inputs' (the warp-specialized forward runs a bounded score_mod such as softcap against its bound
    for bfloat16 inputs only, and for calls without max_scores).
    """
    if kernel not in _PASSES:
        raise ValueError(f"kernel_source: kernel must be one of {sorted(_PASSES)}; got {kernel!r}")
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"kernel_source: dtype must be torch.bfloat16, torch.float16 or torch.float32 (the inputs' "
                         f"dtype); got {dtype!r}")
    if score_mod is not None:
        check_arity(score_mod, "score_mod", caller="kernel_source")
        check_mod_output(score_mod, "score_mod", "kernel_source")
    if is_torch_block_mask(block_mask):
        block_mask = from_torch_block_mask(block_mask)
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise TypeError(f"kernel_source: block_mask must be a BlockMask (flexlite's or torch's) or None; got "
                            f"{type(block_mask).__name__}")
        if block_mask.mask_mod is not None:
            check_mod_output(block_mask.mask_mod, "mask_mod", "kernel_source")
    if device is None and block_mask is not None:
        device = block_mask.kv_num_blocks.device
    device = check_device("kernel_source", device, available=False)  # CUDA source can be read without a GPU
    if kernel.endswith("_ws") and device.type != "cuda":
        raise ValueError(f"kernel_source: the warp-specialized kernels (kernel={kernel!r}) have a CUDA variant only "
                         f"(Triton's interpreter cannot run Gluon); got device={str(device)!r}: pass device='cuda'")
    if kernel.startswith("backward"):
        mask_mod = block_mask.mask_mod if block_mask is not None else None
        return generate_backward(score_mod, mask_mod, interpret=device.type != "cuda", template=_PASSES[kernel],
                                 query_values=_launch.WS_BWD_QUERY_VALUES,
                                 llvm_opt_levels=_launch.WS_BWD_LLVM_OPT_LEVELS,
                                 **_mask_forms()).source
    lengths = block_mask.seq_lengths if block_mask is not None else (0, 0)
    return _generate(score_mod, block_mask, device, _PASSES[kernel], _float_index(_PASSES[kernel], *lengths),
                     dtype=dtype, lengths=lengths).source


def kernel_path(score_mod: Optional[Callable] = None, block_mask=None, *, device=None,
                kernel: str = "forward", dtype: torch.dtype = torch.bfloat16) -> str:
    """Path of the file holding :func:`kernel_source` for these mods."""
    return str(write_source(kernel_source(score_mod, block_mask, device=device, kernel=kernel, dtype=dtype)))


class _ForwardPlan(NamedTuple):
    """What :func:`_forward` decided for a kind of call (:func:`_plan_key`) once its kernels were compiled: a later
    call of that kind goes straight to :func:`_run_forward` (the warp-specialized walk's choice, the decode kernel's,
    the kernel's source, the first_calls bookkeeping: ~120 us a call on the H200 machine's host, NOTES 102)."""

    ws: bool
    rows: int
    template: str
    kernel: GeneratedKernel
    mask_gathers: bool

    def same(self, other: "_ForwardPlan") -> bool:
        return (self[:3] == other[:3] and self.mask_gathers == other.mask_gathers
                and self.kernel.source == other.kernel.source
                and [id(t) for t in self.kernel.captured] == [id(t) for t in other.kernel.captured])


class _Plans:
    """The plans of one block mask's calls (or the dense walk's): per score_mod trace, held weakly (a plan's kernel
    holds the trace's captured tensors: they go with the trace, as a mod made anew each step is), and those of calls
    without a score_mod."""

    def __init__(self):
        self.by_trace: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self.plain: dict = {}

    def of(self, score_trace) -> dict:
        if score_trace is None:
            return self.plain
        plans = self.by_trace.get(score_trace)
        if plans is None:
            plans = self.by_trace[score_trace] = {}
        return plans


# per block mask (held weakly: the plans go with it), and for the dense walk, the plans of their calls
_FORWARD_PLANS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_DENSE_PLANS = _Plans()
_MAX_PLANS = 64  # per block mask and score_mod (and for the dense walk): beyond it they are dropped and made again
# every call with a plan decided again and compared with it (a RuntimeError where they differ): the tests set it
CHECK_PLANS = env_flag("FLEXLITE_CHECK_PLANS")


def _plan_key(query, key, value, score_mod, block_mask, kernel_options, extra: tuple, traced: tuple):
    """What :func:`_forward`'s (and :func:`_backward`'s) decisions read: the inputs' shapes, strides, dtype, device
    and 16-byte alignment (the Gluon kernels' tensor descriptors), the mask_mod's trace (a new object where what it
    captures is rebound; score_mod's trace keys the dict the plan is kept in, :func:`_plans`), the block mask's kv
    lists (their ids and in-place versions), block size and lengths, kernel_options, ``extra`` (the pass's own: the
    forward's max_scores), the launch settings' generation (:data:`launch.GENERATION`), first_calls' switch and its
    set of compiled kernels (a new set: a test's fresh start), and autotuning (an environment variable); None where
    the options do not hash or a score_mod is not traced."""
    if traced[0] is None and score_mod is not None:  # (a score_mod the call did not trace: no plan)
        return None
    try:
        options = tuple(kernel_options.items()) if kernel_options else ()
        hash(options)
    except TypeError:
        return None
    mask_mod = None if block_mask is None else block_mask.mask_mod
    return (query.shape, query.stride(), key.shape, key.stride(), value.shape, value.stride(), query.dtype,
            query.device, (query.data_ptr() | key.data_ptr() | value.data_ptr()) & 15,
            mask_mod if traced[1] is None else traced[1],
            None if block_mask is None else (lists_key(block_mask), tuple(block_mask.BLOCK_SIZE),
                                             tuple(block_mask.seq_lengths)),
            options, extra, _launch.GENERATION, first_calls.ENABLED, id(first_calls._ready),
            autotune_enabled(kernel_options or {}))


def _plans(block_mask, score_trace) -> dict:
    """The plans of calls with ``block_mask`` (None: the dense walk's) and score_mod trace ``score_trace`` (None:
    without a score_mod, or one not traced by the call)."""
    if block_mask is None:
        return _DENSE_PLANS.of(score_trace)
    plans = _FORWARD_PLANS.get(block_mask)
    if plans is None:
        plans = _FORWARD_PLANS[block_mask] = _Plans()
    return plans.of(score_trace)


# warp-specialized forward sources that Triton failed to compile (Triton 3.6's Gluon lowering fails, for one, on a
# score_mod that gathers a whole tile from a captured tensor, bias[h, q_idx, kv_idx]) or to fit in this GPU's shared
# memory: their mods run the Triton forward
_WS_UNCOMPILABLE: set = set()


def _forward(query, key, value, score_mod, block_mask, scale, kernel_options, max_scores: bool = False,
             traced: tuple = (None, None)):
    """(out, lse, row maxima or None): ``max_scores`` (return_aux) takes the Triton forward or the decode kernel,
    which store them, and the warp-specialized one only where :data:`launch.WS_FWD_MAX_SCORES` allows. ``traced``:
    as :func:`_generate`'s."""
    B, Hq, Lq, E = query.shape
    Lkv = key.shape[2]
    if B * Hq * Lq == 0 or Lkv == 0:
        out = query.new_zeros((B, Hq, Lq, value.shape[-1]))
        lse = torch.full((B, Hq, Lq), float("-inf"), dtype=_eager.compute_dtype(query.dtype), device=query.device)
        return out, lse, lse.clone() if max_scores else None
    eager_mod, eager_mask = _traced_or_live(score_mod, block_mask, traced)
    if query.dtype == torch.float64:  # no kernel takes float64: torch ops, as torch's flex_attention's math path
        return _eager.forward(query, key, value, eager_mod, eager_mask, scale, max_scores, limit=False)
    options = kernel_options or {}
    if max_scores and not _launch.WS_FWD_MAX_SCORES:
        options = {**options, "WARP_SPECIALIZE": False}
    num, idx, full_num, full_idx, sparse = _block_tensors(block_mask, Lq, Lkv, query.device)
    compiling = _launch.compiling_only()
    plan_key = None if compiling else _plan_key(query, key, value, score_mod, block_mask, kernel_options,
                                                (max_scores,), traced)
    plan = None if plan_key is None else _plans(block_mask, traced[0]).get(plan_key)
    if plan is not None and not CHECK_PLANS:
        check_captured(plan.kernel.captured, query.device, "flex_attention")
        return _run_forward(plan.kernel, plan.template, plan.ws, plan.rows, plan.mask_gathers, query, key, value,
                            score_mod, block_mask, scale, options, max_scores, traced, num, idx, full_num, full_idx,
                            sparse)
    ws = _warp_specialize(query, key, value, block_mask, num, sparse, options)
    rows = 0 if ws else _decode_rows(query, key, num, sparse, options)
    template = "fwd_ws.py.jinja" if ws else "decode.py.jinja" if rows else "fwd.py.jinja"
    kernel = _generate(score_mod, block_mask, query.device, template, _float_index(template, Lq, Lkv),
                       dtype=query.dtype, max_scores=max_scores, traced=traced, lengths=(Lq, Lkv))
    if ws and kernel.source in _WS_UNCOMPILABLE and not options.get("WARP_SPECIALIZE"):
        return _forward(query, key, value, score_mod, block_mask, scale, {**options, "WARP_SPECIALIZE": False},
                        max_scores, traced)
    check_captured(kernel.captured, query.device, "flex_attention")
    mask_gathers = _mask_gathers(kernel, block_mask)

    def bits_sources(bits, template=template):
        return (_generate(score_mod, bits, query.device, template, _float_index(template, Lq, Lkv), dtype=query.dtype,
                          max_scores=max_scores, traced=(traced[0], None), lengths=(Lq, Lkv)).source,)

    def other_bits(bits):  # where the walk picks the forward, a later mask_mod's may pick the other (NOTES 77)
        if _warp_specialize_fixed(query, key, value, num, sparse, options) is not None:
            return ()
        other = "fwd.py.jinja" if ws else "fwd_ws.py.jinja"
        return ((bits_sources(bits, other), lambda: _compile_call(query, key, value, bits, scale, max_scores,
                                                                  (traced[0], None), {"WARP_SPECIALIZE": not ws},
                                                                  backward=False)),)
    first = _first_call(
        "fwd", (kernel.source,), query, key, value, eager_mask, kernel_options, mask_gathers, bits_sources,
        lambda bits: _compile_call(query, key, value, bits or block_mask, scale, max_scores,
                                   (traced[0], None) if bits else traced),
        max_scores, other_bits=other_bits)
    if first is not None and first.bits is not None:  # a new mask_mod's first calls: its kernel compiles beside
        return _forward(query, key, value, score_mod, first.bits, scale, kernel_options, max_scores,
                        (traced[0], None))
    if first is not None and first.eager:  # in torch ops while the kernels compile beside
        result = _run_eager(first, _eager.forward, query, key, value, eager_mod, eager_mask, scale, max_scores)
        if result is not None:
            return result
    if first is not None and first.new and not compiling:
        _compile_backward_beside(query, key, value, score_mod, block_mask, scale, traced, sparse)
    decided = _ForwardPlan(ws, rows, template, kernel, mask_gathers)
    if plan is not None and not plan.same(decided):  # (CHECK_PLANS: the plan's key misses something decisions read)
        raise RuntimeError(f"flexlite: the forward plan kept for this kind of call ({plan[:3]}, mask gathers "
                           f"{plan.mask_gathers}) differs from what the call decides ({decided[:3]}, "
                           f"{decided.mask_gathers}; sources equal: {plan.kernel.source == kernel.source})")
    result = _run_forward(kernel, template, ws, rows, mask_gathers, query, key, value, score_mod, block_mask, scale,
                          options, max_scores, traced, num, idx, full_num, full_idx, sparse)
    if first is not None:
        first.done()
    if plan is None:
        _keep_plan(plan_key, block_mask, traced[0], first, query, decided)
    return result


def _keep_plan(plan_key, block_mask, score_trace, first: Optional[_FirstCall], query, plan) -> None:
    """``plan`` kept for the calls of ``plan_key`` (None: none kept) once the call's kernels are compiled (not a first
    call's), and not from a CUDA graph capture's decisions (made without reading the block mask on the host)."""
    if (plan_key is None or (first is not None and (first.new or first.eager))
            or (query.is_cuda and torch.cuda.is_current_stream_capturing())):
        return
    plans = _plans(block_mask, score_trace)
    if len(plans) >= _MAX_PLANS:
        plans.clear()
    plans[plan_key] = plan


def _compile_backward_beside(query, key, value, score_mod, block_mask, scale, traced, sparse):
    """Before a forward that compiles its kernels (a new mod's first call), its backward's compile in the first_calls
    worker, where the inputs require grad: the two compile at once (most of Triton's compile runs outside the GIL),
    and the first backward waits for what is left of its own instead of compiling from the start (NOTES 66, 72). The
    backward compiles for stand-ins of the forward's out and LSE (the same dtypes, shapes and strides). Not where
    captured tensors require grad (their backward kernels add gradients)."""
    if not (query.requires_grad or key.requires_grad or value.requires_grad) or _captured_requiring_grad(traced[0]):
        return
    interpret = query.device.type != "cuda"
    mask_mod = traced[1] or (block_mask.mask_mod if block_mask is not None else None)
    mods = [trace_mod(mod, kind) if mod is not None else None
            for mod, kind in ((traced[0] or score_mod, "score_mod"), (mask_mod, "mask_mod"))]
    try:
        kernel, ws_kernel = _backward_kernels(mods, query, key, value, sparse, {}, interpret)
    except Exception:  # noqa: BLE001 - a backward that cannot be generated (an op without a derivative rule) fails
        return  # when it is called, with its own error; the forward must not
    B, Hq, Lq, _ = query.shape
    out = query.new_empty((B, Hq, Lq, value.shape[-1]))
    lse = torch.empty((B, Hq, Lq), dtype=torch.float32, device=query.device)
    bwd_key = ("bwd", (kernel.source, ws_kernel and ws_kernel.source),
               first_calls.signature(query, key, value, block_mask, query.requires_grad, False,
                                     first_calls.int_classes(*out.stride())))  # (grad_out laid out as out)
    first_calls.compile_beside(bwd_key, lambda: _backward(query, key, value, out, lse, out, None, mods[0], block_mask,
                                                           scale, None, (), need_dq=query.requires_grad,
                                                           need_captured=()))


def _compile_call(query, key, value, block_mask, scale, max_scores, traced, kernel_options=None, backward=True):
    """A call's forward (with ``kernel_options``) and, where its inputs require grad and ``backward``, backward, for
    the first_calls worker (inside launch.compile_only: the kernels compile, nothing runs). ``traced``: the mods'
    traces (score_mod's, and block_mask's mask_mod's or None), made on the calling thread (the worker may not
    trace)."""
    out, lse, _ = _forward(query, key, value, traced[0], block_mask, scale, kernel_options, max_scores, traced)
    if backward and (query.requires_grad or key.requires_grad or value.requires_grad):
        _backward(query, key, value, out, lse, out, None, traced[0], block_mask, scale, None, (),
                  need_dq=query.requires_grad, need_captured=())


def _run_forward(kernel, template, ws, rows, mask_gathers, query, key, value, score_mod, block_mask, scale, options,
                 max_scores, traced, num, idx, full_num, full_idx, sparse):
    """:func:`_forward`'s launch of ``kernel``."""
    # also when decoding if tiles are pinned, so that bad pins are reported even where decoding ignores them
    if not (rows or ws) or any(k in options for k in CONFIG_KEYS):
        config = forward_config(query, value, sparse, options, gathers=mask_gathers)
    module = load_module(kernel.source, interpret=query.device.type != "cuda")
    if scale <= 0 and not kernel.has_score_mod:
        # without a score_mod the kernels scale after the row max (and after masking with -inf), which needs a
        # positive scale: the sign goes onto the query, a zero scale becomes query * 0 (NaN / inf still spread)
        query, scale = (-query, -scale) if scale < 0 else (query * 0.0, 1.0)
    if rows:
        return launch_decode(module, kernel.mod_args(), query, key, value, num, idx, full_num, full_idx, sparse,
                             scale, kernel.has_score_mod, rows, options.get("DECODE_SPLITS"),
                             use_tma=_use_tma(options), max_scores=max_scores)
    if ws:
        try:
            # (the three consumer warpgroups of launch.WS_FWD_WIDE_TILES where they fit)
            wide = True if block_mask is None else _wide_items(block_mask, query.shape[-1])
            return launch_forward_ws(module, kernel.mod_args(), query, key, value, num, idx, full_num, full_idx,
                                     sparse, scale, kernel.has_score_mod, dense=block_mask is None,
                                     max_scores=max_scores, wide=wide)
        except Exception as e:  # noqa: BLE001 - only compiler failures are handled, the rest re-raised
            if not is_compile_error(e):
                raise
            if options.get("WARP_SPECIALIZE"):
                raise NotImplementedError(f"flex_attention: kernel_options WARP_SPECIALIZE=True, but Triton cannot "
                                          f"compile or fit the warp-specialized forward with these mods on this GPU "
                                          f"({type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}); leave "
                                          f"WARP_SPECIALIZE unset to run the Triton forward") from e
            _WS_UNCOMPILABLE.add(kernel.source)  # Triton's forward from now on (see the check above)
            return _forward(query, key, value, score_mod, block_mask, scale, {**options, "WARP_SPECIALIZE": False},
                            max_scores, traced)
    return launch_forward(module, kernel.mod_args(), query, key, value, num, idx, full_num, full_idx,
                          sparse, scale, kernel.has_score_mod, config, pinned=any(k in options for k in CONFIG_KEYS),
                          tune=autotune_enabled(options),
                          use_tma=_use_tma(options), dense=block_mask is None,
                          split_partial=_split_partial(kernel, query, value, mask_gathers), max_scores=max_scores)


def _all_full_q_blocks(Lq: int, Lkv: int, device: torch.device):
    """The q side of :func:`_all_full_blocks`: every q block is full for every kv block (the kv side with
    the lengths swapped)."""
    return _all_full_blocks(Lkv, Lq, device)[:4]


def _q_block_tensors(block_mask, Lq, Lkv, device):
    if block_mask is None:
        return _all_full_q_blocks(Lq, Lkv, device)
    q_side = (block_mask.q_num_blocks, block_mask.q_indices, block_mask.full_q_num_blocks, block_mask.full_q_indices)
    if q_side[1] is None or (block_mask.full_kv_indices is not None and q_side[3] is None):
        # built without its q side (from_kv_blocks(compute_q_blocks=False), torch's BlockMask): transposed here, once
        # per kv side (kept on the mask, not redone every backward)
        kv_side = (block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
                   block_mask.full_kv_indices)
        q_side = kept_on(block_mask, "_transposed_q_side", tensors_key(kv_side), lambda: q_sides(*kv_side))
    return q_side


def _captured_requiring_grad(score_mod) -> tuple:
    """Tensors captured by score_mod (a callable or its trace) that require grad: extra inputs of
    FlexAttentionFunction, so that autograd hands them their gradients. (mask_mod's captures get none: masks are not
    differentiable.)"""
    if score_mod is None or not torch.is_grad_enabled():
        return ()
    return tuple(t for t in trace_mod(score_mod, "score_mod").captured.values() if t.requires_grad)


def _deterministic_captured_grads(kernel_options: dict) -> bool:
    """Whether captured-tensor gradients take the deterministic path: ``kernel_options`` says so
    (``DETERMINISTIC_CAPTURED_GRADS``), else ``FLEXLITE_DETERMINISTIC_CAPTURED_GRADS=1`` or
    ``torch.use_deterministic_algorithms(True)``."""
    if "DETERMINISTIC_CAPTURED_GRADS" in kernel_options:
        return bool(kernel_options["DETERMINISTIC_CAPTURED_GRADS"])
    return env_flag("FLEXLITE_DETERMINISTIC_CAPTURED_GRADS") or torch.are_deterministic_algorithms_enabled()


@contextlib.contextmanager
def _deterministic_algorithms():
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


# score positions per chunk when captured-tensor gradients are computed from the dense dS
_DS_CHUNK_ELEMENTS = 2 ** 24


def _captured_grads_from_ds(score_mod, query, key, scale, ds, captured) -> list:
    """Deterministic gradients of ``captured`` from dS [B, Hq, Lq, Lkv] (d loss / d score_mod output):
    score_mod re-runs in torch over the recomputed fp32 scores (vmap, as the reference does: flexlite.eager's), a
    chunk of query rows at a time, and autograd backpropagates dS; the chunks are summed in order."""
    B, Hq, Lq, _ = query.shape
    k = key.detach().float()
    rows = max(1, _DS_CHUNK_ELEMENTS // max(1, B * Hq * key.shape[2]))
    total = [torch.zeros(c.shape, dtype=c.dtype, device=c.device) for c in captured]
    with torch.enable_grad(), _deterministic_algorithms():
        for start in range(0, Lq, rows):
            q = query.detach()[:, :, start:start + rows].float()
            raw, out = _eager.scores(q, k, Hq // key.shape[1], scale, score_mod, start, 0)
            _, grads = _eager.through_score_mod(raw, out, ds[:, :, start:start + rows].to(out.dtype), captured,
                                                score_mod, start, 0)
            total = [t + g.to(t.dtype) for t, g in zip(total, grads)]
    return total


def _with_mask_mod(block_mask, mask_mod):
    """``block_mask`` (flexlite's or torch's) with ``mask_mod`` (a call's trace of its own) in its place, for what
    evaluates the mask in torch (the torch ops, a first call's bits): a shallow copy, its tensors the same, kept on
    the mask for that trace (the forward and its backwards share it, and the bits kept on it)."""
    if block_mask is None or mask_mod is None or block_mask.mask_mod is mask_mod:
        return block_mask

    def make():
        copied = copy.copy(block_mask)
        copied.mask_mod = mask_mod
        vars(copied).pop("_traced_copy", None)  # (not the last trace's copy: no chain of them)
        return copied
    return kept_on(block_mask, "_traced_copy", (mask_mod,), make)


def _traced_or_live(score_mod, block_mask, traced: tuple) -> tuple:
    """(score_mod, block_mask) for the torch ops and the bits: the call's traces where it has them (what its kernels
    and its backward run, whatever the callables have become since), else the mods as given."""
    return traced[0] or score_mod, _with_mask_mod(block_mask, traced[1])


def _backward(query, key, value, out, lse, grad_out, grad_lse, score_mod, block_mask, scale, kernel_options,
              captured, need_dq: bool, need_captured: tuple, traced_mods: Optional[tuple] = None):
    """dq, dk, dv (input dtypes; dq None unless ``need_dq``) and the gradients of ``captured``. ``traced_mods``: the
    traces of score_mod and of the block mask's mask_mod where the caller has them (the forward's: every path here
    runs them, the torch ops too, not the callables as they are now; None: traced here)."""
    B, Hq, Lq, _ = query.shape
    Lkv = key.shape[2]
    want = [t for t, need in zip(captured, need_captured) if need]
    if (grad_out is None and grad_lse is None) or B * Hq * Lq == 0 or Lkv == 0:
        return (torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value),
                [torch.zeros_like(t) for t in captured])
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    elif first_calls.int_classes(*grad_out.stride()) != first_calls.int_classes(*out.stride()):
        # (an expanded grad, out.sum()'s, or rows apart by other than a multiple of 16: copied as out is laid out, so
        # that the kernels compiled beside the forward for that layout serve it, where Triton would compile others)
        grad_out = grad_out.contiguous()
    mask_mod = block_mask.mask_mod if block_mask is not None else None
    # traced once for both kernels' generation (each trace fingerprints the mod's captures)
    traced = list(traced_mods) if traced_mods is not None else [
        trace_mod(mod, kind) if mod is not None else None for mod, kind in ((score_mod, "score_mod"),
                                                                             (mask_mod, "mask_mod"))]
    score_mod, traced_mask = _traced_or_live(score_mod, block_mask, traced)  # (the torch ops', the bits')
    if query.dtype == torch.float64:  # (as its forward: torch ops)
        return _wanted(_eager.backward(query, key, value, out, grad_out, grad_lse, score_mod, traced_mask,
                                       scale, tuple(want), limit=False), need_captured)
    interpret = query.device.type != "cuda"
    options = kernel_options or {}
    deterministic = bool(want) and _deterministic_captured_grads(options)
    scatter = () if deterministic else tuple(want)
    *kv_blocks, sparse = _block_tensors(block_mask, Lq, Lkv, query.device)
    # (a plan: the kernels of a kind of call whose kernels are compiled, as the forward's; not with captured gradients)
    grad_classes = first_calls.int_classes(*grad_out.stride())
    plan_key = None if want or _launch.compiling_only() else _plan_key(
        query, key, value, traced[0], block_mask, kernel_options, ("bwd", need_dq, grad_lse is None, grad_classes),
        traced)
    plan = None if plan_key is None else _plans(block_mask, traced[0]).get(plan_key)
    if plan is not None and not CHECK_PLANS:
        kernel, ws_kernel = plan
        check_captured(kernel.captured, query.device, "flex_attention")
        return _run_backward(kernel, ws_kernel, None, query, key, value, out, lse, grad_out, grad_lse, score_mod,
                             block_mask, scale, options, need_dq, need_captured, want, scatter, deterministic,
                             kv_blocks, sparse)
    kernel, ws_kernel = _backward_kernels(traced, query, key, value, sparse, options, interpret, scatter,
                                          deterministic)
    if plan is not None and (plan[0].source, plan[1] and plan[1].source) != (kernel.source,
                                                                             ws_kernel and ws_kernel.source):
        raise RuntimeError("flexlite: the backward plan kept for this kind of call names other kernels than the call "
                           "generates (CHECK_PLANS: its key misses something the decisions read)")
    check_captured(kernel.captured, query.device, "flex_attention")
    first = None if deterministic else _first_call(  # (captured gradients: no bits, which add none)
        "bwd", (kernel.source, ws_kernel and ws_kernel.source), query, key, value, traced_mask, kernel_options,
        _mask_gathers(kernel, block_mask),
        lambda bits: tuple(k and k.source for k in _backward_kernels(
            (traced[0], trace_mod(bits.mask_mod, "mask_mod")), query, key, value, sparse, options, interpret)),
        lambda bits: _backward(query, key, value, out, lse, grad_out, grad_lse, traced[0], bits or traced_mask,
                               scale, kernel_options, captured, need_dq, need_captured),
        need_dq, grad_lse is not None, grad_classes, with_bits=not want)
    if first is not None and first.bits is not None:  # a new mask_mod's first calls: its kernels compile beside
        return _backward(query, key, value, out, lse, grad_out, grad_lse, score_mod, first.bits, scale,
                         kernel_options, captured, need_dq, need_captured)
    if first is not None and first.eager:  # in torch ops while the kernels compile beside
        grads = _run_eager(first, _eager.backward, query, key, value, out, grad_out, grad_lse, score_mod,
                           traced_mask, scale, tuple(want))
        if grads is not None:
            return _wanted(grads, need_captured)
    grads = _run_backward(kernel, ws_kernel, first, query, key, value, out, lse, grad_out, grad_lse, score_mod,
                          block_mask, scale, options, need_dq, need_captured, want, scatter, deterministic, kv_blocks,
                          sparse)
    if plan is None:  # (a warp-specialized kernel that failed to compile in the call: the Triton one's from now on)
        _keep_plan(plan_key, block_mask, traced[0], first, query,
                   (kernel, None if ws_kernel is not None and ws_kernel.source in _WS_UNCOMPILABLE else ws_kernel))
    return grads


def _run_backward(kernel, ws_kernel, first: Optional[_FirstCall], query, key, value, out, lse, grad_out, grad_lse,
                  score_mod, block_mask, scale, options: dict, need_dq: bool, need_captured: tuple, want: list,
                  scatter: tuple, deterministic: bool, kv_blocks: list, sparse: tuple) -> tuple:
    """:func:`_backward`'s launch of ``kernel`` (and ``ws_kernel``, the warp-specialized dK / dV one, or None), and
    the gradients as it returns them; ``first``: the call's part in first_calls (done once the kernels ran)."""
    B, Hq, Lq, _ = query.shape
    Lkv = key.shape[2]
    interpret = query.device.type != "cuda"
    # (the kernels' modules loaded once the call runs them: not for the bits' or torch ops' calls)
    module = load_module(kernel.source, interpret=interpret)
    q_blocks = _q_block_tensors(block_mask, Lq, Lkv, query.device)

    def config():  # (launch_backward's call: only where the Triton kernels run)
        return backward_config(query, value, sparse, options,
                               gathers=bool(kernel.score_mod.tensors) or _mask_gathers(kernel, block_mask))
    ws_module = None if ws_kernel is None else load_module(ws_kernel.source, interpret=interpret)
    buffers = [torch.zeros(t.shape, dtype=torch.float32, device=query.device) for t in scatter]
    ds = torch.zeros((B, Hq, Lq, Lkv), dtype=torch.float32, device=query.device) if deterministic else None

    def run(ws_module):
        for persistent in _ws_backward_grids(block_mask, Lq, Lkv) if ws_module is not None else (False,):
            grads = launch_backward(
                module, kernel.mod_args(), kernel.grad_args(buffers), query, key, value, out, lse, grad_out, grad_lse,
                tuple(kv_blocks), q_blocks, sparse, scale, kernel.has_score_mod, config, need_dq=need_dq, ds=ds,
                scatter_captured_grads=bool(scatter), pinned=any(k in options for k in BACKWARD_CONFIG_KEYS),
                tune=autotune_enabled(options), dense=block_mask is None, use_tma=_use_tma(options),
                ws_module=ws_module, ws_persistent=persistent)
        return grads
    try:
        dq, dk, dv = run(ws_module)
    except Exception as e:  # noqa: BLE001 - only compiler failures of the warp-specialized kernel are handled
        if ws_module is None or not is_compile_error(e):
            raise
        _WS_UNCOMPILABLE.add(ws_kernel.source)  # the Triton dK / dV kernel for these mods from now on
        dq, dk, dv = run(None)
    if first is not None:
        first.done()
    if deterministic:
        wanted = _captured_grads_from_ds(score_mod, query, key, scale, ds, want)
    else:
        wanted = [b.to(t.dtype) for b, t in zip(buffers, want)]
    return _wanted((dq, dk, dv, wanted), need_captured)


def _wanted(grads: tuple, need_captured: tuple) -> tuple:
    """(dq, dk, dv, gradients of the captured tensors wanted, in order) as :func:`_backward` returns them: a gradient
    or None for every captured tensor."""
    dq, dk, dv, wanted = grads
    wanted = iter(wanted)
    return dq, dk, dv, [next(wanted) if need else None for need in need_captured]


def _backward_kernels(traced, query, key, value, sparse, options: dict, interpret: bool, scatter: tuple = (),
                      deterministic: bool = False) -> tuple:
    """(the Triton kernels, the warp-specialized dK / dV kernel or None) that :func:`_backward` runs for these traced
    mods (``scatter``: the captured tensors whose gradients the kernels add up)."""
    kernel = generate_backward(*traced, interpret=interpret, grad_captured=scatter, **_mask_forms())
    ws_kernel = None
    if not (scatter or deterministic) and _warp_specialize_backward(query, key, value, sparse, options):
        ws_kernel = generate_backward(*traced, interpret=interpret, template="bwd_ws.py.jinja",
                                      query_values=_launch.WS_BWD_QUERY_VALUES,
                                      llvm_opt_levels=_launch.WS_BWD_LLVM_OPT_LEVELS, **_mask_forms())
        if ws_kernel.source in _WS_UNCOMPILABLE:
            ws_kernel = None
    return kernel, ws_kernel


def _capturing(t: torch.Tensor) -> bool:
    """Whether reading ``t`` on the host is off limits: a CUDA graph is being captured on its device's stream."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


class _PendingCount:
    """A block mask's block count being summed on its device and copied to pinned host memory behind an event, so
    that starting it (in the forward) does not wait for the GPU; :meth:`value` waits for the event only, which has
    long passed by the time a backward asks."""

    def __init__(self, counts: list):
        total = sum(t.sum(dtype=torch.int64) for t in counts)
        self._event = None
        if total.is_cuda:
            self._host = torch.empty((), dtype=torch.int64, pin_memory=True)
            self._host.copy_(total, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(total.device))  # (the copy's stream: the mask's device's)
        else:
            self._host = total

    def value(self) -> int:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return int(self._host)


def _block_count(block_mask, start_only: bool = False) -> Optional[int]:
    """The number of (partial and full) blocks in ``block_mask``, kept on the BlockMask for as long as its block
    counts are the same tensors, unmodified; None while a CUDA graph is being captured and it is not known yet (the
    count reads the block mask on the host). ``start_only``: start the count (:class:`_PendingCount`) and return
    None without waiting for it."""
    counts = [t for t in (block_mask.kv_num_blocks, block_mask.full_kv_num_blocks) if t is not None]
    key = tensors_key(counts)
    cached = getattr(block_mask, "_block_count", None)
    if cached is None or cached[0] != key:
        if _capturing(counts[0]):
            return None
        cached = block_mask._block_count = (key, _PendingCount(counts))
    if start_only:
        return None
    if isinstance(cached[1], _PendingCount):
        cached = block_mask._block_count = (key, cached[1].value())
    return cached[1]


def _wide_items(block_mask, head_dim: int) -> Optional[tuple]:
    """``block_mask``'s kv block lists for the warp-specialized forward's wide items at this head dim
    (launch.WS_FWD_WIDE_TILES: BLOCK_M query rows, three consumer warpgroups): (num, idx, full_num, full_idx) for
    q blocks of BLOCK_M rows, kept on the BlockMask for as long as its lists are the same tensors, unmodified. None
    where the forward keeps its two consumer warpgroups: no wide tiles at this head dim, lists block_mask.item_lists
    cannot make (not create_block_mask's), lists that walk more than launch.WS_FWD_WIDE_MAX_WORK times the mask's own
    tiles (:func:`_wide_work`; the answer kept with the settings it was made under), or a CUDA graph being captured
    before they were made (no allocations in the capture)."""
    tiles = _launch.WS_FWD_WIDE_TILES.get(head_dim)
    if tiles is None:
        return None
    rows = tiles["BLOCK_M"]
    key = (rows, lists_key(block_mask), _launch.WS_FWD_PARTIAL_TILE_COST, _launch.WS_FWD_WIDE_MAX_WORK)
    cached = getattr(block_mask, "_wide_items", None)
    if cached is None or cached[0] != key:
        if _capturing(block_mask.kv_num_blocks):
            return None
        lists = item_lists(block_mask, rows)
        if lists is not None and _wide_work(block_mask, lists, rows) > _launch.WS_FWD_WIDE_MAX_WORK:
            lists = None
        cached = block_mask._wide_items = (key, lists)
    return cached[1]


def _wide_work(block_mask, lists: tuple, rows: int) -> float:
    """The wide items' tiles (``lists``, for q blocks of ``rows`` rows) against the mask's own, each weighed by
    its rows and a partial tile as launch.WS_FWD_PARTIAL_TILE_COST full ones: a banded mask's wider items walk more
    keys per query and more of them partial (sliding window 1024 at S8192: 1.27x; causal 1.05x)."""
    def work(num, full_num, q_rows):
        full = 0 if full_num is None else full_num.sum().double()
        return (num.sum().double() * _launch.WS_FWD_PARTIAL_TILE_COST + full) * q_rows
    own, wide = torch.stack([work(block_mask.kv_num_blocks, block_mask.full_kv_num_blocks, block_mask.BLOCK_SIZE[0]),
                             work(lists[0], lists[2], rows)]).tolist()  # (one read from the device)
    return wide / max(own, 1.0)


def _mean_walk(block_mask, Lq: int, Lkv: int) -> Optional[tuple[float, float]]:
    """Keys a q block walks and queries a kv block walks, on average (partial and full blocks), or None while a CUDA
    graph is being captured and they are not known yet: counting reads the block mask on the host once
    (:func:`_block_count`; a forward that will have a backward starts it without waiting: FlexAttentionFunction)."""
    if block_mask is None:
        return float(Lkv), float(Lq)
    total = _block_count(block_mask)
    if total is None:
        return None
    q_rows = max(1, block_mask.kv_num_blocks.numel())  # batch x heads x q blocks
    kv_rows = max(1, q_rows // max(1, block_mask.kv_num_blocks.shape[-1]) * block_mask.kv_indices.shape[-1])
    bq, bkv = block_mask.BLOCK_SIZE
    return total / q_rows * bkv, total / kv_rows * bq


def _ws_backward_persistent(block_mask, Lq: int, Lkv: int) -> bool:
    """Whether the warp-specialized backward takes its persistent grid: :data:`launch.WS_BWD_PERSISTENT` when set,
    else where kv blocks walk at most :data:`launch.WS_BWD_PERSISTENT_MAX_WALK` queries on average (not while a CUDA
    graph is captured before the walk is counted)."""
    if _launch.WS_BWD_PERSISTENT is not None:
        return _launch.WS_BWD_PERSISTENT
    walk = _mean_walk(block_mask, Lq, Lkv)
    return walk is not None and walk[1] <= _launch.WS_BWD_PERSISTENT_MAX_WALK


def _ws_backward_grids(block_mask, Lq: int, Lkv: int) -> tuple:
    """The grids the warp-specialized backward launches with: the call's (:func:`_ws_backward_persistent`), or for
    the bits of a new mask_mod's first calls compiled in the first_calls worker (launch.compile_only) both, the
    persistent one and a program per key block: the bits' kernels serve every later mask_mod, short walks and long,
    whose first backward would otherwise compile the other in the call (a GPU probe, NOTES 73: 3 s)."""
    if (_launch.WS_BWD_PERSISTENT is None and isinstance(block_mask, first_calls.BitsMask)
            and _launch.compiling_only()):
        return (False, True)
    return (_ws_backward_persistent(block_mask, Lq, Lkv),)


def _warp_specialize(query, key, value, block_mask, num_blocks, sparse, options) -> bool:
    """Whether the forward runs the warp-specialized Gluon kernel (fwd_ws.py.jinja): ``kernel_options``
    ``WARP_SPECIALIZE=True`` insists (a NotImplementedError says what the inputs lack), ``False`` refuses. Unset, it
    runs where it can at the head dims of ``launch.WS_DEFAULT_HEAD_DIMS`` when its tensor descriptors can be made on
    the host (:func:`launch.ws_host_descriptors`), or else at ``launch.WS_DEVICE_DESC_HEAD_DIMS`` when q blocks walk at
    least ``launch.WS_MIN_WALK_KEYS`` keys on average (shorter walks with per-program descriptors, and D64's, measured
    slower: NOTES 38); not where tiles are pinned,
    autotuning is asked for, or the queries go to the decode kernel (:func:`_decode_rows`)."""
    fixed = _warp_specialize_fixed(query, key, value, num_blocks, sparse, options)
    if fixed is not None:
        return fixed
    walk = _mean_walk(block_mask, query.shape[2], key.shape[2])
    return walk is not None and walk[0] >= WS_MIN_WALK_KEYS


def _warp_specialize_fixed(query, key, value, num_blocks, sparse, options) -> Optional[bool]:
    """:func:`_warp_specialize` where the inputs and options decide, None where the block mask's walk does."""
    want = options.get("WARP_SPECIALIZE")
    if want is False:
        return False
    unmet = ws_forward_unmet(query, key, value, sparse)
    if want:
        if unmet:
            raise NotImplementedError(f"flex_attention: kernel_options WARP_SPECIALIZE=True needs {unmet}; leave "
                                      f"WARP_SPECIALIZE unset to use the Triton forward where it cannot run")
        return True
    if (unmet or query.shape[-1] not in WS_DEFAULT_HEAD_DIMS or autotune_enabled(options)
            or any(k in options for k in CONFIG_KEYS) or _decode_rows(query, key, num_blocks, sparse, options)):
        return False
    if ws_host_descriptors(query, key, value, sparse):
        return True
    return None if query.shape[-1] in WS_DEVICE_DESC_HEAD_DIMS else False


def _warp_specialize_backward(query, key, value, sparse, options) -> bool:
    """Whether the backward's dK / dV (and dQ, :data:`launch.WS_BWD_FUSED_DQ`) run the warp-specialized Gluon kernel
    (bwd_ws.py.jinja), which needs what :func:`launch.ws_backward_unmet` lists (otherwise the Triton kernels run, also
    when forced: the forward's requirements were checked when it ran). ``kernel_options`` ``WARP_SPECIALIZE=True``
    takes it wherever it can run, ``False`` refuses; unset, it runs at the head dims of
    ``launch.WS_BWD_DEFAULT_HEAD_DIMS`` (benchmarks/NOTES.md 41). Never with pinned backward tiles or autotuning.
    (Captured tensors that need gradients take the Triton kernels before this is asked.)"""
    want = options.get("WARP_SPECIALIZE")
    if (want is False or autotune_enabled(options) or any(k in options for k in BACKWARD_CONFIG_KEYS)
            or ws_backward_unmet(query, key, value, sparse) is not None):
        return False
    return bool(want) or query.shape[-1] in WS_BWD_DEFAULT_HEAD_DIMS


def _decode_rows(query, key, num_blocks, sparse, options) -> int:
    """Query heads per decode program, or 0 for the regular forward kernel. Short queries (<= 64, all in
    the block mask's first q block) over any KV use split-KV decoding unless ``kernel_options`` says
    ``DECODE=False`` (or torch's ``FORCE_USE_FLEX_ATTENTION=True`` or ``BACKEND="TRITON"``, or pinned tiles);
    ``DECODE=True`` (torch's ``BACKEND="TRITON_DECODE"``) insists (beside ``FORCE_USE_FLEX_ATTENTION=True`` or
    pinned forward tiles: refused by :func:`_validate`)."""
    rows = decode_rows(query, key, sparse, num_blocks.shape[1])
    pinned_tiles = any(k in options for k in CONFIG_KEYS)  # a pinned tile config means the regular kernel
    wanted = options.get("DECODE", not (options.get("FORCE_USE_FLEX_ATTENTION", False) or pinned_tiles))
    if options.get("DECODE") and not rows:
        _fail(f"kernel_options DECODE=True (or torch's BACKEND='TRITON_DECODE') needs at most 64 queries, all in the "
              f"block mask's first q block (query length {query.shape[2]}, BLOCK_SIZE {sparse})")
    return rows if wanted else 0


class FlexAttentionFunction(torch.autograd.Function):
    """Block-sparse FlashAttention from generated kernels. Returns (out, lse).

    Inputs after ``traced`` (the mods' traces, :func:`_validate`'s) are the tensors captured by score_mod that require
    grad (see :func:`_captured_requiring_grad`); the backward returns their gradients.
    """

    @staticmethod
    def forward(ctx, query, key, value, score_mod, block_mask, scale, kernel_options, max_scores, traced, *captured):
        if block_mask is not None and _launch.WS_BWD_PERSISTENT is None:
            _block_count(block_mask, start_only=True)  # for the backward's grid: counted now, read there unsynced
        out, lse, row_max = _forward(query, key, value, score_mod, block_mask, scale,
                                     _pass_options(kernel_options, "fwd_"), max_scores, traced)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.block_mask, ctx.scale = block_mask, scale
        ctx.kernel_options = _pass_options(kernel_options, "bwd_")
        ctx.traced, ctx.read = traced, _tensors_read(traced, block_mask)
        # the trace's own objects (its gradient kernels are matched against them), not saved tensors: a non-reentrant
        # checkpoint hands saved ones back as others; the trace holds them anyway (ctx.read: their versions checked)
        ctx.captured = captured
        ctx.versions = tuple(t._version for t in ctx.read)
        ctx.set_materialize_grads(False)  # an unused out or lse arrives as None: no work for it
        if row_max is None:
            return out, lse
        ctx.mark_non_differentiable(row_max)  # as torch's: a max has no gradient worth propagating here
        return out, lse, row_max

    @staticmethod
    def backward(ctx, *grads):
        if torch.is_grad_enabled():  # create_graph=True: the gradients would have no graph, silently
            raise NotImplementedError("flex_attention's backward is not differentiable again (create_graph=True, a "
                                      "gradient penalty, double backward): its kernels' gradients have no graph")
        return FlexAttentionFunction._backward(ctx, *grads)

    @staticmethod
    @torch.autograd.function.once_differentiable  # the kernels' gradients are not differentiable again
    def _backward(ctx, grad_out, grad_lse, grad_max=None):
        _check_unchanged_since_forward(ctx)
        query, key, value, out, lse = ctx.saved_tensors
        captured = ctx.captured
        needs = ctx.needs_input_grad
        with work_scope(query, autocast_on(query)):  # q's GPU current; a backward under autocast: ops as written
            dq, dk, dv, dcaptured = _backward(
                query, key, value, out, lse, grad_out, grad_lse, ctx.traced[0], ctx.block_mask, ctx.scale,
                ctx.kernel_options, captured, need_dq=needs[0], need_captured=tuple(needs[9:]), traced_mods=ctx.traced)
        return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None,
                None, None, None, None, None, None, *dcaptured)


def _tensors_read(traced: tuple, block_mask) -> list:
    """The tensors a forward reads besides query, key and value: its mods' captured tensors and the block mask's
    lists. The backward reads them again (score_mod and mask_mod run again there, from the forward's traces, once
    :func:`_check_unchanged_since_forward` has found them unchanged)."""
    tensors = [t for mod in traced if mod is not None for t in mod.captured.values() if isinstance(t, torch.Tensor)]
    if block_mask is not None:
        tensors += [t for t in (getattr(block_mask, a) for a in BlockMask._TENSOR_ATTRS) if t is not None]
    return tensors


def _check_unchanged_since_forward(ctx) -> None:
    """The backward recomputes the scores from the forward's traces of the mods (their constants and captured tensors
    as the forward had them: a rebound attribute, a new constant, a reassigned mask_mod or functional_call's
    parameters put back since change nothing there) and from the tensors they and the block mask read: a
    RuntimeError, as autograd's for an input changed in place, where one of those was written in place since the
    forward, whose gradients would be those of other scores, silently."""
    changed = [t for t, version in zip(ctx.read, ctx.versions) if t._version != version]
    if changed:
        raise RuntimeError(f"flex_attention's backward: a tensor of shape {tuple(changed[0].shape)} that a mod "
                           f"captures or the block mask holds was modified by an inplace operation since the forward, "
                           f"so the gradients would be those of other scores; change it after the backward (or clone "
                           f"it before the forward)")


def _autocast_inputs(query, key, value) -> tuple:
    """Under torch.autocast for query's device type, query / key / value in its dtype, as torch's flex_attention
    (autocast's rule: floating tensors on that device but float64; the casts are differentiable)."""
    device_type = query.device.type
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
                 and t.device.type == device_type else t for t in (query, key, value))


@opaque_to_compile  # in a compiled model (or compiled itself): one graph break, the kernels run as they are
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
    *,
    return_aux: Optional[AuxRequest] = None,
):
    """Attention with a user score_mod and a block-sparse mask; the same API as torch's flex_attention.

    Args:
        query: [B, Hq, Lq, E]; key: [B, Hkv, Lkv, E]; value: [B, Hkv, Lkv, Ev] (key and value may both have
            batch 1: one sequence shared by the batch, as torch's broadcast). float16, bfloat16 or
            float32, all on one device: CUDA runs compiled Triton kernels, CPU the same kernels through
            Triton's interpreter (exact but slow: for debugging and tests). float64 runs in torch ops
            (:mod:`flexlite.eager`, chunked, block-sparse) on either device, as torch's flex_attention runs it on its
            math path: for gradcheck and tests; kernel_options do not apply to it.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, applied to the scaled score.
        block_mask: a :class:`flexlite.BlockMask` from :func:`flexlite.create_block_mask` (or torch's BlockMask,
            used as it is); None = no mask.
        scale: multiplies ``q @ k^T``; default ``1 / sqrt(E)``. A number, or a 0-d tensor as torch's takes (read
            on the host: on CUDA that waits for the GPU and cannot be captured in a CUDA graph; pass a float there).
        enable_gqa: allow Hq to be a multiple of Hkv (query head h uses kv head ``h // (Hq // Hkv)``).
        return_lse: also return the log-sum-exp [B, Hq, Lq] (fp32, natural log; float64 for float64 inputs).
        kernel_options: pin tile sizes: ``BLOCK_M``, ``BLOCK_N``, ``num_warps``, ``num_stages``; for the
            backward ``BLOCK_M1``, ``BLOCK_N1`` (dK/dV: kv tile, q step), ``BLOCK_M2``, ``BLOCK_N2`` (dQ);
            ``DETERMINISTIC_CAPTURED_GRADS`` (see Gradients); ``AUTOTUNE`` (time a small config space
            once per kernel / dtype / head dim / length bucket, cached on disk); ``USE_TMA`` (the walked tiles
            through Hopper tensor descriptors, forward and backward; default: only without a block mask);
            ``DECODE`` / ``DECODE_SPLITS`` (force or forbid the split-KV kernel that queries of length <= 64
            use by default, and pin its split count); torch's ``BACKEND``: ``"TRITON_DECODE"`` as ``DECODE=True``,
            ``"TRITON"`` as ``DECODE=False``, ``"AUTO"`` and ``"FLASH"`` flexlite's choice. As torch's, a key
            prefixed ``fwd_`` or ``bwd_`` (``fwd_BLOCK_M``, ``bwd_num_warps``) applies to that pass alone.

        return_aux: an :class:`AuxRequest` (flexlite's or torch's): ``lse=True`` for the log-sum-exp as
            ``return_lse``, ``max_scores=True`` for each query row's largest score after score_mod and masking
            [B, Hq, Lq] (fp32, natural units, not differentiable; -inf where every key is masked). max_scores
            is stored by every forward (Triton, decode, and on Hopper the warp-specialized one; with
            ``launch.WS_FWD_MAX_SCORES = False`` such calls take the Triton forward and refuse
            ``kernel_options`` ``WARP_SPECIALIZE=True``).

    Returns:
        out [B, Hq, Lq, Ev] in the input dtype, and ``lse`` if ``return_lse``; with ``return_aux``,
        ``(out, AuxOutput(lse, max_scores))``, unrequested fields None. A query row that every position is
        masked for gives out 0 and LSE -inf.

    Gradients: differentiable w.r.t. query, key, value (any subset), through ``out`` and ``lse``, and
    w.r.t. tensors captured by ``score_mod`` that require grad (a learnable bias table, ALiBi slopes,
    ...). score_mod's derivative is derived from its traced graph (``flexlite.codegen.grad``); an op
    with no derivative rule raises :class:`UntraceableModError` at backward time. Tensors captured by
    ``mask_mod`` get no gradient (a mask is piecewise constant). Captured-tensor gradients are
    accumulated with float32 atomics by default, which is fast but not bit-reproducible on GPUs; with
    ``kernel_options={"DETERMINISTIC_CAPTURED_GRADS": True}`` (default: the environment variable
    ``FLEXLITE_DETERMINISTIC_CAPTURED_GRADS=1`` or ``torch.use_deterministic_algorithms(True)``) the
    backward kernel writes dS [B, Hq, Lq, Lkv] in float32 instead (4 bytes per score: 64 MiB for
    B*Hq = 16 heads of 2048 x 512) and torch re-runs score_mod over chunks of about 2**24 scores to
    backpropagate it, in a fixed order.
    """
    autocast = isinstance(query, torch.Tensor) and autocast_on(query)
    if autocast:
        query, key, value = _autocast_inputs(query, key, value)
    kernel_options = _resolve_backend(kernel_options)
    if is_torch_block_mask(block_mask):  # built with torch's create_block_mask: the same tensors, as they are
        block_mask = from_torch_block_mask(block_mask)
    traced = _validate(query, key, value, score_mod, block_mask, scale, enable_gqa, kernel_options, return_lse,
                       return_aux)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    if key.shape[0] != query.shape[0]:  # batch-1 key / value shared by the batch: a stride-0 view, no copy; their
        key, value = (t.expand(query.shape[0], *t.shape[1:]) for t in (key, value))  # gradients summed by autograd
    max_scores = return_aux is not None and return_aux.max_scores
    with work_scope(query, autocast):  # q's GPU current; under autocast (the inputs cast above) the ops as written
        out, lse, row_max = _attention(query, key, value, score_mod, block_mask, float(scale), kernel_options,
                                       max_scores, traced)
    if return_aux is not None:
        return out, AuxOutput(lse=lse if return_aux.lse else None, max_scores=row_max)
    return (out, lse) if return_lse else out


def _attention(query, key, value, score_mod, block_mask, scale: float, kernel_options, max_scores: bool,
               traced: tuple):
    """(out, lse, row maxima or None), through the autograd Function where a gradient may be asked for; ``traced``:
    the mods' traces (:func:`_validate`)."""
    captured = _captured_requiring_grad(traced[0])
    if torch.is_grad_enabled() and (captured or query.requires_grad or key.requires_grad or value.requires_grad):
        out, lse, *row_max = FlexAttentionFunction.apply(query, key, value, score_mod, block_mask, scale,
                                                         kernel_options, max_scores, traced, *captured)
        return out, lse, row_max[0] if row_max else None
    # inference (decoding above all): no autograd node to build, ~10 us less host time per call
    return _forward(query, key, value, score_mod, block_mask, scale, _pass_options(kernel_options, "fwd_"), max_scores,
                    traced)
