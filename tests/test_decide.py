"""mask_mod's terms decided per tile (flexlite.codegen.decide, launch.DECIDE_MASK_TERMS): which masks have them, that a
tile's code only drops terms that hold on every position of the tile (checked against the mask's own values on the
tile's grid), and that the forward's outputs are the same bits with and without them."""

import operator
import types

import pytest
import torch
import torch.fx as fx

import flexlite
from flexlite import create_block_mask, flex_attention
from flexlite.codegen.decide import MAX_TERMS, mask_variants
from flexlite.codegen.trace import trace_mod
from flexlite.masks import causal_mask, generate_prefix_lm_mask, generate_sliding_window
from flexlite.runtime import launch
from helpers import DEVICE, rand_qkv

_doc = torch.tensor([0] * 40 + [1] * 60 + [2] * 100, device=DEVICE)

MASKS = {
    # mask_mod, (terms taken apart, codes of the variants kept) or None
    "sliding_window": (generate_sliding_window(24), (2, [1, 2])),
    "bidirectional_window": (generate_sliding_window(24, causal=False), (1, [])),
    # variants whose kept band takes its abs's sign from a dropped term (decide._rewritten), or cannot
    "band_above": (lambda b, h, q, kv: ((kv - q).abs() < 20) & (kv > q), (2, [1, 2])),
    "band_on_the_right": (lambda b, h, q, kv: (24 >= (q - kv).abs()) & (q >= kv) & (q % 3 != 1), (2, [1, 2, 3])),
    "band_under_or": (lambda b, h, q, kv: (30 <= (kv - q).abs()) | (q < 5), (2, [1, 2])),
    "band_of_another_factor": (lambda b, h, q, kv: ((2 * q - 2 * kv).abs() <= 30) & (kv <= q), (2, [1, 2])),
    "side_past_int32": (lambda b, h, q, kv: (64 * q - 64 * kv <= 5) & (q < 100), (2, [1, 2])),
    "prefix_lm": (generate_prefix_lm_mask(40), (2, [1, 2])),
    "causal": (causal_mask, (1, [])),
    "affine_pair": (lambda b, h, q, kv: (q - 2 * kv > -30) & (kv <= q + 3), (2, [1, 2])),
    "negative_factor_and_heads": (lambda b, h, q, kv: (-3 * kv + q * 2 >= -h * 5) & (q != kv + 7), (2, [1, 2])),
    "equal_and_or": (lambda b, h, q, kv: (q == kv) | (kv < 8) | (q - kv >= 50), (3, [1, 2, 3, 4, 5, 6])),
    "with_an_undecided_term": (lambda b, h, q, kv: (q >= kv) & ((q + kv) % 3 == 0), (1, [1])),
    "nested_under_or": (lambda b, h, q, kv: ((q >= kv) & (kv > 4)) | (q < 9), (1, [1])),
    # no term decided: a gather, float arithmetic, a captured tensor, a compare of a modulus, a factor past 64
    "document": (lambda b, h, q, kv: (_doc[q] == _doc[kv]) & (q >= kv), None),
    "float_distance": (lambda b, h, q, kv: (q.float() - kv.float()) * 0.5 <= 10.0, None),
    "modulus": (lambda b, h, q, kv: (q - kv) % 4 == 0, None),
    "large_factor": (lambda b, h, q, kv: q * 100000 >= kv * 3, None),  # (int32 wrap-around: not bounded)
}


@pytest.mark.parametrize("name", sorted(MASKS))
def test_which_masks_have_terms_a_tile_decides(monkeypatch, name):
    """(the Triton forward, which the interpreter runs, takes them where launch.DECIDE_MASK_TERMS names it; the
    warp-specialized one by default)"""
    mod, expected = MASKS[name]
    variants = mask_variants(trace_mod(mod, "mask_mod"))
    if expected is None:
        assert variants is None
        return
    assert (variants.terms, sorted(variants.variants)) == expected
    assert variants.terms <= MAX_TERMS and "def mask_mod_decide(b, h, q_lo, q_hi, k_lo, k_hi):" in variants.decide
    for code, low in variants.variants.items():
        assert low.fn_name == f"mask_mod_d{code}" and low.params == []
    bm = create_block_mask(mod, None, 2, 200, 200, device=DEVICE, BLOCK_SIZE=32)
    assert "mask_mod_decide" in flexlite.kernel_source(None, bm, device="cuda", kernel="forward_ws")
    assert "mask_mod_decide" not in flexlite.kernel_source(None, bm, device=DEVICE)
    monkeypatch.setattr(launch, "DECIDE_MASK_TERMS", launch.DECIDE_MASK_TERMS | {"fwd.py.jinja"})
    assert "code = mask_mod_decide(off_z, off_h, q_lo, " in flexlite.kernel_source(None, bm, device=DEVICE)


