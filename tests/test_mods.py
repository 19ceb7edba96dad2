"""flexlite.mods: each score_mod against a direct formula (dense bias + softmax written here) and against
the fp64 reference through flex_attention (CPU: Triton's interpreter); learnable captured tensors get
their gradients; argument checks."""

from __future__ import annotations

import math

import pytest
import torch

from flexlite import attention_reference, create_block_mask, flex_attention
from flexlite._vmap import index_vectors, vmap_bhqkv
from flexlite.codegen.trace import trace_mod
from flexlite.masks import causal_mask
from flexlite.mods import (alibi_slopes, generate_alibi_bias, generate_head_bias, generate_relative_bias,
                           generate_tanh_softcap)
from helpers import DEVICE, LSE_TOLERANCES, TOLERANCES, assert_close, assert_grad_close, rand_qkv

H = 4


def _table(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (0.5 * torch.randn(*shape, generator=g)).to(DEVICE)


def rel_index(Lq, Lkv, L):
    q = torch.arange(Lq)[:, None]
    kv = torch.arange(Lkv)[None, :]
    return (q - kv + L - 1).clamp(0, 2 * L - 2)


# (id, score_mod factory, formula(scores [B, H, Lq, Lkv] fp64) -> modified scores)
def _alibi_formula(s):
    Lq, Lkv = s.shape[-2:]
    slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)], dtype=torch.float64)
    dist = (torch.arange(Lkv)[None, :] - torch.arange(Lq)[:, None]).double()
    return s + slopes[:, None, None] * dist


TABLE_2D = _table(H, 2 * 40 - 1, seed=1)   # L = 40: shorter than the sequences, so the clamp is used
TABLE_1D = _table(2 * 128 - 1, seed=2)
HEAD_BIAS = _table(H, seed=3)

MODS = [
    pytest.param(lambda: generate_alibi_bias(H, device=DEVICE), _alibi_formula, id="alibi"),
    pytest.param(lambda: generate_tanh_softcap(1.5), lambda s: 1.5 * torch.tanh(s / 1.5), id="softcap_approx"),
    pytest.param(lambda: generate_tanh_softcap(1.5, approx=False), lambda s: 1.5 * torch.tanh(s / 1.5),
                 id="softcap_exact"),
    pytest.param(lambda: generate_relative_bias(TABLE_2D),
                 lambda s: s + TABLE_2D.cpu().double()[:, rel_index(*s.shape[-2:], 40)], id="relative_bias_per_head"),
    pytest.param(lambda: generate_relative_bias(TABLE_1D),
                 lambda s: s + TABLE_1D.cpu().double()[rel_index(*s.shape[-2:], 128)], id="relative_bias_shared"),
    pytest.param(lambda: generate_head_bias(HEAD_BIAS), lambda s: s + HEAD_BIAS.cpu().double()[:, None, None],
                 id="head_bias"),
]
# (B, Lq, Lkv, causal): cross lengths with the causal block mask, equal lengths without a mask
SHAPES = [pytest.param((1, 100, 100, False), id="B1-L100"),
          pytest.param((2, 77, 128, True), id="B2-Lq77-Lkv128-causal")]


