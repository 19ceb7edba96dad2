"""Tests for flexlite.block_mask: block masks checked exactly against a dense oracle.

The oracle evaluates each mask_mod densely per (b, h) with its own two-level vmap (independent of
the builder's chunked vmap_bhqkv path) and classifies blocks with explicit loops over block tiles.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.fx

import flexlite.block_mask as bm_mod
from catalog import CATALOG, USES_BH
from flexlite.block_mask import (BlockMask, and_masks, create_block_mask, create_mask, noop_mask,
                                 or_masks)

from helpers import DEVICE
SIZES = [(1, 1, 1, 1), (1, 1, 63, 63), (2, 2, 111, 200), (1, 2, 256, 256), (2, 1, 200, 111)]
BLOCKS = [128, (32, 64), (16, 16)]


# ----------------------------------------------------------------------------------------------
# oracle
# ----------------------------------------------------------------------------------------------

def keep_all(b, h, q_idx, kv_idx):
    return q_idx >= 0


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def keep_none(b, h, q_idx, kv_idx):
    return q_idx < 0


def catalog_mask(name, B, H, Lq, Lkv, device=DEVICE):
    mask_mod = CATALOG[name](B, H, Lq, Lkv, device).mask_mod
    return mask_mod if mask_mod is not None else keep_all


def oracle_dense(mask_mod, B, H, Lq, Lkv):
    """bool [B, H, Lq, Lkv] on the CPU, one (b, h) at a time (evaluated on DEVICE, where the mods' captured
    tensors are)."""
    q = torch.arange(Lq, dtype=torch.int32, device=DEVICE)
    kv = torch.arange(Lkv, dtype=torch.int32, device=DEVICE)
    out = torch.empty(B, H, Lq, Lkv, dtype=torch.bool)
    for b, h in itertools.product(range(B), range(H)):
        bt, ht = (torch.tensor(i, dtype=torch.int32, device=DEVICE) for i in (b, h))

        def one(qi, ki):
            return mask_mod(bt, ht, qi, ki)
        grid = torch.vmap(torch.vmap(one, in_dims=(None, 0)), in_dims=(0, None))
        out[b, h] = grid(q, kv).cpu()
    return out


def oracle_blocks(dense, bq, bkv):
    """(partial, full) bool [B, H, nQ, nKV] from a dense mask, tile by tile."""
    B, H, Lq, Lkv = dense.shape
    nq, nkv = -(-Lq // bq), -(-Lkv // bkv)
    partial = torch.zeros(B, H, nq, nkv, dtype=torch.bool)
    full = torch.zeros(B, H, nq, nkv, dtype=torch.bool)
    for i, j in itertools.product(range(nq), range(nkv)):
        tile = dense[:, :, i * bq:(i + 1) * bq, j * bkv:(j + 1) * bkv].flatten(2)
        full[:, :, i, j] = tile.all(-1)
        partial[:, :, i, j] = tile.any(-1) & ~tile.all(-1)
    return partial, full


def expand_blocks(flags, bq, bkv, Lq, Lkv):
    return flags.repeat_interleave(bq, -2).repeat_interleave(bkv, -1)[..., :Lq, :Lkv]


def check_ordered(num_blocks, indices, flags, descending: bool = False):
    """(num_blocks, indices) compress bool flags [..., R, C]: ascending (or descending) valid prefix, permutation
    rows."""
    num_blocks, indices, flags = num_blocks.cpu(), indices.cpu(), flags.cpu()
    assert num_blocks.dtype == torch.int32 and indices.dtype == torch.int32
    assert indices.shape == flags.shape
    assert torch.equal(num_blocks, flags.sum(-1).to(torch.int32))
    C = flags.shape[-1]
    for n, row, want in zip(num_blocks.flatten().tolist(), indices.reshape(-1, C).tolist(),
                            flags.reshape(-1, C).tolist()):
        assert row[:n] == sorted((c for c in range(C) if want[c]), reverse=descending)
        assert sorted(row) == list(range(C))


def check_block_mask(bm, partial, full):
    """bm matches oracle block flags on both sides, through every accessor."""
    assert torch.equal(bm.dense_blocks(full=False).cpu(), partial)
    assert torch.equal(bm.dense_blocks(full=True).cpu(), full)
    assert torch.equal(bm.to_dense().cpu(), (partial | full).to(torch.int32))
    check_ordered(bm.kv_num_blocks, bm.kv_indices, partial)
    check_ordered(bm.full_kv_num_blocks, bm.full_kv_indices, full)
    check_ordered(bm.q_num_blocks, bm.q_indices, partial.transpose(-2, -1))
    check_ordered(bm.full_q_num_blocks, bm.full_q_indices, full.transpose(-2, -1))


def block_tuple(block):
    return (block, block) if isinstance(block, int) else block


# ----------------------------------------------------------------------------------------------
# create_block_mask vs the oracle
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("block", BLOCKS, ids=str)
@pytest.mark.parametrize("size", SIZES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", sorted(CATALOG))
def test_create_block_mask_matches_oracle(name, size, block):
    B, H, Lq, Lkv = size
    bq, bkv = block_tuple(block)
    mask_mod = catalog_mask(name, B, H, Lq, Lkv)
    bm = create_block_mask(mask_mod, B, H, Lq, Lkv, device=DEVICE, BLOCK_SIZE=block)
    dense = oracle_dense(mask_mod, B, H, Lq, Lkv)
    partial, full = oracle_blocks(dense, bq, bkv)

    assert bm.shape == (B, H, Lq, Lkv) and bm.seq_lengths == (Lq, Lkv)
    assert bm.BLOCK_SIZE == (bq, bkv) and bm.mask_mod is mask_mod
    check_block_mask(bm, partial, full)
    # kernel semantics reproduce the element mask: full blocks, plus mask_mod inside partial ones
    keep = expand_blocks(full, bq, bkv, Lq, Lkv) | (expand_blocks(partial, bq, bkv, Lq, Lkv) & dense)
    assert torch.equal(keep, dense)


@pytest.mark.parametrize("rows", [192, 96, 320])
@pytest.mark.parametrize("name, size, broadcast", [
    pytest.param(name, size, broadcast, id=f"{name}-{'x'.join(map(str, size))}{'-B/H None' * broadcast}")
    for name in sorted(CATALOG)
    for size, broadcast in (((2, 3, 640, 384), False), ((1, 2, 200, 333), False), ((2, 2, 448, 256), True))
    if not (broadcast and name in USES_BH)])  # (a mask that differs per batch or head does not broadcast)
def test_item_lists_for_other_q_blocks_keep_the_element_mask(name, size, broadcast, rows):
    """block_mask.item_lists (the warp-specialized forward's 192-row items at D64, launch.WS_FWD_WIDE_TILES): lists for
    q blocks of ``rows`` rows from create_block_mask's 128-row ones give the same element mask under the kernels'
    semantics (full blocks kept, mask_mod inside partial ones), list a kv block only where one of an item's q blocks
    does, and full only where all do; the partial ones from the last kv block down (the forward's warpgroups skip
    a walk's first tiles that keep none of their rows)."""
    B, H, Lq, Lkv = size
    mask_mod = catalog_mask(name, B, H, Lq, Lkv)
    bm = create_block_mask(mask_mod, None if broadcast else B, None if broadcast else H, Lq, Lkv, device=DEVICE)
    num, idx, full_num, full_idx = bm_mod.item_lists(bm, rows)
    n_kv = bm.kv_indices.shape[-1]
    assert num.shape == bm.kv_num_blocks.shape[:-1] + (-(-Lq // rows),) and idx.shape[-1] == n_kv
    partial = bm_mod._ordered_to_dense(num, idx, n_kv).cpu()
    full = bm_mod._ordered_to_dense(full_num, full_idx, n_kv).cpu()
    check_ordered(num, idx, partial, descending=True)
    check_ordered(full_num, full_idx, full)
    dense = oracle_dense(mask_mod, 1 if broadcast else B, 1 if broadcast else H, Lq, Lkv)
    keep = expand_blocks(full, rows, 128, Lq, Lkv) | (expand_blocks(partial, rows, 128, Lq, Lkv) & dense)
    assert torch.equal(keep, dense)
    listed, full128 = bm.to_dense().bool().cpu(), bm.dense_blocks(full=True).cpu()
    for i in range(num.shape[-1]):
        covered = slice(i * rows // 128, (min((i + 1) * rows, Lq) - 1) // 128 + 1)
        assert torch.equal(partial[..., i, :] | full[..., i, :], listed[..., covered, :].any(-2))
        assert torch.equal(full[..., i, :], full128[..., covered, :].all(-2))


def test_item_lists_only_for_block_masks_that_create_block_mask_made_and_nobody_changed():
    """Lists of partial blocks let mask_mod decide each position, which only create_block_mask's masks allow (absent
    blocks all False, full ones all True): block lists given by hand, modified in place, or with another mask_mod give
    None; separate_full_blocks=False gives partial lists alone."""
    made = create_block_mask(causal, 1, 1, 384, 384, device=DEVICE)
    assert bm_mod.item_lists(made, 192) is not None
    by_hand = BlockMask.from_kv_blocks(made.kv_num_blocks, made.kv_indices, made.full_kv_num_blocks,
                                       made.full_kv_indices, mask_mod=causal)
    assert bm_mod.item_lists(by_hand, 192) is None
    made.kv_num_blocks[..., 0] = 0  # (in place: the first q block now lists nothing)
    assert bm_mod.item_lists(made, 192) is None
    other = create_block_mask(causal, 1, 1, 384, 384, device=DEVICE)
    other.mask_mod = keep_all
    assert bm_mod.item_lists(other, 192) is None
    num, idx, full_num, full_idx = bm_mod.item_lists(
        create_block_mask(causal, 1, 1, 384, 384, device=DEVICE, separate_full_blocks=False), 192)
    assert full_num is None and full_idx is None and num.flatten().tolist() == [2, 3]


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_broadcast_b_h_none(name):
    B, H, L = 2, 3, 100
    mask_mod = catalog_mask(name, B, H, L, L)
    bm = create_block_mask(mask_mod, None, None, L, L, device=DEVICE, BLOCK_SIZE=32)
    assert bm.shape == (1, 1, L, L) and bm.kv_indices.shape == (1, 1, 4, 4)
    partial, full = oracle_blocks(oracle_dense(mask_mod, 1, 1, L, L), 32, 32)
    check_block_mask(bm, partial, full)
    if name not in USES_BH:
        full_bh = create_block_mask(mask_mod, B, H, L, L, device=DEVICE, BLOCK_SIZE=32)
        assert torch.equal(full_bh.to_dense(), bm.to_dense().expand(B, H, 4, 4))


def test_ragged_edge_block_can_be_full():
    """Only in-range positions count: a ragged edge block that is all True is full (torch: partial)."""
    bm = create_block_mask(keep_all, 1, 1, 200, 111, device=DEVICE, BLOCK_SIZE=128)
    assert bm.dense_blocks(full=True).all() and not bm.dense_blocks(full=False).any()


def test_separate_full_blocks_false():
    bm = create_block_mask(causal, 1, 1, 256, 256, device=DEVICE, separate_full_blocks=False)
    assert bm.full_kv_num_blocks is None and bm.full_q_indices is None
    assert torch.equal(bm.dense_blocks(full=False).cpu(), torch.tensor([[[[True, False], [True, True]]]]))
    assert not bm.dense_blocks(full=True).any()


def test_default_device():
    bm = create_block_mask(causal, 1, 1, 64, 64, BLOCK_SIZE=16)
    assert bm.device.type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_an_int_device_is_that_gpu_as_in_torch():
    """device=N (torch's DeviceLikeType) is cuda:N in create_block_mask, BlockMask.to and kernel_source, as the mask
    factories take it (was a TypeError there): on a machine without CUDA the error says so; on one with it, the mask is
    built on that GPU."""
    from flexlite import kernel_source
    assert kernel_source(None, device=0) == kernel_source(None, device="cuda:0")  # (CUDA source needs no GPU)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="create_block_mask: device is cuda:0 but CUDA is not available"):
            create_block_mask(causal, 1, 1, 64, 64, device=0, BLOCK_SIZE=16)
        with pytest.raises(ValueError, match="BlockMask.to: device is cuda:0 but CUDA is not available"):
            create_block_mask(causal, 1, 1, 64, 64, device="cpu", BLOCK_SIZE=16).to(0)
        return
    bm = create_block_mask(causal, 1, 1, 64, 64, device=0, BLOCK_SIZE=16)
    assert bm.device == torch.device("cuda", 0)
    assert create_block_mask(causal, 1, 1, 64, 64, device="cpu", BLOCK_SIZE=16).to(0).device == torch.device("cuda", 0)


# ----------------------------------------------------------------------------------------------
# chunked evaluation: the builder's vmap path, which runs off CUDA (on a GPU the block-mask kernel
# evaluates the mask block by block), so these tests build on the CPU whatever DEVICE is
# ----------------------------------------------------------------------------------------------

def counting(mask_mod):
    calls = []

    def counted(b, h, q_idx, kv_idx):
        calls.append(1)  # vmap calls the mod once per evaluation (with batched tensors)
        return mask_mod(b, h, q_idx, kv_idx)
    return counted, calls


@pytest.mark.parametrize("chunk_rows", [1, 2, 3])
@pytest.mark.parametrize("name", ["document", "per_batch_head", "nested_index", "sliding_window"])
def test_chunking_gives_identical_results(monkeypatch, name, chunk_rows):
    B, H, Lq, Lkv, bq, bkv = 2, 2, 200, 150, 32, 16
    mask_mod = catalog_mask(name, B, H, Lq, Lkv, "cpu")
    whole = create_block_mask(mask_mod, B, H, Lq, Lkv, device="cpu", BLOCK_SIZE=(bq, bkv))
    counted, calls = counting(mask_mod)
    monkeypatch.setattr(bm_mod, "_CHUNK_ELEMENTS", chunk_rows * B * H * bq * Lkv)
    chunked = create_block_mask(counted, B, H, Lq, Lkv, device="cpu", BLOCK_SIZE=(bq, bkv))
    n_q = -(-Lq // bq)
    assert len(calls) == 1 + -(-n_q // chunk_rows)  # the trace, then one vmapped call per chunk
    for a, b in zip(whole.as_tuple()[2:10], chunked.as_tuple()[2:10]):
        assert torch.equal(a, b)


def test_tiny_chunk_constant_evaluates_one_block_at_a_time(monkeypatch):
    monkeypatch.setattr(bm_mod, "_CHUNK_ELEMENTS", 1)
    counted, calls = counting(causal)
    bm = create_block_mask(counted, 1, 1, 130, 130, device="cpu", BLOCK_SIZE=16)
    assert len(calls) == 1 + 9 * 9  # the trace, then one call per block
    check_block_mask(bm, *oracle_blocks(oracle_dense(causal, 1, 1, 130, 130), 16, 16))


@pytest.mark.parametrize("chunk", ["one_bh_rows", "one_bh_row_in_pieces"])
@pytest.mark.parametrize("name", ["per_batch_head", "document", "nested_index"])
def test_chunks_smaller_than_a_row_of_all_heads(monkeypatch, name, chunk):
    # long KV x many heads: chunks go per (b, h), then per row in kv pieces; memory stays bounded
    B, H, Lq, Lkv, bq, bkv = 2, 3, 100, 150, 32, 16
    mask_mod = catalog_mask(name, B, H, Lq, Lkv, "cpu")
    whole = create_block_mask(mask_mod, B, H, Lq, Lkv, device="cpu", BLOCK_SIZE=(bq, bkv))
    limit = 2 * bq * Lkv if chunk == "one_bh_rows" else 3 * bq * bkv
    monkeypatch.setattr(bm_mod, "_CHUNK_ELEMENTS", limit)
    sizes = []
    real = bm_mod.index_vectors

    def spy(B, H, Lq, Lkv, device, **offsets):
        sizes.append(B * H * Lq * Lkv)
        return real(B, H, Lq, Lkv, device, **offsets)
    monkeypatch.setattr(bm_mod, "index_vectors", spy)
    chunked = create_block_mask(mask_mod, B, H, Lq, Lkv, device="cpu", BLOCK_SIZE=(bq, bkv))
    assert len(sizes) > B * H and max(sizes) <= limit
    for a, b in zip(whole.as_tuple()[2:10], chunked.as_tuple()[2:10]):
        assert torch.equal(a, b)


def test_default_chunk_is_bounded(monkeypatch):
    """A long mask is evaluated in pieces of at most _CHUNK_ELEMENTS positions."""
    shapes = []
    real = bm_mod.index_vectors

    def spy(B, H, Lq, Lkv, device, q_start=0, **offsets):
        shapes.append((B, H, Lq, Lkv, q_start))
        return real(B, H, Lq, Lkv, device, q_start=q_start, **offsets)
    monkeypatch.setattr(bm_mod, "index_vectors", spy)
    create_block_mask(causal, 2, 2, 8192, 4096, device="cpu")
    assert len(shapes) > 1
    assert all(B * H * Lq * Lkv <= bm_mod._CHUNK_ELEMENTS for B, H, Lq, Lkv, _ in shapes)
    assert [s[-1] for s in shapes] == list(range(0, 8192, shapes[0][2]))


# ----------------------------------------------------------------------------------------------
# from_kv_blocks, slicing, moving
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["causal", "document", "per_batch_head", "fully_masked_rows"])
def test_from_kv_blocks_round_trip(name):
    B, H, Lq, Lkv = 2, 2, 111, 200
    mask_mod = catalog_mask(name, B, H, Lq, Lkv)
    bm = create_block_mask(mask_mod, B, H, Lq, Lkv, device=DEVICE, BLOCK_SIZE=(16, 32))
    again = BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks,
                                     bm.full_kv_indices, BLOCK_SIZE=bm.BLOCK_SIZE,
                                     mask_mod=bm.mask_mod, seq_lengths=bm.seq_lengths)
    for a, b in zip(bm.as_tuple(), again.as_tuple()):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_from_kv_blocks_defaults_and_unordered_tail():
    # rows list their blocks first; what follows num_blocks is ignored (here: junk repeats)
    kv_num_blocks = torch.tensor([[[1, 2]]], dtype=torch.int32)
    kv_indices = torch.tensor([[[[1, 1, 1], [0, 2, 0]]]], dtype=torch.int32)
    bm = BlockMask.from_kv_blocks(kv_num_blocks, kv_indices)
    assert bm.BLOCK_SIZE == (128, 128) and bm.seq_lengths == (256, 384) and bm.shape == (1, 1, 256, 384)
    assert bm.mask_mod is noop_mask
    assert bm.full_kv_num_blocks is None and bm.full_q_num_blocks is None
    want = torch.tensor([[[[False, True, False], [True, False, True]]]])
    assert torch.equal(bm.dense_blocks(full=False), want)
    assert not bm.dense_blocks(full=True).any()
    check_ordered(bm.q_num_blocks, bm.q_indices, want.transpose(-2, -1))
    assert bm.sparsity() == pytest.approx(50.0)


@pytest.mark.parametrize("name", ["causal", "sliding_window", "prefix_lm", "per_batch_head"])
def test_adjust_crops_as_torch(name):
    """BlockMask._adjust(q, kv): the upper-left corner, block for block as torch's _adjust of the same blocks;
    attention with it is the reference's with mask_mod at the new lengths (for masks measured from the start)."""
    from torch.nn.attention.flex_attention import BlockMask as TorchBlockMask
    B, H, L, Lq, Lkv = 2, 2, 256, 111, 200
    mask_mod = catalog_mask(name, B, H, L, L)
    bm = create_block_mask(mask_mod, B, H, L, L, device=DEVICE, BLOCK_SIZE=(32, 64))
    small = bm._adjust(Lq, Lkv)
    cpu = [t.cpu() for t in (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices)]
    want = TorchBlockMask.from_kv_blocks(*cpu, BLOCK_SIZE=(32, 64), mask_mod=mask_mod, seq_lengths=(L, L))
    want = want._adjust(Lq, Lkv)
    assert small.seq_lengths == (Lq, Lkv) and small.mask_mod is bm.mask_mod
    for full, (num, idx) in ((False, (want.kv_num_blocks, want.kv_indices)),
                             (True, (want.full_kv_num_blocks, want.full_kv_indices))):
        dense = bm_mod._ordered_to_dense(num, idx, idx.shape[-1])
        assert torch.equal(small.dense_blocks(full=full).cpu(), dense), f"full={full}"
    check_ordered(small.q_num_blocks, small.q_indices, small.dense_blocks(full=False).transpose(-2, -1))
    from flexlite import attention_reference, flex_attention
    from helpers import TOLERANCES, assert_close, rand_qkv
    q, k, v = rand_qkv(B, H, H, Lq, Lkv, 16, seed=3)
    ref = attention_reference(q, k, v, block_mask=create_block_mask(mask_mod, B, H, Lq, Lkv, device=DEVICE))[0]
    assert_close(flex_attention(q, k, v, block_mask=small), ref, *TOLERANCES[torch.float32])
    with pytest.raises(ValueError, match=r"can only crop; \(257, 200\) exceeds"):
        bm._adjust(257, 200)
    with pytest.raises(TypeError, match="new_kv_len must be a positive int"):
        bm._adjust(100, 2.0)


GETITEM_INDICES = [1, -1, (slice(None), 2), (1, 2), (slice(0, 2), slice(1, 3)), (0, slice(None), 2),
                   (slice(None), slice(None), torch.tensor([0, 3])), torch.tensor([1, 0])]


@pytest.mark.parametrize("index", GETITEM_INDICES, ids=repr)
def test_getitem(index, monkeypatch):
    B, H, L = 2, 3, 128
    mask_mod = catalog_mask("per_batch_head", B, H, L, L)
    bm = create_block_mask(mask_mod, B, H, L, L, device=DEVICE, BLOCK_SIZE=32)

    def host_read(*args):
        raise AssertionError("slicing a BlockMask re-validated its values (a host sync per slice)")
    monkeypatch.setattr(bm_mod, "_check_kv_values", host_read)
    sub = bm[index]
    tup = index if isinstance(index, tuple) else (index,)
    dense_index = tuple(slice(i, i + 1 if i != -1 else None) if isinstance(i, int) else i for i in tup)
    partial = bm.dense_blocks(full=False)[dense_index].cpu()
    full = bm.dense_blocks(full=True)[dense_index].cpu()
    assert sub.kv_num_blocks.dim() == 3 and sub.kv_indices.dim() == 4
    assert sub.seq_lengths == bm.seq_lengths and sub.BLOCK_SIZE == bm.BLOCK_SIZE
    check_block_mask(sub, partial, full)
    with pytest.raises(RuntimeError, match="sliced BlockMask"):
        sub.mask_mod(*(torch.tensor(0),) * 4)


@pytest.mark.parametrize("index", [0, (slice(None), 1), (0, 0, slice(1, 3))], ids=repr)
def test_getitem_of_a_mask_without_its_q_side_has_none(index):
    """As torch's: a mask built without its q side (compute_q_blocks=False) slices to one without it (before: the q
    side was computed for every slice, a transpose per slice of a decode loop torch does not do); with one, the slice
    has its own. The slice without it still runs forward and backward (the kv side transposed when it runs)."""
    from torch.nn.attention.flex_attention import BlockMask as TorchBlockMask
    bm = create_block_mask(causal, 2, 2, 64, 64, device=DEVICE, BLOCK_SIZE=16)
    lists = (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices)
    for q_side in (False, True):
        ours = BlockMask.from_kv_blocks(*lists, BLOCK_SIZE=16, mask_mod=causal, compute_q_blocks=q_side)[index]
        theirs = TorchBlockMask.from_kv_blocks(*(t.cpu() for t in lists), BLOCK_SIZE=16, mask_mod=causal,
                                               compute_q_blocks=q_side)[index]
        for name in BlockMask._TENSOR_ATTRS:
            mine, want = getattr(ours, name), getattr(theirs, name)
            assert (mine is None) == (want is None) == (name.startswith(("q_", "full_q_")) and not q_side), name
            assert mine is None or torch.equal(mine.cpu(), want), name
    from flexlite import attention_reference, flex_attention
    ours.mask_mod = causal
    q, k, v = (torch.randn(*ours.kv_num_blocks.shape[:2], 64, 16, device=DEVICE, requires_grad=True)
               for _ in range(3))
    sliced = BlockMask.from_kv_blocks(*lists, BLOCK_SIZE=16, mask_mod=causal, compute_q_blocks=False)[index]
    if sliced.kv_num_blocks.shape[2] == 4:  # (whole q side: it runs at these lengths)
        sliced.mask_mod = causal
        flex_attention(q, k, v, block_mask=sliced).sum().backward()
        ref = attention_reference(q.detach(), k.detach(), v.detach(), block_mask=ours)[0]
        assert (flex_attention(q, k, v, block_mask=sliced).double() - ref).abs().max() < 1e-5
        assert q.grad.isfinite().all() and k.grad.isfinite().all()


def test_getitem_out_of_range():
    bm = create_block_mask(causal, 2, 1, 64, 64, device=DEVICE, BLOCK_SIZE=16)
    with pytest.raises(IndexError, match="out of range"):
        bm[2]


def test_to_device_and_as_tuple():
    bm = create_block_mask(causal, 1, 2, 64, 64, device=DEVICE, BLOCK_SIZE=16)
    moved = bm.to("meta")
    assert moved.device.type == "meta" and bm.device.type == torch.device(DEVICE).type
    assert all(getattr(moved, a).device.type == "meta" for a in BlockMask._TENSOR_ATTRS)
    back = bm.to(torch.device("cpu"))
    assert torch.equal(back.kv_indices, bm.kv_indices.cpu()) and back.mask_mod is causal
    flat = bm.as_tuple()  # torch's order, its four dq_* fields (None here) included
    assert len(flat) == 17 and flat[:2] == (64, 64) and flat[-3:] == (16, 16, causal)
    assert flat[2] is bm.kv_num_blocks and flat[9] is bm.full_q_indices and flat[10:14] == (None,) * 4
    nested = bm.as_tuple(flatten=False)
    assert len(nested) == 15 and nested[0] == (64, 64) and nested[-2] == (16, 16)
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask
    torchs = torch_create_block_mask(causal, 1, 2, 64, 64, device="cpu", BLOCK_SIZE=16)
    if all(hasattr(torchs, a) for a in BlockMask._DQ_ATTRS):  # torch 2.13's fields (2.11's as_tuple has fewer)
        theirs = torchs.as_tuple()
        assert len(theirs) == len(flat) and all(type(a) is type(b) or None in (a, b) for a, b in zip(theirs, flat))
    order = torch.arange(4, dtype=torch.int32, device=DEVICE)  # torch's metadata: kept, moved, not used
    kept = BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, dq_write_order=order, dq_kv_order=True)
    assert kept.dq_write_order is order and kept.dq_kv_order is True and kept.as_tuple()[10] is order
    assert kept.to("meta").dq_write_order.device.type == "meta" and kept.to("meta").dq_kv_order is True
    again = BlockMask(*nested[:9], BLOCK_SIZE=nested[-2], mask_mod=nested[-1], dq_kv_order_spt=False)
    assert again.dq_kv_order_spt is False and again.as_tuple()[13] is False
    assert bm.numel() == 1 * 2 * 64 * 64


# ----------------------------------------------------------------------------------------------
# sparsity and printing
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mask_mod, L, block, want", [
    (causal, 256, 128, 25.0),     # blocks: partial, empty / full, partial
    (causal, 200, 128, 25.0),     # counted in blocks, also for ragged lengths
    (keep_all, 300, 64, 0.0),
    (keep_none, 100, 16, 100.0),
    (causal, 512, 128, 37.5),     # 6 of 16 blocks empty
])
def test_sparsity(mask_mod, L, block, want):
    bm = create_block_mask(mask_mod, 1, 1, L, L, device=DEVICE, BLOCK_SIZE=block)
    assert bm.sparsity() == pytest.approx(want)


@pytest.mark.parametrize("index", [(slice(None), slice(None), slice(4, None)), slice(0, 0), (0, slice(1, 1))],
                         ids=["past the last q block", "no batch", "no head"])
def test_sparsity_and_printing_of_a_mask_without_blocks(index):
    """A slice with no blocks computes nothing: sparsity 100 (as torch's for the q-block slice), and printing it does
    not divide by zero (before: ZeroDivisionError out of sparsity(), str() and repr())."""
    bm = create_block_mask(causal, 2, 2, 64, 64, device=DEVICE, BLOCK_SIZE=16)[index]
    assert bm.kv_num_blocks.numel() * bm.kv_indices.shape[-1] == 0
    assert bm.sparsity() == 100.0
    assert str(bm).startswith(f"BlockMask(shape={bm.shape}, sparsity=100.00%,")
    assert "sparsity=100.00%" in repr(bm)


def test_str_small_causal_exact():
    bm = create_block_mask(causal, 1, 1, 256, 256, device=DEVICE, BLOCK_SIZE=128)
    # block (0,0): diagonal -> partial; (0,1): all kv > q -> empty; (1,0): all kv < q -> full
    assert bm.to_string() == "(0, 0)\n░░  \n██░░\n"
    assert str(bm) == "BlockMask(shape=(1, 1, 256, 256), sparsity=25.00%, \n(0, 0)\n░░  \n██░░\n)"


def test_to_string_limit():
    bm = create_block_mask(causal, 1, 3, 256, 256, device=DEVICE, BLOCK_SIZE=128)
    assert bm.to_string(limit=1) == (
        "(0, 0)\n░░  \n██░░\n\n...\n"
        "To print out more, set BlockMask.to_string(limit=N)\n"
        "You can also index (BlockMask[batch, head]) to choose a specific batch or head")
    assert bm.to_string().count("██░░") == 3 and "..." not in bm.to_string()
    assert bm.to_string().startswith("(0, 0)\n") and "\n(0, 2)\n" in bm.to_string()


def test_to_string_downsamples_large_masks():
    bm = create_block_mask(causal, 1, 1, 4096, 4096, device=DEVICE, BLOCK_SIZE=128)  # 32 x 32 blocks
    lines = bm.to_string().splitlines()
    # default grid (20, 20): 2 x 2 blocks per cell; a diagonal cell mixes partial/empty/full -> ░
    assert lines[0] == "(0, 0)" and len(lines) == 1 + 16
    assert lines[1:] == ["██" * i + "░░" + "  " * (15 - i) for i in range(16)]
    assert len(bm.to_string(grid_size=8).splitlines()) == 1 + 8
    assert len(bm.to_string(grid_size=-1).splitlines()) == 1 + 32
    assert len(bm.to_string(grid_size=(4, 32)).splitlines()[1]) == 64


def test_to_string_mixed_full_and_empty_cell_is_partial():
    def even_kv_blocks(b, h, q_idx, kv_idx):
        return (kv_idx // 16) % 2 == 0
    bm = create_block_mask(even_kv_blocks, 1, 1, 64, 64, device=DEVICE, BLOCK_SIZE=16)
    assert bm.to_string() == "(0, 0)\n" + "██  ██  \n" * 4
    assert bm.to_string(grid_size=(4, 2)) == "(0, 0)\n" + "░░░░\n" * 4


def test_repr_lists_shapes():
    bm = create_block_mask(causal, 2, 1, 256, 128, device=DEVICE, BLOCK_SIZE=(64, 32))
    text = repr(bm)
    assert text.startswith("BlockMask(\n    kv_num_blocks=torch.Size([2, 1, 4]),\n")
    assert "q_indices=torch.Size([2, 1, 4, 4])" in text
    assert "BLOCK_SIZE=(64, 32)" in text and "shape=(2, 1, 256, 128)" in text
    assert text.endswith("mask_mod=causal\n)")


# ----------------------------------------------------------------------------------------------
# create_mask and combinators
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["causal", "document", "nested_index", "per_batch_head"])
def test_create_mask_matches_oracle(name):
    B, H, Lq, Lkv = 2, 2, 37, 53
    mask_mod = catalog_mask(name, B, H, Lq, Lkv)
    got = create_mask(mask_mod, B, H, Lq, Lkv, device=DEVICE)
    assert got.dtype == torch.bool and torch.equal(got.cpu(), oracle_dense(mask_mod, B, H, Lq, Lkv))


def test_create_mask_score_mod_and_broadcast():
    def neg_inf_above_diagonal(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx >= kv_idx, score, -float("inf"))
    got = create_mask(neg_inf_above_diagonal, None, None, 20, 30, device=DEVICE)
    assert got.shape == (1, 1, 20, 30) and got.dtype == torch.bool
    assert torch.equal(got.cpu(), oracle_dense(causal, 1, 1, 20, 30))
    alibi = CATALOG["alibi_causal"](1, 2, 8, 8, DEVICE).score_mod
    assert create_mask(alibi, 1, 2, 8, 8, device=DEVICE).all()


def test_combinators():
    sliding = catalog_mask("sliding_window", 1, 1, 90, 90)
    prefix = catalog_mask("prefix_lm", 1, 1, 90, 90)
    a, p = oracle_dense(sliding, 1, 1, 90, 90), oracle_dense(prefix, 1, 1, 90, 90)
    assert torch.equal(create_mask(and_masks(sliding, prefix), 1, 1, 90, 90, DEVICE).cpu(), a & p)
    assert torch.equal(create_mask(or_masks(sliding, prefix), 1, 1, 90, 90, DEVICE).cpu(), a | p)
    assert torch.equal(create_mask(and_masks(sliding), 1, 1, 90, 90, DEVICE).cpu(), a)
    assert create_mask(and_masks(), 1, 1, 9, 9, DEVICE).all()
    assert not create_mask(or_masks(), 1, 1, 9, 9, DEVICE).any()
    assert create_mask(noop_mask, 2, 1, 9, 9, DEVICE).all()
    import inspect  # a drop-in: torch's parameter names, for calls by keyword

    from torch.nn.attention.flex_attention import noop_mask as torch_noop_mask
    assert list(inspect.signature(noop_mask).parameters) == list(inspect.signature(torch_noop_mask).parameters)
    assert and_masks(causal, noop_mask).__name__ == "and_masks(causal, noop_mask)"
    assert or_masks(causal).__name__ == "or_masks(causal)"
    bm = create_block_mask(or_masks(causal, keep_none), 1, 1, 256, 256, device=DEVICE)
    assert str(bm).endswith("░░  \n██░░\n)")


@pytest.mark.parametrize("mod", [and_masks(causal, catalog_mask("prefix_lm", 1, 1, 64, 64)),
                                 or_masks(causal, noop_mask), and_masks(), or_masks(), noop_mask],
                         ids=lambda m: m.__name__)
def test_mods_are_fx_traceable(mod):
    gm = torch.fx.symbolic_trace(mod)
    assert torch.equal(create_mask(gm, 1, 1, 64, 64, DEVICE), create_mask(mod, 1, 1, 64, 64, DEVICE))


# ----------------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------------

def three_args(b, q_idx, kv_idx):
    return q_idx >= kv_idx


def score_mod(score, b, h, q_idx, kv_idx):
    return score


def int_mask(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx).to(torch.int32)


def vector_mask(b, h, q_idx, kv_idx):
    return torch.stack([q_idx >= kv_idx, q_idx < kv_idx])


@pytest.mark.parametrize("args, kwargs, exc, match", [
    ((5, 1, 1, 8, 8), {}, TypeError, "mask_mod must be callable"),
    ((three_args, 1, 1, 8, 8), {}, TypeError, "must take (b, h, q_idx, kv_idx); got a function of 3 arguments"),
    ((score_mod, 1, 1, 8, 8), {}, TypeError, "looks like a score_mod"),
    ((causal, 0, 1, 8, 8), {}, ValueError, "B must be positive"),
    ((causal, 1, 1.5, 8, 8), {}, TypeError, "H must be a positive int or None"),
    ((causal, True, 1, 8, 8), {}, TypeError, "B must be"),
    ((causal, 1, 1, 0, 8), {}, ValueError, "Q_LEN must be positive"),
    ((causal, 1, 1, 8, None), {}, TypeError, "KV_LEN must be a positive int"),
    ((causal, 1, 1, 8, 8), {"BLOCK_SIZE": 100}, ValueError, "BLOCK_SIZE must be positive multiples of 16"),
    ((causal, 1, 1, 8, 8), {"BLOCK_SIZE": 0}, ValueError, "BLOCK_SIZE"),
    ((causal, 1, 1, 8, 8), {"BLOCK_SIZE": (32, -16)}, ValueError, "BLOCK_SIZE"),
    ((causal, 1, 1, 8, 8), {"BLOCK_SIZE": (32,)}, TypeError, "BLOCK_SIZE must be an int or"),
    ((causal, 1, 1, 8, 8), {"BLOCK_SIZE": "128"}, TypeError, "BLOCK_SIZE"),
    ((int_mask, 1, 1, 8, 8), {}, TypeError, "must return a bool tensor"),
    ((vector_mask, 1, 1, 8, 8), {}, ValueError, "one value per (b, h, q_idx, kv_idx)"),
])
def test_create_block_mask_errors(args, kwargs, exc, match):
    with pytest.raises(exc, match=match.replace("(", r"\(").replace(")", r"\)")):
        create_block_mask(*args, device=DEVICE, **kwargs)


def _kv(nb_dtype=torch.int32, idx_dtype=torch.int32, nb_shape=(1, 1, 2), idx_shape=(1, 1, 2, 3)):
    return torch.zeros(nb_shape, dtype=nb_dtype), torch.zeros(idx_shape, dtype=idx_dtype)


@pytest.mark.parametrize("args, kwargs, exc, match", [
    (([1], _kv()[1]), {}, TypeError, "kv_num_blocks must be a Tensor"),
    (_kv(nb_dtype=torch.int16), {}, TypeError, "kv_num_blocks must be int32"),
    (_kv(idx_dtype=torch.float32), {}, TypeError, "kv_indices must be int32"),
    (_kv(nb_shape=(2,), idx_shape=(2, 3)), {}, ValueError, "kv_num_blocks must have 3 dimensions"),
    (_kv(idx_shape=(1, 2, 3)), {}, ValueError, "kv_indices must have 4 dimensions"),
    (_kv(nb_shape=(1, 1, 3)), {}, ValueError, "kv_num_blocks shape (1, 1, 3) must equal"),
    (_kv(), {"full_kv_num_blocks": _kv()[0]}, ValueError, "both given or both None"),
    (_kv(), {"full_kv_num_blocks": _kv()[0], "full_kv_indices": _kv()[1].short()}, TypeError,
     "full_kv_indices must be int32"),
    (_kv(), dict(zip(("full_kv_num_blocks", "full_kv_indices"), _kv(nb_shape=(1, 1, 2), idx_shape=(1, 1, 2, 4)))),
     ValueError, "full_kv_indices shape"),
    (_kv(), {"BLOCK_SIZE": 8}, ValueError, "BLOCK_SIZE"),
    (_kv(), {"mask_mod": "causal"}, TypeError, "mask_mod must be callable"),
    (_kv(), {"mask_mod": score_mod}, TypeError, "looks like a score_mod"),
    (_kv(), {"seq_lengths": (0, 10)}, ValueError, "seq_lengths[0] must be positive"),
    (_kv(), {"seq_lengths": 10}, TypeError, "seq_lengths must be a (Q_LEN, KV_LEN) tuple"),
    (_kv(), {"compute_q_blocks": 0}, TypeError, "compute_q_blocks must be a bool"),
])
def test_from_kv_blocks_errors(args, kwargs, exc, match):
    # (int64 lists are taken, as torch's from_kv_blocks takes them: test_from_kv_blocks_takes_int64_lists)
    escaped = "".join("\\" + c if c in "()[]" else c for c in match)
    with pytest.raises(exc, match=escaped):
        BlockMask.from_kv_blocks(*args, **kwargs)


def test_from_kv_blocks_takes_int64_lists():
    # torch's from_kv_blocks keeps int64 lists as given; flexlite reads them as int32, in its BlockMask and in torch's
    from torch.nn.attention.flex_attention import BlockMask as TorchBlockMask

    from flexlite import flex_attention
    from helpers import rand_qkv
    num, idx = torch.tensor([[[1, 2]]], device=DEVICE), torch.tensor([[[[0, 1], [0, 1]]]], device=DEVICE)
    bm = BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=16)
    assert bm.kv_indices.dtype == torch.int32 and bm.to_dense().tolist() == [[[[1, 0], [1, 1]]]]
    q, k, v = rand_qkv(1, 1, 1, 32, 32, 16)
    theirs = TorchBlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=16)
    assert theirs.kv_indices.dtype == torch.int64
    assert torch.equal(flex_attention(q, k, v, block_mask=theirs), flex_attention(q, k, v, block_mask=bm))


