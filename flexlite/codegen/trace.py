"""Mod -> torch.fx GraphModule with a dtype and shape on every node.

The tracer knows nothing about Triton: it turns a user's ``score_mod(score, b, h, q_idx, kv_idx)``
or ``mask_mod(b, h, q_idx, kv_idx)`` into a graph, finds the tensors it captured (they become
kernel arguments, never constants) and records per-node dtypes by running the graph on 0-d
example tensors (indices int32, score float32), following torch's type promotion.

A mod is traced once: traces are cached per function object and re-done only when what the function
can see (closure cells, referenced globals, recursively through called functions) points at
different objects, so rebinding a captured tensor is never missed and a new value written into the
same tensor needs nothing at all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import operator
import re
import threading
import types
import weakref
from typing import Callable, Optional

import torch
import torch.fx as fx

SCORE_MOD_ARGS = ("score", "b", "h", "q_idx", "kv_idx")
MASK_MOD_ARGS = ("b", "h", "q_idx", "kv_idx")


class UntraceableModError(NotImplementedError):
    """A mod uses a construct that cannot become kernel code (data-dependent Python control flow,
    ``.item()``, an op with no lowering, ...)."""


@dataclasses.dataclass(eq=False)
class TracedMod:
    """A traced mod: its graph (nodes carry ``meta['dtype']`` and ``meta['shape']``) and captures."""

    kind: str  # "score_mod" | "mask_mod"
    name: str
    graph_module: fx.GraphModule
    captured: dict  # get_attr target -> tensor
    lowered: dict = dataclasses.field(default_factory=dict)  # filled by codegen.kernel, dies with the trace

    @property
    def arg_names(self) -> tuple:
        return SCORE_MOD_ARGS if self.kind == "score_mod" else MASK_MOD_ARGS


def mod_name(fn: Callable) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


_ARITY_OK: "weakref.WeakKeyDictionary[Callable, str]" = weakref.WeakKeyDictionary()


def positional_arity(fn: Callable) -> Optional[tuple]:
    """(required, total) positional parameters of ``fn``; None if unknown (``*args``, builtins)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return sum(p.default is p.empty for p in positional), len(positional)


def check_arity(fn: Callable, kind: str, argname: Optional[str] = None, caller: str = "flex_attention") -> None:
    """TypeError unless ``fn`` is callable with exactly the positional arguments of ``kind``."""
    try:
        if _ARITY_OK.get(fn) == kind:  # inspect.signature costs ~10 us; calls repeat with the same mods
            return
    except TypeError:  # not weakly referenceable (or not even callable): check below
        pass
    argname = argname or kind
    expected = SCORE_MOD_ARGS if kind == "score_mod" else MASK_MOD_ARGS
    if not callable(fn):
        raise TypeError(f"{caller}: {argname} must be callable; got {type(fn).__name__}")
    arity = positional_arity(fn)
    if arity is None or arity[0] <= len(expected) <= arity[1]:
        try:
            _ARITY_OK[fn] = kind
        except TypeError:  # not weakly referenceable
            pass
        return
    n = arity[0]
    hint = ""
    if kind == "mask_mod" and n == 5:
        hint = (" (this looks like a score_mod(score, b, h, q_idx, kv_idx); pass it to flex_attention as "
                "score_mod instead)")
    elif kind == "score_mod" and n == 4:
        hint = (" (this looks like a mask_mod(b, h, q_idx, kv_idx); build a BlockMask with "
                "create_block_mask(mask_mod, ...) and pass block_mask= instead)")
    raise TypeError(f"{caller}: {argname} {mod_name(fn)!r} must take ({', '.join(expected)}); "
                    f"got a function of {n} arguments{hint}")


# ---------------------------------------------------------------------------------------------
# capture fingerprint: what a function can see, as object identities (cheap; no tracing)

