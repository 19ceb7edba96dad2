"""Bad-input battery for the public functions other than flex_attention's own argument table (test_errors.py):
every wrong kind of input either gives the right result or a typed error (ValueError / TypeError /
NotImplementedError, IndexError for indexing) that names the argument and the fix; no crash from deep inside
torch or Triton, no silent wrong answer.

Validation cases never launch a kernel (the ``no_launch`` fixture fails any launch); the few right-result cases
(``test_right_result_*``) launch tiny ones.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import flexlite
from flexlite import (AuxRequest, BlockMask, UntraceableModError, and_masks, api, attention_reference,
                      create_block_mask, create_mask, flex_attention, kernel_source, noop_mask, or_masks)
from flexlite.kernels import flash_attention, triton_matmul
from flexlite.mods import generate_tanh_softcap
from flexlite.masks import (build_named_mask, generate_causal_document_mask, generate_kv_cache_causal,
                            generate_vision_cross_attention_mask_mod)
from flexlite.masks.flamingo import generate_vision_cross_attention_from_ranges
from flexlite.runtime import launch
from flexlite.varlen import pack, unpack, varlen_block_mask
from flexlite.viz import attention_scores, visualize_attention_scores
from helpers import DEVICE, TOLERANCES, assert_close, rand_qkv

NO_CUDA_DEVICE = "cuda:99"  # not a visible GPU on any machine: "CUDA is not available" or "only N GPU(s)"


# ----------------------------------------------------------------------------------------------
# mods of every wrong kind

def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def score_identity(score, b, h, q_idx, kv_idx):
    return score


def branchy(b, h, q_idx, kv_idx):
    if q_idx > kv_idx:  # Python control flow on a tensor: untraceable
        return q_idx >= 0
    return q_idx < 0


def uses_item(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx.item()


def float_mask(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx).float()


def constant_mask(b, h, q_idx, kv_idx):
    return True


def none_mask(b, h, q_idx, kv_idx):
    return None


def raising_mask(b, h, q_idx, kv_idx):
    return 1 / 0


def keyword_only_mask(*, b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def none_score(score, b, h, q_idx, kv_idx):
    return None


def item_score(score, b, h, q_idx, kv_idx):
    return score * q_idx.item()


@pytest.fixture(autouse=True)
def no_launch(request, monkeypatch):
    """Validation happens before any kernel work: bad input never reaches a launch."""
    if request.node.name.startswith("test_right_result"):
        return

    def fail(*a, **k):
        raise AssertionError("a kernel was launched for bad input")
    for module in (launch, flexlite.api):  # api imported the launchers by name
        for name in ("launch_forward", "launch_decode", "launch_backward"):
            monkeypatch.setattr(module, name, fail)


def check(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def small_mask(B=2, H=2, L=64, block=16):
    return create_block_mask(causal, B, H, L, L, device=DEVICE, BLOCK_SIZE=block)


# ----------------------------------------------------------------------------------------------
# create_block_mask

def cbm(mask_mod=causal, B=1, H=1, Q_LEN=32, KV_LEN=32, **kw):
    kw.setdefault("device", DEVICE)
    return lambda: create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, **kw)


CREATE_BLOCK_MASK = {
    "B_float": (cbm(B=1.0), TypeError, r"B must be a positive int or None; got 1\.0"),
    "B_tensor": (cbm(B=torch.tensor(2)), TypeError, "B must be a positive int or None"),
    "B_negative": (cbm(B=-2), ValueError, "B must be positive; got -2"),
    "H_zero": (cbm(H=0), ValueError, "H must be positive; got 0"),
    "H_bool": (cbm(H=False), TypeError, "H must be a positive int or None; got False"),
    "Q_LEN_negative": (cbm(Q_LEN=-1), ValueError, "Q_LEN must be positive; got -1"),
    "Q_LEN_float": (cbm(Q_LEN=32.0), TypeError, "Q_LEN must be a positive int; got 32.0"),
    "KV_LEN_zero": (cbm(KV_LEN=0), ValueError, "KV_LEN must be positive; got 0"),
    "KV_LEN_bool": (cbm(KV_LEN=True), TypeError, "KV_LEN must be a positive int; got True"),
    "BLOCK_SIZE_float": (cbm(BLOCK_SIZE=16.0), TypeError, r"BLOCK_SIZE must be an int or a \(Q_BLOCK_SIZE"),
    "BLOCK_SIZE_bool": (cbm(BLOCK_SIZE=True), TypeError, "BLOCK_SIZE must be an int or"),
    "BLOCK_SIZE_triple": (cbm(BLOCK_SIZE=(16, 16, 16)), TypeError, r"got \(16, 16, 16\)"),
    "BLOCK_SIZE_pair_with_bool": (cbm(BLOCK_SIZE=(16, True)), TypeError, "BLOCK_SIZE must be an int or"),
    "BLOCK_SIZE_pair_zero": (cbm(BLOCK_SIZE=(0, 16)), ValueError, "positive multiples of 16"),
    "BLOCK_SIZE_not_multiple_of_16": (cbm(BLOCK_SIZE=8), ValueError, "positive multiples of 16; got 8"),
    "device_unknown_string": (cbm(device="gpu"), ValueError, r"device='gpu' is not a device; use 'cuda'"),
    "device_negative_int": (cbm(device=-1), ValueError, r"device=-1 is no GPU index; use 0, 1, \.\.\. \(GPU N\)"),
    "device_int_past_the_gpus": (cbm(device=99), ValueError, "cuda:99 but (CUDA is not available|only)"),
    "device_list": (cbm(device=["cpu"]), TypeError, "device must be a str, torch.device or GPU index"),
    "device_meta": (cbm(device="meta"), NotImplementedError, "device is meta; flexlite runs on CUDA .* and CPU"),
    "device_missing_gpu": (cbm(device=NO_CUDA_DEVICE), ValueError, "cuda:99 but (CUDA is not available|only)"),
    "mask_mod_keyword_only": (cbm(keyword_only_mask), TypeError, "got a function of 0 arguments"),
    "mask_mod_is_a_module": (cbm(torch.nn.Identity()), UntraceableModError, "Identity"),
    "mask_mod_untraceable": (cbm(branchy), UntraceableModError, r"'branchy' cannot be traced.*torch\.where"),
    "mask_mod_item": (cbm(uses_item), UntraceableModError, r"'uses_item' calls Tensor\.item\(\).*keep it a tensor"),
    "mask_mod_raises": (cbm(raising_mask), UntraceableModError, "'raising_mask' failed while being traced: "
                        "ZeroDivisionError"),
    "mask_mod_returns_float": (cbm(float_mask), TypeError, r"'float_mask' must return a bool tensor; got "
                               r"torch\.float32 .*\.bool\(\)"),
    "mask_mod_returns_constant": (cbm(constant_mask), TypeError, "Python constant True: return a tensor, e.g. "
                                  "noop_mask"),
    "mask_mod_returns_none": (cbm(none_mask), TypeError, "'none_mask' must return a bool tensor; got NoneType"),
    "separate_full_blocks_not_bool": (cbm(separate_full_blocks="no"), TypeError,
                                      "separate_full_blocks must be a bool"),
    "compute_dq_write_order_not_bool": (cbm(compute_dq_write_order=1), TypeError,
                                        "compute_dq_write_order must be a bool"),
    "dq_kv_order_not_bool": (cbm(dq_kv_order=None), TypeError, "dq_kv_order must be a bool"),
    # evaluated in torch (on CPU; a CUDA block mask's kernel reads a captured tensor out of range as 0, documented)
    "document_lengths_short_of_the_sequence": (
        cbm(generate_causal_document_mask([10, 12]), device="cpu"), ValueError,
        r"mask_mod 'document_causal_mask' indexed a tensor out of range .*index 22 is out of bounds.* document "
        r"lengths that do not add up"),
    "mask_mod_dynamic_shape": (cbm(lambda b, h, q, kv: torch.nonzero(q >= kv).numel() >= 0, device="cpu"),
                               NotImplementedError, r"data-dependent output shape \(nonzero"),
}


@pytest.mark.parametrize("name", sorted(CREATE_BLOCK_MASK))
def test_create_block_mask(name):
    check(*CREATE_BLOCK_MASK[name])


def test_create_block_mask_takes_torchs_dq_write_order_flags_with_no_effect():
    """torch 2.13's create_block_mask(compute_dq_write_order, dq_kv_order): metadata for its FLASH backend's
    deterministic dQ; flexlite accepts them (its deterministic backward needs none) and builds the same mask."""
    plain = create_block_mask(causal, 2, None, 80, 48, device=DEVICE, BLOCK_SIZE=16)
    flagged = create_block_mask(causal, 2, None, 80, 48, device=DEVICE, BLOCK_SIZE=16, compute_dq_write_order=True,
                                dq_kv_order=False)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks"):
        assert torch.equal(getattr(plain, name), getattr(flagged, name)), name


def test_create_block_mask_accepts_numpy_ints_and_list_block_size():
    bm = create_block_mask(causal, np.int64(2), None, np.int64(32), 32, device=DEVICE, BLOCK_SIZE=[16, 32])
    assert bm.shape == (2, 1, 32, 32) and bm.BLOCK_SIZE == (16, 32)
    assert bm.to_dense().tolist() == [[[[1], [1]]]] * 2  # one kv block of 32: row 0 partial, row 1 full


# ----------------------------------------------------------------------------------------------
# create_mask, and_masks / or_masks

def cm(mod_fn=causal, B=1, H=1, Q_LEN=8, KV_LEN=8, device=DEVICE):
    return lambda: create_mask(mod_fn, B, H, Q_LEN, KV_LEN, device)


CREATE_MASK = {
    "B_float": (cm(B=2.0), TypeError, "create_mask: B must be a positive int or None"),
    "KV_LEN_zero": (cm(KV_LEN=0), ValueError, "create_mask: KV_LEN must be positive"),
    "device_unknown_string": (cm(device="gpu"), ValueError, "create_mask: device='gpu' is not a device"),
    "device_meta": (cm(device="meta"), NotImplementedError, "create_mask: device is meta"),
    "mod_six_arguments": (cm(lambda a, b, c, d, e, f: a), TypeError, "got a function of 6 arguments"),
    "mask_mod_untraceable": (cm(branchy), UntraceableModError, r"torch\.where"),
    "mask_mod_item": (cm(uses_item), UntraceableModError, r"Tensor\.item\(\)"),
    "mask_mod_returns_float": (cm(float_mask), TypeError, r"create_mask: mask_mod 'float_mask' must return a bool"),
    "mask_mod_returns_constant": (cm(constant_mask), TypeError, "Python constant True"),
    "mask_mod_returns_none": (cm(none_mask), TypeError, "must return a bool tensor; got NoneType"),
    "score_mod_returns_none": (cm(none_score), TypeError, "score_mod 'none_score' must return the new score"),
}


@pytest.mark.parametrize("name", sorted(CREATE_MASK))
def test_create_mask(name):
    check(*CREATE_MASK[name])


COMBINATORS = {
    "and_score_mod": (lambda: and_masks(causal, score_identity), TypeError,
                      r"and_masks: argument 1 'score_identity' must take \(b, h, q_idx, kv_idx\).*looks like a "
                      r"score_mod"),
    "or_three_arguments": (lambda: or_masks(lambda b, h, q: q >= 0), TypeError,
                           r"or_masks: argument 0 '<lambda>' must take .*got a function of 3 arguments"),
    "and_none": (lambda: and_masks(None), TypeError, r"and_masks: argument 0 \(None\) is not callable"),
    "or_list": (lambda: or_masks([causal]), TypeError, "or_masks: argument 0 .* is not callable"),
}


@pytest.mark.parametrize("name", sorted(COMBINATORS))
def test_mask_combinators(name):
    check(*COMBINATORS[name])


def test_mask_combinators_of_zero_masks_keep_all_and_none():
    assert create_mask(and_masks(), 1, 1, 4, 5, DEVICE).all()
    assert not create_mask(or_masks(), 1, 1, 4, 5, DEVICE).any()
    assert create_mask(and_masks(), 1, 1, 4, 5, DEVICE).equal(create_mask(noop_mask, 1, 1, 4, 5, DEVICE))


def test_create_mask_of_a_score_mod():
    def alibi_cut(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx >= kv_idx, score - (q_idx - kv_idx), float("-inf"))
    assert create_mask(alibi_cut, None, None, 6, 6, DEVICE).equal(create_mask(causal, None, None, 6, 6, DEVICE))


# ----------------------------------------------------------------------------------------------
# BlockMask: printing, indexing, moving, from_kv_blocks

def kv(num, idx):
    return torch.tensor(num, dtype=torch.int32), torch.tensor(idx, dtype=torch.int32)


BLOCK_MASK = {
    "to_string_grid_str": (lambda: small_mask().to_string(grid_size="4"), TypeError,
                           r"to_string: grid_size must be an int or a \(rows, cols\)"),
    "to_string_grid_float": (lambda: small_mask().to_string(grid_size=2.5), TypeError, "grid_size"),
    "to_string_grid_triple": (lambda: small_mask().to_string(grid_size=(1, 2, 3)), TypeError, "grid_size"),
    "to_string_limit_str": (lambda: small_mask().to_string(limit="2"), TypeError, "to_string: limit must be an int"),
    "index_none": (lambda: small_mask()[None], TypeError, "BlockMask index: entries must be ints, slices"),
    "index_bool": (lambda: small_mask()[True], TypeError, "got bool True"),
    "index_str": (lambda: small_mask()["0"], TypeError, "got str '0'"),
    "index_float": (lambda: small_mask()[0.0], TypeError, "got float 0.0"),
    "index_too_many": (lambda: small_mask()[0, 0, 0, 0], IndexError,
                       r"too many indices \(4\); a BlockMask is indexed over \(batch, head, q block\)"),
    "index_two_ellipses": (lambda: small_mask()[..., 0, ...], IndexError, "single ellipsis"),
    "index_two_tensors": (lambda: small_mask()[[0, 1], [0, 1]], IndexError, "at most one tensor / list index"),
    "index_2d_tensor": (lambda: small_mask()[torch.zeros(1, 1, dtype=torch.long)], TypeError,
                        "must be 1-D integers or bools"),
    "index_float_tensor": (lambda: small_mask()[torch.tensor([0.0])], TypeError, "must be 1-D integers or bools"),
    "index_out_of_range": (lambda: small_mask()[:, 2], IndexError, "index 2 is out of range for a dimension of size 2"),
    "index_negative_step": (lambda: small_mask()[::-1], ValueError,
                            "BlockMask index: a slice's step must be a positive"),
    "constructor_lengths_int": (lambda: BlockMask(64, *kv([[[1]]], [[[[0]]]]), None, None, None, None, None, None,
                                                  BLOCK_SIZE=16), TypeError,
                                r"BlockMask: seq_lengths must be a \(Q_LEN, KV_LEN\) pair; got 64"),
    "constructor_block_size_str": (lambda: BlockMask((16, 16), *kv([[[1]]], [[[[0]]]]), None, None, None, None, None,
                                                     None, BLOCK_SIZE="16"), TypeError,
                                   "BlockMask: BLOCK_SIZE must be an int or a"),
    # a BLOCK_SIZE no kernel takes (before: kernel_options['BLOCK_N']=8 refused at launch, an option nobody passed) and
    # block lists that are no tensors (before: AttributeError from flex_attention)
    "constructor_block_size_24": (lambda: BlockMask((32, 32), *kv([[[1, 2]]], [[[[0, 1], [0, 1]]]]), None, None, None,
                                                    None, None, None, BLOCK_SIZE=(16, 24)), ValueError,
                                  r"BlockMask: BLOCK_SIZE must be positive multiples of 16; got \(16, 24\)"),
    "constructor_lists": (lambda: BlockMask((32, 32), [[[1, 2]]], [[[[0, 1], [0, 1]]]], None, None, None, None, None,
                                            None, BLOCK_SIZE=16), TypeError,
                          r"BlockMask: kv_num_blocks must be an int32 Tensor; got list"),
    "constructor_q_side_list": (lambda: BlockMask((32, 32), *kv([[[1, 2]]], [[[[0, 1], [0, 1]]]]), None, None,
                                                  [[[2, 1]]], [[[[0, 1], [1, 0]]]], None, None, BLOCK_SIZE=16), TypeError,
                                r"BlockMask: q_num_blocks must be an int32 Tensor or None; got list"),
    "to_unknown_device": (lambda: small_mask().to("gpu"), ValueError, r"BlockMask\.to: device='gpu' is not a device"),
    "to_negative_int": (lambda: small_mask().to(-2), ValueError, r"BlockMask\.to: device=-2 is no GPU index"),
    "to_list": (lambda: small_mask().to(["cpu"]), TypeError, r"BlockMask\.to: device must be a str, torch\.device"),
    "to_missing_gpu": (lambda: small_mask().to(NO_CUDA_DEVICE), ValueError, "cuda:99"),
    "num_blocks_above_columns": (lambda: BlockMask.from_kv_blocks(*kv([[[3, 1]]], [[[[0, 1], [1, 0]]]]),
                                                                  BLOCK_SIZE=16),
                                 ValueError, r"kv_num_blocks must be in \[0, 2\] .*got values in \[1, 3\]"),
    "num_blocks_negative": (lambda: BlockMask.from_kv_blocks(*kv([[[-1, 1]]], [[[[0, 1], [1, 0]]]]), BLOCK_SIZE=16),
                            ValueError, r"kv_num_blocks must be in \[0, 2\]"),
    "index_past_columns": (lambda: BlockMask.from_kv_blocks(*kv([[[2, 1]]], [[[[0, 5], [1, 0]]]]), BLOCK_SIZE=16),
                           ValueError, r"kv_indices\[0, 0, 0, 1\] = 5 is not a kv block index in \[0, 2\)"),
    "index_negative": (lambda: BlockMask.from_kv_blocks(*kv([[[1, 1]]], [[[[-1, 0], [1, 0]]]]), BLOCK_SIZE=16),
                       ValueError, r"kv_indices\[0, 0, 0, 0\] = -1"),
    "full_index_past_columns": (lambda: BlockMask.from_kv_blocks(*kv([[[0, 0]]], [[[[0, 1], [0, 1]]]]),
                                                                 *kv([[[1, 0]]], [[[[2, 0], [0, 1]]]]), BLOCK_SIZE=16),
                                ValueError, r"full_kv_indices\[0, 0, 0, 0\] = 2"),
    # a block listed twice, or both partial and full, is computed twice by the kernels (before: accepted, the row's
    # LSE off by log 2, its output skewed, and the q side, made from the blocks once each, disagreeing with it)
    "index_repeated_in_a_row": (lambda: BlockMask.from_kv_blocks(*kv([[[2, 1]]], [[[[1, 1], [1, 0]]]]), BLOCK_SIZE=16),
                                ValueError, r"kv_indices\[0, 0, 0\] names a kv block more than once among the row's "
                                            r"first kv_num_blocks\[0, 0, 0\] = 2 entries \[1, 1\]"),
    "full_index_repeated_in_a_row": (lambda: BlockMask.from_kv_blocks(*kv([[[0, 0]]], [[[[0, 1], [0, 1]]]]),
                                                                      *kv([[[0, 2]]], [[[[0, 1], [0, 0]]]]),
                                                                      BLOCK_SIZE=16),
                                     ValueError, r"full_kv_indices\[0, 0, 1\] names a kv block more than once"),
    "block_partial_and_full": (lambda: BlockMask.from_kv_blocks(*kv([[[1, 1]]], [[[[0, 1], [1, 0]]]]),
                                                                *kv([[[0, 1]]], [[[[0, 1], [1, 0]]]]), BLOCK_SIZE=16),
                               ValueError, r"kv block 1 of row \[0, 0, 1\] is listed both in kv_indices \(partial\) "
                                           r"and in full_kv_indices \(full\)"),
}


@pytest.mark.parametrize("name", sorted(BLOCK_MASK))
def test_block_mask_methods(name):
    check(*BLOCK_MASK[name])


def test_block_mask_index_forms_that_work():
    bm = small_mask()
    assert bm[..., 1:].to_dense().equal(bm[:, :, 1:].to_dense())
    assert bm[0, ...].to_dense().equal(bm[0:1].to_dense())
    assert bm[torch.tensor([1])].to_dense().equal(bm[1:2].to_dense())
    assert bm[[1, 0]].to_dense().equal(bm.to_dense().flip(0))
    # as torch's BlockMask takes them: a bool mask, a numpy index array (refused before); a mask that differs by
    # batch and head
    bh = create_block_mask(lambda b, h, q, kv: (q - kv).abs() <= 16 * b + 32 * h, 2, 2, 64, 64, device=DEVICE,
                           BLOCK_SIZE=16)
    assert bh[torch.tensor([False, True])].to_dense().equal(bh.to_dense()[1:])
    assert bh[:, np.array([1, 0])].to_dense().equal(bh.to_dense().flip(1))
    assert not bh.to_dense()[0].equal(bh.to_dense()[1]) and not bh.to_dense()[:, 0].equal(bh.to_dense()[:, 1])
    assert bm[2:].shape == (0, 2, 64, 64)
    assert bm.to_string(grid_size=-1, limit=-1).count("(") == 4  # no limits: every (b, h) grid


def test_from_kv_blocks_reads_only_the_counted_prefix():
    # entries past kv_num_blocks are never read, so they may hold anything (torch's format)
    bm = BlockMask.from_kv_blocks(*kv([[[1, 2]]], [[[[1, 99], [0, 1]]]]), BLOCK_SIZE=16)
    assert bm.to_dense().tolist() == [[[[0, 1], [1, 1]]]]


# ----------------------------------------------------------------------------------------------
# flex_attention: kinds test_errors.py does not cover (no launch)

def qkv(B=1, H=2, Lq=32, Lkv=32, D=16):
    return rand_qkv(B, H, H, Lq, Lkv, D)


def on(device, tensors):
    return [t.to(device) for t in tensors]


def other_device_mask():
    """The causal BlockMask of qkv() with every tensor on 'meta' (a device the inputs are not on)."""
    bm = create_block_mask(causal, None, None, 32, 32, device=DEVICE, BLOCK_SIZE=16)
    tensors = {a: getattr(bm, a).to("meta") for a in BlockMask._TENSOR_ATTRS}
    return BlockMask(bm.seq_lengths, **tensors, BLOCK_SIZE=bm.BLOCK_SIZE, mask_mod=causal)


def q_sliced_mask():
    bm = create_block_mask(causal, None, None, 32, 32, device=DEVICE, BLOCK_SIZE=16)[:, :, 1:]
    bm.mask_mod = causal  # torch's recipe; seq_lengths still say 32 rows but only one q block is left
    return bm


def float_mask_block_mask():
    return BlockMask.from_kv_blocks(*on(DEVICE, kv([[[1, 1]]], [[[[0, 1], [1, 0]]]])), BLOCK_SIZE=16,
                                    mask_mod=float_mask)


TABLE = torch.zeros(32, 3)  # a row per query: a mod reading it with one index makes a vector per score


def vector_mask(b, h, q_idx, kv_idx):
    return TABLE[q_idx] >= 0


def vector_mask_block_mask():
    bm = create_block_mask(causal, None, None, 32, 32, device=DEVICE, BLOCK_SIZE=16)
    bm.mask_mod = vector_mask
    return bm


def fa(*tensors, **kw):
    return lambda: flex_attention(*(tensors or qkv()), **kw)


def torch_mask(**replaced):
    """torch's BlockMask of qkv()'s causal mask, with attributes ``replaced`` (its constructor stores them as given)."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask
    bm = torch_create_block_mask(causal, None, None, 32, 32, device=DEVICE, BLOCK_SIZE=16)
    for name, value in replaced.items():
        setattr(bm, name, value)
    return bm


