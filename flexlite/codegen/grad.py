"""Derivatives of a traced score_mod, built as new fx graphs that :mod:`lower` turns into Triton.

Reverse mode over the mod's fx graph: the primal nodes are copied into a new graph, then a sweep from
the output back to the inputs adds, per node, its adjoint ``g * d(out)/d(node)`` as ordinary torch ops
(``mul``, ``where``, ``tanh``, ...). The result is again a graph of the ops that ``lower.OPS`` knows,
so the derivative is lowered by the same op table as the mod itself. ``RULES`` maps an op key (the
one ``lower.op_key`` gives) to its adjoint rule: adding a derivative is one table entry.

Two graphs come out of a score_mod:

* :func:`score_grad_trace`: ``(score, b, h, q_idx, kv_idx) -> d out / d score`` (0 if the mod ignores
  the score). The backward kernels multiply dS by it.
* :func:`captured_grad_trace`: ``(score, b, h, q_idx, kv_idx, grad) -> 0`` that, for every load
  ``t[i, j, ...]`` of a captured tensor ``t`` that requires grad, adds ``grad * d out / d t[i, j, ...]``
  into a float32 buffer shaped like ``t`` at the same (gathered) address:
  ``buf.index_put_((i, j, ...), value, accumulate=True)``, which lowers to ``tl.atomic_add``.

Subgradients follow torch: ``abs``/``relu``/``clamp`` give 0 / pass-through at the kinks as torch does,
``maximum``/``minimum`` split ties in half; ``floor``, ``ceil``, ``sign``, comparisons and integer math
have zero derivative. An op on the path from the score (or a grad-requiring capture) to the output
without a rule raises :class:`UntraceableModError`.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Callable, Union

import torch
import torch.fx as fx

from .lower import op_key
from .trace import SCORE_MOD_ARGS, TracedMod, UntraceableModError

Adjoint = Union[fx.Node, float, None]  # None: no gradient (zero)

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)


@dataclasses.dataclass(eq=False)
class GradTrace(TracedMod):
    """A derivative graph; ``extra_args`` are placeholders after the score_mod's five (``grad``)."""

    extra_args: tuple = ()

    @property
    def arg_names(self) -> tuple:
        return SCORE_MOD_ARGS + self.extra_args


@dataclasses.dataclass(frozen=True)
class CapturedGrad:
    """One gradient buffer of :func:`captured_grad_trace`: float32, shaped like captured tensor ``target``."""

    target: str  # get_attr target of the captured tensor in the primal graph
    buffer: str  # get_attr target of its gradient buffer in the derivative graph


def _is_float(node) -> bool:
    if not isinstance(node, fx.Node):
        return isinstance(node, float)
    dtype = node.meta.get("dtype")
    return dtype is not None and dtype.is_floating_point and node.meta.get("shape", ()) == ()


def _example(a):
    """A 0-d stand-in for a node (its dtype is all that matters), for dtype propagation."""
    if isinstance(a, fx.Node):
        dtype = a.meta["dtype"]
        return torch.ones((), dtype=dtype)
    if isinstance(a, (tuple, list)):
        return type(a)(_example(x) for x in a)
    return a


