"""flex_attention backward vs the fp64 reference (torch autograd through attention_reference): catalog
mods x shapes x dtypes, gradients through the LSE and into captured tensors, a finite-difference check,
score_mod derivative rules, and the edge cases (fully masked rows, strides, head dims, errors)."""

import operator
import zlib

import pytest
import torch

from catalog import CATALOG, USES_BH
from flexlite import (BlockMask, UntraceableModError, attention_reference, create_block_mask, first_calls,
                      flex_attention)
from flexlite.codegen import grad
from flexlite.codegen.trace import trace_mod
from helpers import DEVICE, DTYPES, TOLERANCES, assert_close, assert_grad_close, rand_qkv

# (B, Hq, Hkv, Lq, Lkv, D)
SHAPES = [
    pytest.param((1, 1, 1, 1, 1, 32), id="B1-H1-L1-D32"),
    pytest.param((1, 2, 2, 63, 63, 64), id="B1-H2-L63-D64"),
    pytest.param((1, 2, 2, 111, 200, 80), id="B1-H2-Lq111-Lkv200-D80"),
    pytest.param((1, 4, 2, 200, 111, 32), id="B1-H4-Hkv2-Lq200-Lkv111-D32-gqa"),
]
DETERMINISTIC_ENV = "FLEXLITE_DETERMINISTIC_CAPTURED_GRADS"


def _seed(*key) -> int:
    return zlib.crc32(repr(key).encode()) % 10_000


def check_backward(q, k, v, score_mod=None, block_mask=None, enable_gqa=False, captured=(), lse_weight=None,
                   grad_out=None, dtype=None, name="", seed=0, kernel_options=None):
    """flex_attention's gradients of sum(out * grad_out) (+ sum(lse * lse_weight)) w.r.t. q, k, v and
    ``captured`` against the fp64 reference's; returns flexlite's gradients."""
    dtype = dtype or q.dtype
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=enable_gqa,
                              return_lse=True, kernel_options=kernel_options)
    if grad_out is None:
        g = torch.Generator().manual_seed(seed)
        grad_out = torch.randn(out.shape, generator=g).to(device=out.device, dtype=out.dtype)
    inputs = (q, k, v, *captured)

    def loss(o, l):
        total = (o * grad_out.to(o.dtype)).sum()
        if lse_weight is not None:  # fully masked rows have lse -inf: leave them out of the loss
            total = total + torch.where(torch.isinf(l), 0.0, l * lse_weight.to(l.dtype)).sum()
        return total

    grads = torch.autograd.grad(loss(out, lse), inputs)
    ref_out, ref_lse = attention_reference(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                           enable_gqa=enable_gqa)
    ref_grads = torch.autograd.grad(loss(ref_out, ref_lse), inputs, allow_unused=True)
    names = ["dq", "dk", "dv"] + [f"d(captured {i})" for i in range(len(captured))]
    for i, (n, a, r, t) in enumerate(zip(names, grads, ref_grads, inputs)):
        r = torch.zeros_like(t, dtype=torch.float64) if r is None else r
        # a float32 capture's gradient is only as precise as the (maybe half-precision) attention inputs
        tolerance = t.dtype if i < 3 or t.element_size() <= q.element_size() else q.dtype
        assert_grad_close(a, r, t.dtype, f"{name} {n}", tolerance)
    return grads


def block_mask_for(name, case, B, H, Lq, Lkv, block_size=128):
    if case.mask_mod is None:
        return None
    mb, mh = (B, H) if name in USES_BH else (None, None)
    return create_block_mask(case.mask_mod, mb, mh, Lq, Lkv, device=DEVICE, BLOCK_SIZE=block_size)


def run_catalog(name, shape, dtype, block_size=128, lse_weight=False):
    B, Hq, Hkv, Lq, Lkv, D = shape
    case = CATALOG[name](B, Hq, Lq, Lkv, DEVICE)
    q, k, v = rand_qkv(B, Hq, Hkv, Lq, Lkv, D, dtype=dtype, seed=_seed(name, shape))
    bm = block_mask_for(name, case, B, Hq, Lq, Lkv, block_size)
    weight = torch.randn(B, Hq, Lq, generator=torch.Generator().manual_seed(7)).to(DEVICE) if lse_weight else None
    return check_backward(q, k, v, case.score_mod, bm, Hq != Hkv, lse_weight=weight, name=name,
                          seed=_seed(name, shape, dtype))


