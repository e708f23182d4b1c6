"""The ``@triton.jit`` kernels of the grouped LoRA (``lora_multi``'s launchers call them).

    y[t] = x[t] @ W.T + bias + s * (x[t] @ A[g].T) @ B[g].T,   g = ids[t // S],  ids[...] = -1: base only

x (T, K) in segments of S rows; A (n, R, K), B (n, N, R); ids (len(ids),) on the device. Grids
are (segment, block within the segment, split): a block never straddles two segments.
``_multi_h_kernel`` h = x @ A[g].T; ``_multi_expand_kernel`` y += s * h @ B[g].T;
``_multi_dh_kernel`` dh = s * dy @ B[g]; ``_multi_dfactor_kernel`` dB[g], dA[g] per slot;
``_multi_gemm_kernel`` the persistent TMA GEMM with a per-segment LoRA epilogue.
"""
import triton
import triton.language as tl

from .lora_linear_kernels import _tile_coords

# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _segment_program():
    """(segment, block, split) program ids: every segment kernel's grid is laid out this way."""
    return tl.program_id(0), tl.program_id(1), tl.program_id(2)


@triton.jit
def _multi_h_kernel(
    # pointers
    x_ptr, a_ptr, ids_ptr, h_ptr,
    # sizes
    S, K, R,
    # strides (h is contiguous fp32 (T, R))
    stride_xm, stride_xk, stride_ag, stride_ar, stride_ak,
    # meta
    R_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """h[rows] = x[rows] @ A[g].T for one block of one segment and one of SPLIT_K chunks of K.

    SPLIT_K > 1 adds the chunks atomically into a zeroed h (-1 segments leave it at zero).
    """
    seg, pid_m, pid_k = _segment_program()
    slot = tl.load(ids_ptr + seg).to(tl.int64)
    offs_s = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = seg.to(tl.int64) * S + offs_s
    offs_r = tl.arange(0, R_PAD)
    mask = (offs_s[:, None] < S) & (offs_r[None, :] < R)
    acc = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)
    if slot >= 0:
        chunk = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
        k_end = tl.minimum(pid_k * chunk + chunk, K)
        a_base = a_ptr + slot * stride_ag
        for k0 in range(pid_k * chunk, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < k_end
            x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :].to(tl.int64) * stride_xk,
                        mask=(offs_s[:, None] < S) & mask_k[None, :], other=0.0)  # (BLOCK_M, BLOCK_K)
            at = tl.load(a_base + offs_r[None, :] * stride_ar + offs_k[:, None] * stride_ak,
                         mask=(offs_r[None, :] < R) & mask_k[:, None], other=0.0)  # (BLOCK_K, R_PAD)
            acc = tl.dot(x, at.to(x.dtype), acc, input_precision=DOT_PRECISION)
    ptrs = h_ptr + rows[:, None] * R + offs_r[None, :]
    if SPLIT_K == 1:  # every row stored, zeros for -1 segments: h needs no memset
        tl.store(ptrs, acc, mask=mask)
    elif slot >= 0:
        tl.atomic_add(ptrs, acc, mask=mask, sem="relaxed")