class _Builder:
    """Writes the derivative graph. Arithmetic helpers fold Python-number operands (1 * g = g, ...)."""

    def __init__(self, traced: TracedMod, extra_args: tuple):
        self.traced = traced
        self.src = traced.graph_module.graph
        self.graph = fx.Graph()
        self.env: dict = {}  # primal node -> its copy
        self.extra: dict = {}
        placeholders = [n for n in self.src.nodes if n.op == "placeholder"]
        for n in placeholders:
            self.env[n] = self.graph.node_copy(n)
        for name in extra_args:
            node = self.graph.placeholder(name)
            node.meta.update(dtype=torch.float32, shape=())
            self.extra[name] = node
        for n in self.src.nodes:
            if n.op not in ("placeholder", "output"):
                self.env[n] = self.graph.node_copy(n, lambda x: self.env[x])

    # -- nodes
    def call(self, target, *args, **kwargs) -> fx.Node:
        op = "call_method" if isinstance(target, str) else "call_function"
        node = self.graph.create_node(op, target, args, kwargs)
        ex_args = [_example(a) for a in args]
        ex_kwargs = {k: _example(v) for k, v in kwargs.items()}
        fn = getattr(ex_args[0], target) if op == "call_method" else target
        value = fn(*(ex_args[1:] if op == "call_method" else ex_args), **ex_kwargs)
        value = value if isinstance(value, torch.Tensor) else torch.tensor(value)
        node.meta.update(dtype=value.dtype, shape=tuple(value.shape))
        return node

    def mapped(self, a):
        if isinstance(a, fx.Node):
            return self.env[a]
        if isinstance(a, (tuple, list)):
            return type(a)(self.mapped(x) for x in a)
        return a

    # -- arithmetic on adjoints / values (nodes or Python numbers)
    def add(self, a: Adjoint, b: Adjoint) -> Adjoint:
        if a is None or (not isinstance(a, fx.Node) and a == 0):
            return b
        if b is None or (not isinstance(b, fx.Node) and b == 0):
            return a
        if not isinstance(a, fx.Node) and not isinstance(b, fx.Node):
            return float(a + b)
        return self.call(operator.add, a, b)

    def mul(self, a: Adjoint, b) -> Adjoint:
        if a is None or b is None:
            return None
        if not isinstance(a, fx.Node) and not isinstance(b, fx.Node):
            return float(a * b)
        if not isinstance(a, fx.Node) and a == 1 and _is_float(b):
            return b
        if not isinstance(b, fx.Node) and b == 1 and _is_float(a):
            return a
        return self.call(operator.mul, a, b)

    def div(self, a: Adjoint, b) -> Adjoint:
        if a is None:
            return None
        if not isinstance(b, fx.Node):
            return self.mul(a, 1.0 / b)
        return self.call(operator.truediv, a, b)

    def neg(self, a: Adjoint) -> Adjoint:
        if a is None:
            return None
        return -float(a) if not isinstance(a, fx.Node) else self.call(operator.neg, a)

    def where(self, cond, a: Adjoint, b: Adjoint) -> Adjoint:
        a = 0.0 if a is None else a
        b = 0.0 if b is None else b
        if not isinstance(cond, fx.Node):
            return a if cond else b
        return self.call(torch.where, cond, a, b)

    def fn(self, f: Callable, *args) -> fx.Node:
        return self.call(f, *args)

    def cmp(self, op: Callable, a, b):
        if not isinstance(a, fx.Node) and not isinstance(b, fx.Node):
            return bool(op(a, b))
        return self.call(op, a, b)


# ---------------------------------------------------------------------------------------------
# the rule table: key -> (d: _Builder, x: args (copies), kw: kwargs (copies), y: output (copy), g: adjoint)
#   -> adjoint contributions, one per positional argument (None: none), plus {kwarg: contribution}

def _unary(local: Callable):
    """Rule for y = f(x) with d y / d x = local(d, x, y)."""
    return lambda d, x, kw, y, g: [d.mul(g, local(d, x[0], y))]


def _zero(d, x, kw, y, g):
    return [None] * len(x)


def _add(d, x, kw, y, g):
    return [g, d.mul(g, kw.get("alpha", 1))]


def _sub(d, x, kw, y, g):
    return [g, d.neg(d.mul(g, kw.get("alpha", 1)))]


def _mul(d, x, kw, y, g):
    return [d.mul(g, x[1]), d.mul(g, x[0])]


def _truediv(d, x, kw, y, g):
    return [d.div(g, x[1]), d.neg(d.div(d.mul(g, y), x[1]))]


def _div(d, x, kw, y, g):
    return _truediv(d, x, kw, y, g) if kw.get("rounding_mode") is None else _zero(d, x, kw, y, g)


