"""Pictures of masks and scores.

* Text: ``print(block_mask)`` / :meth:`flexlite.BlockMask.to_string` (█ full, ░ partial, blank empty
  blocks; large masks downsampled).
* PNG: :func:`visualize_attention_scores`, the scores one (batch, head) sees after ``score_mod``, with
  the positions ``mask_mod`` removes drawn in grey (or, without a score_mod, the mask itself). Needs
  matplotlib: ``pip install "flexlite[viz]"``. Drawn with the Agg canvas directly, so it works headless
  and leaves pyplot's backend alone.
"""

from __future__ import annotations

import math
import numbers
import os
from pathlib import Path
from typing import Callable, Optional, Union

import torch

from ._vmap import vmap_bhqkv
from .api import check_scale
from .block_mask import check_captured_device, check_mod_output
from .codegen.trace import check_arity, mod_name

# a dense Lq x Lkv picture beyond this many positions is more memory than insight
MAX_POSITIONS = 2 ** 26
_MASKED_COLOR = "#d0d0d0"
_POSINF_COLOR = "#d62728"  # a +inf score (the row's whole weight), past the top of the scale


def _require_matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError('flexlite.viz needs matplotlib; install it with: pip install "flexlite[viz]"') from e
    return Figure, FigureCanvasAgg


def _fail(msg: str, exc=ValueError):
    raise exc(f"visualize_attention_scores: {msg}")


def _check_index(name: str, value, size: int, dim: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):  # (numpy ints too)
        _fail(f"{name} must be an int; got {type(value).__name__}", TypeError)
    if not 0 <= value < size:
        _fail(f"{name}={value} is out of range for {size} {dim}: use 0..{size - 1}")
    return int(value)


def _check_path(path) -> Path:
    """``path`` as a Path to a .png file (or one without a suffix) in an existing, writable folder (a file already
    there: writable too)."""
    if not isinstance(path, (str, os.PathLike)):
        _fail(f"path must be a str or os.PathLike naming a .png file; got {type(path).__name__} {path!r}", TypeError)
    path = Path(path)
    if path.suffix and path.suffix.lower() != ".png":
        _fail(f"path {str(path)!r} ends in {path.suffix!r}, but the file written is a PNG; name it *.png")
    if path.is_dir():
        _fail(f"path {str(path)!r} is a folder; give a file name, e.g. {str(path / 'attention_scores.png')!r}")
    if not path.parent.is_dir():
        _fail(f"the folder of path {str(path)!r} does not exist; create it first "
              f"(Path({str(path.parent)!r}).mkdir(parents=True))")
    if not os.access(path.parent, os.W_OK | os.X_OK):
        _fail(f"the folder of path {str(path)!r} is not writable; give a path in a folder you can write to")
    if path.exists() and not os.access(path, os.W_OK):
        _fail(f"path {str(path)!r} exists and is not writable; give another path or make the file writable")
    return path


def _validate(query, key, score_mod, mask_mod, batch_idx, head_idx, scale):
    for name, t in (("query", query), ("key", key)):
        if not isinstance(t, torch.Tensor):
            _fail(f"{name} must be a torch.Tensor; got {type(t).__name__}", TypeError)
        if t.dim() != 4:
            _fail(f"{name} must be 4-D (batch, heads, seq_len, head_dim); got shape {tuple(t.shape)}")
    if key.device != query.device:
        _fail(f"key is on {key.device} but query is on {query.device}; move them to one device")
    (B, Hq, Lq, E), (Bk, Hkv, Lkv, Ek) = query.shape, key.shape
    if B != Bk and Bk != 1:
        _fail(f"query has batch {B} but key has {Bk} (key's batch must be the query's, or 1 for all)")
    if E != Ek:
        _fail(f"query and key head_dim differ ({E} vs {Ek})")
    if Hkv == 0 or Hq % Hkv:
        _fail(f"query heads ({Hq}) must be a multiple of key heads ({Hkv})")
    if Lq * Lkv > MAX_POSITIONS:
        _fail(f"{Lq} x {Lkv} positions is too many to draw (at most {MAX_POSITIONS}); slice the sequences")
    _check_index("batch_idx", batch_idx, B, "batches")
    _check_index("head_idx", head_idx, Hq, "heads")
    # traced first: untraceable code or a wrong result type gets flexlite's error, not vmap's
    if score_mod is not None:
        check_arity(score_mod, "score_mod", caller="visualize_attention_scores")
        check_captured_device(check_mod_output(score_mod, "score_mod", "visualize_attention_scores",
                                               check_shape=True).captured.values(),
                              query.device, "visualize_attention_scores", "score_mod")
    if mask_mod is not None:
        check_arity(mask_mod, "mask_mod", caller="visualize_attention_scores")
        check_captured_device(check_mod_output(mask_mod, "mask_mod", "visualize_attention_scores",
                                               allow_constant=False, check_shape=True).captured.values(),
                              query.device, "visualize_attention_scores", "mask_mod")
    check_scale(scale, _fail)


