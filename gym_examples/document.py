"""Document masking over packed sequences: several documents concatenated into one sequence (no padding),
each token attending only within its own document, under any inner mask (causal, sliding window, ...)
applied in document-local positions.

A layout is given by lengths, by offsets (attention-gym's form) or by one document id per token; all three
build the same mask. A new layout is a new BlockMask but the same kernel: the document ids are a kernel
argument, not a constant.

    python gym_examples/document.py [--small] [--png DIR]
"""

# %%
import random

from _common import check, draw, setup
from flexlite import create_block_mask, create_mask, kernel_path, noop_mask
from flexlite.masks import (causal_mask, document_ids_from_lengths, generate_doc_mask_mod, generate_sliding_window,
                            length_to_offsets)

cfg = setup(__doc__)
S, DOCS = cfg.size(8192, 128), cfg.size(12, 4)
BLOCK = cfg.size(128, 32)


def random_lengths(total: int, n: int, seed: int) -> list:
    """n document lengths >= 1 that sum to total."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, total), n - 1))
    return [b - a for a, b in zip([0] + cuts, cuts + [total])]


lengths = random_lengths(S, DOCS, seed=0)
print(f"{DOCS} documents, lengths {lengths}")

# %% [markdown]
# Three ways to give the same layout.

# %%
by_lengths = generate_doc_mask_mod(causal_mask, lengths=lengths, device=cfg.device)
by_offsets = generate_doc_mask_mod(causal_mask, offsets=length_to_offsets(lengths, device=cfg.device))
by_ids = generate_doc_mask_mod(causal_mask, document_ids_from_lengths(lengths, device=cfg.device))
n = min(S, 1024)
dense = [create_mask(m, 1, 1, n, n, device=cfg.device) for m in (by_lengths, by_offsets, by_ids)]
assert dense[0].equal(dense[1]) and dense[0].equal(dense[2])

block_mask = create_block_mask(by_lengths, None, None, S, S, device=cfg.device, BLOCK_SIZE=BLOCK)
print(f"{by_lengths.__name__}:\n{block_mask}")
check(cfg, by_lengths.__name__, S, block_mask=block_mask)

# %% [markdown]
# Any inner mask: bidirectional inside documents (noop_mask), or a sliding window inside documents.

# %%
for inner in (noop_mask, generate_sliding_window(cfg.size(256, 12))):
    mask = generate_doc_mask_mod(inner, lengths=lengths, device=cfg.device)
    block_mask = create_block_mask(mask, None, None, S, S, device=cfg.device, BLOCK_SIZE=BLOCK)
    print(f"{mask.__name__}:\n{block_mask}")
    check(cfg, mask.__name__, S, block_mask=block_mask)

# %% [markdown]
# A new batch with a new layout: new block mask, same generated kernel (no recompile).

# %%
other = generate_doc_mask_mod(causal_mask, lengths=random_lengths(S, DOCS + 3, seed=1), device=cfg.device)
other_block_mask = create_block_mask(other, None, None, S, S, device=cfg.device, BLOCK_SIZE=BLOCK)
same_kernel = kernel_path(None, other_block_mask) == kernel_path(None, create_block_mask(
    by_lengths, None, None, S, S, device=cfg.device, BLOCK_SIZE=BLOCK))
print(f"new layout, same kernel file: {same_kernel}")
if not same_kernel:
    cfg.failures.append("document kernel reuse")

small = [5, 9, 7]
draw(cfg, "document_causal_5_9_7", mask_mod=generate_doc_mask_mod(causal_mask, lengths=small), q_len=sum(small))

cfg.finish()
