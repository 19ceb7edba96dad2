"""Score mods: ``generate_<name>(...)`` factories returning ``score_mod(score, b, h, q_idx, kv_idx)``."""

from .alibi import alibi_slopes, generate_alibi_bias
from .head_bias import generate_head_bias
from .relative_position import generate_relative_bias
from .softcap import generate_tanh_softcap

__all__ = ["alibi_slopes", "generate_alibi_bias", "generate_tanh_softcap", "generate_relative_bias",
           "generate_head_bias"]
