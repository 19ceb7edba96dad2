"""fx graph of a traced mod -> a ``@triton.jit`` function, through one op table.

Every fx node becomes one line ``t_<name> = <expr>``. The table ``OPS`` maps an op key to a small
format function; ``call_function`` targets (``operator.add``, ``torch.where``, ...) and
``call_method`` names (``"clamp"``, ``"__getitem__"``, ...) are first normalised to that key, so
adding an op is one table entry.

Captured tensors become kernel arguments (pointer, then one stride and one size per dimension);
indexing them with symbolic indices becomes a bounds-masked gather. The generated function's
parameters are ``(score, b, h, q_idx, kv_idx, <captures>)`` for a score_mod and
``(b, h, q_idx, kv_idx, <captures>)`` for a mask_mod.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from typing import Callable, Optional

import torch
import torch.fx as fx

from .. import ops  # noqa: F401 - registers flexlite's own ops (torch.ops.flexlite.*)
from .trace import TracedMod, UntraceableModError, arguments_read

_TL_DTYPES = {
    torch.bool: "tl.int1", torch.int8: "tl.int8", torch.uint8: "tl.uint8", torch.int16: "tl.int16",
    torch.int32: "tl.int32", torch.int64: "tl.int64", torch.float16: "tl.float16",
    torch.bfloat16: "tl.bfloat16", torch.float32: "tl.float32", torch.float64: "tl.float64",
}
INT64_INDEX_LIMIT = 2**31 - 1
# integers up to this magnitude are exact in float32 (see _Lowerer.float_index)
FLOAT32_EXACT_INT = 2**24


@dataclasses.dataclass
class Val:
    """A lowered value: Triton expression text, torch dtype, python value if it is a literal."""

    expr: str
    dtype: Optional[torch.dtype]
    literal: object = None
    is_literal: bool = False

    @property
    def is_float(self) -> bool:
        return self.dtype is not None and self.dtype.is_floating_point

    @property
    def is_bool(self) -> bool:
        return self.dtype == torch.bool


@dataclasses.dataclass
class _View:
    """A captured tensor indexed on its leading dims so far (nothing is loaded until all are)."""

    param: str
    tensor: torch.Tensor
    indices: tuple = ()


def literal(value) -> Val:
    if isinstance(value, bool):
        return Val(repr(value), torch.bool, value, True)
    if isinstance(value, int):
        return Val(repr(value), torch.int64, value, True)
    if isinstance(value, float):
        text = repr(value) if math.isfinite(value) else f'float("{value}")'
        return Val(text, torch.float32, value, True)
    raise UntraceableModError(f"unsupported constant {value!r} of type {type(value).__name__}")


def cast(v: Val, dtype: torch.dtype) -> str:
    """Text of ``v`` converted to ``dtype`` (bool means != 0, like torch)."""
    if v.is_literal:
        py = bool if dtype == torch.bool else float if dtype.is_floating_point else int
        return literal(py(v.literal)).expr
    if v.dtype == dtype:
        return v.expr
    if dtype == torch.bool:
        return f"({v.expr} != 0)"
    return f"{v.expr}.to({_TL_DTYPES[dtype]})"


def as_float(v: Val) -> str:
    return v.expr if v.is_float else cast(v, torch.float32)


# ---------------------------------------------------------------------------------------------
# the op table: key -> (args: list[Val], kwargs: dict, node) -> expression text

def _binary(op):
    return lambda a, kw, n: f"({a[0].expr} {op} {a[1].expr})"


def _compare(op):
    """A compare; of float values through int8 and back: Triton 3.6's interpreter keeps a float compare's result in
    its operands' float dtype (0.0 / 1.0), which a later ``&`` / ``|`` with a bool rejects (numpy's bitwise ops);
    compiled, the casts fold away (sm_90a offline: the same SASS tile loops, test_gpu_compile)"""
    def emit(a, kw, n):
        text = f"({a[0].expr} {op} {a[1].expr})"
        return f"({text}.to(tl.int8) != 0)" if any(isinstance(x, Val) and x.is_float for x in a[:2]) else text
    return emit


# ops whose two tensor operands torch promotes to one dtype first (where: its last two)
_PROMOTING_OPS = ("add", "sub", "mul", "floordiv", "mod", "fmod", "div", "and", "or", "xor", "eq", "ne", "lt", "le",
                  "gt", "ge", "minimum", "maximum", "where")


def _promote_ints(args: list) -> list:
    """``args`` with two integer tensor operands of different dtypes cast to torch's promoted one (uint8 with int8 is
    int16 in torch; Triton keeps such a pair in 8 bits, unsigned, so negative values wrapped)."""
    at = [i for i, a in enumerate(args) if isinstance(a, Val) and not a.is_literal and a.dtype is not None and
          not a.dtype.is_floating_point and a.dtype != torch.bool][-2:]
    if len(at) != 2 or args[at[0]].dtype == args[at[1]].dtype:
        return args
    dtype = torch.promote_types(args[at[0]].dtype, args[at[1]].dtype)
    return [Val(cast(a, dtype), dtype) if i in at else a for i, a in enumerate(args)]


def _add_sub(op):
    def lower(a, kw, n):  # torch.add / sub(x, y, alpha=a): x + a * y
        alpha = kw.get("alpha")
        return f"({a[0].expr} {op} {a[1].expr if alpha is None else f'({alpha.expr} * {a[1].expr})'})"
    return lower


def _float_fn(fn):
    return lambda a, kw, n: f"{fn}({as_float(a[0])})"


def _truediv(a, kw, n):
    x, y = a
    if y.is_literal and not isinstance(y.literal, bool) and 1e-30 < abs(y.literal) < 1e30:
        # by a constant: a multiply by its reciprocal (an IEEE fp32 division is a multi-instruction sequence);
        # within 1.5 ulp of the division, exact for powers of two (docs/NUMERICS.md)
        return f"({as_float(x)} * {literal(1.0 / y.literal).expr})"
    if not x.is_float and not y.is_float:
        return f"({as_float(x)} / {as_float(y)})"
    return f"({x.expr} / {y.expr})"


def _floordiv(a, kw, n):
    x, y = a
    if x.is_float or y.is_float:
        return f"tl.floor({x.expr} / {y.expr})"
    return f"py_floordiv({x.expr}, {y.expr})"


def _mod(a, kw, n):
    x, y = a
    if x.is_float or y.is_float:
        return f"({x.expr} - {y.expr} * tl.floor({x.expr} / {y.expr}))"
    return f"py_mod({x.expr}, {y.expr})"


def _fmod(a, kw, n):
    x, y = a
    if x.is_float or y.is_float:
        return f"({x.expr} - {y.expr} * trunc_float({x.expr} / {y.expr}))"
    return f"({x.expr} % {y.expr})"  # Triton's integer % truncates, like fmod


def _div(a, kw, n):
    mode = kw.get("rounding_mode")
    if mode is None:
        return _truediv(a, kw, n)
    if mode == "floor":
        return _floordiv(a, kw, n)
    if mode == "trunc":
        x, y = a
        if x.is_float or y.is_float:
            return f"trunc_float({x.expr} / {y.expr})"
        return f"({x.expr} // {y.expr})"  # Triton's integer // truncates
    raise UntraceableModError(f"torch.div rounding_mode={mode!r} is not supported")


def _pow(a, kw, n):
    """The fast paths of ``x ** y`` (a small integer or 0.5 exponent, a positive constant base of a float result);
    None where :meth:`_Lowerer.power` must write the general case."""
    x, y = a
    dtype = n.meta["dtype"]
    if y.is_literal and not isinstance(y.literal, bool) and float(y.literal).is_integer() and abs(y.literal) <= 8:
        k = int(y.literal)
        base = as_float(x) if dtype.is_floating_point else x.expr  # int ** 2.0 is a float in torch
        if k == 0:
            return f"({base} * 0 + 1)"
        prod = " * ".join([base] * abs(k))
        return f"({prod})" if k > 0 else f"(1.0 / ({prod}))"
    if y.is_literal and y.literal == 0.5:
        return f"tl.sqrt({as_float(x)})"
    if x.is_literal and dtype.is_floating_point and not isinstance(x.literal, bool) and \
            0 < x.literal < math.inf and x.literal != 1:
        # exact at y == 0 (1), y == +-inf (inf or 0) and NaN (NaN), as torch
        return f"tl.exp2({as_float(y)} * {math.log2(x.literal)!r})"
    return None


def _minmax(fn):
    def lower(a, kw, n):
        x, y = a
        nan = ", propagate_nan=tl.PropagateNan.ALL" if (x.is_float or y.is_float) else ""
        return f"{fn}({x.expr}, {y.expr}{nan})"
    return lower


def _clamp(a, kw, n):
    x = a[0]
    lo = a[1] if len(a) > 1 else kw.get("min")
    hi = a[2] if len(a) > 2 else kw.get("max")
    expr = x
    if lo is not None and not (lo.is_literal and lo.literal is None):
        expr = Val(_minmax("tl.maximum")([expr, lo], {}, n), x.dtype)
    if hi is not None and not (hi.is_literal and hi.literal is None):
        expr = Val(_minmax("tl.minimum")([expr, hi], {}, n), x.dtype)
    return expr.expr


def _invert(a, kw, n):
    return f"({a[0].expr} == 0)" if a[0].is_bool else f"(~{a[0].expr})"


def _logical(op):
    return lambda a, kw, n: f"({cast(a[0], torch.bool)} {op} {cast(a[1], torch.bool)})"


def _where(a, kw, n):
    c, x, y = a
    return f"tl.where({cast(c, torch.bool)}, {x.expr}, {y.expr})"


def _to(a, kw, n):
    dtype = n.meta["dtype"]
    return cast(a[0], dtype)


def _rounded(a, n, template: str) -> str:
    """A float rounding (``template`` over ``{x}``); integers are whole already."""
    if not a[0].dtype.is_floating_point:
        return a[0].expr
    return template.format(x=as_float(a[0]))


# half to even, as torch.round; floats from 2**23 up are whole already (x + 0.5 would round there)
_HALF_EVEN = ("tl.where(tl.abs({x}) >= 8388608.0, {x}, tl.where((tl.floor({x} + 0.5) - {x} == 0.5) & "
              "(tl.floor({x} + 0.5) % 2.0 != 0.0), tl.floor({x} + 0.5) - 1.0, tl.floor({x} + 0.5)))")


def _round(a, kw, n) -> str:
    """torch.round(x, decimals=d): as torch, x * 10**d rounded, divided by 10**d (for d < 0: x / 10**-d rounded,
    times 10**-d)."""
    decimals = kw.get("decimals", a[1] if len(a) > 1 else None)
    d = 0 if decimals is None else int(decimals.literal)
    if d == 0 or not a[0].dtype.is_floating_point:
        return _rounded(a[:1], n, _HALF_EVEN)
    f, x = repr(10.0 ** abs(d)), as_float(a[0])
    inner, outer = ("*", "/") if d > 0 else ("/", "*")
    return f"({_HALF_EVEN.format(x=f'({x} {inner} {f})')} {outer} {f})"


def _softplus(a, kw) -> str:
    beta = kw.get("beta", a[1] if len(a) > 1 else None)
    threshold = kw.get("threshold", a[2] if len(a) > 2 else None)
    beta = 1.0 if beta is None else float(beta.literal)
    threshold = 20.0 if threshold is None else float(threshold.literal)
    x = as_float(a[0])
    return (f"tl.where({x} * {beta!r} > {threshold!r}, {x}, "
            f"tl.log(1.0 + tl.exp({x} * {beta!r})) * {1.0 / beta!r})")


def _constant(value_of: Callable):
    def lower(a, kw, n):
        dtype = n.meta["dtype"]
        return f"tl.full([], {cast(literal(value_of(a, kw)), dtype)}, {_TL_DTYPES[dtype]})"
    return lower


def _gelu(a, kw, n):
    x = as_float(a[0])
    if kw.get("approximate", "none") == "tanh":
        return f"(0.5 * {x} * (1.0 + tanh(0.7978845608028654 * ({x} + 0.044715 * {x} * {x} * {x}))))"
    return f"(0.5 * {x} * (1.0 + tl.erf({x} * 0.7071067811865476)))"


def _sign(a, kw, n):
    x = a[0].expr
    return f"tl.where({x} > 0, 1, tl.where({x} < 0, -1, 0)).to({_TL_DTYPES[n.meta['dtype']]})"


def _floor_ceil(fn):
    return lambda a, kw, n: f"{fn}({a[0].expr})" if a[0].is_float else a[0].expr


def _unsupported(n):
    raise UntraceableModError(f"no lowering for {n.format_node()}")


def _and(*conds):
    """Conjunction of conditions, each a Python bool (a constant) or kernel text; a bool where constants decide."""
    if any(c is False for c in conds):
        return False
    texts = [f"({c})" for c in conds if c is not True]
    return " & ".join(texts) if len(texts) > 1 else (texts[0] if texts else True)


def _or(*conds):
    if any(c is True for c in conds):
        return True
    texts = [f"({c})" for c in conds if c is not False]
    return " | ".join(texts) if len(texts) > 1 else (texts[0] if texts else False)


# ops whose Python int operand torch converts to the dtype of their integer tensor operands, wrapping it (int32
# q_idx + 2**33 is q_idx + 0 in torch): Triton would reject such a constant
_WRAPPING_OPS = ("add", "sub", "mul", "floordiv", "mod", "fmod", "div", "pow", "and", "or", "xor", "lshift",
                 "rshift", "eq", "ne", "lt", "le", "gt", "ge")


def _wrap_int_literals(args: list) -> list:
    """``args`` with each Python int outside the range of the (promoted) integer dtype of the other operands
    replaced by its value in that dtype, as torch converts it."""
    tensors = [a for a in args if isinstance(a, Val) and not a.is_literal and a.dtype is not None]
    if not tensors or not all(not a.is_float and not a.is_bool for a in tensors):
        return args
    dtype = functools.reduce(torch.promote_types, [a.dtype for a in tensors])
    info = torch.iinfo(dtype)
    span = info.max - info.min + 1

    def wrapped(a):
        if isinstance(a, Val) and a.is_literal and type(a.literal) is int and not info.min <= a.literal <= info.max:
            return literal((a.literal - info.min) % span + info.min)
        return a

    return [wrapped(a) for a in args]


OPS: dict[str, Callable] = {
    "add": _add_sub("+"), "sub": _add_sub("-"), "mul": _binary("*"), "truediv": _truediv,
    "floordiv": _floordiv, "mod": _mod, "fmod": _fmod, "div": _div, "pow": _pow,
    "neg": lambda a, kw, n: f"(-{a[0].expr})", "pos": lambda a, kw, n: a[0].expr,
    "abs": lambda a, kw, n: f"tl.abs({a[0].expr})",
    "and": _binary("&"), "or": _binary("|"), "xor": _binary("^"), "invert": _invert,
    "lshift": _binary("<<"), "rshift": _binary(">>"),
    "eq": _compare("=="), "ne": _compare("!="), "lt": _compare("<"), "le": _compare("<="),
    "gt": _compare(">"), "ge": _compare(">="),
    "logical_and": _logical("&"), "logical_or": _logical("|"), "logical_xor": _logical("^"),
    "logical_not": lambda a, kw, n: f"({cast(a[0], torch.bool)} == 0)",
    "where": _where, "clamp": _clamp, "clamp_min": lambda a, kw, n: _clamp([a[0], a[1]], {}, n),
    "clamp_max": lambda a, kw, n: _clamp([a[0]], {"max": a[1]}, n),
    "minimum": _minmax("tl.minimum"), "maximum": _minmax("tl.maximum"),
    "exp": _float_fn("tl.exp"), "exp2": _float_fn("tl.exp2"), "log": _float_fn("tl.log"),
    "log2": _float_fn("tl.log2"), "sqrt": _float_fn("tl.sqrt"), "rsqrt": _float_fn("tl.rsqrt"),
    "sin": _float_fn("tl.sin"), "cos": _float_fn("tl.cos"), "erf": _float_fn("tl.erf"),
    "sigmoid": _float_fn("tl.sigmoid"), "tanh": _float_fn("tanh"), "tanh_approx": _float_fn("tanh_approx"),
    "atan": _float_fn("atan"), "asin": _float_fn("asin"), "acos": _float_fn("acos"), "tan": _float_fn("tan"),
    "sinh": _float_fn("sinh"), "cosh": _float_fn("cosh"),
    "atan2": lambda a, kw, n: f"atan2({as_float(a[0])}, {as_float(a[1])})",
    "log1p": lambda a, kw, n: f"tl.log(1.0 + {as_float(a[0])})",
    "expm1": lambda a, kw, n: f"(tl.exp({as_float(a[0])}) - 1.0)",
    "floor": _floor_ceil("tl.floor"), "ceil": _floor_ceil("tl.ceil"), "sign": _sign,
    "relu": lambda a, kw, n: f"tl.maximum({a[0].expr}, 0)", "gelu": _gelu,
    "square": lambda a, kw, n: f"({a[0].expr} * {a[0].expr})",
    "reciprocal": lambda a, kw, n: f"(1.0 / {as_float(a[0])})",
    "log10": lambda a, kw, n: f"(tl.log({as_float(a[0])}) * 0.4342944819032518)",
    "trunc": lambda a, kw, n: _rounded(a, n, "tl.where({x} < 0, tl.ceil({x}), tl.floor({x}))"),
    "round": _round,
    "isinf": lambda a, kw, n: f"(tl.abs({as_float(a[0])}) == float('inf'))",
    "isnan": lambda a, kw, n: f"({as_float(a[0])} != {as_float(a[0])})",
    "isfinite": lambda a, kw, n: f"(tl.abs({as_float(a[0])}) < float('inf'))",
    # torch's defaults: beta 1, threshold 20 (x itself above it)
    "softplus": lambda a, kw, n: _softplus(a, kw),
    "silu": lambda a, kw, n: f"({as_float(a[0])} * tl.sigmoid({as_float(a[0])}))",
    "clone": lambda a, kw, n: a[0].expr,
    "to": _to,
    "ones_like": _constant(lambda a, kw: 1), "zeros_like": _constant(lambda a, kw: 0),
    "full_like": _constant(lambda a, kw: (a[1].literal if len(a) > 1 else kw["fill_value"].literal)),
    "new_full": _constant(lambda a, kw: (a[2].literal if len(a) > 2 else kw["fill_value"].literal)),
    "tensor": _constant(lambda a, kw: a[0].literal),  # torch.tensor(0.5, device=score.device)
}

# call_function targets and call_method names -> op key
_FUNCTIONS = {
    operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.truediv: "truediv",
    operator.floordiv: "floordiv", operator.mod: "mod", operator.pow: "pow", operator.neg: "neg",
    operator.pos: "pos", abs: "abs", operator.abs: "abs", operator.and_: "and", operator.or_: "or",
    operator.xor: "xor", operator.invert: "invert", operator.lshift: "lshift",
    operator.rshift: "rshift", operator.eq: "eq", operator.ne: "ne", operator.lt: "lt",
    operator.le: "le", operator.gt: "gt", operator.ge: "ge", operator.getitem: "getitem",
    torch.nn.functional.relu: "relu", torch.nn.functional.gelu: "gelu",
    torch.special.erf: "erf", torch.special.expit: "sigmoid", torch.special.exp2: "exp2",
    torch.max: "maximum", torch.min: "minimum", torch.true_divide: "truediv",
    torch.bitwise_and: "and", torch.bitwise_or: "or", torch.bitwise_xor: "xor",
    torch.bitwise_not: "invert", torch.greater: "gt", torch.less: "lt",
    torch.greater_equal: "ge", torch.less_equal: "le", torch.not_equal: "ne", torch.multiply: "mul",
    torch.subtract: "sub", torch.divide: "div", torch.negative: "neg",
    torch.ops.flexlite.tanh_approx.default: "tanh_approx", torch.ops.flexlite.tanh_approx: "tanh_approx",
    torch.nn.functional.softplus: "softplus", torch.nn.functional.silu: "silu", torch.special.log1p: "log1p",
    torch.special.expm1: "expm1",
}
# 0-d constants (torch.zeros((), device=score.device)): as the *_like constants (their dtype is the node's)
_FUNCTIONS.update({torch.zeros: "zeros_like", torch.ones: "ones_like", torch.full: "full_like",
                   torch.tensor: "tensor", torch.fix: "trunc"})
for _name in ("add", "sub", "mul", "div", "remainder", "fmod", "pow", "neg", "abs", "where", "clamp",
              "clamp_min", "clamp_max", "clip", "minimum", "maximum", "exp", "exp2", "log", "log2", "sqrt",
              "rsqrt", "sin", "cos", "erf", "sigmoid", "tanh", "log1p", "expm1", "floor", "ceil", "sign",
              "relu", "square", "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or",
              "logical_xor", "logical_not", "ones_like", "zeros_like", "full_like", "floor_divide",
              "reciprocal", "log10", "trunc", "round", "isinf", "isnan", "isfinite", "clone", "atan", "atan2",
              "asin", "acos", "tan", "sinh", "cosh", "arctan", "arctan2", "arcsin", "arccos"):
    _FUNCTIONS[getattr(torch, _name)] = _name
_ALIASES = {"remainder": "mod", "clip": "clamp", "floor_divide": "floordiv", "__getitem__": "getitem",
            "__and__": "and", "__or__": "or", "__xor__": "xor", "__invert__": "invert", "bitwise_not": "invert",
            "float": "to", "int": "to", "long": "to", "bool": "to", "half": "to", "bfloat16": "to",
            "double": "to", "type": "to", "type_as": "to", "fix": "trunc", "new_ones": "ones_like",
            "new_zeros": "zeros_like", "arctan": "atan", "arctan2": "atan2", "arcsin": "asin", "arccos": "acos",
            "masked_fill": None, "true_divide": "truediv", "index_put_": "index_put"}


# custom operators by their qualified name: attention-gym's softcap registers "approx::tanh" (tanh.approx on GPU)
_CUSTOM_OPS = {"approx::tanh": "tanh_approx", "flexlite::tanh_approx": "tanh_approx"}


def _qualified_op_name(target) -> Optional[str]:
    """``"namespace::name"`` of a torch.library operator (an OpOverloadPacket or OpOverload), else None."""
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    if isinstance(target, torch._ops.OpOverload):
        return target.name()
    return None


def op_key(node: fx.Node) -> Optional[str]:
    if node.op == "call_function":
        if node.target not in _FUNCTIONS and _qualified_op_name(node.target) in _CUSTOM_OPS:
            return _CUSTOM_OPS[_qualified_op_name(node.target)]
        return _ALIASES.get(_FUNCTIONS.get(node.target), _FUNCTIONS.get(node.target))
    if node.op == "call_method":
        name = _ALIASES.get(node.target, node.target)
        return name if name in ("getitem", "index_put") or name in OPS else None
    return None


def _target_name(node: fx.Node) -> str:
    t = node.target
    if node.op == "call_method":
        return f"Tensor.{t}"
    name = _qualified_op_name(t)
    if name is not None:
        return f"the operator {name!r}"
    qualname = getattr(t, "__qualname__", None) or ""
    if getattr(t, "__module__", None) == "math":
        return f"math.{qualname} (math's functions take Python numbers: use torch.{qualname})"
    if qualname.startswith("_VariableFunctionsClass."):  # torch.dot and the other torch.* builtins
        return f"torch.{qualname.split('.', 1)[1]}"
    return qualname or getattr(t, "__name__", None) or str(t)


# ops that combine a vector per score (a dot product: MLA's rope term), which a mod, one score at a time, cannot
# lower; what to do instead
_VECTOR_OPS = ("dot", "vdot", "inner", "matmul", "mm", "bmm", "mv", "einsum", "tensordot", "sum", "mean", "prod",
               "norm", "__matmul__")
_VECTOR_HINT = ("a mod computes one score at a time, so a product of vectors per score (MLA's rope term, "
                "q_rope[b, h, q_idx] . k_rope[b, h, kv_idx]) has no lowering; put the vectors into the attention "
                "instead: query = torch.cat([q, q_rope / scale], -1), key = torch.cat([k, k_rope], -1), and pass "
                "scale explicitly (the default 1/sqrt(head dim) follows the longer head dim)")


def _vector_op(node: fx.Node) -> bool:
    t = node.target
    name = t if isinstance(t, str) else getattr(t, "__name__", "")
    return name in _VECTOR_OPS


# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class LoweredMod:
    """A mod as Triton source: ``source`` defines ``@triton.jit def <fn_name>(<inputs>, <params>)``."""

    fn_name: str
    source: str
    params: list  # kernel parameter names for the captured tensors, in order
    tensors: list  # captured tensors, in order (one per pointer parameter)
    result_dtype: Optional[torch.dtype] = None  # torch dtype of the mod's value before the final cast
    # values computed apart (see lower_mod's ``hoist``): their names in the mod, which takes them as parameters
    # after its inputs, and ``hoist_source`` defines ``<fn_name>_hoist(<hoist inputs>, <params>)`` that returns them
    hoisted: tuple = ()
    hoist_source: str = ""
    # score_mod's constant factors taken out (lower_mod's ``fold_scales``): the mod is ``out_scale * f(in_scale *
    # score)`` and the function computes f of its (already multiplied) input; None: no such factor
    in_scale: Optional[float] = None
    out_scale: Optional[float] = None
    # score_mod is ``score + bias`` with a bias that splits into a query side and a key side (lower_mod's
    # ``separate``): the function then gives the bias when called with score -0.0
    separable: bool = False
    # that bias is affine in kv_idx (:func:`_affine_in_keys`): along a tile's keys start_n + j, the bias at
    # start_n plus one vector of j that is the same for every tile
    affine_keys: bool = False

    def kernel_args(self) -> list:
        """Runtime values for ``params``: per tensor its pointer, strides, sizes."""
        out = []
        for t in self.tensors:
            out.append(t)
            out.extend(t.stride())
            out.extend(t.shape)
        return out


class _Lowerer:
    """``float_index``: q_idx and kv_idx are below FLOAT32_EXACT_INT (the caller knows the lengths), so an int
    value built from them by one add or subtract (plus negations / abs) that a float32 operation consumes is
    computed in float32 from the converted vectors: ``kv_idx - q_idx`` times a float becomes
    ``(kv_idx.to(f32) - q_idx.to(f32))`` times it, one subtraction per score instead of an int subtraction and
    a conversion (which Triton would do per element of the tile). Bit-identical: both operands are exact in
    float32 and one IEEE subtraction rounds the exact difference as the conversion would."""

    def __init__(self, traced: TracedMod, prefix: str, float_index: bool = False):
        self.traced = traced
        self.prefix = prefix
        self.float_index = float_index
        self.lines: list[str] = []
        self.params: list[str] = []
        self.tensors: list[torch.Tensor] = []
        self.views: dict[str, _View] = {}
        self.env: dict[fx.Node, object] = {}
        # int value name -> (float32 expression of the same value, whether that expression is exact: no rounding)
        self.float_forms: dict[str, tuple[str, bool]] = {}
        # (captured tensor's param, index expressions) -> the value loaded there: a mod that reads an element twice
        # (a document mask's doc_id[q_idx], once for the comparison and once for the document's start) loads it once
        self.loaded: dict[tuple, Val] = {}
        self.aliases: dict[fx.Node, fx.Node] = {}  # nodes that take another node's value (lower_mod's fold_scales)

    @functools.cached_property
    def bh_only(self) -> tuple[set, set]:
        """:func:`_only` ``b`` and ``h`` of the mod's graph, walked once."""
        return _only(self.traced.graph_module, ("b", "h"))

    def fail(self, node: fx.Node, why: str):
        raise UntraceableModError(f"{self.traced.kind} {self.traced.name!r}: {why} (at `{node.format_node()}`)")

    # -- captured tensors
    def capture(self, node: fx.Node) -> _View:
        if node.target not in self.views:
            tensor = self.traced.captured[node.target]
            param = f"{self.prefix}c{len(self.tensors)}"
            self.params += [param] + [f"{param}_s{d}" for d in range(tensor.dim())] + \
                           [f"{param}_n{d}" for d in range(tensor.dim())]
            self.tensors.append(tensor)
            self.views[node.target] = _View(param, tensor)
        return self.views[node.target]

    def index(self, node: fx.Node, view: _View, index) -> object:
        items = index if isinstance(index, tuple) else (index,)
        for item in items:
            if not isinstance(item, Val):
                self.fail(node, f"captured tensors can only be indexed by integers and index values, "
                                f"not {type(item).__name__} (no slicing, None or ...)")
            if item.is_float or item.is_bool:
                self.fail(node, "a captured tensor is indexed by a float or bool value; index with integers")
        view = _View(view.param, view.tensor, view.indices + items)
        if len(view.indices) > view.tensor.dim():
            self.fail(node, f"too many indices for a captured tensor of {view.tensor.dim()} dims")
        return self.load(node, view) if len(view.indices) == view.tensor.dim() else view

    def load(self, node: fx.Node, view: _View) -> Val:
        key = (view.param, tuple(ix.expr for ix in view.indices))
        if key not in self.loaded:
            ptr, masks = self.address(node, view)
            mask = f", mask={' & '.join(masks)}, other=0" if masks else ""
            self.loaded[key] = self.emit(node, f"tl.load({ptr}{mask})", view.tensor.dtype)
        return self.loaded[key]

    def address(self, node: fx.Node, view: _View) -> tuple[str, list]:
        """Pointer expression of a fully indexed captured tensor, and its in-range masks."""
        p = view.param
        wide = view.tensor.numel() > INT64_INDEX_LIMIT
        offsets, masks = [], []
        for d, ix in enumerate(view.indices):
            if ix.is_literal:
                if not -view.tensor.shape[d] <= ix.literal < view.tensor.shape[d]:
                    self.fail(node, f"constant index {ix.literal} is out of range for dim {d} of size "
                                    f"{view.tensor.shape[d]}")
                text = f"({ix.literal} + {p}_n{d})" if ix.literal < 0 else repr(ix.literal)
            else:
                # python-style negative indices wrap; anything still out of range reads 0
                raw = ix.expr + (".to(tl.int64)" if wide else "")
                text = f"t_{node.name}_i{d}"
                self.lines.append(f"{text} = {raw}")
                self.lines.append(f"{text} = tl.where({text} < 0, {text} + {p}_n{d}, {text})")
                masks.append(f"({text} >= 0) & ({text} < {p}_n{d})")
            offsets.append(f"{text} * {p}_s{d}")
        return " + ".join([p] + offsets), masks

    def scatter_add(self, node: fx.Node) -> Val:
        """``buf.index_put_(indices, value, accumulate=True)`` into a captured tensor: an atomic add at the
        gathered address; out-of-range indices add nothing (the backward pass writes the gradients of
        captured tensors this way). Indices that depend on b and h only (scalars in every kernel) name
        one element per tile: the tile is summed first, one atomic instead of one per element."""
        base, index, value = node.args[:3]
        accumulate = node.kwargs.get("accumulate", node.args[3] if len(node.args) > 3 else False)
        if not (isinstance(base, fx.Node) and base.op == "get_attr") or accumulate is not True:
            self.fail(node, "index_put_ is supported only with accumulate=True, into a captured tensor")
        index = index if isinstance(index, tuple) else (index,)
        view = self.capture(base)
        if len(index) != view.tensor.dim():
            self.fail(node, f"index_put_ into a captured tensor of {view.tensor.dim()} dims needs as many indices")
        self.loaded = {key: v for key, v in self.loaded.items() if key[0] != view.param}  # loads after it reload
        ptr, masks = self.address(node, _View(view.param, view.tensor, self.arg(node, index)))
        v = as_float(self.value(node, self.arg(node, value)))
        mask = f", mask={' & '.join(masks)}" if masks else ""
        if all(i in self.bh_only[0] for i in index if isinstance(i, fx.Node)):
            return self.emit(node, f"tl.atomic_add({ptr}, tl.sum({v}){mask}, sem=\"relaxed\")", torch.float32)
        p, v_tile = f"t_{node.name}_p", f"t_{node.name}_v"
        self.lines.append(f"{p}, {v_tile} = tl.broadcast({ptr}, {v})")
        return self.emit(node, f"tl.atomic_add({p}, {v_tile}{mask}, sem=\"relaxed\")", torch.float32)

    # -- values
    def arg(self, node: fx.Node, a):
        if isinstance(a, fx.Node):
            v = self.env[a]
            return v
        if isinstance(a, (tuple, list)):
            return tuple(self.arg(node, x) for x in a)
        if isinstance(a, (bool, int, float)):
            return literal(a)
        if a is None or isinstance(a, (torch.dtype, str, slice, type(Ellipsis), torch.device)):
            return a if a is not None else literal_none()
        self.fail(node, f"unsupported argument {a!r}")

    def value(self, node: fx.Node, v) -> Val:
        if isinstance(v, _View):
            if v.tensor.dim() == len(v.indices):
                return self.load(node, v)
            self.fail(node, f"a captured tensor of shape {tuple(v.tensor.shape)} is used with "
                            f"{len(v.indices)} indices; index every dimension (for a vector per score: "
                            f"{_VECTOR_HINT})")
        return v

    def emit(self, node: fx.Node, expr: str, dtype) -> Val:
        name = f"t_{node.name}"
        self.lines.append(f"{name} = {expr}")
        return Val(name, dtype)

    def run(self) -> tuple[list[str], Val]:
        result = None
        self.node_lines: dict[fx.Node, tuple[int, int]] = {}  # the lines each node emitted: [start, end)
        for node in self.traced.graph_module.graph.nodes:
            start = len(self.lines)
            self.node_lines[node] = (start, start)
            if node in self.aliases:
                self.env[node] = self.env[self.aliases[node]]
            elif node.op == "placeholder":
                self.env[node] = Val(node.target, node.meta["dtype"])
                if self.float_index and node.target in ("q_idx", "kv_idx"):
                    self.float_forms[node.target] = (f"{node.target}.to(tl.float32)", True)
            elif node.op == "get_attr":
                view = self.capture(node)
                self.env[node] = self.load(node, view) if view.tensor.dim() == 0 else view
            elif node.op in ("call_function", "call_method"):
                self.env[node] = self.call(node)
            elif node.op == "output":
                out = node.args[0]
                result = self.value(node, self.arg(node, out))
            else:
                self.fail(node, f"unsupported fx node kind {node.op}")
            self.node_lines[node] = (start, len(self.lines))
        return self.lines, result

    def call(self, node: fx.Node):
        if node.op == "call_function" and node.target is getattr:
            return self.attribute(node)
        key = op_key(node)
        if key is None:
            hint = f"; {_VECTOR_HINT}" if _vector_op(node) else ""
            self.fail(node, f"no lowering for {_target_name(node)}{hint}; supported ops: {', '.join(sorted(OPS))}")
        args = [self.arg(node, a) for a in node.args]
        kwargs = {k: self.arg(node, v) for k, v in node.kwargs.items()}
        if key == "index_put":
            return self.scatter_add(node)
        if key == "getitem":
            base, index = args
            if isinstance(base, tuple) and isinstance(index, Val) and index.is_literal and \
                    isinstance(index.literal, int) and -len(base) <= index.literal < len(base):
                return base[index.literal]  # x.shape[i] of a (partially indexed) captured tensor: a constant
            if not isinstance(base, _View):
                self.fail(node, "only captured tensors can be indexed")
            return self.index(node, base, index)
        if key in ("ones_like", "zeros_like", "full_like", "new_full", "tensor"):  # only the first arg's dtype matters
            if math.prod(node.meta.get("shape", ())) != 1:
                self.fail(node, f"a mod computes one value per (b, h, q_idx, kv_idx): a constant tensor of shape "
                                f"{tuple(node.meta['shape'])} has no lowering; make it 0-d (size ())")
            return self.emit(node, OPS[key](args, kwargs, node), node.meta["dtype"])
        args = [self.value(node, a) if isinstance(a, (Val, _View)) else a for a in args]
        kwargs = {k: self.value(node, v) if isinstance(v, (Val, _View)) else v for k, v in kwargs.items()}
        if key in _WRAPPING_OPS and (key != "div" or kwargs.get("rounding_mode") not in (None, literal_none())):
            args = _wrap_int_literals(args)
        dtype = node.meta.get("dtype")
        if self.float_index and dtype == torch.float32:
            if key == "to":
                form = self.float_form(args[0])
                if form is not None:
                    return self.emit(node, form[0], dtype)
            else:  # the op promotes its int operands to float32: hand it their float forms instead
                args = [self.as_float_form(a) for a in args]
                kwargs = {k: self.as_float_form(v) for k, v in kwargs.items()}
        if key == "pow":
            return self.power(node, args, kwargs)
        if key in _PROMOTING_OPS:
            args = _promote_ints(args)
        try:
            expr = OPS[key](args, kwargs, node)
        except (ValueError, KeyError, IndexError):  # (unpacking too few arguments, a keyword it reads missing)
            self.fail(node, f"{_target_name(node)} is called with arguments its lowering does not take ({len(args)} "
                            f"positional, keywords {sorted(kwargs) or 'none'}); pass its tensors positionally, in the "
                            f"elementwise form torch documents (torch.where(cond, x, y), torch.maximum(x, y))")
        result = self.emit(node, expr, dtype)
        if self.float_index and dtype is not None and not dtype.is_floating_point and dtype != torch.bool:
            self.track_float_form(key, args, result)
        return result

    def attribute(self, node: fx.Node):
        """``x.device``, ``x.dtype``, ``x.shape``, ``x.ndim`` of a mod's value: compile-time constants (what tensor
        constructors and casts take: torch's noop_mask is ``b.new_ones((), dtype=torch.bool, device=b.device)``)."""
        obj, name = (list(node.args) + [None])[:2]
        meta = obj.meta if isinstance(obj, fx.Node) else {}
        if name == "device":
            return torch.device("cpu")  # a placeholder: the kernels' values live where the kernel runs
        if name == "dtype" and "dtype" in meta:
            return meta["dtype"]
        if name == "shape" and "shape" in meta:
            return tuple(literal(int(d)) for d in meta["shape"])
        if name == "ndim" and "shape" in meta:
            return literal(len(meta["shape"]))
        self.fail(node, f"no lowering for reading attribute {name!r} of a value (only .device, .dtype, .shape and "
                        f".ndim are constants of a mod)")

    def power(self, node: fx.Node, args: list, kwargs: dict) -> Val:
        """``x ** y`` / ``torch.pow`` as torch computes it for the dtypes involved: :func:`_pow`'s fast paths, else
        exact binary exponentiation for an integer result and a sign-aware exp2 / log2 for a float one."""
        if len(args) == 1 and "exponent" in kwargs:
            args = [args[0], kwargs["exponent"]]
        if len(args) != 2 or not all(isinstance(a, Val) for a in args):
            self.fail(node, "pow takes a base and an exponent")
        x, y = args
        dtype = node.meta["dtype"]
        fast = _pow([x, y], kwargs, node)
        if fast is not None:
            return self.emit(node, fast, dtype)
        if dtype == torch.bool:
            self.fail(node, "pow of bool values has no lowering")
        if dtype.is_floating_point:
            return self.float_power(node, x, y, dtype)
        return self.int_power(node, x, y, dtype)

    def int_power(self, node: fx.Node, x: Val, y: Val, dtype: torch.dtype) -> Val:
        """Integer ``x ** y`` exactly as torch's (wrapping) integer pow: square-and-multiply over the exponent's bits
        (all of them, a fixed number of steps, for a non-constant exponent); a negative exponent gives 1 for x == 1,
        +-1 for x == -1 and 0 otherwise, as torch."""
        name, tl_dtype = f"t_{node.name}", _TL_DTYPES[dtype]
        line = self.lines.append

        def operand(v: Val) -> str:
            return f"tl.full([], {int(v.literal)}, {tl_dtype})" if v.is_literal else cast(v, dtype)

        line(f"{name}_b = {operand(x)}")
        if y.is_literal:  # a constant exponent (above _pow's small ones): its bits are known
            k = int(y.literal)
            if k < 0 or k.bit_length() > 64:
                self.fail(node, f"integer pow with the exponent {k} has no lowering")
            result = None
            for i in range(k.bit_length()):
                if k >> i & 1:
                    line(f"{name} = {name}_b" if result is None else f"{name} = {name} * {name}_b")
                    result = name
                if i + 1 < k.bit_length():
                    line(f"{name}_b = {name}_b * {name}_b")
            return Val(name, dtype)
        bits = torch.iinfo(dtype).bits - (1 if dtype.is_signed else 0)
        line(f"{name}_e = {operand(y)}")
        line(f"{name}_x = {name}_b")
        line(f"{name} = {name}_b * 0 + 1")
        line(f"for {name}_i in tl.static_range({bits}):")
        line(f"    {name} = tl.where((({name}_e >> {name}_i) & 1) != 0, {name} * {name}_b, {name})")
        line(f"    {name}_b = {name}_b * {name}_b")
        if dtype.is_signed:
            line(f"{name} = tl.where({name}_e < 0, tl.where({name}_x == 1, 1, tl.where({name}_x == -1, "
                 f"1 - 2 * ({name}_e & 1), 0)), {name})")
        line(f"{name} = {name}.to({tl_dtype})")
        return Val(name, dtype)

    def float_power(self, node: fx.Node, x: Val, y: Val, dtype: torch.dtype) -> Val:
        """Float ``x ** y`` with torch's (C pow's) special values: |x| ** y as exp2(y * log2|x|), negative where x
        is negative (or -0.0) and y an odd integer, NaN where a finite x < 0 meets a non-integer y, 1 where y == 0,
        x == 1 or x == -1 meets y == +-inf; in float32 (float64 for a float64 result). What a constant operand
        decides is decided here (no scalar conditions in the kernel)."""
        ct = torch.float64 if dtype == torch.float64 else torch.float32
        name = f"t_{node.name}"
        inf, nan = literal(math.inf).expr, literal(math.nan).expr
        line = self.lines.append
        xv = float(x.literal) if x.is_literal else None
        yv = float(y.literal) if y.is_literal else None
        X, Y, A = f"{name}_x", f"{name}_y", f"{name}_a"
        if xv is None:
            line(f"{X} = {cast(x, ct)}")
            line(f"{A} = tl.abs({X})")
        if yv is None:
            line(f"{Y} = {cast(y, ct)}")
        if xv is not None:
            log_a = -math.inf if xv == 0 else math.log2(abs(xv))  # (inf: inf, NaN: NaN)
            line(f"{name} = tl.exp2({Y} * {literal(log_a).expr})")
        else:
            line(f"{name} = tl.exp2({literal(yv).expr if yv is not None else Y} * tl.log2({A}))")
        int_exponent = yv is None and not y.is_float
        # x's sign bit (-0.0 included), y an odd integer
        negative = math.copysign(1.0, xv) < 0 if xv is not None else \
            f"({X}.to({'tl.int64' if ct == torch.float64 else 'tl.int32'}, bitcast=True) < 0)"
        if yv is not None:
            odd = math.isfinite(yv) and yv == math.floor(yv) and math.fmod(yv, 2.0) != 0
        elif int_exponent:
            odd = f"(({cast(y, torch.int32) if y.is_bool else y.expr} & 1) != 0)"
        else:
            odd = f"(({Y} - 2.0 * tl.floor(0.5 * {Y})) == 1.0)"
        # a finite negative x, a non-integer y
        finite_negative = (xv < 0 and math.isfinite(xv)) if xv is not None else f"({X} < 0) & ({A} < {inf})"
        if yv is not None:
            fraction = math.isfinite(yv) and yv != math.floor(yv)
        else:
            fraction = False if int_exponent else f"(tl.floor({Y}) != {Y})"
        # 1: y == 0, x == 1, x == -1 and y == +-inf
        y_zero = (yv == 0) if yv is not None else f"({Y} == 0)"
        if xv is not None and math.isfinite(log_a):
            y_zero = False  # exp2(0 * log2|x|) is 1 already
        x_one = (xv == 1) if xv is not None else f"({X} == 1)"
        a_one = (abs(xv) == 1) if xv is not None else f"({A} == 1)"
        y_inf = math.isinf(yv) if yv is not None else (False if int_exponent else f"(tl.abs({Y}) == {inf})")
        ones = _or(y_zero, x_one, _and(a_one, y_inf))
        # (t * -1.0, not -t: Triton's -t is 0 - t, +0.0 for 0.0)
        for cond, value in ((_and(negative, odd), f"({name} * -1.0)"), (_and(finite_negative, fraction), nan),
                            (ones, "1.0")):
            if cond is True:
                line(f"{name} = tl.zeros_like({name}) + {value}")  # (value is 1.0 here: x == 1)
            elif cond is not False:
                line(f"{name} = tl.where({cond}, {value}, {name})")
        if dtype != ct:
            line(f"{name} = {name}.to({_TL_DTYPES[dtype]})")
        return Val(name, dtype)

    # -- float forms of int index arithmetic (see the class docstring)
    def float_form(self, v) -> Optional[tuple[str, bool]]:
        if not isinstance(v, Val) or v.dtype is None or v.is_float or v.is_bool:
            return None
        if v.is_literal:
            ok = isinstance(v.literal, int) and abs(v.literal) <= FLOAT32_EXACT_INT
            return (repr(float(v.literal)), True) if ok else None
        return self.float_forms.get(v.expr)

    def as_float_form(self, v):
        form = self.float_form(v)
        return Val(form[0], torch.float32) if form is not None and not v.is_literal else v

    def track_float_form(self, key: str, args: list, result: Val):
        forms = [self.float_form(a) for a in args]
        if any(f is None for f in forms):
            return
        if key in ("add", "sub") and len(forms) == 2 and all(exact for _, exact in forms):
            # one rounding of the exact result, as its conversion; not exact, so not an operand of another add
            op = "+" if key == "add" else "-"
            self.float_forms[result.expr] = (f"({forms[0][0]} {op} {forms[1][0]})", False)
        elif key == "neg" and len(forms) == 1:
            self.float_forms[result.expr] = (f"(-{forms[0][0]})", forms[0][1])  # rounding is symmetric
        elif key == "abs" and len(forms) == 1:
            self.float_forms[result.expr] = (f"tl.abs({forms[0][0]})", forms[0][1])