def _decide(variants):
    """mask_mod_decide as a Python function of torch scalars (its source run with tl's few ops from torch)."""
    body = variants.decide.split("\n", 1)[1]  # (without @triton.jit)
    tl = types.SimpleNamespace(maximum=lambda a, b: torch.maximum(torch.as_tensor(a), torch.as_tensor(b)),
                               where=torch.where, int32=torch.int32)
    scope = {"tl": tl}
    exec(body, scope)
    return scope["mask_mod_decide"]


def _variant(low):
    """A variant's lowered source (``mask_mod_d<code>``) as a Python function of torch tensors."""
    scope = {"tl": types.SimpleNamespace(abs=torch.abs, where=torch.where, int32=torch.int32),
             "py_mod": torch.remainder}  # (common.py.jinja's Python remainder)
    exec(low.source.split("\n", 1)[1], scope)  # (without @triton.jit)
    return scope[low.fn_name]


def _node_values(gm: fx.GraphModule, q, kv):
    """The value of every node of a traced mask's graph, by name, on the grid of queries q x keys kv
    (fx.Interpreter)."""
    values = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            values[n.name] = super().run_node(n)
            return values[n.name]

    Recorder(gm).run(torch.tensor(0), torch.tensor(1), q[:, None], kv[None, :])
    return values


@pytest.mark.parametrize("name", sorted(n for n, (_, expected) in MASKS.items() if expected is not None))
def test_a_tiles_code_drops_only_terms_that_hold_on_all_of_it(name):
    """Random tiles (ragged sizes, offsets across the mask's edges): code EMPTY only where the mask keeps nothing on
    the tile, FULL only where it keeps all, and a bitmask only of terms that hold (true under &, false under |) on
    every position of the tile; the tiles' codes cover the kinds the mask has."""
    mod = MASKS[name][0]
    variants = mask_variants(trace_mod(mod, "mask_mod"))
    decide = _decide(variants)
    gm = trace_mod(mod, "mask_mod").graph_module
    out = gm.graph.find_nodes(op="output")[0].args[0]
    under_or = out.target is operator.or_
    kernels = {code: _variant(low) for code, low in variants.variants.items()}
    gen = torch.Generator().manual_seed(3)
    seen = set()
    for _ in range(300):
        q_lo, k_lo = (int(x) for x in torch.randint(0, 120, (2,), generator=gen))
        rows, cols = (int(x) for x in torch.randint(1, 40, (2,), generator=gen))
        q, kv = torch.arange(q_lo, q_lo + rows), torch.arange(k_lo, k_lo + cols)
        values = _node_values(gm, q, kv)
        keep = values[out.name].expand(rows, cols)
        code = int(decide(*(torch.tensor(x) for x in (0, 1, q_lo, q_lo + rows - 1, k_lo, k_lo + cols - 1))))
        if code == variants.empty:
            assert not keep.any(), (q_lo, rows, k_lo, cols)
        elif code == variants.full:
            assert keep.all(), (q_lo, rows, k_lo, cols)
        else:
            for i, term in enumerate(variants.names):
                if code >> i & 1:
                    value = values[term].expand(rows, cols)
                    assert (not value.any()) if under_or else value.all(), (term, q_lo, rows, k_lo, cols)
            if code:  # the tile's variant (its kept terms rewritten where the dropped ones allow) is the mask there
                variant = kernels[code](torch.tensor(0), torch.tensor(1), q[:, None], kv[None, :])
                assert torch.equal(torch.as_tensor(variant).expand(rows, cols), keep), (code, q_lo, rows, k_lo, cols)
        seen.add("empty" if code == variants.empty else "full" if code == variants.full else "some" if code else
                 "none")
    assert ({"none", "some"} & seen) and ({"empty", "full"} & seen) and ("some" in seen or not variants.variants), seen


