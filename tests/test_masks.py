"""flexlite.masks against dense definitions written here as plain Python over positions: through
create_mask, through create_block_mask (block flags derived from the dense definition), through the
kernels (a few small flex_attention forwards), plus names, argument checks, tracing and the demos."""

from __future__ import annotations

import importlib

import pytest
import torch

import flexlite.masks as masks
from flexlite import attention_reference, create_block_mask, create_mask, flex_attention, noop_mask
from flexlite.codegen.trace import trace_mod
from flexlite.masks import (causal_mask, generate_block_causal_mask, generate_block_diffusion_mask,
                            generate_causal_bottom_right, generate_causal_document_mask,
                            generate_dilated_sliding_window, generate_doc_mask_mod, generate_document_mask,
                            generate_global_sliding_window, generate_morton_natten, generate_natten,
                            generate_prefix_lm_mask, generate_sasa_mask, generate_shared_prefix_mask,
                            generate_sliding_window, generate_tiled_natten, generate_vision_cross_attention_from_ranges,
                            generate_vision_cross_attention_mask_mod)
from helpers import DEVICE, LSE_TOLERANCES, TOLERANCES, assert_close, rand_qkv

# ----------------------------------------------------------------------------------------------
# dense definitions: keep(q, kv) -> bool over Python ints


def doc_of(lengths):
    """Per-token (document, start of that document) for packed lengths."""
    out = []
    for d, n in enumerate(lengths):
        out += [(d, sum(lengths[:d]))] * n
    return out


def dense_document(lengths, inner):
    doc = doc_of(lengths)

    def keep(q, kv):
        (dq, sq), (dk, sk) = doc[q], doc[kv]
        return dq == dk and inner(q - sq, kv - sk)
    return keep