@pytest.mark.parametrize("call, exc, match", [
    (lambda: and_masks(causal, 3), TypeError, "and_masks: argument 1 (3) is not callable"),
    (lambda: or_masks("x"), TypeError, "or_masks: argument 0 ('x') is not callable"),
    (lambda: create_mask(three_args, 1, 1, 4, 4, DEVICE), TypeError, "got a function of 3 arguments"),
    (lambda: create_mask(None, 1, 1, 4, 4, DEVICE), TypeError, "mod_fn must be callable"),
    (lambda: create_mask(causal, 1, 1, -4, 4, DEVICE), ValueError, "Q_LEN must be positive"),
    (lambda: BlockMask((32, 32), *_kv(), None, None, _kv()[0], None, None, None), ValueError,
     "q_num_blocks and q_indices must be both given or both None"),
    (lambda: BlockMask((32, 32), *_kv(), None, None, None, None, *_kv()), ValueError,
     "full_q_num_blocks / full_q_indices are given but full_kv_num_blocks / full_kv_indices are None"),
])
def test_other_errors(call, exc, match):
    escaped = "".join("\\" + c if c in "()[]" else c for c in match)
    with pytest.raises(exc, match=escaped):
        call()


def test_torchs_mod_type_names():
    """attention-gym imports torch's _mask_mod_signature / _score_mod_signature: flexlite has them, the same types."""
    import flexlite
    from torch.nn.attention import flex_attention as torch_flex

    assert flexlite._mask_mod_signature == torch_flex._mask_mod_signature
    assert flexlite._score_mod_signature == torch_flex._score_mod_signature
    # and the other private names attention-gym imports from torch's module (utils.py, its notebook, paged attention)
    from flexlite import _DEFAULT_SPARSE_BLOCK_SIZE, _identity, _ModificationType, _vmap_for_bhqkv
    assert _DEFAULT_SPARSE_BLOCK_SIZE == torch_flex._DEFAULT_SPARSE_BLOCK_SIZE
    assert (_identity, _ModificationType, _vmap_for_bhqkv) == (torch_flex._identity, torch_flex._ModificationType,
                                                               torch_flex._vmap_for_bhqkv)


