"""GPU probe: share the softmax's exponentials between the SFU and the FMA pipes (FA4's trick).

On Hopper the SFU (MUFU) gives 16 results per clock per SM. At D64 one exp2 per score already takes as long as the
score's two matmuls, and tanh softcap adds a second SFU op per score, so softcap's forward is SFU-bound (NOTES 12,
20). Here half of each kv tile's exponentials are computed by a degree-3 polynomial on the FMA pipes
(``exp2_poly``: round to an integer with the 1.5·2²³ trick, a polynomial for the fraction, the integer added as
a power of two; max relative error 7.5e-5, below bf16's P rounding).

Standalone forward kernels (no mask, even lengths, K / V through tensor descriptors), each with and without a
tanh softcap of 30, in three forms: ``mufu`` (every exp2 on the SFU), ``halves`` (the kv tile as two half tiles,
two Q·Kᵀ and two P·V matmuls, the second half's exp2 by polynomial) and ``pairs`` (one tile, its columns split in
pairs by reshape, the odd columns by polynomial; the TTGIR's convert_layout count shows whether that moves data).
With the softcap, two more: ``bounded`` (every score is at most 30, so exp2 is taken against that constant: no
running max, no rescaling of the accumulator) and ``bounded, l of rounded P`` (the same, with the row sum taken
over the bf16-rounded weights that P·V multiplies).
Each is checked against an fp64 reference first (inputs randn and 3 randn), then timed at the harness shapes. Prints a table;
benchmarks/NOTES.md (31, 32) records what it showed.

Usage: python benchmarks/probe_exp2.py"""


import torch
import triton
import triton.language as tl
from tabulate import tabulate

from flexlite.bench import _median_ms


@triton.jit
def exp2_poly(x):
    # 2**x on the FMA pipes: x = j + f with j = round(x), f in [-0.5, 0.5]; 2**f by a degree-3 minimax polynomial
    # (relative error 7.5e-5); 2**j built in the exponent bits. x <= -127 gives exactly 0 (a zero scale), NaN stays
    # NaN (the max propagates it, the product keeps it).
    x = tl.maximum(x, -127.0, propagate_nan=tl.PropagateNan.ALL)
    j = x + 12582912.0  # 1.5 * 2**23: the add rounds x to an integer held in the low mantissa bits
    f = x - (j - 12582912.0)
    p = tl.fma(tl.fma(tl.fma(0.055171342699102, f, 0.24261034141575366), f, 0.6932609672206903), f,
               0.9999281213111199)
    scale = ((j.to(tl.int32, bitcast=True) << 23) + 0x3F800000).to(tl.float32, bitcast=True)
    return p * scale


@triton.jit
def _scores(q, desc_k, start_n, qk_scale, SOFTCAP: tl.constexpr):
    qk = tl.dot(q, tl.trans(desc_k.load([start_n, 0])))
    if SOFTCAP:
        t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [qk * (qk_scale / 30.0)],
                                      dtype=tl.float32, is_pure=True, pack=1)
        qk = t * (30.0 * 1.4426950408889634)
    else:
        qk = qk * (qk_scale * 1.4426950408889634)
    return qk