def dense_natten(W, H, KW, KH, coords):
    """NATTEN over pixel coordinates coords(idx) -> (row, col)."""
    def keep(q, kv):
        (qr, qc), (kr, kc) = coords(q), coords(kv)
        centre_r = min(max(qr, KH // 2), H - 1 - KH // 2)
        centre_c = min(max(qc, KW // 2), W - 1 - KW // 2)
        return abs(centre_r - kr) <= KH // 2 and abs(centre_c - kc) <= KW // 2
    return keep


def row_major(W):
    return lambda i: (i // W, i % W)


def tiled(W, TW, TH):
    def coords(i):
        tile, off = divmod(i, TW * TH)
        return (tile // (W // TW)) * TH + off // TW, (tile % (W // TW)) * TW + off % TW
    return coords


def morton(i):
    row = sum(((i >> (2 * b + 1)) & 1) << b for b in range(16))
    col = sum(((i >> (2 * b)) & 1) << b for b in range(16))
    return row, col


def dense_flamingo(intervals, counts):
    image_of = [i for i, n in enumerate(counts) for _ in range(n)]
    return lambda q, kv: intervals[image_of[kv]][0] <= q < intervals[image_of[kv]][1]


def dense_block_diffusion(bs, n):
    def keep(q, kv):
        q0, k0 = q >= n, kv >= n
        qb, kb = (q - n * q0) // bs, (kv - n * k0) // bs
        return ((qb == kb and q0 == k0) or (qb > kb and k0 and not q0) or (qb >= kb and k0 and q0))
    return keep


# (id, mask_mod factory, Q_LEN, KV_LEN, dense keep(q, kv))
CASES = [
    ("causal", lambda: causal_mask, 45, 45, lambda q, kv: q >= kv),
    ("causal_bottom_right", lambda: generate_causal_bottom_right(20, 50), 20, 50, lambda q, kv: q + 30 >= kv),
    ("sliding_window", lambda: generate_sliding_window(5), 45, 45, lambda q, kv: 0 <= q - kv <= 5),
    ("sliding_window_0", lambda: generate_sliding_window(0), 33, 33, lambda q, kv: q == kv),
    ("sliding_window_bidir", lambda: generate_sliding_window(5, causal=False), 45, 40, lambda q, kv: abs(q - kv) <= 5),
    ("dilated", lambda: generate_dilated_sliding_window(8, 3), 45, 45,
     lambda q, kv: abs(q - kv) <= 8 and (q - kv) % 3 == 0),
    ("dilated_causal", lambda: generate_dilated_sliding_window(9, 2, causal=True), 45, 45,
     lambda q, kv: 0 <= q - kv <= 9 and (q - kv) % 2 == 0),
    ("global_window", lambda: generate_global_sliding_window(4, 3), 45, 45,
     lambda q, kv: abs(q - kv) <= 4 or q < 3 or kv < 3),
    ("global_window_causal", lambda: generate_global_sliding_window(4, 3, causal=True), 45, 45,
     lambda q, kv: kv <= q and (q - kv <= 4 or kv < 3)),
    ("prefix_lm", lambda: generate_prefix_lm_mask(10), 45, 45, lambda q, kv: kv < 10 or q >= kv),
    ("prefix_lm_0", lambda: generate_prefix_lm_mask(0), 20, 20, lambda q, kv: q >= kv),
    ("document_causal", lambda: generate_causal_document_mask([5, 1, 12, 7, 0, 9], device=DEVICE), 34, 34,
     dense_document([5, 1, 12, 7, 0, 9], lambda q, kv: q >= kv)),
    ("document_bidirectional", lambda: generate_document_mask([5, 1, 12, 7, 9], device=DEVICE), 34, 34,
     dense_document([5, 1, 12, 7, 9], lambda q, kv: True)),
    ("document_window_offsets", lambda: generate_doc_mask_mod(
        generate_sliding_window(2), offsets=torch.tensor([0, 5, 6, 18, 25, 34]), device=DEVICE), 34, 34,
     dense_document([5, 1, 12, 7, 9], lambda q, kv: 0 <= q - kv <= 2)),
    ("document_prefix_ids", lambda: generate_doc_mask_mod(
        generate_prefix_lm_mask(3), torch.tensor([0] * 5 + [1] + [2] * 12 + [3] * 7 + [4] * 9), device=DEVICE), 34, 34,
     dense_document([5, 1, 12, 7, 9], lambda q, kv: kv < 3 or q >= kv)),
    ("shared_prefix", lambda: generate_shared_prefix_mask(10, [5, 7, 0, 4], device=DEVICE), 26, 26,
     lambda q, kv: kv <= q and (kv < 10 or dense_document([10, 5, 7, 0, 4], lambda a, b: True)(q, kv))),
    ("natten_7x5_k3x3", lambda: generate_natten(7, 5, 3, 3), 35, 35, dense_natten(7, 5, 3, 3, row_major(7))),
    ("natten_6x4_k5x3", lambda: generate_natten(6, 4, 5, 3), 24, 24, dense_natten(6, 4, 5, 3, row_major(6))),
    ("tiled_natten", lambda: generate_tiled_natten(8, 4, 3, 3, 4, 2), 32, 32, dense_natten(8, 4, 3, 3, tiled(8, 4, 2))),
    ("morton_natten", lambda: generate_morton_natten(8, 8, 3, 5), 64, 64, dense_natten(8, 8, 3, 5, morton)),
    ("sasa_7x5_w1", lambda: generate_sasa_mask(7, 5, 1), 35, 35,
     lambda q, kv: abs(q // 7 - kv // 7) <= 1 and abs(q % 7 - kv % 7) <= 1),
    ("sasa_6x6_w2", lambda: generate_sasa_mask(6, 6, 2), 36, 36,
     lambda q, kv: abs(q // 6 - kv // 6) <= 2 and abs(q % 6 - kv % 6) <= 2),
    ("flamingo", lambda: generate_vision_cross_attention_mask_mod([[0, 7], [1, 7], [7, 12]], 3, device=DEVICE), 12, 9,
     dense_flamingo([[0, 7], [1, 7], [7, 12]], [3, 3, 3])),
    ("flamingo_var_lengths", lambda: generate_vision_cross_attention_mask_mod(
        torch.tensor([[2, 20], [5, 9], [20, 30]]), [2, 4, 3], device=DEVICE), 30, 9,
     dense_flamingo([[2, 20], [5, 9], [20, 30]], [2, 4, 3])),
    ("flamingo_ranges", lambda: generate_vision_cross_attention_from_ranges(
        [[0, 1], [1, 3], [0, 0], [2, 3], [0, 3]] * 4, [2, 4, 3], device=DEVICE), 20, 9,
     lambda q, kv: [[0, 1], [1, 3], [0, 0], [2, 3], [0, 3]][q % 5][0] <= [0, 0, 1, 1, 1, 1, 2, 2, 2][kv]
     < [[0, 1], [1, 3], [0, 0], [2, 3], [0, 3]][q % 5][1]),
    ("block_causal", lambda: generate_block_causal_mask(5), 33, 33, lambda q, kv: q // 5 >= kv // 5),
    ("block_diffusion", lambda: generate_block_diffusion_mask(13, 4), 26, 26, dense_block_diffusion(4, 13)),
]
CASE_PARAMS = [pytest.param(*c[1:], id=c[0]) for c in CASES]


def dense(keep, Lq, Lkv) -> torch.Tensor:
    return torch.tensor([[bool(keep(q, kv)) for kv in range(Lkv)] for q in range(Lq)])


def blocks_of(d: torch.Tensor, bq: int, bkv: int):
    """(non-empty, full) bool [nQ, nKV] of a dense [Lq, Lkv] mask, tile by tile (in-range positions)."""
    nq, nkv = -(-d.shape[0] // bq), -(-d.shape[1] // bkv)
    tiles = [[d[i * bq:(i + 1) * bq, j * bkv:(j + 1) * bkv] for j in range(nkv)] for i in range(nq)]
    return (torch.tensor([[bool(t.any()) for t in row] for row in tiles]),
            torch.tensor([[bool(t.all()) for t in row] for row in tiles]))


@pytest.mark.parametrize("make, Lq, Lkv, keep", CASE_PARAMS)
def test_create_mask_matches_dense_definition(make, Lq, Lkv, keep):
    got = create_mask(make(), 1, 1, Lq, Lkv, device=DEVICE).cpu()
    assert got.dtype == torch.bool and got.shape == (1, 1, Lq, Lkv)
    expected = dense(keep, Lq, Lkv)
    mismatch = (got[0, 0] != expected).nonzero()
    assert not len(mismatch), f"{len(mismatch)} positions differ, first (q, kv) = {mismatch[0].tolist()}"


@pytest.mark.parametrize("block_size", [16, (16, 32)], ids=str)
@pytest.mark.parametrize("make, Lq, Lkv, keep", CASE_PARAMS)
def test_block_mask_matches_dense_definition(make, Lq, Lkv, keep, block_size):
    bm = create_block_mask(make(), None, None, Lq, Lkv, device=DEVICE, BLOCK_SIZE=block_size)
    bq, bkv = (block_size, block_size) if isinstance(block_size, int) else block_size
    nonempty, full = blocks_of(dense(keep, Lq, Lkv), bq, bkv)
    assert bm.to_dense()[0, 0].cpu().bool().equal(nonempty)
    assert bm.dense_blocks(full=True)[0, 0].cpu().equal(full)


@pytest.mark.parametrize("make, Lq, Lkv, keep", CASE_PARAMS)
def test_traceable(make, Lq, Lkv, keep):
    """Every mask traces with torch.fx (no Python branch on tensors) and lowers to a kernel."""
    mask = make()
    traced = trace_mod(mask, "mask_mod")
    assert traced.graph_module.graph.output_node().meta["dtype"] == torch.bool
    from flexlite import kernel_source
    bm = create_block_mask(mask, None, None, Lq, Lkv, device=DEVICE, BLOCK_SIZE=16)
    assert "def " in kernel_source(None, bm, device=DEVICE)


# ----------------------------------------------------------------------------------------------
# through the kernels (interpreter on CPU): a few masks, L <= 128

FORWARD = [
    pytest.param(lambda: generate_doc_mask_mod(generate_sliding_window(7), lengths=[30, 3, 50, 17], device=DEVICE),
                 100, 100, id="document_sliding_window"),
    pytest.param(lambda: generate_vision_cross_attention_mask_mod(
        [[10, 60], [11, 60], [60, 96]], 24, device=DEVICE), 96, 72, id="flamingo_fully_masked_rows"),
    pytest.param(lambda: generate_vision_cross_attention_from_ranges(
        [[0, 0]] * 10 + [[0, 2]] * 50 + [[2, 3]] * 36, 24, device=DEVICE), 96, 72, id="flamingo_from_ranges"),
    pytest.param(lambda: generate_natten(10, 10, 3, 5), 100, 100, id="natten"),
    pytest.param(lambda: generate_block_diffusion_mask(56, 16), 112, 112, id="block_diffusion"),
    pytest.param(lambda: generate_shared_prefix_mask(40, [30, 27, 31], device=DEVICE), 128, 128, id="shared_prefix"),
]


@pytest.mark.parametrize("make, Lq, Lkv", FORWARD)
def test_flex_attention_forward(make, Lq, Lkv):
    mask = make()
    q, k, v = rand_qkv(1, 2, 2, Lq, Lkv, 32)
    bm = create_block_mask(mask, None, None, Lq, Lkv, device=DEVICE, BLOCK_SIZE=32)
    out, lse = flex_attention(q, k, v, block_mask=bm, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, block_mask=bm)
    assert_close(out, ref, *TOLERANCES[torch.float32])
    assert_close(lse, ref_lse, *LSE_TOLERANCES[torch.float32], name="lse")


def test_fully_masked_text_rows_give_zero():
    mask = generate_vision_cross_attention_mask_mod([[10, 60], [60, 96]], 24, device=DEVICE)
    q, k, v = rand_qkv(1, 1, 1, 96, 48, 16)
    out, lse = flex_attention(q, k, v, block_mask=create_block_mask(mask, None, None, 96, 48, device=DEVICE),
                              return_lse=True)
    assert (out[:, :, :10] == 0).all() and torch.isneginf(lse[:, :, :10]).all()


# ----------------------------------------------------------------------------------------------
# names, layouts, helpers

@pytest.mark.parametrize("mask, name", [
    (causal_mask, "causal_mask"),
    (generate_sliding_window(1024), "sliding_window_1024"),
    (generate_sliding_window(64, causal=False), "sliding_window_64_bidirectional"),
    (generate_dilated_sliding_window(128, 4), "dilated_sliding_window_128_dilation_4"),
    (generate_global_sliding_window(256, 16), "global_16_sliding_window_256"),
    (generate_prefix_lm_mask(2048), "prefix_lm_2048"),
    (generate_causal_document_mask([3, 4]), "document_causal_mask"),
    (generate_doc_mask_mod(noop_mask, lengths=[3, 4]), "document_noop_mask"),
    (generate_shared_prefix_mask(100, [10, 20, 30]), "shared_prefix_100_3_suffixes"),
    (generate_natten(128, 64, 13, 7), "natten_c128x64_k13x7"),
    (generate_tiled_natten(128, 128, 13, 13, 8, 8), "tiled_natten_c128x128_k13x13_t8x8"),
    (generate_morton_natten(64, 64, 7, 7), "morton_natten_c64x64_k7x7"),
    (generate_sasa_mask(128, 128, 8), "sasa_c128x128_w8"),
    (generate_vision_cross_attention_mask_mod([[0, 7], [1, 7]], 3), "vision_cross_attention_2x3"),
    (generate_vision_cross_attention_from_ranges([[0, 1], [0, 2]], [3, 5]), "vision_cross_attention_ranges_2x2"),
    (generate_block_causal_mask(64), "block_causal_64"),
    (generate_block_diffusion_mask(1024, 16), "block_diffusion_16_1024"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_names(mask, name):
    assert mask.__name__ == name


def test_document_layouts_agree():
    lengths = [4, 9, 1, 6]
    ids = masks.document_ids_from_lengths(lengths)
    offsets = masks.length_to_offsets(lengths)
    assert ids.tolist() == [0] * 4 + [1] * 9 + [2] + [3] * 6
    assert offsets.tolist() == [0, 4, 13, 14, 20]
    assert masks.offsets_to_document_ids(offsets).equal(ids)
    dense_masks = [create_mask(generate_doc_mask_mod(causal_mask, **kw), 1, 1, 20, 20, device="cpu")
                   for kw in (dict(document_id=ids), dict(offsets=offsets), dict(lengths=lengths))]
    assert dense_masks[0].equal(dense_masks[1]) and dense_masks[0].equal(dense_masks[2])


def test_attention_gym_offsets_passed_positionally_are_caught():
    """attention-gym's generate_doc_mask_mod(mask_mod, offsets): offsets are not per-token ids."""
    with pytest.raises(ValueError, match="offsets="):
        generate_doc_mask_mod(causal_mask, torch.tensor([0, 4, 13, 14, 20]))


def test_image_intervals_from_tokens():
    tokens = [1, 1, 9673, 527, 1403, 12875, 13, 1, 1115, 374, 264, 8415]
    assert masks.image_intervals_from_tokens(tokens, 1) == [[0, 7], [1, 7], [7, 12]]
    assert masks.image_intervals_from_tokens([5, 5, 1, 5, 1, 1, 5], 1) == [[2, 4], [4, 7], [5, 7]]
    assert masks.image_intervals_from_tokens([5, 5], 1) == []


def test_tiled_natten_permutation():
    W, H, T = 8, 4, (4, 2)
    perm = masks.tiled_natten_permutation(W, H, *T)
    assert sorted(perm.tolist()) == list(range(W * H))
    naive = create_mask(generate_natten(W, H, 3, 3), 1, 1, W * H, W * H, device="cpu")[0, 0]
    tiled_ = create_mask(generate_tiled_natten(W, H, 3, 3, *T), 1, 1, W * H, W * H, device="cpu")[0, 0]
    assert naive[perm][:, perm].equal(tiled_)


def test_captured_tensors_on_requested_device():
    for mask in (generate_causal_document_mask([3, 4], device="cpu"),
                 generate_shared_prefix_mask(4, [2, 2], device="cpu"),
                 generate_vision_cross_attention_mask_mod([[0, 2]], 3, device="cpu")):
        captured = trace_mod(mask, "mask_mod").captured.values()
        assert captured and all(t.device == torch.device("cpu") for t in captured)
    ids = torch.tensor([0, 0, 1])
    assert all(t is ids or t.device == ids.device
               for t in trace_mod(generate_doc_mask_mod(causal_mask, ids), "mask_mod").captured.values())


def test_factories_take_a_meta_device():
    """device="meta" is taken as torch's factories take it (check_device_arg lets it through): the captured tensors
    go there, built from the lengths' values on the CPU first (before: torch's "cannot repeat_interleave a meta tensor
    without output_size" from the document, shared-prefix and Flamingo factories)."""
    for mask in (generate_causal_document_mask([3, 0, 4], device="meta"),
                 generate_doc_mask_mod(causal_mask, torch.tensor([0, 0, 1]), device="meta"),
                 generate_shared_prefix_mask(4, [2, 2], device="meta"),
                 generate_vision_cross_attention_mask_mod([[0, 2], [1, 3]], [3, 2], device="meta"),
                 generate_vision_cross_attention_from_ranges([[0, 1], [0, 2]], 3, device="meta")):
        captured = list(trace_mod(mask, "mask_mod").captured.values())
        assert captured and all(t.device.type == "meta" for t in captured), mask.__name__
    assert masks.document_ids_from_lengths([2, 3], device="meta").shape == (5,)


@pytest.mark.parametrize("name", sorted(masks.NAMED_MASKS))
def test_named_masks_build(name):
    seq = 64 if "natten" in name or name == "sasa" else 96
    given = {"kernel": (3, 3), "tile": (4, 4), "image_tokens": 8}
    mask, Lq, Lkv = masks.build_named_mask(name, seq, **{k: v for k, v in given.items()
                                                         if k in masks.NAMED_MASKS[name].options})
    assert create_block_mask(mask, None, None, Lq, Lkv, device="cpu", BLOCK_SIZE=16).sparsity() < 100


def test_named_mask_unknown():
    with pytest.raises(ValueError, match="valid names: causal"):
        masks.build_named_mask("causel", 64)


def test_lazy_exports():
    assert set(masks.__all__) <= set(dir(masks))
    for name in masks.__all__:
        assert getattr(masks, name) is not None
    with pytest.raises(AttributeError):
        masks.no_such_mask


@pytest.mark.parametrize("module", ["causal", "sliding_window", "dilated_sliding_window", "global_sliding_window",
                                    "prefix_lm", "shared_prefix", "document", "natten", "sasa", "flamingo",
                                    "block_causal"])
def test_every_file_is_a_demo(module, capsys):
    importlib.import_module(f"flexlite.masks.{module}").main()
    assert "BlockMask(shape=" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------
# argument checks: typed errors naming the argument

BAD_ARGS = [
    (generate_sliding_window, (-1,), ValueError, "window_size"),
    (generate_sliding_window, (2.5,), TypeError, "window_size"),
    (generate_sliding_window, (4, "yes"), TypeError, "causal"),
    (generate_dilated_sliding_window, (4, 0), ValueError, "dilation"),
    (generate_global_sliding_window, (4, -2), ValueError, "num_global_tokens"),
    (generate_prefix_lm_mask, (True,), TypeError, "prefix_length"),
    (generate_causal_bottom_right, (0, 4), ValueError, "q_len"),
    (generate_causal_document_mask, ([3, -1],), ValueError, r"lengths\[1\]"),
    (generate_causal_document_mask, ([],), ValueError, "lengths"),
    (generate_doc_mask_mod, (causal_mask,), TypeError, "exactly one of document_id, offsets, lengths"),
    (generate_doc_mask_mod, ("causal", torch.tensor([0, 1])), TypeError, "mask_mod"),
    (generate_doc_mask_mod, (causal_mask, torch.tensor([0.0, 1.0])), TypeError, "document_id"),
    (generate_doc_mask_mod, (causal_mask, torch.tensor([1, 1, 2])), ValueError, "document_id"),
    (lambda: generate_doc_mask_mod(causal_mask, offsets=torch.tensor([0, 5, 3])), (), ValueError, "offsets"),
    (generate_shared_prefix_mask, (4, 7), TypeError, "suffix_lengths"),
    (generate_natten, (8, 8, 4, 3), ValueError, "kernel_w"),
    (generate_natten, (8, 2, 3, 3), ValueError, "kernel_h"),
    (generate_tiled_natten, (8, 8, 3, 3, 3, 2), ValueError, "T_W"),
    (generate_morton_natten, (8, 4, 3, 3), ValueError, "square"),
    (generate_sasa_mask, (0, 4, 1), ValueError, "canvas_w"),
    (generate_vision_cross_attention_mask_mod, ([[3, 1]], 2), ValueError, "interval"),
    (generate_vision_cross_attention_mask_mod, ([[0, 1, 2]], 2), ValueError, "intervals"),
    (generate_vision_cross_attention_mask_mod, ([[0, 1]], 0), ValueError, "image_token_length"),
    (generate_vision_cross_attention_mask_mod, ([[0, 1], [1, 2]], [3]), ValueError, "image_token_length"),
    (generate_vision_cross_attention_mask_mod, (torch.tensor([[0.0, 1.0]]), 2), TypeError, "intervals"),
    (generate_vision_cross_attention_from_ranges, ([[0, 4]], [2, 2]), ValueError, "image 3"),
    (generate_vision_cross_attention_from_ranges, ([[2, 1]], 2), ValueError, "range"),
    (generate_vision_cross_attention_from_ranges, ([[0, 1, 1]], 2), ValueError, "image_ranges"),
    (generate_block_causal_mask, (0,), ValueError, "block_size"),
    (generate_block_diffusion_mask, ("8", 4), TypeError, "seq_len"),
    # a negative GPU index (before: torch's "Device index must not be negative") and meta tensors whose values the
    # factory reads (before: torch's errors from .item() / .tolist() on them)
    (lambda: generate_causal_document_mask([2, 3], device=-1), (), ValueError,
     r"generate_doc_mask_mod: device=-1 is no GPU index"),
    (lambda: generate_vision_cross_attention_mask_mod([[0, 2]], 3, device=-2), (), ValueError, "device=-2"),
    (lambda: generate_doc_mask_mod(causal_mask, torch.tensor([0, 0, 1], device="meta")), (), ValueError,
     "generate_doc_mask_mod: document_id is a meta tensor, which holds no values"),
    (lambda: generate_doc_mask_mod(causal_mask, offsets=torch.tensor([0, 2, 3], device="meta")), (), ValueError,
     "offsets is a meta tensor"),
    (lambda: generate_causal_document_mask(torch.tensor([2, 3], device="meta")), (), ValueError,
     "lengths is a meta tensor"),
    (lambda: generate_vision_cross_attention_mask_mod(torch.tensor([[0, 2]], device="meta"), 3), (), ValueError,
     "intervals is a meta tensor"),
    (lambda: generate_vision_cross_attention_from_ranges(torch.tensor([[0, 1]], device="meta"), 3), (), ValueError,
     "image_ranges is a meta tensor"),
]


@pytest.mark.parametrize("factory, args, exc, match", BAD_ARGS,
                         ids=[f"{getattr(f, '__name__', 'f')}-{m}" for f, _, _, m in BAD_ARGS])
def test_bad_arguments(factory, args, exc, match):
    with pytest.raises(exc, match=match):
        factory(*args)


def test_masks_compose():
    """Composition with and_masks / or_masks keeps tracing and vmap working (no duplicated logic needed)."""
    from flexlite import and_masks, or_masks
    mask = and_masks(generate_block_causal_mask(4), or_masks(generate_sliding_window(3), generate_prefix_lm_mask(2)))
    got = create_mask(mask, 1, 1, 20, 20, device="cpu")[0, 0]
    expected = dense(lambda q, kv: q // 4 >= kv // 4 and ((0 <= q - kv <= 3) or kv < 2 or q >= kv), 20, 20)
    assert got.equal(expected)
    trace_mod(mask, "mask_mod")


def test_block_diffusion_takes_attention_gyms_argument_order():
    """attention-gym's generate_block_diffusion_mask(seq_len, block_size): the same positional order and names, so
    code swapping its import gets the same mask (the order was the other way round, silently another mask)."""
    import inspect

    assert list(inspect.signature(generate_block_diffusion_mask).parameters) == ["seq_len", "block_size"]
    a = create_mask(generate_block_diffusion_mask(13, 4), 1, 1, 26, 26, device="cpu")[0, 0]
    b = create_mask(generate_block_diffusion_mask(block_size=4, seq_len=13), 1, 1, 26, 26, device="cpu")[0, 0]
    keep = dense_block_diffusion(4, 13)
    assert torch.equal(a, b) and torch.equal(a.cpu(), torch.tensor([[bool(keep(q, kv)) for kv in range(26)]
                                                                    for q in range(26)]))