def test_a_torch_mask_adjusted_to_shorter_keys_runs():
    """torch's BlockMask._adjust to a shorter key length leaves entries past the lists' width in their counted
    prefix (torch's kernels mask those keys out): taken out, the mask means what torch's does, forward and backward."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    from flexlite import attention_reference, flex_attention
    from helpers import TOLERANCES, assert_close, assert_grads_like_reference

    adjusted = torch_create_block_mask(causal, None, None, 256, 256, device=DEVICE, BLOCK_SIZE=64)._adjust(150, 111)
    assert (adjusted.kv_indices[0, 0, 2, :1] == 2).all()  # (the entry this is about)
    q = torch.randn(1, 2, 150, 16, device=DEVICE, requires_grad=True)
    k, v = (torch.randn(1, 2, 111, 16, device=DEVICE, requires_grad=True) for _ in range(2))
    if tuple(adjusted.seq_lengths) != (150, 111):
        # torch before 2.12: _adjust's mask is for the lengths rounded up to whole blocks, (192, 128), which torch's
        # own flex_attention refuses at (150, 111) too ("created for a larger length")
        assert tuple(adjusted.seq_lengths) == (192, 128)
        with pytest.raises(ValueError, match=r"built for Q_LEN=192, KV_LEN=128 but query has length 150 and key 111"):
            flex_attention(q, k, v, block_mask=adjusted)
        return
    mine = create_block_mask(causal, None, None, 150, 111, device=DEVICE, BLOCK_SIZE=64)
    out = flex_attention(q, k, v, block_mask=adjusted)
    ref = attention_reference(q, k, v, block_mask=mine)[0]
    assert_close(out, ref, *TOLERANCES[torch.float32])
    assert_grads_like_reference(out, ref, (q, k, v))


def test_a_mask_reading_b_or_h_built_for_none_warns():
    """B / H None broadcast index 0's blocks (as torch's, which says nothing): a mask_mod that reads b or h gets a
    UserWarning naming the dimension to pass, at the caller's line; a mask that does not, or given sizes, none."""
    import warnings

    def per_head(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= 16 * h

    with pytest.warns(UserWarning, match=r"reads h, but H is None.*pass H \(the number of heads\)") as record:
        create_block_mask(per_head, None, None, 64, 64, device=DEVICE, BLOCK_SIZE=16)
    assert [w.filename for w in record if "reads h" in str(w.message)] == [__file__]
    with pytest.warns(UserWarning, match=r"reads b and h, but B and H are None"):
        create_block_mask(CATALOG["per_batch_head"](2, 2, 64, 64, DEVICE).mask_mod, None, None, 64, 64,
                          device=DEVICE, BLOCK_SIZE=16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        create_block_mask(per_head, 1, 2, 64, 64, device=DEVICE, BLOCK_SIZE=16)
        create_block_mask(causal, None, None, 64, 64, device=DEVICE, BLOCK_SIZE=16)
        # b's shape only (noop_mask's b.new_ones(()), torch's with device=b.device, and the masks made from them):
        # its value is not read
        from torch.nn.attention import flex_attention as torch_flex
        for mask in (noop_mask, and_masks(), or_masks(), and_masks(noop_mask, causal), torch_flex.noop_mask,
                     torch_flex.and_masks(torch_flex.noop_mask, causal),
                     lambda b, h, q_idx, kv_idx: torch.zeros_like(h, dtype=torch.bool) | (q_idx >= kv_idx)):
            create_block_mask(mask, None, None, 64, 64, device=DEVICE, BLOCK_SIZE=16)
    # (its value read through another argument of a shape-only op)
    from flexlite.codegen.trace import arguments_read, trace_mod
    assert "b" in arguments_read(trace_mod(lambda b, h, q_idx, kv_idx: b.new_full((), b) > q_idx, "mask_mod"))


def test_a_block_mask_whose_q_side_is_not_its_kv_sides_transpose_is_refused():
    """The backward's dK / dV walk reads the q-side lists: a hand-built BlockMask whose q side is another mask's
    gave dK of that other mask, silently. Refused where the values are read (CPU); the kv side's own mask, whose
    q side from_kv_blocks computes, runs."""
    from flexlite import flex_attention

    kv_num = torch.tensor([[[1, 2, 3, 4]]], dtype=torch.int32, device=DEVICE)
    kv_idx = torch.tensor([[[[0, 1, 2, 3]] * 4]], dtype=torch.int32, device=DEVICE)
    good = BlockMask.from_kv_blocks(kv_num, kv_idx, BLOCK_SIZE=16)
    other = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx + 16, None, None, 64, 64, device=DEVICE,
                              BLOCK_SIZE=16)
    mixed = BlockMask((64, 64), good.kv_num_blocks, good.kv_indices, None, None, other.q_num_blocks,
                      other.q_indices, None, None, BLOCK_SIZE=(16, 16))
    q, k, v = (torch.randn(1, 1, 64, 16, device=DEVICE) for _ in range(3))
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="q_num_blocks / q_indices are not the transpose of kv_num_blocks"):
            flex_attention(q, k, v, block_mask=mixed)
    assert flex_attention(q, k, v, block_mask=good).isfinite().all()


