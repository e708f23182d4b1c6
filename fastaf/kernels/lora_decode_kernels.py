"""The ``@triton.jit`` kernels of a decoding step's LoRA (``lora_decode``'s launcher calls them).

    out[m, n] = y[m, n] + s * (x[m] @ A.T) @ B[n].T     x (M, K), A (R, K), B (N, R), y, out (M, N), M <= 64

``_decode_shrink_kernel``: partial h over one of SPLIT_K chunks of K, stored to its own slice of
an fp32 (S, SPLIT_K, M, R_PAD) buffer (no atomics, so no zeroed buffer: no memset launch), for
up to four siblings' A at once (q/k/v read one x: one launch for all, the grid's third axis
picks the sibling).
``_decode_expand_kernel``: h = the sum of one sibling's slices, rounded to x's dtype as the
reference's ``x @ A.T``; out tile = y tile + s * h @ B[tile].T. out may be y itself (in place).
``_decode_fused_kernel``: both in one launch, each program computing all of its rows' h (eager
inference calls, bound by host time per launch).
``_decode_linear_kernel``: the base GEMM too, in the same launch and the same pass over K (eager
decoding: one launch per adapted linear, as the base model's).
``_multi_decode_shrink_kernel`` and ``_multi_decode_linear_kernel``: a stack with one slot per
segment of rows (ids on the device, -1 the base alone): partial h per slot and split of K, then
the base GEMM with each row's LoRA, one tensor-core dot per slot present, in its epilogue.

Why two launches: one kernel that computes the whole h in every program of the expand reads
all of x and A per program, and at K = 8192 that is what it waits on: it lost to cuBLAS's
``mm`` + ``addmm_`` there, and saved under 0.5 us a layer at K = 2048.
"""
import triton
import triton.language as tl


