"""GPU probe: the dense walk's D64 forward (no block mask) per score_mod at LLVM O3 against O0, and at O0 with the
wide items (three consumer warpgroups) taken only where their kernel spills nothing (benchmarks/NOTES.md 108).

One process, B16 H16 S8192 D64 bf16 (lengths multiples of 128: the dense walk takes launch.WS_FWD_LLVM_OPT_LEVELS and
WS_FWD_DENSE_WIDE_MAX_LOCAL there); each variant's kernels compiled in the call (first_calls off), its output compared
bit for bit with the first variant's, then timed in alternating rounds (bench.time_rounds), the best round kept.

Usage: python benchmarks/probe_dense_levels.py [--rounds=N]"""

import sys

import torch

from flexlite import first_calls, flex_attention
from flexlite.bench import time_rounds
from flexlite.mods import generate_alibi_bias, generate_tanh_softcap
from flexlite.runtime import launch

# variant -> (WS_FWD_LLVM_OPT_LEVELS, WS_FWD_DENSE_WIDE_MAX_LOCAL)
VARIANTS = {"O3": ({128: "O0"}, 48), "O0": ({64: "O0", 128: "O0"}, 48), "O0, no spills": ({64: "O0", 128: "O0"}, 0)}


def main():
    rounds = next((int(a.split("=", 1)[1]) for a in sys.argv if a.startswith("--rounds=")), 4)
    first_calls.ENABLED = False
    B, H, S, D = 16, 16, 8192, 64
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    mods = {"none": None, "softcap": generate_tanh_softcap(30.0, approx=True),
            "alibi": generate_alibi_bias(H, device="cuda"),
            "relative": lambda score, b, h, q_idx, kv_idx: score - 0.01 * (q_idx - kv_idx).abs()}
    for name, mod in mods.items():
        def call(variant, mod=mod):
            def f():
                launch.WS_FWD_LLVM_OPT_LEVELS, launch.WS_FWD_DENSE_WIDE_MAX_LOCAL = VARIANTS[variant]
                return flex_attention(q, k, v, score_mod=mod)
            return f
        fns = {variant: call(variant) for variant in VARIANTS}
        outs = [f() for f in fns.values()]
        same = all(torch.equal(outs[0], out) for out in outs[1:])
        times, errors = time_rounds(fns, rounds=rounds)
        best = {variant: min(t) for variant, t in times.items() if t}
        print(f"{name:9s}", "  ".join(f"{variant} {ms:.4f} ms ({ms / best['O3']:.4f})" for variant, ms in best.items()),
              f" same bits: {same}", errors or "", flush=True)


if __name__ == "__main__":
    main()