def tampered_mask(name: str, value) -> Callable:
    """The causal BlockMask of qkv() with one of its block-list tensors replaced (``value(tensor)``), or changed in
    place (``value`` a (where, number) pair): its tensors are public, and torch's masks are taken as they are. On
    CPU, where the values are checked (on CUDA only dtypes and shapes: a host read there would sync)."""
    def call():
        bm = create_block_mask(causal, None, None, 32, 32, device="cpu", BLOCK_SIZE=16)
        q, k, v = on("cpu", qkv())
        api._validate_block_mask(bm, q, k)  # (its checks kept on the mask: a change must be seen all the same)
        if callable(value):
            setattr(bm, name, value(getattr(bm, name)))
        else:
            getattr(bm, name)[value[0]] = value[1]
        flex_attention(q, k, v, block_mask=bm)
    return call


FLEX_ATTENTION = {
    "key_5d": (lambda: flex_attention(qkv()[0], qkv()[1][None], qkv()[2]), ValueError, "key must be 4-D"),
    "value_3d": (lambda: flex_attention(*qkv()[:2], qkv()[2][0]), ValueError, "value must be 4-D"),
    "query_nested": (lambda: flex_attention(*(torch.nested.nested_tensor([t[0], t[0, :, :20]], layout=torch.jagged)
                                              for t in qkv())), NotImplementedError,
                     r"query is a nested \(jagged\) tensor, which .* do not run: pad it .*varlen\.pack"),
    "key_sparse": (lambda: flex_attention(qkv()[0], qkv()[1].to_sparse(), qkv()[2]), NotImplementedError,
                   r"key is a sparse_coo tensor, which flex_attention's kernels do not read; .*key\.to_dense\(\)"),
    "query_sparse_csr": (lambda: flex_attention(qkv()[0].to_sparse_csr(), *qkv()[1:]),
                         NotImplementedError, r"query is a sparse_csr tensor"),
    "value_not_tensor": (lambda: flex_attention(*qkv()[:2], np.zeros((1, 2, 32, 16))), TypeError,
                         "value must be a torch.Tensor, got ndarray"),
    "value_on_other_device": (lambda: flex_attention(*qkv()[:2], qkv()[2].to("meta")), ValueError,
                              "value is on meta but query is on"),
    "all_on_meta": (lambda: flex_attention(*on("meta", qkv())), NotImplementedError,
                    r"inputs are on meta; flexlite runs CUDA tensors .* and CPU tensors"),
    "return_lse_str": (fa(return_lse="yes"), TypeError, "return_lse must be a bool"),
    "return_lse_none": (fa(return_lse=None), TypeError, "return_lse must be a bool"),
    "enable_gqa_int": (fa(enable_gqa=1), TypeError, "enable_gqa must be a bool"),
    "enable_gqa_str_with_gqa": (lambda: flex_attention(*rand_qkv(1, 4, 2, 8, 8, 16), enable_gqa="True"), TypeError,
                                "enable_gqa must be a bool"),
    "block_mask_other_device": (fa(block_mask=other_device_mask()), ValueError,
                                r"block_mask is on meta but query is on .*block_mask\.to\(query\.device\)"),
    "block_mask_sliced_q_blocks": (fa(block_mask=q_sliced_mask()), ValueError,
                                   r"block_mask has 1 x 2 blocks of 16 x 16 .* need 2 x 2.*seq_lengths"),
    "block_mask_float_mask_mod": (fa(block_mask=float_mask_block_mask()), TypeError,
                                  "flex_attention: mask_mod 'float_mask' must return a bool tensor"),
    "block_mask_for_other_heads": (fa(block_mask=create_block_mask(causal, 1, 3, 32, 32, DEVICE)), ValueError,
                                   "block_mask has 3 heads but query has 2"),
    "block_mask_for_other_kv_len": (fa(block_mask=create_block_mask(causal, 1, 2, 32, 48, DEVICE)), ValueError,
                                    r"built for Q_LEN=32, KV_LEN=48"),
    "block_mask_with_empty_query": (lambda: flex_attention(*qkv(Lq=0), block_mask=small_mask(1, 2, 32)), ValueError,
                                    "query has length 0 .* pass block_mask=None for empty sequences"),
    "score_mod_returns_none": (fa(score_mod=none_score), TypeError,
                               "score_mod 'none_score' must return the new score, a tensor or a number; got NoneType"),
    "score_mod_item": (fa(score_mod=item_score), UntraceableModError, r"'item_score' calls Tensor\.item\(\)"),
    "score_mod_untraceable": (fa(score_mod=lambda s, b, h, q, kv: s if q > kv else -s), UntraceableModError,
                              r"torch\.where"),
    "score_mod_wrong_arity": (fa(score_mod=lambda s, b: s), TypeError, "got a function of 2 arguments"),
    "scale_str": (fa(scale="0.1"), TypeError, "scale must be a Python float"),
    # float64 runs the mods vmapped in torch ops (no lowering to name it): was torch's broadcast RuntimeError
    "score_mod_vector_valued_float64": (
        lambda: flex_attention(*(t.double() for t in qkv()),
                               score_mod=lambda s, b, h, q_idx, kv_idx: s + TABLE[q_idx]), ValueError,
        r"score_mod '<lambda>' must return one value per \(b, h, q_idx, kv_idx\), a 0-d tensor; .* shape \(3,\)"),
    "mask_mod_vector_valued_float64": (
        lambda: flex_attention(*(t.double() for t in qkv()), block_mask=vector_mask_block_mask()),
        ValueError, r"mask_mod 'vector_mask' must return one value per .* shape \(3,\)"),
    "score_mod_numpy_array": (fa(score_mod=lambda s, b, h, q_idx, kv_idx: s * np.ones(3, np.float32)),
                              UntraceableModError, r"uses a numpy array \(<class 'numpy.ndarray'>\).*torch.as_tensor"),
    "scale_1d_tensor": (fa(scale=torch.ones(1)), TypeError, r"scale must be .* got a tensor of shape \(1,\)"),
    "scale_tensor_requiring_grad": (fa(scale=torch.tensor(0.5, requires_grad=True)), TypeError,
                                    "no gradient flows to it.* requiring grad"),
    "scale_complex": (fa(scale=1j), TypeError, "scale must be a Python float .* got complex"),
    "scale_past_float": (fa(scale=10 ** 400), ValueError, r"scale=1000000.*\.\.\. \(401 digits\) does not fit a float"),
    "scale_meta_tensor": (fa(scale=torch.tensor(0.5, device="meta")), ValueError,
                          "scale is a tensor on the meta device, which holds no value"),
    # a block mask's tensors changed after it was built (before: a segfault in the interpreter, memory past the
    # lists or past the sequence read, a raw interpreter error)
    "kv_num_blocks_past_the_blocks": (tampered_mask("kv_num_blocks", lambda t: torch.full_like(t, 50)), ValueError,
                                      r"block_mask: kv_num_blocks must be in \[0, 2\] .* got values in \[50, 50\]"),
    "kv_indices_past_the_blocks_in_place": (tampered_mask("kv_indices", (..., 99)), ValueError,
                                            r"block_mask: kv_indices\[0, 0, 0, 0\] = 99 is not a kv block index"),
    "full_kv_indices_negative": (tampered_mask("full_kv_indices", (..., -5)), ValueError,
                                 r"full_kv_indices\[0, 0, 1, 0\] = -5 is not a kv block index in \[0, 2\)"),
    "q_num_blocks_negative": (tampered_mask("q_num_blocks", lambda t: t - 3), ValueError,
                              r"block_mask: q_num_blocks must be in \[0, 2\]"),
    "kv_block_made_partial_and_full_in_place": (tampered_mask("kv_indices", ((0, 0, 1, 0), 0)), ValueError,
                                                r"block_mask: kv block 0 of row \[0, 0, 1\] is listed both"),
    "kv_indices_float": (tampered_mask("kv_indices", lambda t: t.float()), TypeError,
                         "block_mask: kv_indices must be int32; got torch.float32"),
    "kv_indices_3d": (tampered_mask("kv_indices", lambda t: t[0]), ValueError,
                      "block_mask: kv_indices must have 4 dimensions"),
    # torch's BlockMask stores what it is given: a list for a q-side tensor, an int for seq_lengths (before:
    # AttributeError "'list' object has no attribute 'is_inference'", TypeError "'int' object is not iterable")
    "torch_mask_q_side_list": (lambda: flex_attention(*qkv(), block_mask=torch_mask(q_num_blocks=[[[1, 2]]])),
                               TypeError, r"flex_attention: block_mask \(torch's BlockMask\): q_num_blocks must be an "
                                          r"int32 Tensor or None; got list"),
    "torch_mask_seq_lengths_int": (lambda: flex_attention(*qkv(), block_mask=torch_mask(seq_lengths=32)), TypeError,
                                   r"flex_attention: block_mask \(torch's BlockMask\): seq_lengths must be a "
                                   r"\(Q_LEN, KV_LEN\) tuple; got 32"),
}


