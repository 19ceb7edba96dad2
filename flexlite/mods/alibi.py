"""ALiBi: a per-head linear bias on the distance between query and key (https://arxiv.org/abs/2108.12409)."""

from __future__ import annotations

import torch

from ..block_mask import check_bool
from ..masks._checks import check_device_arg, check_float_tensor, check_int


def alibi_slopes(num_heads: int, device=None, *, interleaved: bool = False) -> torch.Tensor:
    """[num_heads] fp32 slopes 2^(-8 h / H), h = 1..H: the paper's geometric sequence where H is a power of two, and
    attention-gym's for any H. ``interleaved=True``: the paper's (and BLOOM's, MPT's) for other H, those of the
    closest smaller power of two P followed by every other slope of 2P, the first H - P of them (the same where H is
    a power of two)."""
    num_heads = check_int("alibi_slopes", "num_heads", num_heads, 1)
    device = check_device_arg("alibi_slopes", device)
    interleaved = check_bool("alibi_slopes", "interleaved", interleaved)
    power = 1 << (num_heads.bit_length() - 1)  # (the closest power of two not above H)
    if not interleaved or power == num_heads:
        h = torch.arange(1, num_heads + 1, dtype=torch.float32, device=device)
        return torch.exp2(-8.0 * h / num_heads)
    return torch.cat([alibi_slopes(power, device), alibi_slopes(2 * power, device)[0::2][:num_heads - power]])


def generate_alibi_bias(num_heads: int, device=None, slopes: torch.Tensor | None = None):
    """score_mod adding ``slopes[h] * (kv_idx - q_idx)``; ``slopes`` [num_heads] may be learnable
    (default :func:`alibi_slopes` on ``device``: attention-gym's; the paper's for any head count:
    ``slopes=alibi_slopes(num_heads, device, interleaved=True)``). Named ``alibi_<num_heads>``."""
    num_heads = check_int("generate_alibi_bias", "num_heads", num_heads, 1)
    if slopes is None:
        slopes = alibi_slopes(num_heads, device)
    else:
        check_float_tensor("generate_alibi_bias", "slopes", slopes, dims=(1,))
        if slopes.shape[0] != num_heads:
            raise ValueError(f"generate_alibi_bias: slopes has {slopes.shape[0]} entries but num_heads is {num_heads}")

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    alibi.__name__ = f"alibi_{num_heads}"
    alibi.flexlite_heads = num_heads  # (flex_attention checks the query's head count against it)
    return alibi