@pytest.mark.parametrize("Lq, Lkv, block", [(200, 200, 32), (111, 63, 16)], ids=["square", "ragged"])
@pytest.mark.parametrize("name", ["sliding_window", "band_above", "band_under_or", "prefix_lm", "affine_pair",
                                  "negative_factor_and_heads", "equal_and_or", "with_an_undecided_term",
                                  "nested_under_or"])
def test_decided_terms_leave_the_forward_bit_for_bit(monkeypatch, name, Lq, Lkv, block):
    """Outputs and LSE with the decided terms left out of their tiles are the same bits as with the whole mask on
    every partial tile (the same scores, only their mask's evaluation differs), partial blocks cut by the tiles,
    through the Triton forward (the interpreter's; the warp-specialized one on a Hopper GPU: test_warp_specialized)."""
    mod = MASKS[name][0]
    bm = create_block_mask(mod, None, 2, Lq, Lkv, device=DEVICE, BLOCK_SIZE=block)
    q, k, v = rand_qkv(1, 2, 2, Lq, Lkv, 16, seed=9)
    results = {}
    for on in (True, False):
        monkeypatch.setattr(launch, "DECIDE_MASK_TERMS", frozenset({"fwd.py.jinja"} if on else ()))
        assert ("mask_mod_decide" in flexlite.kernel_source(None, bm, device=DEVICE)) == on
        results[on] = flex_attention(q, k, v, block_mask=bm, return_lse=True)
    assert torch.equal(results[True][0], results[False][0]) and torch.equal(results[True][1], results[False][1])


@pytest.mark.parametrize("Lq, Lkv, block", [(200, 200, 32), (111, 63, 16)], ids=["square", "ragged"])
@pytest.mark.parametrize("score_mod", [None, "alibi", "softcap"])
@pytest.mark.parametrize("name", ["sliding_window", "prefix_lm", "negative_factor_and_heads", "equal_and_or",
                                  "with_an_undecided_term"])
