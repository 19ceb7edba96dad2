"""GPU probe for the backward's dQ: a separate dQ kernel (recomputes P: seven matmuls per tile in all) against
dQ accumulated by the dK/dV kernel with fp32 atomics (five matmuls), per-element atomics or the copy engine's
bulk reduce-add (launch.DQ_ATOMIC / DQ_ATOMIC_TMA); torch's flex backward in the same process. Each variant
is first checked against the fp64 reference (bf16, out and gradients). Prints a table; benchmarks/NOTES.md
records what it showed.

Usage: python benchmarks/probe_dq.py [mask,mask,...] [D,D,...] [--no-torch-flex]"""

import sys

import torch
from tabulate import tabulate

from flexlite import create_block_mask, flex_attention
from flexlite.bench import _median_ms, _timed, check_against_reference, mask_cases
from flexlite.runtime import launch

VARIANTS = {"separate dQ kernel": (False, False), "atomic, per element": (True, False),
            "atomic, bulk reduce (TMA)": (True, True)}


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    masks = args[0].split(",") if args else ["full", "causal", "sliding_window_1024", "prefix_lm_2048",
                                             "document_8_causal", "alibi_causal", "softcap30_causal"]
    dims = [int(d) for d in args[1].split(",")] if len(args) > 1 else [128, 64]
    torch_flex = "--no-torch-flex" not in sys.argv
    if torch_flex:
        from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask
        from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention
        compiled = torch.compile(torch_flex_attention, dynamic=False)
    defaults = launch.DQ_ATOMIC, launch.DQ_ATOMIC_TMA
    rows = []
    for (B, H, S, D) in [(4, 16, 8192, 128), (16, 16, 8192, 64)]:
        if D not in dims:
            continue
        q, k, v = [torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3)]
        cases = mask_cases(S, H, "cuda")
        for name in masks:
            case = cases[name]
            bm = create_block_mask(case.mask_mod, None, None, S, S, device="cuda") if case.mask_mod else None
            fwd = lambda: flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm)  # noqa: E731
            times = {}
            for label, (atomic, tma) in VARIANTS.items():
                launch.DQ_ATOMIC, launch.DQ_ATOMIC_TMA = atomic, tma
                try:
                    err = max(check_against_reference(case, D, "cuda", backward=True).values())
                    times[label] = round(_median_ms(_timed(fwd, "bwd"), grad_to_none=[q, k, v]), 3)
                except Exception as e:  # noqa: BLE001 - a variant that fails to compile is a finding
                    print(f"{name} D{D} {label}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    err, times[label] = float("nan"), float("nan")
                row = [name, f"D{D}", label, f"{err:.1e}", times[label],
                       round(times["separate dQ kernel"] / times[label], 3)]
                if torch_flex:
                    if "torch" not in times:
                        tbm = torch_create_block_mask(case.mask_mod, None, None, S, S, device="cuda") \
                            if case.mask_mod else None
                        tfwd = lambda: compiled(q, k, v, score_mod=case.torch_score_mod, block_mask=tbm)  # noqa: E731
                        times["torch"] = round(_median_ms(_timed(tfwd, "bwd"), grad_to_none=[q, k, v]), 3)
                    row += [times["torch"], round(times["torch"] / times[label], 3)]
                rows.append(row)
                print(row, flush=True)
    launch.DQ_ATOMIC, launch.DQ_ATOMIC_TMA = defaults
    headers = ["mask", "D", "dQ", "max err vs fp64", "bwd ms", "vs separate"]
    if torch_flex:
        headers += ["torch flex bwd ms", "speedup vs torch flex"]
    print(tabulate(rows, headers=headers, tablefmt="github"))


if __name__ == "__main__":
    main()
