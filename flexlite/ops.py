"""Ops that mods may call besides torch's: each is a torch operator of its own (so torch.fx keeps it as one node)
with its own lowering, computed by torch ops everywhere else (the reference, flexlite.eager, CPU).

``tanh_approx(x)``: tanh; inside flexlite's GPU kernels the hardware approximation ``tanh.approx.f32`` (max relative
error about 2**-11, like FlashAttention's softcap). Exact in the reference and on CPU.

Defined with ``torch.library.Library`` and a composite implementation (``torch.tanh``), which gives autograd and
vmap through tanh's own rules: a ``torch.library.custom_op`` imported torch._dynamo (and sympy) at its first call,
0.8 s on a fast host and ~5 s on the GPU machine's, which a first call in torch ops (flexlite.eager) paid
(benchmarks/NOTES.md 79).
"""

from __future__ import annotations

import torch

_LIBRARY = torch.library.Library("flexlite", "DEF")
_LIBRARY.define("tanh_approx(Tensor x) -> Tensor")


def _tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x)


# the composite kernel serves autograd and fake tensors; under vmap the same composite runs on the batched tensor
# (without it functorch would loop over the batch)
_LIBRARY.impl("tanh_approx", _tanh, "CompositeImplicitAutograd")
_LIBRARY.impl("tanh_approx", _tanh, "FuncTorchBatched")

tanh_approx = torch.ops.flexlite.tanh_approx.default