def test_a_block_listed_twice_is_refused():
    """A block named twice in a row's counted entries (or both partial and full) is computed twice by the kernels: its
    keys counted twice in the row's softmax (the LSE off by log 2 where it is the row's only block). Before, accepted
    without a word, and the transpose check (over the blocks, each once) passed a q side with a repeat. Refused where
    the values are read (CPU), on either side; the mask without the repeat runs."""
    from flexlite import flex_attention

    kv_num = torch.tensor([[[1, 2, 3, 4]]], dtype=torch.int32, device=DEVICE)
    kv_idx = torch.tensor([[[[0, 1, 2, 3]] * 4]], dtype=torch.int32, device=DEVICE)
    good = BlockMask.from_kv_blocks(kv_num, kv_idx, BLOCK_SIZE=16)
    q_num, q_idx = good.q_num_blocks.clone(), good.q_indices.clone()
    assert q_num[0, 0, 3] == 1 and q_idx[0, 0, 3, 0] == 3
    q_num[0, 0, 3], q_idx[0, 0, 3, 1] = 2, 3  # kv block 3: q block 3 twice
    repeated = BlockMask((64, 64), good.kv_num_blocks, good.kv_indices, None, None, q_num, q_idx, None, None,
                         BLOCK_SIZE=(16, 16))
    q, k, v = (torch.randn(1, 1, 64, 16, device=DEVICE) for _ in range(3))
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match=r"flex_attention: block_mask: q_indices\[0, 0, 3\] names a q block more "
                                             r"than once among the row's first q_num_blocks\[0, 0, 3\] = 2 entries "
                                             r"\[3, 3\]"):
            flex_attention(q, k, v, block_mask=repeated)
        kv_twice = kv_idx.clone()
        kv_twice[0, 0, 1, 1] = 0  # q block 1: kv block 0 twice
        with pytest.raises(ValueError, match=r"kv_indices\[0, 0, 1\] names a kv block more than once"):
            BlockMask.from_kv_blocks(kv_num, kv_twice, BLOCK_SIZE=16)
    assert flex_attention(q, k, v, block_mask=good).isfinite().all()


