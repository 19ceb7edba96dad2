"""Named mods shared by every test: each entry builds (score_mod, mask_mod) for given sizes.

Mods are written the way attention-gym writes them (closures over Python scalars and tensors), so
the catalog also checks that such code runs unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch


@dataclasses.dataclass
class Case:
    score_mod: Optional[Callable] = None
    mask_mod: Optional[Callable] = None


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def full(B, H, Lq, Lkv, device):
    return Case()


def causal(B, H, Lq, Lkv, device):
    return Case(mask_mod=_causal)


def causal_bottom_right(B, H, Lq, Lkv, device):
    """Cross-length causal: queries sit at the end of the kv sequence (KV-cache style)."""
    offset = Lkv - Lq

    def mask(b, h, q_idx, kv_idx):
        return q_idx + offset >= kv_idx
    return Case(mask_mod=mask)


def sliding_window(B, H, Lq, Lkv, device, window=37):
    def mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)
    return Case(mask_mod=mask)


def prefix_lm(B, H, Lq, Lkv, device, prefix=40):
    def mask(b, h, q_idx, kv_idx):
        return (kv_idx < prefix) | (q_idx >= kv_idx)
    return Case(mask_mod=mask)


def _doc_ids(length, device, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max(2, length // 2), (length,), generator=g)
    ids = torch.repeat_interleave(torch.arange(length), lengths)[:length]
    return ids.to(torch.int32).to(device)


def document(B, H, Lq, Lkv, device):
    """Packed documents, causal within each document (doc ids captured, nested in comparisons)."""
    doc_q = _doc_ids(Lq, device, seed=1)
    doc_kv = _doc_ids(Lkv, device, seed=1)

    def mask(b, h, q_idx, kv_idx):
        return (doc_q[q_idx] == doc_kv[kv_idx]) & _causal(b, h, q_idx, kv_idx)
    return Case(mask_mod=mask)


def alibi_causal(B, H, Lq, Lkv, device):
    slopes = torch.exp2(-8.0 * torch.arange(1, H + 1, dtype=torch.float32) / H).to(device)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
    return Case(score_mod=alibi, mask_mod=_causal)


def softcap_causal(B, H, Lq, Lkv, device, cap=2.0):
    # a small cap so tanh actually bends the (O(1)) test scores
    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)
    return Case(score_mod=softcap, mask_mod=_causal)


def captured_bias(B, H, Lq, Lkv, device):
    """A 3-D captured tensor indexed by (h, q_idx, kv_idx) plus a relative-position table."""
    g = torch.Generator().manual_seed(3)
    bias = torch.randn(H, Lq, Lkv, generator=g).to(device)
    rel = torch.randn(Lq + Lkv, generator=g).to(device)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx, kv_idx] + rel[q_idx - kv_idx + Lkv]
    return Case(score_mod=score_mod)


def fully_masked_rows(B, H, Lq, Lkv, device):
    """Every third query row sees nothing: its output must be 0 and its LSE -inf."""
    def mask(b, h, q_idx, kv_idx):
        return (q_idx % 3 != 1) & (kv_idx <= q_idx + (Lkv - Lq))
    return Case(mask_mod=mask)


def nested_index(B, H, Lq, Lkv, device):
    """Flamingo-style: each kv token belongs to an image; intervals[img] = query range that sees it."""
    n_img = 4
    image_of = (torch.arange(Lkv, device=device) * n_img // max(Lkv, 1)).to(torch.int64)
    starts = torch.arange(n_img, device=device) * Lq // n_img
    intervals = torch.stack([starts, torch.full_like(starts, Lq)], dim=1)

    def mask(b, h, q_idx, kv_idx):
        lo = intervals[image_of[kv_idx]][0]
        hi = intervals[image_of[kv_idx]][1]
        return (lo <= q_idx) & (q_idx < hi)
    return Case(mask_mod=mask)


def per_batch_head(B, H, Lq, Lkv, device):
    """Uses b and h: a different window per (batch, head), mask not broadcastable over B/H."""
    def mask(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= 8 + 16 * h + 5 * b
    return Case(mask_mod=mask)


CATALOG = {
    fn.__name__: fn
    for fn in (full, causal, causal_bottom_right, sliding_window, prefix_lm, document, alibi_causal,
               softcap_causal, captured_bias, fully_masked_rows, nested_index, per_batch_head)
}

# masks whose value depends on b or h (their block masks are built with real B, H; others with 1, 1)
USES_BH = {"per_batch_head"}


def composed(B, H, Lq, Lkv, device):
    """Mods that call other mods, combined with and_masks / or_masks; a score_mod calling a helper."""
    from flexlite import and_masks, or_masks

    def window(b, h, q_idx, kv_idx):
        return q_idx - kv_idx <= 24

    def prefix(b, h, q_idx, kv_idx):
        return kv_idx < 16

    def bias(q_idx, kv_idx):
        return torch.where(q_idx > kv_idx, -0.5, 0.25)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score * 0.5 + bias(q_idx, kv_idx)
    return Case(score_mod=score_mod, mask_mod=and_masks(_causal, or_masks(window, prefix)))


CATALOG["composed"] = composed
