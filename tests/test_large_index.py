"""Large-index safety: every offset that can pass 2**31 elements is 64-bit in the generated kernels, and the
offsets that stay 32-bit (within one (batch, head) slice, within block-mask tensors, within small captured
tensors) are guarded in Python, so a tensor past them gets a ValueError instead of wrong memory.

Nothing large is allocated: shapes and strides come from 'meta' tensors (flex_attention validates them, then
refuses the meta device with NotImplementedError, which shows that the index guards let them through) or from
a lowered limit (monkeypatched ``flexlite.api.INDEX_LIMIT``).
"""

from __future__ import annotations

import re

import pytest
import torch

import flexlite.api as api
import flexlite.block_mask as bm_module
from flexlite import create_block_mask, flex_attention, kernel_source
from flexlite.runtime import launch
from helpers import DEVICE, rand_qkv

LIMIT = 2**31
TENSORS = "q|k|v|o|do|dq|dk|dv"  # the stride names of the attention tensors in the kernels


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("a kernel was launched")
    for module in (launch, api):  # api imported the launchers by name
        for name in ("launch_forward", "launch_decode", "launch_backward"):
            monkeypatch.setattr(module, name, fail)


def functions(source: str) -> dict:
    """The generated source split into its top-level functions: name -> body text."""
    parts = re.split(r"^def (\w+)\(", source, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


# ----------------------------------------------------------------------------------------------
# the index math of the generated kernels

@pytest.mark.parametrize("kernel", ["forward", "decode", "backward"])
def test_batch_and_head_offsets_are_64_bit(kernel):
    """Every batch / head base offset (``off * stride_<t>z``, ``off * stride_<t>h``) multiplies an int64: the
    multiplicand is cast ``.to(tl.int64)``, or (the decode combine kernel) derived from an int64 program id."""
    source = kernel_source(kernel=kernel, device="cpu")
    uses = re.findall(rf"(\S+) \* stride_(?:{TENSORS})[zh]\b", source)
    assert len(uses) >= 8, uses
    for name, body in functions(source).items():
        for m in re.finditer(rf"(?<!\.to\(tl\.int64\)) \* stride_(?:{TENSORS})[zh]\b", body):
            line = body[body.rfind("\n", 0, m.start()) + 1:body.find("\n", m.end())].strip()
            # the only exception: off_z / off_h computed from i_row = program_id(0).to(int64)
            assert name == "flex_decode_combine_kernel", f"{name}: 32-bit batch/head offset in: {line}"
            assert re.search(r"i_row = tl\.program_id\(0\)\.to\(tl\.int64\)", body)
            assert "off_zh = i_row // Q_LEN" in body and "off_z = off_zh // HQ" in body, body


ROW_OFFSETS = {  # the lines that index the per-row buffers (LSE, delta, split partials, dS)
    "forward": ["tl.store(LSE + i_zh.to(tl.int64) * Q_LEN + offs_m"],
    "decode": ["tl.store(LSE + i_zh.to(tl.int64) * Q_LEN + offs_m",
               "row = ((off_z.to(tl.int64) * HQ + off_h) * NUM_SPLITS + i_s) * Q_LEN + pos",
               "i_row = tl.program_id(0).to(tl.int64)", "off_zh = i_row // Q_LEN",
               "rows_s = (off_zh * NUM_SPLITS + offs_s) * Q_LEN + off_m"],
    "backward": ["row = i_zh.to(tl.int64) * Q_LEN + offs_m", "LSE_h = LSE + i_zhq.to(tl.int64) * Q_LEN",
                 "DELTA_h = DELTA + i_zhq.to(tl.int64) * Q_LEN", "DS_h = DS + i_zhq.to(tl.int64) * Q_LEN * KV_LEN",
                 "p_ds = DS + offs_m[None, :].to(tl.int64) * KV_LEN", "LSE += i_zh.to(tl.int64) * Q_LEN",
                 "DELTA += i_zh.to(tl.int64) * Q_LEN"],
}


@pytest.mark.parametrize("kernel", sorted(ROW_OFFSETS))
def test_row_offsets_of_lse_and_scratch_are_64_bit(kernel):
    """LSE / delta / split partials / dS are indexed by (batch * heads + head) * Q_LEN + row (dS: times KV_LEN):
    computed in int64; no flattened (batch, head) index is ever multiplied in 32 bits."""
    source = kernel_source(kernel=kernel, device="cpu")
    for line in ROW_OFFSETS[kernel]:
        assert line in source, line
    code = re.sub(r"#.*", "", source)
    assert not re.search(r"\bi_zhq?\b(?!\.to\(tl\.int64\)) \*", code)


def test_gathers_from_captured_tensors_past_2_31_elements_are_64_bit():
    big = torch.empty(LIMIT + 5, device="meta")
    small = torch.empty(1000, device="meta")

    def with_big(score, b, h, q_idx, kv_idx):
        return score + big[q_idx]

    def with_small(score, b, h, q_idx, kv_idx):
        return score + small[q_idx]

    assert re.search(r"t_\w+_i0 = q_idx\.to\(tl\.int64\)", kernel_source(with_big, device="cpu"))
    assert not re.search(r"t_\w+_i0 = q_idx\.to\(tl\.int64\)", kernel_source(with_small, device="cpu"))


# ----------------------------------------------------------------------------------------------
# the Python guards of the 32-bit offsets

def meta(shape, strides=None):
    if strides is None:
        return torch.empty(shape, device="meta")
    return torch.empty_strided(shape, strides, device="meta")


def passes_index_guards(q, k, v):
    """flex_attention accepted the shapes and strides: it got as far as refusing the meta device."""
    with pytest.raises(NotImplementedError, match="inputs are on meta"):
        flex_attention(q, k, v)
    return True


GUARDED = {  # (q, k, v) of meta tensors -> ValueError message
    "query_transposed_view": (lambda: (meta((1, 2**24, 128, 16)).transpose(1, 2), meta((1, 128, 4, 16)),
                                       meta((1, 128, 4, 16))),
                              r"query spans 34359736335 elements within one \(batch, head\) slice"),
    "key_strided_rows": (lambda: (meta((1, 1, 4, 16)), meta((1, 1, 3, 16), (48, 48, 2**30, 1)), meta((1, 1, 3, 16))),
                         r"key spans 2147483663 elements .* make it contiguous or split the sequence"),
    "key_one_row_past_the_limit": (lambda: (meta((1, 1, 4, 16)), meta((1, 1, 2**27 + 1, 16)),
                                          meta((1, 1, 2**27 + 1, 16))),
                                 r"key spans 2147483663 elements"),
    "value_only": (lambda: (meta((1, 1, 4, 16)), meta((1, 1, 2**23 + 1, 16)), meta((1, 1, 2**23 + 1, 256))),
                   r"value spans 2147483903 elements"),
    "key_broadcast_rows": (lambda: (meta((1, 1, 4, 16)), meta((1, 1, 1, 16)).expand(1, 1, 2**28, 16),
                                    meta((1, 1, 1, 16)).expand(1, 1, 2**28, 16)),
                           r"key has 268435456 x 16 = 4294967296 elements per \(batch, head\) slice; .* gradients"),
    "output_slice": (lambda: (meta((1, 1, 2**24, 16)), meta((1, 1, 4, 16)), meta((1, 1, 4, 256))),
                     r"the output has 16777216 x 256 = 4294967296 elements per \(batch, head\) slice"),
}


@pytest.mark.parametrize("name", sorted(GUARDED))
def test_offsets_within_a_slice_past_32_bits_are_refused(name):
    make, match = GUARDED[name]
    with pytest.raises(ValueError, match=match):
        flex_attention(*make())


def test_the_guards_stop_exactly_at_2_31():
    # the largest slice that fits: (L - 1) * D + (D - 1) = 2**31 - 1
    q = meta((1, 1, 2**27, 16))
    assert passes_index_guards(q, q, q)
    # large totals across batch and heads are fine: those offsets are 64-bit
    big = meta((2**12, 2**12, 256, 16))
    assert big.numel() == 2**36 and passes_index_guards(big, big, big)
    # a transposed [B, L, H, D] layout whose slice stays below the limit
    x = meta((2, 2**20, 64, 16)).transpose(1, 2)
    assert api._max_offset(x.shape[2:], x.stride()[2:]) < LIMIT and passes_index_guards(x, x, x)


def test_max_offset():
    assert api._max_offset((3, 16), (2**30, 1)) == 2 * 2**30 + 15
    assert api._max_offset((0, 16), (16, 1)) == 0
    assert api._max_offset((5, 4), (0, 1)) == 3  # broadcast rows
    assert api._max_offset((4, 4), (-4, 1)) == 12 + 3  # |stride|


def test_strided_captured_tensor_past_32_bit_offsets_is_refused():
    q, k, v = rand_qkv(1, 1, 1, 8, 8, 16)
    # 4 elements 2**30 apart: offsets to 3 * 2**30, which 32-bit gather math would wrap
    table = torch.empty_strided((4,), (2**30,), device="meta")

    def mod(score, b, h, q_idx, kv_idx):
        return score + table[q_idx % 4]
    with pytest.raises(ValueError, match=r"captured by a mod \(shape \(4,\), strides \(1073741824,\)\) reaches offset "
                                         r"3221225472.*capture tensor\.contiguous\(\) instead"):
        flex_attention(q, k, v, score_mod=mod)


def test_block_mask_kernel_refuses_strided_captured_tensors_past_32_bit_offsets():
    table = torch.empty_strided((4,), (2**30,), device="meta")

    def mask(b, h, q_idx, kv_idx):
        return table[q_idx % 4] >= 0
    with pytest.raises(ValueError, match=r"create_block_mask: a tensor captured by mask_mod .* reaches offset "
                                         r"3221225472"):
        bm_module._block_flags_kernel(mask, 1, 1, 32, 32, torch.device(DEVICE), (16, 16))


def test_block_mask_tensors_past_32_bit_offsets_are_refused(monkeypatch):
    """Block-mask tensors are indexed in 32 bits; the guard is tested at a lowered limit (no 8 GiB mask)."""
    q, k, v = rand_qkv(1, 70, 70, 4, 4, 4)
    per_head = create_block_mask(causal, None, 70, 4, 4, device=DEVICE, BLOCK_SIZE=16)
    shared = create_block_mask(causal, None, None, 4, 4, device=DEVICE, BLOCK_SIZE=16)
    monkeypatch.setattr(api, "INDEX_LIMIT", 64)  # q/k/v slices span 15 elements, kv_num_blocks 69
    with pytest.raises(ValueError, match=r"block_mask\.kv_num_blocks \(shape \(1, 70, 1\)\) is too large: .* 32 bits.*"
                                         r"H=None"):
        flex_attention(q, k, v, block_mask=per_head)
    api._validate_block_mask(shared, q, k)  # broadcast over heads: small, accepted


def test_block_mask_offsets_are_checked_once_per_set_of_tensor_shapes(monkeypatch):
    """The block-mask tensors' 32-bit offset check runs once per BlockMask and set of tensor shapes and strides (8
    sums were half of a decode call's validation; a copy, an unpickled mask or a tensor reusing a freed one's id
    reads the same), again when one changes, and still refuses a replacement past the limit."""
    import copy
    import pickle
    q, k, v = rand_qkv(1, 2, 2, 4, 4, 4)
    bm = create_block_mask(causal, None, 2, 4, 4, device=DEVICE, BLOCK_SIZE=16)
    sums = []
    real = api._max_offset
    monkeypatch.setattr(api, "_max_offset", lambda shape, strides: sums.append(shape) or real(shape, strides))
    api._validate_block_mask(bm, q, k)
    first = len(sums)
    api._validate_block_mask(bm, q, k)
    bm.kv_indices = bm.kv_indices.clone()  # (the same shape and strides: nothing new to check)
    api._validate_block_mask(bm, q, k)
    api._validate_block_mask(copy.deepcopy(bm), q, k)
    assert first >= 4 and len(sums) == first
    wider = torch.zeros(1, 2, 2, dtype=torch.int32, device=bm.kv_num_blocks.device)
    wider[:, :, :1] = bm.kv_num_blocks
    bm.kv_num_blocks = wider[:, :, :1]  # the same values at other strides: checked again
    api._validate_block_mask(bm, q, k)
    assert len(sums) == 2 * first
    monkeypatch.setattr(api, "INDEX_LIMIT", 1)  # kv_num_blocks [1, 2, 1] reaches offset 1: checked again, refused
    with pytest.raises(ValueError, match=r"block_mask\.kv_num_blocks .* is too large"):
        api._validate_block_mask(bm, q, k)
    with pytest.raises(ValueError, match=r"block_mask\.kv_num_blocks .* is too large"):
        api._validate_block_mask(pickle.loads(pickle.dumps(bm)), q, k)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx
