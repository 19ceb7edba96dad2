"""``python -m flexlite`` — demo (default); ``python -m flexlite bench ...`` — GPU benchmark harness."""

from __future__ import annotations

import sys

import torch


def demo() -> None:
    from tabulate import tabulate

    from . import attention_reference, create_block_mask, flex_attention
    from .masks import causal_mask, generate_causal_document_mask, generate_prefix_lm_mask, generate_sliding_window
    from .mods import generate_alibi_bias, generate_tanh_softcap

    device = "cuda" if torch.cuda.is_available() else "cpu"
    where = "GPU" if device == "cuda" else "CPU (Triton interpreter: exact but slow)"
    print(f"flexlite demo on {where}\n")

    S = 1024
    for mask in (causal_mask, generate_sliding_window(256), generate_causal_document_mask([300, 500, 224])):
        print(f"{mask.__name__}:")
        print(create_block_mask(mask, None, None, S, S, device="cpu"), "\n")

    B, H, L, D = 1, 2, 200, 64
    g = torch.Generator().manual_seed(0)
    q, k, v = [torch.randn(B, H, L, D, generator=g).to(device) for _ in range(3)]
    rows = []
    for label, mask_mod, score_mod in (
            ("full", None, None), ("causal", causal_mask, None), ("sliding_window_64", generate_sliding_window(64), None),
            ("prefix_lm_50", generate_prefix_lm_mask(50), None),
            ("alibi + causal", causal_mask, generate_alibi_bias(H, device=device)),
            ("softcap 20 + causal", causal_mask, generate_tanh_softcap(20.0))):
        bm = create_block_mask(mask_mod, None, None, L, L, device=device) if mask_mod else None
        out, lse = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, return_lse=True)
        ref, ref_lse = attention_reference(q, k, v, score_mod=score_mod, block_mask=bm)
        err = (out.double() - ref).abs().max().item()
        rows.append([label, f"{err:.2e}", f"{(lse.double() - ref_lse).abs().max().item():.2e}",
                     "ok" if err < 1e-4 else "MISMATCH"])
    print(f"flex_attention vs the fp64 reference (B{B} H{H} L{L} D{D}, float32):")
    print(tabulate(rows, headers=["mods", "max |out err|", "max |lse err|", ""], tablefmt="github"), "\n")

    if device == "cuda":
        from .bench import run
        print("Timing (bf16, B4 H16 S4096 D64; do_bench medians):")
        run(["full", "causal", "sliding_window_1024", "softcap30_causal"], [(4, 16, 4096, 64)], out_dir=None)
    else:
        print("No GPU: skipping the timing table (python -m flexlite bench runs the full benchmark on a GPU).")


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] == "demo":
        demo()
    elif argv[0] == "bench":
        from .bench import main as bench_main
        bench_main(argv[1:])
    else:
        raise SystemExit(f"unknown command {argv[0]!r}; use: python -m flexlite [demo | bench ...]")


if __name__ == "__main__":
    main()
