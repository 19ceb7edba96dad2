"""Tolerances and an assertion helper shared by the tests."""

from __future__ import annotations

import os

import torch

from flexlite import reference

# tests run on CPU through Triton's interpreter; FLEXLITE_TEST_DEVICE=cuda runs them on a GPU
DEVICE = os.environ.get("FLEXLITE_TEST_DEVICE", "cpu")

# every input dtype flexlite supports; (atol, rtol) against the fp64 reference, per input dtype
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOLERANCES = reference.TOLERANCES
LSE_TOLERANCES = {torch.float32: (2e-5, 2e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1e-2, 1e-2)}
# gradients (dq, dk, dv, captured tensors): atol is relative to max(1, max |reference gradient|), since
# a gradient is rounded to the input dtype at its own magnitude
GRAD_TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}


def drop_plans(monkeypatch):
    """Forget the plans kept for kinds of call (flexlite.api's, launch_forward_ws'), for this test: after patching a
    decision function (api._float_index, say) the next call decides anew instead of taking what a call before the
    patch kept (FLEXLITE_CHECK_PLANS fails such a call)."""
    import weakref

    import flexlite.api as api
    from flexlite.runtime import launch
    monkeypatch.setattr(api, "_DENSE_PLANS", api._Plans())
    monkeypatch.setattr(api, "_FORWARD_PLANS", weakref.WeakKeyDictionary())
    monkeypatch.setattr(launch, "_WS_FWD_PLANS", {})


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float, name: str = "output"):
    """Like torch.testing.assert_close (infinities must match exactly), reporting the first bad index
    and any NaN."""
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.double().cpu(), expected.double().cpu()
    nan = torch.isnan(a) & ~torch.isnan(e)
    assert not nan.any(), f"{name}: NaN at {nan.nonzero()[:5].tolist()} ({int(nan.sum())} in all)"
    both_inf = torch.isinf(a) & torch.isinf(e) & (torch.sign(a) == torch.sign(e))
    bad = ~both_inf & ~((a - e).abs() <= atol + rtol * e.abs())
    if bad.any():
        first = bad.nonzero()[0].tolist()
        idx = tuple(first)
        diff = (a - e).abs()[~both_inf]
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {a.numel()} elements differ; first at {first}: got {a[idx].item()}, "
            f"expected {e[idx].item()}; max abs diff {diff.max().item():.3g} (atol {atol}, rtol {rtol})")


def assert_grad_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype = torch.float32,
                      name: str = "grad", tolerance_dtype: torch.dtype | None = None):
    """A gradient against the reference's: GRAD_TOLERANCES of ``tolerance_dtype`` (default ``dtype``), atol
    scaled by max(1, max |expected|); ``actual`` must have ``dtype``."""
    atol, rtol = GRAD_TOLERANCES[tolerance_dtype or dtype]
    assert actual.dtype == dtype, f"{name}: dtype {actual.dtype}, expected {dtype}"
    scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
    assert_close(actual, expected, atol * scale, rtol, name=name)


def assert_grads_like_reference(out: torch.Tensor, ref: torch.Tensor, inputs: tuple) -> None:
    """The gradients of ``inputs`` (q, k, v) through ``out`` against those through the reference's ``ref``, for one
    random output gradient (:func:`assert_grad_close` each; float64 inputs to float32's tolerances)."""
    grad = torch.randn_like(out)
    dtype = inputs[0].dtype
    for g, w in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(ref, inputs, grad)):
        assert_grad_close(g, w, dtype, tolerance_dtype=torch.float32 if dtype == torch.float64 else dtype)


def rand_qkv(B, Hq, Hkv, Lq, Lkv, D, Dv=None, dtype=torch.float32, device=DEVICE, seed=0):
    """Random q [B,Hq,Lq,D], k [B,Hkv,Lkv,D], v [B,Hkv,Lkv,Dv] (fresh values, never zeros)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Lq, D, generator=g)
    k = torch.randn(B, Hkv, Lkv, D, generator=g)
    v = torch.randn(B, Hkv, Lkv, Dv or D, generator=g)
    return [t.to(dtype=dtype, device=device) for t in (q, k, v)]