# ---------------------------------------------------------------------------------------------
# dq, dk, dv

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", sorted(CATALOG))
def test_catalog(name, shape, dtype):
    run_catalog(name, shape, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["full", "alibi_causal", "softcap_causal", "fully_masked_rows"])
def test_grad_through_lse(name, dtype):
    run_catalog(name, (1, 2, 2, 111, 200, 32), dtype, lse_weight=True)


def test_only_lse_used():
    q, k, v = (t.requires_grad_() for t in rand_qkv(1, 2, 2, 50, 70, 32))
    _, lse = flex_attention(q, k, v, return_lse=True)
    grads = torch.autograd.grad(lse.sum(), (q, k, v))
    _, ref_lse = attention_reference(q, k, v)
    ref_dq, ref_dk = torch.autograd.grad(ref_lse.sum(), (q, k))
    assert_grad_close(grads[0], ref_dq, torch.float32, "dq")
    assert_grad_close(grads[1], ref_dk, torch.float32, "dk")
    assert torch.equal(grads[2], torch.zeros_like(grads[2]))  # lse does not depend on v


@pytest.mark.parametrize("opts", [dict(BLOCK_M1=16, BLOCK_N1=32, BLOCK_M2=32, BLOCK_N2=16),
                                  dict(BLOCK_M1=64, BLOCK_N1=16, num_warps=8, WRITE_DQ=True)], ids=str)
def test_kernel_options_pin_backward_tiles(opts):
    score_mod, captured = _learnable(1, 2, 111, 90, "bias_table")
    q, k, v = rand_qkv(1, 2, 2, 111, 90, 32)
    bm = create_block_mask(CATALOG["causal"](1, 2, 111, 90, DEVICE).mask_mod, None, None, 111, 90, device=DEVICE)
    check_backward(q, k, v, score_mod, bm, captured=captured, kernel_options=opts)


@pytest.mark.parametrize("shape", [pytest.param((2, 2, 2, 256, 128, 64), id="even-L256-128"),
                                   pytest.param((1, 2, 1, 128, 384, 32), id="even-mqa")])
@pytest.mark.parametrize("name", ["causal", "alibi_causal", "per_batch_head"])
def test_divisible_lengths(name, shape):
    run_catalog(name, shape, torch.float32)


@pytest.mark.parametrize("name", ["full", "causal"])
def test_lengths_divisible_by_tile_but_shorter_than_sparse_block(name):
    # tiles of the 128 sparse block past the sequence must be skipped, not read unchecked (EVEN_M/N)
    run_catalog(name, (1, 2, 1, 64, 32, 64), torch.float32)


@pytest.mark.parametrize("block_size", [(32, 64), (16, 16), (256, 128), (48, 80)], ids=str)
@pytest.mark.parametrize("name", ["causal", "document", "per_batch_head"])
def test_block_sizes(name, block_size):
    run_catalog(name, (1, 2, 2, 100, 90, 32), torch.float32, block_size=block_size)


@pytest.mark.parametrize("name", ["causal", "per_batch_head"])
def test_key_value_of_batch_one_shared_by_the_batch(name):
    """key / value of batch 1 with a query batch of 3 (torch's broadcast; GQA too): out and the gradients (dK / dV
    summed over the batch) are the reference's; the decode kernel (two queries) reads them the same way."""
    B, Hq, Hkv, Lq, Lkv = 3, 4, 2, 70, 90
    case = CATALOG[name](B, Hq, Lq, Lkv, DEVICE)
    mb, mh = (B, Hq) if name in USES_BH else (None, None)
    bm = create_block_mask(case.mask_mod, mb, mh, Lq, Lkv, device=DEVICE)
    q = rand_qkv(B, Hq, Hkv, Lq, Lkv, 32, seed=6)[0]
    k, v = rand_qkv(1, Hq, Hkv, Lq, Lkv, 32, seed=7)[1:]
    dq, dk, dv = check_backward(q, k, v, block_mask=bm, enable_gqa=True, name=name)
    assert dk.shape == k.shape and dv.shape == v.shape
    bm2 = create_block_mask(case.mask_mod, mb, mh, 2, Lkv, device=DEVICE)
    out = flex_attention(q[:, :, :2], k, v, block_mask=bm2, enable_gqa=True, kernel_options={"DECODE": True})
    ref = attention_reference(q[:, :, :2], k, v, block_mask=bm2, enable_gqa=True)[0]
    assert_close(out, ref, *TOLERANCES[torch.float32])