def _only(gm: fx.GraphModule, inputs: tuple) -> tuple[set, set]:
    """(the nodes whose values read no mod input but ``inputs``, besides captured tensors and constants; the subset
    of them that reads a captured tensor). b and h are loop-invariant in every kernel and scalars in all but
    decoding (score, q_idx and kv_idx change from tile to tile); what reads b, h and q_idx alone is a vector along
    the queries of a tile."""
    invariant, loads = set(), set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if node.target in inputs:
                invariant.add(node)
        elif node.op == "get_attr":
            invariant.add(node)
            loads.add(node)
        elif node.op in ("call_function", "call_method") and op_key(node) != "index_put" and \
                all(i in invariant for i in node.all_input_nodes):
            invariant.add(node)
            if any(i in loads for i in node.all_input_nodes):
                loads.add(node)
    return invariant, loads


def literal_none() -> Val:
    return Val("None", None, None, True)


def _hoistable(low: _Lowerer, inputs: tuple) -> tuple[set, set, list]:
    """(nodes computed from ``inputs`` and captured tensors only, e.g. b and h: the same for every tile of a
    kernel's loop, in every kernel; those of them the mod no longer computes; the values among those that the rest of
    the mod uses), when one of those values reads a captured tensor (what is worth computing apart: a load whose
    latency each tile would wait for). With q_idx among ``inputs`` the values that read b and h alone stay in the mod
    (scalars, not vectors along the queries), and the function computing the others recomputes what they need."""
    invariant, loads = low.bh_only if inputs == ("b", "h") else _only(low.traced.graph_module, inputs)
    moved = invariant if inputs == ("b", "h") else invariant - low.bh_only[0]
    used = [n for n in low.traced.graph_module.graph.nodes if n in moved and n.op != "placeholder"
            and any(u not in invariant for u in n.users)
            and isinstance(low.env.get(n), Val) and not low.env[n].is_literal]
    firsts = {}  # a value loaded once (Lowerer.loaded) is one hoisted value, however many nodes read it
    for n in used:
        firsts.setdefault(low.env[n].expr, n)
    used = list(firsts.values())
    return (invariant, moved, used) if any(n in loads for n in used) else (set(), set(), [])