@pytest.mark.parametrize("name", sorted(FLEX_ATTENTION))
def test_flex_attention(name):
    check(*FLEX_ATTENTION[name])


# ----------------------------------------------------------------------------------------------
# flex_attention: the right result for odd but valid inputs (tiny launches)

def assert_matches_reference(out, q, k, v, **kw):
    ref, _ = attention_reference(q, k, v, **kw)
    assert_close(out, ref, *TOLERANCES[q.dtype])


@pytest.mark.parametrize("flag", [np.True_, np.False_], ids=["np.True_", "np.False_"])
def test_right_result_numpy_bools_are_bools(flag):
    """A numpy bool (np.True_, what numpy comparisons and configs read through numpy give) is taken wherever a flag
    is, as the Python bool; numpy's other scalars are refused as Python's are."""
    q, k, v = rand_qkv(1, 2, 1, 32, 32, 16, dtype=torch.float32)
    want = bool(flag)
    got = flex_attention(q, k, v, enable_gqa=np.True_, return_lse=flag, kernel_options={"USE_TMA": np.False_})
    ref = flex_attention(q, k, v, enable_gqa=True, return_lse=want, kernel_options={"USE_TMA": False})
    assert isinstance(got, tuple) == want
    for a, b in zip(got if want else (got,), ref if want else (ref,)):
        assert torch.equal(a, b)
    assert torch.equal(flash_attention(q, q, q, causal=flag), flash_attention(q, q, q, causal=want))
    out, aux = flex_attention(q, k, v, enable_gqa=True, return_aux=AuxRequest(lse=flag))
    assert torch.equal(out, ref[0] if want else ref) and (aux.lse is None) == (not want)
    assert generate_tanh_softcap(30.0, approx=flag).__name__ == generate_tanh_softcap(30.0, approx=want).__name__
    made = create_block_mask(causal, 1, None, 64, 64, device=DEVICE, BLOCK_SIZE=16, separate_full_blocks=flag)
    plain = create_block_mask(causal, 1, None, 64, 64, device=DEVICE, BLOCK_SIZE=16, separate_full_blocks=want)
    assert (made.full_kv_num_blocks is None) == (plain.full_kv_num_blocks is None) == (not want)
    again = BlockMask.from_kv_blocks(plain.kv_num_blocks, plain.kv_indices, plain.full_kv_num_blocks,
                                     plain.full_kv_indices, BLOCK_SIZE=16, compute_q_blocks=flag)
    assert (again.q_num_blocks is None) == (not want)
    from flexlite.masks import generate_global_sliding_window, generate_sliding_window
    assert generate_sliding_window(4, causal=flag).__name__ == generate_sliding_window(4, causal=want).__name__
    assert (generate_global_sliding_window(4, 2, causal=flag).__name__ ==
            generate_global_sliding_window(4, 2, causal=want).__name__)
    a = A.to(DEVICE)  # (on a GPU its compiled kernel: the interpreter there runs under the machine's numpy)
    assert torch.equal(triton_matmul(a, a, use_autotune=np.False_), triton_matmul(a, a, use_autotune=False))
    with pytest.raises(TypeError, match=r"return_lse must be a bool \(True or False\); got int64"):
        flex_attention(q, k, v, enable_gqa=True, return_lse=np.int64(1))


