"""flexlite.eager: attention in torch ops, a chunk of query rows at a time (a new mod's first calls while its kernels
compile: first_calls.EAGER). Its forward and backward against the fp64 reference, over the masks' semantics (full and
partial blocks, broadcast block masks, rows with nothing kept), GQA, keys shared by the batch, lengths that differ
and chunks that split the rows and walk part of the keys. Pure torch: no kernel runs here."""

import pytest
import torch

from flexlite import AuxRequest, attention_reference, create_block_mask, eager, flex_attention
from flexlite.masks import causal_mask, generate_doc_mask_mod, generate_prefix_lm_mask, generate_sliding_window

from helpers import DEVICE, TOLERANCES, assert_close, assert_grad_close, rand_qkv


def _softcap(score, b, h, q_idx, kv_idx):
    return 20.0 * torch.tanh(score / 20.0)


def _alibi(score, b, h, q_idx, kv_idx):
    return score - (h + 1) * 0.1 * (q_idx - kv_idx).abs()


def _table_bias():
    table = torch.randn(3, 5, generator=torch.Generator().manual_seed(3)).to(DEVICE)

    def table_bias(score, b, h, q_idx, kv_idx):  # a captured tensor, indexed per position
        return score + table[h % 3, (q_idx + kv_idx) % 5]
    return table_bias


def _in_place(score, b, h, q_idx, kv_idx):  # (the derivative must be taken at the scores before the change)
    score *= 1.5
    score += 0.1 * h
    return score


def _holes(b, h, q_idx, kv_idx):  # causal, and every seventh query row keeps nothing
    return (kv_idx <= q_idx) & (q_idx % 7 != 3)


def _per_head(b, h, q_idx, kv_idx):
    return ((q_idx + b) % (h + 2)) != (kv_idx % 3)


def _document(L):
    ids = torch.arange(L, device=DEVICE, dtype=torch.int32) * 3 // L
    return generate_doc_mask_mod(causal_mask, ids)


CASES = {  # name -> (B, Hq, Hkv, Lq, Lkv, score_mod, (mask_mod, B and H of the mask, BLOCK_SIZE) or None)
    "causal softcap gqa": (2, 4, 2, 200, 200, _softcap, (causal_mask, (None, None), 64)),
    "document": (1, 2, 2, 111, 111, None, (_document(111), (None, None), 32)),
    "prefix-lm per head": (2, 2, 2, 63, 63, _alibi, (generate_prefix_lm_mask(20), (None, 2), (32, 16))),
    "per (b, h) mask": (2, 3, 3, 96, 96, _table_bias(), (_per_head, (2, 3), 32)),
    "rows with nothing kept": (1, 2, 1, 100, 100, None, (_holes, (None, None), 16)),
    "sliding window, lengths differ": (1, 2, 2, 80, 140, None, (generate_sliding_window(24), (None, None), 16)),
    "no block mask": (2, 2, 1, 63, 100, _alibi, None),
    "score_mod in place": (1, 2, 2, 64, 64, _in_place, (causal_mask, (None, None), 16)),
}


def _inputs(name, dtype=torch.float32):
    B, Hq, Hkv, Lq, Lkv, score_mod, mask = CASES[name]
    q, k, v = rand_qkv(B, Hq, Hkv, Lq, Lkv, 32, Dv=24, dtype=dtype, seed=len(name))
    bm = None
    if mask is not None:
        mod, (Bm, Hm), block = mask
        bm = create_block_mask(mod, Bm, Hm, Lq, Lkv, device=DEVICE, BLOCK_SIZE=block)
    return q, k, v, score_mod, bm


@pytest.fixture(params=[None, 700], ids=["one chunk", "chunks of a few rows"])
def chunk_scores(request, monkeypatch):
    if request.param is not None:
        monkeypatch.setattr(eager, "CHUNK_SCORES", request.param)
    return request.param


