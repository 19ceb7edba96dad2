"""Jinja environment: render a kernel template with lowered mods spliced in.

Templates know nothing about tracing: they receive each mod as ready Triton source plus the names of
its captured-tensor parameters.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Optional

import jinja2

from ..runtime.compile import cache_dir
from .exp2 import poly_exp2_asm, poly_exp2_constraints
from .lower import LoweredMod

TEMPLATE_DIR = Path(__file__).parent / "templates"


@functools.lru_cache(maxsize=None)
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        bytecode_cache=_bytecode_cache(),
    )


def _bytecode_cache() -> Optional[jinja2.BytecodeCache]:
    """The templates' compiled code kept on disk (``<cache_dir>/templates``, Jinja's own cache: keyed by template,
    checked against its source, written atomically), so that a later process's first render loads it instead of
    compiling the templates again (0.19 s of a first call on the H200's host: benchmarks/NOTES.md 105). None where
    that folder cannot be made or written (the templates then compile in every process, as before)."""
    try:
        folder = cache_dir() / "templates"
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return jinja2.FileSystemBytecodeCache(str(folder)) if os.access(folder, os.W_OK) else None


def load_template(name: str) -> jinja2.Template:
    return _environment().get_template(name)


def _param_list(names: list) -> str:
    """``"a, b, "`` (trailing comma so it splices before more arguments) or ``""``."""
    return "".join(f"{n}, " for n in names)


def render(template: str, score_mod: LoweredMod, mask_mod: LoweredMod, *, interpret: bool,
           score_mod_name: str = "none", mask_mod_name: str = "none", extra_mods: Optional[dict] = None,
           compact_bias_dims: tuple = (), affine_bias_dims: tuple = (), score_bound: Optional[float] = None,
           llvm_opt_levels: tuple = (), poly_exp2: tuple = (), mask_decide=None) -> str:
    """Render ``template`` (e.g. ``"fwd.py.jinja"``) into kernel source text.

    ``extra_mods`` (name -> LoweredMod or None), for the backward's derivative functions: each becomes
    ``<name>_source`` and ``<name>_args`` ("" if None), and all their parameters ``extra_params``.
    ``compact_bias_dims`` (fwd_ws.py.jinja): the head dims at which a separable score_mod's bias along the keys is
    computed on a compact vector; ``affine_bias_dims`` (fwd_ws.py.jinja): those at which a bias affine in kv_idx
    (:attr:`LoweredMod.affine_keys`) is taken as one vector per walk plus a scalar per tile. ``score_bound``
    (fwd_ws.py.jinja): a bound of score_mod's output in base 2 that the kernel takes instead of the running row max.
    ``llvm_opt_levels`` (the Gluon templates, fwd_ws.py.jinja and bwd_ws.py.jinja): (head dim, LLVM optimization
    level) pairs, the level the kernel compiles at per head dim (others: Triton's own; llvm_level.llvm_opt_level).
    ``poly_exp2`` (fwd_ws.py.jinja): (head dim, N) pairs, P's exponentials one in N by a polynomial on the FMA pipes
    at that head dim (codegen.exp2; nothing rendered without).
    ``mask_decide`` (the forward and backward templates): mask_mod's :class:`~flexlite.codegen.decide.MaskVariants`,
    the terms a partial tile's index ranges decide taken out per tile (None: the whole mask on every partial tile).
    """
    extra = {}
    extra_params = []
    # score_mod's hoisted values: computed once per kernel (``score_hoist(b, h)`` gives the line that does it) and
    # passed down the kernel's functions under these names
    hoisted = [f"sm_h_{name}" for name in score_mod.hoisted]

    def score_hoist(b: str, h: str) -> str:
        if not hoisted:
            return "pass  # score_mod has no loop-invariant values"
        return f"{', '.join(hoisted)} = score_mod_hoist({', '.join([b, h] + score_mod.params)})"

    # mask_mod's values along one side of a tile (lowered with hoist b, h, q_idx for bwd_ws.py.jinja, whose tiles
    # have the queries along their columns; b, h, kv_idx for fwd_ws.py.jinja): the kernel computes them per tile on a
    # compact vector with ``mask_mod_hoist`` and hands them to mask_mod under these names (``mask_side_params``)
    mask_side = [f"mm_v_{name}" for name in mask_mod.hoisted]

    for name, mod in (extra_mods or {}).items():
        extra[f"{name}_source"] = mod.source if mod is not None else ""
        extra[f"{name}_args"] = _param_list(mod.params) if mod is not None else ""
        extra_params += mod.params if mod is not None else []
    return load_template(template).render(
        template_name=template,
        interpret=interpret,
        score_mod_source=score_mod.source + ("\n\n" + score_mod.hoist_source if score_mod.hoist_source else ""),
        mask_mod_source=mask_mod.source + ("\n\n" + mask_mod.hoist_source if mask_mod.hoist_source else "") +
        ("\n\n" + mask_decide.source if mask_decide is not None else ""),
        mask_decide=mask_decide is not None,
        mask_decide_codes=sorted(mask_decide.variants) if mask_decide is not None else [],
        mask_decide_empty=mask_decide.empty if mask_decide is not None else None,
        score_mod_name=score_mod_name,
        mask_mod_name=mask_mod_name,
        score_args=_param_list(hoisted + score_mod.params),
        mask_args=_param_list(mask_side + mask_mod.params),
        mask_side=mask_side,
        mask_side_params=_param_list(mask_side),
        mask_params=_param_list(mask_mod.params),
        mod_params=_param_list(score_mod.params + mask_mod.params),
        inner_params=_param_list(score_mod.params + mask_mod.params + hoisted),
        score_hoist=score_hoist,
        # score_mod's constant factors left to the kernel (lower_mod's fold_scales), as Python float literals (the
        # templates multiply the output's by LOG2E: the forward's exp2 argument then one FMA, as without a score_mod)
        score_in_scale=None if score_mod.in_scale is None else repr(float(score_mod.in_scale)),
        score_out_scale=None if score_mod.out_scale is None else repr(float(score_mod.out_scale)),
        # score_mod is the score plus a bias of a query side and a key side (lower_mod's separate): the forwards add
        # the key side to each score and the query side to each row's LSE
        score_separable=score_mod.separable,
        # and that bias is affine in kv_idx: its key side a vector of the tile's columns computed once per walk plus a
        # scalar per tile, added to the row max (lower_mod's affine_keys)
        score_affine=score_mod.separable and score_mod.affine_keys,
        compact_bias_dims=compact_bias_dims,
        affine_bias_dims=affine_bias_dims,
        score_bound=None if score_bound is None else repr(float(score_bound)),
        llvm_opt_levels=repr(dict(llvm_opt_levels)),
        poly_exp2=poly_exp2,
        poly_exp2_asm={n: (poly_exp2_asm(n), poly_exp2_constraints(n)) for n in sorted({n for _, n in poly_exp2})},
        extra_params=_param_list(extra_params),
        **extra,
    )