@pytest.mark.parametrize("scale", [np.float32(0.3), np.float64(0.3), torch.tensor(0.3), torch.tensor(0.3).double(),
                                   3], ids=["numpy-float32", "numpy-float64", "0-d-tensor", "0-d-double", "int"])
def test_right_result_scale_as_a_number_or_a_0d_tensor(scale):
    # as torch's flex_attention takes them
    q, k, v = qkv(Lq=20, Lkv=24)
    assert_matches_reference(flex_attention(q, k, v, scale=scale), q, k, v, scale=float(scale))


def test_right_result_stride_zero_inputs():
    # k / v broadcast over heads (GQA written with expand) and v constant along the sequence
    q, k, v = rand_qkv(1, 3, 1, 24, 40, 16)
    k3, v3 = k.expand(1, 3, 40, 16), v[:, :, :1].expand(1, 3, 40, 16)
    assert k3.stride()[1] == 0 and v3.stride()[2] == 0
    assert_matches_reference(flex_attention(q, k3, v3), q, k3, v3)


def test_right_result_transposed_half_precision():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 24, 2, 16, generator=g).to(DEVICE, torch.float16).transpose(1, 2) for _ in range(3))
    assert_matches_reference(flex_attention(q, k, v, block_mask=create_block_mask(causal, None, None, 24, 24, DEVICE)),
                             q, k, v, block_mask=create_block_mask(causal, None, None, 24, 24, DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["kernel", "torch-ops"])
def test_right_result_mods_returning_a_python_constant(dtype):
    # the kernels take a mod returning a number (check_mod_output allows it); float64's torch ops and the reference
    # vmap the mods, and vmap took only tensors: "must only return Tensors, got type <class 'int'>"
    q, k, v = (t.to(dtype).requires_grad_(True) for t in qkv(Lq=20, Lkv=24))
    bm = BlockMask.from_kv_blocks(*on(DEVICE, kv([[[1, 1]]], [[[[1, 0], [0, 1]]]])), BLOCK_SIZE=16,
                                  mask_mod=lambda b, h, q_idx, kv_idx: True, seq_lengths=(20, 24))
    for score_mod in (lambda s, b, h, q_idx, kv_idx: 3, lambda s, b, h, q_idx, kv_idx: 0.1):
        out, lse = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, return_lse=True)
        ref, ref_lse = attention_reference(q, k, v, score_mod=score_mod, block_mask=bm)
        assert_close(out, ref, *TOLERANCES[torch.float32])
        assert_close(lse, ref_lse, *TOLERANCES[torch.float32], name="lse")
        for g, w in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(ref.sum(), (q, k, v), materialize_grads=True)):
            assert_close(g, w, *TOLERANCES[torch.float32], name="grad")


