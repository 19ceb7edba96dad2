"""The GEMM kernel behind :func:`flexlite.kernels.triton_matmul`: C = A @ B, fp32 accumulation.

A plain ``@triton.jit`` file (Triton reads a jit function's source from its file). It is not imported
by name: :mod:`flexlite.kernels.matmul` loads it twice, once with ``TRITON_INTERPRET=1`` for CPU
tensors and once without for CUDA tensors, so one process can run both.

Notation: program ``i_m, i_n`` owns the C tile rows ``[i_m*BLOCK_M, +BLOCK_M)`` and columns
``[i_n*BLOCK_N, +BLOCK_N)`` and walks K in steps of BLOCK_K. Programs are ordered in groups of
GROUP_M tile rows so that consecutive programs share A and B tiles in L2.
"""

import triton
import triton.language as tl


@triton.jit
def matmul_kernel(
    a_ptr, b_ptr, c_ptr,
    M, N, K,
    stride_am, stride_ak,
    stride_bk, stride_bn,
    stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    """C[M, N] = A[M, K] @ B[K, N] for any M, N, K >= 1 and any strides; C gets c_ptr's dtype.

    DOT_IN_FP32: multiply fp32 upcasts of the 16-bit tiles (the interpreter's tl.dot multiplies
    bfloat16 storage as integers; upcasting is exact, so the result is the same up to summation order).
    """
    i_pid = tl.program_id(0)
    n_m = tl.cdiv(M, BLOCK_M)
    n_n = tl.cdiv(N, BLOCK_N)
    # grouped ordering: GROUP_M tile rows are finished column by column before moving on
    n_in_group = GROUP_M * n_n
    i_first_m = (i_pid // n_in_group) * GROUP_M
    group_m = tl.minimum(n_m - i_first_m, GROUP_M)
    i_m = i_first_m + (i_pid % n_in_group) % group_m
    i_n = (i_pid % n_in_group) // group_m

    # rows / columns past M / N wrap around to valid ones (their results are never stored), so only
    # the K edge needs load masks
    o_am = ((i_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M).to(tl.int64)  # [BM]
    o_bn = ((i_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N).to(tl.int64)  # [BN]
    o_k = tl.arange(0, BLOCK_K)                                        # [BK]
    p_a = a_ptr + o_am[:, None] * stride_am + o_k[None, :] * stride_ak  # [BM, BK]
    p_b = b_ptr + o_k[:, None] * stride_bk + o_bn[None, :] * stride_bn  # [BK, BN]

    b_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)             # [BM, BN]
    for k0 in range(0, K, BLOCK_K):
        m_k = o_k < K - k0                                              # [BK]
        b_a = tl.load(p_a, mask=m_k[None, :], other=0.0)                # [BM, BK]
        b_b = tl.load(p_b, mask=m_k[:, None], other=0.0)                # [BK, BN]
        if DOT_IN_FP32:
            b_acc = tl.dot(b_a.to(tl.float32), b_b.to(tl.float32), b_acc, input_precision="ieee")
        else:
            b_acc = tl.dot(b_a, b_b, b_acc)
        p_a += BLOCK_K * stride_ak
        p_b += BLOCK_K * stride_bk

    o_cm = i_m * BLOCK_M + tl.arange(0, BLOCK_M)                        # [BM]
    o_cn = i_n * BLOCK_N + tl.arange(0, BLOCK_N)                        # [BN]
    p_c = c_ptr + o_cm[:, None].to(tl.int64) * stride_cm + o_cn[None, :] * stride_cn
    m_c = (o_cm[:, None] < M) & (o_cn[None, :] < N)                     # [BM, BN]
    tl.store(p_c, b_acc.to(c_ptr.dtype.element_ty), mask=m_c)