def test_a_block_mask_constructed_with_an_int_block_size_runs():
    """As from_kv_blocks takes it: BlockMask(..., BLOCK_SIZE=16) is (16, 16)."""
    from flexlite import attention_reference, flex_attention
    from helpers import TOLERANCES, assert_close, rand_qkv
    num, idx = (torch.tensor(x, dtype=torch.int32) for x in ([[[1, 2]]], [[[[0, 1], [0, 1]]]]))
    bm = BlockMask((32, 32), num.to(DEVICE), idx.to(DEVICE), None, None, None, None, None, None, BLOCK_SIZE=16,
                   mask_mod=causal)
    assert bm.BLOCK_SIZE == (16, 16)
    q, k, v = rand_qkv(1, 1, 1, 32, 32, 16)
    ref = attention_reference(q, k, v, block_mask=create_block_mask(causal, None, None, 32, 32, DEVICE, BLOCK_SIZE=16))
    assert_close(flex_attention(q, k, v, block_mask=bm), ref[0], *TOLERANCES[torch.float32])
    # torch's BlockMask keeps an int as it is given: taken so too (before: "'int' object is not iterable")
    from torch.nn.attention.flex_attention import BlockMask as TorchBlockMask
    theirs = TorchBlockMask((32, 32), num.to(DEVICE), idx.to(DEVICE), None, None, None, None, None, None, BLOCK_SIZE=16,
                            mask_mod=causal)
    assert theirs.BLOCK_SIZE == 16
    assert_close(flex_attention(q, k, v, block_mask=theirs), ref[0], *TOLERANCES[torch.float32])


