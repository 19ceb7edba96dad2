"""GPU probe: a change to kernel templates or launch settings against what was before it, in one process.

For each harness mask and head dim (``flexlite.bench.probe_cases``), flexlite's forward and backward as the package
has them ("now") and with the templates or settings named on the command line ("before"): templates rendered from
other files instead (an earlier version, e.g. from ``git show <commit>:flexlite/codegen/templates/bwd_ws.py.jinja``),
settings of flexlite.runtime.launch given other values. Each is checked against the fp64 reference first
(``bench.check_against_reference``, outputs and gradients), then timed (do_bench medians) in rounds of alternating
order after each has run untimed for bench.HEAT_MS (an idle GPU's first calls ran faster than under load: NOTES
89), the best round of each kept. Prints a table: ms of both and their ratio.

Usage: python benchmarks/probe_against.py NAME=VALUE[,NAME=VALUE...] [mask,mask,...] [D,D,...] [--rounds=N]
[--passes=fwd,bwd] [--options=KEY=VALUE[,KEY=VALUE...]]
(NAME: a template file name under flexlite/codegen/templates, e.g. fwd_ws.py.jinja, and VALUE the path of the text
to use; or launch.SETTING, e.g. launch.WS_FWD_PERSISTENT, and VALUE a Python literal, which may hold commas, e.g.
{64,128}; --options: kernel_options for every call of both, e.g. WARP_SPECIALIZE=False for the Triton forward)"""

import ast
import contextlib
import re
import sys
import unittest.mock
from pathlib import Path

from tabulate import tabulate

from flexlite import first_calls, flex_attention
from flexlite.bench import _median_ms, _timed, check_against_reference, heat, probe_args, probe_cases

ROUNDS = 2  # (--rounds=N)


@contextlib.contextmanager
def templates_from(files: dict):
    """Kernels rendered from ``files`` (template name -> path of the text to use instead) while inside."""
    from flexlite.codegen import kernel, render
    load = render.load_template
    texts = {name: Path(path).read_text() for name, path in files.items()}
    render.load_template = lambda name: (render._environment().from_string(texts[name]) if name in texts
                                         else load(name))
    kernel._render.cache_clear()
    try:
        yield
    finally:
        render.load_template = load
        kernel._render.cache_clear()


@contextlib.contextmanager
def before(changes: dict):
    """The templates and launch settings of ``changes`` (NAME -> VALUE, as on the command line) while inside."""
    from flexlite.runtime import launch
    settings = {name.split(".", 1)[1]: ast.literal_eval(value) for name, value in changes.items()
                if name.startswith("launch.")}
    for name in settings:
        if not hasattr(launch, name):
            raise ValueError(f"flexlite.runtime.launch has no setting {name!r}")
    with templates_from({name: path for name, path in changes.items() if not name.startswith("launch.")}), \
            unittest.mock.patch.multiple(launch, **settings) if settings else contextlib.nullcontext():
        yield


def _pairs(text: str) -> dict:
    """``NAME=VALUE[,NAME=VALUE...]`` as a dict; a comma starts a new pair only before ``NAME=``."""
    return dict(pair.split("=", 1) for pair in re.split(r",(?=[\w.]+=)", text))


def main():
    changes = _pairs(sys.argv[1])
    options = next(({k: ast.literal_eval(v) for k, v in _pairs(a.split("=", 1)[1]).items()}
                    for a in sys.argv if a.startswith("--options=")), None)
    rounds = next((int(a.split("=", 1)[1]) for a in sys.argv if a.startswith("--rounds=")), ROUNDS)
    passes = next((a.split("=", 1)[1].split(",") for a in sys.argv if a.startswith("--passes=")), ["fwd", "bwd"])
    masks, dims = probe_args(sys.argv[1:])
    first_calls.EAGER = False  # the kernels, also in calls made while the worker compiles them (a new score_mod's)
    variants = (("now", contextlib.nullcontext), ("before", lambda: before(changes)))
    rows = []
    for D, q, k, v, case, bm in probe_cases(masks, dims):
        errors = {}
        for label, scope in variants:
            with scope():
                errors[label] = max(check_against_reference(case, D, "cuda", backward="bwd" in passes,
                                                            kernel_options=options).values())

        def call():
            return flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm, kernel_options=options)
        for pass_ in passes:
            best = {}
            grads = (q, k, v) if pass_ == "bwd" else None
            for label, scope in variants:  # each run untimed first (bench.heat: the GPU at its clock under load)
                with scope():
                    heat(_timed(call, pass_), grad_to_none=grads)
            for r in range(rounds):  # (each round in the other order)
                for label, scope in variants[::1 if r % 2 == 0 else -1]:
                    with scope():
                        ms = _median_ms(_timed(call, pass_), grad_to_none=grads)
                    best[label] = min(best.get(label, ms), ms)
            rows.append([case.name, f"D{D}", pass_, round(best["now"], 4), round(best["before"], 4),
                         round(best["now"] / best["before"], 4), f"{errors['now']:.2e} / {errors['before']:.2e}"])
            print(rows[-1], flush=True)
    print(tabulate(rows, headers=["mask", "D", "pass", "ms now", "ms before", "now / before",
                                  "max err vs fp64 (now / before)"], tablefmt="github"), flush=True)


if __name__ == "__main__":
    main()