def test_right_result_zero_length_and_zero_batch():
    q, k, v = qkv(Lkv=0)
    q.requires_grad_(True)
    out, lse = flex_attention(q, k, v, return_lse=True)
    ref, ref_lse = attention_reference(q.detach(), k, v)  # softmax over no keys: 0, and LSE -inf (as torch)
    assert out.shape == (1, 2, 32, 16) and out.equal(ref.float()) and torch.isneginf(lse).all()
    assert torch.isneginf(ref_lse).all()
    out.sum().backward()
    assert q.grad.equal(torch.zeros_like(q))
    for shape in ((0, 2, 8, 16), (1, 0, 8, 16), (1, 2, 0, 16)):
        t = torch.randn(shape, device=DEVICE)
        out, lse = flex_attention(t, t, t, return_lse=True)
        assert out.shape == shape and lse.shape == shape[:3]
    # with a score_mod the reference has no scores to run it on either (torch.vmap took no empty dimension there)
    halved = lambda s, b, h, q_idx, kv_idx: s * 0.5  # noqa: E731
    out, lse = flex_attention(q, k, v, score_mod=halved, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, score_mod=halved)
    assert out.equal(ref.float()) and torch.isneginf(lse).all() and torch.isneginf(ref_lse).all()


def _with(t, index, value):
    t = t.clone()
    t[index] = value
    return t


