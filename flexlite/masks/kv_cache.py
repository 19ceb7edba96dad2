"""KV-cache decoding: the queries are the last tokens of the sequence, at positions offset + q_idx."""

from __future__ import annotations

import torch


def generate_kv_cache_causal(offset: torch.Tensor):
    """Causal mask for queries at positions ``offset + q_idx`` of the keys (the tokens already cached).

    ``offset`` is an integer tensor captured by the mod: 0-d, one cache length for the whole batch; or 1-D with an
    entry per batch element (caches of different lengths in one batch: sample b's queries sit at ``offset[b] +
    q_idx``, and its keys past them, a shorter cache's unused tail included, are masked; build the block mask with
    B = ``len(offset)``). Advance it in place each step (``offset.fill_(cache_len)``, ``offset += n_new``) and the
    same trace and the same compiled kernel serve every step. Rebuild the (cheap) block mask for the new KV length
    with ``create_block_mask``.
    """
    if not isinstance(offset, torch.Tensor) or offset.dim() > 1 or offset.numel() == 0 \
            or offset.dtype.is_floating_point or offset.dtype.is_complex or offset.dtype == torch.bool:
        got = (f"a {offset.dtype} tensor of shape {tuple(offset.shape)}" if isinstance(offset, torch.Tensor)
               else f"{type(offset).__name__} {offset!r}")
        raise TypeError(f"generate_kv_cache_causal: offset must be a 0-d integer tensor (e.g. "
                        f"torch.tensor(cache_len, device=...), advanced in place each step) or a non-empty 1-D one "
                        f"with a cache length per batch element; got {got}")

    if offset.dim() == 0:
        def kv_cache_causal(b, h, q_idx, kv_idx):
            return q_idx + offset >= kv_idx
    else:
        def kv_cache_causal(b, h, q_idx, kv_idx):
            return q_idx + offset[b] >= kv_idx

    return kv_cache_causal


def main():
    from flexlite import create_block_mask
    offset = torch.tensor(1000)
    print(create_block_mask(generate_kv_cache_causal(offset), None, None, 16, 1016, device="cpu", BLOCK_SIZE=16))


if __name__ == "__main__":
    main()
