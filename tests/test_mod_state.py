"""The trace cache sees state a mod reads from objects: a callable object's attributes, a bound method's
``__self__``, an object (SimpleNamespace, dataclass, ``__slots__`` object) found in a global, an nn.Module's
parameters, buffers and plain attributes, and the scalars its class (or a class used as a namespace) holds. Changing
any of them re-traces (the kernel uses the new constant or the new captured tensor); calling again with nothing
changed does not. Between a forward and its backward, a change to what the forward read is an error (the backward
would run the mods on it)."""

from __future__ import annotations

import dataclasses
import functools
import sys
import types

import pytest
import torch
from torch import nn

import flexlite.api as api
from flexlite import attention_reference, create_block_mask, flex_attention
from flexlite.codegen import trace as trace_module
from flexlite.masks import causal_mask, generate_sliding_window
from flexlite.mods import generate_relative_bias, generate_tanh_softcap
from helpers import DEVICE, TOLERANCES, assert_close, assert_grads_like_reference, rand_qkv

B, H, L, D = 1, 1, 64, 16

CFG = types.SimpleNamespace(cap=2.0, window=4)


@dataclasses.dataclass
class Config:
    scale: float = 0.5


DC = Config()


class Slotted:
    __slots__ = ("scale",)

    def __init__(self, scale):
        self.scale = scale


SLOTTED = Slotted(0.5)
SCALE = 0.5
TABLE = {"scale": 0.5}


class Scaled:
    w = 2.0

    def __call__(self, s, b, h, qi, ki):
        return s * self.w

    def sm(self, s, b, h, qi, ki):
        return s * self.w + qi * 0.01


class Bias(nn.Module):
    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(L, generator=torch.Generator().manual_seed(1)).to(DEVICE))
        self.register_buffer("qbias", torch.zeros(L, device=DEVICE))
        self.t = 1.0

    def forward(self, s, b, h, qi, ki):
        return s * self.t + self.bias[ki] + self.qbias[ki] * 0.5


class Outer(nn.Module):  # state inside a submodule
    def __init__(self):
        super().__init__()
        self.inner = Bias()

    def forward(self, s, b, h, qi, ki):
        return self.inner(s, b, h, qi, ki)


def cap_mod(s, b, h, qi, ki):
    return CFG.cap * torch.tanh(s / CFG.cap)


def dataclass_mod(s, b, h, qi, ki):
    return s * DC.scale


def slotted_mod(s, b, h, qi, ki):
    return s * SLOTTED.scale


def global_mod(s, b, h, qi, ki):
    return s * SCALE


def dict_mod(s, b, h, qi, ki):
    return s * TABLE["scale"]


def _new(n):
    return torch.randn(L, generator=torch.Generator().manual_seed(n)).to(DEVICE)


def _callable_object(mp):
    m = Scaled()
    return m, lambda: setattr(m, "w", 7.0)


def _bound_method(mp):
    obj = Scaled()
    return obj.sm, lambda: setattr(obj, "w", 7.0)


def _bound_method_stored(mp):
    obj = Scaled()
    sm = obj.sm  # stored once: the same method object on every call
    return sm, lambda: setattr(obj, "w", -3.0)


def _namespace_global(mp):
    return cap_mod, lambda: mp.setattr(CFG, "cap", 0.5)


def _dataclass_global(mp):
    return dataclass_mod, lambda: mp.setattr(DC, "scale", 3.0)


def _slots_global(mp):
    return slotted_mod, lambda: mp.setattr(SLOTTED, "scale", 3.0)


def _module_parameter(mp):
    mod = Bias()
    return mod, lambda: setattr(mod, "bias", nn.Parameter(_new(2)))


def _module_buffer(mp):
    mod = Bias()
    return mod, lambda: setattr(mod, "qbias", _new(3))


def _module_float(mp):
    mod = Bias()
    return mod, lambda: setattr(mod, "t", 0.25)