def _remainder(rounding: str):
    # x - y * round(x / y): d/dx = 1, d/dy = -round(x / y)  (floor for %, trunc for fmod)
    def rule(d, x, kw, y, g):
        q = d.call(torch.div, x[0], x[1], rounding_mode=rounding) if any(
            isinstance(a, fx.Node) for a in x) else x[0] // x[1]
        return [g, d.neg(d.mul(g, q))]
    return rule


def _atan2(d, x, kw, y, g):
    # y = atan2(a, b): d/da = b / (a^2 + b^2), d/db = -a / (a^2 + b^2); 0 at a = b = 0 (torch's)
    a, b = x
    norm = d.add(d.mul(a, a), d.mul(b, b))
    zero = d.cmp(operator.eq, norm, 0.0)
    recip = d.where(zero, 0.0, d.div(1.0, d.where(zero, 1.0, norm)))
    return [d.mul(d.mul(g, b), recip), d.neg(d.mul(d.mul(g, a), recip))]


def _pow(d, x, kw, y, g):
    base, exponent = x
    if not isinstance(exponent, fx.Node):  # x ** c
        if exponent == 0:
            return [None, None]
        local = exponent if exponent == 1 else d.mul(exponent, d.call(torch.pow, base, exponent - 1.0))
        return [d.mul(g, local), None]
    if not isinstance(base, fx.Node):  # c ** y
        return [None, d.mul(g, d.mul(y, math.log(base))) if base > 0 else None]
    # torch: d/dbase is 0 where the exponent is 0; d/dexponent is 0 where base == 0 and exponent >= 0
    d_base = d.where(d.cmp(operator.eq, exponent, 0.0), 0.0,
                     d.mul(g, d.mul(exponent, d.call(torch.pow, base, d.call(operator.sub, exponent, 1.0)))))
    zero_base = d.call(operator.and_, d.cmp(operator.eq, base, 0.0), d.cmp(operator.ge, exponent, 0.0))
    d_exp = d.where(zero_base, 0.0, d.mul(g, d.mul(y, d.fn(torch.log, base))))
    return [d_base, d_exp]


def _where(d, x, kw, y, g):
    cond = x[0]
    return [None, d.where(cond, g, None), d.where(cond, None, g)]


def _clamp_bounds(x, kw):
    lo = x[1] if len(x) > 1 else kw.get("min")
    hi = x[2] if len(x) > 2 else kw.get("max")
    return lo, hi


def _clamp(d, x, kw, y, g):
    # torch: x passes where lo <= x <= hi; lo gets x < lo (and lo < hi); hi gets x > hi (or hi < lo)
    lo, hi = _clamp_bounds(x, kw)
    inside = True
    if lo is not None:
        inside = d.cmp(operator.ge, x[0], lo)
    if hi is not None:
        below_hi = d.cmp(operator.le, x[0], hi)
        inside = below_hi if inside is True else d.call(operator.and_, inside, below_hi)
    d_lo = d_hi = None
    if isinstance(lo, fx.Node):
        below = d.cmp(operator.lt, x[0], lo)
        if hi is not None:
            below = d.call(operator.and_, below, d.cmp(operator.lt, lo, hi))
        d_lo = d.where(below, g, None)
    if isinstance(hi, fx.Node):
        above = d.cmp(operator.gt, x[0], hi)
        if lo is not None:
            above = d.call(operator.or_, above, d.cmp(operator.lt, hi, lo))
        d_hi = d.where(above, g, None)
    grads = [d.where(inside, g, None), d_lo, d_hi][:len(x)]
    grads += [None] * (len(x) - len(grads))
    return grads, {"min": d_lo, "max": d_hi}


def _clamp_min(d, x, kw, y, g):
    return [d.where(d.cmp(operator.ge, x[0], x[1]), g, None), d.where(d.cmp(operator.lt, x[0], x[1]), g, None)]


def _clamp_max(d, x, kw, y, g):
    return [d.where(d.cmp(operator.le, x[0], x[1]), g, None), d.where(d.cmp(operator.gt, x[0], x[1]), g, None)]