@pytest.mark.parametrize("name", ["document", "per_batch_head"])
def test_block_mask_without_its_q_side(name, monkeypatch):
    """A BlockMask with no q side (from_kv_blocks(compute_q_blocks=False), as torch's): the backward transposes
    the kv side itself, once per kv side (not every backward), and its gradients are the reference's."""
    monkeypatch.setattr(first_calls, "ENABLED", False)  # (counts this call's own launches alone)
    import flexlite.api as api
    transposed = []
    real = api.q_sides
    monkeypatch.setattr(api, "q_sides", lambda *side: transposed.append(1) or real(*side))
    B, H, Lq, Lkv = 1, 2, 100, 90
    case = CATALOG[name](B, H, Lq, Lkv, DEVICE)
    bm = create_block_mask(case.mask_mod, B, H, Lq, Lkv, device=DEVICE, BLOCK_SIZE=(16, 32))
    bare = BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                                    BLOCK_SIZE=bm.BLOCK_SIZE, mask_mod=bm.mask_mod, seq_lengths=bm.seq_lengths,
                                    compute_q_blocks=False)
    assert bare.q_num_blocks is None and bare.full_q_indices is None
    check_backward(*rand_qkv(B, H, H, Lq, Lkv, 32, seed=4), block_mask=bare, name=name)
    check_backward(*rand_qkv(B, H, H, Lq, Lkv, 32, seed=5), block_mask=bare, name=name)
    assert transposed == [1]


@pytest.mark.parametrize("d, dv", [(16, 16), (1, 8), (24, 80), (96, 48), (256, 256)], ids=str)
def test_head_dims(d, dv):
    q, k, v = rand_qkv(1, 2, 2, 70, 90, d, dv, dtype=torch.float16, seed=d)
    case = CATALOG["softcap_causal"](1, 2, 70, 90, DEVICE)
    bm = create_block_mask(case.mask_mod, None, None, 70, 90, device=DEVICE)
    check_backward(q, k, v, case.score_mod, bm, name=f"d={d} dv={dv}")


def test_subset_of_inputs_requires_grad():
    q, k, v = rand_qkv(1, 2, 2, 40, 60, 32)
    k.requires_grad_()
    out = flex_attention(q, k, v)
    (dk,) = torch.autograd.grad(out.sum(), (k,))
    ref_out, _ = attention_reference(q, k, v)
    (ref_dk,) = torch.autograd.grad(ref_out.sum(), (k,))
    assert_grad_close(dk, ref_dk, torch.float32, "dk")
    v.requires_grad_()
    flex_attention(q, k, v).sum().backward()
    assert q.grad is None and k.grad is not None and v.grad is not None


def test_non_contiguous_inputs_and_grad_out():
    # [B, L, H, D] storage viewed as [B, H, L, D], a strided head-dim slice, a transposed grad_out
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 77, 3, 64, generator=g).transpose(1, 2)
    k = torch.randn(2, 90, 3, 128, generator=g).transpose(1, 2)[..., ::2]
    v = torch.randn(2, 3, 48, 90, generator=g).transpose(-1, -2)
    grad_out = torch.randn(2, 48, 77, 3, generator=g).permute(0, 3, 2, 1)
    assert not any(t.is_contiguous() for t in (q, k, v, grad_out))
    case = CATALOG["alibi_causal"](2, 3, 77, 90, DEVICE)
    bm = create_block_mask(case.mask_mod, None, None, 77, 90, device=DEVICE)
    check_backward(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), case.score_mod, bm, grad_out=grad_out.to(DEVICE))