def _fingerprint(obj, seen: set, depth: int = 0) -> tuple:
    if depth > 8 or id(obj) in seen:
        return ()
    if isinstance(obj, torch.Tensor):
        return (id(obj), obj.dtype, obj.dim())
    if isinstance(obj, (int, float, bool, str, type(None))):
        return (type(obj).__name__, obj)
    seen.add(id(obj))
    if isinstance(obj, (list, tuple)):
        return tuple(_fingerprint(x, seen, depth + 1) for x in obj)
    if isinstance(obj, dict):
        return tuple((k, _fingerprint(v, seen, depth + 1)) for k, v in obj.items())
    fn = getattr(obj, "__func__", obj)  # bound methods
    if isinstance(fn, types.FunctionType):
        parts = [id(fn.__code__)]
        for cell in fn.__closure__ or ():
            try:
                parts.append(_fingerprint(cell.cell_contents, seen, depth + 1))
            except ValueError:  # empty cell
                parts.append(None)
        for name in fn.__code__.co_names:
            if name in fn.__globals__:
                value = fn.__globals__[name]
                if not isinstance(value, types.ModuleType):
                    parts.append((name, _fingerprint(value, seen, depth + 1)))
        if fn is not obj:
            parts.append(_fingerprint(obj.__self__, seen, depth + 1))
        return tuple(parts)
    return (id(obj),)


def capture_fingerprint(fn: Callable) -> tuple:
    return _fingerprint(fn, set())


# ---------------------------------------------------------------------------------------------
# dtype / shape propagation

def _zero_tensor_indices(index):
    """Replace tensor indices by 0 so that example values never index out of range."""
    if isinstance(index, tuple):
        return tuple(_zero_tensor_indices(i) for i in index)
    if isinstance(index, torch.Tensor):
        return 0
    return index


class _DtypeProp(fx.Interpreter):
    """Run the graph on 0-d examples, recording ``meta['dtype']`` / ``meta['shape']`` per node."""

    def run_node(self, n: fx.Node):
        result = super().run_node(n)
        if isinstance(result, torch.Tensor):
            n.meta["dtype"], n.meta["shape"] = result.dtype, tuple(result.shape)
        elif isinstance(result, (bool, int, float)):
            n.meta["dtype"] = {bool: torch.bool, int: torch.int64, float: torch.float32}[type(result)]
            n.meta["shape"] = ()
        return result

    def call_function(self, target, args, kwargs):
        if target is operator.getitem and isinstance(args[0], torch.Tensor):
            args = (args[0], _zero_tensor_indices(args[1]))
        return super().call_function(target, args, kwargs)

    def call_method(self, target, args, kwargs):
        if target == "__getitem__":
            args = (args[0], _zero_tensor_indices(args[1]))
        return super().call_method(target, args, kwargs)


def _example_inputs(kind: str):
    idx = [torch.ones((), dtype=torch.int32) for _ in MASK_MOD_ARGS]
    if kind == "score_mod":
        return [torch.full((), 0.5, dtype=torch.float32)] + idx
    return idx


# ---------------------------------------------------------------------------------------------

_TRACE_CACHE: "weakref.WeakKeyDictionary[Callable, tuple]" = weakref.WeakKeyDictionary()
_TRACE_CACHE_STRONG: dict = {}  # for callables that cannot be weakly referenced


def _cache_for(fn):
    try:
        weakref.ref(fn)
        return _TRACE_CACHE
    except TypeError:
        return _TRACE_CACHE_STRONG


def trace_mod(fn: Callable, kind: str) -> TracedMod:
    """Trace ``fn`` (a score_mod or mask_mod) to a :class:`TracedMod`, cached per function; a TracedMod (a caller's
    trace of this call's mod, whose captures it has checked) is its own trace."""
    if kind not in ("score_mod", "mask_mod"):
        raise ValueError(f"kind must be 'score_mod' or 'mask_mod', got {kind!r}")
    if isinstance(fn, TracedMod):
        return fn
    check_arity(fn, kind)
    fp = capture_fingerprint(fn)
    cache = _cache_for(fn)
    hit = cache.get(fn)
    if hit is not None and hit[0] == fp:
        return hit[1]
    traced = _trace(fn, kind)
    cache[fn] = (fp, traced)
    return traced