def _submodule_parameter(mp):
    mod = Outer()
    return mod, lambda: setattr(mod.inner, "bias", nn.Parameter(_new(4)))


def _class_attribute(mp):
    m = Scaled()  # reads self.w, a class attribute
    return m, lambda: mp.setattr(Scaled, "w", 7.0)


class Settings:  # a class as a namespace of settings
    scale = 0.5


def settings_mod(s, b, h, qi, ki):
    return s * Settings.scale


def _class_namespace_global(mp):
    return settings_mod, lambda: mp.setattr(Settings, "scale", 3.0)


def _partial_object(mp):
    m = Scaled()
    return functools.partial(Scaled.__call__, m), lambda: setattr(m, "w", 7.0)


# (what already worked before object state was fingerprinted; must keep working)
def _plain_global(mp):
    return global_mod, lambda: mp.setattr(sys.modules[__name__], "SCALE", 3.0)


def _global_dict(mp):
    return dict_mod, lambda: mp.setitem(TABLE, "scale", 3.0)


def _inplace_parameter(mp):
    mod = Bias()

    def change():
        with torch.no_grad():
            mod.bias.mul_(-2.0)
    return mod, change


# globals read by a function the mod defines, by a class's static method and by another module's function (their
# changes were not seen before: the old kernel kept)
NESTED_SCALE = 1.0
STATIC_SCALE = 1.0
_HELPERS = types.ModuleType("flexlite_test_helpers")
exec("CAP = 1.0\n\ndef scale(x):\n    return x * CAP\n", _HELPERS.__dict__)


def nested_mod(s, b, h, qi, ki):
    def inner(x):
        return x * NESTED_SCALE
    return inner(s)


class StaticHelper:
    @staticmethod
    def apply(x):
        return x * STATIC_SCALE


def static_mod(s, b, h, qi, ki):
    return StaticHelper.apply(s)


def helpers_mod(s, b, h, qi, ki):
    return _HELPERS.scale(s)


def _nested_function_global(mp):
    return nested_mod, lambda: mp.setattr(sys.modules[__name__], "NESTED_SCALE", 3.0)


def _static_method_global(mp):
    return static_mod, lambda: mp.setattr(sys.modules[__name__], "STATIC_SCALE", 3.0)


def _module_function_global(mp):
    return helpers_mod, lambda: mp.setattr(_HELPERS, "CAP", 3.0)


CASES = [_callable_object, _bound_method, _bound_method_stored, _namespace_global, _dataclass_global, _slots_global,
         _module_parameter, _module_buffer, _module_float, _submodule_parameter, _class_attribute,
         _class_namespace_global, _partial_object, _plain_global, _global_dict, _inplace_parameter,
         _nested_function_global, _static_method_global, _module_function_global]


@pytest.fixture
def traces(monkeypatch):
    calls = []
    real = trace_module._trace
    monkeypatch.setattr(trace_module, "_trace", lambda fn, kind: calls.append(fn) or real(fn, kind))
    return calls


@pytest.mark.parametrize("plans", ["checked", "taken"])
@pytest.mark.parametrize("case", CASES, ids=[c.__name__.lstrip("_") for c in CASES])
def test_changed_state_is_seen(case, plans, monkeypatch, traces):
    # (plans taken: a repeated call skips the forward's decisions, as outside the tests, its key holding the trace, and
    # the trace cache's probes stand for the fingerprint without it being walked too)
    monkeypatch.setattr(api, "CHECK_PLANS", plans == "checked")
    monkeypatch.setattr(trace_module, "CHECK_PROBES", plans == "checked")
    mod, change = case(monkeypatch)
    q, k, v = rand_qkv(B, H, H, L, L, D)
    before = flex_attention(q, k, v, score_mod=mod)
    assert_close(before, attention_reference(q, k, v, score_mod=mod)[0], *TOLERANCES[torch.float32])
    change()
    traces.clear()
    out = flex_attention(q, k, v, score_mod=mod)
    # re-traced, except for new values in the same tensor (a kernel argument: nothing to re-trace)
    assert len(traces) == (0 if case is _inplace_parameter else 1)
    expected = attention_reference(q, k, v, score_mod=mod)[0]
    assert not torch.allclose(before.double(), expected.double(), atol=1e-3), "the change changes nothing"
    assert_close(out, expected, *TOLERANCES[torch.float32])