def _constant_factor(node) -> Optional[tuple]:
    """(x, c) when ``node`` is x * c, c * x or x / c for a finite, nonzero number c (as x times a float), else None."""
    if not isinstance(node, fx.Node) or op_key(node) not in ("mul", "truediv") or node.kwargs or len(node.args) != 2:
        return None
    a, b = node.args

    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool) and 1e-30 < abs(v) < 1e30

    if op_key(node) == "truediv":
        return (a, 1.0 / b) if isinstance(a, fx.Node) and number(b) else None
    if isinstance(a, fx.Node) and number(b):
        return a, float(b)
    if isinstance(b, fx.Node) and number(a):
        return b, float(a)
    return None


_BOUNDED_OPS = ("tanh", "tanh_approx", "sigmoid")  # |f| <= 1
_MAX_OUT_SCALE = 1024.0


def _fold_scales(low: "_Lowerer") -> tuple:
    """score_mod = out_scale * f(in_scale * score): (in_scale, out_scale), each None where the mod has no such factor
    (score used once, by a multiply or a division by a constant; the result a positive constant of at most
    _MAX_OUT_SCALE times tanh or sigmoid), and the nodes that then take another's value registered on ``low``."""
    gm = low.traced.graph_module
    score = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.target == "score")
    in_scale = out_scale = None
    if len(score.users) == 1:
        user = next(iter(score.users))
        factor = _constant_factor(user)
        if factor is not None and factor[0] is score:
            low.aliases[user] = score
            in_scale = factor[1]
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    factor = _constant_factor(out)
    # the kernel then scales the row max and each score apart (m = max(s) * d, exp2(s * d - m) as one FMA), so the
    # max's own score gets the product's rounding error back, |m| * 2**-24, as an exponent: only where |m| is small,
    # an output factor of at most _MAX_OUT_SCALE on a bounded function (softcap's cap * tanh)
    if factor is not None and out not in low.aliases and 0 < factor[1] <= _MAX_OUT_SCALE and len(out.users) == 1 and \
            op_key(factor[0]) in _BOUNDED_OPS and out.meta.get("dtype") is not None and \
            out.meta["dtype"].is_floating_point:
        low.aliases[out] = factor[0]
        out_scale = factor[1]
    return in_scale, out_scale


