"""GPU probe for the warp-specialized dK / dV kernel (bwd_ws.py.jinja, Gluon): the backward's time with it and with
the Triton dK / dV kernel (the preprocess and dQ kernels are the same), for every harness mask at both harness
shapes, in one process; each first checked against the fp64 reference (bf16, out and dq / dk / dv). Prints a table;
benchmarks/NOTES.md (40) records what it showed.

Usage: python benchmarks/probe_bwd_ws.py [mask,mask,...] [D,D,...] [--tiles M:S,M:S] [--dq kernel,fused]
(--tiles: the kernel's queries per step and Q / dO ring stages to compare, e.g. 64:2,64:3; default
launch.WS_BWD_TILES; --dq: how dQ is made with it: by the Triton dQ kernel or by the dK / dV programs
(launch.WS_BWD_FUSED_DQ); default the launch's)"""

import sys

import torch
from tabulate import tabulate

import flexlite.api
from flexlite import flex_attention
from flexlite.bench import _median_ms, check_against_reference, probe_args, probe_cases
from flexlite.runtime import launch

def main():
    masks, dims = probe_args(sys.argv)
    tiles = [tuple(int(x) for x in t.split(":")) for t in sys.argv[sys.argv.index("--tiles") + 1].split(",")] \
        if "--tiles" in sys.argv else [None]
    dq_modes = sys.argv[sys.argv.index("--dq") + 1].split(",") if "--dq" in sys.argv else [None]
    saved = {name: getattr(launch, name) for name in ("WS_BWD_TILES", "WS_BWD_FUSED_DQ")}
    heuristic = flexlite.api._warp_specialize_backward
    # (label, warp-specialized, (BLOCK_M, STAGES) or None for the defaults, dQ mode or None for the default)
    variants = [("Triton", False, None, None)] + [
        (" ".join(["ws"] + ([f"{t[0]}x{t[1]}"] if t else []) + ([f"dQ {m}"] if m else [])), True, t, m)
        for t in tiles for m in dq_modes]
    rows = []
    for D, q, k, v, case, bm in probe_cases(masks, dims):
        row = [case.name, f"D{D}"]
        grads = []
        out = flex_attention(q, k, v, score_mod=case.score_mod, block_mask=bm)
        dout = torch.randn_like(out)
        for _, ws, t, mode in variants:
            flexlite.api._warp_specialize_backward = lambda *args, ws=ws, **kwargs: ws
            launch.WS_BWD_TILES = {d: dict(c, BLOCK_M=t[0], STAGES=t[1]) if t else c
                                   for d, c in saved["WS_BWD_TILES"].items()}
            launch.WS_BWD_FUSED_DQ = saved["WS_BWD_FUSED_DQ"] if mode is None else mode != "kernel"
            err = check_against_reference(case, D, "cuda", backward=True)
            grads.append(torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
            bwd = lambda: out.backward(dout, retain_graph=True)  # noqa: E731
            row += [f"{max(e for n, e in err.items() if n != 'max_err_vs_fp64'):.1e}",
                    round(_median_ms(bwd, grad_to_none=[q, k, v]), 3)]
        diff = max(float((a.float() - b.float()).abs().max()) for g in grads[1:] for a, b in zip(grads[0], g))
        row.append(f"{diff:.1e}")
        row += [round(row[3] / row[5 + 2 * i], 3) for i in range(len(variants) - 1)]
        rows.append(row)
        print(row, flush=True)
    flexlite.api._warp_specialize_backward = heuristic
    for name, value in saved.items():
        setattr(launch, name, value)
    headers = ["mask", "D"] + [h for label, *_ in variants for h in (f"max grad err ({label})", "bwd ms")]
    print(tabulate(rows, headers=headers + ["max |ws - Triton| grads"] + [f"speedup ({label})" for label, *_ in
                                                                         variants[1:]], tablefmt="github"))


if __name__ == "__main__":
    main()
