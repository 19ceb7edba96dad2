"""What every public entry point that launches kernels wraps its work in: the inputs' GPU made current
(:func:`on_device`) and opacity to torch.compile (:func:`opaque_to_compile`)."""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Callable

import torch


_NOTHING = contextlib.nullcontext()  # (reusable)
# whether any autocast is on, in ~0.1 us (torch's private check; without it, the public per-device one)
_ANY_AUTOCAST = getattr(torch._C, "_is_any_autocast_enabled", None)


def on_device(device: torch.device):
    """A context making ``device`` the current CUDA device where it is not (Triton launches on the current device and
    its stream, whatever device the arguments are on: cuda:1 tensors with cuda:0 current would run on the wrong GPU);
    nothing to do for CPU tensors or the current GPU."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return _NOTHING


def autocast_on(tensor: torch.Tensor) -> bool:
    """Whether torch.autocast is on for ``tensor``'s device type (CUDA or CPU)."""
    if _ANY_AUTOCAST is not None and not _ANY_AUTOCAST():
        return False
    device_type = tensor.device.type
    return device_type in ("cuda", "cpu") and torch.is_autocast_enabled(device_type)


def work_scope(tensor: torch.Tensor, autocast: bool):
    """The context flex_attention's forward and backward run in: ``tensor``'s GPU current (:func:`on_device`) and, with
    ``autocast`` (on for its device: the inputs are cast already), torch.autocast off, so that the torch ops inside
    stay as written. A shared no-op where neither applies (a decoding step's host time: benchmarks/host_path.py)."""
    switch = tensor.is_cuda and tensor.get_device() != torch.cuda.current_device()
    if not (autocast or switch):
        return _NOTHING
    scope = contextlib.ExitStack()
    if autocast:
        scope.enter_context(torch.autocast(tensor.device.type, enabled=False))
    if switch:
        scope.enter_context(torch.cuda.device(tensor.device))
    return scope


@functools.cache
def _dynamo_skip_code() -> Callable:
    """torch's private ``torch._dynamo.eval_frame.skip_code`` (marks a code object for Dynamo to skip: its frame runs
    as it is, not compiled), or a no-op where it is missing. Called once Dynamo is loaded."""
    return getattr(sys.modules["torch._dynamo"].eval_frame, "skip_code", None) or (lambda code: None)


def opaque_to_compile(fn: Callable) -> Callable:
    """``fn`` run as it is inside torch.compile: a graph break, then eager (Dynamo would trace into Triton's launcher,
    or its interpreter on CPU, and fail). Also for ``torch.compile(fn)`` itself, the attention-gym habit:
    torch.compile unwraps a torch.compiler.disable wrapper it is handed, not one it meets inside a function. The
    disabled function is made once Dynamo is loaded (nothing compiles before): made up front, torch.compiler.disable
    imports Dynamo and ``import flexlite`` took 1 s longer.

    Dynamo also compiles the frame of ``opaque`` itself (run eagerly after the graph break, or handed to torch.compile):
    nothing, one cache entry per entry point, grad mode and autocast state, all entry points sharing its code object,
    so that a compiled model's train / eval steps with and without autocast hit its recompile limit (a warning naming
    ``opaque``). Each run of a disabled function marks that code object for Dynamo to skip
    (:func:`_dynamo_skip_code`): a frame run as it is, not compiled; a call inside a compiled function still
    graph-breaks there (and fullgraph=True still refuses it). The mark is made on every call (0.4 us), since ``torch._dynamo.reset()`` clears it."""
    disabled = []

    @functools.wraps(fn)
    def skipping(*args, **kwargs):
        _dynamo_skip_code()(opaque.__code__)  # (one code object, shared by every entry point's wrapper)
        return fn(*args, **kwargs)

    @functools.wraps(fn)
    def opaque(*args, **kwargs):
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        if not disabled:
            disabled.append(torch.compiler.disable(skipping))
        return disabled[0](*args, **kwargs)
    opaque.flexlite_entry_point = True  # (a mod's fingerprint does not walk into it: codegen.trace)
    return opaque
