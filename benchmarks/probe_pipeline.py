"""GPU probe: does issuing the next tile's Q·Kᵀ before the current tile's softmax (FA3's intra-warpgroup overlap,
written as a software-pipelined loop) let the tensor cores run under the softmax in Triton 3.6?

Standalone forward kernels (no mods, no mask, even lengths, K / V through tensor descriptors) in two loop forms:
``plain`` (the form flexlite's dense walk has: Q·Kᵀ, softmax, P·V per tile) and ``pipelined`` (Q·Kᵀ of tile j+1
issued, then the softmax and P·V of tile j). Each variant is checked against SDPA's math backend in fp32, then
timed at the harness shapes; the number of ``warp_group_dot_wait`` ops and their pending counts in the TTGIR show
where Triton waits on the asynchronous matmuls. Prints a table; benchmarks/NOTES.md (30) records what it showed.

``--rows``: the plain loop only, over query tiles of 64 to 256 rows (256 rows in 8 warps: two warpgroups of 128 rows
sharing each K / V tile, one program per SM).

Usage: python benchmarks/probe_pipeline.py [--rows]"""

import re
import sys

import torch
import triton
import triton.language as tl
from tabulate import tabulate

from flexlite.bench import _median_ms


@triton.jit
def _softmax_pv(qk, acc, l_i, m_i, v, qk_scale):
    m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
    alpha = tl.math.exp2(m_i - m_ij)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_ij


@triton.jit
def _fwd(Q, K, V, O, L, sm_scale, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
         PIPELINED: tl.constexpr):
    i_m = tl.program_id(0)
    i_zh = tl.program_id(1)
    base = i_zh.to(tl.int64) * L * D
    desc_k = tl.make_tensor_descriptor(K + base, shape=[L, D], strides=[D, 1], block_shape=[BLOCK_N, D])
    desc_v = tl.make_tensor_descriptor(V + base, shape=[L, D], strides=[D, 1], block_shape=[BLOCK_N, D])
    offs_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + base + offs_m[:, None] * D + offs_d[None, :])
    qk_scale = sm_scale * 1.4426950408889634
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    if PIPELINED:
        qk = tl.dot(q, tl.trans(desc_k.load([0, 0])))
        for start_n in range(BLOCK_N, L, BLOCK_N):
            qk_next = tl.dot(q, tl.trans(desc_k.load([start_n, 0])))
            acc, l_i, m_i = _softmax_pv(qk, acc, l_i, m_i, desc_v.load([start_n - BLOCK_N, 0]), qk_scale)
            qk = qk_next
        acc, l_i, m_i = _softmax_pv(qk, acc, l_i, m_i, desc_v.load([L - BLOCK_N, 0]), qk_scale)
    else:
        for start_n in range(0, L, BLOCK_N):
            qk = tl.dot(q, tl.trans(desc_k.load([start_n, 0])))
            acc, l_i, m_i = _softmax_pv(qk, acc, l_i, m_i, desc_v.load([start_n, 0]), qk_scale)
    acc = acc / l_i[:, None]
    tl.store(O + base + offs_m[:, None] * D + offs_d[None, :], acc.to(O.dtype.element_ty))


def _alloc(size, align, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def run(q, k, v, tile, pipelined, o=None):
    BM, BN, w, s = tile
    B, H, L, D = q.shape
    o = torch.full_like(q, float("nan")) if o is None else o
    kern = _fwd[(L // BM, B * H)](q, k, v, o, L, D ** -0.5, D, BM, BN, pipelined, num_warps=w, num_stages=s)
    return o, kern


def main():
    triton.set_allocator(_alloc)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    rows = []
    sweep = "--rows" in sys.argv
    shapes = [((4, 16, 8192, 128), [(128, 64, 4, 2), (128, 64, 8, 2), (128, 128, 8, 2)]),
              ((16, 16, 8192, 64), [(128, 128, 4, 3), (128, 64, 4, 3), (128, 128, 8, 2)])]
    if sweep:
        shapes = [((4, 16, 8192, 128), [(128, 64, 4, 2), (64, 64, 4, 3), (64, 128, 4, 2), (256, 64, 8, 2),
                                        (256, 64, 8, 3), (256, 128, 8, 2)]),
                  ((16, 16, 8192, 64), [(128, 64, 4, 3), (128, 128, 4, 3), (64, 128, 4, 3), (256, 64, 8, 3),
                                        (256, 128, 8, 2), (256, 128, 8, 3)])]
    for (B, H, L, D), tiles in shapes:
        g = torch.Generator(device="cuda").manual_seed(0)
        qs, ks, vs = [torch.randn(1, 2, 1024, D, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3)]
        with sdpa_kernel(SDPBackend.MATH):
            ref = torch.nn.functional.scaled_dot_product_attention(qs.float(), ks.float(), vs.float())
        q, k, v = [torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cudnn = _median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
        flops = 4 * B * H * L * L * D
        rows.append(["cuDNN", f"D{D}", "", "", round(cudnn, 3), round(flops / cudnn / 1e9), ""])
        for tile in tiles:
            base = None
            for pipelined in (False,) if sweep else (False, True):
                label = "pipelined" if pipelined else "plain"
                try:
                    out, kern = run(qs, ks, vs, tile, pipelined)
                    err = float((out.float() - ref).abs().max())
                    waits = re.findall(r"warp_group_dot_wait.*?pendings = (\d+)", kern.asm["ttgir"])
                    o = torch.empty_like(q)
                    ms = _median_ms(lambda: run(q, k, v, tile, pipelined, o))
                    base = base or ms
                    row = [label, f"D{D}", "{}x{} {}w {}s".format(*tile), f"{err:.1e}", round(ms, 3),
                           round(flops / ms / 1e9), f"{base / ms:.3f}x plain; waits {','.join(waits)}"]
                except Exception as e:  # noqa: BLE001 - a variant that fails to compile is a finding
                    row = [label, f"D{D}", "{}x{} {}w {}s".format(*tile), f"{type(e).__name__}: {str(e)[:80]}",
                           "", "", ""]
                print(row, flush=True)
                rows.append(row)
    print(tabulate(rows, headers=["loop", "D", "tile", "max err vs fp32", "fwd ms", "TFLOP/s", "notes"],
                   tablefmt="github"))


if __name__ == "__main__":
    main()