def test_fully_masked_rows_get_zero_grads():
    q, k, v = (t.requires_grad_() for t in rand_qkv(1, 2, 2, 100, 100, 32))
    case = CATALOG["fully_masked_rows"](1, 2, 100, 100, DEVICE)
    bm = create_block_mask(case.mask_mod, None, None, 100, 100, device=DEVICE, BLOCK_SIZE=32)
    out, lse = flex_attention(q, k, v, block_mask=bm, return_lse=True)
    dq, dk, dv = torch.autograd.grad(out.sum() + torch.where(torch.isinf(lse), 0.0, lse).sum(), (q, k, v))
    rows = torch.arange(100) % 3 == 1
    assert not any(torch.isnan(t).any() for t in (dq, dk, dv))
    assert torch.equal(dq[:, :, rows], torch.zeros_like(dq[:, :, rows]))


@pytest.mark.parametrize("mod", [None, "learnable_bias"])
def test_everything_masked_gives_zero_grads(mod):
    # with a score_mod and its learnable table too, and the reference's gradients alike (it once vmapped score_mod
    # over no positions at all and raised)
    q, k, v = (t.requires_grad_() for t in rand_qkv(1, 1, 1, 64, 80, 16))
    table = torch.randn(64, generator=torch.Generator().manual_seed(2)).to(DEVICE).requires_grad_()

    def bias(score, b, h, q_idx, kv_idx):
        return score * 0.5 + table[q_idx]  # (a Python scalar: torch.vmap over no positions raised there)

    def nothing(b, h, q_idx, kv_idx):
        return q_idx < 0
    score_mod = bias if mod else None
    bm = create_block_mask(nothing, None, None, 64, 80, device=DEVICE)
    inputs = (q, k, v, table) if mod else (q, k, v)
    for out in (flex_attention(q, k, v, score_mod=score_mod, block_mask=bm),
                attention_reference(q, k, v, score_mod=score_mod, block_mask=bm)[0]):
        assert torch.equal(out, torch.zeros_like(out))
        grads = torch.autograd.grad(out.sum(), inputs, allow_unused=True)
        for t, g in zip(inputs, grads):
            assert g is None or torch.equal(g, torch.zeros_like(g)), t.shape
    check_backward(q.detach(), k.detach(), v.detach(), score_mod, bm, captured=[table] if mod else [])


def test_score_mod_ignoring_score():
    # the mod's derivative w.r.t. the score is 0: dq = dk = 0, dv still flows
    bias = torch.randn(2, 60, 70, generator=torch.Generator().manual_seed(1)).to(DEVICE)

    def bias_only(score, b, h, q_idx, kv_idx):
        return bias[h, q_idx, kv_idx]
    q, k, v = rand_qkv(1, 2, 2, 60, 70, 32)
    dq, dk, dv = check_backward(q, k, v, bias_only)
    assert torch.equal(dq, torch.zeros_like(dq)) and torch.equal(dk, torch.zeros_like(dk))