# ops through which a sum of a query-side and a key-side value stays such a sum (lower_mod's ``separate``): with an
# operand that is the same for the whole tile (b, h, captured tensors, numbers), multiplication and division by it
_SUM_OPS = ("add", "sub", "neg", "pos")
_SCALE_OPS = ("mul", "truediv")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _linear(v, tile_constant: set, leaf: Callable, index_max: int) -> bool:
    """Whether ``v`` is built from leaves (``leaf(v)``: True, False, or None for neither) by adds, subtracts,
    negations, conversions to float (exact for int index arithmetic below 2**24, and linear) and multiplies or
    divisions by finite numbers or values in ``tile_constant`` (those of b and h alone): the linear forms
    :func:`_separable_bias` and :func:`_affine_in_keys` look for. Int arithmetic that combines leaves is int32, as
    torch and the kernels compute it: it is linear only where it cannot wrap, with q_idx and kv_idx up to
    ``index_max`` (:func:`_wraps`; ``(q_idx - kv_idx) * 10**8`` wraps, and its float is no sum of two sides)."""
    found = leaf(v)
    if found is not None:
        return found
    if not isinstance(v, fx.Node) or v.kwargs:
        return False
    if _is_int(v) and _wraps(v, index_max):
        return False
    key = op_key(v)
    if key in _SUM_OPS:
        return all(_linear(a, tile_constant, leaf, index_max) for a in v.args)
    if key == "to":
        return v.meta.get("dtype") in (torch.float32, torch.float64) and len(v.args) >= 1 and \
            _linear(v.args[0], tile_constant, leaf, index_max)
    if key in _SCALE_OPS and len(v.args) == 2:
        a, b = v.args
        if _number(b) or b in tile_constant:
            return _linear(a, tile_constant, leaf, index_max)
        return key == "mul" and (_number(a) or a in tile_constant) and _linear(b, tile_constant, leaf, index_max)
    return False


