"""GPU probe for backward tuning: per mask and shape, the backward's time under several tile configs, split
into the dK/dV kernel (query without grad: preprocess + dK/dV only) and the dQ kernel (the rest). First a
correctness check of the backward at odd sizes against the fp64 reference. Prints tables;
benchmarks/NOTES.md records what they showed.

``--warps``: the D128 dK/dV kernel at the default 64x64 tiles with 4 or 8 warps (8 warps: no spills in the offline
compile, benchmarks/offline_compile.py --backward; NOTES 34), the dQ kernel at its default.

Usage: python benchmarks/probe_bwd.py [mask,mask,...] [D,D,...] [--warps]
"""

import sys

import torch
import triton.testing
from tabulate import tabulate

import flexlite.api
from flexlite import attention_reference, create_block_mask, flex_attention
from flexlite.bench import mask_cases
from flexlite.runtime import launch

# (BLOCK_M1, BLOCK_N1, warps, stages) of the dK/dV kernel, paired with (BLOCK_M2, BLOCK_N2, warps, stages) of dQ
SPACE = {
    128: [((64, 64, 4, 3), (64, 64, 4, 3)), ((32, 64, 4, 3), (64, 32, 4, 3)), ((64, 128, 8, 3), (128, 64, 8, 3)),
          ((64, 128, 8, 2), (128, 64, 8, 2)), ((32, 128, 8, 3), (128, 32, 8, 3)), ((64, 64, 4, 2), (64, 64, 4, 2)),
          ((32, 64, 4, 2), (64, 32, 4, 2)), ((128, 128, 8, 2), (128, 64, 8, 2))],
    64: [((64, 128, 8, 3), (128, 64, 8, 3)), ((64, 64, 4, 3), (64, 64, 4, 3)), ((32, 128, 4, 3), (128, 32, 4, 3)),
         ((32, 64, 4, 3), (64, 32, 4, 3)), ((64, 128, 8, 2), (128, 64, 8, 2)), ((32, 128, 8, 3), (128, 32, 8, 3)),
         ((64, 64, 4, 4), (64, 64, 4, 4)), ((128, 128, 8, 3), (128, 128, 8, 3))],
}

# --warps
WARPS_SPACE = {128: [((64, 64, 4, 2), (64, 64, 4, 2)), ((64, 64, 8, 2), (64, 64, 4, 2)),
                     ((64, 64, 8, 3), (64, 64, 4, 2)), ((32, 64, 4, 2), (64, 64, 4, 2))]}


def check():
    rows = []
    for (Lq, Lkv, D, name) in [(1000, 777, 128, "causal"), (333, 1024, 64, "document_8_causal"),
                               (1024, 1024, 128, "softcap30_causal"), (512, 512, 80, "alibi_causal"),
                               (2048, 2048, 64, "sliding_window_1024")]:
        try:
            rows.append([f"{name} Lq{Lq} Lkv{Lkv} D{D}"] + check_one(Lq, Lkv, D, name))
        except Exception as e:  # noqa: BLE001 - report and go on to the timings
            rows.append([f"{name} Lq{Lq} Lkv{Lkv} D{D}", f"{type(e).__name__}: {e}"[:200], "", "", ""])
    print(tabulate(rows, headers=["backward check (bf16, GQA 2)", "out", "dq", "dk", "dv"], tablefmt="github"),
          flush=True)


def check_one(Lq, Lkv, D, name):
    """Max errors vs fp64 (relative to each tensor's largest reference value) of out, dq, dk, dv."""
    case = mask_cases(max(Lq, Lkv), 4, "cuda")[name]
    q = torch.randn(2, 4, Lq, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = [torch.randn(2, 2, Lkv, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2)]
    bm = create_block_mask(case.mask_mod, None, None, Lq, Lkv, device="cuda") if case.mask_mod else None
    out = flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm, enable_gqa=True)
    ref, _ = attention_reference(q, k, v, score_mod=case.score_mod, block_mask=bm, enable_gqa=True)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref, (q, k, v), dout.double())
    return [f"{(a.double() - b).abs().max().item() / max(1.0, b.abs().max().item()):.2e}"
            for a, b in zip((out,) + got, (ref,) + want)]


def main():
    check()
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    space = WARPS_SPACE if "--warps" in sys.argv else SPACE
    masks = args[0].split(",") if args else ["causal", "document_8_causal"]
    dims = [int(d) for d in args[1].split(",")] if len(args) > 1 else sorted(space, reverse=True)
    real_config = launch.backward_config
    rows = []
    for D in dims:
        B, H, S = (4, 16, 8192) if D == 128 else (16, 16, 8192)
        q, k, v = [torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
        cases = mask_cases(S, H, "cuda")
        for name in masks:
            case = cases[name]
            bm = create_block_mask(case.mask_mod, None, None, S, S, device="cuda") if case.mask_mod else None
            dout = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
            for (dkdv, dq) in space[D]:
                cfg = launch.BackwardTileConfig(dkdv[0], dkdv[1], dq[0], dq[1], dkdv[2], dkdv[3], dq[2], dq[3])
                flexlite.api.backward_config = lambda *a, cfg=cfg, **kw: cfg
                times = []
                try:
                    for q_grad in (False, True):
                        qq = q.detach().requires_grad_(q_grad)
                        out = flex_attention(qq, k, v, score_mod=case.score_mod, block_mask=bm)
                        inputs = (qq, k, v) if q_grad else (k, v)
                        times.append(triton.testing.do_bench(
                            lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True), rep=60))
                    rows.append([name, f"D{D}", "x".join(map(str, dkdv)), "x".join(map(str, dq)),
                                 round(times[0], 3), round(times[1] - times[0], 3), round(times[1], 3)])
                except Exception as e:  # noqa: BLE001 - a config that does not compile or fit: note it, go on
                    rows.append([name, f"D{D}", "x".join(map(str, dkdv)), "x".join(map(str, dq)),
                                 type(e).__name__[:20], str(e).splitlines()[0][:40] if str(e) else "", ""])
                print(rows[-1], flush=True)
    flexlite.api.backward_config = real_config
    print(tabulate(rows, headers=["mask", "D", "dkdv cfg", "dq cfg", "dkdv ms", "dq ms", "total ms"],
                   tablefmt="github"))


if __name__ == "__main__":
    main()
