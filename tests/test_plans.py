"""Plans: a repeated kind of call (the same shapes, strides, mods' traces, block mask lists, options and settings)
skips the forward's and the backward's decisions once its kernels are compiled (flexlite.api's _ForwardPlan and
the backward's kernels, runtime.launch's GENERATION). The rest of the suite runs with FLEXLITE_CHECK_PLANS=1 (each
planned call decides again and must agree); here the plans are taken, as outside the tests, and every call is
checked against the reference."""

from __future__ import annotations

import gc

import pytest
import torch

import flexlite.api as api
from flexlite import attention_reference, create_block_mask, first_calls, flex_attention
from flexlite.masks import causal_mask, generate_sliding_window
from flexlite.mods import generate_tanh_softcap
from flexlite.runtime import launch
from helpers import DEVICE, TOLERANCES, assert_close, assert_grads_like_reference, rand_qkv

B, H, L, D = 1, 2, 128, 16


@pytest.fixture
def taken(monkeypatch):
    """Plans taken (not checked), and the calls that decide counted: {"fwd": [...], "bwd": [...]}."""
    monkeypatch.setattr(api, "CHECK_PLANS", False)
    calls = {"fwd": [], "bwd": []}
    generate, kernels = api._generate, api._backward_kernels
    monkeypatch.setattr(api, "_generate", lambda *a, **kw: calls["fwd"].append(1) or generate(*a, **kw))
    monkeypatch.setattr(api, "_backward_kernels", lambda *a, **kw: calls["bwd"].append(1) or kernels(*a, **kw))
    return calls


def _check(q, k, v, score_mod=None, block_mask=None, backward=False):
    q, k, v = [t.detach().clone().requires_grad_(backward) for t in (q, k, v)]
    out = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)
    ref = attention_reference(q, k, v, score_mod=score_mod, block_mask=block_mask)[0]
    assert_close(out, ref, *TOLERANCES[q.dtype])
    if backward:
        assert_grads_like_reference(out, ref, (q, k, v))
    first_calls.wait()  # (on CUDA a new kind of call's first runs in torch ops while its kernels compile: no plan)
    return out


def _first(*args, **kwargs):
    """A new kind of call's first two calls: its kernels compiled (on CUDA beside the first) and its plan kept."""
    _check(*args, **kwargs)
    return _check(*args, **kwargs)


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("head_dim, dtype", [(D, torch.float32), (64, torch.bfloat16)])  # (the second: Gluon's on
def test_a_repeated_call_takes_its_plan(taken, backward, masked, head_dim, dtype):  # a Hopper GPU)
    q, k, v = rand_qkv(B, H, H, L, L, head_dim, dtype=dtype)
    bm = create_block_mask(causal_mask, None, None, L, L, device=DEVICE) if masked else None
    softcap = generate_tanh_softcap(5.0)
    first = _first(q, k, v, softcap, bm, backward)
    decided = {p: len(c) for p, c in taken.items()}
    assert decided["fwd"] >= 1 and decided["bwd"] >= backward
    again = _check(q, k, v, softcap, bm, backward)
    assert {p: len(c) for p, c in taken.items()} == decided, "a call of a planned kind decided again"
    assert torch.equal(first, again)
    q2, k2, v2 = rand_qkv(B, H, H, L, L, head_dim, dtype=dtype, seed=1)  # other values, the same kind of call
    _check(q2, k2, v2, softcap, bm, backward)
    assert {p: len(c) for p, c in taken.items()} == decided


def test_a_new_kind_of_call_decides(taken):
    q, k, v = rand_qkv(B, H, H, L, L, D)
    _first(q, k, v)
    for other in ((*rand_qkv(B, H, H, 2 * L, 2 * L, D),), (q, k, v, generate_tanh_softcap(5.0)),
                  (q.transpose(1, 2).contiguous().transpose(1, 2), k, v)):  # a length, a score_mod, strides
        n = len(taken["fwd"])
        _check(*other)
        assert len(taken["fwd"]) > n


def test_a_changed_setting_decides_again(taken, monkeypatch):
    q, k, v = rand_qkv(B, H, H, L, L, D)
    softcap = generate_tanh_softcap(5.0)
    _first(q, k, v, softcap)
    n = len(taken["fwd"])
    generation = launch.GENERATION
    monkeypatch.setattr(launch, "FOLD_SCORE_SCALES", False)  # another kernel source for the same call
    assert launch.GENERATION == generation + 1
    _first(q, k, v, softcap)
    assert len(taken["fwd"]) > n
    plans = api._plans(None, api.trace_mod(softcap, "score_mod"))
    assert len({plan.kernel.source for plan in plans.values()}) == 2  # (a plan per setting, each its own kernel)