def test_finite_differences():
    """Central differences of the kernel's own forward (fp32, tiny case) against its backward."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=g).to(DEVICE) for _ in range(3))
    slopes = torch.tensor([0.3, -0.2]).to(DEVICE)
    grad_out = torch.randn(1, 2, 5, 4, generator=g).to(DEVICE)
    lse_weight = torch.randn(1, 2, 5, generator=g).to(DEVICE)

    def mod(score, b, h, q_idx, kv_idx):
        return 1.5 * torch.tanh(score / 1.5) + slopes[h] * (kv_idx - q_idx)

    def loss():
        out, lse = flex_attention(q, k, v, score_mod=mod, return_lse=True)
        return (out * grad_out).sum() + (lse * lse_weight).sum()

    for t in (q, k, v, slopes):
        t.requires_grad_()
    grads = torch.autograd.grad(loss(), (q, k, v, slopes))
    eps = 1e-2
    with torch.no_grad():
        for t, gt in zip((q, k, v, slopes), grads):
            for i in sorted({0, min(3, t.numel() - 1), t.numel() - 1}):
                flat = t.view(-1)
                old = flat[i].item()
                flat[i] = old + eps
                up = loss().item()
                flat[i] = old - eps
                down = loss().item()
                flat[i] = old
                fd = (up - down) / (2 * eps)
                assert abs(fd - gt.view(-1)[i].item()) <= 2e-3 * max(1.0, abs(fd)), (t.shape, i, fd, gt.view(-1)[i])


# ---------------------------------------------------------------------------------------------
# gradients of captured tensors

def _learnable(B, H, Lq, Lkv, kind, dtype=torch.float32):
    """(score_mod, [captured tensors that require grad]) for a learnable bias of the given kind."""
    g = torch.Generator().manual_seed(_seed(kind))
    if kind == "bias_table":  # relative position table, many (q, kv) per entry
        table = (0.5 * torch.randn(H, Lq + Lkv, generator=g)).to(DEVICE, dtype).requires_grad_()

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + table[h, q_idx - kv_idx + Lkv]
        return score_mod, [table]
    if kind == "alibi_slopes":  # one entry per head: the whole tile adds to one element
        slopes = torch.linspace(-0.2, 0.3, H).to(DEVICE, dtype).requires_grad_()

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx)
        return score_mod, [slopes]
    if kind == "bias_3d":  # one entry per position, in a product with the score, plus a 0-d temperature
        bias = torch.randn(H, Lq, Lkv, generator=g).to(DEVICE, dtype).requires_grad_()
        temp = torch.tensor(0.8).to(DEVICE, dtype).requires_grad_()

        def score_mod(score, b, h, q_idx, kv_idx):
            return torch.tanh(score * temp) * 2.0 + bias[h, q_idx, kv_idx]
        return score_mod, [bias, temp]
    if kind == "gate_and_scale":  # a gate read by a compare only (no gradient path: zero) beside a learnable scale
        gate = torch.tensor([1.0, -1.0] * H)[:H].to(DEVICE, dtype).requires_grad_()
        scale = torch.linspace(0.5, 1.5, H).to(DEVICE, dtype).requires_grad_()

        def score_mod(score, b, h, q_idx, kv_idx):
            return torch.where(gate[h] > 0, score * scale[h], score * 0.5)
        return score_mod, [gate, scale]
    if kind == "sqrt_bias":  # sqrt of a bias that is 0 where the mask drops the position: an infinite derivative there
        keep = (torch.arange(Lkv)[None, :] <= torch.arange(Lq)[:, None] + Lkv - Lq)  # causal_bottom_right's
        bias = (torch.rand(H, Lq, Lkv, generator=g) * keep).to(DEVICE, dtype).requires_grad_()

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + bias[h, q_idx, kv_idx].sqrt()
        return score_mod, [bias]
    raise ValueError(kind)


# (sqrt_bias: the gradients stay finite, the masked positions' 0, in the kernels and in the reference alike)
CAPTURED_KINDS = ["bias_table", "alibi_slopes", "bias_3d", "gate_and_scale", "sqrt_bias"]


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("kind", CAPTURED_KINDS)
def test_captured_grads(kind, deterministic, monkeypatch):
    monkeypatch.setenv(DETERMINISTIC_ENV, "1" if deterministic else "0")
    B, Hq, Hkv, Lq, Lkv = 2, 2, 1, 111, 75
    score_mod, captured = _learnable(B, Hq, Lq, Lkv, kind)
    q, k, v = rand_qkv(B, Hq, Hkv, Lq, Lkv, 32, seed=_seed(kind))
    bm = create_block_mask(CATALOG["causal_bottom_right"](B, Hq, Lq, Lkv, DEVICE).mask_mod, None, None, Lq, Lkv,
                           device=DEVICE, BLOCK_SIZE=32)
    weight = torch.randn(B, Hq, Lq, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    check_backward(q, k, v, score_mod, bm, enable_gqa=True, captured=captured, lse_weight=weight, name=kind)


def test_nn_parameter_bias_table_learns():
    # the usual way to hold a learnable bias: an nn.Parameter captured by the score_mod
    table = torch.nn.Parameter((0.5 * torch.randn(2, 64 + 80, generator=torch.Generator().manual_seed(9))).to(DEVICE))

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + 80]
    q, k, v = rand_qkv(1, 2, 2, 64, 80, 16, seed=9)
    check_backward(q, k, v, score_mod, captured=[table], name="nn.Parameter table")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_captured_grads_low_precision(dtype):
    score_mod, captured = _learnable(1, 2, 70, 90, "bias_table", dtype)
    q, k, v = rand_qkv(1, 2, 2, 70, 90, 32, dtype=dtype)
    check_backward(q, k, v, score_mod, captured=captured, name="bias_table")


def test_deterministic_captured_grads_are_bit_identical():
    score_mod, (table,) = _learnable(1, 2, 100, 120, "bias_table")
    q, k, v = rand_qkv(1, 2, 2, 100, 120, 32)
    bm = create_block_mask(CATALOG["sliding_window"](1, 2, 100, 120, DEVICE).mask_mod, None, None, 100, 120,
                           device=DEVICE, BLOCK_SIZE=32)

    def run(deterministic):
        out = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm,
                             kernel_options={"DETERMINISTIC_CAPTURED_GRADS": deterministic})
        return torch.autograd.grad(out.square().sum(), (table,))[0]
    first, second = run(True), run(True)
    assert torch.equal(first, second)
    assert_grad_close(run(False), first.double(), torch.float32, "atomic vs deterministic")


def test_torch_deterministic_mode_selects_deterministic_path():
    score_mod, captured = _learnable(1, 2, 40, 30, "alibi_slopes")
    q, k, v = rand_qkv(1, 2, 2, 40, 30, 16)
    enabled = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        check_backward(q, k, v, score_mod, captured=captured, name="use_deterministic_algorithms")
    finally:
        torch.use_deterministic_algorithms(enabled)


def test_mask_mod_captures_get_no_grad():
    doc = torch.tensor([0] * 30 + [1] * 30, dtype=torch.float32, device=DEVICE, requires_grad=True)

    def same_doc(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]
    q, k, v = (t.requires_grad_() for t in rand_qkv(1, 1, 1, 60, 60, 16))
    bm = create_block_mask(same_doc, None, None, 60, 60, device=DEVICE, BLOCK_SIZE=16)
    flex_attention(q, k, v, block_mask=bm).sum().backward()
    assert doc.grad is None and q.grad is not None


# ---------------------------------------------------------------------------------------------
# derivative rules (no kernels) and errors

_SCORE_MODS = {
    "softcap": lambda s, b, h, q, kv: 2.0 * torch.tanh(s / 2.0),
    "where_sigmoid_exp_abs": lambda s, b, h, q, kv: torch.where(
        q >= kv, torch.sigmoid(s) * torch.exp(s * 0.3) - s.abs(), s.clamp(-0.5, 0.7)),
    "pow_sqrt_rsqrt": lambda s, b, h, q, kv: (s ** 3 + 2.0 ** s + torch.sqrt(s * s + 1) + torch.rsqrt(s * s + 2)
                                              + s.pow(2)),
    "trig_erf_logs": lambda s, b, h, q, kv: (torch.sin(s) * torch.cos(s) + torch.erf(s) + torch.log(s * s + 1.0)
                                             + torch.log2(s * s + 1) + torch.exp2(s) + torch.log1p(s.abs())),
    "gelu": lambda s, b, h, q, kv: torch.nn.functional.gelu(s) + torch.nn.functional.gelu(s, approximate="tanh"),
    "min_max_relu": lambda s, b, h, q, kv: (torch.maximum(s, torch.zeros_like(s)) + torch.minimum(s, 0.3 * s)
                                            + torch.relu(s - 0.1) + torch.clamp_min(s, 0.2) + s.clamp(max=0.4)),
    "mod_fmod_floor": lambda s, b, h, q, kv: s % 0.7 + torch.fmod(s, 0.3) + torch.floor(s) + torch.expm1(s),
    "div_neg_sub": lambda s, b, h, q, kv: s / (1.0 + s * s) - 1.0 / (2.0 + s.abs()) - (-s),
    "casts_and_masks": lambda s, b, h, q, kv: s.float() * (q > kv) + torch.square(s) + (q - kv).float() / s.exp(),
    "ignores_score": lambda s, b, h, q, kv: (q - kv).float() * 0.1,
}


@pytest.mark.parametrize("name", sorted(_SCORE_MODS))
def test_score_grad_rules(name):
    """d score_mod / d score from grad.py's graph (run by torch) against torch autograd, incl. kinks."""
    fn = _SCORE_MODS[name]
    derivative = grad.score_grad_trace(trace_mod(fn, "score_mod")).graph_module
    b, h, q_idx, kv_idx = (torch.tensor(x, dtype=torch.int32) for x in (0, 1, 3, 2))
    for value in (-1.3, -0.2, 0.0, 0.2, 0.45, 2.1):
        s = torch.tensor(value, dtype=torch.float64, requires_grad=True)
        out = fn(s, b, h, q_idx, kv_idx)
        expected = torch.autograd.grad(out, s, allow_unused=True)[0] if out.requires_grad else None
        expected = 0.0 if expected is None else expected.item()
        got = float(derivative(s.detach().float(), b, h, q_idx, kv_idx))
        assert abs(got - expected) <= 1e-4 * (1 + abs(expected)), (value, got, expected)