_NO_TRACING = threading.local()


@contextlib.contextmanager
def tracing_refused():
    """While inside, :func:`trace_mod` in this thread raises where it would trace: torch.fx patches
    torch.nn.Module's methods process-wide while it traces, which would break a torch.compile (or another trace)
    running in another thread (flexlite.first_calls' worker compiles from traces made on the calling thread)."""
    _NO_TRACING.on = True
    try:
        yield
    finally:
        _NO_TRACING.on = False


def _trace(fn: Callable, kind: str) -> TracedMod:
    if getattr(_NO_TRACING, "on", False):
        raise RuntimeError(f"{mod_name(fn)!r} would be traced in a thread that may not trace (flexlite.first_calls' "
                           f"worker): its trace must come from the calling thread")
    name = re.sub(r"[^\w(), .<>-]", "_", mod_name(fn))  # it goes into generated source comments
    arg_names = SCORE_MOD_ARGS if kind == "score_mod" else MASK_MOD_ARGS
    # trace through a wrapper with fixed parameter names, so *args mods and odd names work too
    wrapper = _fixed_signature(fn, arg_names)
    try:
        tracer = _ModTracer()
        graph = tracer.trace(wrapper)  # sets tracer.root
        gm = fx.GraphModule(tracer.root, graph)
    except fx.proxy.TraceError as e:
        raise UntraceableModError(
            f"{kind} {name!r} cannot be traced: {e}. Python control flow (`if`, `while`, `and`/`or`, "
            f"`bool(...)`, `int(...)`, `.item()`) cannot depend on tensor values; write it with "
            f"torch.where(cond, a, b) and `&`, `|`, `~` instead.") from e
    except Exception as e:  # noqa: BLE001 - anything the mod itself raised while being traced
        raise UntraceableModError(f"{kind} {name!r} failed while being traced: {type(e).__name__}: {e}") from e
    captured = {n.target: getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    for target, value in captured.items():
        if not isinstance(value, torch.Tensor):
            raise UntraceableModError(f"{kind} {name!r} captures {type(value).__name__} {target!r}; only tensors "
                                      f"and Python scalars can be captured")
    try:
        _DtypeProp(gm).run(*_example_inputs(kind))
    except Exception as e:  # noqa: BLE001
        raise UntraceableModError(
            f"{kind} {name!r} failed on 0-d example inputs (indices are 0-d int32 tensors, the score a 0-d "
            f"float32 tensor): {type(e).__name__}: {e}") from e
    return TracedMod(kind=kind, name=name, graph_module=gm, captured=captured)


class _ModTracer(fx.Tracer):
    """symbolic_trace's tracer, except that a captured ``nn.Parameter`` (a learnable bias table, say) is
    a captured tensor like any other, and modules a mod calls (a GraphModule of an earlier trace, say)
    are traced through, instead of being errors for not belonging to the (empty) root module."""

    def call_module(self, m, forward, args, kwargs):
        # a mod may be (or call) an nn.Module, e.g. a GraphModule from an earlier trace: inline it
        return forward(*args, **kwargs)

    def create_arg(self, a):
        if isinstance(a, torch.nn.Parameter):
            for name, p in self.root.named_parameters():
                if p is a:
                    return self.create_node("get_attr", name, (), {})
            name = f"_captured_parameter{len(list(self.root.parameters()))}"
            self.root.register_parameter(name, a)
            return self.create_node("get_attr", name, (), {})
        return super().create_arg(a)


def _fixed_signature(fn: Callable, arg_names: tuple) -> Callable:
    ns = {"fn": fn}
    params = ", ".join(arg_names)
    exec(f"def {'mod'}({params}):\n    return fn({params})\n", ns)  # noqa: S102 - fixed, generated text
    return ns["mod"]