NAN, INF = float("nan"), float("inf")
NON_FINITE = {  # (q, k, v) -> (q, k, v) and flex_attention keyword arguments
    "nan_in_key": (lambda q, k, v: (q, _with(k, (0, 1, 7, 2), NAN), v), {}),
    "nan_in_value": (lambda q, k, v: (q, k, _with(v, (0, 0, 9, 0), NAN)), {}),
    "plus_inf_in_key": (lambda q, k, v: (q, _with(k, (0, 0, 4, 0), INF), v), {}),
    "minus_inf_in_key": (lambda q, k, v: (q, _with(k, (0, 1, 30, 3), -INF), v), {}),
    "inf_in_value": (lambda q, k, v: (q, k, _with(v, (0, 1, 2, 5), INF)), {}),
    "nan_scale": (lambda q, k, v: (q, k, v), {"scale": NAN}),
    "score_mod_makes_nan_and_inf": (lambda q, k, v: (q, k, v), {"score_mod": lambda s, b, h, qi, ki: torch.where(
        (ki == 3) & (qi >= 20), NAN, torch.where((ki == 5) & (qi < 8), INF, s))}),
}


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy, on the NaNs we feed
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["kernel", "torch-ops"])
@pytest.mark.parametrize("name", sorted(NON_FINITE))
def test_right_result_non_finite_inputs(name, dtype):
    make, kw = NON_FINITE[name]
    q, k, v = (t.to(dtype) for t in make(*qkv()))
    out, aux = flex_attention(q, k, v, return_aux=AuxRequest(lse=True, max_scores=True), **kw)
    ref, ref_lse, ref_max = attention_reference(q, k, v, return_max=True, **kw)
    # the LSE NaN where out is; max_scores the reference's in the rows without a NaN score (README: in those with
    # one, NaN or the largest of the others)
    assert torch.equal(aux.lse.isnan(), ref_lse.isnan())
    rows = ~ref_lse.isnan()
    assert_close(aux.max_scores[rows], ref_max[rows].to(aux.max_scores.dtype), *TOLERANCES[torch.float32])
    assert out.isnan().any() or out.isinf().any()
    assert torch.equal(out.isnan(), ref.isnan()), f"NaN at {out.isnan().sum()} positions, reference {ref.isnan().sum()}"
    assert not ref.isnan().all() or name == "nan_scale"  # the finite part is checked too
    finite = ~ref.isnan()
    assert_close(out[finite], ref[finite], *TOLERANCES[torch.float32])


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("name", sorted(NON_FINITE))
def test_reference_propagates_non_finite_values_like_sdpa(name):
    """The reference the kernels are held to is torch's semantics: same NaN / inf as SDPA (math, fp64).
    (A +inf score made the reference subtract 0 instead of +inf and return inf where torch gives NaN.)"""
    make, kw = NON_FINITE[name]
    q, k, v = (t.double() for t in make(*qkv()))
    ref, _ = attention_reference(q, k, v, **kw)
    if "score_mod" in kw:
        scores = q @ k.transpose(-1, -2) / math.sqrt(16)
        idx = torch.arange(32, device=q.device)
        qi, ki = idx[:, None], idx[None, :]
        mask = torch.where((ki == 3) & (qi >= 20), NAN, torch.where((ki == 5) & (qi < 8), INF, 0.0))
        expected = torch.softmax(torch.where(torch.isfinite(mask), scores, mask), dim=-1) @ v
    else:
        expected = F.scaled_dot_product_attention(q, k, v, scale=kw.get("scale"))
    assert torch.equal(ref.isnan(), expected.isnan())
    finite = ~expected.isnan()
    assert_close(ref[finite], expected[finite], 1e-12, 1e-12)


# ----------------------------------------------------------------------------------------------
# attention_reference, kernel_source

REFERENCE_AND_SOURCE = {
    "reference_3d": (lambda: attention_reference(*(t[0] for t in qkv())), ValueError,
                     r"attention_reference: query must be 4-D"),
    "reference_shapes": (lambda: attention_reference(qkv()[0], qkv(Lkv=8)[1], qkv()[2]), ValueError,
                         "attention_reference: shapes do not fit"),
    "reference_not_tensor": (lambda: attention_reference([0.0], *qkv()[1:]), TypeError, "query must be a torch.Tensor"),
    "reference_gqa_indivisible": (lambda: attention_reference(*rand_qkv(1, 3, 2, 4, 4, 16), enable_gqa=True),
                                  ValueError, r"query heads \(3\) must be a multiple"),
    "source_block_mask_str": (lambda: kernel_source(block_mask="causal"), TypeError,
                              "kernel_source: block_mask must be a BlockMask"),
    "source_device_unknown": (lambda: kernel_source(device="gpu"), ValueError, "kernel_source: device='gpu'"),
    "source_device_negative_int": (lambda: kernel_source(device=-1), ValueError, "kernel_source: device=-1 is no GPU"),
    "source_mask_mod_as_score_mod": (lambda: kernel_source(causal), TypeError,
                                     "kernel_source: score_mod 'causal' .* looks like a mask_mod"),
    "source_score_mod_returns_none": (lambda: kernel_source(none_score), TypeError,
                                      "kernel_source: score_mod 'none_score' must return the new score"),
    "source_kind": (lambda: kernel_source(kernel="bwd"), ValueError, "kernel must be one of"),
}


@pytest.mark.parametrize("name", sorted(REFERENCE_AND_SOURCE))
def test_reference_and_kernel_source(name):
    check(*REFERENCE_AND_SOURCE[name])


def test_kernel_source_for_cuda_needs_no_gpu():
    assert "def flex_fwd_kernel(" in kernel_source(device="cuda")
    ws = kernel_source(device="cuda", kernel="forward_ws")  # the Gluon forward flex_attention runs on Hopper
    assert "def flex_fwd_ws_kernel(" in ws and "gl.warp_specialize" in ws
    ws = kernel_source(device="cuda", kernel="backward_ws")  # the Gluon dK / dV kernel
    assert "def flex_bwd_ws_dkdv_kernel(" in ws and "gl.warp_specialize" in ws
    for kind in ("forward_ws", "backward_ws"):
        with pytest.raises(ValueError, match=f"kernel='{kind}'.* CUDA variant only.*pass device='cuda'"):
            kernel_source(device="cpu", kernel=kind)


# ----------------------------------------------------------------------------------------------
# flexlite.varlen

PADDED = torch.zeros(2, 1, 8, 4)
PACKED = torch.zeros(1, 1, 8, 4)
CU = torch.tensor([0, 3, 8], dtype=torch.int32)

