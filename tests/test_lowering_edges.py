"""Lowering edge cases against torch's semantics (the fp64 reference evaluates the mods with torch): ``**`` / torch.pow
of every dtype pairing and sign, ``.device`` / ``.dtype`` / ``.shape`` reads feeding tensor constructors and casts
(torch's own noop_mask), and Python int constants beyond int32."""

import math
import warnings

import numpy as np
import pytest
import torch

from flexlite import UntraceableModError, attention_reference, create_block_mask, flex_attention
from flexlite import block_mask as bm_module
from flexlite.codegen.lower import lower_mod
from flexlite.codegen.trace import trace_mod
from helpers import DEVICE, TOLERANCES, assert_close, assert_grad_close, assert_grads_like_reference, rand_qkv

B, H, L, D = 1, 1, 40, 16


def _clean(p):
    """p clamped to [-3, 3] (+-inf -> +-3), NaN -> -2: NaN and inf positions count too, and no term swamps the rest."""
    return torch.where(p == p, torch.clamp(p, -3.0, 3.0), -2.0)


SCORE_MODS = {
    # float ** int tensor: negative bases with odd / even exponents (was NaN everywhere)
    "float_pow_int_tensor": lambda s, b, h, q, kv: s ** (q % 3),
    "torch_pow_method": lambda s, b, h, q, kv: torch.pow(s, kv % 4 - 1).clamp(-20, 20) + s.pow(q % 2),
    # float ** float tensor: NaN for a negative base and a non-integer exponent, signs for odd integers
    "float_pow_float_tensor": lambda s, b, h, q, kv: s + _clean((s * 2) ** ((kv % 5) * 0.5 - 1.0)),
    "negative_scalar_base": lambda s, b, h, q, kv: s + _clean((-2.0) ** ((kv % 7) * 0.5 - 1.5)),
    "negative_scalar_base_int_exponent": lambda s, b, h, q, kv: s + _clean((-1.5) ** (q % 5 - kv % 3)),
    "scalar_base_positive": lambda s, b, h, q, kv: s + 2.0 ** ((kv - q) * 0.1) + 0.5 ** (q % 4),
    "scalar_base_one": lambda s, b, h, q, kv: s + 1.0 ** (s * float("inf")),
    # 0 ** 0 = 1, 0 ** positive = 0, 0 ** negative = inf
    "zero_base_scalar": lambda s, b, h, q, kv: s + _clean(0.0 ** ((kv % 3) - 1.0)),
    "zero_base_tensor": lambda s, b, h, q, kv: s + _clean(torch.where(kv % 4 == 0, 0.0, s) ** (q % 3 - 1)),
    "inf_and_nan_bases": lambda s, b, h, q, kv: s + _clean(torch.where(kv % 3 == 0, float("inf"), -s * 1e30)
                                                           ** ((q % 3) - 1.0) * 1e-3)
    + _clean(torch.where(kv % 2 == 0, float("nan"), s) ** (q % 2 - 1)),
    "int_base_float_exponent": lambda s, b, h, q, kv: s + _clean((q - kv) ** (s * 0.5)),
    "float_pow_constant": lambda s, b, h, q, kv: s + _clean(s ** 2.5) + _clean((s * 1.5) ** 9) + _clean(s ** -9.0)
    + (q % 5) ** 2.0 * 0.1,
    # int ** int: exact as torch's integer pow (wrapping in int32), negative exponents as torch
    "int_pow_int": lambda s, b, h, q, kv: s + ((q - kv) ** (kv % 3)).float() * 0.01,
    "int_pow_int_wraps": lambda s, b, h, q, kv: s + (((q % 7 + 1) ** (kv % 13)) % 1000).float() * 1e-3,
    "int_pow_negative_int": lambda s, b, h, q, kv: s + (((q % 3) - 1) ** ((kv % 3) - 2)).float()
    + ((q % 4) ** -(kv % 3)).float() * 0.5,
    "int_scalar_base": lambda s, b, h, q, kv: s + (2 ** (kv % 40)).float() * 1e-9 + ((-3) ** (q % 5)).float() * 0.01,
    "int_pow_constant": lambda s, b, h, q, kv: s + ((q % 5) ** 13 % 1001).float() * 1e-3,
    "int64_pow": lambda s, b, h, q, kv: s + ((q.long() + 3) ** (kv % 23) % 997).float() * 1e-3,
}

