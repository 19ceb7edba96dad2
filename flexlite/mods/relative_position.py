"""Relative-position bias from a table (T5, Swin, ...): ``score + table[h, q_idx - kv_idx + L - 1]``."""

from __future__ import annotations

import torch

from ..masks._checks import check_float_tensor


def generate_relative_bias(table: torch.Tensor):
    """score_mod adding a learned bias per relative distance.

    Args:
        table: [H, 2 * L - 1] (one row per head) or [2 * L - 1] (shared by all heads), floating point,
            possibly ``requires_grad``; entry ``q_idx - kv_idx + L - 1`` is the bias of distance
            ``q_idx - kv_idx`` in ``-(L - 1) .. L - 1``. Distances beyond that use the edge entries
            (the index is clamped), so any sequence length is safe; ``L >= max(Q_LEN, KV_LEN)`` covers
            every distance exactly.

    Named ``relative_bias_<L>`` (``_per_head`` for a 2-D table).
    """
    caller = "generate_relative_bias"
    check_float_tensor(caller, "table", table, dims=(1, 2))
    n = table.shape[-1]
    if n % 2 == 0:
        raise ValueError(f"{caller}: table's last dimension must be 2 * L - 1 (odd); got {n}")
    L = (n + 1) // 2

    def distance_index(q_idx, kv_idx):
        return (q_idx - kv_idx + (L - 1)).clamp(0, n - 1)

    if table.dim() == 2:
        def relative_bias(score, b, h, q_idx, kv_idx):
            return score + table[h, distance_index(q_idx, kv_idx)]
    else:
        def relative_bias(score, b, h, q_idx, kv_idx):
            return score + table[distance_index(q_idx, kv_idx)]

    relative_bias.__name__ = f"relative_bias_{L}" + ("_per_head" if table.dim() == 2 else "")
    if table.dim() == 2:
        relative_bias.flexlite_heads = table.shape[0]  # (flex_attention checks the query's head count against it)
    return relative_bias