@triton.jit
def _multi_expand_kernel(
    # pointers
    h_ptr, u_ptr, ids_ptr, y_ptr,
    # sizes
    S, N, R,
    # strides (h fp32 (SPLIT, T, R) by strides, rank at unit stride; u (n, R, N); y (T, N))
    stride_hs, stride_hm, stride_ug, stride_ur, stride_un, stride_ym, stride_yn,
    # scalars
    scale,
    # meta
    R_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """y[rows, n-block] += s * h[rows] @ u[g][:, n-block] in place; -1 segments are left alone.
    h is the sum of SPLIT partials (a split shrink's, written without a zeroed buffer), or SPLIT=1
    one (T, R) tensor."""
    seg, pid_m, pid_n = _segment_program()
    slot = tl.load(ids_ptr + seg).to(tl.int64)
    if slot >= 0:
        dtype = y_ptr.dtype.element_ty
        offs_s = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rows = seg.to(tl.int64) * S + offs_s
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_r = tl.arange(0, R_PAD)
        mask_m = offs_s < S
        mask_n = offs_n < N
        h = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)
        for part in range(SPLIT):
            h += tl.load(h_ptr + part * stride_hs + rows[:, None] * stride_hm + offs_r[None, :],
                         mask=mask_m[:, None] & (offs_r[None, :] < R), other=0.0)  # (BLOCK_M, R_PAD) fp32
        u = tl.load(u_ptr + slot * stride_ug + offs_r[:, None] * stride_ur + offs_n[None, :].to(tl.int64) * stride_un,
                    mask=(offs_r[:, None] < R) & mask_n[None, :], other=0.0)  # (R_PAD, BLOCK_N)
        y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :].to(tl.int64) * stride_yn
        y = tl.load(y_ptrs, mask=mask_m[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
        y = tl.dot((h * scale).to(dtype), u.to(dtype), y, input_precision=DOT_PRECISION)
        tl.store(y_ptrs, y.to(dtype), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _multi_dh_kernel(
    # pointers
    dy_ptr, b_ptr, ids_ptr, dh_ptr,
    # sizes
    S, N, R,
    # strides (dh contiguous fp32 (T, R), zeroed)
    stride_dym, stride_dyn, stride_bg, stride_bn, stride_br,
    # scalars
    scale,
    # meta
    R_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """dh[rows] (+)= s * dy[rows] @ B[g] over one of SPLIT_N chunks of N (atomics into a zeroed dh
    when split)."""
    seg, pid_m, pid_s = _segment_program()
    slot = tl.load(ids_ptr + seg).to(tl.int64)
    offs_s = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = seg.to(tl.int64) * S + offs_s
    offs_r = tl.arange(0, R_PAD)
    mask_m = offs_s < S
    mask_r = offs_r < R
    dh = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)
    if slot >= 0:
        chunk = tl.cdiv(tl.cdiv(N, BLOCK_N), SPLIT_N) * BLOCK_N
        n_end = tl.minimum(pid_s * chunk + chunk, N)
        for n0 in range(pid_s * chunk, n_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < n_end
            dy = tl.load(dy_ptr + rows[:, None] * stride_dym + offs_n[None, :].to(tl.int64) * stride_dyn,
                         mask=mask_m[:, None] & mask_n[None, :], other=0.0)  # (BLOCK_M, BLOCK_N)
            b = tl.load(b_ptr + slot * stride_bg + offs_n[:, None] * stride_bn + offs_r[None, :] * stride_br,
                        mask=mask_n[:, None] & mask_r[None, :], other=0.0)  # (BLOCK_N, R_PAD)
            dh = tl.dot(dy, b.to(dy.dtype), dh, input_precision=DOT_PRECISION)
    dh_ptrs = dh_ptr + rows[:, None] * R + offs_r[None, :]
    if SPLIT_N == 1:  # every row stored, zeros for -1 segments: dh needs no memset
        tl.store(dh_ptrs, dh * scale, mask=mask_m[:, None] & mask_r[None, :])
    elif slot >= 0:
        tl.atomic_add(dh_ptrs, dh * scale, mask=mask_m[:, None] & mask_r[None, :], sem="relaxed")


@triton.jit
def _multi_dfactor_kernel(
    # pointers
    lhs_ptr, rhs_ptr, ids_ptr, out_ptr,
    # sizes (C: the output's column count, blocked; R: the rank)
    S, NSEG, C, R,
    # strides (lhs (T, C) by strides; rhs contiguous fp32 (T, R); out (n, ...) by strides)
    stride_lm, stride_lc, stride_og, stride_oc, stride_or,
    # scalars
    scale,
    # meta
    R_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, ID_CHUNK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One slot's factor gradient over one column block, summed over the segments that use it:

        out[g][c-block, :] = s * sum_{rows of g's segments} lhs[rows, c-block].T @ rhs[rows]

    dB[g] (N, R) is (lhs, rhs) = (dy, h); dA[g].T (K, R) is (x, dh). Each (slot, block) has one
    program, so the sum needs no atomics and is stored once in the output's dtype (a slot no
    segment uses gets zeros).
    """
    slot = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, R_PAD)
    mask_c = offs_c < C
    mask_r = offs_r < R
    acc = tl.zeros((BLOCK_C, R_PAD), dtype=tl.float32)
    for c0 in range(0, NSEG, ID_CHUNK):
        # one vector load of ID_CHUNK ids, then a walk over the hits only (not NSEG dependent loads)
        offs_i = c0 + tl.arange(0, ID_CHUNK)
        hits = tl.where(tl.load(ids_ptr + offs_i, mask=offs_i < NSEG, other=-1) == slot, offs_i, NSEG)
        seg = tl.min(hits, axis=0)
        while seg < NSEG:
            for s0 in range(0, S, BLOCK_M):
                offs_s = s0 + tl.arange(0, BLOCK_M)
                rows = (seg * S + offs_s).to(tl.int64)  # seg * S < T < 2**31
                mask_m = offs_s < S
                lhs = tl.load(lhs_ptr + rows[:, None] * stride_lm + offs_c[None, :].to(tl.int64) * stride_lc,
                              mask=mask_m[:, None] & mask_c[None, :], other=0.0)  # (BLOCK_M, BLOCK_C)
                rhs = tl.load(rhs_ptr + rows[:, None] * R + offs_r[None, :],
                              mask=mask_m[:, None] & mask_r[None, :], other=0.0)  # (BLOCK_M, R_PAD)
                acc = tl.dot(tl.trans(lhs), rhs.to(lhs.dtype), acc, input_precision=DOT_PRECISION)
            hits = tl.where(hits == seg, NSEG, hits)
            seg = tl.min(hits, axis=0)
    tl.store(out_ptr + slot.to(tl.int64) * stride_og + offs_c[:, None] * stride_oc + offs_r[None, :] * stride_or,
             (acc * scale).to(out_ptr.dtype.element_ty), mask=mask_c[:, None] & mask_r[None, :])


@triton.jit
def _multi_gemm_kernel(
    # pointers
    x_ptr, w_ptr, h_ptr, u_ptr, ids_ptr, bias_ptr, y_ptr,
    # sizes
    M, N, K, R, S, NSEG,
    # strides (h contiguous fp32 (M, R); u (n, R, N) by strides; w's row stride, its other unit)
    stride_xm, stride_w, stride_ug, stride_ur, stride_un, stride_ym,
    # scalars
    NUM_PROGRAMS, l_scale,
    # meta
    HAS_BIAS: tl.constexpr, W_K_CONTIG: tl.constexpr, R_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Persistent y = x @ w + [bias] + s * h @ u[g] per segment, TMA tiles: the base GEMM once for
    every row, then one (BLOCK_M, R_PAD) @ (R_PAD, BLOCK_N) dot per segment the tile meets."""
    dtype = y_ptr.dtype.element_ty
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1], block_shape=[BLOCK_M, BLOCK_K])
    if W_K_CONTIG:  # w (N, K) row-major: load (BLOCK_N, BLOCK_K) tiles and transpose
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[stride_w, 1], block_shape=[BLOCK_N, BLOCK_K])
    else:  # w (K, N) row-major
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[K, N], strides=[stride_w, 1], block_shape=[BLOCK_K, BLOCK_N])
    y_desc = tl.make_tensor_descriptor(y_ptr, shape=[M, N], strides=[stride_ym, 1], block_shape=[BLOCK_M, BLOCK_N])
    offs_r = tl.arange(0, R_PAD)
    for tile_id in range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if W_K_CONTIG:
                wt = w_desc.load([off_n, k0]).T
            else:
                wt = w_desc.load([k0, off_n])
            acc = tl.dot(x_desc.load([off_m, k0]), wt, acc, input_precision=DOT_PRECISION)
        offs_m = (off_m + tl.arange(0, BLOCK_M)).to(tl.int64)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        seg_end = tl.minimum((off_m + BLOCK_M - 1) // S, NSEG - 1)
        for seg in range(off_m // S, seg_end + 1):
            slot = tl.load(ids_ptr + seg).to(tl.int64)
            if slot >= 0:
                rows = (offs_m >= seg * S) & (offs_m < seg * S + S)
                h = tl.load(h_ptr + offs_m[:, None] * R + offs_r[None, :],
                            mask=rows[:, None] & (offs_r[None, :] < R), other=0.0)
                u = tl.load(u_ptr + slot * stride_ug + offs_r[:, None] * stride_ur
                            + offs_n[None, :].to(tl.int64) * stride_un,
                            mask=(offs_r[:, None] < R) & (offs_n[None, :] < N), other=0.0)
                acc = tl.dot((h * l_scale).to(dtype), u.to(dtype), acc, input_precision=DOT_PRECISION)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :].to(tl.float32)
        y_desc.store([off_m, off_n], acc.to(dtype))