@triton.jit
def _h_over(x_ptr, a_ptr, offs_m, mask_m, k_start, k_end, R, stride_xm, stride_xk, stride_ar, stride_ak,
            R_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """x[rows, k_start:k_end] @ A[:, k_start:k_end].T, fp32 (BLOCK_M, R_PAD): A read in its own
    dtype (fp32 masters) and cast to x's in registers; columns past R are zeros."""
    offs_r = tl.arange(0, R_PAD)
    acc = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # (BLOCK_M, BLOCK_K)
        at = tl.load(a_ptr + offs_r[None, :] * stride_ar + offs_k[:, None] * stride_ak,
                     mask=(offs_r[None, :] < R) & mask_k[:, None], other=0.0)  # (BLOCK_K, R_PAD)
        acc = tl.dot(x, at.to(x.dtype), acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _sibling(sib, a0_ptr, a1_ptr, a2_ptr, a3_ptr, R0, R1, R2, R3):
    """Sibling ``sib``'s A pointer and rank, of the four a shrink launch takes."""
    a_ptr = a0_ptr
    R = R0
    if sib == 1:
        a_ptr = a1_ptr
        R = R1
    elif sib == 2:
        a_ptr = a2_ptr
        R = R2
    elif sib == 3:
        a_ptr = a3_ptr
        R = R3
    return a_ptr, R


@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's rows and columns of an (M, N) output, the grid's N tiles first, and their masks."""
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_m, offs_n, offs_m < M, offs_n < N


@triton.jit
def _x_w_tiles(x_ptr, w_ptr, offs_m, offs_n, mask_m, mask_n, k0, K, stride_xm, stride_xk, stride_wn, stride_wk,
               BLOCK_K: tl.constexpr):
    """The base GEMM's tiles at k0: x (BLOCK_M, BLOCK_K) and W.T (BLOCK_K, BLOCK_N), masked past
    M, N and K, with the K offsets and their mask."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                mask=mask_m[:, None] & mask_k[None, :], other=0.0)
    wt = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                 mask=mask_n[None, :] & mask_k[:, None], other=0.0)
    return x, wt, offs_k, mask_k


@triton.jit
def _up(h, b_ptr, offs_n, mask_n, R, stride_bn, stride_br, dtype: tl.constexpr, R_PAD: tl.constexpr,
        DOT_PRECISION: tl.constexpr):
    """h @ B[tile].T, fp32 (BLOCK_M, BLOCK_N): h (BLOCK_M, R_PAD) fp32 rounded to ``dtype`` first, as
    the reference's ``x @ A.T``; B read in its own dtype and cast in registers."""
    offs_r = tl.arange(0, R_PAD)
    bt = tl.load(b_ptr + offs_r[:, None] * stride_br + offs_n[None, :] * stride_bn,
                 mask=(offs_r[:, None] < R) & mask_n[None, :], other=0.0)  # (R_PAD, BLOCK_N)
    return tl.dot(h.to(dtype), bt.to(dtype), input_precision=DOT_PRECISION)


@triton.jit
def _add_up(h, b_ptr, y_ptr, out_ptr, offs_m, offs_n, mask_m, mask_n, R, stride_bn, stride_br, stride_ym, stride_yn,
            stride_om, stride_on, scale, R_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """out tile = y tile + s * h @ B[tile].T (``_up``)."""
    dtype = y_ptr.dtype.element_ty
    up = _up(h, b_ptr, offs_n, mask_n, R, stride_bn, stride_br, dtype, R_PAD, DOT_PRECISION)
    mask = mask_m[:, None] & mask_n[None, :]
    y = tl.load(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn, mask=mask, other=0.0)
    out = y.to(tl.float32) + scale * up
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on, out.to(dtype), mask=mask)


@triton.jit
def _decode_shrink_kernel(
    # pointers: x, up to four siblings' A (unused ones repeat a0), the partials
    x_ptr, a0_ptr, a1_ptr, a2_ptr, a3_ptr, part_ptr,
    # sizes: each sibling's rank
    M, K, R0, R1, R2, R3,
    # strides (every A has the same; part is contiguous fp32 (S, SPLIT_K, M, R_PAD))
    stride_xm, stride_xk, stride_ar, stride_ak,
    # meta
    R_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """part[sib, split, rows] = x[rows, chunk] @ A_sib[:, chunk].T. A is read in its own dtype
    (fp32 masters) and cast to x's in registers; columns past the sibling's rank store zeros."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    sib = tl.program_id(2)
    a_ptr, R = _sibling(sib, a0_ptr, a1_ptr, a2_ptr, a3_ptr, R0, R1, R2, R3)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, R_PAD)
    mask_m = offs_m < M
    chunk = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    acc = _h_over(x_ptr, a_ptr, offs_m, mask_m, pid_k * chunk, tl.minimum(pid_k * chunk + chunk, K), R, stride_xm,
                  stride_xk, stride_ar, stride_ak, R_PAD, BLOCK_M, BLOCK_K, DOT_PRECISION)
    rows = (sib * SPLIT_K + pid_k) * M + offs_m
    tl.store(part_ptr + rows[:, None] * R_PAD + offs_r[None, :], acc, mask=mask_m[:, None])


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
    offs_m, offs_n, mask_m, mask_n = _tile(M, N, BLOCK_M, BLOCK_N)
    offs_r = tl.arange(0, R_PAD)
    h = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)
    for s in range(SPLIT_K):
        h += tl.load(part_ptr + (s * M + offs_m[:, None]) * R_PAD + offs_r[None, :], mask=mask_m[:, None], other=0.0)
    _add_up(h, b_ptr, y_ptr, out_ptr, offs_m, offs_n, mask_m, mask_n, R, stride_bn, stride_br, stride_ym, stride_yn,
            stride_om, stride_on, scale, R_PAD, DOT_PRECISION)


@triton.jit
def _decode_fused_kernel(
    # pointers
    x_ptr, a_ptr, b_ptr, y_ptr, out_ptr,
    # sizes
    M, N, K, R,
    # strides
    stride_xm, stride_xk, stride_ar, stride_ak, stride_bn, stride_br, stride_ym, stride_yn, stride_om, stride_on,
    # scalars
    scale,
    # meta
    R_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """out tile = y tile + s * (x[rows] @ A.T) @ B[tile].T in one launch: every program computes
    the whole h of its rows (all of x and A, from L2 after the first), then its tile. For eager
    decoding, which host time bounds: one launch where the split pair takes two."""
    offs_m, offs_n, mask_m, mask_n = _tile(M, N, BLOCK_M, BLOCK_N)
    h = _h_over(x_ptr, a_ptr, offs_m, mask_m, 0, K, R, stride_xm, stride_xk, stride_ar, stride_ak, R_PAD, BLOCK_M,
                BLOCK_K, DOT_PRECISION)
    _add_up(h, b_ptr, y_ptr, out_ptr, offs_m, offs_n, mask_m, mask_n, R, stride_bn, stride_br, stride_ym, stride_yn,
            stride_om, stride_on, scale, R_PAD, DOT_PRECISION)


@triton.jit
def _decode_linear_kernel(
    # pointers (bias_ptr unused without HAS_BIAS)
    x_ptr, w_ptr, bias_ptr, a_ptr, b_ptr, out_ptr,
    # sizes
    M, N, K, R,
    # strides
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ar, stride_ak, stride_bn, stride_br, stride_om, stride_on,
    # scalars
    scale,
    # meta
    HAS_BIAS: tl.constexpr, R_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """out tile = x[rows] @ W[tile].T + bias[tile] + s * (x[rows] @ A.T) @ B[tile].T: the base GEMM
    and the LoRA in one launch, for eager decoding (bound by host time per launch: this is the
    base model's one launch per linear). One pass over K reads each x tile once for both W and
    A; the base GEMM is rounded to x's dtype before the LoRA is added, as ``F.linear`` then
    ``addmm`` would."""
    dtype = out_ptr.dtype.element_ty
    offs_m, offs_n, mask_m, mask_n = _tile(M, N, BLOCK_M, BLOCK_N)
    offs_r = tl.arange(0, R_PAD)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    h = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x, wt, offs_k, mask_k = _x_w_tiles(x_ptr, w_ptr, offs_m, offs_n, mask_m, mask_n, k0, K, stride_xm, stride_xk,
                                           stride_wn, stride_wk, BLOCK_K)
        acc = tl.dot(x, wt, acc, input_precision=DOT_PRECISION)
        at = tl.load(a_ptr + offs_r[None, :] * stride_ar + offs_k[:, None] * stride_ak,
                     mask=(offs_r[None, :] < R) & mask_k[:, None], other=0.0)  # (BLOCK_K, R_PAD)
        h = tl.dot(x, at.to(x.dtype), h, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    base = acc.to(dtype).to(tl.float32)
    out = base + scale * _up(h, b_ptr, offs_n, mask_n, R, stride_bn, stride_br, dtype, R_PAD, DOT_PRECISION)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on, out.to(dtype),
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _multi_decode_shrink_kernel(
    # pointers: x, up to four siblings' stacked A (n, R_i, K; unused ones repeat a0), one id per
    # segment of S rows, the partials
    x_ptr, a0_ptr, a1_ptr, a2_ptr, a3_ptr, ids_ptr, part_ptr,
    # sizes: each sibling's rank
    M, K, R0, R1, R2, R3, S,
    # strides (every stack has the same; part is contiguous fp32 (siblings, SPLIT_K, M, R_PAD))
    stride_xm, stride_xk, stride_ag, stride_ar, stride_ak,
    # meta
    R_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """part[sib, split, rows of slot g] = x[rows, chunk] @ A_sib[g][:, chunk].T, the grid (slot,
    split, sibling): siblings over one x (q/k/v, gate/up) in one launch.

    Each slot's factors are read once, by its own programs, for every row that takes it (row m's
    slot is ids[m // S]); a program whose slot no row takes does nothing. Rows of slot -1 are not
    written: the readers (``_multi_decode_linear_kernel``, the grouped expand) skip them."""
    g = tl.program_id(0)
    pid_k = tl.program_id(1)
    sib = tl.program_id(2)
    a_ptr, R = _sibling(sib, a0_ptr, a1_ptr, a2_ptr, a3_ptr, R0, R1, R2, R3)
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, R_PAD)
    slot = tl.load(ids_ptr + offs_m // S, mask=offs_m < M, other=-1)
    mine = (offs_m < M) & (slot == g)
    if tl.max(mine.to(tl.int32), axis=0) > 0:
        chunk = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
        acc = _h_over(x_ptr, a_ptr + g.to(tl.int64) * stride_ag, offs_m, mine, pid_k * chunk,
                      tl.minimum(pid_k * chunk + chunk, K), R, stride_xm, stride_xk, stride_ar, stride_ak, R_PAD,
                      BLOCK_M, BLOCK_K, DOT_PRECISION)
        rows = (sib * SPLIT_K + pid_k) * M + offs_m
        tl.store(part_ptr + rows[:, None] * R_PAD + offs_r[None, :], acc, mask=mine[:, None])


@triton.jit
def _multi_decode_linear_kernel(
    # pointers (bias_ptr unused without HAS_BIAS)
    x_ptr, w_ptr, bias_ptr, part_ptr, b_ptr, ids_ptr, out_ptr,
    # sizes: rows, outputs, K, rank, rows per segment, slots
    M, N, K, R, S, SLOTS,
    # strides
    stride_xm, stride_xk, stride_wn, stride_wk, stride_bg, stride_bn, stride_br, stride_om, stride_on,
    # scalars
    scale,
    # meta
    HAS_BIAS: tl.constexpr, R_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """out tile = x[rows] @ W[tile].T + bias[tile] + s * h[rows] @ B[slot of each row][tile].T, h
    the sum of ``_multi_decode_shrink_kernel``'s SPLIT_K partials: the base GEMM and every row's
    own adapter in one launch. Rows of slot -1 get the base alone. The epilogue takes the slots
    one at a time: for each slot some row of the block takes, one tensor-core dot of those rows'
    h (the others zeroed) with that slot's B tile, read once. (A gather of each row's B tile, one
    rank column at a time, cost 17.6 us a call on the H200 at 32 rows, 1B widths, against 9.9
    for the one-adapter linear: ``bench/results/generate.csv``, run 8f88.)"""
    dtype = out_ptr.dtype.element_ty
    offs_m, offs_n, mask_m, mask_n = _tile(M, N, BLOCK_M, BLOCK_N)
    offs_r = tl.arange(0, R_PAD)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x, wt, _, _ = _x_w_tiles(x_ptr, w_ptr, offs_m, offs_n, mask_m, mask_n, k0, K, stride_xm, stride_xk, stride_wn,
                                 stride_wk, BLOCK_K)
        acc = tl.dot(x, wt, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    slot = tl.load(ids_ptr + offs_m // S, mask=mask_m, other=-1)
    h = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)
    for s in range(SPLIT_K):
        h += tl.load(part_ptr + (s * M + offs_m[:, None]) * R_PAD + offs_r[None, :],
                     mask=(mask_m & (slot >= 0))[:, None], other=0.0)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, SLOTS):
        rows = mask_m & (slot == g)
        if tl.max(rows.to(tl.int32), axis=0) > 0:
            up += _up(tl.where(rows[:, None], h, 0.0), b_ptr + g * stride_bg, offs_n, mask_n, R,
                      stride_bn, stride_br, dtype, R_PAD, DOT_PRECISION)
    out = acc.to(dtype).to(tl.float32) + scale * up
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on, out.to(dtype),
             mask=mask_m[:, None] & mask_n[None, :])