def _extremum(wins: Callable):
    # torch: the winner gets g, a tie gives g / 2 to each
    def rule(d, x, kw, y, g):
        a, b = x
        tie = d.cmp(operator.eq, a, b)
        half = d.mul(g, 0.5)
        return [d.where(d.cmp(wins, a, b), g, d.where(tie, half, None)),
                d.where(d.cmp(wins, b, a), g, d.where(tie, half, None))]
    return rule


def _gelu(d, x, kw, y, g):
    v = x[0]
    if kw.get("approximate", "none") == "tanh":
        # y = 0.5 v (1 + t), t = tanh(u), u = k (v + 0.044715 v^3)
        v2 = d.mul(v, v)
        u = d.mul(d.add(v, d.mul(d.mul(v2, v), 0.044715)), _SQRT_2_OVER_PI)
        t = d.fn(torch.tanh, u)
        du = d.mul(d.add(d.mul(v2, 3 * 0.044715), 1.0), _SQRT_2_OVER_PI)
        local = d.add(d.mul(d.add(t, 1.0), 0.5),
                      d.mul(d.mul(d.mul(v, 0.5), d.call(operator.sub, 1.0, d.mul(t, t))), du))
        return [d.mul(g, local)]
    cdf = d.mul(d.add(d.fn(torch.erf, d.mul(v, _INV_SQRT_2)), 1.0), 0.5)
    pdf = d.mul(d.fn(torch.exp, d.mul(d.mul(v, v), -0.5)), _INV_SQRT_2PI)
    return [d.mul(g, d.add(cdf, d.mul(v, pdf)))]


def _softplus(d, x, kw, y, g):
    # sigmoid(beta x) below the threshold, 1 above it (torch's)
    beta = kw.get("beta", x[1] if len(x) > 1 else 1.0)
    threshold = kw.get("threshold", x[2] if len(x) > 2 else 20.0)
    v = x[0]
    scaled = d.mul(v, float(beta))
    return [d.mul(g, d.where(d.cmp(operator.gt, scaled, float(threshold)), 1.0, d.fn(torch.sigmoid, scaled)))] + \
        [None] * (len(x) - 1)


RULES: dict[str, Callable] = {
    "add": _add, "sub": _sub, "mul": _mul, "truediv": _truediv, "div": _div, "pow": _pow,
    "mod": _remainder("floor"), "fmod": _remainder("trunc"),
    "neg": lambda d, x, kw, y, g: [d.neg(g)], "pos": lambda d, x, kw, y, g: [g],
    "abs": _unary(lambda d, v, y: d.fn(torch.sign, v)),
    "exp": _unary(lambda d, v, y: y),
    "exp2": _unary(lambda d, v, y: d.mul(y, math.log(2.0))),
    "log": _unary(lambda d, v, y: d.div(1.0, v)),
    "log2": _unary(lambda d, v, y: d.div(1.0 / math.log(2.0), v)),
    "log1p": _unary(lambda d, v, y: d.div(1.0, d.add(v, 1.0))),
    "expm1": _unary(lambda d, v, y: d.add(y, 1.0)),
    "sqrt": _unary(lambda d, v, y: d.div(0.5, y)),
    "rsqrt": _unary(lambda d, v, y: d.mul(d.mul(d.mul(y, y), y), -0.5)),
    "sin": _unary(lambda d, v, y: d.fn(torch.cos, v)),
    "cos": _unary(lambda d, v, y: d.neg(d.fn(torch.sin, v))),
    "erf": _unary(lambda d, v, y: d.mul(d.fn(torch.exp, d.neg(d.mul(v, v))), _TWO_OVER_SQRT_PI)),
    "sigmoid": _unary(lambda d, v, y: d.mul(y, d.call(operator.sub, 1.0, y))),
    "tanh": _unary(lambda d, v, y: d.call(operator.sub, 1.0, d.mul(y, y))),
    "tanh_approx": _unary(lambda d, v, y: d.call(operator.sub, 1.0, d.mul(y, y))),
    "atan": _unary(lambda d, v, y: d.div(1.0, d.add(d.mul(v, v), 1.0))),
    "asin": _unary(lambda d, v, y: d.fn(torch.rsqrt, d.mul(d.call(operator.sub, 1.0, v), d.add(v, 1.0)))),
    "acos": _unary(lambda d, v, y: d.neg(d.fn(torch.rsqrt, d.mul(d.call(operator.sub, 1.0, v), d.add(v, 1.0))))),
    "tan": _unary(lambda d, v, y: d.add(d.mul(y, y), 1.0)),
    "sinh": _unary(lambda d, v, y: d.fn(torch.cosh, v)),
    "cosh": _unary(lambda d, v, y: d.fn(torch.sinh, v)),
    "atan2": _atan2,
    "relu": lambda d, x, kw, y, g: [d.where(d.cmp(operator.gt, y, 0.0), g, None)],
    "gelu": _gelu,
    "square": _unary(lambda d, v, y: d.mul(v, 2.0)),
    "reciprocal": _unary(lambda d, v, y: d.neg(d.mul(y, y))),
    "log10": _unary(lambda d, v, y: d.div(1.0 / math.log(10.0), v)),
    "silu": _unary(lambda d, v, y: (lambda s: d.add(s, d.mul(d.mul(v, s), d.call(operator.sub, 1.0, s))))(
        d.fn(torch.sigmoid, v))),
    "softplus": _softplus,
    "clone": lambda d, x, kw, y, g: [g],
    "where": _where, "clamp": _clamp, "clamp_min": _clamp_min, "clamp_max": _clamp_max,
    "maximum": _extremum(operator.gt), "minimum": _extremum(operator.lt),
    "to": lambda d, x, kw, y, g: [g] + [None] * (len(x) - 1),
    # piecewise constant: zero derivative (as torch)
    "floordiv": _zero, "floor": _zero, "getitem": _zero, "ceil": _zero, "sign": _zero, "trunc": _zero,
    "round": _zero, "isinf": _zero, "isnan": _zero, "isfinite": _zero,
    "ones_like": _zero, "zeros_like": _zero, "full_like": _zero, "new_full": _zero, "tensor": _zero,
}