MASK_MODS = {
    "int_pow": lambda b, h, q, kv: ((q % 7 + 1) ** (kv % 3 + 1)) % 5 == 0,
    "int_pow_signed": lambda b, h, q, kv: ((q - kv) ** (kv % 3)) % 3 == 0,
    "int_pow_wraps": lambda b, h, q, kv: (2 ** (kv % 40)) > q,
    "float_pow_nan": lambda b, h, q, kv: (((q - kv) * 0.25) ** ((kv % 4) * 0.5)) < 2.0,
}


def _check(score_mod=None, mask_mod=None, L=L, scale_q=1.0):
    q, k, v = rand_qkv(B, H, H, L, L, D, seed=3)
    bm = None if mask_mod is None else create_block_mask(mask_mod, None, None, L, L, device=DEVICE, BLOCK_SIZE=16)
    out, lse = flex_attention(q * scale_q, k, v, score_mod=score_mod, block_mask=bm, return_lse=True)
    ref_out, ref_lse = attention_reference(q * scale_q, k, v, score_mod=score_mod, block_mask=bm)
    assert_close(out, ref_out, *TOLERANCES[torch.float32])
    assert_close(lse, ref_lse, *TOLERANCES[torch.float32], name="lse")


@pytest.mark.parametrize("name", sorted(SCORE_MODS))
def test_pow_score_mods(name):
    fn = SCORE_MODS[name]
    fn.__name__ = name
    _check(score_mod=fn, scale_q=3.0 if name == "float_pow_int_tensor" else 1.0)


@pytest.mark.parametrize("name", sorted(MASK_MODS))
def test_pow_mask_mods(name):
    """The attention kernels' mask_mod (partial blocks) and the block-mask kernel's flags against torch's."""
    fn = MASK_MODS[name]
    fn.__name__ = name
    _check(mask_mod=fn, L=64)
    got = bm_module._block_flags_kernel(fn, 1, 1, 64, 64, torch.device(DEVICE), (16, 16))
    want = bm_module._block_flags_vmap(fn, 1, 1, 64, 64, torch.device(DEVICE), (16, 16))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


_BASES = [-float("inf"), -2.5, -2.0, -1.0, -0.5, -0.0, 0.0, 0.5, 1.0, 2.0, 3.0, float("inf"), float("nan")]
_EXPONENTS = [-float("inf"), -3.0, -2.5, -2.0, -1.0, -0.0, 0.5, 1.0, 2.0, 3.0, 31.0, float("inf"), float("nan")]


def _elementwise_mask(x, y, expected, rtol=1e-5):
    """True where the kernel's x[q_idx] ** y[kv_idx] is torch's (NaN for NaN, zeros' signs, ``rtol``)."""
    def mask(b, h, q_idx, kv_idx):
        p, e = x[q_idx] ** y[kv_idx], expected[q_idx, kv_idx]
        if not expected.is_floating_point():
            return p == e
        same = (p == e) | ((p != p) & (e != e)) | ((p - e).abs() <= rtol * e.abs())
        return same & ((p != 0) | (1 / p == 1 / e))
    return mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.int32, torch.int64, torch.int16,
                                   "float_int", "int_float"], ids=str)
def test_pow_special_values_elementwise(dtype):
    """Every pairing of special bases and exponents (signed zeros, infinities, NaN, negative bases with integer and
    fractional exponents; for ints negative exponents and wrapping) as torch computes it, through the block-mask
    kernel: every block all True."""
    if dtype in (torch.int32, torch.int64, torch.int16):
        x = torch.tensor([-3, -2, -1, 0, 1, 2, 3, 7, 181, -181, 46341, -46341], dtype=torch.int64).to(dtype)
        y = torch.tensor([-3, -2, -1, 0, 1, 2, 3, 4, 13, 31, 62, 63], dtype=dtype)
    else:
        xd, yd = {"float_int": (torch.float32, torch.int32), "int_float": (torch.int32, torch.float32)}.get(
            dtype, (dtype, dtype))
        x = torch.tensor(_BASES).to(xd) if xd.is_floating_point else torch.tensor([-3, -2, -1, 0, 1, 2, 3], dtype=xd)
        y = torch.tensor(_EXPONENTS).to(yd) if yd.is_floating_point else torch.tensor([-3, -2, -1, 0, 1, 2, 3, 31],
                                                                                        dtype=yd)
    x, y = x.to(DEVICE), y.to(DEVICE)
    expected = x[:, None] ** y[None, :]
    mask = _elementwise_mask(x, y, expected, rtol=1e-3 if dtype == torch.float16 else 1e-5)
    sizes = (len(x), len(y))
    want = bm_module._block_flags_vmap(mask, 1, 1, *sizes, torch.device(DEVICE), (16, 16))
    assert want[1].all()  # (torch agrees with itself)
    got = bm_module._block_flags_kernel(mask, 1, 1, *sizes, torch.device(DEVICE), (16, 16))
    assert got[1].all()