_INT32 = (-2 ** 31, 2 ** 31 - 1)
INDEX_INTS = (torch.int32, torch.int64)
# the largest numbers and factors index_form takes: with indices below 2 ** 24 its forms' values (codegen.decide's
# bounds, as the mask's own values) stay far from int32's wrap-around, where an interval would no longer contain them
MAX_FORM_NUMBER, MAX_FORM_FACTOR = 2 ** 24, 64


def _is_int(v) -> bool:
    dtype = v.meta.get("dtype") if isinstance(v, fx.Node) else None
    return dtype is not None and not dtype.is_floating_point and dtype != torch.bool


def _wraps(v, index_max: int) -> bool:
    """Whether an int value of a mod may leave int32 (wrap, as torch's int32 arithmetic does): unless it is a linear
    form of the indices (:func:`index_form`) whose range, with q_idx and kv_idx from 0 to ``index_max`` and b and h
    any non-negative int32, stays inside it."""
    form = index_form(v)
    if form is None:
        return True
    low = high = form.get(1, 0)
    for name, factor in form.items():
        if name != 1:
            reach = factor * (index_max if name in ("q_idx", "kv_idx") else _INT32[1])
            low, high = low + min(0, reach), high + max(0, reach)
    return not (_INT32[0] <= low and high <= _INT32[1])


