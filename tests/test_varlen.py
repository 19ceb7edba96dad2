"""Packed variable-length batches: pack/unpack, and attention over the packed batch equals per-sample
attention, with the cross-sample blocks skipped."""

import pytest
import torch

from flexlite import attention_reference, create_block_mask, flex_attention
from flexlite.masks import causal_mask
from flexlite.varlen import pack, unpack, varlen_block_mask
from helpers import DEVICE, TOLERANCES, assert_close, rand_qkv

LENGTHS = [37, 100, 1, 64]


def test_pack_unpack_round_trip():
    x = torch.randn(4, 2, 100, 8, device=DEVICE)
    packed, cu = pack(x, LENGTHS)
    assert packed.shape == (1, 2, sum(LENGTHS), 8) and cu.tolist() == [0, 37, 137, 138, 202]
    back = unpack(packed, cu, 100)
    for b, n in enumerate(LENGTHS):
        assert torch.equal(back[b, :, :n], x[b, :, :n]) and (back[b, :, n:] == 0).all()


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_packed_attention_equals_per_sample_attention(causal):
    q, k, v = rand_qkv(4, 2, 2, 100, 100, 16)
    (pq, cu), (pk, _), (pv, _) = pack(q, LENGTHS), pack(k, LENGTHS), pack(v, LENGTHS)
    bm = varlen_block_mask(cu, causal=causal, BLOCK_SIZE=32)
    out = unpack(flex_attention(pq, pk, pv, block_mask=bm), cu, 100)
    for b, n in enumerate(LENGTHS):
        qs, ks, vs = q[b:b + 1, :, :n], k[b:b + 1, :, :n], v[b:b + 1, :, :n]
        per_sample = create_block_mask(causal_mask, None, None, n, n, device=DEVICE, BLOCK_SIZE=32) if causal else None
        ref, _ = attention_reference(qs, ks, vs, block_mask=per_sample)
        assert_close(out[b:b + 1, :, :n], ref, *TOLERANCES[torch.float32], name=f"sample {b}")


def test_cross_sample_blocks_are_skipped():
    lengths = [256, 256, 512]
    cu = torch.tensor([0, 256, 512, 1024], dtype=torch.int32, device=DEVICE)
    bm = varlen_block_mask(cu, causal=False, BLOCK_SIZE=128)
    blocks = sum((n // 128) ** 2 for n in lengths)
    assert int(bm.to_dense().sum()) == blocks  # exactly the per-sample blocks, nothing across


def test_bad_inputs():
    with pytest.raises(ValueError, match="lengths must be 2 ints"):
        pack(torch.zeros(2, 1, 8, 4), [3, 9])
    with pytest.raises(ValueError, match="4-D"):
        pack(torch.zeros(8, 4), [3])
    with pytest.raises(ValueError, match="cu_seqlens must rise"):
        unpack(torch.zeros(1, 1, 10, 4), torch.tensor([0, 4, 3, 10]), 8)
    with pytest.raises(ValueError, match="longer than max_len"):
        unpack(torch.zeros(1, 1, 10, 4), torch.tensor([0, 10]), 8)