# ---------------------------------------------------------------------------------------------

def _load_chain(node: fx.Node) -> tuple:
    """``t[i][j, k]`` -> (get_attr node of t, [i, j, k]); (node, []) for anything else."""
    indices: list = []
    while node.op in ("call_function", "call_method") and op_key(node) == "getitem":
        idx = node.args[1]
        indices[:0] = list(idx) if isinstance(idx, tuple) else [idx]
        node = node.args[0]
    return node, indices


def _loads(traced: TracedMod, targets: set) -> dict:
    """Value nodes that read one element of a captured tensor in ``targets`` -> (get_attr node, indices)."""
    found = {}
    for n in traced.graph_module.graph.nodes:
        root, indices = _load_chain(n)
        if root.op == "get_attr" and root.target in targets and len(indices) == traced.captured[root.target].dim():
            found[n] = (root, indices)
    return found


def _dependents(graph: fx.Graph, sources: set) -> set:
    dep = set(sources)
    for n in graph.nodes:
        if any(a in dep for a in n.all_input_nodes):
            dep.add(n)
    return dep


def _reverse_sweep(d: _Builder, seed: Adjoint, sources: set, stop: set) -> dict:
    """Adjoints of the primal nodes on a path from ``sources`` to the output (keys: primal nodes).
    ``stop`` nodes (loads) get an adjoint but do not propagate it further."""
    graph = d.src
    output = next(n for n in graph.nodes if n.op == "output")
    out = output.args[0]
    dep = _dependents(graph, sources)
    adj: dict = {}
    if isinstance(out, fx.Node) and out in dep and _is_float(out):
        adj[out] = seed
    for n in reversed(list(graph.nodes)):
        g = adj.get(n)
        if g is None or n.op in ("placeholder", "get_attr") or n in stop:
            continue
        key = op_key(n)
        rule = RULES.get(key)
        if rule is None:
            what = key or (n.target if isinstance(n.target, str) else getattr(n.target, "__name__", n.target))
            raise UntraceableModError(
                f"score_mod {d.traced.name!r}: the backward pass is not supported for `{what}` "
                f"(no derivative rule; at `{n.format_node()}`). flex_attention's forward works with it; "
                f"for gradients, rewrite the mod with ops from flexlite.codegen.grad.RULES: "
                f"{', '.join(sorted(RULES))}")
        x = [d.mapped(a) for a in n.args]
        kw = {k: d.mapped(v) for k, v in n.kwargs.items()}
        result = rule(d, x, kw, d.env[n], g)
        grads, kw_grads = result if isinstance(result, tuple) else (result, {})
        pairs = list(zip(n.args, grads)) + [(n.kwargs.get(k), v) for k, v in kw_grads.items()]
        for a, contribution in pairs:
            if isinstance(a, fx.Node) and a in dep and _is_float(a) and contribution is not None:
                adj[a] = d.add(adj.get(a), contribution)
    return adj