def window_mask(b, h, qi, ki):
    return (qi - ki).abs() <= CFG.window


@pytest.mark.parametrize("new_window", [12, 1])
def test_mask_mod_reading_a_global_object(new_window, monkeypatch):
    """create_block_mask's block flags come from a fresh evaluation; the kernel's partial blocks must use the new
    window too (one 64 x 64 partial block: all of the mask is the kernel's)."""
    q, k, v = rand_qkv(B, H, H, L, L, D)
    bm = create_block_mask(window_mask, None, None, L, L, device=DEVICE)
    out = flex_attention(q, k, v, block_mask=bm)
    assert_close(out, attention_reference(q, k, v, block_mask=bm)[0], *TOLERANCES[torch.float32])
    monkeypatch.setattr(CFG, "window", new_window)
    bm = create_block_mask(window_mask, None, None, L, L, device=DEVICE)
    out = flex_attention(q, k, v, block_mask=bm)
    assert_close(out, attention_reference(q, k, v, block_mask=bm)[0], *TOLERANCES[torch.float32])


def _mods():
    obj = Scaled()
    return {
        "callable_object": (obj, None),
        "bound_method": (obj.sm, None),
        "namespace_global": (cap_mod, None),
        "nn_module": (Outer(), None),
        "partial": (functools.partial(Scaled.__call__, obj), None),
        "softcap": (generate_tanh_softcap(2.0), None),
        "relative_bias": (generate_relative_bias(_new(5).repeat(2)[:2 * L - 1]), None),
        "mask_mod_global": (None, window_mask),
        "sliding_window": (None, generate_sliding_window(8)),
        "causal": (cap_mod, causal_mask),
    }


@pytest.mark.parametrize("name", list(_mods()))
def test_unchanged_state_does_not_retrace(name, traces):
    score_mod, mask_mod = _mods()[name]
    q, k, v = rand_qkv(B, H, H, L, L, D)
    bm = create_block_mask(mask_mod, None, None, L, L, device=DEVICE, BLOCK_SIZE=32) if mask_mod else None
    flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)
    traces.clear()
    out = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)
    assert traces == []
    fps = [trace_module.capture_fingerprint(m) for m in (score_mod, mask_mod, bm) if m is not None]
    assert fps == [trace_module.capture_fingerprint(m) for m in (score_mod, mask_mod, bm) if m is not None]
    assert_close(out, attention_reference(q, k, v, score_mod=score_mod, block_mask=bm)[0], *TOLERANCES[torch.float32])


def test_cyclic_and_deep_state_fingerprint():
    """Cycles, deep nesting and wide objects end (depth limit, seen set, object budget); still stable."""

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other, a.me = b, a, a
    deep = Node()
    cur = deep
    for _ in range(50):
        cur.next = Node()
        cur = cur.next
    wide = Node()
    wide.items = [Node() for _ in range(5000)]

    class Mod:
        def __init__(self):
            self.a, self.deep, self.wide = a, deep, wide

        def __call__(self, s, b, h, qi, ki):
            return s

    m = Mod()
    fp = trace_module.capture_fingerprint(m)
    assert fp == trace_module.capture_fingerprint(m)
    a.value = 1.0
    assert fp != trace_module.capture_fingerprint(m)


# ----------------------------------------------------------------------------------------------
# between a forward and its backward: the backward runs the mods again, on what they read then

def _in_place_bias(bias, bm):
    bias.mul_(5)