def test_scalar_bases_special_values():
    y = torch.tensor(_EXPONENTS).to(DEVICE)
    for base in (-2.0, -1.0, -0.0, 0.0, 1.0, 2.5, float("inf"), -float("inf"), float("nan")):
        expected = (base ** y)[None, :].expand(2, -1).contiguous()

        def mask(b, h, q_idx, kv_idx, base=base):
            p, e = base ** y[kv_idx], expected[q_idx, kv_idx]
            same = (p == e) | ((p != p) & (e != e)) | ((p - e).abs() <= 1e-5 * e.abs())
            return same & ((p != 0) | (1 / p == 1 / e))

        got = bm_module._block_flags_kernel(mask, 1, 1, 2, len(y), torch.device(DEVICE), (16, 16))
        assert got[1].all(), base


@pytest.mark.parametrize("mod", [
    lambda s, b, h, q, kv: s ** (q % 3 + 1),
    lambda s, b, h, q, kv: s * 0.5 + torch.pow(s * 0.5, (kv % 4).float()),
], ids=["int_exponent", "float_exponent"])
def test_pow_of_a_negative_base_has_torchs_gradient(mod):
    """The derivative's pow(x, y - 1) of negative scores is torch's too (it was NaN)."""
    _check_gradients(mod, seed=6)


def _check_gradients(mod, seed: int):
    """out and dq / dk / dv of ``mod`` against the reference's."""
    q, k, v = (t.requires_grad_() for t in rand_qkv(B, H, H, L, L, D, seed=seed))
    out = flex_attention(q, k, v, score_mod=mod)
    ref = attention_reference(q, k, v, score_mod=mod)[0]
    assert_close(out, ref, *TOLERANCES[torch.float32])
    grad = torch.randn_like(out)
    for n, g, w in zip(("dq", "dk", "dv"), torch.autograd.grad(out, (q, k, v), grad),
                       torch.autograd.grad(ref, (q, k, v), grad)):
        assert_grad_close(g, w, name=n)


def test_pow_keeps_the_fast_paths():
    def mod(s, b, h, q, kv):
        return s ** 2 + s ** -1 + s.abs() ** 0.5 + 2.0 ** s + (q % 3) ** 3

    source = lower_mod(trace_mod(mod, "score_mod"), "sm", "s_").source
    assert "log2" not in source and "static_range" not in source and "tl.exp2(" in source


def test_int_pow_of_a_tensor_exponent_walks_its_bits_in_fixed_steps():
    def mod(b, h, q, kv):
        return (q ** (kv % 3)) > 2

    source = lower_mod(trace_mod(mod, "mask_mod"), "mm", "m_").source
    assert "tl.static_range(31)" in source and "log2" not in source


# ---------------------------------------------------------------------------------------------
# .device / .dtype / .shape and the constructors they feed

ATTRIBUTE_SCORE_MODS = {
    "zeros_on_device": lambda s, b, h, q, kv: s + torch.zeros((), device=s.device),
    "ones_dtype_device": lambda s, b, h, q, kv: s * torch.ones((), dtype=s.dtype, device=s.device),
    "full": lambda s, b, h, q, kv: s + torch.full((), 0.5, device=s.device) + torch.full((), 2, device=q.device),
    "new_ones_zeros": lambda s, b, h, q, kv: s + q.new_ones(()).to(s.dtype) + s.new_zeros((), device=s.device),
    "to_dtype_device": lambda s, b, h, q, kv: s + (q - kv).to(s.dtype) * 0.01 + s.to(s.device) + s.to(
        device=s.device, dtype=s.dtype),
    "ndim_shape": lambda s, b, h, q, kv: s + s.ndim + s.new_full(s.shape, 0.25),
}


@pytest.mark.parametrize("name", sorted(ATTRIBUTE_SCORE_MODS))
def test_attributes_feed_constructors_and_casts(name):
    fn = ATTRIBUTE_SCORE_MODS[name]
    fn.__name__ = name
    _check(score_mod=fn)


def test_constructor_on_device_has_a_gradient():
    def mod(s, b, h, q_idx, kv_idx):
        return s * 0.5 + torch.zeros((), device=s.device)
    _check_gradients(mod, seed=4)