def _graph_module(d: _Builder, captured: dict) -> fx.GraphModule:
    def impure(n: fx.Node) -> bool:
        return n.op in ("placeholder", "output") or (n.op == "call_method" and n.target == "index_put_")
    d.graph.eliminate_dead_code(is_impure_node=impure)
    return fx.GraphModule(dict(captured), d.graph)


def _output(d: _Builder, value: Adjoint):
    d.graph.output(value if value is not None else 0.0)


def score_grad_trace(traced: TracedMod) -> GradTrace:
    """``d score_mod(score, b, h, q_idx, kv_idx) / d score`` as a traced mod of the same five arguments."""
    score = next(n for n in traced.graph_module.graph.nodes if n.op == "placeholder" and n.target == "score")
    d = _Builder(traced, ())
    adj = _reverse_sweep(d, 1.0, {score}, set())
    _output(d, adj.get(score))
    gm = _graph_module(d, traced.captured)
    captured = {n.target: traced.captured[n.target] for n in gm.graph.nodes if n.op == "get_attr"}
    return GradTrace("score_mod", f"{traced.name} d/dscore", gm, captured)


def captured_grad_trace(traced: TracedMod, targets: tuple) -> tuple[GradTrace, list]:
    """Scatter ``grad * d out / d t[idx]`` into a float32 buffer per captured tensor ``t`` in ``targets``
    (get_attr names). Returns the trace, of (score, b, h, q_idx, kv_idx, grad), and its buffers as
    :class:`CapturedGrad` (their tensors in ``trace.captured`` are ``meta`` placeholders: pass the real
    buffers at launch)."""
    d = _Builder(traced, ("grad",))
    loads = _loads(traced, set(targets))
    adj = _reverse_sweep(d, d.extra["grad"], set(loads), set(loads))
    buffers = {t: CapturedGrad(t, f"{t}_grad") for t in targets}
    captured = dict(traced.captured)
    for t, cg in buffers.items():
        captured[cg.buffer] = torch.empty(traced.captured[t].shape, dtype=torch.float32, device="meta")
    attrs: dict = {}
    grad = d.extra["grad"]
    for load, (root, indices) in loads.items():
        value = adj.get(load)
        if value is None:
            continue
        buf = buffers[root.target].buffer
        if buf not in attrs:
            attrs[buf] = d.graph.get_attr(buf)
            attrs[buf].meta.update(dtype=torch.float32, shape=tuple(captured[buf].shape))
        if value is not grad:
            # adjoints are linear in grad: where grad is 0 (masked positions) add exactly 0, never 0 * inf
            value = d.where(d.cmp(operator.ne, grad, 0.0), value, None)
        node = d.graph.call_method("index_put_", (attrs[buf], tuple(d.mapped(i) for i in indices), value),
                                   {"accumulate": True})
        node.meta.update(dtype=torch.float32, shape=())
    _output(d, None)
    gm = _graph_module(d, captured)
    used = {n.target: captured[n.target] for n in gm.graph.nodes if n.op == "get_attr"}
    trace = GradTrace("score_mod", f"{traced.name} d/dcaptured", gm, used, extra_args=("grad",))
    return trace, [buffers[t] for t in targets]