VARLEN = {
    "pack_negative_length": (lambda: pack(PADDED, [-1, 3]), ValueError, r"pack: lengths must be 2 ints in \[0, 8\]"),
    "pack_no_lengths": (lambda: pack(PADDED, []), ValueError, "pack: lengths must be 2 ints"),
    "pack_float_lengths": (lambda: pack(PADDED, [1.0, 3.0]), TypeError, "pack: lengths must be ints; got 1.0"),
    "pack_float_tensor": (lambda: pack(PADDED, torch.tensor([1.0, 3.0])), TypeError,
                          "lengths must be an integer tensor or a sequence of ints; got a torch.float32"),
    "pack_2d_tensor": (lambda: pack(PADDED, torch.tensor([[1, 3]])), ValueError, "lengths must be 1-D"),
    "pack_none": (lambda: pack(PADDED, None), TypeError, "lengths must be a sequence of ints or an integer tensor"),
    "pack_int": (lambda: pack(PADDED, 3), TypeError, "got int"),
    "unpack_not_from_zero": (lambda: unpack(PACKED, torch.tensor([1, 3, 8]), 8), ValueError,
                             r"unpack: cu_seqlens must rise from 0.*got \[1, 3, 8\]"),
    "unpack_decreasing": (lambda: unpack(PACKED, torch.tensor([0, 5, 3, 8]), 8), ValueError, "never decrease"),
    "unpack_total_mismatch": (lambda: unpack(PACKED, torch.tensor([0, 3, 7]), 8), ValueError,
                              "rise from 0 to the packed length 8; got"),
    "unpack_float": (lambda: unpack(PACKED, torch.tensor([0.0, 3.0, 8.0]), 8), TypeError,
                     r"cu_seqlens must be an integer \(int32\) tensor; got torch\.float32"),
    "unpack_empty": (lambda: unpack(PACKED, torch.tensor([], dtype=torch.int32), 8), ValueError,
                     r"cu_seqlens must be 1-D with batch \+ 1 entries"),
    "unpack_2d": (lambda: unpack(PACKED, CU[None], 8), ValueError, r"got shape \(1, 3\)"),
    "unpack_str": (lambda: unpack(PACKED, "0,3,8", 8), TypeError, "cu_seqlens must be an int32 tensor"),
    "unpack_max_len_float": (lambda: unpack(PACKED, CU, 5.0), TypeError, "unpack: max_len must be an int"),
    "unpack_max_len_negative": (lambda: unpack(PACKED, CU, -1), ValueError, "max_len must be >= 0"),
    "unpack_max_len_short": (lambda: unpack(PACKED, CU, 4), ValueError, r"longer than max_len=4 \(the longest has 5"),
    "block_mask_not_from_zero": (lambda: varlen_block_mask(torch.tensor([1, 3, 8])), ValueError,
                                 "varlen_block_mask: cu_seqlens must rise from 0"),
    "block_mask_decreasing": (lambda: varlen_block_mask(torch.tensor([0, 5, 3, 8])), ValueError, "never decrease"),
    "block_mask_float": (lambda: varlen_block_mask(torch.tensor([0.0, 8.0])), TypeError,
                         "varlen_block_mask: cu_seqlens must be an integer"),
    "block_mask_no_tokens": (lambda: varlen_block_mask(torch.tensor([0, 0])), ValueError,
                             r"has no tokens \(total length 0\)"),
    "block_mask_causal_str": (lambda: varlen_block_mask(CU, causal="no"), TypeError, "causal must be a bool"),
    "block_mask_bad_block_size": (lambda: varlen_block_mask(CU, BLOCK_SIZE=8), ValueError, "BLOCK_SIZE"),
}


@pytest.mark.parametrize("name", sorted(VARLEN))
def test_varlen(name):
    check(*VARLEN[name])


def test_varlen_edge_inputs_that_work():
    x = torch.randn(2, 1, 8, 4)
    packed, cu = pack(x, np.array([3, 5]))  # numpy ints are ints
    assert cu.tolist() == [0, 3, 8] and packed.shape == (1, 1, 8, 4)
    assert unpack(packed, [0, 3, 8], 5)[1, :, :5].equal(x[1, :, :5])  # a list of offsets is fine
    packed, cu = pack(x, [0, 0])  # every sample empty
    assert packed.shape == (1, 1, 0, 4) and unpack(packed, cu, 0).shape == (2, 1, 0, 4)
    packed, cu = pack(x[:0], [])  # no samples at all
    assert packed.shape == (1, 1, 0, 4) and cu.tolist() == [0] and unpack(packed, cu, 3).shape == (0, 1, 3, 4)
    assert varlen_block_mask([0, 3, 8], BLOCK_SIZE=16).to_dense().equal(varlen_block_mask(CU, BLOCK_SIZE=16).to_dense())


def test_varlen_takes_numpy_offsets_and_bools():
    x = torch.randn(2, 1, 8, 4)
    packed, cu = pack(x, [3, 5])
    assert unpack(packed, np.array([0, 3, 8]), 5).equal(unpack(packed, cu, 5))  # as pack takes numpy lengths
    for causal_ in (True, False):
        made = varlen_block_mask(np.array([0, 3, 8], dtype=np.int64), causal=np.bool_(causal_), BLOCK_SIZE=16)
        assert made.to_dense().equal(varlen_block_mask(CU, causal=causal_, BLOCK_SIZE=16).to_dense())
        b0 = torch.tensor(0)
        assert made.mask_mod(b0, b0, torch.tensor(4), torch.tensor(7)).item() is not causal_  # (a later key)
    with pytest.raises(TypeError, match=r"cu_seqlens must be an int32 tensor .* got ndarray"):
        varlen_block_mask(np.array([0.0, 8.0]))


# ----------------------------------------------------------------------------------------------
# flexlite.viz

QK = torch.randn(1, 2, 8, 8), torch.randn(1, 2, 8, 8)


def viz(path="unused.png", query=None, key=None, **kw):
    return lambda tmp: visualize_attention_scores(QK[0] if query is None else query, QK[1] if key is None else key,
                                                  path=tmp / path if isinstance(path, str) else path, **kw)


VIZ = {
    "path_int": (viz(path=3), TypeError, "path must be a str or os.PathLike"),
    "path_none": (viz(path=None), TypeError, "path must be a str or os.PathLike"),
    "path_missing_folder": (viz(path="no/such/folder/s.png"), ValueError, r"does not exist; create it first"),
    "path_is_folder": (viz(path="."), ValueError, "is a folder; give a file name"),
    "path_jpg": (viz(path="s.jpg"), ValueError, r"ends in '\.jpg', but the file written is a PNG"),
    "empty_query": (viz(query=torch.randn(1, 2, 0, 8)), ValueError, "nothing to draw: query has length 0"),
    "key_on_other_device": (viz(key=QK[1].to("meta")), ValueError, "key is on meta but query is on cpu"),
    "mask_mod_untraceable": (viz(mask_mod=branchy), UntraceableModError, r"torch\.where"),
    "mask_mod_returns_float": (viz(mask_mod=float_mask), TypeError, "mask_mod 'float_mask' must return a bool"),
    "score_mod_returns_none": (viz(score_mod=none_score), TypeError, "must return the new score"),
    "score_mod_vector": (viz(score_mod=lambda s, b, h, q, kv: torch.stack([s, s])), ValueError,
                         r"must return one value per \(b, h, q_idx, kv_idx\)"),
}


@pytest.mark.parametrize("name", sorted(VIZ))
def test_viz(name, tmp_path):
    call, exc, match = VIZ[name]
    check(lambda: call(tmp_path), exc, match)
    assert not list(tmp_path.glob("*.*")), "nothing is written for bad input"


def test_attention_scores_of_empty_sequences():
    scores, keep = attention_scores(torch.randn(1, 1, 0, 8), torch.randn(1, 1, 5, 8), mask_mod=causal)
    assert scores.shape == (0, 5) and keep.shape == (0, 5)


