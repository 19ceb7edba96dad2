"""Per-head bias: ``score + bias[h]``.

A constant per head shifts every score of a query row equally, so softmax (the attention output) is
unchanged and only the log-sum-exp moves, by ``bias[h]`` (``return_lse=True``). It matters where the LSE
does (merging partial attentions) and is the smallest score_mod with a captured per-head tensor.
"""

from __future__ import annotations

import torch

from ..masks._checks import check_float_tensor


def generate_head_bias(bias: torch.Tensor):
    """score_mod adding ``bias[h]``; ``bias`` [H] floating point, possibly ``requires_grad``.
    Named ``head_bias_<H>``."""
    check_float_tensor("generate_head_bias", "bias", bias, dims=(1,))
    if bias.shape[0] == 0:
        raise ValueError("generate_head_bias: bias has no entries; it needs one per head")

    def head_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h]

    head_bias.__name__ = f"head_bias_{bias.shape[0]}"
    head_bias.flexlite_heads = bias.shape[0]  # (flex_attention checks the query's head count against it)
    return head_bias
