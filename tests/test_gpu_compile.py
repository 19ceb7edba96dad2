"""The CUDA variant of the kernels compiles for Hopper (sm_90a) without a GPU.

Every other test runs the interpreter variant of the generated kernels, which never meets Triton's GPU compiler:
a template or lowering change that the interpreter accepts but the compiler rejects (a layout, a constexpr
condition, an op without a GPU lowering) would only show on the device. benchmarks/offline_compile.py compiles
through the real launch path with a stand-in driver (Triton's CUDA backend and ptxas ship in its wheel); here a
few forward and backward kernels go through it, with mods that exercise the paths that differ (dense walk, block
walk, gathers, hoisting, the score_mod's derivative)."""

import importlib.util
from pathlib import Path

import pytest
import torch

from flexlite import create_block_mask
from flexlite.masks import causal_mask, generate_doc_mask_mod
from flexlite.mods import generate_alibi_bias, generate_tanh_softcap
from flexlite.runtime import launch

_TOOL = Path(__file__).resolve().parent.parent / "benchmarks" / "offline_compile.py"


@pytest.fixture(scope="module")
def offline():
    spec = importlib.util.spec_from_file_location("offline_compile", _TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


L = 256


def _masks():
    document = torch.arange(L) // 96
    return {"none": None, "causal": create_block_mask(causal_mask, None, None, L, L, device="cpu"),
            "document": create_block_mask(generate_doc_mask_mod(causal_mask, document), None, None, L, L,
                                          device="cpu")}


# (score_mod, mask, head dim, tile (BLOCK_M, BLOCK_N, warps, stages), tensor descriptors, half partial tiles)
FORWARD = {
    "dense, softcap, descriptors": (generate_tanh_softcap(30.0, approx=True), "none", 64, (128, 128, 4, 3), True,
                                    False),
    "causal, ALiBi (hoisted gather)": (generate_alibi_bias(2), "causal", 128, (128, 64, 4, 2), False, False),
    "causal, half partial tiles": (None, "causal", 128, (128, 64, 4, 2), False, True),
    "document (mask gathers), D80": (None, "document", 80, (64, 64, 4, 3), False, False),
}


@pytest.mark.parametrize("case", list(FORWARD))
def test_forward_compiles_for_sm90(offline, case):
    score_mod, mask, D, tile, tma, split = FORWARD[case]
    kernel = offline.compile_forward(score_mod, _masks()[mask], D, tile, tma, L=L, split_partial=split)
    assert kernel.name == "flex_fwd_kernel"
    assert "wgmma" in kernel.asm["ptx"]  # Hopper's matmul, not a fallback
    report = offline.ptxas_report(kernel.asm["ptx"])
    assert 0 < report["regs"] <= 255 and report["HGMMA"] > 0


def test_backward_compiles_for_sm90(offline):
    cfg = launch.BackwardTileConfig(64, 64, 64, 64, 4, 2)
    kernels = offline.compile_backward(generate_alibi_bias(2), _masks()["causal"], 64, cfg, L=L)
    assert {"flex_bwd_dkdv_kernel", "flex_bwd_dq_kernel"} <= set(kernels)
    for name in ("flex_bwd_dkdv_kernel", "flex_bwd_dq_kernel"):
        report = offline.ptxas_report(kernels[name].asm["ptx"])
        assert 0 < report["regs"] <= 255 and report["HGMMA"] > 0, name


# the warp-specialized (Gluon) forward: (score_mod, mask, head dim, Lq, Lkv, (query heads, kv heads))
FORWARD_WS = {
    "dense, D128": (None, "none", 128, L, L, (2, 2)),
    "causal, GQA, D64": (None, "causal", 64, L, L, (4, 2)),
    "document (mask gathers), softcap, D128": (generate_tanh_softcap(30.0, approx=True), "document", 128, L, L,
                                               (2, 2)),
    "ALiBi (hoisted gather), ragged, D64": (generate_alibi_bias(2), "none", 64, 200, 333, (2, 2)),
}


@pytest.mark.parametrize("case", list(FORWARD_WS))
def test_warp_specialized_forward_compiles_for_sm90(offline, case):
    score_mod, mask, D, Lq, Lkv, heads = FORWARD_WS[case]
    kernel = offline.compile_forward_ws(score_mod, _masks()[mask], D, L=Lq, Lkv=Lkv, heads=heads)
    assert kernel.name == "flex_fwd_ws_kernel"
    ptx = kernel.asm["ptx"]
    # FA3's pieces: asynchronous wgmma, TMA copies into shared memory, mbarriers, and per-partition registers
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx and "mbarrier" in ptx
    assert "setmaxnreg" in ptx
    # descriptors: made on the host for contiguous inputs whose lengths are multiples of the tiles, else per
    # (z, head) on the device (tensormap.replace: the per-program set-up that host descriptors avoid)
    assert ("tensormap.replace" in ptx) == (Lq % 128 != 0 or Lkv % 128 != 0)
    report = offline.ptxas_report(ptx)
    assert 0 < report["regs"] <= 255 and report["HGMMA"] > 0
