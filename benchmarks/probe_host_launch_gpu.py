"""GPU probe: host time per call with the kernels launched through Triton's launch path (JITFunction.run) against
flexlite's compiled launches (launch.COMPILED_LAUNCHES off and on; on, with launch.CACHED_TENSOR_MAPS off and on: NOTES
67), in one process, rounds alternating (the GPU
host's CPU speed moves from minute to minute: NOTES 65). The harness's document mask at a small shape (B1 H16 S2048, bf16, q / k / v
requiring grad), so that the GPU finishes before the host's next call: host time = calls back to back without waiting
for the GPU. Rows: the forward alone, and a training step (forward and backward). Checks one step against the
reference first (NOTES 66).

Usage: python benchmarks/probe_host_launch_gpu.py [rounds]"""

import sys

import torch
from tabulate import tabulate

from flexlite import attention_reference, create_block_mask, flex_attention
from flexlite.bench import host_us, mask_cases
from flexlite.runtime import launch


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    B, H, S = 1, 16, 2048
    case = mask_cases(S, H, "cuda")["document_8_causal"]
    bm = create_block_mask(case.mask_mod, None, None, S, S, device="cuda")
    rows = []
    for D in (128, 64):
        q, k, v = [torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
        grad_out = torch.randn_like(q)

        def forward():
            return flex_attention(q, k, v, block_mask=bm)

        def step():
            forward().backward(grad_out)

        out = forward()
        inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref = attention_reference(*inputs, block_mask=bm)[0]
        err = (out.double() - ref).abs().max().item()
        assert err < 0.05, f"D{D}: max abs error {err} against the reference"
        for r in range(rounds):
            for mode in ("triton", "compiled", "compiled, maps kept"):
                launch.COMPILED_LAUNCHES = mode != "triton"
                launch.CACHED_TENSOR_MAPS = mode == "compiled, maps kept"
                rows.append([f"D{D}", r, mode, f"{host_us(forward, 200):.0f}", f"{host_us(step, 100):.0f}"])
                print(rows[-1], flush=True)
    launch.COMPILED_LAUNCHES = launch.CACHED_TENSOR_MAPS = True
    print(tabulate(rows, headers=["head dim", "round", "launches", "forward (us a call)", "training step (us)"],
                   tablefmt="github"))


if __name__ == "__main__":
    main()