def test_error_for_op_without_derivative_rule(monkeypatch):
    monkeypatch.delitem(grad.RULES, "erf")

    def erf_mod(score, b, h, q_idx, kv_idx):
        return torch.erf(score)
    q, k, v = (t.requires_grad_() for t in rand_qkv(1, 1, 1, 20, 20, 16))
    out = flex_attention(q, k, v, score_mod=erf_mod)  # the forward needs no derivative
    with pytest.raises(UntraceableModError, match=r"backward pass is not supported for `erf`"):
        out.sum().backward()
    with pytest.raises(NotImplementedError, match="lgamma"):
        grad.score_grad_trace(trace_mod(lambda s, b, h, q, kv: torch.lgamma(s), "score_mod"))
    # an op off the score's path needs no rule
    grad.score_grad_trace(trace_mod(lambda s, b, h, q, kv: s + torch.erf((q - kv).float()), "score_mod"))


def test_captured_grad_scatter_is_lowered_to_atomics():
    score_mod, captured = _learnable(1, 2, 8, 8, "alibi_slopes")
    traced = trace_mod(score_mod, "score_mod")
    target = next(n for n, t in traced.captured.items() if t is captured[0])
    trace, buffers = grad.captured_grad_trace(traced, (target,))
    from flexlite.codegen.lower import lower_mod
    source = lower_mod(trace, "score_mod_captured_grad", "sg_").source
    # slopes[h] is one element per tile: the tile is summed before its single atomic add
    assert "tl.atomic_add(" in source and "tl.sum(" in source and len(buffers) == 1