def test_torch_noop_mask():
    """torch's noop_mask (``b.new_ones((), dtype=torch.bool, device=b.device)``): through create_block_mask, and
    as the default mask_mod of torch's BlockMask.from_kv_blocks, whose blocks are all partial (the kernels call it)."""
    from torch.nn.attention.flex_attention import BlockMask as TorchBlockMask
    from torch.nn.attention.flex_attention import noop_mask

    q, k, v = rand_qkv(B, H, H, 64, 64, D, seed=5)
    bm = create_block_mask(noop_mask, None, None, 64, 64, device=DEVICE)
    assert_close(flex_attention(q, k, v, block_mask=bm), attention_reference(q, k, v)[0], *TOLERANCES[torch.float32])
    got = bm_module._block_flags_kernel(noop_mask, 1, 1, 64, 64, torch.device(DEVICE), (16, 16))
    assert got[0].all() and got[1].all()
    n_kv = 4  # 64 / 16: the last kv block left out of every row, so the mask matters
    kv_num_blocks = torch.full((1, 1, n_kv), n_kv - 1, dtype=torch.int32, device=DEVICE)
    kv_indices = torch.arange(n_kv, dtype=torch.int32, device=DEVICE).expand(1, 1, n_kv, n_kv).contiguous()
    tbm = TorchBlockMask.from_kv_blocks(kv_num_blocks, kv_indices, BLOCK_SIZE=16, seq_lengths=(64, 64))
    assert tbm.mask_mod is noop_mask
    out = flex_attention(q, k, v, block_mask=tbm)
    assert_close(out, attention_reference(q, k, v, block_mask=tbm)[0], *TOLERANCES[torch.float32])
    ours = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx < 48, None, None, 64, 64, device=DEVICE,
                             BLOCK_SIZE=16)
    assert_close(out, attention_reference(q, k, v, block_mask=ours)[0], *TOLERANCES[torch.float32])


def test_mask_from_new_zeros_on_device():
    def mask(b, h, q_idx, kv_idx):
        return b.new_zeros((), dtype=torch.bool, device=b.device) | (q_idx >= kv_idx)

    _check(mask_mod=mask, L=64)


def test_a_constant_tensor_that_is_not_0d_is_untraceable():
    def mod(s, b, h, q_idx, kv_idx):
        return s + q_idx.new_zeros((3,))

    with pytest.raises(UntraceableModError, match="make it 0-d"):
        lower_mod(trace_mod(mod, "score_mod"), "sm", "s_")


def test_other_attributes_are_named():
    def mod(s, b, h, q_idx, kv_idx):
        return s + s.real

    with pytest.raises(UntraceableModError, match="attribute 'real'"):
        lower_mod(trace_mod(mod, "score_mod"), "sm", "s_")


# ---------------------------------------------------------------------------------------------
# Python ints beyond int32: torch converts them to the int tensor's dtype (wrapping), as the kernels now do