def direct_attention(q, k, v, formula, mask=None):
    """softmax(formula(q k^T / sqrt(D)) [masked]) v in fp64, written out: the formula's own attention."""
    q, k, v = q.cpu().double(), k.cpu().double(), v.cpu().double()
    s = formula(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.softmax(s, dim=-1) @ v, lse


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("make, formula", MODS)
def test_score_mod_forward(make, formula, shape):
    """flex_attention (kernels) vs the fp64 reference vs the formula."""
    B, Lq, Lkv, causal = shape
    mod = make()
    q, k, v = rand_qkv(B, H, H, Lq, Lkv, 32, seed=Lq)
    bm = create_block_mask(causal_mask, None, None, Lq, Lkv, device=DEVICE, BLOCK_SIZE=32) if causal else None
    dense_mask = torch.ones(Lq, Lkv, dtype=torch.bool).tril() if causal else None
    out, lse = flex_attention(q, k, v, score_mod=mod, block_mask=bm, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, score_mod=mod, block_mask=bm)
    direct, direct_lse = direct_attention(q, k, v, formula, dense_mask)
    assert_close(ref, direct, 1e-10, 1e-10, name="reference vs formula")
    assert_close(ref_lse, direct_lse, 1e-10, 1e-10, name="reference lse vs formula")
    assert_close(out, ref, *TOLERANCES[torch.float32], name="flex_attention out")
    assert_close(lse, ref_lse, *LSE_TOLERANCES[torch.float32], name="flex_attention lse")


@pytest.mark.parametrize("make, formula", MODS)
def test_score_mod_values(make, formula):
    """The mod itself, evaluated at every (b, h, q, kv) with vmap, against the formula."""
    scores = torch.randn(2, H, 9, 50, dtype=torch.float64).to(DEVICE)
    got = vmap_bhqkv(make(), prefix=(0,))(scores, *index_vectors(2, H, 9, 50, DEVICE))
    assert_close(got, formula(scores.cpu()), 1e-6, 1e-6)


def test_alibi_slopes():
    assert alibi_slopes(8).tolist() == [2.0 ** -i for i in range(1, 9)]
    assert alibi_slopes(4).tolist() == [2.0 ** (-2 * i) for i in range(1, 5)]


def _paper_slopes(n: int) -> list:
    """The ALiBi paper's reference get_slopes (ofirpress/attention_with_linear_biases), as BLOOM builds them."""
    def power_of_2(n):
        start = 2 ** (-2 ** -(math.log2(n) - 3))
        return [start * start ** i for i in range(n)]
    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + _paper_slopes(2 * closest)[0::2][:n - closest]


@pytest.mark.parametrize("heads", [1, 2, 3, 5, 6, 12, 16, 20, 40, 96])
def test_interleaved_alibi_slopes_are_the_papers_for_any_head_count(heads):
    """interleaved=True: the paper's slopes (BLOOM's, MPT's) where the head count is not a power of two; the default
    stays attention-gym's 2^(-8 h / H), equal to them for powers of two."""
    got = alibi_slopes(heads, interleaved=True)
    assert got.dtype == torch.float32 and got.shape == (heads,)
    assert torch.allclose(got.double(), torch.tensor(_paper_slopes(heads), dtype=torch.float64), rtol=1e-6, atol=0)
    gym = [2.0 ** (-8.0 * h / heads) for h in range(1, heads + 1)]
    assert torch.allclose(alibi_slopes(heads).double(), torch.tensor(gym, dtype=torch.float64), rtol=1e-6, atol=0)
    assert torch.equal(got, alibi_slopes(heads)) == (heads & (heads - 1) == 0)


def test_interleaved_must_be_a_bool():
    with pytest.raises(TypeError, match="alibi_slopes: interleaved must be a bool"):
        alibi_slopes(6, interleaved="yes")


def test_softcap_approx_is_the_flexlite_op():
    """approx=True keeps flexlite::tanh_approx as one node (the GPU lowering picks tanh.approx.f32)."""
    def targets(mod):
        return {str(n.target) for n in trace_mod(mod, "score_mod").graph_module.graph.nodes}
    assert any("tanh_approx" in t for t in targets(generate_tanh_softcap(30.0)))
    assert not any("tanh_approx" in t for t in targets(generate_tanh_softcap(30.0, approx=False)))
    assert generate_tanh_softcap(30.0).__name__ == "tanh_softcap_30_approx"
    assert generate_tanh_softcap(50.0, approx=False).__name__ == "tanh_softcap_50"


def test_relative_bias_clamps_far_distances():
    table = torch.arange(5, dtype=torch.float32)  # L = 3: distances -2..2
    mod = generate_relative_bias(table)
    got = vmap_bhqkv(mod, prefix=(0,))(torch.zeros(1, 1, 6, 6), *index_vectors(1, 1, 6, 6, "cpu"))[0, 0]
    expected = (torch.arange(6)[:, None] - torch.arange(6)[None, :] + 2).clamp(0, 4).float()
    assert got.equal(expected)
    assert mod.__name__ == "relative_bias_3"
    assert generate_relative_bias(torch.zeros(2, 7)).__name__ == "relative_bias_4_per_head"


def test_head_bias_shifts_only_the_lse():
    q, k, v = rand_qkv(1, H, H, 100, 100, 16)
    out, lse = flex_attention(q, k, v, score_mod=generate_head_bias(HEAD_BIAS), return_lse=True)
    out0, lse0 = flex_attention(q, k, v, return_lse=True)
    assert_close(out, out0, 1e-5, 1e-5)
    assert_close(lse - lse0, HEAD_BIAS[None, :, None].expand_as(lse), 1e-5, 1e-5, name="lse shift")


@pytest.mark.parametrize("which", ["relative_bias", "head_bias", "alibi_slopes"])
def test_learnable_captured_tensor_gradients(which):
    """Tables and slopes that require grad get the reference's gradients through flex_attention."""
    param = {"relative_bias": _table(H, 2 * 64 - 1, seed=4), "head_bias": _table(H, seed=5),
             "alibi_slopes": alibi_slopes(H, device=DEVICE)}[which].clone().requires_grad_()
    mod = {"relative_bias": lambda: generate_relative_bias(param), "head_bias": lambda: generate_head_bias(param),
           "alibi_slopes": lambda: generate_alibi_bias(H, slopes=param)}[which]()
    q, k, v = rand_qkv(1, H, H, 64, 64, 16)
    g = torch.Generator().manual_seed(6)
    w_out, w_lse = torch.randn(1, H, 64, 16, generator=g).to(DEVICE), torch.randn(1, H, 64, generator=g).to(DEVICE)
    bm = create_block_mask(causal_mask, None, None, 64, 64, device=DEVICE, BLOCK_SIZE=32)
    out, lse = flex_attention(q, k, v, score_mod=mod, block_mask=bm, return_lse=True)
    ((out * w_out).sum() + (lse * w_lse).sum()).backward()
    got, param.grad = param.grad, None
    ref, ref_lse = attention_reference(q, k, v, score_mod=mod, block_mask=bm)
    ((ref * w_out).sum() + (ref_lse * w_lse).sum()).backward()
    assert_grad_close(got, param.grad, name=f"d{which}")


BAD_ARGS = [
    (generate_alibi_bias, (0,), ValueError, "num_heads"),
    (generate_alibi_bias, (4.0,), TypeError, "num_heads"),
    (lambda: generate_alibi_bias(4, slopes=torch.ones(3)), (), ValueError, "slopes"),
    (lambda: generate_alibi_bias(4, slopes=torch.ones(4, dtype=torch.int32)), (), TypeError, "slopes"),
    (generate_tanh_softcap, (0.0,), ValueError, "cap"),
    (generate_tanh_softcap, ("30",), TypeError, "cap"),
    (generate_tanh_softcap, (30.0, 1), TypeError, "approx"),
    (generate_relative_bias, (torch.zeros(4, 8),), ValueError, "table"),
    (generate_relative_bias, (torch.zeros(2, 3, 5),), ValueError, "table"),
    (generate_relative_bias, (torch.zeros(5, dtype=torch.int64),), TypeError, "table"),
    (generate_relative_bias, ([0.0, 1.0, 2.0],), TypeError, "table"),
    (generate_head_bias, (torch.zeros(4, 1),), ValueError, "bias"),
    (generate_head_bias, (3.0,), TypeError, "bias"),
    (generate_head_bias, (torch.zeros(0),), ValueError, "bias"),
]


@pytest.mark.parametrize("make", [lambda n: generate_alibi_bias(n, device=DEVICE),
                                  lambda n: generate_head_bias(torch.zeros(n, device=DEVICE)),
                                  lambda n: generate_relative_bias(torch.zeros(n, 7, device=DEVICE))],
                         ids=["alibi", "head_bias", "relative_bias_per_head"])
def test_a_per_head_mod_for_other_heads_is_an_error(make):
    """A per-head table with fewer (or more) rows than the query's heads would read 0 past its end (flexlite's
    out-of-range reads): the library's mods know their head count, and flex_attention checks it."""
    q, k, v = rand_qkv(1, 4, 2, 32, 32, 16)
    with pytest.raises(ValueError, match=r"made for 2 heads .* but query has 4; make it for 4 heads"):
        flex_attention(q, k, v, score_mod=make(2), enable_gqa=True)
    out = flex_attention(q, k, v, score_mod=make(4), enable_gqa=True)
    assert_close(out, attention_reference(q, k, v, score_mod=make(4), enable_gqa=True)[0], *TOLERANCES[torch.float32])


@pytest.mark.parametrize("factory, args, exc, match", BAD_ARGS,
                         ids=[f"{getattr(f, '__name__', 'f')}-{m}-{i}" for i, (f, _, _, m) in enumerate(BAD_ARGS)])
def test_bad_arguments(factory, args, exc, match):
    with pytest.raises(exc, match=match):
        factory(*args)


def test_tanh_approx_in_torch_is_tanh_and_cheap_to_call_first():
    """flexlite.ops.tanh_approx outside the kernels: tanh, its gradient and under vmap (nested, as the reference and
    flexlite.eager evaluate mods), and its first call in a process imports nothing (a torch.library.custom_op
    imported torch._dynamo there: ~5 s on a GPU host, paid by a softcap's first call in torch ops)."""
    import subprocess
    import sys

    from flexlite.ops import tanh_approx

    x = torch.randn(3, 5, 7, dtype=torch.float64, requires_grad=True)
    y = torch.vmap(torch.vmap(lambda s: 30.0 * tanh_approx(s / 30.0)))(x)
    assert torch.equal(y, 30.0 * torch.tanh(x / 30.0))
    (g,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(g, 1 - torch.tanh(x / 30.0) ** 2)
    code = ("import sys, torch, flexlite; from flexlite.ops import tanh_approx; before = set(sys.modules); "
            "tanh_approx(torch.ones(2)); torch.vmap(tanh_approx)(torch.ones(2, 2)); "
            "print(sorted(set(sys.modules) - before))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]"
