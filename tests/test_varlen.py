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


@pytest.mark.parametrize("B, lengths", [(0, []), (2, [0, 0])], ids=["no_samples", "empty_samples"])
def test_pack_of_nothing_stays_in_autograd(B, lengths):
    """An empty packed batch (no samples, or samples of no tokens) is tied to the padded input as any other, so that a
    loss over it back-propagates (empty gradients) instead of failing with 'does not require grad' (no samples: the
    packed tensor was new zeros)."""
    x = torch.randn(B, 2, 5, 8, device=DEVICE, requires_grad=True)
    packed, cu = pack(x, lengths)
    assert packed.shape == (1, 2, 0, 8) and cu.tolist() == [0] * (B + 1)
    packed.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape and not x.grad.any()


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


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_queries_and_keys_packed_apart(causal):
    """cu_seqlens_k (flash-attn's): query chunks over longer (or shorter, or no) keys per sample; each sample's
    rows are attention over its own keys with causal aligned to the bottom right (key j seen by query i if
    j <= i + Lk - Lq), rows with no key give 0; gradients are the reference's."""
    from test_backward import check_backward
    lengths_q, lengths_k = [5, 40, 3, 30], [70, 40, 0, 20]
    cu_q = torch.tensor([0, 5, 45, 48, 78], dtype=torch.int32)
    cu_k = torch.tensor([0, 70, 110, 110, 130], dtype=torch.int32)
    q = rand_qkv(1, 2, 2, 78, 130, 16, seed=1)[0]
    k, v = rand_qkv(1, 2, 2, 78, 130, 16, seed=2)[1:]
    bm = varlen_block_mask(cu_q, causal=causal, BLOCK_SIZE=16, device=DEVICE, cu_seqlens_k=cu_k)
    assert bm.shape == (1, 1, 78, 130)
    out = flex_attention(q, k, v, block_mask=bm)
    for b, (lq, lk) in enumerate(zip(lengths_q, lengths_k)):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        keys = slice(int(cu_k[b]), int(cu_k[b + 1]))
        if causal and lq > lk:  # its first lq - lk queries see no key: out 0 there
            assert torch.equal(out[:, :, rows][:, :, :lq - lk], torch.zeros_like(out[:, :, rows][:, :, :lq - lk]))
        if lk == 0:
            assert torch.equal(out[:, :, rows], torch.zeros_like(out[:, :, rows]))
            continue
        mask = create_block_mask(lambda b_, h, i, j, shift=lk - lq: j <= i + shift, None, None, lq, lk,
                                 device=DEVICE) if causal else None
        ref, _ = attention_reference(q[:, :, rows], k[:, :, keys], v[:, :, keys], block_mask=mask)
        assert_close(out[:, :, rows], ref, *TOLERANCES[torch.float32], name=f"sample {b}")
    check_backward(q, k, v, block_mask=bm, name="packed apart")
    with pytest.raises(ValueError, match="cu_seqlens_k must have one entry per sample"):
        varlen_block_mask(cu_q, cu_seqlens_k=cu_k[:3], device=DEVICE)


def test_bad_inputs():
    with pytest.raises(ValueError, match="lengths must be 2 ints"):
        pack(torch.zeros(2, 1, 8, 4), [3, 9])
    with pytest.raises(ValueError, match="4-D"):
        pack(torch.zeros(8, 4), [3])
    with pytest.raises(ValueError, match="cu_seqlens must rise"):
        unpack(torch.zeros(1, 1, 10, 4), torch.tensor([0, 4, 3, 10]), 8)
    with pytest.raises(ValueError, match="longer than max_len"):
        unpack(torch.zeros(1, 1, 10, 4), torch.tensor([0, 10]), 8)


@pytest.mark.parametrize("bad, error, match", [
    ([0, 5.0], TypeError, "cu_seqlens_k must be an int32 tensor"),
    (torch.tensor([0.0, 5.0]), TypeError, "cu_seqlens_k must be an integer"),
    (torch.tensor([[0, 5]]), ValueError, "cu_seqlens_k must be 1-D"),
    (torch.tensor([0, 9, 5]), ValueError, "cu_seqlens_k must rise from 0"),
    (torch.tensor([0, 5], device="meta"), ValueError, "cu_seqlens_k is a meta tensor"),
])
def test_a_bad_cu_seqlens_k_is_named_as_such(bad, error, match):
    with pytest.raises(error, match=match):
        varlen_block_mask(torch.tensor([0, 5], dtype=torch.int32), cu_seqlens_k=bad, BLOCK_SIZE=16)


@pytest.mark.parametrize("keys", [None, [0, 40, 90]])
@pytest.mark.parametrize("device", ["meta", torch.device("meta")])
def test_a_meta_device_or_cu_seqlens_gets_flexlites_error(keys, device):
    """A block mask is built from the lengths' values: a meta device (or meta lengths) has none, and is refused up
    front with the argument's name (a ValueError, not torch's copy error); a device flexlite does not run on is
    refused as create_block_mask refuses it."""
    cu_seqlens = torch.tensor([0, 30, 70], dtype=torch.int32)
    with pytest.raises(ValueError, match="varlen_block_mask: device is meta, but a meta device cannot hold a block "
                                         "mask built from lengths.*use a real device such as 'cpu' or 'cuda'"):
        varlen_block_mask(cu_seqlens, device=device, cu_seqlens_k=keys, BLOCK_SIZE=16)
    with pytest.raises(ValueError, match="varlen_block_mask: cu_seqlens is a meta tensor"):
        varlen_block_mask(cu_seqlens.to("meta"), cu_seqlens_k=keys, BLOCK_SIZE=16)
    with pytest.raises(NotImplementedError, match="varlen_block_mask: device is mps; .*use 'cuda' or 'cpu'"):
        varlen_block_mask(cu_seqlens, device="mps", cu_seqlens_k=keys, BLOCK_SIZE=16)
