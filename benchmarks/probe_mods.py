"""GPU probe for what score_mods cost: forward and backward ms of ALiBi + causal (per-head slopes gathered, and
one constant slope; the distance converted to float as an int tile or as float q / kv vectors), softcap + causal (also
with its factors folded into the forward's multiplies, launch.FOLD_SCORE_SCALES: NOTES 46) and an identity score_mod
next to plain causal; each is first checked against the fp64 reference. Prints a table; benchmarks/NOTES.md records
what it showed (17: the ALiBi lowering experiment it was written for).

Usage: python benchmarks/probe_mods.py [D,D,...]"""

import sys

import torch
from tabulate import tabulate

from flexlite import attention_reference, create_block_mask, flex_attention
from flexlite.bench import _median_ms, _timed, mask_cases
from flexlite.mods import alibi_slopes
from flexlite.runtime import launch


def _fold(fn, on: bool):
    """``fn`` run with launch.FOLD_SCORE_SCALES ``on`` (softcap's factors folded into the forward's multiplies)."""
    def run(*args, **kwargs):
        saved, launch.FOLD_SCORE_SCALES = launch.FOLD_SCORE_SCALES, on
        try:
            return fn(*args, **kwargs)
        finally:
            launch.FOLD_SCORE_SCALES = saved
    return run


def _error(score_mod, mask_mod, D: int) -> float:
    g = torch.Generator().manual_seed(0)
    q, k, v = [torch.randn(1, 16, 1024, D, generator=g).to("cuda", torch.bfloat16) for _ in range(3)]
    bm = create_block_mask(mask_mod, None, None, 1024, 1024, device="cuda")
    out = torch.full_like(q, float("nan"))
    out.copy_(flex_attention(q, k, v, score_mod=score_mod, block_mask=bm))
    ref, _ = attention_reference(q, k, v, score_mod=score_mod, block_mask=bm)
    return float((out.double() - ref).abs().max())


def main():
    dims = [int(d) for d in sys.argv[1].split(",")] if len(sys.argv) > 1 else [128, 64]
    rows = []
    for (B, H, S, D) in [(4, 16, 8192, 128), (16, 16, 8192, 64)]:
        if D not in dims:
            continue
        cases = mask_cases(S, H, "cuda")
        q, k, v = [torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
        bm = create_block_mask(cases["causal"].mask_mod, None, None, S, S, device="cuda")
        slopes = alibi_slopes(H, "cuda")
        mods = {"causal": None, "identity score_mod": lambda score, b, h, q_idx, kv_idx: score,
                "alibi_causal": cases["alibi_causal"].score_mod,
                "alibi, float indices": lambda score, b, h, q_idx, kv_idx: score + slopes[h] * (
                    kv_idx.float() - q_idx.float()),
                "alibi, one constant slope (no gather)": lambda score, b, h, q_idx, kv_idx: score + 0.0625 * (
                    kv_idx - q_idx),
                "alibi, constant slope, float indices": lambda score, b, h, q_idx, kv_idx: score + 0.0625 * (
                    kv_idx.float() - q_idx.float()),
                "softcap30_causal, factors folded": cases["softcap30_causal"].score_mod,
                "softcap30_causal, factors in the mod": cases["softcap30_causal"].score_mod}
        for name, score_mod in mods.items():
            fold = (lambda fn: _fold(fn, name.endswith("folded"))) if name.startswith("softcap") else (lambda fn: fn)
            err = fold(_error)(score_mod, cases["causal"].mask_mod, D)
            fwd = fold(lambda score_mod=score_mod: flex_attention(q, k, v, score_mod=score_mod, block_mask=bm))
            row = [name, f"D{D}", f"{err:.1e}", round(_median_ms(fwd), 3),
                   round(_median_ms(_timed(fwd, "bwd"), grad_to_none=[q, k, v]), 3)]
            rows.append(row)
            print(row, flush=True)
    print(tabulate(rows, headers=["mods", "D", "max err (bf16, vs fp64)", "fwd ms", "bwd ms"], tablefmt="github"))


if __name__ == "__main__":
    main()
