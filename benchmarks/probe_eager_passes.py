"""flexlite.eager's forward and backward at the harness's D64 shape (B16 H16 S8192 D64, bf16, no mask), three times
each in one process (the first cold), and the forward's output against float32 SDPA on two heads (NOTES 105).
To compare two trees, run it from outside both with PYTHONPATH naming each (it prints which flexlite it imported).

Usage: python benchmarks/probe_eager_passes.py   (CUDA)"""

import time

import torch

import flexlite
from flexlite import eager


def main():
    print("flexlite from", flexlite.__file__)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(16, 16, 8192, 64, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    for _ in range(3):
        t = time.perf_counter()
        out, _, _ = eager.forward(q, k, v, None, None, 0.125)
        torch.cuda.synchronize()
        forward = time.perf_counter() - t
        t = time.perf_counter()
        with torch.no_grad():
            eager.backward(q, k, v, out, do, None, None, None, 0.125)
        torch.cuda.synchronize()
        print("forward %.3f s  backward %.3f s" % (forward, time.perf_counter() - t), flush=True)
    ref = torch.nn.functional.scaled_dot_product_attention(*(t[:2, :2].float() for t in (q, k, v)))
    print("out against float32 SDPA, max abs diff: %.2e" % (out[:2, :2].float() - ref).abs().max().item())


if __name__ == "__main__":
    main()
