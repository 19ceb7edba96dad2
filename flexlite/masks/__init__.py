"""Mask mods, one family per file (attention-gym style): fixed masks are plain functions,
parameterised ones come from ``generate_<name>(...)`` factories that set ``__name__``. Every file is
also a demo: ``python -m flexlite.masks.<file>`` prints its block masks.

The names below are imported on first use (PEP 562), so that running a file with ``-m`` does not import
it twice.
"""

import importlib

_EXPORTS = {
    "causal": ["causal_mask", "generate_causal_bottom_right"],
    "sliding_window": ["generate_sliding_window"],
    "dilated_sliding_window": ["generate_dilated_sliding_window"],
    "global_sliding_window": ["generate_global_sliding_window"],
    "prefix_lm": ["generate_prefix_lm_mask"],
    "shared_prefix": ["generate_shared_prefix_mask"],
    "document": ["generate_doc_mask_mod", "generate_causal_document_mask", "generate_document_mask",
                 "document_ids_from_lengths", "length_to_offsets", "offsets_to_document_ids"],
    "natten": ["generate_natten", "generate_tiled_natten", "generate_morton_natten", "tiled_natten_permutation"],
    "sasa": ["generate_sasa_mask"],
    "flamingo": ["generate_vision_cross_attention_mask_mod", "generate_vision_cross_attention_from_ranges",
                 "image_intervals_from_tokens"],
    "block_causal": ["generate_block_causal_mask", "generate_block_diffusion_mask"],
    "kv_cache": ["generate_kv_cache_causal"],
    "registry": ["NAMED_MASKS", "build_named_mask"],
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = list(_MODULE_OF)


def __getattr__(name):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
