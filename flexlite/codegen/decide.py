"""mask_mod's compares decided per tile: the variants of a mask that a tile's index ranges leave.

Most masks are a conjunction (or disjunction) of compares of index arithmetic: sliding window's
``(q_idx - kv_idx).abs() <= w`` and ``q_idx >= kv_idx``, prefix-LM's ``kv_idx < p`` or ``q_idx >= kv_idx``. In a
partial tile one of them usually holds on the whole tile (the window on the diagonal tile, causality on the window's
edge), yet the kernel evaluates both for every score. :func:`mask_variants` finds the top-level terms whose value over
a tile's rectangle of indices (queries q_lo ... q_hi, keys k_lo ... k_hi) interval arithmetic can bound: compares of
int values built from q_idx, kv_idx, b, h and int numbers (up to 2 ** 24) by adds, subtracts, negations, abs and
multiplies by numbers (up to 64). The kernel computes per tile (``mask_mod_decide``) which of them the tile decides
and runs the mask without those (``mask_mod_d<code>``), or none of it where the tile is decided whole (a term of an
``&`` false on it: nothing kept; of an ``|`` true: all kept). Interval bounds are sound (q and kv taken apart, each
term's range contains its values on the tile), so a term is only dropped where it holds on every position of the tile.

Masks that read captured tensors are left as they are (a variant's parameters would differ from the mask's).

With ``rewrite`` (launch.DECIDE_REWRITE_TERMS) a variant's kept terms are put in the forms it computes most cheaply,
each equal to the term it replaces wherever the dropped terms hold: ``|x|`` becomes ``x`` (or ``-x``) where a dropped
term gives x's sign (sliding window's edge tile, where causality holds: ``q_idx - kv_idx <= w``), and a compare of
int arithmetic linear in q_idx and kv_idx becomes a query side against a key side (``q_idx - w <= kv_idx``), which the
kernels compute once per row and once per column: one compare per score where the band took a subtract, an abs and
a compare (benchmarks/NOTES.md 94). The variants stay one per code: taking the band apart as two terms instead
(seven variants) made the warp-specialized forward's partial-tile loop half as long again and sliding window slower.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Optional

import torch
import torch.fx as fx

from .lower import (INDEX_INTS, MAX_FORM_FACTOR, MAX_FORM_NUMBER, LoweredMod, combined_forms, index_form,
                    lower_mod, op_key)
from .trace import TracedMod

# the most terms taken apart (2 ** MAX_TERMS - 1 variants of the mask)
MAX_TERMS = 3
# compare -> (decided true, decided false) of its operands' difference d = a - b in [lo, hi]
_DECIDE = {"ge": ("{lo} >= 0", "{hi} < 0"), "gt": ("{lo} > 0", "{hi} <= 0"),
           "le": ("{hi} <= 0", "{lo} > 0"), "lt": ("{hi} < 0", "{lo} >= 0"),
           "eq": ("({lo} == 0) & ({hi} == 0)", "({lo} > 0) | ({hi} < 0)"),
           "ne": ("({lo} > 0) | ({hi} < 0)", "({lo} == 0) & ({hi} == 0)")}
_JOIN = {"and": ("and", "logical_and"), "or": ("or", "logical_or")}


@dataclasses.dataclass(eq=False)
class MaskVariants:
    """The mask's variants per tile: ``decide`` (``@triton.jit def mask_mod_decide(b, h, q_lo, q_hi, k_lo, k_hi)``)
    gives a tile's code: a bitmask of the decided terms dropped (0: the whole mask), or :attr:`empty` (nothing kept)
    or :attr:`full` (all kept); ``variants`` holds the mask without the terms of each other bitmask
    (``mask_mod_d<code>``, the mask's own signature)."""

    terms: int  # top-level terms taken apart
    names: tuple  # their nodes' names in the mask's graph, by bit
    decide: str
    variants: dict  # code -> LoweredMod

    @property
    def empty(self) -> int:
        return 1 << self.terms

    @property
    def full(self) -> int:
        return (1 << self.terms) + 1

    @property
    def source(self) -> str:
        return "\n\n".join([self.decide] + [low.source for low in self.variants.values()])

    # equal by their source (which names every variant's code), so that the render cache (kernel._render) serves a
    # mod traced again, as it does the mods' own sources
    def __eq__(self, other) -> bool:
        return isinstance(other, MaskVariants) and self.source == other.source

    def __hash__(self) -> int:
        return hash(self.source)


def _join(node) -> Optional[str]:
    if not isinstance(node, fx.Node) or node.kwargs or node.meta.get("dtype") != torch.bool:
        return None
    key = op_key(node)
    return next((j for j, keys in _JOIN.items() if key in keys), None)


def _terms(out: fx.Node, join: str) -> list:
    """The operands of a tree of ``join`` nodes at the output, left to right."""
    if _join(out) == join and len(out.args) == 2:
        return _terms(out.args[0], join) + _terms(out.args[1], join)
    return [out]


class _Intervals:
    """Per int node of the mask, Triton source lines for its range over a tile (``lo_<name>``, ``hi_<name>``)."""

    def __init__(self):
        self.lines, self.bounds = [], {}

    def of(self, v) -> Optional[tuple]:
        if isinstance(v, bool):
            return None
        if isinstance(v, int):
            return (repr(v), repr(v)) if abs(v) <= MAX_FORM_NUMBER else None
        if not isinstance(v, fx.Node) or v.meta.get("dtype") not in INDEX_INTS or v.kwargs:
            return None
        if v in self.bounds:
            return self.bounds[v]
        bounds = self._bounds(v)
        if bounds is not None:
            lo, hi = f"lo_{v.name}", f"hi_{v.name}"
            self.lines += [f"{lo} = {bounds[0]}", f"{hi} = {bounds[1]}"]
            bounds = self.bounds[v] = (lo, hi)
        return bounds

    def _bounds(self, v: fx.Node) -> Optional[tuple]:
        if v.op == "placeholder":
            return {"q_idx": ("q_lo", "q_hi"), "kv_idx": ("k_lo", "k_hi"), "b": ("b", "b"), "h": ("h", "h")}.get(
                v.target)
        key = op_key(v)
        args = [self.of(a) for a in v.args]
        if any(a is None for a in args):
            return None
        if key == "add" and len(args) == 2:
            (a0, a1), (b0, b1) = args
            return f"{a0} + {b0}", f"{a1} + {b1}"
        if key == "sub" and len(args) == 2:
            (a0, a1), (b0, b1) = args
            return f"{a0} - {b1}", f"{a1} - {b0}"
        if key == "neg" and len(args) == 1:
            return f"-{args[0][1]}", f"-{args[0][0]}"
        if key == "pos" and len(args) == 1:
            return args[0]
        if key == "abs" and len(args) == 1:
            lo, hi = args[0]
            return f"tl.maximum(tl.maximum({lo}, -{hi}), 0)", f"tl.maximum(-{lo}, {hi})"
        if key == "mul" and len(v.args) == 2:
            for k, other in ((0, 1), (1, 0)):
                c = v.args[k]
                if isinstance(c, int) and not isinstance(c, bool) and abs(c) <= MAX_FORM_FACTOR:
                    lo, hi = args[other]
                    return (f"{c} * {lo}", f"{c} * {hi}") if c >= 0 else (f"{c} * {hi}", f"{c} * {lo}")
        return None


# the compares with their operands swapped, and negated (a op b == -a op' -b)
_MIRROR = {"ge": "le", "gt": "lt", "le": "ge", "lt": "gt", "eq": "eq", "ne": "ne"}
# a side of a rewritten compare: its values' bound where every index, b and h are below 2 ** 24, at most this (int32
# holds the side's values wherever it holds the indices')
_MAX_SIDE = 2 ** 30
_INDEX_BOUND = 2 ** 24


def _bound(form: dict) -> int:
    """The largest magnitude of a linear form's values with every index, b and h below 2 ** 24."""
    return sum(abs(f) * (1 if name == 1 else _INDEX_BOUND) for name, f in form.items())


class _Builder:
    """New int and bool nodes in ``graph``, with the meta the lowering reads."""

    def __init__(self, graph: fx.Graph, placeholders: dict):
        self.graph, self.placeholders = graph, placeholders

    def call(self, fn, args: tuple, dtype, shape: tuple = ()) -> fx.Node:
        node = self.graph.call_function(fn, args)
        node.meta.update(dtype=dtype, shape=shape)
        return node

    def linear(self, form: dict):
        """The value of a linear form (the indices first, the number last): a node, or an int where it has no
        index."""
        value = None
        for name in ("q_idx", "kv_idx", "b", "h"):
            f = form.get(name, 0)
            if not f:
                continue
            x = self.placeholders[name]
            term = x if abs(f) == 1 else self.call(operator.mul, (abs(f), x), torch.int32)
            if value is None:
                value = term if f > 0 else self.call(operator.neg, (term,), torch.int32)
            else:
                value = self.call(operator.add if f > 0 else operator.sub, (value, term), torch.int32)
        c = form.get(1, 0)
        if value is None:
            return c
        return value if not c else self.call(operator.add if c > 0 else operator.sub, (value, abs(c)), torch.int32)


def _separated(build: _Builder, key: str, a, b) -> Optional[fx.Node]:
    """``a key b`` as a query side against a key side (``q_idx - w <= kv_idx``), or None where it is one already, or
    is not linear in the indices, or a side could leave int32."""
    la, lb = index_form(a), index_form(b)
    if la is None or lb is None:
        return None
    sides = [{n for n in form if n in ("q_idx", "kv_idx")} for form in (la, lb)]
    if len(sides[0]) < 2 and len(sides[1]) < 2 and sides[0] != sides[1]:
        return None  # (each side one of the indices, or none: nothing to gain)
    d = combined_forms(la, lb, -1)
    k = d.pop("kv_idx", 0)
    if not k or not d.get("q_idx"):
        return None
    # a - b = R + k * kv_idx: (a key b) == (R key -k * kv_idx), or with k > 0, (-R key' k * kv_idx)
    row = d if k < 0 else combined_forms({}, d, -1)
    if k > 0:
        key = _MIRROR[key]
    col = {"kv_idx": abs(k)}
    if _bound(row) > _MAX_SIDE or _bound(col) > _MAX_SIDE:
        return None
    return build.call(getattr(operator, key), (build.linear(row), build.linear(col)), torch.bool)


def mask_variants(traced: Optional[TracedMod], rewrite: bool = True) -> Optional[MaskVariants]:
    """The variants of a mask_mod whose top-level terms (of an ``&`` or an ``|`` at its output) include compares a
    tile's index ranges can decide (module docstring), or None (no such term, or the mask reads captured tensors).
    ``rewrite``: each variant's kept terms in the cheaper forms the dropped ones allow (:func:`_rewritten`)."""
    if traced is None or traced.kind != "mask_mod" or traced.captured:
        return None
    gm = traced.graph_module
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    join = _join(out) or "and"  # (a single compare: the term of a conjunction of one)
    terms = _terms(out, join)
    intervals, decided = _Intervals(), []
    for term in terms:
        key = op_key(term) if isinstance(term, fx.Node) and not term.kwargs else None
        if key in _DECIDE and len(term.args) == 2 and len(decided) < MAX_TERMS:
            a, b = (intervals.of(x) for x in term.args)
            if a is not None and b is not None:
                decided.append((term, key, (f"({a[0]} - {b[1]})", f"({a[1]} - {b[0]})")))
    if not decided:
        return None
    n = len(decided)
    result = MaskVariants(n, tuple(term.name for term, _, _ in decided), "", {})
    # per term: "holds" (true under &, false under |: the term can go) and "settles" the tile (false under &: nothing
    # kept; true under |: all kept)
    lines = list(intervals.lines)
    for i, (_, key, (lo, hi)) in enumerate(decided):
        true, false = (form.format(lo=lo, hi=hi) for form in _DECIDE[key])
        holds, settles = (true, false) if join == "and" else (false, true)
        lines += [f"holds{i} = ({holds}).to(tl.int32)", f"settles{i} = {settles}"]
    lines.append("code = " + " + ".join(f"holds{i} * {1 << i}" for i in range(n)))
    if n == len(terms):  # every term holds: the tile is decided whole
        lines.append(f"code = tl.where(code == {(1 << n) - 1}, {result.full if join == 'and' else result.empty}, "
                     f"code)")
    lines.append(f"code = tl.where({' | '.join(f'settles{i}' for i in range(n))}, "
                 f"{result.empty if join == 'and' else result.full}, code)")
    result.decide = "\n".join(
        ["@triton.jit", "def mask_mod_decide(b, h, q_lo, q_hi, k_lo, k_hi):",
         f"    # which of mask_mod {traced.name}'s terms the tile of queries q_lo ... q_hi and keys k_lo ... k_hi "
         f"decides (flexlite.codegen.decide)"] + [f"    {line}" for line in lines] + ["    return code"]) + "\n"
    for code in range(1, 1 << n):
        dropped = [term for i, (term, _, _) in enumerate(decided) if code >> i & 1]
        kept = [t for t in terms if not any(t is term for term in dropped)]
        if kept:
            result.variants[code] = _lowered_without(traced, kept, join, f"mask_mod_d{code}",
                                                     dropped if rewrite else None)
    return result


def _lowered_without(traced: TracedMod, kept: list, join: str, fn_name: str,
                     dropped: Optional[list] = None) -> LoweredMod:
    """The mask with only the top-level terms ``kept`` (joined as before), lowered as ``fn_name``; with ``dropped``
    (the terms the variant's tiles decide) the kept ones rewritten where that makes them cheaper (:func:`_rewritten`)."""
    graph = fx.Graph()
    env = {}
    graph.graph_copy(traced.graph_module.graph, env)
    build = _Builder(graph, {n.target: env[n] for n in traced.graph_module.graph.nodes if n.op == "placeholder"})
    facts = _facts(dropped, join) if dropped is not None else None
    values = [_rewritten(build, env, term, facts) if facts is not None else env[term] for term in kept]
    value = values[0]
    for term in values[1:]:
        value = build.call(operator.and_ if join == "and" else operator.or_, (value, term), torch.bool,
                           term.meta.get("shape", ()) if isinstance(term, fx.Node) else ())
    graph.output(value)
    graph.eliminate_dead_code()
    gm = fx.GraphModule(traced.graph_module, graph)
    return lower_mod(TracedMod(traced.kind, traced.name, gm, traced.captured), fn_name, "mm_")


# a compare of a - b: the sign it gives d = a - b where it holds, and where it fails
_SIGN = {"ge": (">=", "<"), "gt": (">", "<="), "le": ("<=", ">"), "lt": ("<", ">="), "eq": ("==", "!="),
         "ne": ("!=", "==")}


def _facts(dropped: list, join: str) -> list:
    """What the dropped terms say on a variant's tiles (true under ``&``, false under ``|``) as (linear form of d,
    relation of d to 0), for those that compare linear int values."""
    facts = []
    for term in dropped:
        key = op_key(term)
        forms = [index_form(a) for a in term.args]
        if key in _SIGN and None not in forms:
            facts.append((combined_forms(forms[0], forms[1], -1), _SIGN[key][0 if join == "and" else 1]))
    return facts


def _sign(form: dict, facts: list) -> int:
    """1 where the facts say the linear form is >= 0 on the tile, -1 where <= 0, else 0."""
    negated = combined_forms({}, form, -1)
    for d, rel in facts:
        for sign, same in ((1, d == form), (-1, d == negated)):
            if same and rel in (">=", ">", "=="):
                return sign
            if same and rel in ("<=", "<", "=="):
                return -sign
    return 0


def _rewritten(build: _Builder, env: dict, term, facts: list):
    """A kept term in the new graph, cheaper where it can be: a compare with ``|x|`` as one side takes ``x`` or
    ``-x`` where the facts give x's sign, then a compare linear in the indices takes a query side against a key side
    (:func:`_separated`); its value the term's wherever the facts hold."""
    if not isinstance(term, fx.Node) or term.kwargs or op_key(term) not in _MIRROR or len(term.args) != 2:
        return env[term] if isinstance(term, fx.Node) else term
    args = [env[a] if isinstance(a, fx.Node) else a for a in term.args]
    changed = False
    for k, a in enumerate(term.args):
        if isinstance(a, fx.Node) and op_key(a) == "abs" and len(a.args) == 1 and not a.kwargs \
                and a.meta.get("dtype") in INDEX_INTS and (form := index_form(a.args[0])) is not None:
            sign = _sign(form, facts)
            if sign:
                x = env[a.args[0]]
                args[k] = x if sign > 0 else build.call(operator.neg, (x,), a.meta["dtype"])
                changed = True
    separated = _separated(build, op_key(term), *args)
    if separated is not None:
        return separated
    return build.call(getattr(operator, op_key(term)), tuple(args), torch.bool) if changed else env[term]
