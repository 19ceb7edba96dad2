"""Tracing and lowering: every op of the table against the reference, captures, caching, errors."""

import operator

import pytest
import torch

import flexlite
from flexlite import UntraceableModError, attention_reference, create_block_mask, flex_attention
from flexlite.codegen import trace as trace_module
from flexlite.codegen.trace import trace_mod
from flexlite.runtime import compile as compile_module
from helpers import (DEVICE, TOLERANCES, assert_close, assert_grad_close, assert_grads_like_reference, drop_plans,
                     rand_qkv)

B, H, LQ, LKV, D = 1, 2, 37, 45, 16
_t = torch.linspace(-2.0, 2.0, 8).to(DEVICE)
_i = torch.tensor([3, -1, 4, 1, -5, 9, 2, -6], dtype=torch.int32).to(DEVICE)
_table = torch.randn(4, 2 * 64, generator=torch.Generator().manual_seed(5)).to(DEVICE)
_long = (torch.arange(LKV, dtype=torch.int64) % 5).to(DEVICE)
_bool = (torch.arange(LKV) % 3 == 0).to(DEVICE)
_half = torch.randn(H, dtype=torch.float16).to(DEVICE)
_scalar = torch.tensor(0.75).to(DEVICE)

SCORE_MODS = {
    "add_sub_mul_div": lambda s, b, h, q, kv: (s + 1) * 2 - s / 3 + q / (kv + 1),
    "int_truediv": lambda s, b, h, q, kv: s + q / 7,
    "floordiv_mod_negative": lambda s, b, h, q, kv: s + ((q - kv) // 5) * 0.1 + ((q - kv) % 7) * 0.05,
    "float_floordiv_mod": lambda s, b, h, q, kv: s + (s * 3) // 1.5 + (s * 3) % 1.5,
    "div_rounding": lambda s, b, h, q, kv: s + torch.div(q - kv, 4, rounding_mode="floor") * 0.1
    + torch.div(q - kv, 4, rounding_mode="trunc") * 0.2 + torch.div(s, 0.7, rounding_mode="trunc") * 0.3,
    "remainder_fmod": lambda s, b, h, q, kv: s + torch.remainder(q - kv, 3) * 0.1 + torch.fmod(q - kv, 3) * 0.2,
    "pow": lambda s, b, h, q, kv: s + s ** 2 * 0.1 + (kv + 1.0) ** -1 + torch.abs(s) ** 0.5 + 2.0 ** s,
    "neg_abs": lambda s, b, h, q, kv: -s + (q - kv).abs() * 0.01 + abs(s),
    "where_cmp": lambda s, b, h, q, kv: torch.where((q > kv) | (q == kv + 3), s, s * 0.5)
    + torch.where(q != kv, 0.1, 0.0) + torch.where(q <= kv, 0.2, -0.2),
    "clamp_min_max": lambda s, b, h, q, kv: s.clamp(-0.5, 0.5) + torch.clamp(s, min=0.0) + s.clamp_max(0.3)
    + torch.minimum(s, s * 0.5) + torch.maximum(q - kv, q * 0) * 0.01 + s.clamp_min(-0.1),
    "math_fns": lambda s, b, h, q, kv: torch.exp(s * 0.1) + torch.exp2(s * 0.1) + torch.log(s.abs() + 1)
    + torch.log2(s.abs() + 1) + torch.tanh(s) + torch.sigmoid(s) + torch.sqrt(s.abs()) + torch.rsqrt(s.abs() + 1)
    + torch.sin(s) + torch.cos(s) + torch.erf(s),
    "methods": lambda s, b, h, q, kv: s.exp().log() + s.tanh() + s.sigmoid() + s.abs().sqrt() + s.neg(),
    "more_math": lambda s, b, h, q, kv: torch.floor(s) + torch.ceil(s) + torch.sign(s) + torch.log1p(s.abs())
    + torch.expm1(s * 0.1) + torch.square(s) + torch.relu(s),
    "gelu": lambda s, b, h, q, kv: torch.nn.functional.gelu(s) + torch.nn.functional.gelu(s, approximate="tanh"),
    "casts": lambda s, b, h, q, kv: s + q.float() * 0.01 + (s * 4).int().float() + (s > 0).to(torch.float32)
    + s.half().float() + kv.long() * 0.01 + (q % 2).bool() * 0.5,
    # (no s.bfloat16() here: the interpreter rounds fp32 -> bf16 toward zero, the GPU to nearest)
    "bitwise_ints": lambda s, b, h, q, kv: s + ((q & 3) | (kv ^ 5)) * 0.01 + (~q) * 0.001 + (q >> 1) * 0.01
    + (kv << 1) * 0.001,
    "b_and_h": lambda s, b, h, q, kv: s * (h + 1) + b,
    "captured_1d_int_negative_index": lambda s, b, h, q, kv: s + _i[(q - kv) % 8 - 4] * 0.1,
    "captured_2d_table": lambda s, b, h, q, kv: s + _table[h, q - kv + 64],
    "captured_mixed_dtypes": lambda s, b, h, q, kv: s + _long[kv] * 0.1 + _bool[kv] * 0.2 + _half[h],
    "captured_scalar_tensor": lambda s, b, h, q, kv: s * _scalar,
    "constant_index": lambda s, b, h, q, kv: s + _t[3] + _table[1][2] + _t[-1],
    "ignores_score": lambda s, b, h, q, kv: (q - kv) * 0.01,
    "ones_like": lambda s, b, h, q, kv: s * torch.ones_like(s) + torch.zeros_like(s) + torch.full_like(s, 0.5),
    "logical": lambda s, b, h, q, kv: s + torch.logical_and(q > kv, kv > 2) * 1.0
    + torch.logical_or(q < 3, kv < 3) * 0.5 + torch.logical_not(q > kv) * 0.25 + torch.logical_xor(q > 1, kv > 1) * 0.1,
    "torch_functions": lambda s, b, h, q, kv: torch.add(s, 1) + torch.mul(s, 2) + torch.sub(s, q) + torch.div(s, 3)
    + torch.neg(s) + torch.abs(s),
}

MASK_MODS = {
    "and_or_xor_invert": lambda b, h, q, kv: ((q >= kv) & ~(q - kv > 20)) | ((q ^ kv) == 0),
    "captured_bool": lambda b, h, q, kv: _bool[kv] | (q == kv),
    "nested_captured": lambda b, h, q, kv: _long[_long[kv]] <= q % 5,
    "int_division": lambda b, h, q, kv: (q // 8) == (kv // 8),
    "returns_new_ones": lambda b, h, q, kv: b.new_ones((), dtype=torch.bool),
    "per_head": lambda b, h, q, kv: (q - kv).abs() <= 4 * (h + 1),
}


def _check(score_mod=None, mask_mod=None, mask_bh=(None, None)):
    q, k, v = rand_qkv(B, H, H, LQ, LKV, D, seed=7)
    bm = None if mask_mod is None else create_block_mask(mask_mod, *mask_bh, LQ, LKV, device=DEVICE, BLOCK_SIZE=16)
    out, lse = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, return_lse=True)
    ref_out, ref_lse = attention_reference(q, k, v, score_mod=score_mod, block_mask=bm)
    assert_close(out, ref_out, 1e-4, 1e-4)
    assert_close(lse, ref_lse, 1e-4, 1e-4, name="lse")


@pytest.mark.parametrize("name", sorted(SCORE_MODS))
def test_score_mod_ops(name):
    fn = SCORE_MODS[name]
    fn.__name__ = name
    _check(score_mod=fn)


@pytest.mark.parametrize("name", sorted(MASK_MODS))
def test_mask_mod_ops(name):
    fn = MASK_MODS[name]
    fn.__name__ = name
    _check(mask_mod=fn, mask_bh=(B, H))


def test_dtypes_follow_torch_promotion():
    slopes = torch.ones(4, dtype=torch.float64, device=DEVICE)

    def mod(score, b, h, q_idx, kv_idx):
        return score + (q_idx - kv_idx) + slopes[h] * (q_idx // 2)

    gm = trace_mod(mod, "score_mod").graph_module
    dtypes = {n.name: n.meta["dtype"] for n in gm.graph.nodes}
    assert dtypes["sub"] == torch.int32 and dtypes["floordiv"] == torch.int32
    assert dtypes["add"] == torch.float32 and dtypes["output"] == torch.float64


def test_trace_once_and_retrace_on_rebinding(monkeypatch):
    calls = []
    real = trace_module._trace
    monkeypatch.setattr(trace_module, "_trace", lambda fn, kind: calls.append(fn) or real(fn, kind))
    bias = torch.zeros(LKV, device=DEVICE)

    def mod(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx]

    q, k, v = rand_qkv(B, H, H, LQ, LKV, D)
    flex_attention(q, k, v, score_mod=mod)
    flex_attention(q, k, v, score_mod=mod)
    assert len(calls) == 1
    bias = torch.ones(LKV, device=DEVICE)  # rebinding the closure variable must be seen
    out = flex_attention(q, k, v, score_mod=mod)
    assert len(calls) == 2
    assert_close(out, attention_reference(q, k, v, score_mod=mod)[0], *TOLERANCES[torch.float32])


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_a_call_fingerprints_each_mod_once(monkeypatch, grad):
    """A call checks each mod's captures once (validation's trace, handed on to code generation and, with grad, to
    the autograd inputs), not once per use; a backward none (it runs the forward's traces, its kernels the Triton
    ones and on Hopper the warp-specialized one); the forward is still the reference's."""
    from flexlite import create_block_mask, first_calls

    monkeypatch.setattr(first_calls, "ENABLED", False)  # (a first call's bits and worker trace more: NOTES 72)
    fingerprints = []
    real = trace_module._fingerprint_and_truncated
    monkeypatch.setattr(trace_module, "_fingerprint_and_truncated", lambda fn: fingerprints.append(fn) or real(fn))
    bias = torch.randn(LKV, device=DEVICE)

    def mod(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx]

    def mask(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    bm = create_block_mask(mask, None, None, LQ, LKV, device=DEVICE)
    q, k, v = (t.requires_grad_(grad) for t in rand_qkv(B, H, H, LQ, LKV, D))
    flex_attention(q, k, v, score_mod=mod, block_mask=bm)  # traced and compiled
    fingerprints.clear()
    out = flex_attention(q, k, v, score_mod=mod, block_mask=bm)
    assert sorted(map(id, fingerprints)) == sorted([id(mod), id(mask)])
    assert_close(out, attention_reference(q, k, v, score_mod=mod, block_mask=bm)[0], *TOLERANCES[torch.float32])
    if grad:
        fingerprints.clear()
        out.sum().backward()
        assert fingerprints == []


def test_captured_values_and_lengths_reuse_the_kernel():
    bias = torch.randn(256, device=DEVICE)

    def mod(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx]

    src = flexlite.kernel_source(mod, device=DEVICE)
    q, k, v = rand_qkv(B, H, H, 70, LKV, D)
    flex_attention(q, k, v, score_mod=mod)
    n_modules = len(compile_module._MODULES)
    bias.mul_(3.0)  # new values, same tensor: no new kernel, new result
    out = flex_attention(q, k, v, score_mod=mod)
    assert_close(out, attention_reference(q, k, v, score_mod=mod)[0], *TOLERANCES[torch.float32])
    q2, k2, v2 = rand_qkv(2, H, H, 100, 130, D)  # new lengths and batch: same kernel
    out = flex_attention(q2, k2, v2, score_mod=mod)
    assert_close(out, attention_reference(q2, k2, v2, score_mod=mod)[0], *TOLERANCES[torch.float32])
    assert len(compile_module._MODULES) == n_modules
    assert flexlite.kernel_source(mod, device=DEVICE) == src


def test_kernel_source_and_file():
    def softcap(score, b, h, q_idx, kv_idx):
        return 20.0 * torch.tanh(score / 20.0)

    src = flexlite.kernel_source(softcap, device=DEVICE)
    assert "def score_mod(score, b, h, q_idx, kv_idx" in src and "def flex_fwd_kernel" in src
    assert "Sub notation" in src
    path = flexlite.kernel_path(softcap, device=DEVICE)
    assert open(path).read() == src
    assert "def flex_decode_kernel" in flexlite.kernel_source(softcap, device=DEVICE, kernel="decode")
    bwd = flexlite.kernel_source(softcap, device=DEVICE, kernel="backward")
    assert "def score_mod_grad" in bwd
    assert open(flexlite.kernel_path(softcap, device=DEVICE, kernel="backward")).read() == bwd
    with pytest.raises(ValueError, match="kernel must be one of"):
        flexlite.kernel_source(softcap, kernel="bwd")


def test_show_kernels_env_prints_source(tmp_path):
    import subprocess
    import sys
    code = ("import torch, flexlite\n"
            "q = torch.randn(1, 1, 16, 16)\n"
            "flexlite.flex_attention(q, q, q, score_mod=lambda s, b, h, q_idx, kv_idx: s * 2)\n")
    env = dict(__import__("os").environ, FLEXLITE_SHOW_KERNELS="1", FLEXLITE_CACHE_DIR=str(tmp_path))
    env.pop("TRITON_INTERPRET", None)  # also covers a process that imported triton without the interpreter
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "def flex_fwd_kernel" in res.stderr and str(tmp_path) in res.stderr


# ------------------------------------------------------------------------------------------ errors

def test_data_dependent_if_says_use_where():
    def bad(score, b, h, q_idx, kv_idx):
        if q_idx > kv_idx:
            return score
        return score * 2

    q, k, v = rand_qkv(1, 1, 1, 16, 16, 16)
    with pytest.raises(UntraceableModError, match=r"torch\.where") as e:
        flex_attention(q, k, v, score_mod=bad)
    assert isinstance(e.value, NotImplementedError) and "'bad'" in str(e.value)


def test_op_without_lowering_is_named():
    def bad(score, b, h, q_idx, kv_idx):
        return torch.lgamma(score)

    q, k, v = rand_qkv(1, 1, 1, 16, 16, 16)
    with pytest.raises(UntraceableModError, match="lgamma") as e:
        flex_attention(q, k, v, score_mod=bad)
    assert "'bad'" in str(e.value)


def test_item_is_untraceable():
    def bad(b, h, q_idx, kv_idx):
        return q_idx < int(kv_idx)

    with pytest.raises(UntraceableModError, match="bad"):
        trace_mod(bad, "mask_mod")


@pytest.mark.parametrize("mod, match", [
    (lambda s, b, h, q, kv: s + _table[h], "index every dimension"),
    (lambda s, b, h, q, kv: s + _t[kv:].sum(), "slice"),
    (lambda s, b, h, q, kv: s + _t[s], "float or bool"),
    (lambda s, b, h, q, kv: s + _t[20], "out of bounds"),
], ids=["partial_index", "slice", "float_index", "constant_out_of_range"])
def test_bad_captured_indexing(mod, match):
    q, k, v = rand_qkv(1, 1, 1, 16, 16, 16)
    with pytest.raises(UntraceableModError, match=match):
        flex_attention(q, k, v, score_mod=mod)


def test_operator_table_covers_every_operator_target():
    from flexlite.codegen.lower import _FUNCTIONS, OPS
    for fn in (operator.add, operator.floordiv, operator.mod, operator.invert, operator.and_, torch.where,
               torch.exp2, torch.tanh, torch.nn.functional.gelu):
        assert _FUNCTIONS[fn] in OPS or _FUNCTIONS[fn] in ("remainder", "floor_divide", "clip")


def test_block_mask_builders_report_untraceable_mods():
    def bad(b, h, q_idx, kv_idx):
        if q_idx > kv_idx:
            return q_idx >= 0
        return q_idx < 0
    for build in (lambda: flexlite.create_block_mask(bad, None, None, 64, 64, device=DEVICE),
                  lambda: flexlite.create_mask(bad, 1, 1, 8, 8, device=DEVICE)):
        with pytest.raises(UntraceableModError, match=r"torch\.where"):
            build()


@pytest.mark.parametrize("divisor, lowered", [(30.0, "* 0.03333333333333333"), (4, "* 0.25"), (-0.5, "* -2.0"),
                                              (1e-35, "/ 1e-35")])
def test_division_by_a_constant_is_a_multiply(divisor, lowered):
    """x / c (c a normal-range constant) lowers to x * (1 / c): one instruction instead of an IEEE division,
    and the result still matches the reference."""
    def mod(score, b, h, q_idx, kv_idx):
        return score / divisor + q_idx / 2

    source = flexlite.kernel_source(mod)
    assert lowered in source and "q_idx.to(tl.float32) * 0.5" in source
    q, k, v = rand_qkv(1, 1, 1, 20, 30, 16)
    assert_close(flex_attention(q, k, v, score_mod=mod), attention_reference(q, k, v, score_mod=mod)[0],
                 *TOLERANCES[torch.float32])



FLOAT_INDEX_MODS = {
    # mod, what the forward's lowering must contain (the distance from float vectors), or None: no float form
    "alibi": (lambda s, b, h, q, kv: s + _half.float()[h] * (kv - q), "(kv_idx.to(tl.float32) - q_idx.to(tl.float32))"),
    "explicit_cast_abs_neg": (lambda s, b, h, q, kv: s - 0.1 * torch.abs(q - kv).float() + (-(kv - 2)) * 0.01,
                              "tl.abs((q_idx.to(tl.float32) - kv_idx.to(tl.float32)))"),
    "truediv": (lambda s, b, h, q, kv: s + (kv + 1) / (q + 1), "(kv_idx.to(tl.float32) + 1.0)"),
    # two roundings could differ from converting the exact int: kept as an int tile converted once
    "two_adds": (lambda s, b, h, q, kv: s + ((kv - q) + 5) * 0.01, None),
    "int_only": (lambda s, b, h, q, kv: s + _table[h % 4, (kv - q) % 64], None),
}


@pytest.mark.parametrize("name", sorted(FLOAT_INDEX_MODS))
def test_forward_lowers_index_distances_from_float_vectors(name, monkeypatch):
    """Both forwards compute int index arithmetic that a float32 op consumes from float32 q / kv vectors
    (one subtraction per score instead of an int subtraction and a per-score conversion), only where that is
    bit-identical (one add / subtract of exact values); the backward keeps the int form. Same output as the int
    form, bit for bit, and the reference's."""
    import flexlite.api as api
    from flexlite.runtime import launch
    mod, lowered = FLOAT_INDEX_MODS[name]
    source = flexlite.kernel_source(mod, device=DEVICE)
    ws_source = flexlite.kernel_source(mod, device="cuda", kernel="forward_ws")  # (its CUDA source: no GPU needed)
    backward = flexlite.kernel_source(mod, device=DEVICE, kernel="backward")
    for forward in (source, ws_source):
        if lowered is None:
            assert "kv_idx.to(tl.float32)" not in forward and "q_idx.to(tl.float32)" not in forward
        else:
            assert lowered in forward
    assert "kv_idx.to(tl.float32)" not in backward
    q, k, v = rand_qkv(1, 2, 2, 100, 70, 16, seed=4)  # more than 64 queries: the forward kernel
    out = flex_attention(q, k, v, score_mod=mod)
    assert_close(out, attention_reference(q, k, v, score_mod=mod)[0], *TOLERANCES[torch.float32])
    # the bit-for-bit comparison with the bias kept whole: whether a bias splits into a query side and a key side
    # depends on the positions' bound, which float_index sets too ((kv - q) + 5 may wrap past 2**24 positions)
    monkeypatch.setattr(launch, "SEPARATE_SCORE_BIAS", False)
    drop_plans(monkeypatch)
    floats = flex_attention(q, k, v, score_mod=mod)
    assert_close(floats, out, *TOLERANCES[torch.float32])
    monkeypatch.setattr(api, "_float_index", lambda *args: False)
    drop_plans(monkeypatch)  # (the float form's plan: kept for calls that would take it)
    assert torch.equal(floats, flex_attention(q, k, v, score_mod=mod))


def test_float_index_only_while_positions_are_exact_in_float32(monkeypatch):
    """Past 2**24 positions a float32 q_idx would round: the forward keeps the int form there (the limit is
    lowered here to run that path at a testable length)."""
    import flexlite.api as api
    from flexlite.codegen import kernel as kernel_module
    seen, real = [], kernel_module.generate

    def spy(template, score_mod, mask_mod, *, interpret, float_index=False, **kwargs):
        seen.append((template, float_index))
        return real(template, score_mod, mask_mod, interpret=interpret, float_index=float_index, **kwargs)
    monkeypatch.setattr(api, "generate", spy)
    mod = FLOAT_INDEX_MODS["alibi"][0]
    q, k, v = rand_qkv(1, 2, 2, 100, 70, 16, seed=5)  # more than 64 queries: the forward kernel, not decoding
    monkeypatch.setattr(api, "FLOAT32_EXACT_INT", 99)
    long = flex_attention(q, k, v, score_mod=mod)
    monkeypatch.setattr(api, "FLOAT32_EXACT_INT", 100)
    short = flex_attention(q, k, v, score_mod=mod)
    assert seen == [("fwd.py.jinja", False), ("fwd.py.jinja", True)]
    assert torch.equal(long, short)


_slopes = torch.rand(H, generator=torch.Generator().manual_seed(8)).to(DEVICE)
_bh_bias = torch.randn(B + 1, H, generator=torch.Generator().manual_seed(9)).to(DEVICE)

HOIST_MODS = {
    # mod, the values score_mod_hoist returns (None: nothing is hoisted)
    "alibi": (lambda s, b, h, q, kv: s + _slopes[h] * (kv - q), ("t_getitem",)),
    "several_and_a_scalar": (lambda s, b, h, q, kv: s * _scalar + _bh_bias[b, h] - _slopes[h - 1] * (q - kv)
                             + _table[h % 4, (kv - q) % 64],
                             ("t__tensor_constant0", "t_getitem", "t_getitem_1", "t_mod")),
    "ignores_score": (lambda s, b, h, q, kv: _bh_bias[b, h] * 2 + _slopes[h], ("t_add",)),  # all of it
    "no_load": (lambda s, b, h, q, kv: s + h * 0.5 + b, None),  # nothing worth taking out of the loop
    "per_position": (lambda s, b, h, q, kv: s + _table[h % 4, kv % 64], None),
    "reads_an_element_twice": (lambda s, b, h, q, kv: s + _slopes[h] * kv - _slopes[h] * q, ("t_getitem",)),
}


@pytest.mark.parametrize("name", sorted(HOIST_MODS))
def test_loop_invariant_loads_are_hoisted_out_of_the_kernel_loops(name):
    """What score_mod computes from b, h and captured tensors alone (ALiBi's slopes[h]) is computed once per
    program, before the kv / q loop, by score_mod_hoist in every kernel (forward, decoding, backward), and
    passed to score_mod; gradients included, the results are the reference's."""
    mod, hoisted = HOIST_MODS[name]
    for kernel, b, h in (("forward", "off_z", "off_h"), ("decode", "off_z", "off_h[:, None]"),
                         ("backward", "off_z", "off_h")):
        source = flexlite.kernel_source(mod, device=DEVICE, kernel=kernel)
        score_mod = source[source.index("def score_mod("):source.index("@triton.jit", source.index("def score_mod("))]
        if hoisted is None:
            assert "def score_mod_hoist" not in source and "= score_mod_hoist(" not in source
            continue
        kernel_names = ", ".join(f"sm_h_{n}" for n in hoisted)
        assert f"{kernel_names} = score_mod_hoist({b}, {h}, " in source
        assert score_mod.startswith(f"def score_mod(score, b, h, q_idx, kv_idx, {', '.join(hoisted)}, ")
        assert "sm_c0 +" not in score_mod and "tl.load(sm_c0)" not in score_mod  # the hoisted loads left
    for lq in (3, 100):  # decoding and the forward kernel
        q, k, v = (t.requires_grad_() for t in rand_qkv(B + 1, H, 1, lq, 70, 16, seed=lq))
        out = flex_attention(q, k, v, score_mod=mod, enable_gqa=True)
        ref = attention_reference(q, k, v, score_mod=mod, enable_gqa=True)[0]
        assert_close(out, ref, *TOLERANCES[torch.float32])
        grad = torch.randn_like(out)
        want = torch.autograd.grad(ref, (q, k, v), grad, allow_unused=True)
        for g, w in zip(torch.autograd.grad(out, (q, k, v), grad), want):
            assert_grad_close(g, torch.zeros_like(g) if w is None else w)


_doc = (torch.arange(80) // 24).to(torch.int32).to(DEVICE)  # documents of 24 tokens
_start = torch.arange(0, 96, 24, dtype=torch.int32).to(DEVICE)


def _doc_local_causal(b, h, q_idx, kv_idx):
    # doc[q_idx] read twice, as generate_doc_mask_mod-style masks do (once to compare, once for the start)
    return (_doc[q_idx] == _doc[kv_idx]) & (q_idx - _start[_doc[q_idx]] >= kv_idx - _start[_doc[kv_idx]])


def test_an_element_read_twice_is_loaded_once():
    """Two reads of the same captured element (same tensor, same index values) lower to one load; the mask still
    computes the reference's attention and gradients."""
    bm = create_block_mask(_doc_local_causal, None, None, 80, 80, device=DEVICE, BLOCK_SIZE=16)
    source = flexlite.kernel_source(None, bm, device=DEVICE)
    mask_mod = source[source.index("def mask_mod("):source.index("@triton.jit", source.index("def mask_mod("))]
    assert mask_mod.count("tl.load(") == 4  # _doc[q_idx], _doc[kv_idx], _start[...] of each
    q, k, v = (t.requires_grad_() for t in rand_qkv(1, 2, 2, 80, 80, 16, seed=3))
    out = flex_attention(q, k, v, block_mask=bm)
    ref = attention_reference(q, k, v, block_mask=bm)[0]
    assert_close(out, ref, *TOLERANCES[torch.float32])
    assert_grads_like_reference(out, ref, (q, k, v))


_QUERY_VALUE_MASKS = {
    # mask, the values computed apart from b, h, q_idx and captured tensors (None: no gather along the queries)
    "document": (_doc_local_causal, ("t_getitem", "t_sub")),
    # _start[h % 4] reads b and h alone (a scalar, not a vector along the queries): it stays in the mask
    "per_head_and_query": (lambda b, h, q, kv: (_doc[q] + _start[h % 4] == _doc[kv] + h) | (kv < _start[h % 4]),
                           ("t_add",)),
    "causal": (lambda b, h, q, kv: q >= kv, None),
}


@pytest.mark.skipif(DEVICE != "cpu", reason="runs the lowered mask in Triton's interpreter on the CPU tensors it "
                                             "captures (test_warp_specialized checks the GPU kernels that use it)")
@pytest.mark.parametrize("name", sorted(_QUERY_VALUE_MASKS))
def test_a_masks_values_along_the_queries_computed_apart_give_the_same_mask(name):
    """lower_mod's hoist ("b", "h", "q_idx") (bwd_ws.py.jinja's query values, computed there on a compact query
    vector): ``mask_mod_hoist(b, h, q_idx[vector])`` and the rest of the mask on the tile give the whole mask's
    values, here through Triton's interpreter on a [64, 64] tile."""
    from flexlite.codegen.lower import lower_mod
    from flexlite.codegen.render import load_template
    from flexlite.runtime.compile import load_module

    mask, names = _QUERY_VALUE_MASKS[name]
    traced = trace_mod(mask, "mask_mod")
    whole = lower_mod(traced, "mask_whole", "mm_")
    split = lower_mod(traced, "mask_split", "mm_", hoist=("b", "h", "q_idx"))
    assert split.hoisted == (names or ()) and split.params == whole.params
    if names is None:
        assert split.source.replace("mask_split", "mask_whole") == whole.source
        return
    values = ", ".join(f"v{i}" for i in range(len(names)))
    spread = "".join(f", v{i}[:, None]" for i in range(len(names)))
    params = ", ".join(whole.params)
    source = load_template("common.py.jinja").render(
        template_name="test", score_mod_name="none", mask_mod_name=name, interpret=True, score_mod_source="",
        mask_mod_source="\n\n".join([whole.source, split.source, split.hoist_source, f"""
@triton.jit
def check(OUT_WHOLE, OUT_SPLIT, {params}, L: tl.constexpr):
    q = tl.arange(0, L)
    kv = tl.arange(0, L)
    offs = q[:, None] * L + kv[None, :]
    for h in range(3):
        tl.store(OUT_WHOLE + h * L * L + offs, mask_whole(0, h, q[:, None], kv[None, :], {params}).to(tl.int32))
        {values} = mask_split_hoist(0, h, q, {params})
        tl.store(OUT_SPLIT + h * L * L + offs,
                 mask_split(0, h, q[:, None], kv[None, :]{spread}, {params}).to(tl.int32))
"""]))
    module = load_module(source, interpret=True)
    L = 64
    out_whole, out_split = (torch.full((3, L, L), -1, dtype=torch.int32) for _ in range(2))
    module.check[(1,)](out_whole, out_split, *whole.kernel_args(), L=L)
    want = torch.stack([mask(0, torch.tensor(h), torch.arange(L)[:, None], torch.arange(L)[None, :])
                        for h in range(3)]).to(torch.int32)
    assert torch.equal(out_whole, want) and torch.equal(out_split, want)


FOLD_MODS = {
    # score_mod, (in_scale, out_scale) lower_mod's fold_scales takes out
    "softcap": (lambda s, b, h, q, kv: 30.0 * torch.tanh(s / 30.0), (1 / 30.0, 30.0)),
    # an unbounded output keeps its factor: the folded max would carry the rounding of a large score into exp2
    "scaled_bias": (lambda s, b, h, q, kv: (s * 2 + _slopes[h] * (kv - q)) * 0.5, (2.0, None)),
    "sigmoid": (lambda s, b, h, q, kv: 20.0 * torch.sigmoid(s * 0.25), (0.25, 20.0)),
    "times_a_constant": (lambda s, b, h, q, kv: 3 * s, (3.0, None)),  # one node: taken as the input's factor
    "negative_output_factor": (lambda s, b, h, q, kv: -2.0 * torch.tanh(s / 8), (0.125, None)),  # max would flip
    "score_used_twice": (lambda s, b, h, q, kv: torch.tanh(torch.tanh(s * 0.5) * s) * 4.0, (None, 4.0)),
    "no_factor": (lambda s, b, h, q, kv: s + h, (None, None)),
}


@pytest.mark.parametrize("cap, out_scale", [(1024.0, 1024.0), (1025.0, None), (1e4, None)])
def test_only_a_small_output_factor_is_folded(cap, out_scale):
    """The folded output factor scales the row max apart from the scores (exp2's argument one FMA), which hands the
    max's own score the product's rounding error, |max| * 2**-24, as an exponent: folded only up to 1024 x tanh
    (that form for every score_mod turned rows of 1e35-sized scores to NaN on a GPU: benchmarks/NOTES.md 48)."""
    from flexlite.codegen.lower import lower_mod

    low = lower_mod(trace_mod(lambda s, b, h, q, kv: cap * torch.tanh(s / cap), "score_mod"), "score_mod", "sm_",
                    fold_scales=True)
    assert (low.in_scale, low.out_scale) == (1 / cap, out_scale)


@pytest.mark.parametrize("name", sorted(FOLD_MODS))
def test_score_mod_constant_factors_are_folded_into_the_forward(monkeypatch, name):
    """launch.FOLD_SCORE_SCALES: a score_mod's constant input factor and positive output factor are left to the
    forward kernel, which folds them into its own multiplies; outputs and gradients stay the reference's."""
    from flexlite.codegen.lower import lower_mod
    from flexlite.runtime import launch

    mod, (in_scale, out_scale) = FOLD_MODS[name]
    low = lower_mod(trace_mod(mod, "score_mod"), "score_mod", "sm_", fold_scales=True)
    assert (low.in_scale, low.out_scale) == (in_scale, out_scale)
    monkeypatch.setattr(launch, "FOLD_SCORE_SCALES", True)
    source = flexlite.kernel_source(mod, device=DEVICE)
    assert (f"qk_scale * {in_scale!r}" in source) == (in_scale is not None)
    assert ("* LOG2E\n" not in source.split("def flex_fwd_block")[1].split("def ")[0]) == (out_scale is not None)
    q, k, v = (t.requires_grad_() for t in rand_qkv(2, H, H, 100, 70, 16, seed=11))
    bm = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx + 20 >= kv_idx, None, None, 100, 70, device=DEVICE)
    out = flex_attention(q, k, v, score_mod=mod, block_mask=bm)
    ref = attention_reference(q, k, v, score_mod=mod, block_mask=bm)[0]
    assert_close(out, ref, *TOLERANCES[torch.float32])
    assert_grads_like_reference(out, ref, (q, k, v))


def test_the_warp_specialized_forward_computes_the_masks_key_values_apart():
    """generate(key_values=True), launch.WS_FWD_KEY_VALUES: for fwd_ws.py.jinja only, mask_mod's values from b, h,
    kv_idx and captured tensors (a document mask's gathers along the keys) move to mask_mod_hoist, which the kernel
    calls on a compact key vector, with index arithmetic in int; a mask with nothing to move keeps its float forms
    and its source; other templates are unchanged."""
    from flexlite.codegen.kernel import generate
    from flexlite.masks import causal_mask, generate_doc_mask_mod
    doc = torch.arange(256) // 96
    document = generate_doc_mask_mod(causal_mask, doc)

    def window(b, h, q_idx, kv_idx):  # no captured tensor: nothing to compute apart
        return (q_idx - kv_idx).abs().float() < 64.0

    split = generate("fwd_ws.py.jinja", None, document, interpret=False, float_index=True, key_values=True)
    whole = generate("fwd_ws.py.jinja", None, document, interpret=False, float_index=True)
    assert split.mask_mod.hoisted and not whole.mask_mod.hoisted
    assert "def mask_mod_hoist(b, h, kv_idx, " in split.source and "mask_mod_hoist(off_z, off_h, offs_key, " in \
        split.source and "offs_key" not in whole.source
    assert "tl.float32" not in split.mask_mod.source  # (no float forms across the split)

    def near_in_doc(b, h, q_idx, kv_idx):  # key values and float index forms both: the split keeps the ints
        return (doc[q_idx] == doc[kv_idx]) & ((q_idx - kv_idx).abs().float() < 64.0)
    near = {kv: generate("fwd_ws.py.jinja", None, near_in_doc, interpret=False, float_index=True, key_values=kv)
            for kv in (False, True)}
    assert near[True].mask_mod.hoisted and not near[False].mask_mod.hoisted
    assert "kv_idx.to(tl.float32)" in near[False].mask_mod.source
    assert "kv_idx.to(tl.float32)" not in near[True].mask_mod.source + near[True].mask_mod.hoist_source
    for name in split.mask_mod.hoisted:  # the mask takes the moved values as parameters
        assert f"mm_v_{name}" in split.source
    kept = generate("fwd_ws.py.jinja", None, window, interpret=False, float_index=True, key_values=True)
    assert kept.source == generate("fwd_ws.py.jinja", None, window, interpret=False, float_index=True).source
    assert "kv_idx.to(tl.float32)" in kept.mask_mod.source
    for template in ("fwd.py.jinja", "decode.py.jinja"):
        assert generate(template, None, document, interpret=False, key_values=True).source == \
            generate(template, None, document, interpret=False).source


_q_bias = torch.randn(512, generator=torch.Generator().manual_seed(12)).to(DEVICE)
_k_bias = torch.randn(512, generator=torch.Generator().manual_seed(13)).to(DEVICE)

SEPARABLE_MODS = {
    # score_mod, whether lower_mod's separate finds it the score plus a bias of a query side and a key side, and
    # whether that bias is affine in kv_idx (lower_mod's affine_keys)
    "alibi": (lambda s, b, h, q, kv: s + _slopes[h] * (kv - q), True, True),
    "bias_first": (lambda s, b, h, q, kv: (kv * 0.01 - q * 0.02) + s, True, True),
    "input_factor_and_sides": (lambda s, b, h, q, kv: s * 0.5 + q.float() * 0.3 - (kv // 3).float() / 2, True, False),
    "minus_a_float_distance": (lambda s, b, h, q, kv: s - _slopes[h] * (q - kv).float() / 7, True, True),
    "query_side_only": (lambda s, b, h, q, kv: s + _slopes[h] * q, True, True),
    "key_side_squared": (lambda s, b, h, q, kv: s + (kv * kv).float() * 1e-4 - q * 0.01, True, False),
    # terms read from captured tensors may be non-finite at a tile's anchors: not separated
    "query_side_read": (lambda s, b, h, q, kv: s + _q_bias[q], False, False),
    "key_padding_read": (lambda s, b, h, q, kv: _k_bias[kv] + s, False, False),
    "head_bias_read": (lambda s, b, h, q, kv: s + _slopes[h] + kv * 0.1, False, False),
    "two_slopes_and_a_head_term": (lambda s, b, h, q, kv: s + _slopes[h] * kv - _slopes[(h + 1) % H] * q + h * 0.25,
                                   True, True),
    "relative_table": (lambda s, b, h, q, kv: s + _table[h % 4, (kv - q) % 64], False, False),
    "product_of_sides": (lambda s, b, h, q, kv: s + q * kv * 1e-3, False, False),
    "absolute_distance": (lambda s, b, h, q, kv: s - _slopes[h] * (kv - q).abs(), False, False),
    "score_not_linear": (lambda s, b, h, q, kv: torch.tanh(s) + _q_bias[q], False, False),
    "score_times_a_side": (lambda s, b, h, q, kv: s * _q_bias[q], False, False),
    "score_subtracted": (lambda s, b, h, q, kv: _k_bias[kv] - s, False, False),
    "score_used_twice": (lambda s, b, h, q, kv: s + s * 0.1 + _q_bias[q], False, False),
    "factor_on_the_sum": (lambda s, b, h, q, kv: (s + _q_bias[q]) * 0.5, False, False),
    "where_on_both_sides": (lambda s, b, h, q, kv: s + torch.where(q >= kv, 0.0, -1.0), False, False),
    "floor_division": (lambda s, b, h, q, kv: s + (kv - q) // 2, False, False),
    # int32 arithmetic that wraps before its float: no sum of two sides
    "int_distance_that_wraps": (lambda s, b, h, q, kv: s + ((q - kv) * 100000000).float() * 1e-9, False, False),
    "identity": (lambda s, b, h, q, kv: s, False, False),
}


@pytest.mark.parametrize("name", sorted(SEPARABLE_MODS))
def test_which_score_mods_are_the_score_plus_a_separable_bias(name):
    """lower_mod's separate (launch.SEPARATE_SCORE_BIAS): a score_mod that adds to the score (or to its folded
    input factor's product) terms of the queries alone and of the keys alone is found separable; products of the two
    sides, gathers or non-linear functions of both, a score used twice, negated or scaled after the sum are not. The
    forwards take the separable ones apart (row_bias); the backward and decoding keep the mod as it is. Of those, a
    bias whose terms of kv_idx are kv_idx under sums and constant factors is affine in it (lower_mod's affine_keys:
    not a floor division or a square of kv_idx); the forwards take its key side as a vector per walk and a scalar
    per tile (tile_bias), fwd_ws.py.jinja at the head dims asked (AFFINE_BIAS), the others there on the compact
    vector or the tile's columns."""
    from flexlite.codegen.kernel import generate, generate_backward
    from flexlite.codegen.lower import lower_mod

    mod, separable, affine = SEPARABLE_MODS[name]
    low = lower_mod(trace_mod(mod, "score_mod"), "score_mod", "sm_", fold_scales=True, separate=True)
    assert low.separable == separable and low.affine_keys == affine
    plain = lower_mod(trace_mod(mod, "score_mod"), "score_mod", "sm_", fold_scales=True)
    assert not plain.separable and not plain.affine_keys
    source = flexlite.kernel_source(mod, device=DEVICE)
    assert ("row_bias" in source) == separable and ("score_mod(-0.0, " in source) == separable
    assert "tile_bias" not in source  # (the Triton forward: not in launch.AFFINE_KEY_BIAS by default)
    ws = generate("fwd_ws.py.jinja", mod, None, interpret=False, fold_scales=True, separate=True,
                  compact_bias_dims=(128,))
    assert ("row_bias" in ws.source) == separable and ("offs_kb" in ws.source) == separable
    assert "tile_bias" not in ws.source  # (affine_keys off)
    ws = generate("fwd_ws.py.jinja", mod, None, interpret=False, fold_scales=True, separate=True,
                  affine_keys=("fwd_ws.py.jinja",),
                  compact_bias_dims=(128,), affine_bias_dims=(64,))
    assert ("tile_bias" in ws.source) == affine and ("AFFINE_BIAS: gl.constexpr = (D == 64)" in ws.source) == affine
    assert ("row_bias" in ws.source) == separable and ("offs_kb" in ws.source) == separable
    assert "row_bias" not in generate("decode.py.jinja", mod, None, interpret=False, separate=True).source
    assert "row_bias" not in generate_backward(mod, None, interpret=False).source


@pytest.mark.parametrize("mod", [lambda s, b, h, q, kv: s + (2 * (kv - q)).float() * 0.1,
                                 lambda s, b, h, q, kv: s + (q + kv).float() * 0.01 - kv * 0.5],
                         ids=["twice_a_distance", "sum_of_indices"])
def test_int_index_arithmetic_is_separated_only_where_it_cannot_wrap(mod):
    """A bias's int32 arithmetic is linear only where it cannot wrap: 2 * (kv_idx - q_idx) and q_idx + kv_idx stay in
    int32 for positions below 2**24 (the forwards' float_index, lengths up to 2**24), not for any int32 position."""
    from flexlite.codegen.lower import lower_mod

    for float_index in (True, False):
        low = lower_mod(trace_mod(mod, "score_mod"), "score_mod", "sm_", float_index=float_index, separate=True)
        assert low.separable == float_index and low.affine_keys == float_index


def test_int_index_arithmetic_that_wraps_keeps_the_references_values():
    """(q_idx - kv_idx) * 10**8 wraps in int32, as torch computes it: the forward must not take the bias apart into a
    query side and a key side (their floats' sum is not the wrapped value's float). The reference's out and LSE."""
    mod = SEPARABLE_MODS["int_distance_that_wraps"][0]
    q, k, v = rand_qkv(1, 2, 2, 128, 128, 16, seed=22)
    out, lse = flex_attention(q, k, v, score_mod=mod, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, score_mod=mod)
    assert_close(out, ref, *TOLERANCES[torch.float32])
    assert_close(lse, ref_lse, *TOLERANCES[torch.float32], name="lse")


@pytest.mark.parametrize("Lq, Lkv", [(100, 70), (63, 200)], ids=["more-queries-than-keys", "ragged"])
@pytest.mark.parametrize("name, affine", [(n, a) for n, (_, separable, affine) in sorted(SEPARABLE_MODS.items())
                                          if separable for a in ((True, False) if affine else (False,))])
def test_a_separable_bias_leaves_outputs_lse_max_scores_and_gradients_the_references(monkeypatch, name, affine,
                                                                                      Lq, Lkv):
    """The forward adds bias(q_anchor, kv) to the scores and bias(q, k0) - bias(q_anchor, k0) to each row's LSE and
    max_scores (k0 a key in range: with more queries than keys the query block's first row is not one); the backward
    reads that LSE with the whole mod. A bias affine in kv_idx (launch.AFFINE_KEY_BIAS naming the Triton forward, which
    the interpreter runs) goes in as
    bias(q_anchor, q_anchor + j) - bias(q_anchor, q_anchor) along a tile's columns j (keys past the sequence where
    q_anchor is) and bias(q_anchor, start_n) in the row max. All of it is the reference's, under a block mask with
    partial and full blocks, with GQA."""
    from flexlite import AuxRequest
    from flexlite.runtime import launch

    monkeypatch.setattr(launch, "AFFINE_KEY_BIAS", frozenset({"fwd.py.jinja"} if affine else ()))
    mod = SEPARABLE_MODS[name][0]
    q, k, v = (t.requires_grad_() for t in rand_qkv(1, H, 1, Lq, Lkv, 16, seed=21))
    bm = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx + 20 >= kv_idx, None, None, Lq, Lkv, device=DEVICE,
                           BLOCK_SIZE=32)
    out, aux = flex_attention(q, k, v, score_mod=mod, block_mask=bm, enable_gqa=True,
                              return_aux=AuxRequest(lse=True, max_scores=True))
    source = flexlite.kernel_source(mod, bm, device=DEVICE)
    assert "row_bias" in source and ("tile_bias" in source) == affine
    ref, ref_lse, ref_max = attention_reference(q, k, v, score_mod=mod, block_mask=bm, enable_gqa=True,
                                                return_max=True)
    assert_close(out, ref, *TOLERANCES[torch.float32])
    assert_close(aux.lse, ref_lse, *TOLERANCES[torch.float32], name="lse")
    assert_close(aux.max_scores, ref_max, *TOLERANCES[torch.float32], name="max_scores")
    assert_grads_like_reference(out, ref, (q, k, v))
    with torch.no_grad():  # and without a block mask (the dense walk's tiles)
        out, lse = flex_attention(q, k, v, score_mod=mod, enable_gqa=True, return_lse=True)
        ref, ref_lse = attention_reference(q, k, v, score_mod=mod, enable_gqa=True)
    assert_close(out, ref, *TOLERANCES[torch.float32], name="out, dense")
    assert_close(lse, ref_lse, *TOLERANCES[torch.float32], name="lse, dense")


def test_a_bias_read_from_a_captured_tensor_is_not_separated_whatever_it_holds(monkeypatch):
    """A bias term read from a captured tensor may be non-finite anywhere, at a tile's first query or key too, where
    a separated bias takes its anchors (bias(q0, kv) + bias(q, k0) - bias(q0, k0): -inf - -inf is NaN): left padding
    written as a key bias of -inf, rows of -inf, +inf and NaN (the first query's too). Such mods are not separated;
    out, LSE and max_scores are the reference's (a fully masked row stays empty whatever its bias)."""
    check_non_finite_biases(monkeypatch, D=16, dtype=torch.float32, block_size=32)


def _assert_same_non_finite(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, name: str):
    # NaN where the reference has NaN (assert_close refuses matching NaNs), the rest by assert_close (infinities
    # exactly)
    assert torch.equal(got.cpu().isnan(), want.cpu().isnan()), name
    assert_close(got[~want.isnan()], want[~want.isnan()], *TOLERANCES[dtype], name=name)


def check_non_finite_biases(monkeypatch, D: int, dtype: torch.dtype, block_size: int, kernel_options=None):
    """(test_a_bias_read_from_a_captured_tensor_is_not_separated_whatever_it_holds; on a Hopper GPU,
    test_warp_specialized runs it through the warp-specialized forward)"""
    from flexlite import AuxRequest
    from flexlite.runtime import launch

    row_bias = torch.randn(80, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    row_bias[[0, 3, 40]] = float("-inf")
    row_bias[[7, 50]] = float("inf")
    row_bias[[11, 60]] = float("nan")
    row_bias[[20, 21]] = float("inf")  # rows the mask empties
    key_pad = torch.zeros(90, device=DEVICE)
    key_pad[:3] = float("-inf")  # left padding

    def biases(score, b, h, q_idx, kv_idx):
        return score + row_bias[q_idx] + _k_bias[kv_idx]

    def padding(score, b, h, q_idx, kv_idx):
        return score + key_pad[kv_idx]

    monkeypatch.setattr(launch, "SEPARATE_SCORE_BIAS", True)
    bm = create_block_mask(lambda b, h, q_idx, kv_idx: (q_idx < 20) | (q_idx > 21), None, None, 80, 90,
                           device=DEVICE, BLOCK_SIZE=block_size)
    q, k, v = rand_qkv(1, 2, 2, 80, 90, D, dtype=dtype, seed=6)
    for mod in (biases, padding):
        assert "row_bias" not in flexlite.kernel_source(mod, bm, device=DEVICE)
        out, aux = flex_attention(q, k, v, score_mod=mod, block_mask=bm, kernel_options=kernel_options,
                                  return_aux=AuxRequest(lse=True, max_scores=True))
        ref, ref_lse, ref_max = attention_reference(q, k, v, score_mod=mod, block_mask=bm, return_max=True)
        _assert_same_non_finite(out, ref, dtype, f"{mod.__name__}: out")
        _assert_same_non_finite(aux.lse, ref_lse, dtype, f"{mod.__name__}: lse")
        # (a NaN row's max: a GPU's row max (max.f32) skips NaN, the interpreter's and the reference's do not)
        rows = ~ref_max.isnan()
        _assert_same_non_finite(aux.max_scores[rows], ref_max[rows], dtype, f"{mod.__name__}: max_scores")
        if mod is biases:
            assert torch.equal(out[:, :, [0, 3, 40, 20, 21]], torch.zeros_like(out[:, :, [0, 3, 40, 20, 21]]))
            assert out[:, :, [7, 50, 11, 60]].isnan().all()


@pytest.mark.parametrize("cap, dtype, bounded", [(30.0, torch.bfloat16, True), (41.0, torch.bfloat16, True),
                                                 (42.0, torch.bfloat16, False), (30.0, torch.float16, False),
                                                 (30.0, torch.float32, False)],
                         ids=["cap30-bf16", "cap41-bf16", "cap42-bf16", "cap30-fp16", "cap30-fp32"])
def test_the_gluon_forward_takes_a_bounded_score_mod_against_its_bound(cap, dtype, bounded):
    """launch.WS_FWD_BOUNDED_SOFTMAX: softcap's folded cap * tanh bounds the scores, so the warp-specialized forward
    runs exp2 against cap * log2(e) instead of the running row max (P's row sums by the tensor cores, ones_smem):
    for bfloat16 inputs only (fp16's P would lose its small weights below 2 ** -14) and only while the smallest
    weight, 2 ** (-2 * cap * log2(e)), is a normal number (cap * log2(e) <= 60: caps up to 41.58)."""
    from flexlite.mods import generate_tanh_softcap

    mod = generate_tanh_softcap(cap, approx=True)
    source = flexlite.kernel_source(mod, device="cuda", kernel="forward_ws", dtype=dtype)
    assert ("ones_smem" in source) == bounded
    if bounded:
        # (at D64 by ws_exp2: launch.WS_FWD_POLY_EXP2_BOUNDED)
        assert f"exp2(s * {cap * 1.4426950408889634!r} - {cap * 1.4426950408889634!r}" in source
    for kernel in ("forward", "decode"):  # the Triton kernels keep the running max
        assert "ones_smem" not in flexlite.kernel_source(mod, device="cuda", kernel=kernel, dtype=dtype)
    with pytest.raises(ValueError, match="kernel_source: dtype must be"):
        flexlite.kernel_source(mod, device="cuda", kernel="forward_ws", dtype=torch.int32)


@pytest.mark.parametrize("max_scores", [False, True])
def test_max_scores_take_the_running_max(monkeypatch, max_scores):
    """The bound replaces the row max, so a call asking for max_scores is generated without it (api._generate decides
    generate's bounded), as is one with other than bfloat16 inputs."""
    import flexlite.api as api
    from flexlite import AuxRequest
    from flexlite.mods import generate_tanh_softcap

    seen, real = [], api.generate
    monkeypatch.setattr(api, "generate", lambda *a, **kw: seen.append(kw.get("bounded")) or real(*a, **kw))
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v = rand_qkv(1, 2, 2, 80, 80, 16, dtype=dtype, seed=2)
        flex_attention(q, k, v, score_mod=generate_tanh_softcap(20.0, approx=True),
                       return_aux=AuxRequest(max_scores=max_scores))
    assert seen == [not max_scores, False]


def test_poly_exp2_matches_exp2_where_the_forward_uses_it():
    """codegen.exp2's polynomial (the lane launch.WS_FWD_POLY_EXP2 moves to the FMA pipes), step for step in fp32:
    within 1.02e-4 of 2 ** x down to -126, 0 at -127 and below and at -inf (masked scores), NaN kept."""
    from flexlite.codegen.exp2 import poly_exp2_reference

    x = torch.cat([torch.linspace(-126.0, 0.0, 100_001), -torch.rand(10_000) * 126, torch.tensor([0.0, -0.5, -1.5])])
    want = torch.exp2(x.double())
    assert ((poly_exp2_reference(x).double() - want) / want).abs().max() < 1.02e-4
    edges = torch.tensor([-127.0, -127.2, -300.0, float("-inf"), float("nan")])
    got = poly_exp2_reference(edges)
    assert torch.equal(got[:4], torch.zeros(4)) and torch.isnan(got[4])


@pytest.mark.parametrize("one_in", [2, 4, 8])
def test_poly_exp2_asm_computes_one_value_in_n_on_the_fma_pipes(one_in):
    from flexlite.codegen.exp2 import poly_exp2_asm, poly_exp2_constraints

    asm = poly_exp2_asm(one_in)
    assert asm.count("ex2.approx.ftz.f32") == one_in - 1 and asm.count("fma.rn.f32") == 3
    assert f"mul.rn.f32 ${one_in - 1}, p, s;" in asm and f"max.NaN.f32 x, ${2 * one_in - 1}," in asm
    assert poly_exp2_constraints(one_in).split(",") == ["=r"] * one_in + ["r"] * one_in


@pytest.mark.parametrize("bad", [1, 3, 0, "4"])
def test_poly_exp2_takes_powers_of_two_of_at_least_two(monkeypatch, bad):
    from flexlite.codegen.exp2 import poly_exp2_asm
    from flexlite.mods import generate_tanh_softcap
    from flexlite.runtime import launch

    if isinstance(bad, int):
        with pytest.raises(ValueError, match="one_in must be a power of two"):
            poly_exp2_asm(bad)
    for name in ("WS_FWD_POLY_EXP2", "WS_FWD_POLY_EXP2_BOUNDED"):
        with monkeypatch.context() as patch:
            patch.setattr(launch, name, {64: bad})
            with pytest.raises(TypeError, match=f"launch.{name} must be a dict of head dim -> N"):
                flexlite.kernel_source(generate_tanh_softcap(30.0, approx=True), device="cuda", kernel="forward_ws",
                                       dtype=torch.bfloat16)


@pytest.mark.parametrize("bounded", [True, False], ids=["softcap against its bound", "running max"])
def test_the_gluon_forward_takes_p_exponentials_through_ws_exp2_where_asked(monkeypatch, bounded):
    """launch.WS_FWD_POLY_EXP2 (off by default: the kernel's source is then what it was): head dim -> N renders
    ws_exp2 (one of every N of P's exponentials by the polynomial), a constexpr N per head dim, and every P exp2
    through it; the rescale's exp2 and the Triton kernels are untouched. launch.WS_FWD_POLY_EXP2_BOUNDED (D64: 8)
    does the same for a kernel that runs a bounded score_mod against its bound only, over WS_FWD_POLY_EXP2."""
    from flexlite.mods import generate_tanh_softcap
    from flexlite.runtime import launch

    def source(score_mod=generate_tanh_softcap(30.0, approx=True)):
        return flexlite.kernel_source(score_mod, device="cuda", kernel="forward_ws",
                                      dtype=torch.bfloat16 if bounded else torch.float16)
    assert launch.WS_FWD_POLY_EXP2_BOUNDED == {64: 8} and not launch.WS_FWD_POLY_EXP2
    default = source()
    assert ("EXP2_ONE_IN: gl.constexpr = (8 if D == 64 else 0)" in default) == bounded
    assert "ws_exp2" not in source(None) and "ws_exp2" not in source(lambda s, b, h, q, k: s * 0.5 + 1.0)
    monkeypatch.setattr(launch, "WS_FWD_POLY_EXP2_BOUNDED", {})
    plain = source()
    assert "ws_exp2" not in plain and "EXP2_ONE_IN" not in plain
    monkeypatch.setattr(launch, "WS_FWD_POLY_EXP2", {64: 4, 128: 2})
    monkeypatch.setattr(launch, "WS_FWD_POLY_EXP2_BOUNDED", {128: 8})  # over the plain setting's 2 at D128
    over = "EXP2_ONE_IN: gl.constexpr = (4 if D == 64 else 8 if D == 128 else 0)"
    assert (over in source()) == bounded and over not in source(None)
    monkeypatch.setattr(launch, "WS_FWD_POLY_EXP2_BOUNDED", {})
    poly = source()
    assert "def ws_exp2(x, ONE_IN: gl.constexpr):" in poly and "pack=4)" in poly and "pack=2)" in poly
    assert "EXP2_ONE_IN: gl.constexpr = (4 if D == 64 else 2 if D == 128 else 0)" in poly
    assert "EXP2_ONE_IN: gl.constexpr = (4 if q.shape[1] == 64 else 2 if q.shape[1] == 128 else 0)" in poly
    # (the running max's P: with and without a score_mod, constexpr branches)
    assert poly.count("ws_exp2(s ") == (1 if bounded else 2) and "gl.exp2(s" not in poly
    assert poly.count("EVEN_N, EXP2_ONE_IN)") == 3  # ws_softmax's three calls
    assert ("alpha = gl.exp2(m_i - m_safe)" in poly) == (not bounded)
    assert "ws_exp2" not in flexlite.kernel_source(generate_tanh_softcap(30.0, approx=True), device="cuda",
                                                   kernel="forward", dtype=torch.bfloat16)
