"""One chunk of flexlite.eager's forward at the harness's D64 shape (B16 H16, 32 query rows against 8192 keys: 2**26
scores, the chunk eager.CHUNK_SCORES makes there), its steps timed apart (NOTES 105): Q K^T and P V with float32
operands against bfloat16 ones with float32 sums (``torch.bmm``'s ``out_dtype``) and TF32, and P and LSE by
logsumexp plus the running-max weights (before NOTES 105) against one fused softmax (eager._weights_lse).

Usage: python benchmarks/probe_eager_chunk.py   (CUDA)"""

import torch
from tabulate import tabulate
from triton.testing import do_bench

from flexlite import eager

B, H, R, S, D = 16, 16, 32, 8192, 64


def main():
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, n, D, device="cuda", dtype=torch.bfloat16, generator=g) for n in (R, S, S))
    k32, v32 = k.float(), v.float()
    s = q.float() @ k32.transpose(-1, -2) * 0.125
    p = eager._weights(s)

    def tf32():
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            return q.float() @ k32.transpose(-1, -2)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = False

    steps = {
        "Q K^T, float32 operands": lambda: q.float() @ k32.transpose(-1, -2) * 0.125,
        "Q K^T, bfloat16 operands, float32 sums": lambda: eager._matmul(q, k.transpose(-1, -2)) * 0.125,
        "Q K^T, TF32": tf32,
        "P and LSE: logsumexp + _weights": lambda: (torch.logsumexp(s, dim=-1), eager._weights(s)),
        "P and LSE: _weights_lse": lambda: eager._weights_lse(s),
        "P V, float32 operands": lambda: p @ v32,
        "P V, P rounded to bfloat16, float32 sums": lambda: eager._matmul(p.to(torch.bfloat16), v),
    }
    rows = [(name, round(do_bench(fn, warmup=50, rep=200), 3)) for name, fn in steps.items()]
    print(tabulate(rows, headers=["step (one chunk)", "ms"], tablefmt="github"))
    print("Q K^T bfloat16 against float32 operands, max abs diff:",
          (eager._matmul(q, k.transpose(-1, -2)) - q.float() @ k32.transpose(-1, -2)).abs().max().item())


if __name__ == "__main__":
    main()