def _in_place_ids(ids, bm):
    ids.copy_(torch.arange(L, device=DEVICE) // 40)  # a data pipeline writing the next batch's documents


def _in_place_block_list(ids, bm):
    bm.kv_num_blocks.zero_()


@pytest.mark.parametrize("change", [_in_place_bias, _in_place_ids, _in_place_block_list],
                         ids=lambda f: f.__name__[1:])
def test_what_the_forward_read_changed_before_its_backward_is_an_error(change):
    # (each gave gradients of other scores, silently: off by up to 1e14 for the in-place bias)
    bias = torch.randn(L, device=DEVICE)
    ids = torch.arange(L, device=DEVICE) // 20
    cfg = types.SimpleNamespace(cap=2.0)

    def score_mod(score, b, h, q_idx, kv_idx):
        return cfg.cap * torch.tanh(score / cfg.cap) + bias[kv_idx]

    def documents(b, h, q_idx, kv_idx):
        return ids[q_idx] == ids[kv_idx]
    bm = create_block_mask(documents, None, None, L, L, device=DEVICE, BLOCK_SIZE=16)
    q, k, v = (t.requires_grad_() for t in rand_qkv(B, H, H, L, L, D, seed=8))
    out = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)
    change({_in_place_bias: bias, _new_constant: cfg}.get(change, ids), bm)
    with pytest.raises(RuntimeError, match="flex_attention's backward: .* since the forward, so the gradients would "
                                           "be those of other scores"):
        torch.autograd.grad(out, (q, k, v), torch.randn_like(out))


def _rebound_bias(state, bm):
    state.bias = torch.randn(L, device=DEVICE)


def _new_constant(state, bm):
    state.cap = 3.0


def _new_mask_mod(state, bm):
    bm.mask_mod = lambda b, h, q_idx, kv_idx: q_idx >= 0


@pytest.mark.parametrize("change", [_rebound_bias, _new_constant, _new_mask_mod], ids=lambda f: f.__name__[1:])
def test_what_the_forward_traced_rebound_before_its_backward_keeps_the_forwards_gradients(change):
    """The backward runs the forward's traces (their constants and captured tensors), torch ops paths too: a rebound
    attribute, a new constant or a reassigned mask_mod between a forward and its backward changes nothing there,
    as autograd's saved tensors (the forward's objects are what a trace holds; written in place, they are an
    error: the test above)."""
    state = types.SimpleNamespace(cap=2.0, bias=torch.randn(L, device=DEVICE))
    ids = torch.arange(L, device=DEVICE) // 20

    def score_mod(score, b, h, q_idx, kv_idx):
        return state.cap * torch.tanh(score / state.cap) + state.bias[kv_idx]

    def documents(b, h, q_idx, kv_idx):
        return ids[q_idx] == ids[kv_idx]
    bm = create_block_mask(documents, None, None, L, L, device=DEVICE, BLOCK_SIZE=16)
    for dtype in (torch.float32, torch.float64):  # (the kernels; the torch ops)
        q, k, v = (t.to(dtype).requires_grad_() for t in rand_qkv(B, H, H, L, L, D, seed=8))
        ref = attention_reference(q, k, v, score_mod=score_mod, block_mask=bm)[0]
        saved = state.cap, state.bias, bm.mask_mod
        out = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)
        change(state, bm)
        try:
            assert_grads_like_reference(out, ref, (q, k, v))
        finally:
            state.cap, state.bias, bm.mask_mod = saved


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomics", "deterministic captured grads"])
def test_functional_call_trains(monkeypatch, deterministic):
    """torch.func.functional_call puts the module's own parameters back when it returns, before the backward: the
    gradients are those of the parameters it was given (the forward's trace holds them), flex_attention's
    kernels and the reference alike; the captured tensors' gradients by atomics or the deterministic path (which
    runs score_mod in torch ops: the trace's too)."""
    monkeypatch.setenv("FLEXLITE_DETERMINISTIC_CAPTURED_GRADS", "1" if deterministic else "0")
    module = _Attention()
    params = {"slopes": torch.randn(H + 1, generator=torch.Generator().manual_seed(5)).to(DEVICE).requires_grad_()}
    q, k, v = (t.requires_grad_() for t in rand_qkv(B, H, H, L, L, D, seed=12))
    out = torch.func.functional_call(module, params, (q, k, v))
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, params["slopes"]), grad)
    slopes = params["slopes"]
    ref = attention_reference(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s - slopes[h] * (q_idx - kv_idx))[0]
    want = torch.autograd.grad(ref, (q, k, v, params["slopes"]), grad)
    for g, w, tolerances in zip(got, want, [TOLERANCES[torch.float32]] * 3 + [(1e-3, 1e-3)]):
        assert_close(g, w, *tolerances)
    assert not torch.equal(module.slopes, params["slopes"])  # (the module's own, which the gradients are not of)