def attention_scores(query: torch.Tensor, key: torch.Tensor, score_mod: Optional[Callable] = None,
                     mask_mod: Optional[Callable] = None, batch_idx: int = 0, head_idx: int = 0,
                     scale: Optional[float] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """What :func:`visualize_attention_scores` draws, as tensors: ``(scores, keep)``.

    scores: fp64 [Lq, Lkv], ``score_mod(q @ k^T * scale, b, h, q_idx, kv_idx)`` for the one (batch_idx,
    head_idx) (before softmax, as flex_attention computes it); keep: bool [Lq, Lkv] from ``mask_mod``
    (None without one). Mods are evaluated with the same vmap as the reference.
    """
    _validate(query, key, score_mod, mask_mod, batch_idx, head_idx, scale)
    batch_idx, head_idx = int(batch_idx), int(head_idx)  # (numpy ints too)
    Lq, E = query.shape[-2:]
    Lkv = key.shape[2]
    kv_head = head_idx // (query.shape[1] // key.shape[1])
    q = query[batch_idx, head_idx].detach().double()
    k = key[batch_idx if key.shape[0] > 1 else 0, kv_head].detach().double()
    scale = 1.0 / math.sqrt(E) if scale is None else float(scale)
    kw = dict(dtype=torch.int32, device=query.device)
    indices = (torch.tensor([batch_idx], **kw), torch.tensor([head_idx], **kw),
               torch.arange(Lq, **kw), torch.arange(Lkv, **kw))
    scores = (q @ k.T) * scale
    if score_mod is not None:
        scores = vmap_bhqkv(score_mod, prefix=(0,))(scores[None, None], *indices)[0, 0].double()
    keep = None
    if mask_mod is not None:
        keep = vmap_bhqkv(mask_mod)(*indices)[0, 0].to(torch.bool)
    return scores, keep


def _score_image(scores: torch.Tensor, keep: Optional[torch.Tensor]):
    """(the scores as a numpy masked array, masked where mask_mod removes a position or the score is -inf or NaN;
    the colour scale's (vmin, vmax), over the other finite scores; whether a score is +inf). A +inf score is drawn
    past the scale's top (the colormap's "over" colour): matplotlib takes an infinite value for a missing one, which
    drew it in the masked grey, as if that position took no weight, where it takes all of its row's."""
    import numpy as np

    masked = torch.isneginf(scores) | torch.isnan(scores)
    if keep is not None:
        masked |= ~keep
    posinf = torch.isposinf(scores) & ~masked
    finite = scores[~masked & ~posinf]
    vmin, vmax = (float(finite.min()), float(finite.max())) if finite.numel() else (0.0, 1.0)
    if vmin == vmax:  # (one value: a scale around it)
        vmin, vmax = vmin - 0.5, vmax + 0.5
    over = vmax + max(1.0, vmax - vmin)  # (finite, past the top: "over")
    values = scores.masked_fill(posinf, over if math.isfinite(over) else torch.finfo(torch.float64).max)
    return np.ma.masked_array(values.cpu().numpy(), mask=masked.cpu().numpy()), (vmin, vmax), bool(posinf.any())


def _default_title(score_mod, mask_mod, batch_idx, head_idx) -> str:
    mods = " + ".join(mod_name(m) for m in (score_mod, mask_mod) if m is not None) or "q @ k^T * scale"
    return f"{mods}\nbatch {batch_idx}, head {head_idx}"


def visualize_attention_scores(
    query: torch.Tensor,
    key: torch.Tensor,
    score_mod: Optional[Callable] = None,
    mask_mod: Optional[Callable] = None,
    path: Union[str, Path] = "attention_scores.png",
    batch_idx: int = 0,
    head_idx: int = 0,
    title: Optional[str] = None,
    scale: Optional[float] = None,
) -> Path:
    """Write a PNG of the scores of one (batch, head): ``score_mod`` applied to ``q @ k^T * scale``, no
    softmax; positions ``mask_mod`` removes (and scores of -inf or NaN) in grey, scores of +inf in red past the
    colour scale's top (the scale spans the finite scores). Without a score_mod the picture
    is the mask itself (attended dark, masked light).

    Args:
        query: [B, Hq, Lq, E]; key: [B, Hkv, Lkv, E] (Hq a multiple of Hkv; values are not needed).
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx)`` or None.
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx)`` or None.
        path: the PNG file to write (its folder must exist).
        batch_idx, head_idx: which (batch, query head) to draw.
        title: default: the mods' names, batch and head.
        scale: multiplies ``q @ k^T``; default ``1 / sqrt(E)``.

    Returns:
        The path written.
    """
    Figure, FigureCanvasAgg = _require_matplotlib()
    import matplotlib
    import numpy as np
    from matplotlib.colors import ListedColormap

    path = _check_path(path)
    scores, keep = attention_scores(query, key, score_mod, mask_mod, batch_idx, head_idx, scale)
    Lq, Lkv = scores.shape
    if Lq == 0 or Lkv == 0:
        _fail(f"there is nothing to draw: query has length {Lq} and key {Lkv}")
    fig = Figure(figsize=(8, 8 * min(2.0, max(0.5, Lq / Lkv)) * 0.9))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if score_mod is None and mask_mod is not None:
        image = keep.cpu().numpy().astype(np.int8)
        cmap = ListedColormap([_MASKED_COLOR, "#1f3b73"])
        im = ax.imshow(image, cmap=cmap, vmin=0, vmax=1, interpolation="nearest", aspect="auto")
        bar = fig.colorbar(im, ax=ax, ticks=[0.25, 0.75])
        bar.ax.set_yticklabels(["masked", "attended"])
    else:
        image, (vmin, vmax), posinf = _score_image(scores, keep)
        cmap = matplotlib.colormaps["viridis"].with_extremes(bad=_MASKED_COLOR, over=_POSINF_COLOR)
        im = ax.imshow(image, cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest", aspect="auto")
        notes = ["grey: masked"] * bool(image.mask.any()) + ["red: +inf"] * posinf
        fig.colorbar(im, ax=ax, extend="max" if posinf else "neither",
                     label="score" + (f" ({'; '.join(notes)})" if notes else ""))
    ax.set_title(title if title is not None else _default_title(score_mod, mask_mod, batch_idx, head_idx))
    ax.set_xlabel("key tokens (kv_idx)")
    ax.set_ylabel("query tokens (q_idx)")
    ax.xaxis.set_label_position("top")
    ax.tick_params(axis="x", top=True, labeltop=True, bottom=False, labelbottom=False)
    if Lq <= 32 and Lkv <= 32:
        ax.set_xticks(range(Lkv))
        ax.set_yticks(range(Lq))
        ax.set_xticks(np.arange(-0.5, Lkv, 1), minor=True)
        ax.set_yticks(np.arange(-0.5, Lq, 1), minor=True)
        ax.grid(which="minor", color="white", linewidth=1)
        ax.tick_params(which="minor", length=0)
    try:
        fig.savefig(path, format="png", dpi=100, bbox_inches="tight")
    except OSError as e:  # a folder that exists but takes no files (read-only, /proc)
        _fail(f"cannot write path {str(path)!r}: {e.strerror or e}; write it somewhere writable")
    return path