@triton.jit
def _fwd(Q, K, V, O, L, sm_scale, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
         MODE: tl.constexpr, SOFTCAP: tl.constexpr):
    i_m = tl.program_id(0)
    i_zh = tl.program_id(1)
    base = i_zh.to(tl.int64) * L * D
    HALF: tl.constexpr = BLOCK_N // 2
    TILE: tl.constexpr = HALF if MODE == 1 else BLOCK_N
    desc_k = tl.make_tensor_descriptor(K + base, shape=[L, D], strides=[D, 1], block_shape=[TILE, D])
    desc_v = tl.make_tensor_descriptor(V + base, shape=[L, D], strides=[D, 1], block_shape=[TILE, D])
    offs_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + base + offs_m[:, None] * D + offs_d[None, :])
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    for start_n in range(0, L, BLOCK_N):
        if MODE == 1:
            qa = _scores(q, desc_k, start_n, sm_scale, SOFTCAP)
            qb = _scores(q, desc_k, start_n + HALF, sm_scale, SOFTCAP)
            m_ij = tl.maximum(m_i, tl.maximum(tl.max(qa, 1), tl.max(qb, 1)))
            pa = tl.math.exp2(qa - m_ij[:, None])
            pb = exp2_poly(qb - m_ij[:, None])
            alpha = tl.math.exp2(m_i - m_ij)
            l_i = l_i * alpha + tl.sum(pa, 1) + tl.sum(pb, 1)
            acc = acc * alpha[:, None]
            acc = tl.dot(pa.to(Q.dtype.element_ty), desc_v.load([start_n, 0]), acc)
            acc = tl.dot(pb.to(Q.dtype.element_ty), desc_v.load([start_n + HALF, 0]), acc)
        else:
            qk = _scores(q, desc_k, start_n, sm_scale, SOFTCAP)
            if MODE >= 3:
                # tanh softcap bounds every score by 30: no running max, no rescale (probe only, SOFTCAP=True)
                m_ij = m_i
                x = qk - 30.0 * 1.4426950408889634
            else:
                m_ij = tl.maximum(m_i, tl.max(qk, 1))
                x = qk - m_ij[:, None]
            if MODE == 2:
                xa, xb = tl.split(tl.reshape(x, [BLOCK_M, HALF, 2]))
                p = tl.reshape(tl.join(tl.math.exp2(xa), exp2_poly(xb)), [BLOCK_M, BLOCK_N])
            else:
                p = tl.math.exp2(x)
            if MODE == 3:
                l_i += tl.sum(p, 1)
            elif MODE == 4:
                # the row sum of the rounded weights that P·V multiplies: they cancel in acc / l
                p = p.to(Q.dtype.element_ty)
                l_i += tl.sum(p.to(tl.float32), 1)
            else:
                alpha = tl.math.exp2(m_i - m_ij)
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None]
            acc = tl.dot(p.to(Q.dtype.element_ty), desc_v.load([start_n, 0]), acc)
        m_i = m_ij
    acc = acc / l_i[:, None]
    tl.store(O + base + offs_m[:, None] * D + offs_d[None, :], acc.to(O.dtype.element_ty))


MODES = {"mufu": 0, "halves": 1, "pairs": 2, "bounded": 3, "bounded, l of rounded P": 4}


def run(q, k, v, tile, mode, softcap, o=None):
    BM, BN, w, s = tile
    B, H, L, D = q.shape
    o = torch.full_like(q, float("nan")) if o is None else o
    kern = _fwd[(L // BM, B * H)](q, k, v, o, L, D ** -0.5, D, BM, BN, MODES[mode], softcap, num_warps=w,
                                  num_stages=s)
    return o, kern


def _reference(q, k, v, softcap):
    s = (q.double() @ k.double().transpose(-1, -2)) * q.shape[-1] ** -0.5
    if softcap:
        s = 30.0 * torch.tanh(s / 30.0)
    return torch.softmax(s, -1) @ v.double()


def main():
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    rows = []
    for (B, H, L, D), tiles in [((4, 16, 8192, 128), [(128, 64, 4, 2), (128, 128, 8, 2)]),
                                ((16, 16, 8192, 64), [(128, 128, 4, 3), (128, 64, 4, 3)])]:
        g = torch.Generator(device="cuda").manual_seed(0)
        small = [torch.randn(1, 2, 1024, D, device="cuda", generator=g) for _ in range(3)]
        inputs = {scale: [(scale * t).to(torch.bfloat16) for t in small] for scale in (1, 3)}
        q, k, v = [torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        flops = 4 * B * H * L * L * D
        for softcap in (False, True):
            refs = {scale: _reference(*inputs[scale], softcap) for scale in inputs}
            for tile in tiles:
                base = None
                for mode in [m for m in MODES if softcap or MODES[m] < 3]:
                    name = "{}x{} {}w {}s".format(*tile)
                    try:
                        errs = []
                        for scale, (qs, ks, vs) in inputs.items():
                            out, kern = run(qs, ks, vs, tile, mode, softcap)
                            errs.append(float((out.double() - refs[scale]).abs().max()))
                        err = " / ".join(f"{e:.1e}" for e in errs)
                        converts = kern.asm["ttgir"].count("convert_layout")
                        spills = kern.n_spills
                        o = torch.empty_like(q)
                        ms = _median_ms(lambda: run(q, k, v, tile, mode, softcap, o))
                        base = base or ms
                        row = [mode, "softcap" if softcap else "plain", f"D{D}", name, err, round(ms, 3),
                               round(flops / ms / 1e9), f"{base / ms:.3f}", f"{converts} cvt, {spills} spills"]
                    except Exception as e:  # noqa: BLE001 - a variant that fails to compile is a finding
                        row = [mode, "softcap" if softcap else "plain", f"D{D}", name,
                               f"{type(e).__name__}: {str(e)[:80]}", "", "", "", ""]
                    print(row, flush=True)
                    rows.append(row)
    print(tabulate(rows, headers=["exp2", "mod", "D", "tile", "max err vs fp64 (inputs randn, 3 randn)", "fwd ms",
                                  "TFLOP/s",
                                  "speedup vs mufu", "ttgir"], tablefmt="github"))


if __name__ == "__main__":
    main()
