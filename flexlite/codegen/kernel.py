"""The codegen pipeline in one call: mods -> trace -> lower -> render -> kernel source.

Tracing is cached per function (:mod:`flexlite.codegen.trace`), lowering per trace (stored on it, so
it is freed with it) and rendering per source text, so a call with known mods costs a fingerprint
check and a few dict lookups, and no cache keeps a captured tensor alive.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import torch

from .decide import mask_variants
from .grad import captured_grad_trace, score_grad_trace
from .lower import LoweredMod, identity_score_mod, lower_mod, noop_mask_mod, op_key
from .render import render
from .trace import TracedMod, trace_mod


@dataclasses.dataclass(eq=False)
class GeneratedKernel:
    template: str
    source: str
    score_mod: LoweredMod
    mask_mod: LoweredMod
    has_score_mod: bool

    def mod_args(self) -> list:
        """Runtime values for the captured-tensor parameters (score_mod's first, then mask_mod's)."""
        return self.score_mod.kernel_args() + self.mask_mod.kernel_args()

    @property
    def captured(self) -> list:
        return self.score_mod.tensors + self.mask_mod.tensors


def _lowered(traced: Optional[TracedMod], fn_name: str, prefix: str, float_index: bool = False,
             query_values: bool = False, fold_scales: bool = False, key_values: bool = False,
             separate: bool = False) -> LoweredMod:
    """``query_values`` (mask_mod): its values from b, h, q_idx and captured tensors alone computed apart
    (bwd_ws.py.jinja evaluates them on a compact query vector); ``key_values`` (mask_mod): from b, h, kv_idx
    (fwd_ws.py.jinja: a compact key vector), and where there are such values, index arithmetic in int only (the
    float forms of ``float_index`` are not carried across the split). ``fold_scales`` (score_mod): its constant
    input and output factors left to the kernel (lower_mod's ``fold_scales``); ``separate`` (score_mod): whether it
    is the score plus a bias of a query side and a key side (lower_mod's ``separate``)."""
    if traced is None:
        return identity_score_mod() if fn_name == "score_mod" else noop_mask_mod()
    key = (fn_name,) + tuple(name for name, on in (("float_index", float_index), ("query_values", query_values),
                                                    ("fold_scales", fold_scales), ("key_values", key_values),
                                                    ("separate", separate)) if on)
    if key not in traced.lowered:
        # score_mod's loop-invariant loads are hoisted out of the kernels' loops (lower_mod's ``hoist``)
        hoist = ("b", "h") if fn_name == "score_mod" else ("b", "h", "q_idx") if query_values else \
            ("b", "h", "kv_idx") if key_values else ()
        low = lower_mod(traced, fn_name, prefix, float_index and not hoist[2:], hoist=hoist, fold_scales=fold_scales,
                        separate=separate)
        if hoist[2:] and not low.hoisted and float_index:  # nothing to split off: keep the float forms
            low = lower_mod(traced, fn_name, prefix, float_index, fold_scales=fold_scales)
        traced.lowered[key] = low
    return traced.lowered[key]


def _mask_variants(traced: Optional[TracedMod], rewrite: bool):
    """mask_mod's :class:`~flexlite.codegen.decide.MaskVariants` (None: no term a tile decides; ``rewrite``: each
    variant's kept terms rewritten where its dropped ones allow), kept with its trace."""
    if traced is None:
        return None
    if ("decide", rewrite) not in traced.lowered:
        traced.lowered["decide", rewrite] = mask_variants(traced, rewrite)
    return traced.lowered["decide", rewrite]


def _refuse_bfloat16_arithmetic(*traced_mods) -> None:
    """On CPU: Triton 3.6's interpreter computes bfloat16 arithmetic wrongly (numpy has no bfloat16: products of two
    captured bf16 values came out NaN or off by whole units) and truncates casts to it; a mod computing a bfloat16
    value (other than reading one from a captured tensor) would be silently wrong there, so it is refused."""
    for traced in traced_mods:
        for node in traced.graph_module.graph.nodes if traced is not None else ():
            if node.op in ("call_function", "call_method") and node.meta.get("dtype") == torch.bfloat16 and \
                    op_key(node) != "getitem":
                raise NotImplementedError(
                    f"{traced.kind} {traced.name!r} computes in bfloat16 ({node.format_node()}), which Triton's "
                    f"interpreter (CPU tensors) gets wrong; capture float32 tensors (tensor.float()) or cast to "
                    f"float32 first, or run on a GPU")


@functools.lru_cache(maxsize=512)
def _render(template: str, sm_source: str, mm_source: str, sm_params: tuple, mm_params: tuple,
            interpret: bool, sm_name: str, mm_name: str, extra: tuple = (), sm_hoisted: tuple = (),
            sm_hoist_source: str = "", mm_hoisted: tuple = (), mm_hoist_source: str = "",
            sm_scales: tuple = (None, None), sm_separable: bool = False, sm_affine_keys: bool = False,
            compact_bias_dims: tuple = (), affine_bias_dims: tuple = (), score_bound: Optional[float] = None,
            llvm_opt_levels: tuple = (), poly_exp2: tuple = (), mm_decide=None) -> str:
    sm = LoweredMod("score_mod", sm_source, list(sm_params), [], hoisted=sm_hoisted, hoist_source=sm_hoist_source,
                    in_scale=sm_scales[0], out_scale=sm_scales[1], separable=sm_separable,
                    affine_keys=sm_affine_keys)
    mm = LoweredMod("mask_mod", mm_source, list(mm_params), [], hoisted=mm_hoisted, hoist_source=mm_hoist_source)
    extra_mods = {name: LoweredMod(name, src, list(params), []) if src is not None else None
                  for name, src, params in extra}
    return render(template, sm, mm, interpret=interpret, score_mod_name=sm_name, mask_mod_name=mm_name,
                  extra_mods=extra_mods, compact_bias_dims=compact_bias_dims, affine_bias_dims=affine_bias_dims,
                  score_bound=score_bound, llvm_opt_levels=llvm_opt_levels, poly_exp2=poly_exp2,
                  mask_decide=mm_decide)


# the largest score bound (base 2) a kernel takes in place of the running row max: P's smallest weight,
# 2 ** (-2 * bound), must stay a normal bf16 / fp32 number (above 2 ** -126), ex2.approx flushing what is below
MAX_BOUND = 60.0
_LOG2E = 1.4426950408889634


def _score_bound(low: LoweredMod) -> Optional[float]:
    """The bound of a folded score_mod's output in base 2 (its output factor times tanh / sigmoid, |f| <= 1:
    lower_mod's fold_scales), or None where it has none or it is above MAX_BOUND."""
    if low.out_scale is None or not 0 < low.out_scale * _LOG2E <= MAX_BOUND:
        return None
    return low.out_scale * _LOG2E


def _one_in(poly_exp2: Optional[dict], bounded_poly_exp2: Optional[dict], score_bound: Optional[float]) -> tuple:
    """Head dim -> N (launch.WS_FWD_POLY_EXP2, and for a kernel that runs a bounded score_mod against its bound
    launch.WS_FWD_POLY_EXP2_BOUNDED over it) as sorted pairs (the render cache's key), each N a power of two of at
    least 2."""
    for name, value in (("WS_FWD_POLY_EXP2", poly_exp2), ("WS_FWD_POLY_EXP2_BOUNDED", bounded_poly_exp2)):
        if value and (not isinstance(value, dict) or not all(
                isinstance(d, int) and isinstance(n, int) and n >= 2 and not n & (n - 1) for d, n in value.items())):
            raise TypeError(f"launch.{name} must be a dict of head dim -> N, a power of two of at least 2 (one of "
                            f"every N exponentials on the FMA pipes), e.g. {{64: 4}}; got {value!r}")
    one_in = {**(poly_exp2 or {}), **((bounded_poly_exp2 or {}) if score_bound is not None else {})}
    return tuple(sorted(one_in.items()))


def _levels(levels: Optional[dict]) -> tuple:
    """Head dim -> LLVM level as sorted pairs (the render cache's key); the levels themselves are checked where the
    kernel is launched (:class:`flexlite.runtime.llvm_level.llvm_opt_level`)."""
    if levels is None:
        return ()
    if not isinstance(levels, dict):
        raise TypeError(f"launch.WS_FWD_LLVM_OPT_LEVELS / WS_BWD_LLVM_OPT_LEVELS must be a dict of head dim -> LLVM "
                        f"level ('O0' ... 'O3'; head dims left out: Triton's own), e.g. {{128: 'O0'}}; got "
                        f"{levels!r}")
    return tuple(sorted(levels.items()))


def generate(template: str, score_mod: Optional[Callable], mask_mod: Optional[Callable], *,
             interpret: bool, float_index: bool = False, fold_scales: bool = False,
             key_values: bool = False, separate: bool = False, affine_keys=(),
             compact_bias_dims: tuple = (), affine_bias_dims: tuple = (), decide_mask_terms=(), decide_rewrite=True,
             bounded: bool = False, llvm_opt_levels: Optional[dict] = None,
             poly_exp2: Optional[dict] = None, bounded_poly_exp2: Optional[dict] = None) -> GeneratedKernel:
    """Kernel source for ``template`` with ``score_mod`` / ``mask_mod`` (None: identity / keep all).
    ``float_index``: lower index arithmetic that ends in float32 from float index vectors (the caller guarantees
    lengths below 2**24; :class:`~flexlite.codegen.lower._Lowerer`). ``fold_scales`` (the forward templates):
    score_mod's constant input and output factors folded into the kernel's multiplies. ``key_values``
    (fwd_ws.py.jinja): mask_mod's values from b, h, kv_idx and captured tensors alone (its gathers along the keys)
    computed apart, on a compact key vector. ``separate`` (the forward templates): a score_mod that is the score plus
    a bias of a query side and a key side takes the query side once per row, into the LSE (lower_mod's
    ``separate``); ``affine_keys``: the templates (of those two) that take such a bias affine in kv_idx as a key side
    of one vector per walk plus a scalar per tile that joins the row max (lower_mod's
    :attr:`~flexlite.codegen.lower.LoweredMod.affine_keys`); ``affine_bias_dims`` (fwd_ws.py.jinja): the head dims at
    which it does so there (fwd.py.jinja: at all);
    ``compact_bias_dims`` (fwd_ws.py.jinja): the head dims at which a bias not taken so is computed along the keys
    on a compact key vector. ``decide_mask_terms``: the templates (of fwd.py.jinja, fwd_ws.py.jinja; for
    :func:`generate_backward` its own) in which mask_mod's terms that a partial tile's index ranges decide are left
    out on that tile (:mod:`flexlite.codegen.decide`), with ``decide_rewrite`` each variant's kept terms rewritten
    where the dropped ones allow (an abs whose argument's sign they give, linear compares as a query side against a
    key side). ``bounded`` (fwd_ws.py.jinja, bf16 inputs only: the caller's to know): where
    score_mod's folded output factor bounds it (``cap * tanh`` with cap * log2(e) up to :data:`MAX_BOUND`), the
    softmax runs against that bound instead of the running row max. ``llvm_opt_levels`` (fwd_ws.py.jinja): head
    dim -> the LLVM optimization level its launcher compiles it at (others: Triton's own;
    :class:`flexlite.runtime.llvm_level.llvm_opt_level`). ``poly_exp2`` (fwd_ws.py.jinja): head dim -> N, one of every N
    of P's exponentials computed by a polynomial on the FMA pipes (:mod:`flexlite.codegen.exp2`); ``bounded_poly_exp2``
    the same, over it, where the kernel runs a bounded score_mod against its bound. A mod may come as
    its :class:`TracedMod` where the caller has traced it already.
    """
    sm = trace_mod(score_mod, "score_mod") if score_mod is not None else None
    mm = trace_mod(mask_mod, "mask_mod") if mask_mod is not None else None
    if interpret:
        _refuse_bfloat16_arithmetic(sm, mm)
    low_sm = _lowered(sm, "score_mod", "sm_", float_index, fold_scales=fold_scales,
                      separate=separate and template in ("fwd.py.jinja", "fwd_ws.py.jinja"))
    low_mm = _lowered(mm, "mask_mod", "mm_", float_index, key_values=key_values and template == "fwd_ws.py.jinja")
    ws = template == "fwd_ws.py.jinja"
    score_bound = _score_bound(low_sm) if bounded and ws else None
    source = _render(template, low_sm.source, low_mm.source, tuple(low_sm.params), tuple(low_mm.params),
                     interpret, sm.name if sm else "none", mm.name if mm else "none", (), low_sm.hoisted,
                     low_sm.hoist_source, low_mm.hoisted, low_mm.hoist_source,
                     sm_scales=(low_sm.in_scale, low_sm.out_scale), sm_separable=low_sm.separable,
                     sm_affine_keys=template in affine_keys and low_sm.affine_keys,
                     compact_bias_dims=tuple(sorted(compact_bias_dims))
                     if low_sm.separable and ws else (),
                     affine_bias_dims=tuple(sorted(affine_bias_dims))
                     if template in affine_keys and low_sm.affine_keys and ws else (),
                     score_bound=score_bound, llvm_opt_levels=_levels(llvm_opt_levels) if ws else (),
                     poly_exp2=_one_in(poly_exp2, bounded_poly_exp2, score_bound) if ws else (),
                     mm_decide=_mask_variants(mm, decide_rewrite) if template in decide_mask_terms and template in (
                         "fwd.py.jinja", "fwd_ws.py.jinja") else None)
    return GeneratedKernel(template, source, low_sm, low_mm, has_score_mod=sm is not None)


# ---------------------------------------------------------------------------------------------
# backward: the mods plus score_mod's derivatives (codegen.grad), lowered by the same op table

@dataclasses.dataclass(eq=False)
class BackwardKernel(GeneratedKernel):
    """``bwd.py.jinja`` (or ``bwd_ws.py.jinja``) rendered with ``score_mod_grad`` (d score_mod / d score) and, when
    captured tensors need gradients in-kernel, ``score_mod_captured_grad`` (atomic adds into float32 buffers)."""

    score_grad: Optional[LoweredMod] = None
    captured_grad: Optional[LoweredMod] = None
    buffer_slots: tuple = ()  # per captured_grad tensor: index of its gradient buffer, or None

    def grad_args(self, buffers: list) -> list:
        """Runtime values of the derivative functions' parameters; ``buffers`` are the float32 gradient
        buffers, in the order of ``generate_backward``'s ``grad_captured``."""
        args = self.score_grad.kernel_args() if self.score_grad is not None else []
        if self.captured_grad is not None:
            tensors = [t if slot is None else buffers[slot]
                       for t, slot in zip(self.captured_grad.tensors, self.buffer_slots)]
            args += LoweredMod("", "", [], tensors).kernel_args()
        return args


def _score_grad(traced: TracedMod) -> LoweredMod:
    if "score_mod_grad" not in traced.lowered:
        traced.lowered["score_mod_grad"] = lower_mod(score_grad_trace(traced), "score_mod_grad", "sd_")
    return traced.lowered["score_mod_grad"]


def _captured_grad(traced: TracedMod, grad_captured: tuple) -> tuple:
    targets = tuple(next(name for name, t in traced.captured.items() if t is want) for want in grad_captured)
    key = ("score_mod_captured_grad",) + targets
    if key not in traced.lowered:
        trace, buffers = captured_grad_trace(traced, targets)
        low = lower_mod(trace, "score_mod_captured_grad", "sg_")
        # (a target the score does not depend on through a differentiable path, read by a compare or an index only,
        # scatters nothing: its buffer is not in the trace and its gradient stays zero)
        placeholder_slot = {id(trace.captured[b.buffer]): i for i, b in enumerate(buffers)
                            if b.buffer in trace.captured}
        traced.lowered[key] = (low, tuple(placeholder_slot.get(id(t)) for t in low.tensors))
    return traced.lowered[key]


def generate_backward(score_mod: Optional[Callable], mask_mod: Optional[Callable], *, interpret: bool,
                      grad_captured: tuple = (), template: str = "bwd.py.jinja",
                      query_values: bool = False, llvm_opt_levels: Optional[dict] = None,
                      decide_mask_terms=(), decide_rewrite=True) -> BackwardKernel:
    """Backward kernel source for these mods. ``grad_captured``: tensors captured by ``score_mod``
    whose gradients the dK/dV kernel scatters (atomically) into buffers; () for none. ``template``:
    ``"bwd.py.jinja"`` (preprocess, dK/dV and dQ kernels) or ``"bwd_ws.py.jinja"`` (the warp-specialized dK/dV
    kernel; no captured-tensor gradients). ``query_values`` (bwd_ws.py.jinja): mask_mod's values from b, h, q_idx
    and captured tensors alone (its gathers along the queries) computed apart, on a compact query vector.
    ``llvm_opt_levels`` (bwd_ws.py.jinja): as :func:`generate`'s. ``decide_mask_terms``, ``decide_rewrite``: as
    :func:`generate`'s, for the backward templates (their partial tiles' P and dS; not where mask_mod's values along
    the queries are computed apart, whose parameters the variants lack). The mods may come as their traces, as there."""
    sm = trace_mod(score_mod, "score_mod") if score_mod is not None else None
    mm = trace_mod(mask_mod, "mask_mod") if mask_mod is not None else None
    if interpret:
        _refuse_bfloat16_arithmetic(sm, mm)
    low_sm = _lowered(sm, "score_mod", "sm_")
    low_mm = _lowered(mm, "mask_mod", "mm_", query_values=query_values and template == "bwd_ws.py.jinja")
    score_grad = _score_grad(sm) if sm is not None else None
    captured_grad, slots = _captured_grad(sm, tuple(grad_captured)) if sm is not None and grad_captured \
        else (None, ())
    extra = tuple((name, m.source if m is not None else None, tuple(m.params) if m is not None else ())
                  for name, m in (("score_grad", score_grad), ("captured_grad", captured_grad)))
    source = _render(template, low_sm.source, low_mm.source, tuple(low_sm.params), tuple(low_mm.params),
                     interpret, sm.name if sm else "none", mm.name if mm else "none", extra, low_sm.hoisted,
                     low_sm.hoist_source, low_mm.hoisted, low_mm.hoist_source,
                     llvm_opt_levels=_levels(llvm_opt_levels) if template == "bwd_ws.py.jinja" else (),
                     mm_decide=_mask_variants(mm, decide_rewrite) if template in decide_mask_terms
                     and not low_mm.hoisted else None)
    return BackwardKernel(template, source, low_sm, low_mm, has_score_mod=sm is not None,
                          score_grad=score_grad, captured_grad=captured_grad, buffer_slots=slots)