def test_what_the_forward_read_changed_after_its_backward_is_fine():
    bias = torch.randn(L, device=DEVICE)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx]
    q, k, v = (t.requires_grad_() for t in rand_qkv(B, H, H, L, L, D, seed=9))
    for step in range(2):
        out = flex_attention(q, k, v, score_mod=score_mod)
        ref = attention_reference(q, k, v, score_mod=score_mod)[0]
        grad = torch.randn_like(out)
        for g, w in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
            assert_close(g, w, *TOLERANCES[torch.float32], name=f"step {step}")
        bias.add_(1.0)  # after the backward: the next step's forward reads it


class _Attention(nn.Module):
    """A module passing its own method as the score_mod (slopes learned), from a forward that calls flex_attention."""

    def __init__(self):
        super().__init__()
        self.slopes = nn.Parameter(torch.rand(H + 1, generator=torch.Generator().manual_seed(4)).to(DEVICE))

    def score_mod(self, s, b, h, q_idx, kv_idx):
        return s - self.slopes[h] * (q_idx - kv_idx)

    def forward(self, q, k, v):
        return flex_attention(q, k, v, score_mod=self.score_mod)


class _Table:
    def __init__(self):
        self.t = torch.randn(L, device=DEVICE)

    def score_mod(self, s, b, h, q_idx, kv_idx):
        return s + self.t[kv_idx]


@pytest.mark.parametrize("how", ["module method", "method taken per call"])
def test_a_method_as_score_mod_trains_and_is_traced_once(how, traces):
    """A training loop over a module's method (its fingerprint reaches flex_attention itself through forward, whose
    caches change as it runs) and over ``obj.method`` taken anew per call (an equal method object each time): each
    step's backward runs (no 'changed since the forward'), its gradients are the reference's, and the mod is traced
    once."""
    module, table = _Attention(), _Table()
    q, k, v = (t.requires_grad_() for t in rand_qkv(B, H, H, L, L, D, seed=11))
    previous = []  # the last step's output and method object
    for step in range(3):
        score_mod = module.score_mod if how == "module method" else table.score_mod
        out = module(q, k, v) if how == "module method" else flex_attention(q, k, v, score_mod=score_mod)
        previous.clear()  # (the last step's graph and method object go between this forward and its backward)
        ref = attention_reference(q, k, v, score_mod=score_mod)[0]
        grad = torch.randn_like(out)
        wrt = (q, k, v, module.slopes) if how == "module method" else (q, k, v)
        got = torch.autograd.grad(out, wrt, grad, retain_graph=True)
        for g, w, tolerances in zip(got, torch.autograd.grad(ref, wrt, grad),
                                    [TOLERANCES[torch.float32]] * 3 + [(1e-3, 1e-3)]):  # (slopes: a sum of 4k terms)
            assert_close(g, w, *tolerances, name=f"step {step}")
        previous[:] = [out, score_mod]
        del out, ref, score_mod
    assert len(traces) == 1, traces


