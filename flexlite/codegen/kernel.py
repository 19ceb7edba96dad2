"""The codegen pipeline in one call: mods -> trace -> lower -> render -> kernel source.

Tracing is cached per function (:mod:`flexlite.codegen.trace`), lowering per trace (stored on it, so
it is freed with it) and rendering per source text, so a call with known mods costs a fingerprint
check and a few dict lookups, and no cache keeps a captured tensor alive.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

from .lower import LoweredMod, identity_score_mod, lower_mod, noop_mask_mod
from .render import render
from .trace import TracedMod, trace_mod


@dataclasses.dataclass(eq=False)
class GeneratedKernel:
    template: str
    source: str
    score_mod: LoweredMod
    mask_mod: LoweredMod
    has_score_mod: bool

    def mod_args(self) -> list:
        """Runtime values for the captured-tensor parameters (score_mod's first, then mask_mod's)."""
        return self.score_mod.kernel_args() + self.mask_mod.kernel_args()

    @property
    def captured(self) -> list:
        return self.score_mod.tensors + self.mask_mod.tensors


def _lowered(traced: Optional[TracedMod], fn_name: str, prefix: str) -> LoweredMod:
    if traced is None:
        return identity_score_mod() if fn_name == "score_mod" else noop_mask_mod()
    if fn_name not in traced.lowered:
        traced.lowered[fn_name] = lower_mod(traced, fn_name, prefix)
    return traced.lowered[fn_name]


@functools.lru_cache(maxsize=512)
def _render(template: str, sm_source: str, mm_source: str, sm_params: tuple, mm_params: tuple,
            interpret: bool, sm_name: str, mm_name: str) -> str:
    sm = LoweredMod("score_mod", sm_source, list(sm_params), [])
    mm = LoweredMod("mask_mod", mm_source, list(mm_params), [])
    return render(template, sm, mm, interpret=interpret, score_mod_name=sm_name, mask_mod_name=mm_name)


def generate(template: str, score_mod: Optional[Callable], mask_mod: Optional[Callable], *,
             interpret: bool) -> GeneratedKernel:
    """Kernel source for ``template`` with ``score_mod`` / ``mask_mod`` (None: identity / keep all)."""
    sm = trace_mod(score_mod, "score_mod") if score_mod is not None else None
    mm = trace_mod(mask_mod, "mask_mod") if mask_mod is not None else None
    low_sm, low_mm = _lowered(sm, "score_mod", "sm_"), _lowered(mm, "mask_mod", "mm_")
    source = _render(template, low_sm.source, low_mm.source, tuple(low_sm.params), tuple(low_mm.params),
                     interpret, sm.name if sm else "none", mm.name if mm else "none")
    return GeneratedKernel(template, source, low_sm, low_mm, has_score_mod=sm is not None)