@pytest.mark.parametrize("op", [operator.add, torch.mul], ids=["add", "mul"])
def test_score_grad_trace_is_cached_per_mod(op):
    from flexlite.codegen.kernel import generate_backward

    def mod(score, b, h, q_idx, kv_idx):
        return op(score, 0.5)
    first = generate_backward(mod, None, interpret=True)
    assert generate_backward(mod, None, interpret=True).score_grad is first.score_grad


def test_every_float_op_has_a_derivative_rule():
    from flexlite.codegen.lower import OPS
    bool_or_int_ops = {"and", "or", "xor", "invert", "lshift", "rshift", "eq", "ne", "lt", "le", "gt", "ge",
                       "logical_and", "logical_or", "logical_xor", "logical_not"}
    assert set(OPS) - set(grad.RULES) <= bool_or_int_ops


def test_softcap_library_mod():
    from flexlite.mods.softcap import generate_tanh_softcap
    q, k, v = rand_qkv(1, 2, 2, 50, 70, 32)
    for approx in (True, False):
        check_backward(q, k, v, generate_tanh_softcap(2.0, approx=approx), name=f"approx={approx}")


def test_double_backward_is_an_error():
    # at create_graph=True already: the gradients would have no graph (a penalty on them would add nothing, silently)
    q, k, v = (t.requires_grad_() for t in rand_qkv(1, 1, 1, 20, 20, 16))
    with pytest.raises(NotImplementedError, match=r"backward is not differentiable again \(create_graph=True"):
        torch.autograd.grad(flex_attention(q, k, v).sum(), (q,), create_graph=True)


def test_fp32_capture_with_half_inputs_regression():
    # found by tests/test_fuzz.py: a float32 ALiBi slope learned from float16 attention inputs
    slopes = torch.tensor([0.4963]).to(DEVICE).requires_grad_()

    def alibi(s, b, h, q, kv):
        return s + slopes[h] * (kv - q) * 0.05
    q, k, v = rand_qkv(1, 1, 1, 1, 2, 16, dtype=torch.float16, seed=1)
    check_backward(q, k, v, alibi, captured=[slopes], seed=1, name="fp32 slope, fp16 inputs")


