"""The library's masks by name, built for a sequence length with defaults for every parameter:
``python -m flexlite show <name> --seq N`` uses this."""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional, Sequence

from ._checks import check_int
from .block_causal import generate_block_causal_mask, generate_block_diffusion_mask
from .causal import causal_mask, generate_causal_bottom_right
from .dilated_sliding_window import generate_dilated_sliding_window
from .document import generate_causal_document_mask, generate_document_mask
from .flamingo import generate_vision_cross_attention_mask_mod
from .global_sliding_window import generate_global_sliding_window
from .natten import generate_morton_natten, generate_natten, generate_tiled_natten
from .prefix_lm import generate_prefix_lm_mask
from .sasa import generate_sasa_mask
from .shared_prefix import generate_shared_prefix_mask
from .sliding_window import generate_sliding_window


@dataclasses.dataclass
class MaskOptions:
    """Parameters of the named masks; None means a default derived from ``seq``."""

    seq: int
    kv_seq: Optional[int] = None    # causal_bottom_right
    window: Optional[int] = None    # sliding windows, sasa: default seq // 8 (sasa: 3)
    dilation: int = 2               # dilated_sliding_window
    prefix: Optional[int] = None    # prefix_lm, shared_prefix: default seq // 4
    docs: Optional[Sequence[int]] = None  # document*: lengths, default 4 near-equal documents
    canvas: Optional[tuple] = None  # 2-D masks: (W, H), default a square of side sqrt(seq)
    kernel: tuple = (7, 7)          # natten: (KW, KH)
    tile: tuple = (8, 8)            # tiled_natten: (TW, TH)
    global_tokens: int = 16         # global_sliding_window
    block: Optional[int] = None     # block_causal, block_diffusion: default seq // 8 (block_diffusion: seq // 16)
    images: int = 3                 # flamingo: images, seq // images text tokens each
    image_tokens: int = 64          # flamingo: tokens per image
    device: str = "cpu"

    def window_or(self, default: int) -> int:
        return default if self.window is None else self.window

    def block_or(self, default: int) -> int:  # (a given 0 is the factory's to refuse, not a default's to replace)
        return default if self.block is None else self.block

    def kv_seq_or_seq(self) -> int:
        return self.seq if self.kv_seq is None else self.kv_seq

    def square_canvas(self) -> tuple:
        if self.canvas is not None:
            w, h = self.canvas
            if w * h != self.seq:
                raise ValueError(f"canvas {w}x{h} has {w * h} pixels but seq is {self.seq}")
            return w, h
        side = math.isqrt(self.seq)
        if side * side != self.seq:
            raise ValueError(f"2-D masks need seq = W * H: give --canvas WxH, or a square seq (e.g. {side * side})")
        return side, side

    def even_split(self, total: int, parts: int) -> list:
        return [total // parts + (i < total % parts) for i in range(parts)]

    def lengths(self, total: int, parts: int) -> list:
        """``docs`` (which must sum to ``total``), default ``parts`` near-equal lengths."""
        if self.docs is None:
            return self.even_split(total, parts)
        if any(n < 0 for n in self.docs):
            raise ValueError(f"document lengths (--docs) must be >= 0; got {list(self.docs)}")
        if sum(self.docs) != total:
            raise ValueError(f"document lengths (--docs) {list(self.docs)} sum to {sum(self.docs)}, not {total}")
        return list(self.docs)


@dataclasses.dataclass(frozen=True)
class NamedMask:
    description: str
    build: Callable[[MaskOptions], tuple]  # -> (mask_mod, Q_LEN, KV_LEN)
    options: tuple = ()  # the MaskOptions fields it reads (besides seq and device)


def _self(mask, o: MaskOptions):
    return mask, o.seq, o.seq


def _flamingo(o: MaskOptions):
    check_int("build_named_mask", "images", o.images, 1)
    text = o.even_split(o.seq, o.images)
    starts = [sum(text[:i]) for i in range(o.images)]
    intervals = [[s, s + n] for s, n in zip(starts, text)]
    mask = generate_vision_cross_attention_mask_mod(intervals, o.image_tokens, device=o.device)
    return mask, o.seq, o.images * o.image_tokens


def _prefix(o: MaskOptions) -> int:
    """--prefix (default seq // 4), at most seq."""
    prefix = o.seq // 4 if o.prefix is None else check_int("build_named_mask", "prefix", o.prefix)
    if prefix > o.seq:
        raise ValueError(f"build_named_mask: prefix={prefix} is longer than seq={o.seq}")
    return prefix


def _prefix_lm(o: MaskOptions):
    return _self(generate_prefix_lm_mask(_prefix(o)), o)


def _shared_prefix(o: MaskOptions):
    prefix = _prefix(o)
    suffixes = o.lengths(o.seq - prefix, 3)
    return _self(generate_shared_prefix_mask(prefix, suffixes, device=o.device), o)


def _block_diffusion(o: MaskOptions):
    if o.seq % 2:
        raise ValueError(f"block_diffusion needs an even seq ([x_t | x_0]); got {o.seq}")
    return _self(generate_block_diffusion_mask(o.seq // 2, o.block_or(max(1, o.seq // 16))), o)


NAMED_MASKS = {
    "causal": NamedMask("q_idx >= kv_idx", lambda o: _self(causal_mask, o)),
    "causal_bottom_right": NamedMask(
        "causal with queries aligned to the end of --kv-seq keys",
        lambda o: (generate_causal_bottom_right(o.seq, o.kv_seq_or_seq()), o.seq, o.kv_seq_or_seq()), ("kv_seq",)),
    "sliding_window": NamedMask("causal, the last --window keys",
                                lambda o: _self(generate_sliding_window(o.window_or(o.seq // 8)), o), ("window",)),
    "sliding_window_bidirectional": NamedMask(
        "|q_idx - kv_idx| <= --window",
        lambda o: _self(generate_sliding_window(o.window_or(o.seq // 8), causal=False), o), ("window",)),
    "dilated_sliding_window": NamedMask(
        "|q - kv| <= --window, every --dilation-th key",
        lambda o: _self(generate_dilated_sliding_window(o.window_or(o.seq // 8), o.dilation), o),
        ("window", "dilation")),
    "global_sliding_window": NamedMask(
        "--global-tokens global tokens + bidirectional --window",
        lambda o: _self(generate_global_sliding_window(o.window_or(o.seq // 8), o.global_tokens), o),
        ("window", "global_tokens")),
    "prefix_lm": NamedMask("bidirectional over --prefix tokens, causal after", _prefix_lm, ("prefix",)),
    "document": NamedMask("causal within packed documents of lengths --docs", lambda o: _self(
        generate_causal_document_mask(o.lengths(o.seq, 4), device=o.device), o), ("docs",)),
    "document_bidirectional": NamedMask("bidirectional within packed documents --docs", lambda o: _self(
        generate_document_mask(o.lengths(o.seq, 4), device=o.device), o), ("docs",)),
    "shared_prefix": NamedMask("--prefix shared by suffixes of lengths --docs (causal)", _shared_prefix,
                               ("prefix", "docs")),
    "block_causal": NamedMask("blocks of --block tokens, causal between blocks",
                              lambda o: _self(generate_block_causal_mask(o.block_or(max(1, o.seq // 8))), o),
                              ("block",)),
    "block_diffusion": NamedMask("BD3-LM [x_t | x_0] mask, blocks of --block", _block_diffusion, ("block",)),
    "natten": NamedMask("2-D neighbourhood --kernel on a row-major --canvas",
                        lambda o: _self(generate_natten(*o.square_canvas(), *o.kernel), o), ("canvas", "kernel")),
    "tiled_natten": NamedMask("NATTEN with --tile tiles", lambda o: _self(
        generate_tiled_natten(*o.square_canvas(), *o.kernel, *o.tile), o), ("canvas", "kernel", "tile")),
    "morton_natten": NamedMask("NATTEN in Morton (Z-curve) order",
                               lambda o: _self(generate_morton_natten(*o.square_canvas(), *o.kernel), o),
                               ("canvas", "kernel")),
    "sasa": NamedMask("2-D window of +-window pixels on --canvas",
                      lambda o: _self(generate_sasa_mask(*o.square_canvas(), o.window_or(3)), o), ("canvas", "window")),
    "flamingo": NamedMask("text (--seq) to --images images of --image-tokens tokens", _flamingo,
                          ("images", "image_tokens")),
}


def build_named_mask(name: str, seq: int, **options) -> tuple:
    """``(mask_mod, Q_LEN, KV_LEN)`` of the library mask ``name`` (one of :data:`NAMED_MASKS`) for a
    sequence of ``seq`` tokens; ``options`` are :class:`MaskOptions` fields."""
    if not isinstance(name, str):
        raise TypeError(f"build_named_mask: name must be a str, one of {', '.join(NAMED_MASKS)}; got "
                        f"{type(name).__name__} {name!r}")
    if name not in NAMED_MASKS:
        raise ValueError(f"unknown mask {name!r}; valid names: {', '.join(NAMED_MASKS)}")
    seq = check_int("build_named_mask", "seq", seq, 1)
    fields = [f.name for f in dataclasses.fields(MaskOptions) if f.name != "seq"]
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise TypeError(f"build_named_mask: unknown options {unknown}; valid options: {', '.join(fields)}")
    named = NAMED_MASKS[name]
    options = {k: v for k, v in options.items() if v is not None}  # (None: the default, as MaskOptions has it)
    unused = sorted(set(options) - set(named.options) - {"device"})
    if unused:
        raise ValueError(f"build_named_mask: mask {name!r} takes no {', '.join(unused)} (it would be ignored); its "
                         f"options: {', '.join(named.options) or 'none besides seq'}")
    return named.build(MaskOptions(seq=seq, **options))
