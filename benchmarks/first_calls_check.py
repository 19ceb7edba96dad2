"""Host time of first_calls' check in a call whose kernels are known (NOTES 72): api._first_call for a forward with
a block mask and first_calls on (applies, the signature, one set lookup; what every forward and backward with a
mask_mod pays on a GPU). Runs anywhere (CPU tensors; first_calls.ENABLED = "always", the key marked compiled).

Usage: python benchmarks/first_calls_check.py [calls]"""

from __future__ import annotations

import os
import sys
import timeit

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from flexlite import api, create_block_mask, first_calls  # noqa: E402
from flexlite.masks import causal_mask  # noqa: E402


def main():
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
    first_calls.ENABLED = "always"
    q, k, v = (torch.randn(1, 16, 2048, 128) for _ in range(3))
    bm = create_block_mask(causal_mask, None, None, 2048, 2048, device="cpu")
    sources = ("x" * 60000,)  # (a kernel's source: its hash cached on the string, as a generated kernel's is)
    first_calls.mark_ready(("fwd", sources, first_calls.signature(q, k, v, bm, False)))

    def check():
        return api._first_call("fwd", sources, q, k, v, bm, None, False, None, None, False)
    assert check() is not None and not check().new
    print(f"first_calls' check, kernels known: {timeit.timeit(check, number=calls) / calls * 1e6:.2f} us a call")


if __name__ == "__main__":
    main()
