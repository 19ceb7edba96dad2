"""Block-sparse attention masks: ``BlockMask``, ``create_block_mask``, ``create_mask``, mask combinators.

Same names, arguments and semantics as ``torch.nn.attention.flex_attention``.

Notation used in shapes below:

* ``B, H``: batch and heads of the mask (1 where the mask broadcasts);
* ``Q_LEN, KV_LEN``: sequence lengths; ``BQ, BKV = BLOCK_SIZE``;
* ``nQ = cdiv(Q_LEN, BQ)``, ``nKV = cdiv(KV_LEN, BKV)``: number of q / kv blocks.

Block (qb, kb) covers ``q_idx in [qb*BQ, min((qb+1)*BQ, Q_LEN))`` and
``kv_idx in [kb*BKV, min((kb+1)*BKV, KV_LEN))``. Judged over those in-range positions, a block is

* *empty* if ``mask_mod`` is False everywhere: kernels skip it;
* *full* if ``mask_mod`` is True everywhere: kernels compute it without calling ``mask_mod``
  (``full_kv_*`` / ``full_q_*``);
* *partial* otherwise: kernels compute it and apply ``mask_mod`` (``kv_*`` / ``q_*``).

Divergence from torch: torch pads the ragged last block of each axis with False, so such a block
is never full; here only in-range positions count (kernels bounds-check ragged blocks anyway), so a
ragged block that is True everywhere in range is full.

Compressed format (as torch's): ``num_blocks[..., r]`` is how many blocks row ``r`` has, and
``indices[..., r, :num_blocks[..., r]]`` are their column indices in ascending order (the rest of
the row is the other columns; kernels read only the prefix). The kv side has one row per q block
(``kv_num_blocks [B, H, nQ]``, ``kv_indices [B, H, nQ, nKV]``); the q side, used by the backward
pass, is its transpose (``q_num_blocks [B, H, nKV]``, ``q_indices [B, H, nKV, nQ]``).
"""

from __future__ import annotations

import collections.abc
import functools
import itertools
import numbers
import operator
import os
import sys
import warnings
from typing import Callable, Optional, Union

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor

from ._vmap import index_vectors, vmap_bhqkv
from .codegen.trace import UntraceableModError, arguments_read, check_arity, positional_arity, trace_mod
from .runtime.guards import on_device, opaque_to_compile
from .runtime.launch import cdiv, is_host_scalar
from .runtime.launch_mask import launch_block_mask

__all__ = ["BlockMask", "create_block_mask", "create_mask", "and_masks", "or_masks", "noop_mask"]

_DEFAULT_SPARSE_BLOCK_SIZE = 128
# create_block_mask (on CPU) evaluates mask_mod on at most this many positions at once (but always on
# at least one block), so a long sequence never needs its dense B x H x Q_LEN x KV_LEN mask.
_CHUNK_ELEMENTS = 2 ** 24
# on CUDA (a new mask_mod's block mask, evaluated in torch while its kernel compiles: first_calls) chunks this small
# keep the int64 temporaries of the vmapped mask_mod at ~32 MB each
_CUDA_CHUNK_ELEMENTS = 2 ** 22

_MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
# torch's names for the mods' types (torch.nn.attention.flex_attention; attention-gym imports them)
_mask_mod_signature = collections.abc.Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
_score_mod_signature = collections.abc.Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


# ----------------------------------------------------------------------------------------------
# mask_mods and combinators
# ----------------------------------------------------------------------------------------------

def noop_mask(batch: Tensor, head: Tensor, token_q: Tensor, token_kv: Tensor) -> Tensor:
    """mask_mod that keeps every position: a 0-d True (torch's parameter names, for calls by keyword)."""
    return batch.new_ones((), dtype=torch.bool)


def _mod_name(fn) -> str:
    return getattr(fn, "__name__", None) or repr(fn)


