"""LLVM's optimization level for the kernels a thread compiles (:class:`llvm_opt_level`).

Self-contained (threading and Triton only): flexlite's compile servers (runtime/compile_server.py), which import
Triton alone, load this file by path to compile at the level the capturing thread asked for.
"""

from __future__ import annotations

import threading

_INSTALL_LOCK = threading.Lock()
_LLVM_LEVEL = threading.local()  # .level: the LLVM optimization level this thread's compiles take ("O0" ...)


class _LLVMAtLevel:
    """Triton's ``llvm`` binding as its NVIDIA backend sees it once :class:`llvm_opt_level` has been asked for a
    level: everything passes through but ``optimize_module``, which takes the level the calling thread asked for
    (Triton's own, O3, where it asked for none). Per thread, so that other kernels compiling at the same time keep
    Triton's level."""

    def __init__(self, llvm):
        self._llvm = llvm

    def __getattr__(self, name):
        return getattr(self._llvm, name)

    def optimize_module(self, module, level, *args, **kwargs):
        asked = getattr(_LLVM_LEVEL, "level", None)
        return self._llvm.optimize_module(module, level if asked is None else getattr(self._llvm, f"OPTIMIZE_{asked}"),
                                          *args, **kwargs)


LLVM_LEVELS = ("O0", "O1", "O2", "O3")


class llvm_opt_level:
    """Context for a launch whose kernel, if Triton compiles it now (in this thread), runs LLVM's optimizer at
    ``level`` (one of :data:`LLVM_LEVELS`; None: Triton's own). Triton's NVIDIA backend calls it at O3, whose SLP
    vectorizer (run without a target machine, Triton's own comment says) packs a tile's mask compares into one
    ``<64 x i1>`` vector that the NVPTX backend then unpacks bit by bit: ~200 shifts and logic ops per partial tile
    of the warp-specialized forward (benchmarks/NOTES.md 65). The level must be part of the kernel's source (the
    templates render it), so that Triton's caches, keyed by source, never mix the two builds. Where the Triton
    build lacks the hook point (``triton.backends.nvidia.compiler.llvm``) kernels compile at Triton's level."""

    _installed = False

    def __init__(self, level: "str | None"):
        if level is not None and level not in LLVM_LEVELS:
            raise ValueError(f"llvm_opt_level: level must be one of {LLVM_LEVELS} or None (the values of "
                             f"launch.WS_FWD_LLVM_OPT_LEVELS / WS_BWD_LLVM_OPT_LEVELS, per head dim), got {level!r}")
        self.level = level
        if level is not None and not llvm_opt_level._installed:
            _install_llvm_at_level()

    def __enter__(self):
        self.previous = getattr(_LLVM_LEVEL, "level", None)
        _LLVM_LEVEL.level = self.level
        return self

    def __exit__(self, *exc):
        _LLVM_LEVEL.level = self.previous
        return False


def _install_llvm_at_level():
    """Put :class:`_LLVMAtLevel` between Triton's NVIDIA backend and its ``llvm`` binding, once."""
    try:
        from triton.backends.nvidia import compiler as nvidia
    except ImportError:  # no NVIDIA backend: nothing compiles through it
        nvidia = None
    with _INSTALL_LOCK:
        if nvidia is not None and hasattr(nvidia, "llvm") and not isinstance(nvidia.llvm, _LLVMAtLevel):
            nvidia.llvm = _LLVMAtLevel(nvidia.llvm)
        llvm_opt_level._installed = True


def current_level() -> "str | None":
    """The level this thread's compiles take (None: Triton's own)."""
    return getattr(_LLVM_LEVEL, "level", None)
