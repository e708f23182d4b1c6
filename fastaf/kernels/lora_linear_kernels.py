"""LoRA linear's Triton kernels; the math and the launchers are in ``lora_linear``.

    _lora_linear_fwd_h_kernel   h = dropout(x) @ a.T, one pass over x
    _lora_linear_gemm_kernel    out = lhs @ rhs [+ lhs_2 @ rhs_2 + lhs_3 @ rhs_3] [+ bias]
                                      + [mask *] (l_scale * low) @ up, persistent
    _lora_linear_bwd_dy_kernel  dh = s * dy @ b and db = s * dy.T @ h, one pass over dy
    _lora_linear_bwd_db_kernel  db = s * the sum of bwd_dy's m-block partials
    _lora_linear_bwd_da_kernel  da = dh.T @ dropout(x), split over M, reduced with atomics
"""
from __future__ import annotations

import triton
import triton.language as tl

from fastaf.kernels.dropout_hash_triton import dropout_keep


@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped ordering: GROUP_M row-tiles share each rhs column-tile while it is in L2."""
    num_in_group = GROUP_M * num_pid_n
    first_m = (tile_id // num_in_group) * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile_id % num_in_group) % group_m
    pid_n = (tile_id % num_in_group) // group_m
    return pid_m, pid_n


@triton.jit
def _lora_linear_fwd_h_kernel(
    # pointers
    x_ptr, a_ptr, seed_ptr, h_ptr,
    # sizes
    M, K, R,
    # strides
    stride_xm, stride_xk, stride_ar, stride_ak, stride_hm, stride_hr,
    # scalars
    dropout_p,
    # meta
    HAS_DROPOUT: tl.constexpr, USE_TMA: tl.constexpr, R_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """h[m-block] = dropout(x)[m-block] @ a.T; x is read once, dropout applied on the fly.

    USE_TMA loads x (BLOCK_M, BLOCK_K) and a (R_PAD, BLOCK_K) tiles through TMA descriptors
    (out-of-bounds rows and columns read as zero); it needs unit stride on x's and a's K.
    """
    pid = tl.program_id(0)
    offs_m = (pid * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_r = tl.arange(0, R_PAD)
    mask_m = offs_m < M
    if USE_TMA:
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[R, K], strides=[stride_ar, 1],
                                           block_shape=[R_PAD, BLOCK_K])
    acc = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        if USE_TMA:
            x = x_desc.load([pid * BLOCK_M, k0])  # (BLOCK_M, BLOCK_K)
            at = a_desc.load([0, k0]).T  # (BLOCK_K, R_PAD)
        else:
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # (BLOCK_M, BLOCK_K)
            at = tl.load(a_ptr + offs_r[None, :] * stride_ar + offs_k[:, None] * stride_ak,
                         mask=(offs_r[None, :] < R) & mask_k[:, None], other=0.0)  # (BLOCK_K, R_PAD)
        if HAS_DROPOUT:
            keep = dropout_keep(seed_ptr, offs_m[:, None] * K + offs_k[None, :], dropout_p)
            x = tl.where(keep, x, 0.0).to(x.dtype)
        # a may be fp32 master weights beside 16-bit x: cast in registers, not as a launch per call
        acc = tl.dot(x, at.to(x.dtype), acc, input_precision=DOT_PRECISION)
    if HAS_DROPOUT:
        acc = acc * (1.0 / (1.0 - dropout_p))
    tl.store(h_ptr + offs_m[:, None] * stride_hm + offs_r[None, :] * stride_hr,
             acc.to(h_ptr.dtype.element_ty), mask=mask_m[:, None] & (offs_r[None, :] < R))


@triton.jit
def _k_loop(acc, x_ptr, w_ptr, x_desc, w_desc, off_m, off_n, M, N, K, stride_xm, stride_xk, stride_wk, stride_wn,
            USE_TMA: tl.constexpr, W_K_CONTIG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc += x[off_m block, :K] @ w[:K, off_n block]: one segment's K loop (the descriptors'
    when USE_TMA, else masked pointer loads)."""
    offs_m = (off_m + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    for k0 in range(0, K, BLOCK_K):
        if USE_TMA:
            xt = x_desc.load([off_m, k0])
            if W_K_CONTIG:
                wt = w_desc.load([off_n, k0]).T
            else:
                wt = w_desc.load([k0, off_n])
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xt = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                         mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
            wt = tl.load(w_ptr + offs_k[:, None].to(tl.int64) * stride_wk + offs_n[None, :] * stride_wn,
                         mask=(offs_k[:, None] < K) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(xt, wt, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _w_desc(w_ptr, N, K, stride_wk, stride_wn, W_K_CONTIG: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr):
    """w's TMA descriptor: (BLOCK_N, BLOCK_K) tiles of an (N, K) row-major w (W_K_CONTIG), else
    (BLOCK_K, BLOCK_N) tiles of a (K, N) one."""
    if W_K_CONTIG:
        return tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[stride_wn, 1], block_shape=[BLOCK_N, BLOCK_K])
    else:
        return tl.make_tensor_descriptor(w_ptr, shape=[K, N], strides=[stride_wk, 1], block_shape=[BLOCK_K, BLOCK_N])


@triton.jit
def _lora_linear_gemm_kernel(
    # pointers (x2, w2, x3, w3: more (x, w) segments summed into y, unused below NUM_SEG)
    x_ptr, w_ptr, h_ptr, u_ptr, bias_ptr, seed_ptr, y_ptr, x2_ptr, w2_ptr, x3_ptr, w3_ptr,
    # sizes
    M, N, K, R, K2, K3,
    # strides
    stride_xm, stride_xk, stride_wk, stride_wn, stride_hm, stride_hr, stride_ur, stride_un,
    stride_ym, stride_yn, stride_x2m, stride_w2k, stride_w2n, stride_x3m, stride_w3k, stride_w3n,
    # scalars
    NUM_PROGRAMS, l_scale, dropout_p,
    # meta
    HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, USE_TMA: tl.constexpr,
    W_K_CONTIG: tl.constexpr, R_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr, NUM_SEG: tl.constexpr,
):
    """Persistent y = x @ w [+ x2 @ w2 + x3 @ w3] + [bias] + [mask *] (l_scale * h) @ u, one
    (BLOCK_M, BLOCK_N) tile at a time.

    x (M, K), w (K, N), h (M, R), u (R, N) by strides; y (M, N). Segment j of NUM_SEG: x_j
    (M, K_j) with unit stride on K_j, w_j (K_j, N) laid out as w is (W_K_CONTIG); siblings' dX
    = sum_j dy_j @ W_j + dh @ A is one launch, y written once. The LoRA dot runs after the K
    loops so the main loop stays pipelined (before the loop it halved the speed).
    USE_TMA needs unit stride on x's K, y's N and one of w's dims (W_K_CONTIG: w's K).
    """
    dtype = y_ptr.dtype.element_ty
    start = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    x_desc, w_desc, y_desc = x_ptr, w_ptr, y_ptr  # pointer loads unless USE_TMA
    x2_desc, w2_desc, x3_desc, w3_desc = x2_ptr, w2_ptr, x3_ptr, w3_ptr
    if USE_TMA:
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
        w_desc = _w_desc(w_ptr, N, K, stride_wk, stride_wn, W_K_CONTIG, BLOCK_N, BLOCK_K)
        y_desc = tl.make_tensor_descriptor(y_ptr, shape=[M, N], strides=[stride_ym, 1],
                                           block_shape=[BLOCK_M, BLOCK_N])
        if NUM_SEG >= 2:
            x2_desc = tl.make_tensor_descriptor(x2_ptr, shape=[M, K2], strides=[stride_x2m, 1],
                                                block_shape=[BLOCK_M, BLOCK_K])
            w2_desc = _w_desc(w2_ptr, N, K2, stride_w2k, stride_w2n, W_K_CONTIG, BLOCK_N, BLOCK_K)
        if NUM_SEG >= 3:
            x3_desc = tl.make_tensor_descriptor(x3_ptr, shape=[M, K3], strides=[stride_x3m, 1],
                                                block_shape=[BLOCK_M, BLOCK_K])
            w3_desc = _w_desc(w3_ptr, N, K3, stride_w3k, stride_w3n, W_K_CONTIG, BLOCK_N, BLOCK_K)
    for tile_id in range(start, num_tiles, NUM_PROGRAMS):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        offs_m = (off_m + tl.arange(0, BLOCK_M)).to(tl.int64)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = _k_loop(acc, x_ptr, w_ptr, x_desc, w_desc, off_m, off_n, M, N, K, stride_xm, stride_xk, stride_wk,
                      stride_wn, USE_TMA, W_K_CONTIG, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)
        if NUM_SEG >= 2:  # the extra segments have unit stride on their K (the launcher checks)
            acc = _k_loop(acc, x2_ptr, w2_ptr, x2_desc, w2_desc, off_m, off_n, M, N, K2, stride_x2m, 1, stride_w2k,
                          stride_w2n, USE_TMA, W_K_CONTIG, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)
        if NUM_SEG >= 3:
            acc = _k_loop(acc, x3_ptr, w3_ptr, x3_desc, w3_desc, off_m, off_n, M, N, K3, stride_x3m, 1, stride_w3k,
                          stride_w3n, USE_TMA, W_K_CONTIG, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)

        # LoRA epilogue: one (BLOCK_M, R_PAD) @ (R_PAD, BLOCK_N) dot.
        offs_r = tl.arange(0, R_PAD)
        h = tl.load(h_ptr + offs_m[:, None] * stride_hm + offs_r[None, :] * stride_hr,
                    mask=(offs_m[:, None] < M) & (offs_r[None, :] < R), other=0.0)
        h = (h.to(tl.float32) * l_scale).to(dtype)
        u = tl.load(u_ptr + offs_r[:, None] * stride_ur + offs_n[None, :].to(tl.int64) * stride_un,
                    mask=(offs_r[:, None] < R) & (offs_n[None, :] < N), other=0.0).to(dtype)
        if HAS_DROPOUT:
            lora = tl.dot(h, u, input_precision=DOT_PRECISION)
            keep = dropout_keep(seed_ptr, offs_m[:, None] * N + offs_n[None, :], dropout_p)
            acc += tl.where(keep, lora * (1.0 / (1.0 - dropout_p)), 0.0)
        else:
            acc = tl.dot(h, u, acc, input_precision=DOT_PRECISION)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
            acc += bias[None, :].to(tl.float32)
        if USE_TMA:
            y_desc.store([off_m, off_n], acc.to(dtype))
        else:
            tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn, acc.to(dtype),
                     mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _lora_linear_bwd_dy_kernel(
    # pointers
    dy_ptr, b_ptr, h_ptr, dh_ptr, db_ptr,
    # sizes
    M, N, R,
    # strides (dh is contiguous fp32 (M, R); db contiguous fp32 (N, R), or (cdiv(M, BLOCK_M), N, R))
    stride_dym, stride_dyn, stride_bn, stride_br, stride_hm, stride_hr,
    # scalars
    scale,
    # meta
    USE_TMA: tl.constexpr, DB_PARTIAL: tl.constexpr, R_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """dh += s * dy @ b and db += s * dy.T @ h over one (m-block, N-chunk); dy is read once.

    Program (pid_m, pid_s) owns rows pid_m*BLOCK_M.. and the pid_s-th of SPLIT_N column chunks
    (each a whole number of BLOCK_N blocks). Its db partial of each column block, (BLOCK_N, R),
    is stored to slice pid_m of the partial buffer (DB_PARTIAL, summed later by the bwd_db
    kernel) or atomically added to db. dh is complete in registers when SPLIT_N == 1 (plain
    store), else atomically added.
    """
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_r = tl.arange(0, R_PAD)
    mask_m = offs_m < M
    mask_r = offs_r < R
    h = tl.load(h_ptr + offs_m[:, None] * stride_hm + offs_r[None, :] * stride_hr,
                mask=mask_m[:, None] & mask_r[None, :], other=0.0)  # (BLOCK_M, R_PAD)
    if USE_TMA:
        dy_desc = tl.make_tensor_descriptor(dy_ptr, shape=[M, N], strides=[stride_dym, 1],
                                            block_shape=[BLOCK_M, BLOCK_N])
    if DB_PARTIAL:
        db_ptr += pid_m.to(tl.int64) * N * R
    chunk = tl.cdiv(tl.cdiv(N, BLOCK_N), SPLIT_N) * BLOCK_N
    n_start = pid_s * chunk
    n_end = tl.minimum(n_start + chunk, N)
    dh = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)
    for n0 in range(n_start, n_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < n_end
        if USE_TMA:  # chunks are whole blocks: a tile never reaches into the next chunk
            dy = dy_desc.load([pid_m * BLOCK_M, n0])  # (BLOCK_M, BLOCK_N)
        else:
            dy = tl.load(dy_ptr + offs_m[:, None] * stride_dym + offs_n[None, :] * stride_dyn,
                         mask=mask_m[:, None] & mask_n[None, :], other=0.0)  # (BLOCK_M, BLOCK_N)
        b = tl.load(b_ptr + offs_n[:, None] * stride_bn + offs_r[None, :] * stride_br,
                    mask=mask_n[:, None] & mask_r[None, :], other=0.0).to(dy.dtype)  # (BLOCK_N, R_PAD)
        dh = tl.dot(dy, b, dh, input_precision=DOT_PRECISION)
        db = tl.dot(tl.trans(dy), h, input_precision=DOT_PRECISION)  # (BLOCK_N, R_PAD)
        db_ptrs = db_ptr + offs_n[:, None] * R + offs_r[None, :]
        if DB_PARTIAL:
            tl.store(db_ptrs, db, mask=mask_n[:, None] & mask_r[None, :])
        else:
            tl.atomic_add(db_ptrs, db * scale, mask=mask_n[:, None] & mask_r[None, :], sem="relaxed")
    dh_ptrs = dh_ptr + offs_m[:, None] * R + offs_r[None, :]
    if SPLIT_N == 1:
        tl.store(dh_ptrs, dh * scale, mask=mask_m[:, None] & mask_r[None, :])
    else:
        tl.atomic_add(dh_ptrs, dh * scale, mask=mask_m[:, None] & mask_r[None, :], sem="relaxed")


@triton.jit
def _lora_linear_bwd_db_kernel(
    # pointers
    part_ptr, db_ptr,
    # sizes (NR = N * R elements per partial, P partials)
    NR, P,
    # scalars
    scale,
    # meta
    BLOCK: tl.constexpr,
):
    """db = s * sum_p part[p] in db's dtype; part (P, N*R) fp32 contiguous, db (N*R,) contiguous."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < NR
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for p in range(0, P):  # P * NR < 2**31: the partial buffer is a fraction of dy
        acc += tl.load(part_ptr + p * NR + offs, mask=mask, other=0.0)
    tl.store(db_ptr + offs, (acc * scale).to(db_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _lora_linear_bwd_da_kernel(
    # pointers
    dh_ptr, x_ptr, seed_ptr, da_ptr,
    # sizes
    M, K, R,
    # strides (dh is contiguous fp32 (M, R), da contiguous fp32 (R, K))
    stride_xm, stride_xk,
    # scalars
    dropout_p,
    # meta
    HAS_DROPOUT: tl.constexpr, USE_TMA: tl.constexpr, R_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """da[:, k-block] += dh[m-chunk].T @ dropout(x)[m-chunk, k-block], SPLIT_M chunks reduced by atomics."""
    pid_k = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, R_PAD)
    mask_k = offs_k < K
    mask_r = offs_r < R
    if USE_TMA:
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
    chunk = tl.cdiv(tl.cdiv(M, BLOCK_M), SPLIT_M) * BLOCK_M
    m_start = pid_s * chunk
    m_end = tl.minimum(m_start + chunk, M)
    acc = tl.zeros((R_PAD, BLOCK_K), dtype=tl.float32)
    for m0 in range(m_start, m_end, BLOCK_M):
        offs_m = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask_m = offs_m < m_end
        if USE_TMA:  # chunks are whole blocks: a tile never reaches into the next chunk
            x = x_desc.load([m0, pid_k * BLOCK_K])  # (BLOCK_M, BLOCK_K)
        else:
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # (BLOCK_M, BLOCK_K)
        if HAS_DROPOUT:
            keep = dropout_keep(seed_ptr, offs_m[:, None] * K + offs_k[None, :], dropout_p)
            x = tl.where(keep, x, 0.0).to(x.dtype)
        dh = tl.load(dh_ptr + offs_m[None, :] * R + offs_r[:, None],
                     mask=mask_m[None, :] & mask_r[:, None], other=0.0).to(x.dtype)  # (R_PAD, BLOCK_M)
        acc = tl.dot(dh, x, acc, input_precision=DOT_PRECISION)
    if HAS_DROPOUT:
        acc = acc * (1.0 / (1.0 - dropout_p))
    ptrs = da_ptr + offs_r[:, None] * K + offs_k[None, :]
    if SPLIT_M == 1:
        tl.store(ptrs, acc, mask=mask_r[:, None] & mask_k[None, :])
    else:
        tl.atomic_add(ptrs, acc, mask=mask_r[:, None] & mask_k[None, :], sem="relaxed")
