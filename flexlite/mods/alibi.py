"""ALiBi: a per-head linear bias on the distance between query and key."""

from __future__ import annotations

import torch


def alibi_slopes(num_heads: int, device=None) -> torch.Tensor:
    """[num_heads] fp32 slopes 2^(-8 h / H), h = 1..H (the paper's geometric sequence)."""
    h = torch.arange(1, num_heads + 1, dtype=torch.float32, device=device)
    return torch.exp2(-8.0 * h / num_heads)


def generate_alibi_bias(num_heads: int, device=None, slopes: torch.Tensor | None = None):
    """score_mod adding ``slopes[h] * (kv_idx - q_idx)``; ``slopes`` may be learnable."""
    slopes = alibi_slopes(num_heads, device) if slopes is None else slopes

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    alibi.__name__ = f"alibi_{num_heads}"
    return alibi
