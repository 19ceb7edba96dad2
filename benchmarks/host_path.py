"""Host time of one flex_attention call with its kernel launch stubbed out: what validation, dispatch and the guards
cost per call, where a decoding step (~0.1 ms on the GPU) can be host-bound (NOTES 17, 19, 59), and a training
forward (softcap + a document mask, q / k / v requiring grad; NOTES 66). Runs anywhere (CPU tensors; the kernels'
launches replaced by functions returning preallocated outputs).

Usage: python benchmarks/host_path.py [calls]   (from a checkout: PYTHONPATH=<checkout> to time that version)"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import flexlite  # noqa: E402
import flexlite.api as api  # noqa: E402


def main():
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 20_000
    # a decoding step: B8, 8 query heads on 2 kv heads, one query over 4096 cached keys, a captured-offset mask
    q = torch.randn(8, 8, 1, 64)
    k, v = torch.randn(8, 2, 4096, 64), torch.randn(8, 2, 4096, 64)
    offset = torch.tensor(4000)
    bm = flexlite.create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + offset, None, None, 1, 4096,
                                    device="cpu")
    out, lse = torch.zeros(8, 8, 1, 64), torch.zeros(8, 8, 1)
    triple = "max_scores" in api._forward.__code__.co_varnames  # (versions before return_aux returned a pair)
    api.launch_decode = (lambda *a, **kw: (out, lse, None)) if triple else (lambda *a, **kw: (out, lse))
    parts = {"flex_attention": lambda: flexlite.flex_attention(q, k, v, block_mask=bm, enable_gqa=True),
             "_validate": lambda: api._validate(q, k, v, None, bm, None, True, None),
             "_forward": lambda: api._forward(q, k, v, None, bm, 0.125, None)}
    # a training forward: softcap + a causal document mask, B1 H2 L2048 D128 bf16, q / k / v requiring grad
    from flexlite.masks import generate_causal_document_mask
    from flexlite.mods import generate_tanh_softcap
    softcap = generate_tanh_softcap(30.0)
    doc = flexlite.create_block_mask(generate_causal_document_mask([256] * 8), None, None, 2048, 2048, device="cpu")
    tq, tk, tv = (torch.randn(1, 2, 2048, 128, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    t_out, t_lse = torch.zeros(1, 2, 2048, 128, dtype=torch.bfloat16), torch.zeros(1, 2, 2048)
    api.launch_forward = (lambda *a, **kw: (t_out, t_lse, None)) if triple else (lambda *a, **kw: (t_out, t_lse))
    parts["training forward"] = lambda: flexlite.flex_attention(tq, tk, tv, score_mod=softcap, block_mask=doc)
    print(f"flexlite at {os.path.dirname(flexlite.__file__)}")
    for name, fn in parts.items():
        fn()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        print(f"{name:16s} {(time.perf_counter() - start) / calls * 1e6:6.1f} us per call")


if __name__ == "__main__":
    main()