@pytest.mark.parametrize("name", CASES)
def test_forward_is_the_references(name, chunk_scores):
    q, k, v, score_mod, bm = _inputs(name)
    out, lse, row_max = eager.forward(q, k, v, score_mod, bm, 0.3, max_scores=True)
    ref_out, ref_lse, ref_max = attention_reference(q, k, v, score_mod=score_mod, block_mask=bm, scale=0.3,
                                                    enable_gqa=True, return_max=True)
    atol, rtol = TOLERANCES[torch.float32]
    assert out.dtype == q.dtype and lse.dtype == row_max.dtype == torch.float32
    assert_close(out, ref_out, atol, rtol)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)) and torch.equal(torch.isneginf(row_max),
                                                                                      torch.isneginf(ref_max))
    assert_close(lse, ref_lse, atol, rtol, "lse")
    assert_close(row_max, ref_max, atol, rtol, "max_scores")
    if name == "rows with nothing kept":
        assert torch.isneginf(lse[:, :, 3::7]).all() and (out[:, :, 3::7] == 0).all()


@pytest.mark.parametrize("lse_grad", [False, True], ids=["out", "out and lse"])
@pytest.mark.parametrize("name", CASES)
def test_backward_is_the_references(name, lse_grad, chunk_scores):
    q, k, v, score_mod, bm = _inputs(name)
    out, lse, _ = eager.forward(q, k, v, score_mod, bm, 0.3)
    g = torch.Generator().manual_seed(1)
    grad_out = torch.randn(out.shape, generator=g).to(DEVICE)
    grad_lse = torch.randn(lse.shape, generator=g).to(DEVICE) if lse_grad else None
    with torch.no_grad():  # (as autograd runs a backward)
        grads = eager.backward(q, k, v, out, grad_out, grad_lse, score_mod, bm, 0.3)
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = attention_reference(q, k, v, score_mod=score_mod, block_mask=bm, scale=0.3, enable_gqa=True)
    loss = (ref_out * grad_out.double()).sum()
    if lse_grad:  # (rows with nothing kept: lse -inf, no gradient)
        loss = loss + torch.where(torch.isinf(ref_lse), 0.0, ref_lse * grad_lse.double()).sum()
    for label, got, want, t in zip(("dq", "dk", "dv"), grads, torch.autograd.grad(loss, (q, k, v)), (q, k, v)):
        assert got.shape == t.shape and got.dtype == torch.float32 and not got.isnan().any()
        assert_grad_close(got, want, torch.float32, label)


