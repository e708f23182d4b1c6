"""The ``@triton.jit`` kernels of a decoding step's LoRA (``lora_decode``'s launcher calls them).

    out[m, n] = y[m, n] + s * (x[m] @ A.T) @ B[n].T     x (M, K), A (R, K), B (N, R), y, out (M, N), M <= 64

``_decode_shrink_kernel``: partial h over one of SPLIT_K chunks of K, stored to its own slice of
an fp32 (SPLIT_K, M, R_PAD) buffer (no atomics, so no zeroed buffer: no memset launch).
``_decode_expand_kernel``: h = the sum of the slices, rounded to x's dtype as the reference's
``x @ A.T``; out tile = y tile + s * h @ B[tile].T. out may be y itself (in place).

Why two launches: one kernel that computes the whole h in every program of the expand reads
all of x and A per program, and at K = 8192 that is what it waits on: it lost to cuBLAS's
``mm`` + ``addmm_`` there, and saved under 0.5 us a layer at K = 2048.
"""
import triton
import triton.language as tl


@triton.jit
def _decode_shrink_kernel(
    # pointers
    x_ptr, a_ptr, part_ptr,
    # sizes
    M, K, R,
    # strides (part is contiguous fp32 (SPLIT_K, M, R_PAD))
    stride_xm, stride_xk, stride_ar, stride_ak,
    # meta
    R_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """part[split, rows] = x[rows, chunk] @ A[:, chunk].T. A is read in its own dtype (fp32
    masters) and cast to x's in registers; columns past R store zeros."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, R_PAD)
    mask_m = offs_m < M
    chunk = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_end = tl.minimum(pid_k * chunk + chunk, K)
    acc = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)
    for k0 in range(pid_k * chunk, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # (BLOCK_M, BLOCK_K)
        at = tl.load(a_ptr + offs_r[None, :] * stride_ar + offs_k[:, None] * stride_ak,
                     mask=(offs_r[None, :] < R) & mask_k[:, None], other=0.0)  # (BLOCK_K, R_PAD)
        acc = tl.dot(x, at.to(x.dtype), acc, input_precision=DOT_PRECISION)
    tl.store(part_ptr + (pid_k * M + offs_m[:, None]) * R_PAD + offs_r[None, :], acc, mask=mask_m[:, None])


@triton.jit
def _decode_expand_kernel(
    # pointers
    part_ptr, b_ptr, y_ptr, out_ptr,
    # sizes
    M, N, R,
    # strides
    stride_bn, stride_br, stride_ym, stride_yn, stride_om, stride_on,
    # scalars
    scale,
    # meta
    R_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """out tile = y tile + s * h[rows] @ B[tile].T, h the sum of the shrink's SPLIT_K slices."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    dtype = y_ptr.dtype.element_ty
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, R_PAD)
    mask_m = offs_m < M
    mask_n = offs_n < N
    h = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)
    for s in range(SPLIT_K):
        h += tl.load(part_ptr + (s * M + offs_m[:, None]) * R_PAD + offs_r[None, :], mask=mask_m[:, None], other=0.0)
    bt = tl.load(b_ptr + offs_r[:, None] * stride_br + offs_n[None, :] * stride_bn,
                 mask=(offs_r[:, None] < R) & mask_n[None, :], other=0.0)  # (R_PAD, BLOCK_N)
    up = tl.dot(h.to(dtype), bt.to(dtype), input_precision=DOT_PRECISION)  # h rounded as the reference's
    mask = mask_m[:, None] & mask_n[None, :]
    y = tl.load(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn, mask=mask, other=0.0)
    out = y.to(tl.float32) + scale * up
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on, out.to(dtype), mask=mask)
