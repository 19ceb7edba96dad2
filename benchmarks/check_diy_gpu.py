"""GPU check of the "DIY FlashAttention" API (flexlite.kernels, flexlite.utils; docs/API.md).

What the CPU tests cannot cover: the compiled GEMM (autotuning, the heuristic per GPU, shared-memory
fallback for large explicit blocks), flash_attention on CUDA, detect_gpu on a real device, and
timings with do_bench. Prints the GPU, the selector's configs, a correctness table and a timing table;
exits 1 if a check fails.

    python benchmarks/check_diy_gpu.py            # about 6 minutes on an H200, mostly first compiles
    python benchmarks/check_diy_gpu.py --quick    # fewer shapes, no timing table (about 2 minutes)
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from tabulate import tabulate

from flexlite import attention_reference
from flexlite.kernels import flash_attention, reference_attention, triton_matmul
from flexlite.kernels.attention import block_mask_for
from flexlite.kernels.matmul import _TUNED, autotune_candidates, matmul_config
from flexlite.utils import (AdaptiveKernelSelector, BenchmarkRunner, benchmark_fn, check_hopper_features, detect_gpu,
                            validate_attention, validate_matmul)

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _short(dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_matmul(rows: list, quick: bool):
    shapes = [(1, 1, 1), (33, 47, 61), (100, 200, 150), (1000, 1000, 1000)] + ([] if quick else [(4096, 4096, 4096),
                                                                                                  (8192, 64, 4096)])
    for dtype in DTYPES:
        for m, n, k in shapes:
            for autotune in (True, False):
                t0 = time.perf_counter()
                ok, diff = validate_matmul(lambda a, b: triton_matmul(a, b, use_autotune=autotune), m, n, k,
                                           dtype=dtype, device="cuda")
                rows.append(["triton_matmul", f"{m}x{n}x{k} {_short(dtype)} autotune={autotune}", ok, diff,
                             round(time.perf_counter() - t0, 2)])
    for blocks in [(16, 16, 16), (64, 64, 32), (128, 256, 64), (256, 256, 128)]:
        fn = lambda a, b: triton_matmul(a, b, *blocks)  # noqa: E731
        try:
            ok, diff = validate_matmul(fn, 1024, 1024, 1024, device="cuda")
            rows.append(["triton_matmul blocks", f"1024^3 {blocks}", ok, diff, ""])
        except ValueError as e:  # blocks that do not fit shared memory even with one stage
            rows.append(["triton_matmul blocks", f"1024^3 {blocks}", "ValueError", str(e)[:60], ""])
    a = torch.randn(300, 500, device="cuda", dtype=torch.float16)
    b = torch.randn(700, 300, device="cuda", dtype=torch.float16)
    diff = (triton_matmul(a.t(), b.t()).double() - a.t().double() @ b.t().double()).abs().max().item()
    rows.append(["triton_matmul strided", "a.t() @ b.t() 500x700x300", diff < 0.05, diff, ""])


def check_attention(rows: list, quick: bool):
    cases = [(2, 4, 1, 64), (2, 4, 63, 64), (2, 4, 200, 128), (1, 8, 1024, 64), (1, 4, 1000, 80), (1, 2, 300, 256),
             (1, 2, 129, 16), (1, 2, 64, 128), (1, 2, 192, 128)]
    if quick:
        cases = cases[:4]
    for dtype in DTYPES:
        for b, h, s, d in cases:
            for causal in (False, True):
                ok, diff = validate_attention(flash_attention, b, h, s, d, causal=causal, dtype=dtype, device="cuda")
                rows.append(["flash_attention", f"B{b} H{h} S{s} D{d} causal={causal} {_short(dtype)}", ok, diff, ""])
    # seq_lens: valid rows = attention over the prefix alone, rows past it = 0
    for dtype in (torch.bfloat16, torch.float16):
        B, H, S, D = 4, 8, 1000, 128
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=dtype) for _ in range(3))
        lens = torch.tensor([1000, 1, 517, 0], dtype=torch.int32, device="cuda")
        for causal in (False, True):
            out = flash_attention(q, k, v, causal=causal, seq_lens=lens)
            diff, zeros = 0.0, True
            for i, n in enumerate(lens.tolist()):
                if n:
                    ref = reference_attention(q[i:i + 1, :, :n], k[i:i + 1, :, :n], v[i:i + 1, :, :n], causal=causal)
                    diff = max(diff, (out[i:i + 1, :, :n].float() - ref.float()).abs().max().item())
                zeros &= bool((out[i, :, n:] == 0).all())
            tol = 4e-3 if dtype == torch.float16 else 2.5e-2
            rows.append(["flash_attention seq_lens", f"B{B} H{H} S{S} D{D} causal={causal} {_short(dtype)}",
                         zeros and diff < tol, diff, ""])
    # gradients through flexlite's backward (3-D input, seq_lens, causal) vs the fp64 reference per prefix
    q, k, v = (torch.randn(8, 333, 64, device="cuda", requires_grad=True) for _ in range(3))
    lens = torch.randint(1, 334, (8,), dtype=torch.int32, device="cuda")
    flash_attention(q, k, v, causal=True, seq_lens=lens).sum().backward()
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    total = 0
    for i, n in enumerate(lens.tolist()):
        qi, ki, vi = (t[i:i + 1, None, :n] for t in (q2, k2, v2))
        total = total + attention_reference(qi, ki, vi, block_mask=block_mask_for(qi, True, None))[0].sum()
    total.backward()
    diff = max((a.grad - b.grad).abs().max().item() for a, b in ((q, q2), (k, k2), (v, v2)))
    rows.append(["flash_attention grad", "3-D 8x333x64 fp32 causal seq_lens", diff < 1e-3, diff, ""])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2

    caps = detect_gpu()
    print(f"torch {torch.__version__}, triton {__import__('triton').__version__}")
    print(tabulate([[f, getattr(caps, f)] for f in caps.__dataclass_fields__], tablefmt="github",
                   headers=["detect_gpu()", ""]))
    print("check_hopper_features():", check_hopper_features())

    selector = AdaptiveKernelSelector()
    print("\nmatmul configs (use_autotune=False):")
    for mnk in [(4096, 4096, 4096), (100, 200, 150)]:
        print(f"  {mnk}: {selector.get_matmul_config(*mnk)}")
    print(f"  autotune candidates at 4096^3: {len(autotune_candidates(4096, 4096, 4096, caps))}")
    print("attention configs (flexlite's forward heuristic):")
    for d, causal, varlen in [(64, False, False), (128, True, False), (128, True, True)]:
        config = selector.get_attention_config(8192, d, torch.bfloat16, causal, varlen)
        print(f"  D{d} causal={causal} varlen={varlen}: {config}")

    rows: list = []
    t0 = time.perf_counter()
    check_matmul(rows, args.quick)
    check_attention(rows, args.quick)
    print(f"\ncorrectness ({time.perf_counter() - t0:.0f} s, compiles included):")
    print(tabulate(rows, headers=["check", "case", "ok", "max |diff|", "s"], tablefmt="github", floatfmt=".3g"))
    failed = [r for r in rows if r[2] is not True and r[2] != "ValueError"]

    if not args.quick:
        runner = BenchmarkRunner("cuda")
        sizes = [(1024, 1024, 1024), (4096, 4096, 4096), (8192, 8192, 8192)]
        for dtype in (torch.float16, torch.bfloat16):
            runner.benchmark_matmul(triton_matmul, sizes, dtype=dtype)
            heuristic = lambda a, b: triton_matmul(a, b, use_autotune=False)  # noqa: E731
            heuristic.__name__ = "triton_matmul(heuristic)"
            runner.benchmark_matmul(heuristic, sizes, dtype=dtype)
        runner.print_comparison_table(title="matmul fp16 then bf16 (torch rows are cuBLAS)")
        print("chosen by autotune (dtype, M, N, K): (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)")
        for key, v in _TUNED.items():
            if key[2] >= 1024:
                print(f"  {key[1:]}: {(v['BLOCK_M'], v['BLOCK_N'], v['BLOCK_K'], v['num_warps'], v['num_stages'])}")
        print("heuristic:", matmul_config(8192, 8192, 8192, "cuda"))
        runner.clear_results()
        for d in (64, 128):
            for causal in (False, True):
                runner.benchmark_attention(flash_attention, [1024, 4096, 8192], batch_size=4, num_heads=16, head_dim=d,
                                           causal=causal, dtype=torch.bfloat16)
        runner.print_comparison_table(title="attention bf16 B4 H16, D64 then D128, full then causal")
        x = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
        print("benchmark_fn(torch.matmul, 4096^2 fp16) (median, p20, p80) ms:", benchmark_fn(torch.matmul, x, x))

    print(f"\n{len(rows) - len(failed)} of {len(rows)} checks passed")
    for r in failed:
        print("FAILED:", r)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
