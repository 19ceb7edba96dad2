"""Tanh soft-capping of attention scores (Gemma 2, Grok): cap * tanh(score / cap)."""

import torch

from ..block_mask import check_bool
from ..masks._checks import check_float
from ..ops import tanh_approx


def generate_tanh_softcap(cap: float, approx: bool = True):
    """score_mod ``cap * tanh(score / cap)``. ``approx=True`` uses the GPU's ``tanh.approx.f32``
    (FlashAttention does the same; exact on CPU and in the reference), ``approx=False`` the exact tanh.
    Named ``tanh_softcap_<cap>`` (``_approx``)."""
    cap = check_float("generate_tanh_softcap", "cap", cap, positive=True)
    approx = check_bool("generate_tanh_softcap", "approx", approx)
    tanh = tanh_approx if approx else torch.tanh

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * tanh(score / cap)

    softcap.__name__ = f"tanh_softcap_{cap:g}" + ("_approx" if approx else "")
    return softcap
