"""Mod -> torch.fx GraphModule with a dtype and shape on every node.

The tracer knows nothing about Triton: it turns a user's ``score_mod(score, b, h, q_idx, kv_idx)``
or ``mask_mod(b, h, q_idx, kv_idx)`` into a graph, finds the tensors it captured (they become
kernel arguments, never constants) and records per-node dtypes by running the graph on 0-d
example tensors (indices int32, score float32), following torch's type promotion.

A mod is traced once: traces are cached per function object and re-done only when what the function
can see (closure cells, referenced globals, recursively through called functions, and the attributes of
the objects among them: a callable object's or a bound method's own, an nn.Module's parameters, buffers
and submodules) points at different objects or holds different Python scalars, so rebinding a captured
tensor or changing a constant is never missed and a new value written into the same tensor needs nothing
at all.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import inspect
import operator
import re
import threading
import types
import warnings
import weakref
from typing import Callable, Optional

import torch
import torch.fx as fx

from ..runtime.compile import env_flag

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
    volatile: bool = False  # not cached (trace_mod): traced again at every call

    @property
    def arg_names(self) -> tuple:
        return SCORE_MOD_ARGS if self.kind == "score_mod" else MASK_MOD_ARGS

    def __call__(self, *args):
        """The mod as traced, on tensors (its constants and captured tensors those of the trace; the torch ops paths
        of a backward run the forward's trace so)."""
        return self.graph_module(*args)


# ops whose result depends on their first argument's shape, dtype and device only (``b.new_ones(())``, noop_mask's),
# and the attributes that are those (torch's noop_mask: ``batch.new_ones(..., device=batch.device)``)
_SHAPE_ONLY_OPS = frozenset(("ones_like", "zeros_like", "full_like", "empty_like", "new_ones", "new_zeros", "new_full",
                             "new_empty", "size", "dim"))
_SHAPE_ONLY_ATTRIBUTES = frozenset(("device", "dtype", "shape", "ndim"))


def arguments_read(traced: TracedMod) -> set:
    """The names of the mod's arguments whose values its result depends on: not those it only takes a shape, dtype or
    device from (``b.new_ones(())``, ``b.device``) or does not use."""
    nodes = list(traced.graph_module.graph.nodes)
    live = {nodes[-1]}  # (the output)
    for node in reversed(nodes):
        if node not in live:
            continue
        op = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
        if node.op == "call_function" and op == "getattr" and node.args[1:2] and \
                node.args[1] in _SHAPE_ONLY_ATTRIBUTES:
            continue
        if node.op in ("call_method", "call_function") and op in _SHAPE_ONLY_OPS and node.args:
            inputs = []  # (the first argument's value is not read; the others' are, itself among them again)
            fx.node.map_arg((node.args[1:], node.kwargs), lambda n: inputs.append(n) or n)
        else:
            inputs = node.all_input_nodes
        live.update(inputs)
    return {node.target for node in live if node.op == "placeholder"}


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
#
# Python scalars are compared by value (they become compile-time constants), tensors by identity, dtype and rank
# (they are kernel arguments: new values in the same tensor need no new trace). Objects a mod can read attributes
# of (the mod itself when it is a callable object, a bound method's ``__self__``, an object in a closure cell or a
# referenced global, an nn.Module's parameters / buffers / submodules) are fingerprinted through their ``__dict__``
# and ``__slots__``, so that ``obj.w = 7.0`` or ``mod.bias = nn.Parameter(...)`` re-traces.

_MAX_DEPTH = 8
_MAX_OBJECTS = 2000  # objects (not scalars) visited per fingerprint; past it, further objects count by identity only
_NO_STATE = (type, types.ModuleType, types.BuiltinFunctionType, types.MethodWrapperType, types.WrapperDescriptorType,
             types.MethodDescriptorType, types.CodeType, types.FrameType, weakref.ReferenceType)
_EMPTY_OK = (dict, collections.OrderedDict, list, tuple, set)
_SLOTS: dict = {}  # type -> its instances' slot names (through the MRO)


def _slot_names(cls) -> tuple:
    names = _SLOTS.get(cls)
    if names is None:
        names = []
        for klass in cls.__mro__:
            slots = klass.__dict__.get("__slots__", ())
            for name in (slots,) if isinstance(slots, str) else slots:
                if name not in ("__dict__", "__weakref__") and name not in names:
                    names.append(name)
        names = _SLOTS[cls] = tuple(names)
    return names


def _has_state(obj) -> bool:
    """Whether ``obj``'s attributes are fingerprinted: user objects and nn.Modules, not torch's (or Python's)
    internals, whose lazily filled caches (dispatch tables, say) would change the key without changing the mod."""
    if isinstance(obj, torch.nn.Module):
        return True
    if isinstance(obj, _NO_STATE):
        return False
    module = getattr(type(obj), "__module__", None) or ""
    return not (module == "builtins" or module == "torch" or module.startswith(("torch.", "triton")))


def _state_fingerprint(obj, seen: set, depth: int) -> list:
    """``obj``'s attributes (``__dict__``, then ``__slots__``) and, for a callable object, its ``__call__`` (an
    nn.Module's ``forward``) function: what the mod's code reads when it calls or reads from ``obj``."""
    cls = type(obj)
    parts = [id(obj), id(cls), *_class_constants(cls)]
    try:
        state = object.__getattribute__(obj, "__dict__")
    except AttributeError:
        state = None
    if state:
        # flexlite keeps per-mask work on BlockMasks as "_"-attributes (kept_on); they are derived from the rest
        skip_private = cls.__name__ == "BlockMask"
        for name, value in list(state.items()):
            if skip_private and name.startswith("_"):
                continue
            if type(value) in _EMPTY_OK and not value:  # an nn.Module's (usually empty) hook dicts, quickly
                parts.append((name, type(value)))
            else:
                parts.append((name, _fingerprint(value, seen, depth + 1)))
    for name in _slot_names(cls):
        try:
            parts.append((name, _fingerprint(object.__getattribute__(obj, name), seen, depth + 1)))
        except AttributeError:  # an unset slot
            parts.append((name,))
    call = getattr(cls, "forward" if isinstance(obj, torch.nn.Module) else "__call__", None)
    if isinstance(call, types.FunctionType):
        parts.append(_fingerprint(call, seen, depth + 1))
    return parts


_TRUNCATED = "truncated"  # (in a fingerprint's seen set: the walk was cut short, by depth or by its object budget)


def _fingerprint(obj, seen: set, depth: int = 0) -> tuple:
    if depth > _MAX_DEPTH:
        seen.add(_TRUNCATED)
        return ()
    if id(obj) in seen:
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
    if isinstance(obj, functools.partial):
        return (id(obj), _fingerprint(obj.func, seen, depth + 1), _fingerprint(obj.args, seen, depth + 1),
                _fingerprint(obj.keywords, seen, depth + 1))
    fn = obj.__func__ if isinstance(obj, types.MethodType) else obj  # bound methods
    if getattr(fn, "flexlite_entry_point", False):
        # flexlite's entry points (flex_attention, create_block_mask: runtime.guards.opaque_to_compile), which a
        # module's forward calls: their caches fill as they run, and no mod's values come from them
        return (id(fn),)
    if isinstance(fn, types.FunctionType):
        parts = [id(fn.__code__)]
        for cell in fn.__closure__ or ():
            try:
                parts.append(_fingerprint(cell.cell_contents, seen, depth + 1))
            except ValueError:  # empty cell
                parts.append(None)
        names = _code_names(fn.__code__)
        for name in names:
            if name in fn.__globals__:
                value = fn.__globals__[name]
                if not isinstance(value, types.ModuleType):
                    parts.append((name, _fingerprint(value, seen, depth + 1)))
                else:  # a module's attributes the code may read (``cfg.cap``): its scalars and tensors, by name,
                    # and a user module's functions (``helpers.scale(s)`` reading ``helpers.CAP``)
                    user = not _library_module(value.__name__)
                    attrs = [(n, _fingerprint(a, seen, depth + 1)) for n in names
                             for a in (vars(value).get(n, None),)
                             if isinstance(a, (int, float, bool, str, torch.Tensor))
                             or (user and isinstance(a, types.FunctionType))]
                    if attrs:
                        parts.append((name, tuple(attrs)))
        if fn.__defaults__:  # a mod's extra parameters with defaults (their values are constants too)
            parts.append(_fingerprint(fn.__defaults__, seen, depth + 1))
        if fn.__dict__:  # attributes set on the function (a mod reading its own ``mod.w``)
            parts.append(_fingerprint(fn.__dict__, seen, depth + 1))
        if fn is not obj:
            parts.append(_fingerprint(obj.__self__, seen, depth + 1))
        return tuple(parts)
    if _has_state(obj):
        if len(seen) <= _MAX_OBJECTS:
            return tuple(_state_fingerprint(obj, seen, depth))
        seen.add(_TRUNCATED)
    if isinstance(obj, type):  # a class used as a namespace of settings (``Cfg.window``) or of helpers
        return (id(obj), *_class_constants(obj), *_class_functions(obj, seen, depth))
    return (id(obj),)


# probes: identity checks that stand for a plain function's fingerprint while they hold (trace_mod's hot path: a
# fingerprint walk costs ~10 us a mod a call, NOTES 102). Each is (kind, ...): the code object, a closure cell's
# contents, a namespace's entry (a global, a module's attribute; _ABSENT where there is none), the defaults tuple,
# a tensor's dtype and rank, the function's __dict__ (its items, by identity: attributes set on a mod, as flexlite's
# own ALiBi and head biases set ``flexlite_heads``)
_ABSENT = object()
_CODE, _CELL, _ENTRY, _DEFAULTS, _TENSOR, _DICT = range(6)
_MAX_PROBE_DEPTH = 4
_SCALARS = (int, float, bool, str, type(None))


def _probes(fn) -> Optional[tuple]:
    """The probes of ``fn`` (:func:`_probes_hold`), or None where its fingerprint must be walked: anything but a plain
    function whose closure, globals (a module's attributes by name), defaults, helpers and attributes set on it hold
    Python scalars, tensors, objects fingerprinted by identity alone, tuples of those or such functions."""
    probes: list = []
    return tuple(probes) if _probe_function(fn, probes, 0) else None


def _probe_function(fn, probes: list, depth: int) -> bool:
    if (not isinstance(fn, types.FunctionType) or depth > _MAX_PROBE_DEPTH
            or getattr(fn, "flexlite_entry_point", False)):
        return False
    this = fn if depth else None  # (the mod itself as None: the trace cache's weak key is not held by its probes)
    probes.append((_CODE, this, fn.__code__))
    attributes = tuple(fn.__dict__.items())
    probes.append((_DICT, this, attributes))
    if not all(_probe_value(value, probes, depth) for _, value in attributes):
        return False
    for cell in fn.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            return False
        probes.append((_CELL, cell, value))
        if not _probe_value(value, probes, depth):
            return False
    names = _code_names(fn.__code__)
    namespace = fn.__globals__
    for name in names:
        value = namespace.get(name, _ABSENT)
        probes.append((_ENTRY, namespace, name, value))
        if value is _ABSENT:
            continue
        if isinstance(value, types.ModuleType):  # (as the fingerprint reads it: its attributes of these names)
            user, attrs = not _library_module(value.__name__), vars(value)
            for n in names:
                a = attrs.get(n, _ABSENT)
                probes.append((_ENTRY, attrs, n, a))
                if isinstance(a, torch.Tensor):
                    probes.append((_TENSOR, a, a.dtype, a.dim()))
                elif user and isinstance(a, types.FunctionType) and not _probe_function(a, probes, depth + 1):
                    return False
        elif not _probe_value(value, probes, depth):
            return False
    if fn.__defaults__:
        probes.append((_DEFAULTS, this, fn.__defaults__))
        if not _probe_value(fn.__defaults__, probes, depth):
            return False
    return True


def _probe_value(value, probes: list, depth: int) -> bool:
    """Whether ``value``'s fingerprint is fixed by its identity (checked by the probe that holds it) and the probes this
    adds: a scalar, a tensor (its dtype and rank), a tuple of such values, a plain function (its own probes), an object
    fingerprinted by identity alone."""
    if isinstance(value, _SCALARS):
        return True
    if isinstance(value, torch.Tensor):
        probes.append((_TENSOR, value, value.dtype, value.dim()))
        return True
    if isinstance(value, tuple):
        return depth <= _MAX_PROBE_DEPTH and all(_probe_value(v, probes, depth + 1) for v in value)
    if isinstance(value, types.FunctionType):
        return _probe_function(value, probes, depth + 1)
    if isinstance(value, (list, dict, set, functools.partial, types.MethodType, type)) or _has_state(value):
        return False
    return not getattr(value, "flexlite_entry_point", False)  # (identity alone: a builtin, a dtype, a module)


def _probes_hold(probes: tuple, fn) -> bool:
    """Whether everything :func:`_probes` saw of ``fn`` is as it was (then the fingerprint is too)."""
    for probe in probes:
        kind = probe[0]
        if kind == _ENTRY:
            if probe[1].get(probe[2], _ABSENT) is not probe[3]:
                return False
        elif kind == _CELL:
            try:
                if probe[1].cell_contents is not probe[2]:
                    return False
            except ValueError:
                return False
        elif kind == _TENSOR:
            if probe[1].dtype != probe[2] or probe[1].dim() != probe[3]:
                return False
        elif kind == _CODE:
            if (fn if probe[1] is None else probe[1]).__code__ is not probe[2]:
                return False
        elif kind == _DICT:
            attributes = (fn if probe[1] is None else probe[1]).__dict__
            if len(attributes) != len(probe[2]) or any(
                    name != was or value is not value_was
                    for (name, value), (was, value_was) in zip(attributes.items(), probe[2])):
                return False
        elif (fn if probe[1] is None else probe[1]).__defaults__ is not probe[2]:  # _DEFAULTS
            return False
    return True


def _library_module(name: str) -> bool:
    return name.split(".")[0] in ("builtins", "torch", "triton", "numpy", "math", "functools", "operator")


@functools.lru_cache(maxsize=4096)
def _code_names(code: types.CodeType) -> tuple:
    """The global and attribute names ``code`` and the functions defined inside it (their code objects are its
    constants) read (per code object: a fingerprint is taken at every call)."""
    names, stack = [], [code]
    while stack:
        c = stack.pop()
        names.extend(c.co_names)
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return tuple(dict.fromkeys(names))


def _class_functions(cls, seen: set, depth: int) -> tuple:
    """The fingerprints of the static and class methods a user class defines (``Helper.apply(s)``, reading a
    global): called through the class, not an instance, so no instance's state walk reaches them."""
    parts = []
    for klass in cls.__mro__:
        if _library_module(getattr(klass, "__module__", None) or "builtins"):
            continue
        for name, value in vars(klass).items():
            if isinstance(value, (staticmethod, classmethod)) and isinstance(value.__func__, types.FunctionType):
                parts.append((klass.__name__, name, _fingerprint(value.__func__, seen, depth + 1)))
    return tuple(parts)


def _class_constants(cls) -> tuple:
    """The Python scalars and tensors ``cls`` and its user bases hold as class attributes (``w = 2.0``, read as
    ``self.w`` or ``Cls.w``): a change there changes the mod (its methods are fingerprinted where they are called)."""
    parts = []
    for klass in cls.__mro__:
        module = getattr(klass, "__module__", None) or ""
        if module == "builtins" or module == "torch" or module.startswith(("torch.", "triton")):
            continue
        for name, value in vars(klass).items():
            if isinstance(value, (int, float, bool, str, torch.Tensor)) and not name.startswith("__"):
                parts.append((klass.__name__, name, id(value) if isinstance(value, torch.Tensor) else value))
    return tuple(parts)


def capture_fingerprint(fn: Callable) -> tuple:
    return _fingerprint(fn, set())


def _fingerprint_and_truncated(fn: Callable) -> tuple:
    """(the fingerprint, whether its walk was cut short)."""
    seen: set = set()
    fp = _fingerprint(fn, seen)
    return fp, _TRUNCATED in seen


def _tensor_ids(fp: tuple) -> set:
    """The ids of the tensors a fingerprint holds (their entries: id, dtype, dims)."""
    ids, stack = set(), [fp]
    while stack:
        x = stack.pop()
        if isinstance(x, tuple):
            if len(x) == 3 and isinstance(x[1], torch.dtype):  # a tensor's entry
                ids.add(x[0])
            else:
                stack.extend(x)
    return ids


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
    """0-d examples of the mod's arguments in the kernels' dtypes (:data:`_ARG_DTYPES`): the score 0.5, indices 1."""
    names = SCORE_MOD_ARGS if kind == "score_mod" else MASK_MOD_ARGS
    return [torch.full((), 0.5 if name == "score" else 1, dtype=_ARG_DTYPES[name]) for name in names]


# ---------------------------------------------------------------------------------------------

# every trace cache hit by its probes also fingerprinted and compared (a RuntimeError where they differ): the tests
# set it (FLEXLITE_CHECK_PLANS, as flexlite.api's plans)
CHECK_PROBES = env_flag("FLEXLITE_CHECK_PLANS")
_TRACE_CACHE: "weakref.WeakKeyDictionary[Callable, tuple]" = weakref.WeakKeyDictionary()
_TRACE_CACHE_STRONG: dict = {}  # for callables that cannot be weakly referenced
# bound methods per function, then per object: ``obj.mod`` makes a new method object at each access (equal to the
# others), which a weak key would lose as soon as the first one died
_METHOD_CACHE: "weakref.WeakKeyDictionary[Callable, weakref.WeakKeyDictionary]" = weakref.WeakKeyDictionary()


def _cache_for(fn) -> tuple:
    """(the cache dict, the key) that ``fn``'s trace is kept under."""
    if isinstance(fn, types.MethodType):
        try:
            weakref.ref(fn.__self__)
            return _METHOD_CACHE.setdefault(fn.__func__, weakref.WeakKeyDictionary()), fn.__self__
        except TypeError:
            pass
    try:
        weakref.ref(fn)
        return _TRACE_CACHE, fn
    except TypeError:
        return _TRACE_CACHE_STRONG, fn


def trace_mod(fn: Callable, kind: str) -> TracedMod:
    """Trace ``fn`` (a score_mod or mask_mod) to a :class:`TracedMod`, cached per function; a TracedMod (a caller's
    trace of this call's mod, whose captures it has checked) is its own trace."""
    if kind not in ("score_mod", "mask_mod"):
        raise ValueError(f"kind must be 'score_mod' or 'mask_mod', got {kind!r}")
    if isinstance(fn, TracedMod):
        return fn
    check_arity(fn, kind)
    cache, key = _cache_for(fn)
    hit = cache.get(key)
    if hit is not None and hit[2] is not None and _probes_hold(hit[2], fn):
        if CHECK_PROBES and _fingerprint_and_truncated(fn)[0] != hit[0]:
            raise RuntimeError(f"flexlite: {mod_name(fn)!r}'s probes hold but its fingerprint changed: the probes miss "
                               f"something the fingerprint reads")
        return hit[1]
    fp, truncated = _fingerprint_and_truncated(fn)
    if hit is not None and hit[0] == fp:
        cache[key] = (fp, hit[1], None if truncated else _probes(fn))  # (what the probes saw changed, not the mod)
        return hit[1]
    traced = _trace(fn, kind)
    # a trace is kept only where its fingerprint sees everything it took: a captured tensor the walk did not meet
    # (made by a property or a parametrization at each access, or past the walk's limits) may be another one at
    # the next call, and a walk cut short may miss a changed value; such a mod is traced at every call
    reach = () if truncated or not traced.captured else _tensor_ids(fp)  # (on a miss only: not on the hot path)
    traced.volatile = truncated or any(id(t) not in reach for t in traced.captured.values())
    if not traced.volatile:
        cache[key] = (fp, traced, None if truncated else _probes(fn))
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
        with _TracingTorchFunctions(kind, name):
            graph = tracer.trace(wrapper)  # sets tracer.root
        gm = fx.GraphModule(tracer.root, graph)
    except UntraceableModError:
        raise
    except fx.proxy.TraceError as e:
        raise UntraceableModError(
            f"{kind} {name!r} cannot be traced: {e}. Python control flow (`if`, `while`, `and`/`or`, "
            f"`bool(...)`, `int(...)`, `.item()`) cannot depend on tensor values; write it with "
            f"torch.where(cond, a, b) and `&`, `|`, `~` instead.") from e
    except Exception as e:  # noqa: BLE001 - anything the mod itself raised while being traced
        if isinstance(e, NotImplementedError) and "argument of type" in str(e) and "numpy" in str(e):
            raise UntraceableModError(
                f"{kind} {name!r} uses a numpy array ({str(e).split(': ')[-1]}), which torch.fx cannot record; "
                f"make it a tensor (torch.as_tensor(x), on the inputs' device), or a Python number") from e
        raise UntraceableModError(f"{kind} {name!r} failed while being traced: {type(e).__name__}: {e}") from e
    captured = {n.target: getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    for target, value in captured.items():
        if not isinstance(value, torch.Tensor):
            raise UntraceableModError(f"{kind} {name!r} captures {type(value).__name__} {target!r}; only tensors "
                                      f"and Python scalars can be captured")
    try:
        with torch.no_grad():  # (examples only: no autograd graph, which a checkpoint's forward would count)
            _DtypeProp(gm).run(*_example_inputs(kind))
    except Exception as e:  # noqa: BLE001
        raise UntraceableModError(
            f"{kind} {name!r} failed on 0-d example inputs (indices are 0-d int32 tensors, the score a 0-d "
            f"float32 tensor): {type(e).__name__}: {e}") from e
    _warn_of_type_checks(fn, kind, name)
    return TracedMod(kind=kind, name=name, graph_module=gm, captured=captured)


def _warn_of_type_checks(fn: Callable, kind: str, name: str) -> None:
    """A UserWarning where the mod's own code reads both ``isinstance`` and ``Tensor``: traced, its values are
    torch.fx proxies, for which ``isinstance(x, torch.Tensor)`` is False (torch's vmapped tensors say True), so a
    branch on it was traced down its other side."""
    code = getattr(fn, "__code__", None) or getattr(getattr(fn, "__call__", None), "__code__", None)
    if code is not None and {"isinstance", "Tensor"} <= set(code.co_names):
        warnings.warn(f"{kind} {name!r} calls isinstance on torch.Tensor: while it is traced its values are torch.fx "
                      f"proxies and isinstance(x, torch.Tensor) is False there (torch's flex_attention says True); "
                      f"branch on x.dtype instead", UserWarning, stacklevel=2)


_RANDOM_OPS = frozenset(getattr(owner, name) for owner, names in (
    (torch, ("rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "bernoulli",
             "multinomial", "normal", "poisson")),
    (torch.Tensor, ("uniform_", "normal_", "bernoulli", "bernoulli_", "random_", "exponential_", "geometric_",
                    "cauchy_", "log_normal_"))) for name in names if hasattr(owner, name))


class _TracingTorchFunctions(torch.overrides.TorchFunctionMode):
    """torch's functions while a mod is traced. Its random numbers refused. A draw made while tracing
    (``torch.rand(())``, whose arguments are no traced values) would become a constant of the trace, one draw broadcast
    to every position; torch's flex_attention refuses random ops under its vmap too. ``torch.as_tensor`` of a traced
    value is that value (in the dtype asked), as in torch; ``torch.tensor`` of one (a copy, which torch's vmap cannot
    make of its values either) is refused with what to write instead."""

    def __init__(self, kind: str, name: str):
        super().__init__()
        self.kind, self.name = kind, name

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _RANDOM_OPS:
            raise UntraceableModError(f"{self.kind} {self.name!r} calls {getattr(func, '__name__', func)}: random "
                                      f"numbers inside a mod are not supported (a trace would keep one draw for every "
                                      f"position); draw them outside it into a tensor the mod reads")
        if func in (torch.as_tensor, torch.tensor) and _holds_traced(args[:1] + ((kwargs["data"],) if "data" in kwargs
                                                                                 else ())):
            data = args[0] if args else kwargs["data"]
            if func is torch.tensor or not isinstance(data, fx.Proxy):
                raise UntraceableModError(
                    f"{self.kind} {self.name!r} calls torch.{func.__name__} on its traced values: use the value "
                    f"itself (x.to(dtype) for another dtype, torch.as_tensor(x) as torch does), and torch.where / "
                    f"arithmetic rather than a tensor built of several values")
            dtype = args[1] if len(args) > 1 else kwargs.get("dtype")
            return data if dtype is None else data.to(dtype)
        return func(*args, **kwargs)


def _holds_traced(values) -> bool:
    """Whether ``values`` (nested lists / tuples) hold a traced value."""
    return any(isinstance(v, fx.Proxy) or (isinstance(v, (list, tuple)) and _holds_traced(v)) for v in values)


# the dtypes a mod's arguments have in the kernels (and the traces' examples, _example_inputs)
_ARG_DTYPES = {"score": torch.float32, "b": torch.int32, "h": torch.int32, "q_idx": torch.int32, "kv_idx": torch.int32}


class _ModProxy(fx.Proxy):
    """A traced value: numpy scalars on its left (``np.float32(0.5) * score``) leave the operation to it (numpy would
    take it for an array), as on its right."""

    __array_ufunc__ = None


class _ArgProxy(_ModProxy):
    """A mod's argument while it is traced: its dtype is a constant (``torch.finfo(score.dtype).min``, ``if
    score.dtype == torch.float32``, ``score.is_floating_point()`` work as in torch), its values are not."""

    def __getattr__(self, name):
        if name == "dtype":
            return _ARG_DTYPES[self.node.target]
        return super().__getattr__(name)

    def is_floating_point(self) -> bool:
        return _ARG_DTYPES[self.node.target].is_floating_point


class _ModTracer(fx.Tracer):
    """symbolic_trace's tracer, except that a captured ``nn.Parameter`` (a learnable bias table, say) is
    a captured tensor like any other, and modules a mod calls (a GraphModule of an earlier trace, say)
    are traced through, instead of being errors for not belonging to the (empty) root module."""

    def proxy(self, node):
        if node.op == "placeholder" and node.target in _ARG_DTYPES:
            return _ArgProxy(node, self)
        return _ModProxy(node, self)

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
        if type(a).__module__ == "numpy" and hasattr(a, "item") and getattr(a, "ndim", None) == 0:
            a = a.item()  # a numpy scalar (np.float32(0.5)) as the Python number torch takes it for
        return super().create_arg(a)


def _fixed_signature(fn: Callable, arg_names: tuple) -> Callable:
    ns = {"fn": fn}
    params = ", ".join(arg_names)
    exec(f"def {'mod'}({params}):\n    return fn({params})\n", ns)  # noqa: S102 - fixed, generated text
    return ns["mod"]