def test_bfloat16_inputs_give_bfloat16_outputs_within_the_kernels_tolerance():
    q, k, v, score_mod, bm = _inputs("causal softcap gqa", torch.bfloat16)
    out, lse, _ = eager.forward(q, k, v, score_mod, bm, 0.25)
    ref_out, _ = attention_reference(q, k, v, score_mod=score_mod, block_mask=bm, scale=0.25, enable_gqa=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert_close(out, ref_out, *TOLERANCES[torch.bfloat16])
    grads = eager.backward(q, k, v, out, torch.ones_like(out), None, score_mod, bm, 0.25)
    assert [t.dtype for t in grads[:3]] == [torch.bfloat16] * 3 and grads[3] == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_multiply_in_their_dtype_and_round_p_as_the_kernels(dtype, chunk_scores):
    """bfloat16 / float16 inputs: key and value stay in their dtype (no float32 copies of them), the scores are their
    products in float32, and P is rounded to their dtype before P @ V, as the kernels' tensor cores take them; LSE
    and the row maxima from the float32 scores. Checked against those steps spelled out densely, over a mask with
    partial blocks and rows of different lengths, a key not contiguous, GQA."""
    q, k, v = rand_qkv(2, 4, 2, 80, 140, 32, Dv=24, dtype=dtype, seed=8)
    k = k.transpose(1, 2).contiguous().transpose(1, 2)  # ([B, L, H, D] in memory)
    window = generate_sliding_window(24)
    bm = create_block_mask(window, None, None, 80, 140, device=DEVICE, BLOCK_SIZE=16)
    chunks, groups, key, value = eager._start(q, k, v, bm, True, eager.native(q, k, v))
    assert eager.native(q, k, v) and key.dtype == value.dtype == dtype and key.is_contiguous()
    out, lse, row_max = eager.forward(q, k, v, None, bm, 0.25, max_scores=True)
    rows, cols = torch.arange(80, device=DEVICE)[:, None], torch.arange(140, device=DEVICE)[None, :]
    kk, vv = (t.float().repeat_interleave(2, dim=1) for t in (k, v))
    s = (q.float() @ kk.transpose(-1, -2) * 0.25).masked_fill(~window(0, 0, rows, cols), float("-inf"))
    want = (torch.softmax(s, dim=-1).to(dtype).float() @ vv).to(dtype)
    assert out.dtype == dtype and lse.dtype == row_max.dtype == torch.float32
    assert_close(out, want, 1e-3, 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -9)  # (an ulp where P's sums differ)
    assert_close(lse, torch.logsumexp(s, dim=-1), 1e-5, 1e-6, "lse")
    assert_close(row_max, s.amax(dim=-1), 1e-5, 1e-6, "max_scores")
    ref_out, _ = attention_reference(q, k, v, block_mask=bm, scale=0.25, enable_gqa=True)
    assert_close(out, ref_out, *TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_backward_multiplies_in_their_dtype_and_rounds_ds_and_p(dtype, chunk_scores):
    """The backward of bfloat16 / float16 inputs: key and value in their dtype, dP = dO V^T their products in
    float32, dS and P rounded to their dtype before dQ = dS K, dK = dS^T Q and dV = P^T dO, as the kernels take
    them. Checked against those steps spelled out densely (a sliding window with partial blocks, lengths that differ,
    a key not contiguous, GQA) and against the fp64 reference's gradients."""
    q, k, v = rand_qkv(2, 4, 2, 80, 140, 32, Dv=24, dtype=dtype, seed=9)
    k = k.transpose(1, 2).contiguous().transpose(1, 2)
    window = generate_sliding_window(24)
    bm = create_block_mask(window, None, None, 80, 140, device=DEVICE, BLOCK_SIZE=16)
    out, _, _ = eager.forward(q, k, v, None, bm, 0.25)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(dtype=dtype, device=DEVICE)
    with torch.no_grad():
        dq, dk, dv, _ = eager.backward(q, k, v, out, grad_out, None, None, bm, 0.25)
    rows, cols = torch.arange(80, device=DEVICE)[:, None], torch.arange(140, device=DEVICE)[None, :]
    kk, vv = (t.float().repeat_interleave(2, dim=1) for t in (k, v))
    s = (q.float() @ kk.transpose(-1, -2) * 0.25).masked_fill(~window(0, 0, rows, cols), float("-inf"))
    p = torch.softmax(s, dim=-1)
    do = grad_out.float()
    ds = p * (do @ vv.transpose(-1, -2) - (do * out.float()).sum(-1, keepdim=True)) * 0.25
    ds, p = ds.to(dtype).float(), p.to(dtype).float()
    want = (ds @ kk, (ds.transpose(-1, -2) @ q.float()).view(2, 2, 2, 140, 32).sum(2),
            (p.transpose(-1, -2) @ do).view(2, 2, 2, 140, 24).sum(2))
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref_out, _ = attention_reference(qd, kd, vd, block_mask=bm, scale=0.25, enable_gqa=True)
    ref = torch.autograd.grad(ref_out, (qd, kd, vd), grad_out.double())
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -9
    for name, got, steps, exact in zip(("dq", "dk", "dv"), (dq, dk, dv), want, ref):
        assert got.dtype == dtype
        assert_close(got, steps.to(dtype), 1e-3, ulp, name)
        assert_grad_close(got, exact, dtype, name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_operands_give_their_float32_products(dtype):
    a, b = (torch.randn(shape, generator=torch.Generator().manual_seed(5)).to(dtype=dtype, device=DEVICE)
            for shape in ((2, 3, 5, 16), (2, 3, 16, 7)))
    got = eager._matmul(a, b)
    exact = a.double() @ b.double()  # (the products of half-precision values are exact; the sums in float64)
    assert got.dtype == torch.float32 and got.shape == (2, 3, 5, 7)
    assert_close(got, exact, 1e-5, 1e-6)
    # float32 sums and results, not the operands' dtype's: ten times closer than a product rounded to it
    assert (got.double() - exact).abs().max() * 10 < ((a @ b).double() - exact).abs().max()


def test_the_forwards_weights_and_lse_in_rows_with_nonfinite_scores():
    """One softmax for P and LSE (:func:`eager._weights_lse`): as logsumexp and the backward's weights in finite rows
    and in rows of one huge value; a row with nothing kept P 0 and LSE -inf; a +inf score LSE +inf; a NaN one NaN."""
    inf, nan = float("inf"), float("nan")
    s = torch.tensor([[0.5, -1.0, 2.0, -inf], [-inf] * 4, [1.0, inf, 0.0, -inf], [1.0, nan, 0.0, 0.0],
                      [-1e20] * 4, [3e4, 1.0, -2.0, 0.5]], device=DEVICE)
    p, lse, m = eager._weights_lse(s)
    assert torch.equal(m.isnan(), s.amax(-1).isnan()) and torch.equal(m[~m.isnan()], s.amax(-1)[~m.isnan()])
    finite = [0, 4, 5]
    assert_close(p[finite], eager._weights(s)[finite], 1e-7, 1e-6, "P")
    assert_close(p[4], torch.full((4,), 0.25, device=DEVICE), 0.0, 1e-6, "P of one value")
    assert_close(lse[finite], torch.logsumexp(s, dim=-1)[finite], 0.0, 1e-6, "lse")
    assert (p[1] == 0).all() and lse[1] == -inf
    assert lse[2] == inf and p[2, 1].isnan()
    assert lse[3].isnan() and p[3].isnan().all()


def test_keys_shared_by_the_batch():
    # flex_attention hands key and value of batch 1 on as stride-0 views of the query's batch: cast and multiplied
    # once for the batch, not copied to it; their gradients per batch, which autograd sums
    q, k1, v1 = rand_qkv(3, 4, 2, 64, 64, 16, seed=4)
    k, v = k1[:1].expand(3, -1, -1, -1), v1[:1].expand(3, -1, -1, -1)
    assert eager._cast(k1[:1].bfloat16().expand(3, -1, -1, -1), torch.float32).stride(0) == 0
    bm = create_block_mask(causal_mask, None, None, 64, 64, device=DEVICE, BLOCK_SIZE=16)
    out, lse, _ = eager.forward(q, k, v, _softcap, bm, 0.25)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    dq, dk, dv, _ = eager.backward(q, k, v, out, grad_out, None, _softcap, bm, 0.25)
    q, k1, v1 = (t[:1].double().requires_grad_() if t is not q else t.double().requires_grad_() for t in (q, k1, v1))
    ref_out, _ = attention_reference(q, k1.expand(3, -1, -1, -1), v1.expand(3, -1, -1, -1), score_mod=_softcap,
                                     block_mask=bm, scale=0.25, enable_gqa=True)
    assert_close(out, ref_out, *TOLERANCES[torch.float32])
    want = torch.autograd.grad((ref_out * grad_out.double()).sum(), (q, k1, v1))
    assert dk.shape == dv.shape == (3, 2, 64, 16)
    for label, got, w in zip(("dq", "dk", "dv"), (dq, dk.sum(0, keepdim=True), dv.sum(0, keepdim=True)), want):
        assert_grad_close(got, w, torch.float32, label)


def test_a_score_mod_that_ignores_the_score():
    def only_bias(score, b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).float() * 0.01
    q, k, v = rand_qkv(1, 1, 1, 32, 32, 16, seed=5)
    out, lse, _ = eager.forward(q, k, v, only_bias, None, 1.0)
    dq, dk, dv, _ = eager.backward(q, k, v, out, torch.ones_like(out), None, only_bias, None, 1.0)
    assert (dq == 0).all() and (dk == 0).all() and dv.abs().sum() > 0


@pytest.mark.parametrize("constant", [-1e20, 1e30, -1e6])
def test_rows_of_one_huge_score_are_normalized_by_their_own_sum(constant):
    """Rows whose scores are all one value far from 0 (a "mask" by a large constant instead of -inf): P is each
    row's own normalized weights, the mean of v there, as a dense softmax; exp(s - LSE) took every weight as 1 (LSE
    rounds back to the constant, losing log(n)), out the sum of v, in the forward and the backward."""
    q, k, v = (t.double().requires_grad_() for t in rand_qkv(1, 1, 1, 48, 48, 16, seed=6))

    def rows_of_one_value(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx % 3 == 0, constant, score)
    out = flex_attention(q, k, v, score_mod=rows_of_one_value)  # (float64: these torch ops)
    s = torch.where(torch.arange(48, device=DEVICE)[:, None] % 3 == 0, constant, q @ k.transpose(-1, -2) * 0.25)
    want = torch.softmax(s, dim=-1) @ v
    assert_close(out, want, 1e-12, 1e-12)
    assert_close(out[0, 0, 0], v[0, 0].mean(0), 1e-12, 1e-12)
    grad = torch.randn_like(out)
    for name, g, w in zip(("dq", "dk", "dv"), torch.autograd.grad(out, (q, k, v), grad),
                          torch.autograd.grad(want, (q, k, v), grad)):
        assert_close(g, w, 1e-12, 1e-12, name=name)


def test_chunks_walk_only_the_keys_their_blocks_reach(monkeypatch):
    monkeypatch.setattr(eager, "CHUNK_SCORES", 2 * 2 * 256)  # two query rows a chunk (2 heads, 256 keys)
    bm = create_block_mask(generate_sliding_window(16), 1, 2, 256, 256, device=DEVICE, BLOCK_SIZE=32)
    chunks = list(eager._Chunks(bm, 1, 2, 256, 256, torch.device(DEVICE)))
    assert len(chunks) == 128
    for q0, q1, k0, k1 in chunks:
        assert k0 == max(0, (q0 // 32 - 1) * 32) and k1 == min(256, (q0 // 32 + 1) * 32)


def test_fits():
    q, k, v = rand_qkv(1, 4, 4, 8, 100, 16)
    assert eager.fits(q, k, v)
    assert not eager.fits(q.expand(2 ** 20, -1, -1, -1), k, v)  # a row of a chunk past CHUNK_SCORES


def test_calls_that_walk_too_many_scores_are_refused(monkeypatch):
    # counted over the keys the chunks walk: a sliding window walks a band, so its limit is not the dense one's
    q, k, v = rand_qkv(1, 2, 2, 256, 256, 16, seed=6)
    window = create_block_mask(generate_sliding_window(16), None, None, 256, 256, device=DEVICE, BLOCK_SIZE=32)
    monkeypatch.setattr(eager, "CHUNK_SCORES", 2 * 256 * 32)  # chunks of 32 rows
    monkeypatch.setattr(eager, "MAX_SCORES", 2 * 256 * 256 - 1)
    with pytest.raises(eager.TooLarge, match="MAX_SCORES"):
        eager.forward(q, k, v, None, None, 0.25)
    out, lse, _ = eager.forward(q, k, v, None, window, 0.25)  # 2 heads x 256 rows x 64 keys (96 for the edges)
    with pytest.raises(eager.TooLarge):
        eager.backward(q, k, v, out, torch.ones_like(out), None, None, None, 0.25)


def _float64_case(name):
    B, Hq, Hkv, Lq, Lkv, score_mod, mask = CASES[name]
    q, k, v = (t.double().requires_grad_() for t in rand_qkv(1, Hq, Hkv, 40, 56, 8, seed=7))
    bm = None
    if mask is not None:
        mod, (Bm, Hm), _ = mask
        bm = create_block_mask(mod, None if Bm is None else 1, Hm, 40, 56, device=DEVICE, BLOCK_SIZE=16)
    return q, k, v, score_mod, bm


@pytest.mark.parametrize("name", ["causal softcap gqa", "prefix-lm per head", "rows with nothing kept",
                                  "sliding window, lengths differ", "no block mask"])
def test_flex_attention_takes_float64_through_torch_ops(name):
    # as torch's flex_attention (its math path): float64 for gradcheck; out, lse and max_scores in float64
    q, k, v, score_mod, bm = _float64_case(name)
    out, aux = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=True, scale=0.4,
                              return_aux=AuxRequest(lse=True, max_scores=True))
    ref_out, ref_lse, ref_max = attention_reference(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=True,
                                                    scale=0.4, return_max=True)
    assert out.dtype == aux.lse.dtype == aux.max_scores.dtype == torch.float64
    for got, want in ((out, ref_out), (aux.lse, ref_lse), (aux.max_scores, ref_max)):
        assert torch.equal(torch.isneginf(got), torch.isneginf(want))
        assert_close(got, want, 1e-12, 1e-12)

    def attention(q, k, v):
        out, lse = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=True, scale=0.4,
                                  return_lse=True)
        return out, torch.where(torch.isinf(lse), 0.0, lse)  # (rows with nothing kept: lse -inf, no gradient)
    assert torch.autograd.gradcheck(attention, (q, k, v), fast_mode=True)


def test_float64_gradients_reach_tensors_a_score_mod_captures():
    bias = torch.randn(2, 40, 56, dtype=torch.float64, device=DEVICE, requires_grad=True)
    slopes = torch.tensor([0.5, -0.25], dtype=torch.float64, device=DEVICE, requires_grad=True)

    def learned(score, b, h, q_idx, kv_idx):
        return score * slopes[h] + bias[h, q_idx, kv_idx]
    q, k, v = (t.double().requires_grad_() for t in rand_qkv(1, 2, 2, 40, 56, 8, seed=8))
    bm = create_block_mask(causal_mask, None, None, 40, 56, device=DEVICE, BLOCK_SIZE=16)
    assert torch.autograd.gradcheck(lambda q, k, v, bias, slopes: flex_attention(q, k, v, score_mod=learned,
                                                                               block_mask=bm),
                                    (q, k, v, bias, slopes), fast_mode=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_score_mod_capturing_the_key_itself_gets_its_gradient_once(dtype):
    # the backward's scores are recomputed from the key, under grad mode for score_mod's derivative; a key already in
    # the compute dtype (no copy) tied them to it, so that a score_mod capturing the key (or the query) added the
    # attention's dK to the captured tensor's gradient a second time (float64: dk off by ~1)
    q, k, v = (t.to(dtype).requires_grad_() for t in rand_qkv(1, 2, 2, 24, 40, 16, seed=9))

    def mod_of(q, k):
        return lambda score, b, h, q_idx, kv_idx: score + q[b, h, q_idx, 0] * k[b, h, kv_idx, 1]
    bm = create_block_mask(causal_mask, None, None, 24, 40, device=DEVICE, BLOCK_SIZE=16)
    out, lse, _ = eager.forward(q, k, v, mod_of(q, k), bm, 0.3)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    with torch.no_grad():  # (as autograd runs a backward)
        dq, dk, dv, (dq_captured, dk_captured) = eager.backward(q, k, v, out, grad_out, None, mod_of(q, k), bm, 0.3,
                                                                (q, k))
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_out, _ = attention_reference(qd, kd, vd, score_mod=mod_of(qd, kd), block_mask=bm, scale=0.3)
    want = torch.autograd.grad((ref_out * grad_out.double()).sum(), (qd, kd, vd))
    for label, got, w in zip(("dq", "dk", "dv"), (dq + dq_captured, dk + dk_captured, dv), want):
        assert_grad_close(got, w, dtype, label, tolerance_dtype=torch.float32)
    if dtype == torch.float64:  # through flex_attention, whose float64 runs these torch ops
        q.grad = k.grad = v.grad = None
        (flex_attention(q, k, v, score_mod=mod_of(q, k), block_mask=bm, scale=0.3) * grad_out).sum().backward()
        for label, got, w in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), want):
            assert_grad_close(got, w, dtype, label, tolerance_dtype=torch.float32)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # (the interpreter's sqrt, masked)
@pytest.mark.parametrize("dtype, options", [(torch.float64, None),
                                            (torch.float32, {"DETERMINISTIC_CAPTURED_GRADS": True}),
                                            (torch.float32, None)], ids=["float64", "deterministic", "kernels"])
def test_a_captured_tensors_gradient_leaves_out_masked_positions_whose_derivative_is_not_finite(dtype, options):
    # sqrt(q_idx - kv_idx) is NaN above a causal mask's diagonal, where dS is 0: the torch ops' autograd summed
    # 0 * NaN into the bias' gradient (every entry NaN, in float64 and in the deterministic captured gradients; the
    # kernels' atomics skip masked positions), where torch's kernels leave masked positions out
    q, k, v = (t.to(dtype).requires_grad_() for t in rand_qkv(1, 2, 2, 24, 40, 16, seed=10))
    bias = torch.rand(40, dtype=dtype, device=DEVICE, requires_grad=True)

    def mod_of(sqrt):
        return lambda score, b, h, q_idx, kv_idx: score + sqrt((q_idx - kv_idx).to(score.dtype)) * bias[kv_idx]
    bm = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx > kv_idx, None, None, 24, 40, device=DEVICE,
                           BLOCK_SIZE=16)
    out = flex_attention(q, k, v, score_mod=mod_of(torch.sqrt), block_mask=bm, kernel_options=options)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    got = torch.autograd.grad((out * grad_out).sum(), (q, k, v, bias))
    # the reference's sqrt of a clamped difference: the same scores where kept, a finite derivative where masked
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = attention_reference(qd, kd, vd, score_mod=mod_of(lambda x: torch.sqrt(x.clamp(min=0))), block_mask=bm)
    want = torch.autograd.grad((ref * grad_out.double()).sum(), (qd, kd, vd, bias))
    for label, g, w in zip(("dq", "dk", "dv", "dbias"), got, want):
        assert_grad_close(g, w.to(dtype), dtype, label, tolerance_dtype=torch.float32)


def test_float64_without_keys_gives_a_float64_lse():
    q, k, v = (t.double() for t in rand_qkv(1, 2, 2, 8, 0, 8))
    out, lse = flex_attention(q, k, v, return_lse=True)
    assert lse.dtype == torch.float64 and torch.isneginf(lse).all() and (out == 0).all()


def test_other_dtypes_are_refused_with_the_ones_taken():
    q, k, v = rand_qkv(1, 1, 1, 8, 8, 8)
    with pytest.raises(TypeError, match="float16, bfloat16, float32 .* or float64"):
        flex_attention(*(t.to(torch.complex64) for t in (q, k, v)))


def test_large_block_masks_are_refused_before_their_dense_flags(monkeypatch):
    q, k, v = rand_qkv(2, 2, 2, 256, 256, 16, seed=9)
    causal = create_block_mask(causal_mask, 2, 2, 256, 256, device=DEVICE, BLOCK_SIZE=32)  # 36 blocks a (b, h)
    monkeypatch.setattr(eager, "MAX_SCORES", 4 * 36 * 32 * 32 - 1)
    monkeypatch.setattr(causal, "dense_blocks", lambda full: pytest.fail("the dense flags were built"))
    with pytest.raises(eager.TooLarge, match="listed blocks"):
        eager.forward(q, k, v, None, causal, 0.25)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # (numpy, on the NaNs we feed)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_a_nonfinite_value_reaches_only_the_rows_whose_blocks_read_it(value, chunk_scores):
    """As the kernels: a NaN / inf value spreads to the rows of the query blocks whose lists hold its block (0 * NaN
    there), never to the others, forward and backward (P @ V over a chunk's keys would give 0 * NaN to every row)."""
    q, k, v = rand_qkv(1, 2, 1, 200, 256, 16, seed=4)
    v[0, 0, 190, 3] = float(value)  # kv block 2 of 64: read by query blocks 2 and 3 (rows 128-199) only
    bm = create_block_mask(causal_mask, None, None, 200, 256, device=DEVICE, BLOCK_SIZE=64)
    out, lse, _ = eager.forward(q, k, v, None, bm, 0.25)
    kernel = flex_attention(q, k, v, block_mask=bm, scale=0.25, enable_gqa=True)
    assert torch.equal(out.isnan(), kernel.isnan()) and torch.equal(out.isinf(), kernel.isinf())
    assert out[:, :, 128:].isnan().any() or out[:, :, 128:].isinf().any()
    clean = v.clone()
    clean[0, 0, 190, 3] = 0.0
    ref = attention_reference(q, k, clean, block_mask=bm, scale=0.25, enable_gqa=True)[0]
    assert_close(out[:, :, :128], ref[:, :, :128], *TOLERANCES[torch.float32])
    finite = torch.isfinite(kernel)
    assert_close(out[finite], kernel[finite], *TOLERANCES[torch.float32], name="finite part")
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    with torch.no_grad():
        dq, dk, dv, _ = eager.backward(q, k, v, out, grad_out, None, None, bm, 0.25)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, clean))
    want = torch.autograd.grad(attention_reference(qd, kd, vd, block_mask=bm, scale=0.25, enable_gqa=True)[0],
                               qd, grad_out.double())[0]
    assert_grad_close(dq[:, :, :128], want[:, :, :128], torch.float32, "dq of the rows that do not read it")
    assert not torch.isfinite(dq[:, :, 128:]).all()