BIG_INT_SCORE_MODS = {
    "add_mod": lambda s, b, h, q, kv: s + ((q + 2 ** 33) % 7).float(),
    "mul_sub_and": lambda s, b, h, q, kv: s + ((q * (2 ** 32 + 3) - (2 ** 40 + kv)) % 11).float() * 0.1
    + (kv & (2 ** 35 + 5)).float() * 0.1,
    "floordiv_fmod": lambda s, b, h, q, kv: s + (q // (2 ** 32 + 4)).float() * 0.1
    + torch.fmod(kv, -(2 ** 32) + 5).float() * 0.1 + torch.div(q, 2 ** 34 + 3, rounding_mode="floor").float() * 0.1,
    "int64_stays_int64": lambda s, b, h, q, kv: s + ((q.long() + 2 ** 33) % 7).float()
    + (kv.long() * 2 ** 40 > 0) * 0.5,
    # (not q / 2**33: torch gives 1.16e-10 * q, but under vmap, which the reference uses, q / 0)
    "float_operand": lambda s, b, h, q, kv: s + (q.float() + 2 ** 33) * 1e-10 + (q - kv).float() * 2 ** 33 * 1e-12,
}


@pytest.mark.parametrize("name", sorted(BIG_INT_SCORE_MODS))
def test_int_constants_beyond_int32(name):
    fn = BIG_INT_SCORE_MODS[name]
    fn.__name__ = name
    _check(score_mod=fn)


def test_int_constant_beyond_int32_in_a_mask():
    def mask(b, h, q_idx, kv_idx):
        return ((q_idx < 2 ** 33) | (q_idx - kv_idx == 2 ** 32 + 1)) | (kv_idx <= q_idx)  # 2**33 -> 0 as torch

    _check(mask_mod=mask, L=64)
    got = bm_module._block_flags_kernel(mask, 1, 1, 64, 64, torch.device(DEVICE), (16, 16))
    want = bm_module._block_flags_vmap(mask, 1, 1, 64, 64, torch.device(DEVICE), (16, 16))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ---------------------------------------------------------------------------------------------
# more of torch's elementwise ops, and the arguments' dtypes as constants while tracing

_TABLE = torch.randn(64, generator=torch.Generator().manual_seed(6)).to(DEVICE)
_TABLE[::7] = float("inf")
# atan2's arguments at the quadrants' edges, zero, infinities, tiny and huge (-0.0 left out: counted as +0.0)
_SPECIAL = torch.tensor([0.0, 0.5, -0.5, 2.0, -2.0, float("inf"), -float("inf"), 1e-30, -1e30], device=DEVICE)
_ENDS = torch.tensor([-1.0, -0.5, 0.0, 0.5, 1.0], device=DEVICE)  # asin / acos at the ends of their domain

_U8 = torch.arange(190, 190 + L, dtype=torch.uint8, device=DEVICE)  # torch: uint8 with int8 is int16
_I8 = torch.arange(-100, -100 + 5 * L, 5, dtype=torch.int8, device=DEVICE)

MORE_OPS = {
    # (Triton kept such pairs in 8 bits, unsigned: the negative ones wrapped)
    "mixed_signedness_ints": lambda s, b, h, q, kv: torch.where(_U8[q] > _I8[kv], s, s - 1.0) + (
        _U8[q] + _I8[kv]) * 0.01 - (_U8[kv] * _I8[q]) * 1e-4,
    "round": lambda s, b, h, q, kv: s + torch.round(s * 3) * 0.1 + torch.round((q - kv) * 0.5),  # halves to even
    # (alpha and decimals were dropped before: the plain add / sub / round)
    "add_sub_alpha": lambda s, b, h, q, kv: torch.add(s, q - kv, alpha=0.1) - s.sub((q + kv) * 0.01, alpha=3),
    "round_decimals": lambda s, b, h, q, kv: s + torch.round(s * 3, decimals=1) * 0.1 + torch.round(
        s * 300, decimals=-1) * 0.001,
    "trunc_fix": lambda s, b, h, q, kv: s + torch.trunc(s * 3) * 0.1 + torch.fix(-s * 2) * 0.05,
    "reciprocal": lambda s, b, h, q, kv: s + torch.reciprocal(2.0 + (q - kv).abs()) + s.reciprocal().clamp(-3, 3),
    "log10": lambda s, b, h, q, kv: s - torch.log10(1.0 + (q - kv).abs()),
    "isinf_isnan_isfinite": lambda s, b, h, q, kv: torch.where(torch.isinf(_TABLE[kv]), s - 1.0, s) + torch.where(
        torch.isnan(s) | ~torch.isfinite(_TABLE[q]), 0.5, 0.0),
    "softplus": lambda s, b, h, q, kv: torch.nn.functional.softplus(s * 8),  # (above the threshold too)
    "softplus_beta_threshold": lambda s, b, h, q, kv: torch.nn.functional.softplus(s, beta=2.0, threshold=1.0),
    "silu": lambda s, b, h, q, kv: torch.nn.functional.silu(s),
    "type_as_clone": lambda s, b, h, q, kv: s.clone() + (q - kv).type_as(s) * 0.01,
    "finfo_of_the_score": lambda s, b, h, q, kv: torch.where(q >= kv, s, torch.finfo(s.dtype).min),
    "is_floating_point": lambda s, b, h, q, kv: s + (1.0 if s.is_floating_point() else 0.0) + (
        1.0 if q.is_floating_point() else 0.5),
    "tensor_on_the_device": lambda s, b, h, q, kv: s * torch.tensor(0.5, device=s.device),
    # (x of atan2 negative, zero and positive: every quadrant)
    "atan_atan2": lambda s, b, h, q, kv: s + torch.atan(s * 3) + torch.atan2(s, ((q - kv) % 5 - 2) * 0.25) * 0.5,
    "asin_acos": lambda s, b, h, q, kv: s + torch.asin(torch.tanh(s)) * 0.5 + torch.acos(torch.sigmoid(s) * 2 - 1) * 0.3,
    "tan_sinh_cosh": lambda s, b, h, q, kv: s + torch.tan(s * 0.3) * 0.5 + torch.sinh(s * 0.5) * 0.2 - torch.cosh(
        s * 0.3) * 0.1,
    "atan2_special_values": lambda s, b, h, q, kv: s + torch.atan2(_SPECIAL[q % 9], _SPECIAL[kv % 9]) + torch.atan(
        _SPECIAL[(q + kv) % 9]) * 0.5 + torch.asin(_ENDS[q % 5]) * 0.3 + torch.acos(_ENDS[kv % 5]) * 0.2,
    # y and x both 0 where q == kv: atan2's gradient 0 there (torch's), not 0 / 0
    "atan2_at_the_origin": lambda s, b, h, q, kv: s + torch.atan2(s * (q != kv), (q - kv) * 0.5),
    "arc_aliases_and_methods": lambda s, b, h, q, kv: s + torch.arctan(s) * 0.3 + s.atan() * 0.2 + torch.arcsin(
        torch.tanh(s)) * 0.1 + s.sinh() * 0.1 + torch.arctan2(s, torch.ones_like(s)) * 0.2 + torch.arccos(
        torch.tanh(s)) * 0.1,
}


@pytest.mark.parametrize("name", sorted(MORE_OPS))
def test_more_elementwise_ops_and_the_arguments_dtypes(name):
    """Out, LSE and gradients against torch's for ops a score_mod may use, and the idioms reading the arguments'
    dtypes (constants while tracing: float32 scores, int32 indices, as the kernels hand them)."""
    fn = MORE_OPS[name]
    fn.__name__ = name
    _check(score_mod=fn)
    _check_gradients(fn, seed=7)


@pytest.mark.parametrize("mod", [lambda s, b, h, q_idx, kv_idx: torch.zeros_like(s),
                                 lambda s, b, h, q_idx, kv_idx: torch.full_like(s, 2.0),
                                 lambda s, b, h, q_idx, kv_idx: s.new_full((), -1.0)],
                         ids=["zeros_like", "full_like", "new_full"])
def test_a_mod_taking_only_the_scores_shape_is_broadcast_to_its_tile(mod):
    """(the forward kernel, L 128 past the short-query one: a constant made from the score's shape was taken for a
    read of the score, left 0-d, and the interpreter failed on its row reductions)"""
    _check(score_mod=mod, L=128)


def test_a_branch_on_the_scores_dtype_takes_the_kernels_float32():
    def mod(s, b, h, q_idx, kv_idx):
        return s * 2.0 if s.dtype == torch.float32 else s

    def float32_branch(s, b, h, q_idx, kv_idx):
        return s * 2.0
    q, k, v = rand_qkv(B, H, H, L, L, D, seed=8)
    assert_close(flex_attention(q, k, v, score_mod=mod), attention_reference(q, k, v, score_mod=float32_branch)[0],
                 *TOLERANCES[torch.float32])


def _attention_gym_tanh():
    """attention-gym's softcap operator, "approx::tanh" (tanh.approx.f32 in its inductor lowering; torch.tanh
    in torch), registered as it registers it."""
    if not hasattr(torch.ops.approx, "tanh"):
        global _APPROX_LIB
        _APPROX_LIB = torch.library.Library("approx", "FRAGMENT")
        _APPROX_LIB.define("tanh(Tensor inp) -> Tensor")
        _APPROX_LIB.impl("tanh", torch.tanh, "CompositeExplicitAutograd")
    return torch.ops.approx.tanh


def test_attention_gyms_approx_tanh_is_tanh_approx():
    """attention-gym's ``generate_tanh_softcap(cap, approx=True)`` calls torch.ops.approx.tanh: it lowers as
    flexlite's tanh_approx (forward, its gradient, the bounded softmax), not an untraceable op. Compared with
    flexlite's own approx softcap, which runs the same kernels (tanh.approx.f32 on a GPU, whose error is beyond the
    fp32 tolerances against the exact reference: test_backward's softcap tests check it against the reference)."""
    from flexlite.mods import generate_tanh_softcap
    approx_tanh = _attention_gym_tanh()

    def gym_softcap(score, b, h, q_idx, kv_idx):
        return 20.0 * approx_tanh(score / 20.0)
    q, k, v = (t.requires_grad_() for t in rand_qkv(B, H, H, L, L, D, seed=9))
    out = flex_attention(q * 8, k, v, score_mod=gym_softcap)
    want = flex_attention(q * 8, k, v, score_mod=generate_tanh_softcap(20.0, approx=True))
    assert_close(out, want, *TOLERANCES[torch.float32])
    grad = torch.randn_like(out)
    for n, g, w in zip(("dq", "dk", "dv"), torch.autograd.grad(out, (q, k, v), grad),
                       torch.autograd.grad(want, (q, k, v), grad)):
        assert_grad_close(g, w.double(), name=n)
    from flexlite import kernel_source
    assert "tanh_approx(" in kernel_source(gym_softcap, None, device=DEVICE)


def test_an_operator_without_a_lowering_is_named_by_its_qualified_name():
    lib = torch.library.Library("flexlite_test_ns", "FRAGMENT")
    lib.define("twice(Tensor x) -> Tensor")
    lib.impl("twice", lambda x: x * 2, "CompositeExplicitAutograd")

    def mod(score, b, h, q_idx, kv_idx):
        return torch.ops.flexlite_test_ns.twice(score)
    q, k, v = rand_qkv(B, H, H, L, L, D)
    with pytest.raises(UntraceableModError, match="no lowering for the operator 'flexlite_test_ns::twice'"):
        flex_attention(q, k, v, score_mod=mod)


@pytest.mark.parametrize("mod, message", [
    (lambda s, b, h, q_idx, kv_idx: torch.max(s), r"torch\.max is called with arguments its lowering does not take "
                                                   r"\(1 positional, keywords none\)"),
    (lambda s, b, h, q_idx, kv_idx: torch.where(q_idx >= kv_idx, s, other=s * 2),
     r"torch\.where is called with .*keywords \['other'\]\); pass its tensors positionally"),
    (lambda s, b, h, q_idx, kv_idx: math.exp(s), r"no lowering for math\.exp \(math's functions take Python numbers: "
                                                 r"use torch\.exp\)")], ids=["max_of_one", "where_other", "math_exp"])
def test_calls_a_lowering_cannot_take_are_named(mod, message):
    """(before: a ValueError from unpacking the arguments, or math.exp named as exp, as if torch.exp were missing)"""
    with pytest.raises(UntraceableModError, match=message):
        flex_attention(*rand_qkv(B, H, H, L, L, D), score_mod=mod)


@pytest.mark.parametrize("mod", [lambda s, b, h, q_idx, kv_idx: s * (1 + 5 * torch.rand(())),
                                 lambda s, b, h, q_idx, kv_idx: s + torch.randn_like(s),
                                 lambda s, b, h, q_idx, kv_idx: s + torch.empty(()).uniform_()],
                         ids=["rand", "randn_like", "uniform_"])
def test_random_numbers_in_a_mod_are_refused(mod):
    """A draw made while tracing would be a constant of the trace (one value for every position, another at each
    retrace): refused, as torch's flex_attention refuses random ops under its vmap; a tensor constant is fine."""
    q, k, v = rand_qkv(B, H, H, L, L, D)
    with pytest.raises(UntraceableModError, match="random numbers inside a mod are not supported"):
        flex_attention(q, k, v, score_mod=mod)
    with pytest.raises(UntraceableModError, match="calls rand"):
        create_block_mask(lambda b, h, q_idx, kv_idx: torch.rand(()) < 0.5, None, None, L, L, device=DEVICE)
    half = flex_attention(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s * torch.tensor(0.5))
    assert_close(half, attention_reference(q * 0.5, k, v)[0], *TOLERANCES[torch.float32])


@pytest.mark.parametrize("mod, mask", [
    (lambda s, b, h, q_idx, kv_idx: s + torch.as_tensor(q_idx - kv_idx, dtype=torch.float32) * 0.1,
     lambda b, h, q_idx, kv_idx: torch.as_tensor(q_idx) >= kv_idx),
    (lambda s, b, h, q_idx, kv_idx: torch.as_tensor(s) * 0.5 + torch.as_tensor(h).float(),
     lambda b, h, q_idx, kv_idx: torch.as_tensor(data=q_idx - kv_idx) < 40)], ids=["distance", "score_and_head"])
def test_torch_as_tensor_of_a_traced_value_is_that_value(mod, mask):
    """torch.as_tensor(x) of a mod's value is x (in the dtype asked), as torch's flex_attention takes it (before: a
    TypeError from torch.fx's proxy), in a score_mod and a mask_mod; out, LSE and the gradients the reference's."""
    q, k, v = (t.requires_grad_() for t in rand_qkv(B, H, H, L, L, D))
    bm = create_block_mask(mask, None, None, L, L, device=DEVICE, BLOCK_SIZE=16)
    out, lse = flex_attention(q, k, v, score_mod=mod, block_mask=bm, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, score_mod=mod, block_mask=bm)
    assert_close(out, ref, *TOLERANCES[torch.float32])
    assert_close(lse, ref_lse, *TOLERANCES[torch.float32], name="lse")
    assert_grads_like_reference(out, ref, (q, k, v))


@pytest.mark.parametrize("mod", [lambda s, b, h, q_idx, kv_idx: s + torch.tensor(kv_idx, dtype=torch.float32),
                                 lambda s, b, h, q_idx, kv_idx: s + torch.as_tensor([q_idx, kv_idx]).sum(),
                                 lambda s, b, h, q_idx, kv_idx: s + torch.tensor((h, 1)).float().mean()],
                         ids=["tensor_of_a_value", "as_tensor_of_a_list", "tensor_of_a_tuple"])
def test_a_tensor_built_from_traced_values_is_refused_with_what_to_write(mod):
    """torch.tensor of a traced value (a copy, which torch's vmap cannot make of its values either), or either of a
    list of them: an UntraceableModError that names the call and what to write instead."""
    with pytest.raises(UntraceableModError, match=r"calls torch\.(tensor|as_tensor) on its traced values: use the "
                                                  r"value itself"):
        flex_attention(*rand_qkv(B, H, H, L, L, D), score_mod=mod)


def test_a_mod_that_checks_for_tensors_is_warned_about_its_proxies():
    """Traced, a mod's values are torch.fx proxies: isinstance(x, torch.Tensor) is False there, where torch's vmapped
    tensors say True, so a branch on it is traced down its other side. A mod whose code reads isinstance and Tensor
    gets a UserWarning that says so (once: its trace is kept); other mods none."""
    def checks(score, b, h, q_idx, kv_idx):
        return score * 2 if isinstance(score, torch.Tensor) else score

    def plain(score, b, h, q_idx, kv_idx):
        return score * 2

    with pytest.warns(UserWarning, match=r"isinstance\(x, torch\.Tensor\) is False there"):
        trace_mod(checks, "score_mod")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trace_mod(plain, "score_mod")
        trace_mod(checks, "score_mod")  # (kept: not traced, nor warned, again)


@pytest.mark.parametrize("mod", [lambda s, b, h, q_idx, kv_idx: s * np.float32(0.5),
                                 lambda s, b, h, q_idx, kv_idx: np.float32(0.5) * s + np.float16(1.5),
                                 lambda s, b, h, q_idx, kv_idx: torch.where(np.int64(3) <= q_idx, s, -s)],
                         ids=["right", "left", "compare"])
def test_numpy_scalars_in_a_mod_are_python_numbers(mod):
    """As torch takes them: a numpy scalar (np.float32(0.5), np.int64(3)) is a Python number of the trace, on either
    side of an operation (on the left numpy would take the traced value for an array)."""
    q, k, v = rand_qkv(B, H, H, L, L, D)
    assert_close(flex_attention(q, k, v, score_mod=mod), attention_reference(q, k, v, score_mod=mod)[0],
                 *TOLERANCES[torch.float32])


def test_a_dot_product_per_score_is_refused_with_the_concatenation_that_computes_it():
    # MLA's rope term (attention-gym's latent attention): a product of two vectors per score has no lowering; the
    # error's fix, the vectors concatenated onto q and k with the scale passed, computes what the mod meant
    Hq, R = 2, 8
    q, k, v = rand_qkv(1, Hq, 1, L, L, D, seed=11)
    g = torch.Generator().manual_seed(12)
    q_rope = torch.randn(1, Hq, L, R, generator=g).to(DEVICE)
    k_rope = torch.randn(1, 1, L, R, generator=g).to(DEVICE)

    def mla_rope(score, b, h, q_idx, kv_idx):
        return score + torch.dot(q_rope[b, h, q_idx], k_rope[b, 0, kv_idx])

    def mla_rope_sum(score, b, h, q_idx, kv_idx):
        return score + (q_rope[b, h, q_idx] * k_rope[b, 0, kv_idx]).sum()

    for mod in (mla_rope, mla_rope_sum):
        with pytest.raises(UntraceableModError, match=r"torch\.cat\(\[q, q_rope / scale\], -1\)"):
            flex_attention(q, k, v, score_mod=mod, enable_gqa=True)
    scale = D ** -0.5
    out = flex_attention(torch.cat([q, q_rope / scale], -1), torch.cat([k, k_rope], -1), v, scale=scale,
                         enable_gqa=True)
    want = attention_reference(q, k.expand(1, Hq, L, D), v.expand(1, Hq, L, D), score_mod=mla_rope, scale=scale)[0]
    assert_close(out, want, *TOLERANCES[torch.float32])
