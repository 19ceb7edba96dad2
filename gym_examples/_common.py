"""What every gym_examples script shares: the command line (``--small`` / ``--device`` / ``--png DIR``), the
correctness check against ``flexlite.attention_reference`` (forward and, where flexlite has one, backward)
and drawing masks.

Without a GPU the scripts run tiny sizes through Triton's interpreter (exact, slow). On a GPU they run
the FlexAttention notebook's sizes; the fp64 reference then runs at B1 H2 (the sequence length kept).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path
from typing import Callable, Optional

import torch

from flexlite import BlockMask, attention_reference, flex_attention

# max |flexlite - reference| / max(1, max |reference|) accepted, per input dtype
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}


@dataclasses.dataclass
class Setup:
    device: torch.device
    small: bool
    dtype: torch.dtype
    png_dir: Optional[Path]
    args: argparse.Namespace
    failures: list = dataclasses.field(default_factory=list)

    def size(self, full: int, small: int) -> int:
        """``full`` on a GPU, ``small`` in --small / CPU mode."""
        return small if self.small else full

    def finish(self) -> None:
        """Exit non-zero if any check failed (so CI notices)."""
        if self.failures:
            print(f"\nFAILED: {', '.join(self.failures)}")
            sys.exit(1)
        print("\nall checks passed")


def setup(doc: Optional[str] = None, add_arguments: Optional[Callable] = None) -> Setup:
    """Parse the command line (unknown arguments are ignored, so cells also run in Jupyter / VS Code);
    ``add_arguments(parser)`` adds a script's own options (then in ``Setup.args``)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="tiny sizes (automatic without a GPU)")
    p.add_argument("--device", help="cuda or cpu (default: cuda if available)")
    p.add_argument("--png", metavar="DIR", help="also draw the masks as PNGs into DIR (needs matplotlib)")
    if add_arguments is not None:
        add_arguments(p)
    args, _ = p.parse_known_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    small = args.small or device.type != "cuda"
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    if device.type != "cuda":
        print("CPU mode: tiny sizes through the Triton interpreter (exact, slow); timings and torch's compiled "
              "flex_attention skipped.\n")
    elif small:
        print("--small: tiny sizes on the GPU.\n")
    png_dir = Path(args.png) if args.png else None
    if png_dir is not None:
        png_dir.mkdir(parents=True, exist_ok=True)
    return Setup(device, small, dtype, png_dir, args)


_BACKWARD: dict = {}


def backward_available(device: torch.device) -> bool:
    """Whether flex_attention has a backward: one tiny try per device; says so if it has not."""
    if device.type not in _BACKWARD:
        q = torch.randn(1, 1, 128, 16, device=device, requires_grad=True)
        try:
            flex_attention(q, q.detach(), q.detach()).sum().backward()
            _BACKWARD[device.type] = True
        except NotImplementedError as e:
            print(f"backward: not available ({e})")
            _BACKWARD[device.type] = False
    return _BACKWARD[device.type]


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    finite = torch.isfinite(expected)
    if not torch.equal(torch.isfinite(actual), finite):
        return math.inf
    diff = (actual.double() - expected)[finite].abs()
    return diff.max().item() / max(1.0, expected[finite].abs().max().item()) if diff.numel() else 0.0


def check(cfg: Setup, name: str, q_len: int, kv_len: Optional[int] = None, score_mod: Optional[Callable] = None,
          block_mask: Optional[BlockMask] = None, H: Optional[int] = None, D: Optional[int] = None,
          captured: tuple = ()) -> dict:
    """flex_attention vs the fp64 reference on random [1, H, L, D] inputs (default H: 2, 1 in small mode):
    out and LSE, then dq, dk, dv (and the gradients of ``captured`` tensors that require grad) if flexlite
    has a backward. Prints one line, records a failure in ``cfg``; returns the errors."""
    kv_len = q_len if kv_len is None else kv_len
    H = H or cfg.size(2, 1)
    D = D or cfg.size(64, 16)
    g = torch.Generator().manual_seed(0)
    q, k, v, d_out = (torch.randn(1, H, L, D, generator=g).to(cfg.device, cfg.dtype)
                      for L in (q_len, kv_len, kv_len, q_len))
    tol = TOLERANCE[cfg.dtype]
    backward = backward_available(cfg.device)
    q, k, v = (t.requires_grad_(backward) for t in (q, k, v))
    out, lse = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, score_mod=score_mod, block_mask=block_mask)
    errors = {"out": _rel_err(out, ref), "lse": _rel_err(lse, ref_lse)}
    if backward:
        inputs = (q, k, v, *[t for t in captured if t.requires_grad])
        try:
            grads = torch.autograd.grad(out, inputs, d_out)
        except NotImplementedError as e:
            print(f"  {name}: backward: not available for these mods ({e})")
        else:
            ref_grads = torch.autograd.grad(ref, inputs, d_out.double())
            names = ["dq", "dk", "dv"] + [f"d_captured{i}" for i in range(len(inputs) - 3)]
            errors.update({n: _rel_err(a, e) for n, a, e in zip(names, grads, ref_grads)})
    worst = max(errors.values())
    status = "ok" if worst <= tol else "MISMATCH"
    passes = "fwd+bwd" if "dq" in errors else "fwd only (backward: not available)"
    print(f"  {name}: {passes} vs fp64 reference, max rel err {worst:.1e} (tol {tol:g}) {status}")
    if status != "ok":
        cfg.failures.append(name)
    return errors


def draw(cfg: Setup, name: str, mask_mod: Optional[Callable] = None, score_mod: Optional[Callable] = None,
         q_len: int = 24, kv_len: Optional[int] = None) -> None:
    """With --png DIR: draw ``mask_mod`` / ``score_mod`` over a small ``q_len x kv_len`` grid as DIR/name.png."""
    if cfg.png_dir is None:
        return
    from flexlite.viz import visualize_attention_scores
    g = torch.Generator().manual_seed(0)
    query = torch.randn(1, 1, q_len, 8, generator=g)
    key = torch.randn(1, 1, kv_len or q_len, 8, generator=g)
    path = visualize_attention_scores(query, key, score_mod=score_mod, mask_mod=mask_mod,
                                      path=cfg.png_dir / f"{name}.png")
    print(f"  wrote {path}")