@pytest.mark.parametrize("use_tma", [None, True, False], ids=["default", "tma", "pointers"])
@pytest.mark.parametrize("masked", [False, True], ids=["no_block_mask", "block_mask"])
def test_backward_tensor_descriptor_loads(monkeypatch, masked, use_tma):
    """kernel_options USE_TMA switches the backward's walked-side loads (Q / dO for dK/dV, K / V for dQ) to tensor
    descriptors; by default they are used without a block mask only (launch.default_use_tma). Triton's
    interpreter runs descriptors too (tma_ok, which wants a Hopper GPU, is forced here); the gradients are the
    reference's either way, at ragged lengths, GQA and a head dim that is not a power of two."""
    from flexlite.runtime import launch

    used, install = [], launch._ensure_allocator

    def ensure_allocator():  # called only for descriptors; a GPU needs the allocator (the interpreter does not)
        used.append(True)
        if DEVICE == "cuda":
            install()
    monkeypatch.setattr(launch, "tma_ok", lambda *tensors: True)
    monkeypatch.setattr(launch, "_ensure_allocator", ensure_allocator)
    q, k, v = (t.requires_grad_() for t in rand_qkv(1, 4, 2, 111, 200, 48, seed=3))
    bm = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx + 40 >= kv_idx, None, None, 111, 200, device=DEVICE,
                           BLOCK_SIZE=64) if masked else None
    options = {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32}
    if use_tma is not None:
        options["USE_TMA"] = use_tma
    out = flex_attention(q, k, v, block_mask=bm, enable_gqa=True, kernel_options=options)
    used.clear()  # the forward's
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    assert bool(used) == (not masked if use_tma is None else use_tma)
    ref = attention_reference(q, k, v, block_mask=bm, enable_gqa=True)[0]
    for name, g, want in zip(("dq", "dk", "dv"), got, torch.autograd.grad(ref, (q, k, v), grad)):
        assert_grad_close(g, want, name=name)


def test_torch_func_transforms_are_named():
    # torch.func transforms wrap the inputs (flex_attention's kernels take plain tensors): raw internal errors before
    q, k, v = (t.requires_grad_() for t in rand_qkv(1, 2, 2, 32, 32, 16, seed=3))
    with pytest.raises(NotImplementedError, match=r"query comes from a torch.func transform .* fold a vmapped "
                                                  r"dimension into the batch"):
        torch.vmap(lambda a: flex_attention(a, k, v))(torch.randn(3, *q.shape, device=q.device))
    with pytest.raises(NotImplementedError, match="comes from a torch.func transform"):
        torch.func.grad(lambda a: flex_attention(q.detach(), a, v.detach()).sum())(k.detach())
    dq, = torch.autograd.grad(flex_attention(q, k, v).sum(), q)  # (double backward: test_double_backward_is_an_error)
    ref, = torch.autograd.grad(attention_reference(q, k, v)[0].sum(), q)
    assert_grad_close(dq, ref)


@pytest.mark.parametrize("where", ["mask_mod", "score_mod"])
def test_a_float_tables_compare_joined_by_and(where):
    """A compare of a float captured value read at b or h, joined to an index compare by ``&``: Triton's interpreter
    kept the float compare's result as 0.0 / 1.0 floats, which the ``&`` rejected (the backward inlines what the
    forward hoists); lower.py's compares of floats go through int8."""
    gate = torch.tensor([0.3, -0.6]).to(DEVICE)
    q, k, v = rand_qkv(1, 2, 2, 63, 63, 16, seed=4)
    if where == "mask_mod":
        bm = create_block_mask(lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (gate[h] > 0) | (q_idx == kv_idx), 1, 2,
                               63, 63, device=DEVICE, BLOCK_SIZE=32)
        check_backward(q, k, v, block_mask=bm, name="float gate in the mask")
    else:
        check_backward(q, k, v, lambda s, b, h, q_idx, kv_idx: torch.where((q_idx >= kv_idx) & (gate[h] > 0), s,
                                                                          s * 0.5), name="float gate in score_mod")