def test_decided_terms_leave_the_backward_bit_for_bit(monkeypatch, name, score_mod, Lq, Lkv, block):
    """The backward kernels (generate_backward's templates, where launch.DECIDE_MASK_TERMS names them; none by
    default) with the decided terms left out of their partial tiles: dQ, dK and dV the same bits as with the whole
    mask (the Triton backward, both walks, on the interpreter; the warp-specialized dK / dV kernel shares its per-score
    math, flex_bwd_scores), with score_mods whose derivative is a number (ALiBi's 1) or a tensor (softcap's)."""
    mod = MASKS[name][0]
    sm = {None: None, "alibi": lambda s, b, h, q, kv: s + (kv - q) * 0.0625,
          "softcap": lambda s, b, h, q, kv: 4.0 * torch.tanh(s / 4.0)}[score_mod]
    bm = create_block_mask(mod, None, 2, Lq, Lkv, device=DEVICE, BLOCK_SIZE=block)
    q, k, v = [t.requires_grad_() for t in rand_qkv(1, 2, 2, Lq, Lkv, 16, seed=11)]
    grad_out = torch.randn(1, 2, Lq, 16, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    results = {}
    for on in (True, False):
        monkeypatch.setattr(launch, "DECIDE_MASK_TERMS", frozenset({"bwd.py.jinja"} if on else ()))
        assert ("mask_mod_decide" in flexlite.kernel_source(sm, bm, device=DEVICE, kernel="backward")) == on
        out = flex_attention(q, k, v, score_mod=sm, block_mask=bm)
        results[on] = [out] + list(torch.autograd.grad(out, (q, k, v), grad_out))
    for with_terms, without in zip(results[True], results[False]):
        assert torch.equal(with_terms, without) and not with_terms.isnan().any()


def test_decided_terms_leave_a_captured_tensors_gradient_bit_for_bit(monkeypatch):
    """A score_mod's captured tensor that needs a gradient (added up by the Triton dK / dV kernel from dS) gets the
    same bits with the decided terms left out of the partial tiles as with the whole mask. Its sums take the
    deterministic path: the atomic one adds in whatever order a GPU's programs finish."""
    bm = create_block_mask(MASKS["sliding_window"][0], None, 2, 200, 200, device=DEVICE, BLOCK_SIZE=32)
    q, k, v = [t.requires_grad_() for t in rand_qkv(1, 2, 2, 200, 200, 16, seed=5)]
    grad_out = torch.randn(1, 2, 200, 16, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    results = {}
    for on in (True, False):
        monkeypatch.setattr(launch, "DECIDE_MASK_TERMS", frozenset({"bwd.py.jinja"} if on else ()))
        bias = torch.linspace(-1.0, 1.0, 2, device=DEVICE).requires_grad_()
        out = flex_attention(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s + bias[h], block_mask=bm,
                             kernel_options={"DETERMINISTIC_CAPTURED_GRADS": True})
        results[on] = torch.autograd.grad(out, (q, k, v, bias), grad_out)
    for with_terms, without in zip(results[True], results[False]):
        assert torch.equal(with_terms, without) and not with_terms.isnan().any()
    assert results[True][3].abs().sum() > 0


def test_variants_of_a_mask_traced_again_are_equal():
    """A mask traced again (a new closure of the same code) gives equal, equally hashed variants, so that the kernel
    render cache serves it (kernel._render's key) as it serves the mask's own source."""
    def make():
        def band(b, h, q, kv):
            return ((q - kv).abs() <= 24) & (q >= kv)
        return band

    first, again = (mask_variants(trace_mod(make(), "mask_mod")) for _ in range(2))
    assert first is not again and first == again and hash(first) == hash(again)
    assert first != mask_variants(trace_mod(generate_sliding_window(25), "mask_mod"))



def test_a_window_edge_tiles_variant_is_one_compare_of_a_row_side_and_a_key():
    """Sliding window's edge tile (causality holds there) keeps the band as ``q_idx - w <= kv_idx``: the abs gone (the
    dropped causality gives its sign) and the window's row side computed per row against the key, one compare per
    score; the diagonal tile's causality as written. Other variants keep their terms where nothing is gained or a
    side could leave int32. launch.DECIDE_REWRITE_TERMS off: the band as written."""
    variants = mask_variants(trace_mod(generate_sliding_window(24), "mask_mod"))
    body = {code: [line.strip() for line in low.source.splitlines()[3:]] for code, low in variants.variants.items()}
    assert body == {1: ["t_ge = (q_idx >= kv_idx)", "return t_ge"],
                    2: ["t_sub_1 = (q_idx - 24)", "t_le_1 = (t_sub_1 <= kv_idx)", "return t_le_1"]}, body
    as_written = mask_variants(trace_mod(generate_sliding_window(24), "mask_mod"), rewrite=False)
    assert "tl.abs(t_sub)" in as_written.variants[2].source
    for name in ("band_under_or", "band_of_another_factor", "side_past_int32"):
        mod = MASKS[name][0]
        rewritten, written = (mask_variants(trace_mod(mod, "mask_mod"), rewrite=r) for r in (True, False))
        assert rewritten.variants[2].source == written.variants[2].source, name
    above = mask_variants(trace_mod(MASKS["band_above"][0], "mask_mod")).variants[2].source
    assert "abs" not in above and "> kv_idx)" in above, above


@pytest.mark.parametrize("rewrite", [True, False])
def test_the_kernels_take_the_rewritten_terms_where_the_setting_says(monkeypatch, rewrite):
    monkeypatch.setattr(launch, "DECIDE_REWRITE_TERMS", rewrite)
    bm = create_block_mask(generate_sliding_window(24), None, 2, 200, 200, device=DEVICE, BLOCK_SIZE=32)
    source = flexlite.kernel_source(None, bm, device="cuda", kernel="forward_ws")
    variant = source.split("def mask_mod_d2(")[1].split("\n\n")[0]
    assert ("t_le_1 = (t_sub_1 <= kv_idx)" in variant) == rewrite and ("tl.abs(" in variant) == (not rewrite)
