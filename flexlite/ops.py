"""Ops that mods may call besides torch's: each is a torch custom op (so torch.fx keeps it as one node
and vmap / autograd work in the reference) with its own lowering."""

from __future__ import annotations

import torch


@torch.library.custom_op("flexlite::tanh_approx", mutates_args=())
def tanh_approx(x: torch.Tensor) -> torch.Tensor:
    """tanh; inside flexlite's GPU kernels the hardware approximation ``tanh.approx.f32`` (max relative
    error about 2**-11, like FlashAttention's softcap). Exact in the reference and on CPU."""
    return torch.tanh(x)


@tanh_approx.register_fake
def _(x):
    return torch.empty_like(x)


def _tanh_approx_vmap(info, in_dims, x):
    return tanh_approx(x), in_dims[0]


def _tanh_approx_setup(ctx, inputs, output):
    ctx.save_for_backward(output)


def _tanh_approx_backward(ctx, grad):
    (y,) = ctx.saved_tensors
    return grad * (1 - y * y)


torch.library.register_vmap("flexlite::tanh_approx", _tanh_approx_vmap)
torch.library.register_autograd("flexlite::tanh_approx", _tanh_approx_backward, setup_context=_tanh_approx_setup)