def _combine_masks(caller: str, mask_mods: tuple, op: Callable, empty: Callable) -> _MaskMod:
    """mask_mod returning ``op``-reduction of ``mask_mods`` (``empty(b)`` when there are none).

    Plain Python over the list of mods (no branch on tensor values), so it stays traceable by
    torch.fx and vmap.
    """
    for i, mod in enumerate(mask_mods):
        if not callable(mod):
            raise TypeError(f"{caller}: argument {i} ({mod!r}) is not callable; "
                            "expected mask_mod(b, h, q_idx, kv_idx) functions")
        check_arity(mod, "mask_mod", argname=f"argument {i}", caller=caller)

    def combined(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        results = [mod(b, h, q_idx, kv_idx) for mod in mask_mods]
        return functools.reduce(op, results) if results else empty(b)

    combined.__name__ = combined.__qualname__ = f"{caller}({', '.join(map(_mod_name, mask_mods))})"
    return combined


def and_masks(*mask_mods: _MaskMod) -> _MaskMod:
    """mask_mod keeping a position iff every one of ``mask_mods`` keeps it (no mods: keep all)."""
    return _combine_masks("and_masks", mask_mods, operator.and_,
                          lambda b: b.new_ones((), dtype=torch.bool))


def or_masks(*mask_mods: _MaskMod) -> _MaskMod:
    """mask_mod keeping a position iff any one of ``mask_mods`` keeps it (no mods: keep none)."""
    return _combine_masks("or_masks", mask_mods, operator.or_,
                          lambda b: b.new_zeros((), dtype=torch.bool))


def _sliced_mask_mod_error(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """mask_mod of a sliced BlockMask (as torch): the original's indices no longer line up."""
    raise RuntimeError(
        "Cannot use mask_mod from a sliced BlockMask: slicing with [] resets mask_mod, because "
        "the batch/head/q-block positions of the slice no longer match the original mask_mod. "
        "Assign one derived from the original BlockMask's mask_mod, e.g. "
        "sliced.mask_mod = apply_offset(base_mask.mask_mod, offset).")


# ----------------------------------------------------------------------------------------------
# validation helpers
# ----------------------------------------------------------------------------------------------

def _check_mask_mod(caller: str, mask_mod) -> None:
    """TypeError unless ``mask_mod`` is a callable of the 4 arguments (b, h, q_idx, kv_idx)."""
    check_arity(mask_mod, "mask_mod", caller=caller)


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_bool(x) -> bool:
    """Whether ``x`` is a bool: Python's, or numpy's (``np.True_``: what numpy comparisons and configs read through
    numpy give; a flag argument takes either, as ``bool(x)``)."""
    if isinstance(x, bool):
        return True
    np = sys.modules.get("numpy")  # (a numpy bool exists only where numpy is imported)
    return np is not None and isinstance(x, np.bool_)


def check_bool(caller: str, name: str, value) -> bool:
    """``value`` as a bool; TypeError naming ``name`` unless it is one (Python's or numpy's)."""
    if not is_bool(value):
        raise TypeError(f"{caller}: {name} must be a bool (True or False); got {type(value).__name__} {value!r}")
    return bool(value)


def _check_positive_int(caller: str, name: str, value, allow_none: bool = False) -> int:
    """``value`` as an int (None -> 1 when allowed); TypeError / ValueError naming ``name``."""
    if value is None and allow_none:
        return 1
    if not _is_int(value):
        kind = "a positive int or None" if allow_none else "a positive int"
        raise TypeError(f"{caller}: {name} must be {kind}; got {value!r}")
    if value <= 0:
        raise ValueError(f"{caller}: {name} must be positive; got {value}")
    return int(value)


def _normalize_block_size(caller: str, BLOCK_SIZE) -> tuple[int, int]:
    """int or (q, kv) -> (BQ, BKV), each a positive multiple of 16."""
    sizes = (BLOCK_SIZE, BLOCK_SIZE) if _is_int(BLOCK_SIZE) else BLOCK_SIZE
    if not (isinstance(sizes, (tuple, list)) and len(sizes) == 2 and all(map(_is_int, sizes))):
        raise TypeError(f"{caller}: BLOCK_SIZE must be an int or a (Q_BLOCK_SIZE, KV_BLOCK_SIZE) "
                        f"tuple of ints; got {BLOCK_SIZE!r}")
    if any(s <= 0 or s % 16 for s in sizes):
        raise ValueError(f"{caller}: BLOCK_SIZE must be positive multiples of 16; got {BLOCK_SIZE!r}")
    return int(sizes[0]), int(sizes[1])


def check_device(caller: str, device, name: str = "device", available: bool = True,
                 any_type: bool = False) -> torch.device:
    """``device`` (a str, torch.device, an int N for GPU N as torch takes it, or None) as a torch.device flexlite
    can run on, else a typed error naming ``name``: TypeError for another kind of value, ValueError for a malformed
    string or a negative int, a CUDA device without CUDA or past the visible GPUs (unless ``available=False``: the
    device need not be present), NotImplementedError for a device type other than cuda / cpu (unless ``any_type``).
    None -> "cuda" if available, else "cpu"; "cuda" names the current GPU."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device, int) and not isinstance(device, bool):
        if device < 0:
            raise ValueError(f"{caller}: {name}={device} is no GPU index; use 0, 1, ... (GPU N), 'cuda:N' or 'cpu'")
        device = torch.device("cuda", device)
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"{caller}: {name} must be a str, torch.device or GPU index such as 'cuda', 'cpu' or 0 (or "
                        f"None); got {type(device).__name__} {device!r}")
    try:
        device = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"{caller}: {name}={device!r} is not a device; use 'cuda', 'cuda:N' or 'cpu'") from e
    if device.type not in ("cuda", "cpu") and not any_type:
        raise NotImplementedError(f"{caller}: {name} is {device}; flexlite runs on CUDA (compiled kernels) and "
                                  f"CPU (Triton's interpreter) only: use 'cuda' or 'cpu'")
    if device.type == "cuda" and available:
        if not torch.cuda.is_available():
            raise ValueError(f"{caller}: {name} is {device} but CUDA is not available; use device='cpu'")
        if device.index is None:  # "cuda" means the current GPU: name it
            device = torch.device("cuda", torch.cuda.current_device())
        elif device.index >= torch.cuda.device_count():
            raise ValueError(f"{caller}: {name} is {device} but only {torch.cuda.device_count()} GPU(s) are "
                             f"visible; use cuda:0..cuda:{torch.cuda.device_count() - 1}")
    return device


_HOST_METHODS = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__")


def check_captured_device(captured, device: torch.device, caller: str, what: str, runs: str = "") -> None:
    """The tensors ``captured`` by ``what`` (a mod) on ``device``, where it runs (``runs``: "the kernel runs on"
    for a kernel, else "<what> is evaluated on": create_mask and the pictures, in torch ops), or host scalars, which
    the launchers and torch move: one elsewhere is a ValueError naming the fix, not torch's error from inside vmap."""
    for t in captured:
        if t.device != device and not is_host_scalar(t):
            raise ValueError(f"{caller}: a tensor captured by {what} is on {t.device} but "
                             f"{runs or what + ' is evaluated on'} {device}; create it on {device} "
                             f"(tensor.to({device.type!r})) before defining the mod")


def check_mod_output(fn, kind: str, caller: str, allow_constant: bool = True, check_shape: bool = False):
    """Trace ``fn`` (a ``kind``: "mask_mod" or "score_mod") and check what it returns: the trace, or a typed
    error naming the mod and the fix. A mask_mod must return a 0-d bool tensor (a Python bool only with
    ``allow_constant``: the kernels take one, vmap does not), a score_mod a 0-d tensor or a number (0-d:
    with ``check_shape``, for callers that vmap the mod; the kernels' lowering names what went wrong);
    ``.item()`` and friends (a tensor turned into a Python value) are :class:`UntraceableModError`."""
    traced = trace_mod(fn, kind)
    key = (kind, allow_constant, check_shape)
    if key in getattr(traced, "_outputs_checked", ()):
        return traced
    name = traced.name
    for node in traced.graph_module.graph.nodes:
        if node.op == "call_method" and node.target in _HOST_METHODS:
            raise UntraceableModError(
                f"{caller}: {kind} {name!r} calls Tensor.{node.target}(), which turns a tensor into a Python value "
                f"that kernel code cannot have; keep it a tensor (torch.where(cond, a, b) instead of `if`)")
    result = next(n for n in traced.graph_module.graph.nodes if n.op == "output").args[0]
    if isinstance(result, fx.Node):
        dtype, shape = result.meta.get("dtype"), result.meta.get("shape", ())
        if kind == "mask_mod" and dtype is not None and dtype != torch.bool:
            raise TypeError(f"{caller}: mask_mod {name!r} must return a bool tensor; got {dtype} (compare, e.g. "
                            f"q_idx >= kv_idx, or convert with .bool())")
        if check_shape and shape != ():
            raise ValueError(f"{caller}: {kind} {name!r} must return one value per (b, h, q_idx, kv_idx), a 0-d "
                             f"tensor; on 0-d inputs it returned shape {tuple(shape)}")
    elif kind == "mask_mod":
        if not isinstance(result, bool):
            raise TypeError(f"{caller}: mask_mod {name!r} must return a bool tensor; got {type(result).__name__} "
                            f"{result!r}")
        if not allow_constant:
            raise TypeError(f"{caller}: mask_mod {name!r} must return a bool tensor; got the Python constant "
                            f"{result!r}: return a tensor, e.g. noop_mask (keep all) or q_idx < 0 (keep none)")
    elif not isinstance(result, (int, float)):
        raise TypeError(f"{caller}: score_mod {name!r} must return the new score, a tensor or a number; got "
                        f"{type(result).__name__} {result!r}")
    traced._outputs_checked = getattr(traced, "_outputs_checked", ()) + (key,)
    return traced


# ----------------------------------------------------------------------------------------------
# block flags <-> compressed (num_blocks, indices)
# ----------------------------------------------------------------------------------------------

def _block_any(x: Tensor, rows: int, cols: int) -> Tensor:
    """bool [..., R, C] -> bool [..., cdiv(R, rows), cdiv(C, cols)]: any() over each rows x cols tile.

    The ragged last tile of each axis is padded with False, so only in-range entries count.
    """
    R, C = x.shape[-2:]
    nr, nc = cdiv(R, rows), cdiv(C, cols)
    if (nr * rows, nc * cols) != (R, C):
        x = F.pad(x, (0, nc * cols - C, 0, nr * rows - R))
    return x.reshape(*x.shape[:-2], nr, rows, nc, cols).any(dim=-1).any(dim=-2)


def _block_all(x: Tensor, rows: int, cols: int) -> Tensor:
    """As :func:`_block_any` with all(): the ragged tiles count only their in-range entries."""
    return ~_block_any(~x, rows, cols)


def _dense_to_ordered(flags: Tensor) -> tuple[Tensor, Tensor]:
    """Compress block flags: bool [..., R, C] -> (num_blocks int32 [..., R], indices int32 [..., R, C]).

    ``indices[..., r, :num_blocks[..., r]]`` are the set columns of row r, ascending, followed by
    the unset ones (a stable descending sort of the flags, as torch).
    """
    flags = flags.to(torch.int8)
    num_blocks = flags.sum(dim=-1, dtype=torch.int32)
    indices = torch.argsort(flags, dim=-1, descending=True, stable=True)
    return num_blocks.contiguous(), indices.to(torch.int32).contiguous()


def _ordered_to_dense(num_blocks: Tensor, indices: Tensor, n_cols: int) -> Tensor:
    """Expand compressed blocks: (num_blocks [..., R], indices [..., R, N], n_cols) -> bool [..., R, n_cols].

    Only the first ``num_blocks[..., r]`` entries of each row are read.
    """
    n_entries = indices.shape[-1]
    valid = torch.arange(n_entries, device=indices.device) < num_blocks.unsqueeze(-1)
    # invalid entries write into an extra sink column, dropped below
    target = torch.where(valid, indices.long(), n_cols)
    dense = torch.zeros(*indices.shape[:-1], n_cols + 1, dtype=torch.bool, device=indices.device)
    return dense.scatter_(-1, target, True)[..., :n_cols]


def _transpose_ordered(num_blocks: Tensor, indices: Tensor) -> tuple[Tensor, Tensor]:
    """kv side (num_blocks [..., nQ], indices [..., nQ, nKV]) -> q side ([..., nKV], [..., nKV, nQ])."""
    dense = _ordered_to_dense(num_blocks, indices, indices.shape[-1])
    return _dense_to_ordered(dense.transpose(-2, -1))


_UNTRACKED = itertools.count()


def tensors_key(tensors) -> tuple:
    """(id, version) of each tensor (None for None): a key that changes where one is replaced or changed in place.
    An inference tensor (made under torch.inference_mode) keeps no version counter: its entry is new on every call,
    so what is kept for it is redone every call (create_block_mask makes its tensors outside inference mode)."""
    key = []
    for t in tensors:  # (a loop, not is_inference() per tensor: this runs several times a call, NOTES 108)
        if t is None:
            key.append(None)
        elif isinstance(t, Tensor):
            try:
                key.append((id(t), t._version))
            except RuntimeError:  # (an inference tensor has no version counter)
                key.append((id(t), next(_UNTRACKED)))
        else:  # (something other than a tensor: new every call too, for its checks to name it)
            key.append((id(t), next(_UNTRACKED)))
    return tuple(key)


def kept_on(owner, name: str, key: tuple, make: Callable):
    """``make()``, kept on ``owner`` (a BlockMask) as attribute ``name`` for as long as ``key`` (its tensors' ids and
    what else the value depends on) stays the same: per-mask work done once, not on every call."""
    kept = getattr(owner, name, None)
    if kept is not None and kept[0] == key:
        return kept[1]
    value = make()
    setattr(owner, name, (key, value))
    return value


def q_sides(kv_num_blocks: Tensor, kv_indices: Tensor, full_kv_num_blocks: Optional[Tensor],
            full_kv_indices: Optional[Tensor]) -> tuple:
    """(q_num_blocks, q_indices, full_q_num_blocks, full_q_indices) of a kv side (full ones None without full
    blocks); on the kv side's device, no host sync."""
    full = (None, None) if full_kv_num_blocks is None else _transpose_ordered(full_kv_num_blocks, full_kv_indices)
    return (*_transpose_ordered(kv_num_blocks, kv_indices), *full)


# ----------------------------------------------------------------------------------------------
# BlockMask
# ----------------------------------------------------------------------------------------------

def _check_block_tensor(name: str, t, ndim: int, caller: str = "BlockMask.from_kv_blocks") -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{caller}: {name} must be a Tensor; got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{caller}: {name} must be int32; got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{caller}: {name} must have {ndim} dimensions "
                         f"({'[B, H, nQ]' if ndim == 3 else '[B, H, nQ, nKV]'}); got shape "
                         f"{tuple(t.shape)} (unsqueeze missing batch/head dimensions)")


def _int32_lists(tensors: tuple) -> tuple:
    """Block lists given in int64 (torch's from_kv_blocks keeps them so) as the int32 the kernels read; the rest as
    they are (their checks name a wrong dtype)."""
    return tuple(t.to(torch.int32) if isinstance(t, Tensor) and t.dtype == torch.int64 else t for t in tensors)


def _check_kv_pair(prefix: str, num_blocks, indices, caller: str = "BlockMask.from_kv_blocks",
                   side: str = "kv") -> None:
    """``prefix`` ("" or "full_") ``side`` ("kv" or "q", the transposed lists)'s block counts and indices: int32
    tensors of 3 and 4 dimensions, the counts' shape the indices' without their last."""
    _check_block_tensor(f"{prefix}{side}_num_blocks", num_blocks, 3, caller)
    _check_block_tensor(f"{prefix}{side}_indices", indices, 4, caller)
    if num_blocks.shape != indices.shape[:-1]:
        raise ValueError(f"{caller}: {prefix}{side}_num_blocks shape {tuple(num_blocks.shape)} "
                         f"must equal {prefix}{side}_indices shape without its last dimension "
                         f"{tuple(indices.shape[:-1])}")


def _check_kv_values(prefix: str, num_blocks: Tensor, indices: Tensor, caller: str = "BlockMask.from_kv_blocks",
                     side: str = "kv") -> None:
    """The values the kernels read: 0 <= num_blocks <= n, and the first num_blocks indices of each row in
    [0, n), n the indices' last dimension (blocks on the other side). (Anything else reads other rows' entries or
    blocks past the sequence.) Reads the tensors on the host."""
    n_cols = indices.shape[-1]
    if num_blocks.numel() == 0 or num_blocks.device.type == "meta":
        return
    if int(num_blocks.min()) < 0 or int(num_blocks.max()) > n_cols:
        raise ValueError(f"{caller}: {prefix}{side}_num_blocks must be in [0, {n_cols}] (the number of {side} blocks, "
                         f"{prefix}{side}_indices.shape[-1]); got values in [{int(num_blocks.min())}, "
                         f"{int(num_blocks.max())}]")
    read = torch.arange(n_cols, device=indices.device) < num_blocks.unsqueeze(-1)
    bad = read & ((indices < 0) | (indices >= n_cols))
    if bool(bad.any()):
        where = tuple(bad.nonzero()[0].tolist())
        raise ValueError(f"{caller}: {prefix}{side}_indices{list(where)} = {int(indices[where])} is not a "
                         f"{side} block index in [0, {n_cols}) (only the first {prefix}{side}_num_blocks entries of a "
                         f"row are read, and those must be)")
    # a block named twice in a row's counted entries is computed twice: its keys counted twice in the row's softmax
    # (the LSE off by log 2 where it is the row's only block, the output of other rows skewed), the q side (made from
    # the blocks, once each) then disagreeing with the forward's walk
    listed = _ordered_to_dense(num_blocks, indices, n_cols)
    twice = listed.sum(-1, dtype=torch.int32) != num_blocks
    if bool(twice.any()):
        where = tuple(twice.nonzero()[0].tolist())
        row = indices[where][:int(num_blocks[where])].tolist()
        raise ValueError(f"{caller}: {prefix}{side}_indices{list(where)} names a {side} block more than once among "
                         f"the row's first {prefix}{side}_num_blocks{list(where)} = {int(num_blocks[where])} entries "
                         f"{row}; the kernels would compute it once for each: list every block once")


def _check_partial_full_disjoint(num_blocks: Tensor, indices: Tensor, full_num_blocks: Tensor, full_indices: Tensor,
                                 caller: str = "BlockMask.from_kv_blocks", side: str = "kv") -> None:
    """No block both partial (``side``_*) and full (full_``side``_*): the kernels walk both lists, so such a block
    would be computed twice (once with mask_mod, once without). Reads the tensors on the host; the values must have
    passed :func:`_check_kv_values`."""
    if num_blocks.numel() == 0 or num_blocks.device.type == "meta" or indices.shape != full_indices.shape:
        return
    both = (_ordered_to_dense(num_blocks, indices, indices.shape[-1])
            & _ordered_to_dense(full_num_blocks, full_indices, full_indices.shape[-1]))
    if bool(both.any()):
        where = tuple(both.nonzero()[0].tolist())
        raise ValueError(f"{caller}: {side} block {where[-1]} of row {list(where[:-1])} is listed both in "
                         f"{side}_indices (partial) and in full_{side}_indices (full); the kernels would compute it "
                         f"twice: list it in one of them (full where mask_mod keeps all of it)")


def check_block_tensors(block_mask: "BlockMask", caller: str, values: bool) -> None:
    """Every block-list pair of ``block_mask`` (kv and q sides, partial and full) as :meth:`BlockMask.from_kv_blocks`
    checks its arguments: dtypes and shapes, and with ``values`` (a host read) the counts and indices in range, each
    block listed once (not twice in a row, nor both partial and full) and the q side the kv side's transpose."""
    for side in ("kv", "q"):
        for prefix in ("", "full_"):
            num_blocks = getattr(block_mask, f"{prefix}{side}_num_blocks")
            indices = getattr(block_mask, f"{prefix}{side}_indices")
            if num_blocks is None or indices is None:
                continue
            _check_kv_pair(prefix, num_blocks, indices, caller, side)
            if values:
                _check_kv_values(prefix, num_blocks, indices, caller, side)
        lists = [getattr(block_mask, f"{prefix}{side}_{what}") for prefix in ("", "full_")
                 for what in ("num_blocks", "indices")]
        if values and None not in lists:
            _check_partial_full_disjoint(*lists, caller, side)
    if values:
        _check_q_side_transposes_kv_side(block_mask, caller)


def _check_q_side_transposes_kv_side(block_mask: "BlockMask", caller: str) -> None:
    """The q-side lists (which the backward's dK / dV walk reads) hold the kv-side lists' blocks, transposed: a
    ValueError where they do not (a hand-built BlockMask whose sides disagree gave dK / dV of another mask). Reads
    the tensors on the host."""
    for prefix in ("", "full_"):
        kv = (getattr(block_mask, f"{prefix}kv_num_blocks"), getattr(block_mask, f"{prefix}kv_indices"))
        q = (getattr(block_mask, f"{prefix}q_num_blocks"), getattr(block_mask, f"{prefix}q_indices"))
        if None in q or None in kv or kv[0].device.type == "meta":
            continue
        by_kv = _ordered_to_dense(*kv, kv[1].shape[-1])
        by_q = _ordered_to_dense(*q, q[1].shape[-1]).transpose(-1, -2)
        if by_kv.shape != by_q.shape or not torch.equal(by_kv, by_q):
            raise ValueError(f"{caller}: {prefix}q_num_blocks / {prefix}q_indices are not the transpose of "
                             f"{prefix}kv_num_blocks / {prefix}kv_indices (the backward's dK / dV read the q side); "
                             f"build the mask with BlockMask.from_kv_blocks(...), which computes the q side, or pass "
                             f"its transposed lists")


def _check_seq_lengths(seq_lengths, caller: str = "BlockMask.from_kv_blocks") -> tuple[int, int]:
    if not (isinstance(seq_lengths, (tuple, list)) and len(seq_lengths) == 2):
        raise TypeError(f"{caller}: seq_lengths must be a (Q_LEN, KV_LEN) tuple; got {seq_lengths!r}")
    return tuple(_check_positive_int(caller, f"seq_lengths[{i}]", n) for i, n in enumerate(seq_lengths))


class BlockMask:
    """Block-sparse attention mask (torch's format; see the module docstring).

    Attributes:
        seq_lengths: (Q_LEN, KV_LEN).
        kv_num_blocks: int32 [B, H, nQ], partial blocks per q block row.
        kv_indices: int32 [B, H, nQ, nKV], their kv block indices (ascending prefix).
        full_kv_num_blocks, full_kv_indices: the same for full blocks, or None (then there are
            none: every non-empty block is partial).
        q_num_blocks: int32 [B, H, nKV]; q_indices: int32 [B, H, nKV, nQ]: transpose of kv_*.
        full_q_num_blocks, full_q_indices: transpose of full_kv_*, or None.
        BLOCK_SIZE: (BQ, BKV).
        mask_mod: the mask_mod(b, h, q_idx, kv_idx) applied inside partial blocks.
    """

    def __init__(
        self,
        seq_lengths: tuple[int, int],
        kv_num_blocks: Tensor,
        kv_indices: Tensor,
        full_kv_num_blocks: Optional[Tensor],
        full_kv_indices: Optional[Tensor],
        q_num_blocks: Optional[Tensor],
        q_indices: Optional[Tensor],
        full_q_num_blocks: Optional[Tensor],
        full_q_indices: Optional[Tensor],
        BLOCK_SIZE: tuple[int, int] = (_DEFAULT_SPARSE_BLOCK_SIZE, _DEFAULT_SPARSE_BLOCK_SIZE),
        mask_mod: _MaskMod = noop_mask,
        *,
        dq_write_order: Optional[Tensor] = None,
        dq_write_order_full: Optional[Tensor] = None,
        dq_kv_order: "Optional[Tensor | bool]" = None,
        dq_kv_order_spt: Optional[bool] = None,
    ) -> None:
        """Store the tensors as given; prefer :meth:`from_kv_blocks` or :func:`create_block_mask`. The ``dq_*``
        keywords are torch's (metadata for its FLASH backend's deterministic dQ): kept, in :meth:`as_tuple` where
        torch has them, and not used (flexlite's backward is deterministic under
        ``torch.use_deterministic_algorithms(True)`` without them)."""
        if (full_kv_num_blocks is None) != (full_kv_indices is None):
            raise ValueError("BlockMask: full_kv_num_blocks and full_kv_indices must be both given or both None")
        if (full_q_num_blocks is None) != (full_q_indices is None):
            raise ValueError("BlockMask: full_q_num_blocks and full_q_indices must be both given or both None")
        if (q_num_blocks is None) != (q_indices is None):
            raise ValueError("BlockMask: q_num_blocks and q_indices must be both given or both None")
        if full_kv_num_blocks is None and full_q_num_blocks is not None:
            raise ValueError("BlockMask: full_q_num_blocks / full_q_indices are given but full_kv_num_blocks / "
                             "full_kv_indices are None; the full blocks need their kv side (pass both, or neither)")
        if not (isinstance(seq_lengths, (tuple, list, torch.Size)) and len(seq_lengths) == 2):
            raise TypeError(f"BlockMask: seq_lengths must be a (Q_LEN, KV_LEN) pair; got {seq_lengths!r}")
        # an int as from_kv_blocks takes it; positive multiples of 16 as everywhere (a BLOCK_SIZE of 24 reached the
        # kernels' launch, whose error named a kernel_options['BLOCK_N'] nobody passed)
        BLOCK_SIZE = _normalize_block_size("BlockMask", BLOCK_SIZE)
        for name, t in (("kv_num_blocks", kv_num_blocks), ("kv_indices", kv_indices),
                        ("full_kv_num_blocks", full_kv_num_blocks), ("full_kv_indices", full_kv_indices),
                        ("q_num_blocks", q_num_blocks), ("q_indices", q_indices),
                        ("full_q_num_blocks", full_q_num_blocks), ("full_q_indices", full_q_indices)):
            if not isinstance(t, Tensor) and (t is not None or name in ("kv_num_blocks", "kv_indices")):
                maybe = "" if name.startswith("kv_") else " or None"
                raise TypeError(f"BlockMask: {name} must be an int32 Tensor{maybe}; got {type(t).__name__} "
                                f"(torch.tensor(..., dtype=torch.int32))")
        self.seq_lengths = tuple(seq_lengths)
        self.kv_num_blocks = kv_num_blocks
        self.kv_indices = kv_indices
        self.full_kv_num_blocks = full_kv_num_blocks
        self.full_kv_indices = full_kv_indices
        self.q_num_blocks = q_num_blocks
        self.q_indices = q_indices
        self.full_q_num_blocks = full_q_num_blocks
        self.full_q_indices = full_q_indices
        self.BLOCK_SIZE = tuple(BLOCK_SIZE)
        self.mask_mod = mask_mod
        self.dq_write_order, self.dq_write_order_full = dq_write_order, dq_write_order_full
        self.dq_kv_order, self.dq_kv_order_spt = dq_kv_order, dq_kv_order_spt

    _DQ_ATTRS = ("dq_write_order", "dq_write_order_full", "dq_kv_order", "dq_kv_order_spt")  # torch's, kept unused
    _TENSOR_ATTRS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                     "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")

    # -- construction ----------------------------------------------------------------------------

    @classmethod
    def from_kv_blocks(
        cls,
        kv_num_blocks: Tensor,
        kv_indices: Tensor,
        full_kv_num_blocks: Optional[Tensor] = None,
        full_kv_indices: Optional[Tensor] = None,
        BLOCK_SIZE: Union[int, tuple[int, int]] = _DEFAULT_SPARSE_BLOCK_SIZE,
        mask_mod: Optional[_MaskMod] = None,
        seq_lengths: Optional[tuple[int, int]] = None,
        compute_q_blocks: bool = True,
        *,
        dq_write_order: Optional[Tensor] = None,
        dq_write_order_full: Optional[Tensor] = None,
        dq_kv_order: "Optional[Tensor | bool]" = None,
    ) -> "BlockMask":
        """BlockMask from its kv side; the q side (q_*, full_q_*) is computed.

        Args:
            kv_num_blocks: int32 [B, H, nQ]; kv_indices: int32 [B, H, nQ, nKV] (partial blocks).
            full_kv_num_blocks, full_kv_indices: same shapes (full blocks), or both None.
            BLOCK_SIZE: int or (BQ, BKV), positive multiples of 16.
            mask_mod: applied in partial blocks; None means :func:`noop_mask`.
            seq_lengths: (Q_LEN, KV_LEN); None means (nQ * BQ, nKV * BKV).
            compute_q_blocks: False leaves the q side None, as torch (where that means no backward); flexlite's
                backward then transposes the kv side when it runs.
            dq_write_order, dq_write_order_full, dq_kv_order: torch's metadata for its FLASH backend, kept and not
                used (see :class:`BlockMask`).
        """
        caller = "BlockMask.from_kv_blocks"
        kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices = _int32_lists(
            (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices))
        compute_q_blocks = check_bool(caller, "compute_q_blocks", compute_q_blocks)
        _check_kv_pair("", kv_num_blocks, kv_indices)
        if (full_kv_num_blocks is None) != (full_kv_indices is None):
            raise ValueError(f"{caller}: full_kv_num_blocks and full_kv_indices must be both given or both None")
        if full_kv_num_blocks is not None:
            _check_kv_pair("full_", full_kv_num_blocks, full_kv_indices)
            if full_kv_indices.shape != kv_indices.shape:
                raise ValueError(f"{caller}: full_kv_indices shape {tuple(full_kv_indices.shape)} must "
                                 f"equal kv_indices shape {tuple(kv_indices.shape)}")
        tensors = [t for t in (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices) if t is not None]
        if len({t.device for t in tensors}) > 1:
            raise ValueError(f"{caller}: kv_* and full_kv_* tensors must be on one device; "
                             f"got {[str(t.device) for t in tensors]}")
        _check_kv_values("", kv_num_blocks, kv_indices)
        if full_kv_num_blocks is not None:
            _check_kv_values("full_", full_kv_num_blocks, full_kv_indices)
            _check_partial_full_disjoint(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)
        block_size = _normalize_block_size(caller, BLOCK_SIZE)
        if mask_mod is not None:
            _check_mask_mod(caller, mask_mod)
        if seq_lengths is None:
            seq_lengths = (kv_indices.shape[-2] * block_size[0], kv_indices.shape[-1] * block_size[1])
        seq_lengths = _check_seq_lengths(seq_lengths)
        mask = cls._from_kv_side(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, block_size,
                                 mask_mod, seq_lengths, compute_q_blocks)
        mask.dq_write_order, mask.dq_write_order_full, mask.dq_kv_order = \
            dq_write_order, dq_write_order_full, dq_kv_order
        return mask

    @classmethod
    def _from_kv_side(cls, kv_num_blocks: Tensor, kv_indices: Tensor, full_kv_num_blocks: Optional[Tensor],
                      full_kv_indices: Optional[Tensor], block_size: tuple[int, int], mask_mod: Optional[_MaskMod],
                      seq_lengths: tuple[int, int], compute_q_blocks: bool = True) -> "BlockMask":
        """:meth:`from_kv_blocks` without its checks, for kv-side tensors already known to be valid (slices of
        a BlockMask): its value checks read the tensors on the host, a sync per call."""
        q_side = q_sides(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices) if compute_q_blocks else (
            None, None, None, None)
        return cls(seq_lengths, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, *q_side,
                   BLOCK_SIZE=block_size, mask_mod=mask_mod if mask_mod is not None else noop_mask)

    def _adjust(self, new_q_len: int, new_kv_len: int) -> "BlockMask":
        """This mask cropped to ``new_q_len`` x ``new_kv_len`` (at most its own lengths), keeping its upper-left
        corner, as torch's ``BlockMask._adjust``: right where the mask of the shorter sequences is that corner
        (causal, sliding window, prefix-LM from the start), wrong for masks measured from the end (bottom-right
        causal) or from the length (rebuild those with create_block_mask). mask_mod is kept."""
        caller = "BlockMask._adjust"
        new_q_len = _check_positive_int(caller, "new_q_len", new_q_len)
        new_kv_len = _check_positive_int(caller, "new_kv_len", new_kv_len)
        if new_q_len > self.seq_lengths[0] or new_kv_len > self.seq_lengths[1]:
            raise ValueError(f"{caller}: can only crop; ({new_q_len}, {new_kv_len}) exceeds this mask's seq_lengths "
                             f"{tuple(self.seq_lengths)}: build the mask for the longer sequences with "
                             f"create_block_mask")
        rows, cols = -(-new_q_len // self.BLOCK_SIZE[0]), -(-new_kv_len // self.BLOCK_SIZE[1])

        def crop(num_blocks, indices):
            if num_blocks is None:
                return None, None
            return _dense_to_ordered(_ordered_to_dense(num_blocks, indices, indices.shape[-1])[..., :rows, :cols])

        return BlockMask._from_kv_side(*crop(self.kv_num_blocks, self.kv_indices),
                                       *crop(self.full_kv_num_blocks, self.full_kv_indices), tuple(self.BLOCK_SIZE),
                                       self.mask_mod, (new_q_len, new_kv_len), self.q_indices is not None)

    @classmethod
    def _from_block_flags(cls, partial: Tensor, full: Optional[Tensor], seq_lengths: tuple[int, int],
                          BLOCK_SIZE: tuple[int, int], mask_mod: _MaskMod) -> "BlockMask":
        """BlockMask from bool block flags partial / full [B, H, nQ, nKV] (full may be None)."""
        def both_sides(flags):
            if flags is None:
                return (None, None), (None, None)
            return _dense_to_ordered(flags), _dense_to_ordered(flags.transpose(-2, -1))

        (kv_n, kv_i), (q_n, q_i) = both_sides(partial)
        (fkv_n, fkv_i), (fq_n, fq_i) = both_sides(full)
        return cls(seq_lengths, kv_n, kv_i, fkv_n, fkv_i, q_n, q_i, fq_n, fq_i,
                   BLOCK_SIZE=BLOCK_SIZE, mask_mod=mask_mod)

    # -- views -------------------------------------------------------------------------------------

    @property
    def shape(self) -> tuple[int, ...]:
        """(B, H, Q_LEN, KV_LEN)."""
        return tuple(self.kv_indices.shape[:-2]) + tuple(self.seq_lengths)

    @property
    def device(self) -> torch.device:
        return self.kv_num_blocks.device

    def numel(self) -> int:
        """B * H * Q_LEN * KV_LEN (positions covered, ignoring sparsity)."""
        return functools.reduce(operator.mul, self.shape, 1)

    def dense_blocks(self, full: bool) -> Tensor:
        """bool [B, H, nQ, nKV]: the full blocks (``full=True``; all False if there are none) or the
        partial blocks (``full=False``)."""
        n_cols = self.kv_indices.shape[-1]
        if not full:
            return _ordered_to_dense(self.kv_num_blocks, self.kv_indices, n_cols)
        if self.full_kv_num_blocks is None:
            return torch.zeros(self.kv_indices.shape[:-1] + (n_cols,), dtype=torch.bool, device=self.device)
        return _ordered_to_dense(self.full_kv_num_blocks, self.full_kv_indices, n_cols)

    def to_dense(self) -> Tensor:
        """int32 [B, H, nQ, nKV]: 1 where a block is computed (partial or full), else 0 (as torch)."""
        return (self.dense_blocks(full=False) | self.dense_blocks(full=True)).to(torch.int32)

    def sparsity(self) -> float:
        """Percentage of blocks that are empty (skipped).

        Counted in blocks; torch counts block areas against Q_LEN * KV_LEN, which differs (and
        can go negative) when the lengths are not multiples of BLOCK_SIZE. A mask without blocks (a slice
        such as ``block_mask[:, :, n:]`` past its last q block, or of no batch / head) computes nothing: 100.0.
        """
        total = self.kv_num_blocks.numel() * self.kv_indices.shape[-1]
        if total == 0:  # (not a ZeroDivisionError out of print(block_mask))
            return 100.0
        computed = self.kv_num_blocks.sum()
        if self.full_kv_num_blocks is not None:
            computed = computed + self.full_kv_num_blocks.sum()
        return 100.0 * (1.0 - computed.item() / total)

    def as_tuple(self, flatten: bool = True) -> tuple:
        """(Q_LEN, KV_LEN, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
        q_num_blocks, q_indices, full_q_num_blocks, full_q_indices, dq_write_order, dq_write_order_full,
        dq_kv_order, dq_kv_order_spt, BQ, BKV, mask_mod), as torch's; with ``flatten=False`` the lengths and block
        sizes stay tuples."""
        seq_lengths = tuple(self.seq_lengths) if flatten else (self.seq_lengths,)
        block_size = tuple(self.BLOCK_SIZE) if flatten else (self.BLOCK_SIZE,)
        return (*seq_lengths, *(getattr(self, a) for a in self._TENSOR_ATTRS + self._DQ_ATTRS), *block_size,
                self.mask_mod)

    def __getitem__(self, index) -> "BlockMask":
        """Slice over batch, head (and q block) like torch: ints keep their dimension, so the
        result stays [B', H', nQ', ...]. The q side is recomputed (where this mask has one: a mask built without it,
        ``compute_q_blocks=False``, slices to one without it, as torch) and ``mask_mod`` is reset to one that raises
        (as torch): assign a mask_mod derived from the original's."""
        index = self._check_index(index)
        padded = (*index, slice(None), slice(None), slice(None))[:3]
        sizes = self.kv_num_blocks.shape[:3]
        index = tuple(self._int_to_slice(i, n) for i, n in zip(padded, sizes))
        full = ((self.full_kv_num_blocks[index], self.full_kv_indices[index])
                if self.full_kv_num_blocks is not None else (None, None))
        # slices of valid blocks are valid: no value checks (no host sync when slicing per decode step)
        return BlockMask._from_kv_side(self.kv_num_blocks[index], self.kv_indices[index], *full,
                                       tuple(self.BLOCK_SIZE), _sliced_mask_mod_error, tuple(self.seq_lengths),
                                       self.q_indices is not None)

    @staticmethod
    def _check_index(index) -> tuple:
        """``index`` as a tuple of at most 3 entries (batch, head, q block), ``...`` expanded; each an int, a
        slice, or (in one position) a 1-D integer or bool tensor, numpy array or list, as torch takes them: others
        would change the number of dimensions or index the kv_indices' columns."""
        index = index if isinstance(index, tuple) else (index,)
        if sum(i is Ellipsis for i in index) > 1:
            raise IndexError("BlockMask index: an index can only have a single ellipsis ('...')")
        if any(i is Ellipsis for i in index):
            at = next(n for n, i in enumerate(index) if i is Ellipsis)
            rest = index[:at] + index[at + 1:]
            index = index[:at] + (slice(None),) * max(0, 3 - len(rest)) + index[at + 1:]
        if len(index) > 3:
            raise IndexError(f"BlockMask index: too many indices ({len(index)}); a BlockMask is indexed over "
                             f"(batch, head, q block) only")
        advanced = 0
        index = tuple(torch.as_tensor(i) if type(i).__module__ == "numpy" and hasattr(i, "ndim") and i.ndim else i
                      for i in index)  # (a numpy array; its scalars are ints)
        for i in index:
            if isinstance(i, (list, Tensor)):
                t = torch.as_tensor(i) if isinstance(i, list) else i
                if t.dim() != 1 or not (t.numel() == 0 or (not t.dtype.is_floating_point and not t.dtype.is_complex)):
                    raise TypeError(f"BlockMask index: a tensor, array or list index must be 1-D integers or bools; "
                                    f"got {t.dtype} of shape {tuple(t.shape)}")
                advanced += 1
            elif not (_is_int(i) or isinstance(i, slice)):
                raise TypeError(f"BlockMask index: entries must be ints, slices, '...' or 1-D integer tensors; got "
                                f"{type(i).__name__} {i!r}")
            elif isinstance(i, slice) and i.step is not None and not (_is_int(i.step) and i.step > 0):
                raise ValueError(f"BlockMask index: a slice's step must be a positive int (torch's tensors take no "
                                 f"negative steps either); got {i!r}")
        if advanced > 1:
            raise IndexError("BlockMask index: at most one tensor / list index (index the others one at a time)")
        return index

    @staticmethod
    def _int_to_slice(i, n: int):
        if not _is_int(i):
            return i
        if not -n <= i < n:
            raise IndexError(f"BlockMask index {i} is out of range for a dimension of size {n}")
        i = i + n if i < 0 else i
        return slice(i, i + 1)

    def to(self, device: Union[torch.device, str]) -> "BlockMask":
        """A new BlockMask with every tensor moved to ``device``."""
        device = check_device("BlockMask.to", device, any_type=True)  # "meta" too, as torch
        moved = {a: getattr(self, a) for a in self._TENSOR_ATTRS + self._DQ_ATTRS}
        moved = {a: (t.to(device) if isinstance(t, Tensor) else t) for a, t in moved.items()}
        return BlockMask(self.seq_lengths, **moved, BLOCK_SIZE=self.BLOCK_SIZE, mask_mod=self.mask_mod)

    # -- printing ------------------------------------------------------------------------------

    _GLYPHS = ("  ", "░░", "██")  # empty, partial (or mixed), full

    def to_string(self, grid_size: Union[int, tuple[int, int]] = (20, 20), limit: int = 4) -> str:
        """Text picture of the blocks of each (b, h): ``██`` full, ``░░`` partial, blank empty.

        A grid larger than ``grid_size`` (rows, cols; an int for both; -1 or less for no limit) is
        downsampled: a cell stands for several blocks and shows ██ if all are full, blank if all
        are empty, ░░ otherwise. At most ``limit`` (b, h) grids are printed, then "...".
        """
        sizes = (grid_size, grid_size) if _is_int(grid_size) else grid_size
        if not (isinstance(sizes, (tuple, list)) and len(sizes) == 2 and all(map(_is_int, sizes))):
            raise TypeError(f"BlockMask.to_string: grid_size must be an int or a (rows, cols) tuple of ints; got "
                            f"{grid_size!r}")
        if 0 in sizes:
            raise ValueError(f"BlockMask.to_string: grid_size {grid_size!r} has no rows or columns to print; give "
                             f"positive sizes, or -1 for no limit")
        if not _is_int(limit):
            raise TypeError(f"BlockMask.to_string: limit must be an int (the number of (batch, head) grids to "
                            f"print); got {type(limit).__name__} {limit!r}")
        full = self.dense_blocks(full=True)
        nonempty = self.dense_blocks(full=False) | full
        *batch_dims, n_rows, n_cols = nonempty.shape
        max_rows, max_cols = sizes
        row_step = max(1, cdiv(n_rows, max_rows)) if max_rows > 0 else 1
        col_step = max(1, cdiv(n_cols, max_cols)) if max_cols > 0 else 1
        # 0 empty, 1 some non-empty block, 2 all full (a cell always holds at least one block)
        codes = (_block_any(nonempty, row_step, col_step).to(torch.int8)
                 + _block_all(full, row_step, col_step).to(torch.int8))

        grids = []
        for count, batch_idx in enumerate(itertools.product(*map(range, batch_dims))):
            if count == limit:
                grids += ["...", "To print out more, set BlockMask.to_string(limit=N)",
                          "You can also index (BlockMask[batch, head]) to choose a specific batch or head"]
                break
            rows = codes[batch_idx].tolist()
            grids.append(f"{batch_idx}\n" + "".join(
                "".join(self._GLYPHS[c] for c in row) + "\n" for row in rows))
        return "\n".join(grids)

    def __str__(self) -> str:
        return (f"BlockMask(shape={self.shape}, sparsity={self.sparsity():.2f}%, \n"
                f"{self.to_string().rstrip(chr(10))}\n)")

    def __repr__(self) -> str:
        def shape_or_none(t):
            return t.shape if t is not None else None
        fields = "".join(f"    {a}={shape_or_none(getattr(self, a))},\n" for a in self._TENSOR_ATTRS)
        return (f"BlockMask(\n{fields}"
                f"    BLOCK_SIZE={self.BLOCK_SIZE},\n"
                f"    shape={self.shape},\n"
                f"    sparsity={self.sparsity():.2f}%,\n"
                f"    mask_mod={_mod_name(self.mask_mod)}\n"
                f")")


# ----------------------------------------------------------------------------------------------
# create_block_mask / create_mask
# ----------------------------------------------------------------------------------------------

def _as_bool_mask(mask: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Check a vmapped mask_mod result: bool [B, H, Lq, Lkv]."""
    if mask.dtype != torch.bool:
        raise TypeError(f"create_block_mask: mask_mod must return a bool tensor; got {mask.dtype}")
    if tuple(mask.shape) != shape:
        raise ValueError("create_block_mask: mask_mod must return one value per (b, h, q_idx, kv_idx); "
                         f"evaluated over {shape} it gave shape {tuple(mask.shape)}")
    return mask


def _block_flags(mask_mod: _MaskMod, B: int, H: int, Q_LEN: int, KV_LEN: int, device: torch.device,
                 block_size: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """(any, all): bool [B, H, nQ, nKV], whether mask_mod is True at any / all in-range positions
    of each block. On CUDA a generated Triton kernel evaluates the mask block by block; elsewhere
    mask_mod is vmapped over chunks of at most _CHUNK_ELEMENTS positions (see :func:`_chunks`), and on CUDA too while
    a new mask_mod's kernel compiles beside (:func:`first_calls.block_flags_in_torch`)."""
    if device.type != "cuda":
        return _block_flags_vmap(mask_mod, B, H, Q_LEN, KV_LEN, device, block_size)
    from . import first_calls  # (it imports this module)

    device = check_device("create_block_mask", device)  # "cuda" names the current GPU, as captures do
    kernel, module = _mask_kernel(mask_mod, device)
    key = first_calls.block_mask_key(kernel.source, H, Q_LEN, KV_LEN, device, block_size)
    run = functools.partial(_run_mask_kernel, kernel, module, B, H, Q_LEN, KV_LEN, device, block_size)
    if first_calls.block_flags_in_torch(key, run, B * H * Q_LEN * KV_LEN):
        try:
            return _block_flags_vmap(mask_mod, B, H, Q_LEN, KV_LEN, device, block_size, _CUDA_CHUNK_ELEMENTS)
        except Exception:  # noqa: BLE001 - a shortcut only: the kernel decides (and raises what it raises) as always
            first_calls.wait_for(key)
    flags = run()
    first_calls.mark_ready(key)
    return flags


def _mask_kernel(mask_mod: _MaskMod, device: torch.device) -> tuple:
    """(the generated block-mask kernel of ``mask_mod``, its loaded module)."""
    from .api import check_captured  # api imports this module
    from .codegen.kernel import generate
    from .runtime.compile import load_module

    interpret = device.type != "cuda"
    kernel = generate("block_mask.py.jinja", None, mask_mod, interpret=interpret)
    if kernel.mask_mod.result_dtype not in (None, torch.bool):
        raise TypeError(f"create_block_mask: mask_mod must return a bool tensor; got {kernel.mask_mod.result_dtype}")
    check_captured(kernel.captured, device, "create_block_mask", "mask_mod")
    return kernel, load_module(kernel.source, interpret=interpret)


def _block_flags_kernel(mask_mod: _MaskMod, B: int, H: int, Q_LEN: int, KV_LEN: int, device: torch.device,
                        block_size: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """:func:`_block_flags` by the generated block-mask kernel (the same codegen as the attention
    kernels): O(number of blocks) memory. On CPU it runs through Triton's interpreter (tests)."""
    device = check_device("create_block_mask", device)  # "cuda" names the current GPU, as captures do
    return _run_mask_kernel(*_mask_kernel(mask_mod, device), B, H, Q_LEN, KV_LEN, device, block_size)


def _run_mask_kernel(kernel, module, B: int, H: int, Q_LEN: int, KV_LEN: int, device: torch.device,
                     block_size: tuple[int, int]) -> tuple[Tensor, Tensor]:
    with on_device(device):
        return launch_block_mask(module, kernel.mod_args(), B, H, Q_LEN, KV_LEN, block_size, device)


def _block_flags_vmap(mask_mod: _MaskMod, B: int, H: int, Q_LEN: int, KV_LEN: int, device: torch.device,
                      block_size: tuple[int, int], chunk_elements: Optional[int] = None) -> tuple[Tensor, Tensor]:
    bq, bkv = block_size
    n_q, n_kv = cdiv(Q_LEN, bq), cdiv(KV_LEN, bkv)
    any_flags = torch.empty((B, H, n_q, n_kv), dtype=torch.bool, device=device)
    all_flags = torch.empty_like(any_flags)
    mask_fn = vmap_bhqkv(mask_mod)
    for (b0, b1), (h0, h1), (r0, r1), (c0, c1) in _chunks(B, H, n_q, n_kv, bq, bkv, KV_LEN, chunk_elements):
        q0, q1 = r0 * bq, min(r1 * bq, Q_LEN)
        k0, k1 = c0 * bkv, min(c1 * bkv, KV_LEN)
        mask = mask_fn(*index_vectors(b1 - b0, h1 - h0, q1 - q0, k1 - k0, device, q_start=q0, kv_start=k0,
                                      b_start=b0, h_start=h0))
        mask = _as_bool_mask(mask, (b1 - b0, h1 - h0, q1 - q0, k1 - k0))
        any_flags[b0:b1, h0:h1, r0:r1, c0:c1] = _block_any(mask, bq, bkv)
        all_flags[b0:b1, h0:h1, r0:r1, c0:c1] = _block_all(mask, bq, bkv)
    return any_flags, all_flags


def _chunks(B: int, H: int, n_q: int, n_kv: int, bq: int, bkv: int, KV_LEN: int, chunk: Optional[int] = None):
    """(b, h, q block row, kv block column) ranges covering the mask, each of at most ``chunk`` positions (default
    _CHUNK_ELEMENTS; but at least one block): whole rows for every (b, h) when they fit, else rows of one (b, h),
    else column pieces of one row."""
    chunk = chunk or _CHUNK_ELEMENTS

    def spans(n, step):
        return [(i, min(i + step, n)) for i in range(0, n, step)]
    row = bq * KV_LEN
    if B * H * row <= chunk:
        bh = [((0, B), (0, H))]
        rows, cols = spans(n_q, chunk // (B * H * row)), [(0, n_kv)]
    else:
        bh = [((b, b + 1), (h, h + 1)) for b in range(B) for h in range(H)]
        if row <= chunk:
            rows, cols = spans(n_q, chunk // row), [(0, n_kv)]
        else:
            rows, cols = spans(n_q, 1), spans(n_kv, max(1, chunk // (bq * bkv)))
    for b, h in bh:
        for r in rows:
            for c in cols:
                yield b, h, r, c


def is_torch_block_mask(block_mask) -> bool:
    """Whether ``block_mask`` is torch's ``torch.nn.attention.flex_attention.BlockMask`` (by name: no import)."""
    cls = type(block_mask)
    return cls.__name__ == "BlockMask" and cls.__module__ == "torch.nn.attention.flex_attention"


def _without_blocks_past_the_end(num_blocks: Tensor, indices: Tensor) -> tuple:
    """A torch BlockMask's kv lists with the entries of their counted prefixes that name no block (an index past
    the lists' width: torch's ``_adjust`` to a shorter key length leaves such entries, which torch's kernels mask
    out as keys past the end) taken out, the rest in their order. No host sync."""
    n = indices.shape[-1]
    cols = torch.arange(n, device=indices.device)
    valid = (cols < num_blocks[..., None]) & (indices >= 0) & (indices < n)
    order = torch.sort((~valid).to(torch.int8), dim=-1, stable=True).indices
    return valid.sum(-1, dtype=torch.int32), torch.gather(indices, -1, order)


def from_torch_block_mask(block_mask) -> BlockMask:
    """flexlite's BlockMask for torch's: the same tensors (but the kv lists, without entries past their width:
    :func:`_without_blocks_past_the_end`; no host sync), lengths, block size and mask_mod, so that a mask built with
    torch's create_block_mask (or by attention-gym code) runs in flexlite as it is. Kept on
    torch's object and made again only when one of those attributes is replaced (a slice's mask_mod assigned, new
    seq_lengths: gpt-fast's decoding), so per-mask state (the walk count) is not lost between calls."""
    caller = "flex_attention: block_mask (torch's BlockMask)"
    tensors = tuple(getattr(block_mask, n, None) for n in BlockMask._TENSOR_ATTRS)

    def convert():
        lists = list(_int32_lists(tensors))
        _check_kv_pair("", lists[0], lists[1], caller)
        if lists[2] is not None:
            _check_kv_pair("full_", lists[2], lists[3], caller)
        for i in (0, 2) if lists[2] is not None else (0,):
            lists[i:i + 2] = _without_blocks_past_the_end(lists[i], lists[i + 1])
        try:
            block_size = _normalize_block_size(caller, block_mask.BLOCK_SIZE)  # (an int too, as torch's own stores it)
        except ValueError as e:
            raise ValueError(f"{e}: rebuild the mask with flexlite.create_block_mask (same arguments, BLOCK_SIZE a "
                             f"multiple of 16)") from None
        for name, t in zip(BlockMask._TENSOR_ATTRS[4:], lists[4:]):  # (the q side, which the BlockMask checks)
            if t is not None and not isinstance(t, Tensor):
                raise TypeError(f"{caller}: {name} must be an int32 Tensor or None; got {type(t).__name__}")
        return BlockMask(_check_seq_lengths(block_mask.seq_lengths, caller), *lists, BLOCK_SIZE=block_size,
                         mask_mod=block_mask.mask_mod if block_mask.mask_mod is not None else noop_mask)

    def as_key(value):  # (seq_lengths and BLOCK_SIZE as torch holds them: tuples, lists, an int)
        return tuple(value) if isinstance(value, (tuple, list)) else value
    key = (tensors_key(tensors), as_key(block_mask.seq_lengths), as_key(block_mask.BLOCK_SIZE),
           id(block_mask.mask_mod))
    return kept_on(block_mask, "_flexlite_block_mask", key, convert)


@opaque_to_compile  # Dynamo would trace into the mask kernel's launch
@torch.inference_mode(False)  # its tensors keep version counters under inference mode too (tensors_key)
def create_block_mask(
    mask_mod: _MaskMod,
    B: Optional[int],
    H: Optional[int],
    Q_LEN: int,
    KV_LEN: int,
    device=None,
    BLOCK_SIZE: Union[int, tuple[int, int]] = _DEFAULT_SPARSE_BLOCK_SIZE,
    _compile: bool = False,
    separate_full_blocks: bool = True,
    compute_dq_write_order: bool = False,
    dq_kv_order: bool = True,
) -> BlockMask:
    """Build the BlockMask of ``mask_mod`` over [B, H, Q_LEN, KV_LEN].

    Args:
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (0-d int32 tensors in, True = keep).
        B, H: batch and heads; None means 1 (the mask broadcasts over that dimension).
        Q_LEN, KV_LEN: sequence lengths.
        device: where to evaluate mask_mod and keep the result. None means "cuda" if
            ``torch.cuda.is_available()`` else "cpu" (torch's default is its current accelerator).
        BLOCK_SIZE: int or (BQ, BKV), positive multiples of 16.
        _compile: accepted for compatibility with torch's signature; ignored.
        separate_full_blocks: if False, full blocks are listed as partial ones (full_* are None).
        compute_dq_write_order, dq_kv_order: accepted (bools) for torch's signature, no effect: torch's FLASH backend
            needs that metadata for a deterministic dQ; flexlite's backward is deterministic under
            ``torch.use_deterministic_algorithms(True)`` (its separate dQ kernel) without it.

    Returns:
        BlockMask with kv_num_blocks [B, H, nQ], kv_indices [B, H, nQ, nKV] and the full / q-side
        counterparts. The dense mask is never materialised: on CUDA a generated Triton kernel
        evaluates mask_mod block by block (extra memory O(number of blocks)); elsewhere mask_mod is
        vmapped over chunks of q block rows (about 2**24 positions; O(number of blocks + one chunk)),
        and on CUDA too (chunks of 2**22) for a new mask_mod's masks of at most
        first_calls.MAX_TORCH_POSITIONS positions while its kernel compiles beside.
    """
    caller = "create_block_mask"
    _check_mask_mod(caller, mask_mod)
    # the kernels need it traced; untraceable code or a wrong result type fails here, clearly
    traced = check_mod_output(mask_mod, "mask_mod", caller, allow_constant=False, check_shape=True)
    _warn_if_broadcast_hides(traced, B, H)
    B = _check_positive_int(caller, "B", B, allow_none=True)
    H = _check_positive_int(caller, "H", H, allow_none=True)
    Q_LEN = _check_positive_int(caller, "Q_LEN", Q_LEN)
    KV_LEN = _check_positive_int(caller, "KV_LEN", KV_LEN)
    block_size = _normalize_block_size(caller, BLOCK_SIZE)
    separate_full_blocks, compute_dq_write_order, dq_kv_order = (
        check_bool(caller, name, flag) for name, flag in (("separate_full_blocks", separate_full_blocks),
                                                          ("compute_dq_write_order", compute_dq_write_order),
                                                          ("dq_kv_order", dq_kv_order)))
    device = check_device(caller, device)
    from .api import check_captured  # (api imports this module)
    check_captured(traced.captured.values(), device, caller, "mask_mod")  # (every path: the kernel's and torch's)

    any_blocks, all_blocks = _block_flags(mask_mod, B, H, Q_LEN, KV_LEN, device, block_size)
    if separate_full_blocks:
        partial, full = any_blocks & ~all_blocks, all_blocks
    else:
        partial, full = any_blocks, None
    block_mask = BlockMask._from_block_flags(partial, full, (Q_LEN, KV_LEN), block_size, mask_mod)
    # (with the lists and mask_mod themselves, so that no other object takes their ids while the key is kept)
    block_mask._exact = (lists_key(block_mask), block_mask.kv_num_blocks, block_mask.kv_indices,
                         block_mask.full_kv_num_blocks, block_mask.full_kv_indices, mask_mod)
    return block_mask


def lists_key(block_mask: BlockMask) -> tuple:
    """What :func:`create_block_mask` made ``block_mask`` from (its kv block lists, unmodified, and its mask_mod):
    while these are the same, its absent blocks are all False under mask_mod and its full blocks all True."""
    return tensors_key(t for t in (block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
                                   block_mask.full_kv_indices) if t is not None) + (id(block_mask.mask_mod),)


def item_lists(block_mask: BlockMask, rows: int) -> Optional[tuple]:
    """The kv block lists of ``block_mask`` for q blocks of ``rows`` rows instead of its own: (kv_num_blocks,
    kv_indices, full_kv_num_blocks, full_kv_indices), a kv block full where it is full for every q block the rows
    cover and partial where it is listed for any but not full for all (mask_mod then decides each position). Exact
    only for a block mask whose absent blocks are all False under its mask_mod and full blocks all True, as
    :func:`create_block_mask` makes them: None for any other (a user's block lists, a modified one, torch's).

    The partial blocks are listed from the last kv block down: the warp-specialized forward's warpgroups skip the
    first ones of a walk that keep none of their rows (fwd_ws.py.jinja's ws_empty_lead; a causal diagonal's blocks
    past a warpgroup's rows come first so)."""
    if getattr(block_mask, "_exact", (None,))[0] != lists_key(block_mask):
        return None
    bq = block_mask.BLOCK_SIZE[0]
    q_len = block_mask.seq_lengths[0]
    partial, full = block_mask.dense_blocks(full=False), block_mask.dense_blocks(full=True)
    device = partial.device
    first = torch.arange(0, q_len, rows, device=device)  # each item's first and last row, their q blocks
    last = torch.clamp(first + rows, max=q_len) - 1
    span = -(-rows // bq) + 1
    covered = torch.minimum(first[:, None] // bq + torch.arange(span, device=device), last[:, None] // bq)
    listed = (partial | full)[..., covered, :].any(dim=-2)  # [..., items, span, nKV] -> [..., items, nKV]
    all_full = full[..., covered, :].all(dim=-2)
    num, idx = _dense_to_ordered((listed & ~all_full).flip(-1))
    idx = (listed.shape[-1] - 1 - idx).to(torch.int32)
    if block_mask.full_kv_num_blocks is None:
        return num, idx, None, None
    return (num, idx, *_dense_to_ordered(all_full))


def _outside_flexlite() -> int:
    """The stacklevel of warnings.warn called here that names the first frame outside flexlite's package, the
    torch.compile guard around its entry points and torch's context decorators (the user's line)."""
    dynamo = sys.modules.get("torch._dynamo")  # (not imported for this: none of its frames then)
    inside = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (sys.modules[__name__], dynamo)
                   if m is not None) + (os.path.abspath(torch.utils._contextlib.__file__),)
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


def _warn_if_broadcast_hides(traced, B: Optional[int], H: Optional[int]) -> None:
    """A UserWarning where mask_mod reads ``b`` or ``h`` but the block mask is built for B or H None: its blocks are
    those of index 0, broadcast (as torch's), so a block full there is taken as full for every batch or head, where
    mask_mod is not called (torch's create_block_mask does the same, silently)."""
    read = arguments_read(traced)
    hidden = [(arg, dim, what) for arg, dim, what, size in (("b", "B", "the batch size", B),
                                                            ("h", "H", "the number of heads", H))
              if size is None and arg in read]
    if hidden:
        args, dims = " and ".join(h[0] for h in hidden), " and ".join(h[1] for h in hidden)
        sizes = " and ".join(f"{h[1]} ({h[2]})" for h in hidden)
        warnings.warn(f"create_block_mask: mask_mod {traced.name!r} reads {args}, but {dims} "
                      f"{'are' if len(hidden) > 1 else 'is'} None: the blocks are "
                      f"those of {args} = 0 for every one, and a block full there is taken as full (mask_mod is not "
                      f"called) for the others; pass {sizes} if the mask differs between them",
                      UserWarning, stacklevel=_outside_flexlite())


def create_mask(
    mod_fn: Callable,
    B: Optional[int],
    H: Optional[int],
    Q_LEN: int,
    KV_LEN: int,
    device=None,
) -> Tensor:
    """Dense mask of a mod over all positions: bool [B, H, Q_LEN, KV_LEN] (B, H None -> 1).

    ``mod_fn`` is a mask_mod (4 arguments: its value) or, as torch, a score_mod (5 arguments: True
    where ``score_mod(0.0, b, h, q_idx, kv_idx)`` is not -inf). Materialises the whole mask: for
    tests and visualisation. ``device`` defaults as in :func:`create_block_mask`.
    """
    caller = "create_mask"
    if not callable(mod_fn):
        raise TypeError(f"{caller}: mod_fn must be callable; got {type(mod_fn).__name__}")
    n_args = (positional_arity(mod_fn) or (4,))[0]  # unknown arity (*args): treat as a mask_mod
    if n_args not in (4, 5):
        raise TypeError(f"{caller}: mod_fn must be a mask_mod(b, h, q_idx, kv_idx) or a "
                        f"score_mod(score, b, h, q_idx, kv_idx); got a function of {n_args} arguments")
    B = _check_positive_int(caller, "B", B, allow_none=True)
    H = _check_positive_int(caller, "H", H, allow_none=True)
    Q_LEN = _check_positive_int(caller, "Q_LEN", Q_LEN)
    KV_LEN = _check_positive_int(caller, "KV_LEN", KV_LEN)
    device = check_device(caller, device)
    # untraceable code or a wrong result type: a clear error, not vmap's
    kind = "mask_mod" if n_args == 4 else "score_mod"
    check_captured_device(check_mod_output(mod_fn, kind, caller, allow_constant=False, check_shape=True
                                           ).captured.values(), device, caller, kind)
    indices = index_vectors(B, H, Q_LEN, KV_LEN, device)
    if n_args == 4:
        return vmap_bhqkv(mod_fn)(*indices)
    scores = torch.zeros(B, H, Q_LEN, KV_LEN, device=device)
    return ~torch.isneginf(vmap_bhqkv(mod_fn, prefix=(0,))(scores, *indices))