_FRESH_PROCESS_STEPS = """
import sys
import torch, torch.nn as nn
from flexlite import flex_attention, create_block_mask
from flexlite.masks import causal_mask

class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.slopes = nn.Parameter(torch.rand(2))

    def score_mod(self, s, b, h, q, kv):
        return s - self.slopes[h] * (q - kv)

    def forward(self, q, k, v):
        bm = create_block_mask(causal_mask, None, None, q.shape[2], q.shape[2], device=q.device, BLOCK_SIZE=32)
        return flex_attention(q, k, v, score_mod=self.score_mod, block_mask=bm)

class Table:
    def __init__(self):
        self.t = torch.randn(64)

    def score_mod(self, s, b, h, q, kv):
        return s + self.t[kv]

DEVICE = sys.argv[1]
m, table = Attn().to(DEVICE), Table()
table.t = table.t.to(DEVICE)
q = torch.randn(1, 2, 64, 16, device=DEVICE, requires_grad=True)
for step in range(3):
    m(q, q, q).sum().backward()
    loss = flex_attention(q, q, q, score_mod=table.score_mod).sum()
    loss.backward()
print("TRAINED", m.slopes.grad is not None)
"""


def test_methods_as_mods_train_in_a_fresh_process():
    """As a user's first steps see it (flexlite's caches filling as its entry points run, which a warm test process
    hides): a module's method over three training steps, and ``obj.method`` taken per call."""
    import os
    import subprocess

    env = {**os.environ, "TRITON_INTERPRET": "1"} if DEVICE == "cpu" else dict(os.environ)
    run = subprocess.run([sys.executable, "-c", _FRESH_PROCESS_STEPS, DEVICE], capture_output=True, text=True,
                         timeout=600, env=env)
    assert run.returncode == 0 and "TRAINED True" in run.stdout, run.stderr[-3000:]


def test_flexlites_entry_points_are_opaque_to_fingerprints():
    # (their globals reach caches that fill as they run: a forward calling them would look changed at every call)
    from flexlite.codegen.trace import capture_fingerprint

    for fn in (flex_attention, create_block_mask):
        assert capture_fingerprint(fn) == (id(fn),)


_CFG_MODULE = types.ModuleType("flexlite_test_cfg")
_CFG_MODULE.cap = 2.0


def _reads_a_module(score, b, h, q_idx, kv_idx):
    return _CFG_MODULE.cap * torch.tanh(score / _CFG_MODULE.cap)