# ----------------------------------------------------------------------------------------------
# block lists changed in place between calls (static buffers: a CUDA-graph decode loop updates its mask so), and
# masks made under torch.inference_mode, whose tensors keep no version counter
# ----------------------------------------------------------------------------------------------

def _window16(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx).abs() <= 16


def _lists(m):
    return m.kv_num_blocks, m.kv_indices, m.full_kv_num_blocks, m.full_kv_indices


def _attention_inputs(L=128, D=16):
    g = torch.Generator().manual_seed(1)
    return tuple(torch.randn(1, 2, L, D, generator=g).to(DEVICE) for _ in range(3))


def _attention_and_grads(block_mask):
    from flexlite import flex_attention
    q, k, v = (t.requires_grad_() for t in _attention_inputs())
    out = flex_attention(q, k, v, block_mask=block_mask)
    out.backward(torch.linspace(-1, 1, out.numel(), device=DEVICE).reshape(out.shape))
    return out, q.grad, k.grad, v.grad


@pytest.mark.parametrize("kind", ["flexlite_without_q_side", "torch_with_q_side", "torch_without_q_side"])
def test_block_lists_changed_in_place_are_read_anew_forward_and_backward(kind):
    """Each per-mask result kept between calls (the q side transposed for the backward, a torch mask's conversion,
    its checks) is keyed on the lists' versions too: before, the backward's dK / dV of a mask without its q side and
    a torch mask's forward kept the old lists (or a consistent torch mask was refused as not transposed)."""
    from flexlite import attention_reference
    from torch.nn.attention import flex_attention as torch_flex
    lib = BlockMask if kind.startswith("flexlite") else torch_flex.BlockMask
    make = create_block_mask if kind.startswith("flexlite") else torch_flex.create_block_mask
    old, new = (make(m, None, None, 128, 128, device=DEVICE, BLOCK_SIZE=32) for m in (causal, _window16))
    q_side = kind == "torch_with_q_side"
    mask = lib.from_kv_blocks(*(t.clone() for t in _lists(old)), BLOCK_SIZE=32, mask_mod=noop_mask,
                              compute_q_blocks=q_side)
    _attention_and_grads(mask)
    for dst, src in zip(_lists(mask), _lists(new)):
        dst.copy_(src)
    if q_side:
        for name in ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
            getattr(mask, name).copy_(getattr(new, name))
    got = _attention_and_grads(mask)
    fresh = lib.from_kv_blocks(*_lists(new), BLOCK_SIZE=32, mask_mod=noop_mask)
    want = _attention_and_grads(fresh)
    for name, x, y in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.equal(x, y), name
    # (noop_mask: the listed blocks whole)
    ref = attention_reference(*_attention_inputs(), block_mask=BlockMask.from_kv_blocks(*_lists(new), BLOCK_SIZE=32))[0]
    assert (got[0].double() - ref).abs().max() < 1e-5