def index_form(v) -> Optional[dict]:
    """An int value of a mod as ``{name: factor}`` (q_idx, kv_idx, b, h; 1 for the number), where it is built from
    those and int numbers by adds, subtracts, negations and multiplies by numbers (codegen.decide's bounds, and
    whether a separable bias's int arithmetic can wrap: :func:`_wraps`); else None."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return {1: v} if abs(v) <= MAX_FORM_NUMBER else None
    if not isinstance(v, fx.Node) or v.meta.get("dtype") not in INDEX_INTS or v.kwargs:
        return None
    if v.op == "placeholder":
        return {v.target: 1}
    key = op_key(v)
    if key == "mul" and len(v.args) == 2:
        for k in (0, 1):
            c, other = v.args[k], v.args[1 - k]
            if isinstance(c, int) and not isinstance(c, bool) and abs(c) <= MAX_FORM_FACTOR:
                form = index_form(other)
                return None if form is None else {name: c * f for name, f in form.items() if c * f}
        return None
    args = [index_form(a) for a in v.args]
    if any(a is None for a in args):
        return None
    if key in ("add", "sub") and len(args) == 2:
        return combined_forms(args[0], args[1], 1 if key == "add" else -1)
    if key == "neg" and len(args) == 1:
        return combined_forms({}, args[0], -1)
    if key == "pos" and len(args) == 1:
        return args[0]
    return None


def combined_forms(a: dict, b: dict, sign: int) -> dict:
    """The linear form a + sign * b."""
    out = dict(a)
    for name, f in b.items():
        out[name] = out.get(name, 0) + sign * f
    return {name: f for name, f in out.items() if f}


def _separable_bias(low: "_Lowerer") -> bool:
    """Whether score_mod is the score plus a bias (sums and differences with the score, or its folded input factor's
    multiply, added once) whose terms split into values of b, h, q_idx alone and of b, h, kv_idx alone (ALiBi's
    ``slopes[h] * (kv_idx - q_idx)``): built from such values by adds, subtracts, negations, conversions to float and
    multiplies or divisions by what b and h alone give. Then bias(q, kv) = bias(q0, kv) + bias(q, k0) - bias(q0, k0)
    for any q0, k0, and the forward templates add the query side to the LSE once per row instead of to every
    score. That needs the terms finite at the anchors q0, k0 (a tile's first query and key): a term read from a
    captured tensor (a padding bias ``pad[kv_idx]`` of -inf, a per-head ``bias[h]``) may not be, so no term added to
    the score may read one (a factor may: ALiBi's slopes)."""
    gm = low.traced.graph_module
    score = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.target == "score")
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    scored = {score} | {n for n, target in low.aliases.items() if target is score}
    row_side, row_loads = _only(gm, ("b", "h", "q_idx"))
    key_side, key_loads = _only(gm, ("b", "h", "kv_idx"))

    def separable(v) -> bool:
        return _linear(v, low.bh_only[0], lambda u: (
            True if _number(u) or (u in row_side and u not in row_loads) or (u in key_side and u not in key_loads)
            else False if u in scored else None), _index_max(low))

    def score_plus_bias(v) -> bool:
        # v is the score plus separable terms, the score (read by nothing else) taken with a plus sign
        if v in scored:
            return True
        if not isinstance(v, fx.Node) or v.kwargs or len(v.users) != 1 or op_key(v) not in ("add", "sub", "pos"):
            return False
        if op_key(v) == "pos":
            return score_plus_bias(v.args[0])
        a, b = v.args
        if op_key(v) == "add" and score_plus_bias(b):
            return separable(a)
        return score_plus_bias(a) and separable(b)

    dtype = out.meta.get("dtype") if isinstance(out, fx.Node) else None
    return (dtype is not None and dtype.is_floating_point and out not in scored and
            all(len(n.users) == 1 for n in scored) and score_plus_bias(out))


def _affine_in_keys(low: "_Lowerer") -> bool:
    """Whether a separable score_mod's (:func:`_separable_bias`) bias is affine in kv_idx: its terms that read kv_idx
    are kv_idx under adds, subtracts, negations, conversions to float and multiplies or divisions by numbers or what
    b and h alone give (ALiBi's ``slopes[h] * (kv_idx - q_idx)``; not ``(kv_idx // 3)``). Then bias(q0, start_n + j)
    = bias(q0, start_n) + [bias(q0, q0 + j) - bias(q0, q0)] for every tile start_n: the bracket, a vector of the
    tile's columns, is the same in every tile, and the forwards add it to each score and the first term, one scalar
    per tile, to the row max (fwd.py.jinja, fwd_ws.py.jinja). Nothing it computes from kv_idx reads a captured tensor,
    so the kernel may evaluate it at keys past the sequence (q0 + j)."""
    gm = low.traced.graph_module
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    kv = next((n for n in gm.graph.nodes if n.op == "placeholder" and n.target == "kv_idx"), None)
    reads_keys = set() if kv is None else {kv}
    for node in gm.graph.nodes:
        if any(i in reads_keys for i in node.all_input_nodes):
            reads_keys.add(node)
    return _linear(out, low.bh_only[0], lambda v: True if not isinstance(v, fx.Node) or v not in reads_keys or v is kv
                   else None, _index_max(low))


def _index_max(low: "_Lowerer") -> int:
    """The largest q_idx / kv_idx the kernel evaluates the mod at: with ``float_index`` (lengths up to 2**24) 2**24
    and a tile past it (an affine key side is evaluated at keys past the sequence, :func:`_affine_in_keys`), else
    int32's."""
    return FLOAT32_EXACT_INT + 1024 if low.float_index else _INT32[1]


def lower_mod(traced: TracedMod, fn_name: str, prefix: str, float_index: bool = False,
              hoist: tuple = (), fold_scales: bool = False,
              separate: bool = False) -> LoweredMod:
    """Lower a traced mod to ``@triton.jit def fn_name(...)``; captured params are named ``prefix``c<i>.
    ``float_index``: the kernel's q_idx / kv_idx stay below 2**24 (see :class:`_Lowerer`). ``hoist``: mod inputs
    (e.g. ``("b", "h")``) whose values, with captured tensors, the kernel can compute apart: what the mod computes
    from them alone (ALiBi's ``slopes[h]``; with q_idx a document mask's ``doc_id[q_idx]``) moves to
    ``<fn_name>_hoist(<hoist>, <params>)``, which kernels call once before their loops (b, h) or once per tile on
    a compact query vector (q_idx: the warp-specialized backward), when it reads a captured tensor; the mod takes
    those values as parameters (:attr:`LoweredMod.hoisted`). ``fold_scales`` (score_mod): a constant factor of its
    input and a small positive one of a bounded output (softcap's ``30 * tanh(score / 30)``; :func:`_fold_scales`)
    are left to the kernel, which folds them into its own multiplies (:attr:`LoweredMod.in_scale`,
    :attr:`LoweredMod.out_scale`). ``separate`` (score_mod): whether the mod is the score plus a bias that splits
    into a query side and a key side (:func:`_separable_bias`, :attr:`LoweredMod.separable`), and whether that bias
    is affine in kv_idx (:func:`_affine_in_keys`, :attr:`LoweredMod.affine_keys`); the source is the same either
    way."""
    low = _Lowerer(traced, prefix, float_index)
    in_scale, out_scale = _fold_scales(low) if fold_scales else (None, None)
    separable = separate and traced.kind == "score_mod" and _separable_bias(low)
    affine_keys = separable and _affine_in_keys(low)
    lines, result = low.run()
    invariant, moved, hoisted = _hoistable(low, hoist) if hoist else (set(), set(), [])
    hoist_lines = [line for n in low.traced.graph_module.graph.nodes if n in invariant
                   for line in lines[slice(*low.node_lines[n])]]
    if hoisted:
        lines = [line for n in low.traced.graph_module.graph.nodes if n not in moved
                 for line in lines[slice(*low.node_lines[n])]]
    names = tuple(low.env[n].expr for n in hoisted)
    if traced.kind == "score_mod":
        out = cast(result, torch.float32)
        if "score" not in arguments_read(traced):  # (torch.zeros_like(score) reads its shape only)
            out = f"{out} + zeros_of(score)"  # broadcast a mod that ignores the score to its tile
    else:
        out = cast(result, torch.bool)
    inputs = list(traced.arg_names)
    header = f"def {fn_name}({', '.join(inputs + list(names) + low.params)}):"
    doc = f"    # {traced.kind} {traced.name}, traced and lowered by flexlite"
    body = [f"    {line}" for line in lines] + [f"    return {out}"]
    source = "\n".join(["@triton.jit", header, doc] + body) + "\n"
    hoist_source = ""
    if hoisted:
        hoist_source = "\n".join(
            ["@triton.jit", f"def {fn_name}_hoist({', '.join(list(hoist) + low.params)}):",
             f"    # the values of {traced.kind} {traced.name} computed from {', '.join(hoist)} and captured tensors "
             f"only"]
            + [f"    {line}" for line in hoist_lines] + [f"    return {', '.join(names)}"]) + "\n"
    return LoweredMod(fn_name=fn_name, source=source, params=low.params, tensors=low.tensors,
                      result_dtype=result.dtype, hoisted=names, hoist_source=hoist_source, in_scale=in_scale,
                      out_scale=out_scale, separable=separable, affine_keys=affine_keys)


def identity_score_mod() -> LoweredMod:
    src = "@triton.jit\ndef score_mod(score, b, h, q_idx, kv_idx):\n    return score\n"
    return LoweredMod("score_mod", src, [], [])


def noop_mask_mod() -> LoweredMod:
    src = "@triton.jit\ndef mask_mod(b, h, q_idx, kv_idx):\n    return True\n"
    return LoweredMod("mask_mod", src, [], [])
