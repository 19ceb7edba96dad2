"""``python -m flexlite`` — demo (default); ``python -m flexlite show <mask> --seq N`` — print a library
mask's BlockMask (``--png``: draw it); ``python -m flexlite bench ...`` — GPU benchmark harness."""

from __future__ import annotations

import argparse
import importlib.util
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


# the most positions `show` evaluates: create_block_mask runs mask_mod at every position on the CPU, and the printout
# (sparsity, the grid) needs every block's flags, so there is no coarse shortcut for an arbitrary mask_mod. The time
# grows with query x key: causal at 65536 x 65536 took 5 s and at 262144 x 262144 71 s on 2 CPU cores (~1e9 positions
# a second), so the cap, 131072 x 131072, takes ~20 s there (longer on a busy machine); a length of 3M would take hours
MAX_SHOW_POSITIONS = 2 ** 34


def _pair(text: str) -> tuple:
    """'7' -> (7, 7); '16x8' -> (16, 8)."""
    parts = text.lower().split("x")
    if len(parts) not in (1, 2) or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"expected N or WxH, got {text!r}")
    return (int(parts[0]), int(parts[-1]))


def _lengths(text: str) -> list:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated lengths like 300,500,224; got {text!r}") from None


def show(argv) -> None:
    """``python -m flexlite show <mask> --seq N [--png out.png] [options]``."""
    from . import create_block_mask
    from .masks.registry import NAMED_MASKS, build_named_mask

    names = "\n".join(f"  {name:<30}{m.description}" for name, m in NAMED_MASKS.items())
    p = argparse.ArgumentParser(
        prog="python -m flexlite show", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Print the BlockMask of a library mask (█ full, ░ partial, blank empty blocks); "
                    "--png also draws the dense mask.",
        epilog=f"masks:\n{names}\n\nexample: python -m flexlite show sliding_window --seq 4096 --window 512")
    p.add_argument("mask", choices=list(NAMED_MASKS), metavar="mask", help="one of the masks listed below")
    p.add_argument("--seq", type=int, default=1024,
                   help=f"query (and key) length (default 1024). The mask is evaluated at every position on the CPU, "
                        f"so query x key lengths are at most {MAX_SHOW_POSITIONS} (2^34, as 131072 x 131072: ~20 s "
                        f"on 2 cores)")
    p.add_argument("--kv-seq", type=int, help="key length for causal_bottom_right")
    p.add_argument("--window", type=int, help="window size (default seq // 8; sasa: 3)")
    p.add_argument("--dilation", type=int, help="dilated_sliding_window: every n-th key (default 2)")
    p.add_argument("--prefix", type=int, help="prefix length (default seq // 4)")
    p.add_argument("--docs", type=_lengths, help="document (or suffix) lengths, e.g. 300,500,224")
    p.add_argument("--canvas", type=_pair, help="2-D masks: canvas WxH (default: square, W*H = seq)")
    p.add_argument("--kernel", type=_pair, help="natten kernel KWxKH (default 7x7)")
    p.add_argument("--tile", type=_pair, help="tiled_natten tile TWxTH (default 8x8)")
    p.add_argument("--global-tokens", type=int, help="global_sliding_window: global tokens (default 16)")
    p.add_argument("--block", type=int, help="block_causal / block_diffusion block length")
    p.add_argument("--images", type=int, help="flamingo: number of images (default 3)")
    p.add_argument("--image-tokens", type=int, help="flamingo: tokens per image (default 64)")
    p.add_argument("--block-size", type=int, default=128, help="BlockMask BLOCK_SIZE (default 128)")
    p.add_argument("--grid", type=int, default=32, help="print at most this many rows/cols of blocks")
    p.add_argument("--png", help="also write a PNG of the dense mask (needs matplotlib)")
    args = p.parse_args(argv)
    given = dict(kv_seq=args.kv_seq, window=args.window, dilation=args.dilation, prefix=args.prefix,
                 docs=args.docs, canvas=args.canvas, kernel=args.kernel, tile=args.tile,
                 global_tokens=args.global_tokens, block=args.block, images=args.images,
                 image_tokens=args.image_tokens)
    given = {name: value for name, value in given.items() if value is not None}  # (the others: the mask's defaults)
    unused = [name for name in given if name not in NAMED_MASKS[args.mask].options]
    if unused:
        flags = ", ".join("--" + name.replace("_", "-") for name in unused)
        takes = ", ".join("--" + name.replace("_", "-") for name in NAMED_MASKS[args.mask].options)
        p.error(f"mask {args.mask} takes no {flags} (it would be ignored); its options: {takes or 'only --seq'}")
    try:
        mask_mod, q_len, kv_len = build_named_mask(args.mask, args.seq, **given)
    except (ValueError, TypeError) as e:
        p.error(str(e))
    if q_len * kv_len > MAX_SHOW_POSITIONS:
        p.error(f"--seq: {q_len} x {kv_len} positions is too many to evaluate on the CPU (mask_mod runs at every "
                f"position; at most {MAX_SHOW_POSITIONS}, e.g. --seq 131072); use a smaller --seq")
    if args.png:  # (before the printout: the PNG's limits, not a failure after it)
        from .viz import MAX_POSITIONS, _check_path
        if q_len * kv_len > MAX_POSITIONS:
            p.error(f"--png: {q_len} x {kv_len} positions is too many to draw (at most {MAX_POSITIONS}); use a "
                    f"smaller --seq, or leave out --png for the block printout")
        try:
            _check_path(args.png)
        except (ValueError, TypeError) as e:
            p.error(f"--png: {str(e).removeprefix('visualize_attention_scores: ')}")
        if importlib.util.find_spec("matplotlib") is None:
            p.error('--png needs matplotlib; install it with: pip install "flexlite[viz]" (or leave out --png)')
    try:
        block_mask = create_block_mask(mask_mod, None, None, q_len, kv_len, device="cpu", BLOCK_SIZE=args.block_size)
        picture = block_mask.to_string(grid_size=args.grid).rstrip("\n")
    except (ValueError, TypeError) as e:
        p.error(str(e))
    print(f"{mask_mod.__name__}: Q_LEN={q_len}, KV_LEN={kv_len}, BLOCK_SIZE={args.block_size}")
    print(f"BlockMask(shape={block_mask.shape}, sparsity={block_mask.sparsity():.2f}%,")
    print(picture + "\n)")
    if args.png:
        from .viz import visualize_attention_scores
        query = torch.zeros(1, 1, q_len, 1)
        key = torch.zeros(1, 1, kv_len, 1)
        try:
            path = visualize_attention_scores(query, key, mask_mod=mask_mod, path=args.png)
        except (ImportError, ValueError) as e:
            raise SystemExit(f"python -m flexlite show: cannot write {args.png}: {e}") from None
        print(f"wrote {path}")


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] == "demo":
        argparse.ArgumentParser(prog="python -m flexlite demo", description="flex_attention against the fp64 "
                                "reference on a few masks and mods (and a timing table on a GPU)").parse_args(argv[1:])
        demo()
    elif argv[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\npython -m flexlite show --help lists the masks.")
    elif argv[0] == "show":
        show(argv[1:])
    elif argv[0] == "bench":
        from .bench import main as bench_main
        bench_main(argv[1:])
    else:
        print(f"python -m flexlite: unknown command {argv[0]!r}; use: python -m flexlite [demo | show <mask> ... | "
              f"bench ...]", file=sys.stderr)
        raise SystemExit(2)  # (argparse's status for bad arguments, as show and bench give)


if __name__ == "__main__":
    main()
