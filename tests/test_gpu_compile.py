"""The CUDA variant of the kernels compiles for Hopper (sm_90a) without a GPU.

Every other test runs the interpreter variant of the generated kernels, which never meets Triton's GPU compiler:
a template or lowering change that the interpreter accepts but the compiler rejects (a layout, a constexpr
condition, an op without a GPU lowering) would only show on the device. benchmarks/offline_compile.py compiles
through the real launch path with a stand-in driver (Triton's CUDA backend and ptxas ship in its wheel); here a
few forward and backward kernels go through it, with mods that exercise the paths that differ (dense walk, block
walk, gathers, hoisting, the score_mod's derivative, the warp-specialized forward and dK / dV kernels).

Each compile runs in a fresh Python process (:func:`_compiled`): Triton's interpreter patches triton.language while
it runs a kernel, and a compile in a process where earlier interpreted launches left a patch in place fails in the
front end (seen once in a parallel CI run), which says nothing about the kernel."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flexlite import create_block_mask
from flexlite.masks import causal_mask, generate_doc_mask_mod, generate_sliding_window
from flexlite.mods import generate_alibi_bias, generate_tanh_softcap
from flexlite.runtime import launch

_TOOL = Path(__file__).resolve().parent.parent / "benchmarks" / "offline_compile.py"


def _offline():
    spec = importlib.util.spec_from_file_location("offline_compile", _TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _count_rows_descriptors() -> dict:
    """From now on in this (fresh) process: per kernel name, the launch.RowsDescriptor arguments of its last launch."""
    counts = {}
    call = launch.CompiledLaunch.__call__

    def counting(self, grid, args):
        counts[self.kernel.fn.__name__] = sum(a.__class__ is launch.RowsDescriptor for a in args)
        return call(self, grid, args)
    launch.CompiledLaunch.__call__ = counting
    return counts


def _facts(kernel, offline, rows_descriptors: dict = None) -> dict:
    """What the tests check of a compiled kernel: its name, PTX markers and ptxas's report, and with
    ``rows_descriptors`` (:func:`_count_rows_descriptors`) its host descriptor parameters against the
    RowsDescriptors its launcher passes."""
    ptx = kernel.asm["ptx"]
    extra = {} if rows_descriptors is None else dict(
        descriptor_params=len(getattr(kernel.metadata, "tensordesc_meta", None) or ()),
        rows_descriptors=rows_descriptors.get(kernel.name))
    return dict(extra, name=kernel.name, report=offline.ptxas_report(ptx), shared=kernel.metadata.shared,
                llir_i1_vectors=kernel.asm["llir"].count("x i1>"),
                ptx={marker: marker in ptx for marker in ("wgmma", "wgmma.mma_async", "cp.async.bulk.tensor",
                                                          "mbarrier", "setmaxnreg", "tensormap.replace",
                                                          "cp.reduce.async.bulk.tensor", "st.global.v4",
                                                          "st.global.b32")})


def _compiled(kind: str, case: str) -> dict:
    """``_compile_<kind>(case)`` of this module, run in a fresh interpreter (with TRITON_INTERPRET=1, as the suite)."""
    code = (f"import json, sys; sys.path[:0] = [{str(Path(__file__).parent)!r}]; import test_gpu_compile as t; "
            f"print('FACTS ' + json.dumps(t._compile_{kind}({case!r})))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0, f"compiling {kind} {case!r} failed:\n{run.stderr[-4000:]}"
    return json.loads(next(line for line in run.stdout.splitlines() if line.startswith("FACTS "))[6:])


L = 256


def _masks():
    document = torch.arange(L) // 96
    return {"none": None, "causal": create_block_mask(causal_mask, None, None, L, L, device="cpu"),
            "document": create_block_mask(generate_doc_mask_mod(causal_mask, document), None, None, L, L,
                                          device="cpu"),
            "sliding window": create_block_mask(generate_sliding_window(300), None, None, L, L, device="cpu")}


# (score_mod, mask, head dim, tile (BLOCK_M, BLOCK_N, warps, stages), tensor descriptors, half partial tiles)
FORWARD = {
    "dense, softcap, descriptors": (generate_tanh_softcap(30.0, approx=True), "none", 64, (128, 128, 4, 3), True,
                                    False),
    "causal, ALiBi (hoisted gather)": (generate_alibi_bias(2), "causal", 128, (128, 64, 4, 2), False, False),
    "causal, half partial tiles": (None, "causal", 128, (128, 64, 4, 2), False, True),
    "document (mask gathers), D80": (None, "document", 80, (64, 64, 4, 3), False, False),
    "sliding window, mask terms decided per tile": (None, "sliding window", 64, (128, 128, 4, 3), True, False),
    "causal, its one mask term decided per tile": (None, "causal", 128, (128, 64, 4, 2), False, False),
}


def _compile_forward(case: str) -> dict:
    score_mod, mask, D, tile, tma, split = FORWARD[case]
    offline = _offline()
    facts = {}
    if "decided" in case:  # (launch.DECIDE_MASK_TERMS: the Triton forward too; a branch of -inf between the mask's
        # variants made Triton's software pipeliner fail there)
        from flexlite.api import _generate
        launch.DECIDE_MASK_TERMS = launch.DECIDE_MASK_TERMS | {"fwd.py.jinja"}
        source = _generate(score_mod, _masks()[mask], torch.device("cuda"), "fwd.py.jinja").source
        facts["source_decides"] = "mask_mod_decide(" in source
    return dict(_facts(offline.compile_forward(score_mod, _masks()[mask], D, tile, tma, L=L, split_partial=split),
                       offline), **facts)


@pytest.mark.parametrize("case", list(FORWARD))
def test_forward_compiles_for_sm90(case):
    facts = _compiled("forward", case)
    assert facts["name"] == "flex_fwd_kernel"
    assert facts["ptx"]["wgmma"]  # Hopper's matmul, not a fallback
    assert 0 < facts["report"]["regs"] <= 255 and facts["report"]["HGMMA"] > 0
    if "decided" in case:
        assert facts["source_decides"], case


def _compile_backward(case: str) -> dict:
    cfg = launch.BackwardTileConfig(64, 64, 64, 64, 4, 2)
    offline = _offline()
    kernels = offline.compile_backward(generate_alibi_bias(2), _masks()[case], 64, cfg, L=L)
    return {name: _facts(kernel, offline) for name, kernel in kernels.items()}


def test_backward_compiles_for_sm90():
    kernels = _compiled("backward", "causal")
    assert {"flex_bwd_dkdv_kernel", "flex_bwd_dq_kernel"} <= set(kernels)
    for name in ("flex_bwd_dkdv_kernel", "flex_bwd_dq_kernel"):
        report = kernels[name]["report"]
        assert 0 < report["regs"] <= 255 and report["HGMMA"] > 0, name


# the warp-specialized (Gluon) forward: (score_mod, mask, head dim, Lq, Lkv, (query heads, kv heads))
FORWARD_WS = {
    "dense, D128": (None, "none", 128, L, L, (2, 2)),
    "causal, GQA, D64": (None, "causal", 64, L, L, (4, 2)),
    "document (mask gathers), softcap, D128": (generate_tanh_softcap(30.0, approx=True), "document", 128, L, L,
                                               (2, 2)),
    "ALiBi (hoisted gather), ragged, D64": (generate_alibi_bias(2), "none", 64, 200, 333, (2, 2)),
    "causal, softcap with its factors folded, D128": (generate_tanh_softcap(30.0, approx=True), "causal", 128, L, L,
                                                      (2, 2)),
    "causal, max_scores stored, D128": (None, "causal", 128, L, L, (2, 2)),
    "document, key values on a compact vector, D64": (None, "document", 64, L, L, (2, 2)),
    "causal, ALiBi a separable bias, D128": (generate_alibi_bias(2), "causal", 128, L, L, (2, 2)),
    "causal, ALiBi affine in kv_idx, D64": (generate_alibi_bias(2), "causal", 64, L, L, (2, 2)),
    "sliding window, mask terms decided per tile, D64": (None, "sliding window", 64, L, L, (2, 2)),
    "causal, softcap folded, against its bound, D128": (generate_tanh_softcap(30.0, approx=True), "causal", 128, L,
                                                        L, (2, 2)),
    "document, LLVM at O0 against Triton's O3, D128": (None, "document", 128, L, L, (2, 2)),
    "causal, softcap folded against its cap, exp2 one in 8 on the FMA pipes (the default), D64": (
        generate_tanh_softcap(30.0, approx=True), "causal", 64, L, L, (2, 2)),
    "sliding window, two Q buffers in two warpgroups, D64": (None, "sliding window", 64, L, L, (2, 2)),
    "dense, wide items, D64": (None, "none", 64, L, L, (2, 2)),
    "causal, wide items, GQA, D64": (None, "causal", 64, L, L, (4, 2)),
}


def _compile_ws(case: str) -> dict:
    from flexlite.runtime import launch

    score_mod, mask, D, Lq, Lkv, heads = FORWARD_WS[case]
    offline = _offline()
    launch.FOLD_SCORE_SCALES = "folded" in case  # (a fresh process per compile)
    # (the other softcap cases keep the running max)
    launch.WS_FWD_BOUNDED_SOFTMAX = "bound" in case or "FMA pipes" in case
    # (the affine key side's loops measured without the branches of causal's decided mask term)
    if "affine" in case:
        launch.DECIDE_MASK_TERMS = frozenset()
    if "FMA pipes" in case:  # and the same kernel with every exponential on the SFU, compiled first
        assert launch.WS_FWD_POLY_EXP2_BOUNDED == {D: 8} and not launch.WS_FWD_POLY_EXP2
        launch.WS_FWD_POLY_EXP2_BOUNDED = {}
        sfu = offline.compile_forward_ws(score_mod, _masks()[mask], D, L=Lq, Lkv=Lkv, heads=heads)
        launch.WS_FWD_POLY_EXP2_BOUNDED = {D: 8}
    if "two Q buffers" in case:  # and the same kernel with one, compiled first
        one = offline.compile_forward_ws(score_mod, _masks()[mask], D, L=Lq, Lkv=Lkv, heads=heads)
        launch.WS_TILES = {**launch.WS_TILES, D: {**launch.WS_TILES[D], "Q_BUFFERS": 2}}
    rows = _count_rows_descriptors()
    kernel = offline.compile_forward_ws(score_mod, _masks()[mask], D, L=Lq, Lkv=Lkv, heads=heads,
                                        max_scores="max_scores" in case, wide="wide" in case)
    facts = {**_facts(kernel, offline, rows), "loops": offline.sass_loops(kernel),
             "stores": kernel.asm["ptx"].count("st.global"),
             "threads": int(re.search(r"\.reqntid (\d+)", kernel.asm["ptx"]).group(1)),
             "maxnreg": sorted({int(n) for n in re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+)",
                                                           kernel.asm["ptx"])})}
    if "FMA pipes" in case:
        facts["sfu_loops"] = offline.sass_loops(sfu)
    if "two Q buffers" in case:
        facts.update(one_loops=offline.sass_loops(one), one_shared=one.metadata.shared)
    if "max_scores" in case:  # and the same kernel without: what storing the maxima costs
        plain = offline.compile_forward_ws(score_mod, _masks()[mask], D, L=Lq, Lkv=Lkv, heads=heads)
        facts.update(plain_loops=offline.sass_loops(plain), plain_stores=plain.asm["ptx"].count("st.global"))
    if "key values" in case:  # and with mask_mod's gathers along the keys made in the tile's layout
        launch.WS_FWD_KEY_VALUES = False
        gathers = offline.compile_forward_ws(score_mod, _masks()[mask], D, L=Lq, Lkv=Lkv, heads=heads)
        facts.update(gather_loops=offline.sass_loops(gathers), ptx_lines=kernel.asm["ptx"].count("\n"),
                     gather_ptx_lines=gathers.asm["ptx"].count("\n"))
    if "bound" in case:  # and with the running row max
        launch.WS_FWD_BOUNDED_SOFTMAX = False
        facts["running_loops"] = offline.sass_loops(
            offline.compile_forward_ws(score_mod, _masks()[mask], D, L=Lq, Lkv=Lkv, heads=heads))
    if "LLVM" in case:  # and at Triton's own LLVM level
        launch.WS_FWD_LLVM_OPT_LEVELS = {}
        o3 = offline.compile_forward_ws(score_mod, _masks()[mask], D, L=Lq, Lkv=Lkv, heads=heads)
        facts.update(o3_loops=offline.sass_loops(o3), o3_llir_i1_vectors=o3.asm["llir"].count("x i1>"))
    if "decided" in case:  # and with the whole mask on every partial tile, and in wide items
        facts["wide_loops"] = offline.sass_loops(
            offline.compile_forward_ws(score_mod, _masks()[mask], D, L=Lq, Lkv=Lkv, heads=heads, wide=True))
        launch.DECIDE_REWRITE_TERMS = False
        facts["as_written_loops"] = offline.sass_loops(
            offline.compile_forward_ws(score_mod, _masks()[mask], D, L=Lq, Lkv=Lkv, heads=heads))
        launch.DECIDE_MASK_TERMS = frozenset()
        facts["whole_loops"] = offline.sass_loops(
            offline.compile_forward_ws(score_mod, _masks()[mask], D, L=Lq, Lkv=Lkv, heads=heads))
    if "affine" in case:  # and with its key side computed on the tile's columns
        launch.AFFINE_KEY_BIAS = frozenset()
        facts["column_loops"] = offline.sass_loops(
            offline.compile_forward_ws(score_mod, _masks()[mask], D, L=Lq, Lkv=Lkv, heads=heads))
    if "separable" in case:  # and with its key side on the tile's columns, and with the bias in every score
        launch.WS_FWD_COMPACT_BIAS_HEAD_DIMS = frozenset()
        column = offline.compile_forward_ws(score_mod, _masks()[mask], D, L=Lq, Lkv=Lkv, heads=heads)
        launch.SEPARATE_SCORE_BIAS = False
        whole = offline.compile_forward_ws(score_mod, _masks()[mask], D, L=Lq, Lkv=Lkv, heads=heads)
        facts.update(column_loops=offline.sass_loops(column), whole_loops=offline.sass_loops(whole))
    return facts


@pytest.mark.parametrize("case", list(FORWARD_WS))
def test_warp_specialized_forward_compiles_for_sm90(case):
    Lq, Lkv = FORWARD_WS[case][3:5]
    facts = _compiled("ws", case)
    assert facts["name"] == "flex_fwd_ws_kernel"
    ptx = facts["ptx"]
    # FA3's pieces: asynchronous wgmma, TMA copies into shared memory, mbarriers, and per-partition registers
    assert ptx["wgmma.mma_async"] and ptx["cp.async.bulk.tensor"] and ptx["mbarrier"] and ptx["setmaxnreg"]
    # descriptors: made on the host for contiguous inputs whose lengths are multiples of the tiles, else per
    # (z, head) on the device (tensormap.replace: the per-program set-up that host descriptors avoid)
    assert ptx["tensormap.replace"] == (Lq % 128 != 0 or Lkv % 128 != 0)
    # every host descriptor parameter gets a RowsDescriptor, so that a direct launch passes their kept tensor maps
    # (launch.CACHED_TENSOR_MAPS, NOTES 67): four with host descriptors, none without
    assert facts["descriptor_params"] == facts["rows_descriptors"] == (0 if ptx["tensormap.replace"] else 4), facts
    assert 0 < facts["report"]["regs"] <= 255 and facts["report"]["HGMMA"] > 0
    # its K / V ring (three stages at D128) and Q / OUT staging fit in what a Hopper block may have (227 KB)
    assert facts["shared"] <= 232448
    # launch.WS_FWD_WIDE_TILES: wide items run three consumer warpgroups of 160 registers, the producer the default
    # partition's warpgroup (512 threads); else two beside the producer's warp, padded to a warpgroup (Triton gives
    # the first consumer, the default partition, what the others leave)
    assert facts["threads"] == (512 if "wide" in case else 384), facts["threads"]
    assert (160 in facts["maxnreg"]) == ("wide" in case), facts["maxnreg"]
    if "wide" in case:
        # all three consumers are worker partitions with the same tile loops, none spilling (at LLVM O0 the first
        # consumer as the default partition spilled 14 registers a tile in causal's and the dense walk's loops, and
        # sliding window's and prefix-LM's kernels 200-208 bytes: NOTES 85); the kernel at most what the launch takes
        # (with Q's two buffers causal's spills 16 bytes, values of an item reloaded once per item: NOTES 89)
        assert len(facts["loops"]) >= 3 and not any(loop["STL"] for loop in facts["loops"]), facts["loops"]
        assert facts["report"]["spill_bytes"] <= launch.WS_FWD_WIDE_MAX_LOCAL, facts["report"]
    # P crosses the walk's iterations in fp32: carried as 16-bit values through its two loops it was split into
    # scalars and repacked with 33-64 PRMTs per tile and loop (benchmarks/NOTES.md 57)
    prmt = [loop["PRMT"] for loop in facts["loops"]]
    assert prmt and max(prmt) < 8, prmt
    if "max_scores" in case:
        # return_aux max_scores (launch.WS_FWD_MAX_SCORES): more stores; the consumers' tile loops unchanged, the
        # loops around whole items (the persistent grid's) a store and its address longer (22 instructions offline)
        assert facts["stores"] > facts["plain_stores"]
        growth = [a["instructions"] - b["instructions"] for a, b in zip(facts["loops"], facts["plain_loops"])]
        assert len(facts["loops"]) == len(facts["plain_loops"]) and growth.count(0) >= 4 and max(growth) <= 32, growth
    if "key values" in case:
        # launch.WS_FWD_KEY_VALUES: the document mask's gathers along the keys (document_id[kv_idx] and the start of
        # its document) once per partial tile on a compact vector, a key per thread, instead of each thread gathering
        # for its 32 columns: the partial-tile loops load less and are shorter, the full-tile loops (no mask_mod) as
        # they were, and the kernel smaller (at L 1024: 53 -> 37 global loads, 1372 -> 1207 instructions, PTX
        # 16.9k -> 13.7k lines; benchmarks/NOTES.md 61)
        loops, gathers = facts["loops"], facts["gather_loops"]
        assert len(loops) == len(gathers)
        partial = [i for i, loop in enumerate(gathers) if loop["LDG"] > 8]
        assert len(partial) == 2, gathers  # one per consumer warpgroup
        for i in partial:
            assert loops[i]["LDG"] < gathers[i]["LDG"] and loops[i]["instructions"] < gathers[i]["instructions"]
        for i in set(range(len(loops))) - set(partial):
            assert abs(loops[i]["instructions"] - gathers[i]["instructions"]) <= 12 and loops[i]["STL"] == 0
        assert facts["ptx_lines"] < 0.9 * facts["gather_ptx_lines"]
    if "bound" in case:
        # launch.WS_FWD_BOUNDED_SOFTMAX: softcap's scores are at most 30, so exp2 runs against that bound: per tile
        # no row max and no rescale (2 exponentials fewer per thread: the rescale's), and P's row sums by 8 more
        # wgmma instructions (P times ones) instead of the adds (full-tile loops 594 -> 394 instructions at L 256;
        # benchmarks/NOTES.md 64)
        loops, running = facts["loops"], facts["running_loops"]
        tiles = [i for i, loop in enumerate(running) if loop["MUFU"] == 130]  # tanh and exp2 per score, 2 rescales
        assert len(tiles) == 4 and len(loops) == len(running), running
        for i in tiles:
            assert loops[i]["MUFU"] == 128 and loops[i]["HGMMA"] == running[i]["HGMMA"] + 8, (loops[i], running[i])
            assert loops[i]["instructions"] < 0.85 * running[i]["instructions"], (loops[i], running[i])
    if "two Q buffers" in case:
        # launch.WS_TILES' Q_BUFFERS at D64 (one by default; NOTES 91): Q's second buffer (128 x 64 bf16) beside the
        # ring (and its two barriers), spilling nothing; the tile loops (64 exponentials a thread and 2 for the
        # rescale) an instruction longer at most, the loops around items a few (L 256: 5-33)
        assert 0 <= facts["shared"] - facts["one_shared"] - 128 * 64 * 2 <= 64, facts
        assert facts["report"]["spill_bytes"] == 0 and len(facts["loops"]) == len(facts["one_loops"])
        tiles = [(loop, one) for loop, one in zip(facts["loops"], facts["one_loops"]) if one["MUFU"] == 66]
        assert len(tiles) == 4 and all(loop["instructions"] - one["instructions"] <= 1 for loop, one in tiles), tiles
        assert all(loop["MUFU"] == one["MUFU"] and loop["STL"] == 0
                   for loop, one in zip(facts["loops"], facts["one_loops"])), facts["loops"]
    if "FMA pipes" in case:
        # launch.WS_FWD_POLY_EXP2_BOUNDED (D64: N = 8, NOTES 91): one of every 8 of P's exponentials by codegen.exp2's
        # polynomial: each tile loop (64 exponentials per thread at D64, and 64 tanh) has 8 MUFU ops fewer and ~8
        # instructions more per value moved (L 256: 65 more per tile loop), without spilling
        loops, sfu = facts["loops"], facts["sfu_loops"]
        tiles = [i for i, loop in enumerate(sfu) if loop["MUFU"] >= 128]
        assert len(loops) == len(sfu) and len(tiles) >= 4, sfu
        for i in tiles:
            assert loops[i]["MUFU"] == sfu[i]["MUFU"] - 8 and loops[i]["STL"] == 0, (loops[i], sfu[i])
            assert 50 <= loops[i]["instructions"] - sfu[i]["instructions"] <= 80, (loops[i], sfu[i])
    # launch.WS_FWD_LLVM_OPT_LEVELS (O0): no vector of compare results for the NVPTX backend to unpack bit by bit (the
    # dense walk at lengths not multiples of 128 compiles at Triton's O3 at D64, WS_FWD_DENSE_RAGGED_LLVM_OPT_LEVELS:
    # there ragged keys' compares may be)
    mask, D, Lq, Lkv = FORWARD_WS[case][1:5]
    if D in (launch.WS_FWD_LLVM_OPT_LEVELS if mask != "none" or launch.dense_lengths_even(Lq, Lkv)
             else launch.WS_FWD_DENSE_RAGGED_LLVM_OPT_LEVELS):
        assert facts["llir_i1_vectors"] == 0
    if "LLVM" in case:
        # at Triton's O3 the SLP vectorizer packs the partial tiles' mask compares into <64 x i1> vectors, unpacked
        # with shifts and logic ops (L 256, document: partial-tile loops ~1350 -> ~850 instructions at O0, full-tile
        # loops within a few; benchmarks/NOTES.md 65). Should a Triton no longer do that, the setting may go.
        loops, o3 = facts["loops"], facts["o3_loops"]
        assert facts["o3_llir_i1_vectors"] > 0 and len(loops) == len(o3), o3
        tiles = [i for i, loop in enumerate(o3) if loop["MUFU"] == 66]  # 64 exponentials and 2 rescales a tile
        partial = [i for i in tiles if o3[i]["ISETP"] >= 64]  # the mask's compares per score
        assert len(tiles) == 4 and len(partial) == 2, o3
        for i in partial:
            assert loops[i]["instructions"] < o3[i]["instructions"] - 150, (loops[i], o3[i])
        for i in set(tiles) - set(partial):
            assert abs(loops[i]["instructions"] - o3[i]["instructions"]) <= 12, (loops[i], o3[i])
    if "separable" in case:
        # launch.SEPARATE_SCORE_BIAS: ALiBi's bias taken at the item's first row, one FMA per score with the bias
        # along the keys, and the rest added to the LSE once per row; WS_FWD_COMPACT_BIAS_HEAD_DIMS: on full tiles
        # that bias computed on a compact key vector, partial ones' on the tile's columns beside the mask's key indices
        # (partial / full tile loops 930 / 798 instructions with the bias in every score, 838 / 703 separated, 838 /
        # 562 with the compact vector; benchmarks/NOTES.md 62)
        loops, column, whole = facts["loops"], facts["column_loops"], facts["whole_loops"]
        assert len(loops) == len(column) == len(whole)
        tiles = [i for i, loop in enumerate(whole) if loop["MUFU"] == 66]  # 64 exponentials and 2 rescales a tile
        partial = [i for i in tiles if whole[i]["ISETP"] >= 64]  # the causal compare per score
        assert len(tiles) == 4 and len(partial) == 2, whole
        for i in tiles:
            assert column[i]["instructions"] < whole[i]["instructions"] - 60, (column[i], whole[i])
        for i in set(tiles) - set(partial):
            assert loops[i]["instructions"] < column[i]["instructions"] - 100, (loops[i], column[i])
        for i in partial:
            assert abs(loops[i]["instructions"] - column[i]["instructions"]) <= 8, (loops[i], column[i])
    if "decided" in case:
        # launch.DECIDE_MASK_TERMS: the partial tiles' loops branch to the mask's variants (sliding window: its band
        # or its causality alone, or the whole mask), longer in code (L 2048: 879 -> ~1330 instructions, ~1170 with
        # launch.DECIDE_REWRITE_TERMS' band at one compare per score, NOTES 94) though a tile runs one branch, and
        # spill nothing; the full-tile loops as they were; in wide items (three warpgroups
        # at 160 registers, where the branches spilled) the loops are the whole mask's (DECIDE off there: NOTES 87;
        # there the decided terms only skip a walk's first tiles, launch.WS_FWD_SKIP_EMPTY_LEAD, with which sliding
        # window's wide kernel spilled 108 bytes at L 1024: the launch then takes two warpgroups, as sliding
        # window's work ratio does anyway)
        loops, whole, wide = facts["loops"], facts["whole_loops"], facts["wide_loops"]
        assert facts["report"]["spill_bytes"] == 0 and len(loops) == len(whole), (facts["report"], whole)
        partial = [i for i, loop in enumerate(whole) if loop["MUFU"] >= 60 and loop["ISETP"] >= 128]
        assert len(partial) == 2, whole
        for i, (loop, before) in enumerate(zip(loops, whole)):
            grew = loop["instructions"] - before["instructions"]
            assert grew > 200 if i in partial else abs(grew) <= 12, (loop, before)
        # the variants' kept terms as written: the band's subtract and abs per score on the edge tile
        as_written = facts["as_written_loops"]
        assert all(as_written[i]["instructions"] > loops[i]["instructions"] + 100 for i in partial), (as_written, loops)
        wide_partial = [loop["instructions"] for loop in wide if loop["MUFU"] >= 60 and loop["ISETP"] >= 128]
        assert len(wide_partial) == 3, wide
        assert all(abs(n - whole[partial[0]]["instructions"]) <= 12 for n in wide_partial), (wide, whole)
    if "affine" in case:
        # launch.AFFINE_KEY_BIAS, WS_FWD_AFFINE_BIAS_HEAD_DIMS: ALiBi's key side, affine in kv_idx, as a vector of the
        # tile's columns computed once per item and held in registers, plus one scalar per tile in the row max: no
        # index, conversion or multiply per column in the tile loops (L 1024: full-tile loops 654 -> 505
        # instructions, partial ones 784 -> 666; benchmarks/NOTES.md 86), no spill stores in them
        loops, column = facts["loops"], facts["column_loops"]
        tiles = [i for i, loop in enumerate(column) if loop["MUFU"] == 66]  # 64 exponentials and 2 rescales a tile
        assert len(tiles) == 4 and len(loops) == len(column), column
        for i in tiles:
            assert loops[i]["instructions"] < column[i]["instructions"] - 100 and loops[i]["STL"] == 0, \
                (loops[i], column[i])


# the warp-specialized (Gluon) dK / dV kernel: (score_mod, mask, head dim, (query heads, kv heads), options of
# offline_compile.compile_backward_ws: dQ added by it (fused_dq, launch.WS_BWD_FUSED_DQ: the two warpgroups split dQ's
# columns at D128, not at D64) or by the dQ kernel, a persistent grid (launch.WS_BWD_PERSISTENT), mask_mod's values
# along the queries on a compact vector (launch.WS_BWD_QUERY_VALUES), the backward templates that leave out the mask
# terms a partial tile decides (launch.DECIDE_MASK_TERMS: none by default; that kernel spills nothing))
BACKWARD_WS = {
    "causal, softcap (its derivative), D128": (generate_tanh_softcap(30.0, approx=True), "causal", 128, (2, 2), {}),
    "dense, GQA, D64": (None, "none", 64, (4, 2), {}),
    "document (mask gathers), ALiBi (hoisted gather), D128": (generate_alibi_bias(2), "document", 128, (2, 1), {}),
    "causal, D128, dQ kernel": (None, "causal", 128, (2, 2), {"fused_dq": False}),
    "document, D128, persistent grid, query values": (None, "document", 128, (2, 1),
                                                      {"persistent": True, "query_values": True}),
    "sliding window, softcap, D128, mask terms decided per tile": (
        generate_tanh_softcap(30.0, approx=True), "sliding window", 128, (2, 2),
        {"decide_mask_terms": ("bwd.py.jinja", "bwd_ws.py.jinja")}),
}


def _compile_backward_ws(case: str) -> dict:
    score_mod, mask, D, heads, options = BACKWARD_WS[case]
    offline = _offline()
    rows = _count_rows_descriptors()
    kernels = offline.compile_backward_ws(score_mod, _masks()[mask], D, L=L, heads=heads, **options)
    return {name: _facts(kernel, offline, rows) for name, kernel in kernels.items()}


@pytest.mark.parametrize("case", list(BACKWARD_WS))
def test_warp_specialized_backward_compiles_for_sm90(case):
    fused_dq = BACKWARD_WS[case][4].get("fused_dq", True)
    kernels = _compiled("backward_ws", case)
    # the preprocess kernel is the Triton one, dK / dV (and dQ, added into an fp32 buffer by TMA reduce-adds) the
    # Gluon kernel, or else the Triton dQ kernel
    assert set(kernels) == {"flex_bwd_preprocess_kernel", "flex_bwd_ws_dkdv_kernel"} | (
        set() if fused_dq else {"flex_bwd_dq_kernel"})
    facts = kernels["flex_bwd_ws_dkdv_kernel"]
    ptx = facts["ptx"]
    assert ptx["wgmma.mma_async"] and ptx["cp.async.bulk.tensor"] and ptx["mbarrier"] and ptx["setmaxnreg"]
    assert ptx["cp.reduce.async.bulk.tensor"] == fused_dq
    assert not ptx["tensormap.replace"]  # its descriptors are always made on the host
    # Q, K, V, dO and the dQ buffer (Q's again where the dQ kernel runs), each a RowsDescriptor (NOTES 67)
    assert facts["descriptor_params"] == facts["rows_descriptors"] == 5, facts
    # dK / dV stored in 16-byte vectors, a warp writing whole rows (bws_store_rows): not in 4-byte pieces straight from
    # the accumulator's layout, which cost 2-3 tiles' time per key block (NOTES 52)
    assert ptx["st.global.v4"] and not ptx["st.global.b32"]
    assert 0 < facts["report"]["regs"] <= 255 and facts["report"]["HGMMA"] > 0
    assert facts["shared"] <= 232448
    # launch.WS_BWD_LLVM_OPT_LEVELS: at D128 LLVM at O0, no vector of compare results to unpack bit by bit (and no
    # spills in the tile loops, which O3 had: NOTES 65)
    if BACKWARD_WS[case][2] == 128:
        assert facts["llir_i1_vectors"] == 0, facts
    if "decide_mask_terms" in BACKWARD_WS[case][4]:
        assert not facts["report"]["spill_bytes"], facts["report"]


# a kernel compiled at one length runs at another: lengths whose block counts differ in divisibility by 16 (2 and 16
# blocks of 128) reuse the compiled kernel (the block mask's strides are not specialized: common.py.jinja)
LENGTHS = {
    "forward, warp-specialized, D128": lambda offline, bm, n: offline.compile_forward_ws(None, bm, 128, L=n),
    "forward, D64": lambda offline, bm, n: offline.compile_forward(None, bm, 64, (128, 128, 4, 3), False, L=n),
    "backward, warp-specialized, D128": lambda offline, bm, n: offline.compile_backward_ws(None, bm, 128, L=n),
    "backward, D64": lambda offline, bm, n: offline.compile_backward(None, bm, 64,
                                                                    launch.BackwardTileConfig(64, 64, 64, 32, 4, 3),
                                                                    L=n),
}


def _compile_lengths(case: str) -> dict:
    offline = _offline()
    compiled = {}
    for n in (256, 2048):
        got = LENGTHS[case](offline, create_block_mask(causal_mask, None, None, n, n, device="cpu"), n)
        for name, kernel in (got.items() if isinstance(got, dict) else [(got.name, got)]):
            compiled.setdefault(name, []).append(id(kernel))
    return {name: ids[0] == ids[1] for name, ids in compiled.items()}


@pytest.mark.parametrize("case", list(LENGTHS))
def test_a_kernel_compiled_at_one_length_runs_at_another(case):
    reused = _compiled("lengths", case)
    assert reused and all(reused.values()), reused


def _probe(name: str):
    """benchmarks/<name>.py as a module."""
    spec = importlib.util.spec_from_file_location(name, _TOOL.parent / f"{name}.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    return probe


def _compile_stamped(case: str) -> dict:
    import tempfile

    kind, grid = case.split(", ")
    probe = _probe(f"probe_{kind}_phases")
    offline = _offline()
    template = f"{kind}_ws.py.jinja"
    warpgroups = 3 if grid == "wide items" else 2
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / template
        path.write_text(probe.stamped_template(1 << 40, *[warpgroups] * (kind == "fwd")))
        with probe.templates_from({template: str(path)}):
            persistent = grid != "per key block" and grid != "per q block"
            if kind == "bwd":
                kernel = offline.compile_backward_ws(None, _masks()["causal"], 128, L=L, persistent=persistent)
                kernel = kernel["flex_bwd_ws_dkdv_kernel"]
            else:
                kernel = offline.compile_forward_ws(None, _masks()["causal"], 64 if warpgroups == 3 else 128, L=L,
                                                    persistent=persistent, wide=warpgroups == 3)
    return {"stamps": kernel.asm["ptx"].count("%clock64"), "fields": len(probe.FIELDS), "warpgroups": warpgroups}


@pytest.mark.parametrize("case", ["bwd, per key block", "bwd, persistent", "fwd, per q block", "fwd, persistent",
                                  "fwd, wide items"])
def test_the_phase_probes_still_find_their_insertion_points(case):
    # benchmarks/probe_bwd_phases.py and probe_fwd_phases.py insert clock stamps into bwd_ws.py.jinja / fwd_ws.py.jinja
    # after lines they find by their text: a template change that moves them fails here, not on the GPU (with --wide
    # the forward's 192-row items at D64, three consumer warpgroups, whose OUT is stored in its own branch)
    facts = _compiled("stamped", case)
    assert facts["stamps"] >= facts["warpgroups"] * facts["fields"]  # each field stamped in every consumer


def _compile_bounds(variant: str) -> dict:
    import tempfile

    probe = _probe("probe_fwd_bounds")
    offline = _offline()
    D = 128 if variant == "noturn" else 64  # (no turns at D64 in the package either)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / probe.TEMPLATE
        path.write_text(probe.variant_source(variant))
        with probe.templates_from({probe.TEMPLATE: str(path)}):
            kernel = offline.compile_forward_ws(None, None, D, L=L)
    facts = {}
    for label, ptx in (("", kernel.asm["ptx"]), ("base_", offline.compile_forward_ws(None, None, D, L=L).asm["ptx"])):
        report = offline.ptxas_report(ptx)
        facts.update({label + "MUFU": report["MUFU"], label + "HGMMA": report["HGMMA"],
                      label + "waits": ptx.count("mbarrier.try_wait"), label + "spill_bytes": report["spill_bytes"]})
    return facts


@pytest.mark.parametrize("variant", ["noexp", "nosoftmax", "nopv", "noturn", "sonly", "pvonly"])
def test_the_bounds_probes_variants_still_find_their_lines_and_compile(variant):
    # benchmarks/probe_fwd_bounds.py takes parts out of fwd_ws.py.jinja by replacing lines it finds by their text: a
    # template change that moves them fails here (variant_source raises), not on the GPU; what each takes out is gone
    facts = _compiled("bounds", variant)
    assert facts["spill_bytes"] == 0
    if variant in ("noexp", "nosoftmax", "sonly", "pvonly"):
        assert facts["MUFU"] < facts["base_MUFU"]
    if variant in ("nopv", "sonly", "pvonly"):
        assert facts["HGMMA"] < facts["base_HGMMA"]
    if variant == "noturn":
        assert facts["waits"] < facts["base_waits"]


def _compile_float_gate(cast: str) -> dict:
    # the Triton backward of a mask joining a float table's compare to causality by & (lower._compare's int8 casts,
    # or the plain compares where ``cast`` is "plain")
    from flexlite.codegen import lower
    if cast == "plain":
        for key, op in (("eq", "=="), ("ne", "!="), ("lt", "<"), ("le", "<="), ("gt", ">"), ("ge", ">=")):
            lower.OPS[key] = lower._binary(op)
    offline = _offline()
    gate = torch.tensor([0.3, -0.6])

    def mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (gate[h] > 0) | (q_idx == kv_idx)
    kernels = offline.compile_backward(None, create_block_mask(mask, None, 2, L, L, device="cpu"), 64,
                                       launch.BackwardTileConfig(64, 64, 64, 64, num_warps=4, num_stages=2))
    from flexlite.codegen.kernel import generate_backward
    return {"loops": {name: [loop["instructions"] for loop in offline.sass_loops(k)] for name, k in kernels.items()},
            "casts": "to(tl.int8)" in generate_backward(None, mask, interpret=False).source}


def test_float_compares_casts_fold_away_when_compiled():
    """lower._compare takes a float compare through int8 and back for Triton's interpreter (CPU); compiled for sm_90a
    the backward's tile loops come out as long as with the plain compare."""
    with_casts, plain = _compiled("float_gate", "cast"), _compiled("float_gate", "plain")
    assert with_casts["casts"] and not plain["casts"]
    loops = with_casts["loops"]
    assert loops == plain["loops"] and loops["flex_bwd_dkdv_kernel"] and loops["flex_bwd_dq_kernel"], (loops, plain)
