"""GPU stress check of the decode kernel, whose last-arriving split merges all splits (an atomic counter
orders the programs; the interpreter runs programs one after another and cannot exercise that): many random
shapes, split counts and masks against the fp64 reference, outputs poisoned with NaN first. Prints a summary
and exits non-zero on any mismatch.

Usage: python benchmarks/check_decode_gpu.py [trials]
"""

import random
import sys

import torch

from flexlite import attention_reference, create_block_mask, flex_attention
from flexlite.reference import TOLERANCES


def main():
    trials = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    rng = random.Random(0)
    worst, failures = 0.0, []
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = poisoned_empty
    try:
        for trial in range(trials):
            B, Hkv = rng.choice([1, 2, 3, 8]), rng.choice([1, 2, 8])
            Hq = Hkv * rng.choice([1, 2, 4, 8])
            Lq, Lkv, D = rng.choice([1, 1, 2, 5, 16]), rng.randint(1, 40000), rng.choice([64, 128, 80])
            dtype = rng.choice([torch.bfloat16, torch.float16])
            q = torch.randn(B, Hq, Lq, D, device="cuda", dtype=dtype)
            k, v = [torch.randn(B, Hkv, Lkv, D, device="cuda", dtype=dtype) for _ in range(2)]
            opts = {"DECODE": True}
            if rng.random() < 0.5:
                opts["DECODE_SPLITS"] = rng.randint(1, 300)
            bm = None
            if rng.random() < 0.5:  # queries at the end of the cache, causal
                offset = Lkv - Lq
                bm = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx + offset >= kv_idx, None, None, Lq, Lkv,
                                       device="cuda")
            out, lse = flex_attention(q, k, v, block_mask=bm, enable_gqa=True, return_lse=True, kernel_options=opts)
            ref, ref_lse = attention_reference(q, k, v, block_mask=bm, enable_gqa=True)
            atol, rtol = TOLERANCES[dtype]
            err = (out.double() - ref).abs()
            bad = torch.isnan(out).any() or bool((err > atol + rtol * ref.abs()).any()) or \
                bool(((lse.double() - ref_lse).abs() > 1e-2).any())
            worst = max(worst, float(err.max()))
            if bad:
                failures.append((trial, B, Hq, Hkv, Lq, Lkv, D, dtype, opts, bm is not None))
    finally:
        torch.empty = real_empty
    print(f"{trials} trials, {len(failures)} failures, max |out - ref| {worst:.3g}")
    for f in failures[:10]:
        print("FAILED", f)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
