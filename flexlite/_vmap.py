"""Evaluate a mod densely over (b, h, q_idx, kv_idx) with nested torch.vmap, as torch's math path does.

Both the fp64 reference and the block-mask builder use this, so a mod means the same thing to
both: vmap gives every index a 0-d value, which is what the traced kernels see too (nested
indexing such as ``intervals[image_of[kv_idx]][0]`` would mean something else under plain
broadcasting).
"""

from __future__ import annotations

from typing import Callable

import torch

# innermost first: kv, q, h, b
_BHQKV_DIMS = ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None))


def vmap_bhqkv(fn: Callable, prefix: tuple = ()) -> Callable:
    """Return ``fn`` vectorised over 1-D index tensors b, h, q_idx, kv_idx -> [B, H, Q, KV].

    ``prefix`` gives the in_dims of leading arguments (for score_mod: ``(0,)``, a [B, H, Q, KV]
    score tensor peeled one dimension per vmap level).
    """
    batched = _tensor_valued(fn)
    for dims in _BHQKV_DIMS:
        batched = torch.vmap(batched, in_dims=prefix + dims, out_dims=0)
    return _with_clear_errors(batched, "score_mod" if prefix else "mask_mod", fn)


def vmap_positions(fn: Callable) -> Callable:
    """Return score_mod ``fn`` vectorised over a list of positions: score, b, h, q_idx and kv_idx each a 1-D tensor
    with an entry per position -> a value per position. As under :func:`vmap_bhqkv`, ``fn`` sees 0-d values."""
    return _with_clear_errors(torch.vmap(_tensor_valued(fn)), "score_mod", fn)


def _tensor_valued(fn: Callable) -> Callable:
    def tensor_valued(*args):  # a mod may return a Python constant (the kernels take one); vmap takes only tensors
        out = fn(*args)
        if isinstance(out, (bool, int, float)):
            out = torch.tensor(out, dtype=torch.float64 if isinstance(out, float) else None, device=args[-1].device)
        return out
    return tensor_valued


def _with_clear_errors(batched: Callable, kind: str, fn: Callable) -> Callable:
    name = f"{kind} {getattr(fn, '__name__', type(fn).__name__)!r}"

    def evaluate(*args):
        try:
            return batched(*args)
        except IndexError as e:  # the common mistake, with the lengths in view
            raise ValueError(f"{name} indexed a tensor out of range evaluated over the sequence's positions ({e}): "
                             f"a captured tensor (document ids, a bias table) shorter than the sequence, or document "
                             f"lengths that do not add up to it? Size it to the lengths the mask is built for") from e
        except RuntimeError as e:
            if "vmap" in str(e) and "dynamic shape" in str(e):
                raise NotImplementedError(f"{name} is evaluated position by position (torch.vmap), where an op with a "
                                          f"data-dependent output shape (nonzero, masked_select, boolean indexing) "
                                          f"cannot run: write it with torch.where / comparisons ({e})") from e
            raise
    return evaluate


def index_vectors(B: int, H: int, Q_LEN: int, KV_LEN: int, device, q_start: int = 0, kv_start: int = 0,
                  b_start: int = 0, h_start: int = 0):
    """int32 index vectors (b, h, q_idx, kv_idx), as the kernels use: ``B`` batch indices from
    ``b_start``, ``H`` heads from ``h_start``, and so on."""
    kw = dict(device=device, dtype=torch.int32)
    return (torch.arange(b_start, b_start + B, **kw), torch.arange(h_start, h_start + H, **kw),
            torch.arange(q_start, q_start + Q_LEN, **kw), torch.arange(kv_start, kv_start + KV_LEN, **kw))
