"""Mask mods, one family per file (attention-gym style): fixed masks are plain functions,
parameterised ones come from ``generate_<name>(...)`` factories that set ``__name__``."""

from .causal import causal_mask, generate_causal_bottom_right
from .document import document_ids_from_lengths, generate_causal_document_mask, generate_doc_mask_mod
from .prefix_lm import generate_prefix_lm_mask
from .sliding_window import generate_sliding_window

__all__ = ["causal_mask", "generate_causal_bottom_right", "generate_sliding_window", "generate_prefix_lm_mask",
           "generate_doc_mask_mod", "generate_causal_document_mask", "document_ids_from_lengths"]
