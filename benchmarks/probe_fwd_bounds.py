"""GPU probe: what bounds the Gluon forward's tile, by taking parts of it away (NOTES 83).

The package's fwd_ws.py.jinja and variants of it made by replacing source lines (the probe fails if a line is not
found), each timed (do_bench medians, the best of --rounds) at the harness shapes whose head dims are named, for
masks without a score_mod (the variants change that path only). The variants compute wrong outputs, so nothing is
checked against the reference; they exist to be timed:
- ``noexp``: P's exponentials gone (P = the exponent itself, on the FMA pipes; the rescale's stay);
- ``nosoftmax``: no row max, exponentials or row sums (P = the scaled scores);
- ``nopv``: no P V in the walk (S waited for alone);
- ``noturn``: the warpgroups issue their matmuls as they come at every head dim (no ping-pong waits);
- ``sonly``, ``pvonly``: one matmul alone (no softmax; ``pvonly``'s S a function of the columns instead of Q K^T).
Prints ms per variant and its ratio to the package's kernel.

--stages64=N: the K / V ring's stages at D64 (launch.WS_TILES) for the package and every variant.
(At D64 the forward runs three consumer warpgroups since NOTES 84, with the stages of launch.WS_FWD_WIDE_TILES,
which --stages64 leaves as they are.)

Usage: python benchmarks/probe_fwd_bounds.py [mask,mask,...] [D,D,...] [--rounds=N] [--variants=a,b,...]
[--stages64=N]"""

import sys
import tempfile
import unittest.mock
from pathlib import Path

from tabulate import tabulate

from flexlite import first_calls, flex_attention
from flexlite.bench import _median_ms, probe_args, probe_cases
from flexlite.codegen import render
from flexlite.runtime import launch

sys.path.insert(0, str(Path(__file__).parent))
from probe_against import templates_from  # noqa: E402

TEMPLATE = "fwd_ws.py.jinja"
# variant -> (source text, its replacement) pairs
VARIANTS = {
    "noexp": (('{% if poly_exp2 %}ws_exp2({{ arg }}, EXP2_ONE_IN){% else %}gl.exp2({{ arg }}){% endif %}',
               "({{ arg }})"),),
    "nosoftmax": (("        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)\n", "        m_new = m_i\n"),
                  ('        p = {{ p_exp2("s * qk_scale - gl.expand_dims(m_safe, 1)") }}\n',
                   "        p = s * qk_scale\n"),
                  ("    return p, alpha, l_i * alpha + gl.sum(p, 1), m_new\n", "    return p, alpha, l_i, m_new\n")),
    "nopv": (("        o = warpgroup_mma(p_cur, v_smem.index(sp), o, is_async=True)\n", ""),
             ("num_outstanding=1, deps=(s, ))  # P V(j-1) may still run", "num_outstanding=0, deps=(s, ))")),
    "noturn": (("    if TURNS:\n        mbarrier.wait(turn.index(WG), phase=r & 1)\n",
                "    if False:\n        mbarrier.wait(turn.index(WG), phase=r & 1)\n"),),
}
# the matmuls alone: S alone (no softmax, no P V), P V alone (no softmax; S(j) in the walk a function of the columns
# and of l_i, which the compilers cannot fold, instead of Q K^T)
VARIANTS["sonly"] = VARIANTS["nosoftmax"] + VARIANTS["nopv"]
VARIANTS["pvonly"] = VARIANTS["nosoftmax"] + (
    ("""        s = warpgroup_mma(q, k_smem.index(sj).permute((1, 0)), gl.zeros([HALF, BLOCK_N], gl.float32, layout=s_layout),
                          use_acc=False, is_async=True)
""", """        s = gl.expand_dims(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout)).to(gl.float32), 0) * \\
            gl.expand_dims(l_i * 0.0 + 1e-3, 1)
"""),
    ("        s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))  # P V(j-1) may still run\n", ""))


def variant_source(name: str) -> str:
    """The package's template with variant ``name``'s replacements (each source text found exactly once)."""
    text = (Path(render.__file__).parent / "templates" / TEMPLATE).read_text()
    for old, new in VARIANTS[name]:
        if text.count(old) != 1:
            raise ValueError(f"variant {name!r}: {old.strip()!r} found {text.count(old)} times in {TEMPLATE}")
        text = text.replace(old, new)
    return text


def main():
    masks, dims = probe_args(sys.argv)
    rounds = next((int(a.split("=", 1)[1]) for a in sys.argv if a.startswith("--rounds=")), 2)
    names = next((a.split("=", 1)[1].split(",") for a in sys.argv if a.startswith("--variants=")), list(VARIANTS))
    stages = next((int(a.split("=", 1)[1]) for a in sys.argv if a.startswith("--stages64=")), None)
    if stages is not None:
        unittest.mock.patch.object(launch, "WS_TILES", {**launch.WS_TILES, 64: dict(launch.WS_TILES[64],
                                                                                   STAGES=stages)}).start()
    first_calls.EAGER = False  # (the kernels, also in a new template's first calls)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for name in names:
            paths[name] = Path(tmp) / f"{name}.jinja"
            paths[name].write_text(variant_source(name))
        for D, q, k, v, case, bm in probe_cases(masks, dims, requires_grad=False):
            if case.score_mod is not None:
                raise ValueError(f"{case.name}: the variants change the path without a score_mod only")
            best = {}
            for r in range(rounds):
                for name in ["base", *names]:
                    scope = templates_from({TEMPLATE: paths[name]}) if name != "base" else templates_from({})
                    with scope:
                        flex_attention(q, k, v, block_mask=bm)  # (compiled before it is timed)
                        ms = _median_ms(lambda: flex_attention(q, k, v, block_mask=bm))
                    best[name] = min(best.get(name, ms), ms)
            for name in names:
                rows.append([case.name, f"D{D}", name, round(best["base"], 4), round(best[name], 4),
                             round(best[name] / best["base"], 4)])
                print(rows[-1], flush=True)
    print(tabulate(rows, headers=["mask", "D", "variant", "ms package", "ms variant", "variant / package"],
                   tablefmt="github"), flush=True)


if __name__ == "__main__":
    main()