def test_block_masks_under_inference_mode():
    """create_block_mask's tensors keep version counters under inference mode; a mask of inference tensors (which
    keep none) has its per-mask work redone every call, so an in-place change there is read too."""
    from flexlite import attention_reference, flex_attention
    q, k, v = _attention_inputs()
    with torch.inference_mode():
        made = create_block_mask(causal, None, None, 128, 128, device=DEVICE, BLOCK_SIZE=32)
        assert not made.kv_indices.is_inference()
        out = flex_attention(q, k, v, block_mask=made)
        old = BlockMask.from_kv_blocks(*(t.clone() for t in _lists(made)), BLOCK_SIZE=32, compute_q_blocks=False)
        assert old.kv_indices.is_inference()
        flex_attention(q, k, v, block_mask=old)
        new = create_block_mask(_window16, None, None, 128, 128, device=DEVICE, BLOCK_SIZE=32)
        for dst, src in zip(_lists(old), _lists(new)):
            dst.copy_(src)
        changed = flex_attention(q, k, v, block_mask=old)
    for got, mask in ((out, made), (changed, BlockMask.from_kv_blocks(*_lists(new), BLOCK_SIZE=32))):
        assert (got.double() - attention_reference(q, k, v, block_mask=mask)[0]).abs().max() < 1e-5