def test_a_block_mask_changed_in_place_decides_again(taken):
    """The block mask's kv lists changed in place (their versions): the kernels read the new lists, and the decisions
    that read them (the walk's length) are made again."""
    q, k, v = rand_qkv(B, H, H, L, L, D)
    bm = create_block_mask(causal_mask, None, None, L, L, device=DEVICE, BLOCK_SIZE=32)
    _first(q, k, v, block_mask=bm)
    n = len(taken["fwd"])
    band = create_block_mask(generate_sliding_window(40), None, None, L, L, device=DEVICE, BLOCK_SIZE=32)
    with torch.no_grad():  # the band's lists in the causal mask's tensors (each side's, the same shapes)
        for name in api.BlockMask._TENSOR_ATTRS:
            if getattr(bm, name) is not None:
                getattr(bm, name).copy_(getattr(band, name))
    _check(q, k, v, block_mask=bm)  # (the band's blocks, causal_mask on its partial ones)
    assert len(taken["fwd"]) > n


def test_a_reassigned_mask_mod_decides_again(taken):
    q, k, v = rand_qkv(B, H, H, L, L, D)
    bm = create_block_mask(generate_sliding_window(40), None, None, L, L, device=DEVICE, BLOCK_SIZE=32)
    _first(q, k, v, block_mask=bm)
    n = len(taken["fwd"])
    bm.mask_mod = generate_sliding_window(20)  # the same blocks are partial; their positions now the narrower band
    _check(q, k, v, block_mask=bm)
    assert len(taken["fwd"]) > n


def test_plans_go_with_their_block_mask(taken):
    q, k, v = rand_qkv(B, H, H, L, L, D)
    bm = create_block_mask(causal_mask, None, None, L, L, device=DEVICE, BLOCK_SIZE=64)
    _first(q, k, v, block_mask=bm)
    assert len(api._FORWARD_PLANS[bm].plain) == 1
    masks = len(api._FORWARD_PLANS)
    del bm
    gc.collect()
    assert len(api._FORWARD_PLANS) == masks - 1


def test_launch_settings_count_their_assignments(monkeypatch):
    generation = launch.GENERATION
    monkeypatch.setattr(launch, "WS_FWD_PERSISTENT", launch.WS_FWD_PERSISTENT)
    launch.cdiv = launch.cdiv  # (a function: not a setting)
    assert launch.GENERATION == generation + 1
    monkeypatch.undo()
    assert launch.GENERATION == generation + 2


def test_a_differing_plan_is_an_error_when_checked(monkeypatch):
    """With CHECK_PLANS (the suite's default) a plan whose call decides otherwise raises instead of running the
    plan's kernel: a key that misses something the decisions read shows in the test that changes it."""
    monkeypatch.setattr(api, "CHECK_PLANS", True)
    q, k, v = rand_qkv(B, H, H, L, L, D)
    _first(q, k, v)
    ((key, plan),) = api._plans(None, None).items()
    api._plans(None, None)[key] = plan._replace(template="decode.py.jinja")
    with pytest.raises(RuntimeError, match="forward plan kept for this kind of call"):
        flex_attention(q, k, v)


def test_plans_go_with_their_score_mods_trace(taken):
    """A score_mod made anew for each step (capturing a new tensor): its plans, whose kernels hold that tensor, go
    with its trace, not kept by the plans of the dense walk."""
    q, k, v = rand_qkv(B, H, H, L, L, D)
    bias = torch.randn(L, device=DEVICE)
    mod = lambda s, b, h, qi, ki: s + bias[ki]  # noqa: E731
    _first(q, k, v, mod)
    assert len(api._DENSE_PLANS.by_trace) == 1
    del mod
    gc.collect()
    assert len(api._DENSE_PLANS.by_trace) == 0


def test_a_planned_call_takes_its_own_scale_and_aux_requests(taken):
    """What a plan does not decide stays the call's: the scale (a negative or zero one too, which the launch turns
    into the query's sign) and the auxiliary outputs (max_scores picks its kernels: part of the key)."""
    from flexlite import AuxRequest
    q, k, v = rand_qkv(B, H, H, L, L, D)
    bm = create_block_mask(causal_mask, None, None, L, L, device=DEVICE, BLOCK_SIZE=64)
    for scale in (0.25, 0.5, -0.3, 0.0):
        for _ in range(2):
            out, aux = flex_attention(q, k, v, block_mask=bm, scale=scale,
                                      return_aux=AuxRequest(lse=True, max_scores=True))
            first_calls.wait()
        ref, lse, row_max = attention_reference(q, k, v, block_mask=bm, scale=scale, return_max=True)
        assert_close(out, ref, *TOLERANCES[torch.float32])
        assert_close(aux.lse, lse, *TOLERANCES[torch.float32], name="lse")
        assert_close(aux.max_scores, row_max, *TOLERANCES[torch.float32], name="max_scores")