# ----------------------------------------------------------------------------------------------
# flexlite.masks registry and factories

NAMES = "causal, causal_bottom_right, sliding_window"

MASKS = {
    "unknown_name": (lambda: build_named_mask("causel", 64), ValueError,
                     f"unknown mask 'causel'; valid names: {NAMES}"),
    "name_not_str": (lambda: build_named_mask(None, 64), TypeError, f"name must be a str, one of {NAMES}"),
    "seq_zero": (lambda: build_named_mask("causal", 0), ValueError, "build_named_mask: seq must be >= 1; got 0"),
    "seq_float": (lambda: build_named_mask("causal", 64.0), TypeError, "seq must be an int; got float"),
    "unknown_option": (lambda: build_named_mask("causal", 64, windw=3), TypeError,
                       r"unknown options \['windw'\]; valid options: kv_seq, window"),
    "flamingo_no_images": (lambda: build_named_mask("flamingo", 64, images=0), ValueError, "images must be >= 1"),
    "softcap_infinite": (lambda: generate_tanh_softcap(float("inf")), ValueError,  # (its output was NaN)
                         "generate_tanh_softcap: cap must be a finite number > 0; got inf"),
    "softcap_nan": (lambda: generate_tanh_softcap(float("nan")), ValueError, "cap must be a finite number > 0"),
    "shared_prefix_too_long": (lambda: build_named_mask("shared_prefix", 64, prefix=100), ValueError,
                               "prefix=100 is longer than seq=64"),
    "prefix_lm_too_long": (lambda: build_named_mask("prefix_lm", 64, prefix=100), ValueError,
                           "prefix=100 is longer than seq=64"),
    "option_the_mask_ignores": (lambda: build_named_mask("causal", 64, window=3), ValueError,
                                "mask 'causal' takes no window .it would be ignored.; its options: none besides seq"),
    "flamingo_empty_intervals": (lambda: generate_vision_cross_attention_mask_mod([], 2), ValueError,
                                 r"intervals must have shape \[num_images >= 1, 2\]; got \(0, 2\)"),
    # torch's errors from deep inside before
    "flamingo_ragged_intervals": (lambda: generate_vision_cross_attention_mask_mod([[1, 2], [3]], 3), ValueError,
                                  r"intervals must be a \[N, 2\] table of ints .* got \[\[1, 2\], \[3\]\]"),
    "flamingo_empty_ranges": (lambda: generate_vision_cross_attention_from_ranges([], 3), ValueError,
                              r"image_ranges must have shape \[num_text_tokens >= 1, 2\]; got \(0, 2\)"),
    "document_bad_device": (lambda: generate_causal_document_mask([3], device="bogus"), ValueError,
                            "generate_doc_mask_mod: device='bogus' is not a device"),
    "document_no_tokens": (lambda: generate_causal_document_mask([0, 0]), ValueError,
                           "the documents have no tokens"),
    "varlen_bad_device": (lambda: varlen_block_mask(torch.tensor([0, 5], dtype=torch.int32), device="bogus"),
                          ValueError, "varlen_block_mask: device='bogus' is not a device"),
    "kv_cache_offset_int": (lambda: generate_kv_cache_causal(3), TypeError,
                            "generate_kv_cache_causal: offset must be a 0-d integer tensor .* got int 3"),
    "kv_cache_offset_bool": (lambda: generate_kv_cache_causal(torch.tensor(True)), TypeError,
                             "offset must be a 0-d integer tensor .* got a torch.bool tensor"),
    "kv_cache_offset_2d": (lambda: generate_kv_cache_causal(torch.zeros(2, 3, dtype=torch.int64)), TypeError,
                           r"or a non-empty 1-D one with a cache length per batch element; got a torch.int64 tensor "
                           r"of shape \(2, 3\)"),
    "kv_cache_offset_empty": (lambda: generate_kv_cache_causal(torch.zeros(0, dtype=torch.int32)), TypeError,
                              r"got a torch.int32 tensor of shape \(0,\)"),
}


@pytest.mark.parametrize("name", sorted(MASKS))
def test_masks(name):
    check(*MASKS[name])


# ----------------------------------------------------------------------------------------------
# DIY API: flexlite.kernels

A = torch.randn(8, 8)
Q4 = torch.randn(1, 2, 8, 16)

KERNELS = {
    "matmul_on_meta": (lambda: triton_matmul(A.to("meta"), A.to("meta")), NotImplementedError,
                       "triton_matmul: the inputs are on meta"),
    "matmul_use_autotune_str": (lambda: triton_matmul(A, A, use_autotune="no"), TypeError,
                                "use_autotune must be a bool"),
    "matmul_other_device": (lambda: triton_matmul(A, A.to("meta")), ValueError, "a is on cpu but b is on meta"),
    "flash_on_meta": (lambda: flash_attention(*on("meta", (Q4, Q4, Q4))), NotImplementedError,
                      "flash_attention: the inputs are on meta"),
    "flash_causal_str": (lambda: flash_attention(Q4, Q4, Q4, causal="no"), TypeError,
                         "flash_attention: causal must be a bool"),
    "flash_other_device": (lambda: flash_attention(Q4, Q4, Q4.to("meta")), ValueError, "must be on one device"),
    "flash_seq_lens_on_meta": (lambda: flash_attention(Q4, Q4, Q4, seq_lens=torch.tensor([3], device="meta")),
                               ValueError, "seq_lens is on meta"),
    "flash_rank_2": (lambda: flash_attention(A, A, A), ValueError, r"expected 3-D .* or 4-D"),
}


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernels(name):
    check(*KERNELS[name])


def test_flexlite_reexports_are_the_checked_functions():
    assert flexlite.flash_attention is flash_attention and flexlite.triton_matmul is triton_matmul


@pytest.mark.parametrize("case", ["longer tensors", "sliced over q blocks", "fewer kv blocks"])
def test_a_block_mask_whose_tensors_and_lengths_disagree_is_told_the_fix_that_fits(case):
    """Tensors made for longer sequences: _adjust; a mask sliced over q blocks: its seq_lengths (before: both got the
    slice's advice, or _adjust's for a slice); tensors with fewer kv blocks than KV_LEN needs (no slice makes those):
    neither (they got the slice's advice)."""
    base = create_block_mask(causal, None, None, 64, 64, DEVICE, BLOCK_SIZE=16)
    if case == "longer tensors":
        bm = BlockMask.from_kv_blocks(base.kv_num_blocks, base.kv_indices, BLOCK_SIZE=16, seq_lengths=(48, 48))
        q = k = torch.randn(1, 1, 48, 16, device=DEVICE)
        match = r"need 3 x 3: a mask whose tensors were made for longer sequences: crop it with block_mask._adjust"
    else:
        bm = base[:, :, 1:3]
        q, k = torch.randn(1, 1, 32, 16, device=DEVICE), torch.randn(1, 1, 64, 16, device=DEVICE)
        match = r"sliced over q blocks keeps the original seq_lengths.*set block_mask.seq_lengths = \(32, 64\)"
    if case == "fewer kv blocks":
        small = create_block_mask(causal, None, None, 64, 32, DEVICE, BLOCK_SIZE=16)
        bm = BlockMask.from_kv_blocks(small.kv_num_blocks, small.kv_indices, BLOCK_SIZE=16, seq_lengths=(64, 64))
        q = k = torch.randn(1, 1, 64, 16, device=DEVICE)
        match = (r"block_mask has 4 x 2 blocks of 16 x 16 .* need 4 x 4: its tensors cover only 64 x 32 positions "
                 r"\(a mask made for other lengths\); or rebuild it with create_block_mask$")
    with pytest.raises(ValueError, match=match) as e:
        flex_attention(q, k, k, block_mask=bm)
    assert ("sliced over q blocks" in str(e.value)) == (case == "sliced over q blocks")