class _Computed(nn.Module):
    """A captured tensor made at each access (a property; parametrizations such as weight_norm do the same)."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(2 * L - 1, device=DEVICE))
        self.scale = nn.Parameter(torch.tensor(0.3, device=DEVICE))

    @property
    def bias(self):
        return self.table * self.scale

    def score_mod(self, s, b, h, q_idx, kv_idx):
        return s + self.bias[q_idx - kv_idx + L - 1]


def test_a_captured_tensor_made_at_each_access_is_taken_anew():
    """Its trace is not kept (the fingerprint never met the tensor it captured): each call takes the current one,
    through training steps (was: the first step's tensor, its freed graph at the second backward) and after an
    update without grad (was: the old values, silently)."""
    m = _Computed()
    q, k, v = (t.requires_grad_() for t in rand_qkv(B, H, H, L, L, D, seed=12))
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    for step in range(2):
        out = flex_attention(q, k, v, score_mod=m.score_mod)
        ref = attention_reference(q, k, v, score_mod=m.score_mod)[0]
        grad = torch.randn_like(out)
        got = torch.autograd.grad(out, (m.table, m.scale), grad)
        want = torch.autograd.grad(ref, (m.table, m.scale), grad)
        for g, w in zip(got, want):
            assert_close(g, w, 1e-3, 1e-3, name=f"step {step}")
        m.table.grad, m.scale.grad = got
        opt.step()
    with torch.no_grad():
        m.scale.add_(1.0)
        assert_close(flex_attention(q, k, v, score_mod=m.score_mod),
                     attention_reference(q, k, v, score_mod=m.score_mod)[0], *TOLERANCES[torch.float32])


def test_what_a_mod_reads_from_a_module_global_or_past_the_walks_limit_is_seen(monkeypatch):
    """``cfg.cap`` of a module (its attributes the code names are fingerprinted), and a value deeper than the
    fingerprint's walk goes (such a mod is not kept: traced at each call)."""
    q, k, v = rand_qkv(B, H, H, L, L, D, seed=13)
    q = q * 4
    flex_attention(q, k, v, score_mod=_reads_a_module)
    monkeypatch.setattr(_CFG_MODULE, "cap", 0.5)
    assert_close(flex_attention(q, k, v, score_mod=_reads_a_module),
                 attention_reference(q, k, v, score_mod=_reads_a_module)[0], *TOLERANCES[torch.float32])

    deep = types.SimpleNamespace(cap=2.0)
    for _ in range(trace_module._MAX_DEPTH + 2):
        deep = types.SimpleNamespace(inner=deep)
    top = deep

    def deep_mod(score, b, h, q_idx, kv_idx):
        node = top
        while hasattr(node, "inner"):
            node = node.inner
        return node.cap * torch.tanh(score / node.cap)
    flex_attention(q, k, v, score_mod=deep_mod)
    node = top
    while hasattr(node, "inner"):
        node = node.inner
    node.cap = 0.5
    assert_close(flex_attention(q, k, v, score_mod=deep_mod), attention_reference(q, k, v, score_mod=deep_mod)[0],
                 *TOLERANCES[torch.float32])


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_around_a_mod_with_a_learned_captured_tensor(reentrant):
    """torch.utils.checkpoint: the trace's example run makes no autograd graph (a non-reentrant checkpoint counted
    its saved tensors), and the backward matches captured tensors to the trace's own (it hands back others)."""
    from torch.utils.checkpoint import checkpoint

    bias = torch.randn(2, device=DEVICE, requires_grad=True)

    def sm(score, b, h, q_idx, kv_idx):
        return score + bias[h] * (q_idx - kv_idx) * 0.1
    q, k, v = (t.requires_grad_() for t in rand_qkv(1, 2, 2, L, L, D, seed=14))
    ref = attention_reference(q, k, v, score_mod=sm)[0]
    grad = torch.randn_like(ref)
    want = torch.autograd.grad(ref, (q, bias), grad)
    out = checkpoint(lambda a, b_, c: flex_attention(a, b_, c, score_mod=sm), q, k, v, use_reentrant=reentrant)
    (out * grad.to(out.dtype)).sum().backward()  # (a reentrant checkpoint takes no autograd.grad)
    for g, w in zip((q.grad, bias.grad), want):
        assert_close(g, w, 1e-3, 1e-3)


def test_a_float64_call_runs_one_trace_forward_and_backward():
    """float64 (torch ops) runs the call's trace in the forward as in the backward: a Python number read from a
    tensor while tracing (a constant of the trace, README) changed since gives one function, not a forward of the
    mod as it is now and a backward of its trace (gradcheck failed)."""
    t = torch.tensor(2.0, dtype=torch.float64)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score * float(t) + torch.where(q_idx >= kv_idx, 0.0, -1.0) * float(t)
    q, k, v = (x.double().requires_grad_() for x in rand_qkv(1, 1, 1, 24, 24, 8, seed=13))
    flex_attention(q, k, v, score_mod=score_mod)  # (traced: the constant is 2)
    t.fill_(3.0)
    assert torch.autograd.gradcheck(lambda q, k, v: flex_attention(q, k, v, score_mod=score_mod), (q, k, v))


PROBED_CAP = 2.0


def probed_mod(s, b, h, qi, ki):
    return s * PROBED_CAP + _PROBED_BIAS[ki] * 0.0


_PROBED_BIAS = torch.zeros(L, device=DEVICE)


def test_a_plain_functions_trace_is_found_by_its_probes(monkeypatch, traces):
    """A plain function (closure, globals, defaults: scalars, tensors, such functions) is found in the trace cache by
    identity checks (its probes) without its fingerprint walked; a rebound global fails them, and the fingerprint
    then re-traces. A mod that reads an object's state is fingerprinted at every call."""
    monkeypatch.setattr(trace_module, "CHECK_PROBES", False)
    walks = []
    real = trace_module._fingerprint_and_truncated
    monkeypatch.setattr(trace_module, "_fingerprint_and_truncated", lambda fn: walks.append(fn) or real(fn))
    cap = 3.0
    closure = lambda s, b, h, qi, ki: s * cap  # noqa: E731
    for mod in (probed_mod, closure):
        first = trace_module.trace_mod(mod, "score_mod")
        walks.clear()
        assert trace_module.trace_mod(mod, "score_mod") is first and walks == []
    monkeypatch.setattr(sys.modules[__name__], "PROBED_CAP", 5.0)
    traces.clear()
    assert trace_module.trace_mod(probed_mod, "score_mod") is not first and len(traces) == 1 and walks
    q, k, v = rand_qkv(B, H, H, L, L, D)
    assert_close(flex_attention(q, k, v, score_mod=probed_mod),
                 attention_reference(q, k, v, score_mod=probed_mod)[0], *TOLERANCES[torch.float32])
    walks.clear()
    trace_module.trace_mod(cap_mod, "score_mod")  # (reads CFG, a SimpleNamespace: its state walked every call)
    trace_module.trace_mod(cap_mod, "score_mod")
    assert len(walks) == 2


def test_attributes_set_on_a_mod_are_probed(monkeypatch, traces):
    """Attributes set on a plain function (flexlite's ALiBi and head biases set ``flexlite_heads``) are probes too,
    by identity: the trace is found without the fingerprint walked; an attribute changed, added or removed fails them,
    and the fingerprint decides (a mod reading its own attribute is traced again, with the new value)."""
    from flexlite.mods import generate_alibi_bias

    monkeypatch.setattr(trace_module, "CHECK_PROBES", False)
    walks = []
    real = trace_module._fingerprint_and_truncated
    monkeypatch.setattr(trace_module, "_fingerprint_and_truncated", lambda fn: walks.append(fn) or real(fn))
    alibi = generate_alibi_bias(H, device=DEVICE)
    assert alibi.__dict__ == {"flexlite_heads": H}
    first = trace_module.trace_mod(alibi, "score_mod")
    walks.clear()
    assert trace_module.trace_mod(alibi, "score_mod") is first and walks == []
    for change in (lambda: setattr(alibi, "note", "x"), lambda: setattr(alibi, "note", "y"),
                   lambda: delattr(alibi, "note")):
        change()
        walks.clear()
        trace_module.trace_mod(alibi, "score_mod")
        assert walks, alibi.__dict__  # (the probes failed: the fingerprint was walked)
        walks.clear()
        trace_module.trace_mod(alibi, "score_mod")
        assert walks == [], alibi.__dict__  # (and the probes taken again for the new attributes)

    def own(s, b, h, qi, ki):
        return s * own.w
    own.w = 2.0
    q, k, v = rand_qkv(B, H, H, L, L, D)
    for w in (2.0, 3.0):
        own.w = w
        traces.clear()
        assert_close(flex_attention(q, k, v, score_mod=own), attention_reference(q, k, v, score_mod=own)[0],
                     *TOLERANCES[torch.float32])
        assert len(traces) == 1, traces  # (traced at its first call, and again once w changed)


def test_probes_that_hold_where_the_fingerprint_changed_are_an_error_when_checked(monkeypatch):
    """With CHECK_PROBES (the suite's default) a probe hit is also fingerprinted: probes that miss what the
    fingerprint reads show in the test that changes it."""
    monkeypatch.setattr(trace_module, "CHECK_PROBES", True)
    trace_module.trace_mod(probed_mod, "score_mod")
    cache, key = trace_module._cache_for(probed_mod)
    fp, traced, probes = cache[key]
    cache[key] = (("another",), traced, probes)
    with pytest.raises(RuntimeError, match="probes hold but its fingerprint changed"):
        trace_module.trace_mod(probed_mod, "score_mod")
