"""LoRA linear: fused forward and backward of one adapter on a frozen linear layer.

Math (2-D; the caller flattens leading dims), s = scale, p = dropout_p:
    x (M, K), weight (N, K) any strides, bias (N,) or None, a (R, K), b (N, R), seed int64 (1,)
    d  = x * keep / (1 - p)                 keep[m, k] = hash(seed, m*K + k) >= p  (dropout_hash)
    h  = d @ a.T                            (M, R)  one pass over x                 [fwd_h kernel]
    y  = x @ weight.T + bias + s * h @ b.T  (M, N)  base GEMM; the LoRA dot runs once
                                                    after its K loop                [gemm kernel]
    dh = s * dy @ b  (M, R),  db = s * dy.T @ h  (N, R)   one pass over dy          [bwd_dy kernel]
                                 db's m-block partials: stored and summed [bwd_db kernel], or atomics
    dx = dy @ weight + keep/(1-p) * (dh @ a)     (M, K)   the same GEMM kernel      [gemm kernel]
    da = dh.T @ d                                (R, K)   split-M, atomic reduce    [bwd_da kernel]

The gemm kernel computes, in its own names,
    out (M, N) = lhs (M, K) @ rhs (K, N) [+ bias (N,)] + [mask *] (l_scale * low (M, R)) @ up (R, N)
forward:  lhs = x,  rhs = weight.T, low = h,  up = b.T, l_scale = s, no mask;
backward: lhs = dy, rhs = weight,   low = dh, up = a,   l_scale = 1, mask = keep/(1-p) of (m, n).
On Hopper it is persistent (one program per SM looping over grouped tiles) and reads lhs, rhs
and writes out through device-side TMA descriptors; elsewhere, and under TRITON_INTERPRET=1 for
the CPU tests, the same kernel runs with plain masked pointer loads (USE_TMA=False).
R is padded to R_PAD = max(16, next power of two) inside the kernels with masks (tl.dot needs
16). Accumulation is fp32 everywhere; dh, da, db are reduced in fp32 buffers and cast at the end.

The skinny kernels can load their big operand through TMA descriptors too (config USE_TMA).
Every launch goes through ``_launch.LaunchSite``, which calls the compiled kernel directly after
the first launch per specialization (~14 us of host time instead of ~27 us on the H200 machine).

``impl="auto"`` asks ``_dispatch.choose`` per phase: "triton" runs the kernels here, "addmm"
runs cuBLAS (F.linear / torch.mm) with the LoRA term added by ``addmm_``.
"""
from __future__ import annotations

import functools
import os
import warnings
from typing import Any, Optional

import torch
import triton
import triton.language as tl

from fastaf.kernels import _cache, _dispatch, _launch
from fastaf.kernels.dropout_hash import keep_mask
from fastaf.kernels.dropout_hash_triton import dropout_keep

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_RANK = 256  # R_PAD > 256 leaves no registers for the (BLOCK_M, R_PAD) accumulators

# ----------------------------------------------------------------------------------------------
# Config generators. A config is a plain dict (JSON-friendly for the tuning cache): the kernel's
# constexpr block sizes plus num_warps / num_stages.
# ----------------------------------------------------------------------------------------------


def smem_bytes(phase: str, conf: dict, r_pad: int, elt: int) -> int:
    """Shared memory a config of ``phase`` needs at padded rank ``r_pad``: the pipelined tiles.

    The skinny kernels' tiles grow with R_PAD, so a config tuned at r=16 can overflow at r=64:
    fwd_h 64x256 with 4 stages takes 4 * (64*256 + 64*256) * 2 = 262144 bytes at R_PAD=64 (H100
    limit 232448), which a nearest-shape cache lookup once handed to an r=64 launch.
    """
    st = conf["num_stages"]
    if phase in ("gemm", "gemm_plain"):
        # triton 3.6 keeps the out tile apart from the pipeline buffers: the default 128x256x64
        # 3-stage config took 213016 bytes on the H100, 3 * 49152 + 65536 (+ 24). gemm_plain
        # stores y from registers: counting its out tile too only errs on the safe side
        bm, bn, bk = conf["BLOCK_M"], conf["BLOCK_N"], conf["BLOCK_K"]
        return (st * (bm * bk + bk * bn) + bm * bn) * elt
    if phase == "fwd_h":
        return st * (conf["BLOCK_M"] + r_pad) * conf["BLOCK_K"] * elt
    if phase == "bwd_dy":
        return st * (conf["BLOCK_M"] + r_pad) * conf["BLOCK_N"] * elt + conf["BLOCK_M"] * r_pad * elt
    if phase == "bwd_da":
        return st * (conf["BLOCK_M"] * conf["BLOCK_K"] * elt + r_pad * conf["BLOCK_M"] * 4)  # dh tile is fp32
    return 0


def fit(phase: str, conf: dict, r_pad: int, elt: int, limit: int) -> dict | None:
    """``conf`` with ``num_stages`` lowered (not below 2) until ``smem_bytes`` fits ``limit``.

    None when even 2 stages do not fit.
    """
    conf = dict(conf)
    while smem_bytes(phase, conf, r_pad, elt) > limit:
        if conf["num_stages"] <= 2:
            return None
        conf["num_stages"] -= 1
    return conf


_FLAGS = ("USE_TMA", "DB_PARTIAL")  # 0/1 switches
_POW2 = ("BLOCK", "num_warps")  # BLOCK_* are tl.arange extents; warps come in powers of two


def config_problem(conf: dict) -> str | None:
    """Why a cached config cannot be launched (``BLOCK_M: 0``, ``num_warps: "eight"``), or None."""
    for key, value in conf.items():
        if type(value) is not int:  # bool and float are not configs either
            return f"{key}={value!r} is not an int"
        if key in _FLAGS:
            if value not in (0, 1):
                return f"{key}={value} is not 0 or 1"
        elif value < 1:
            return f"{key}={value} is not positive"
        elif key.startswith(_POW2) and value & (value - 1):
            return f"{key}={value} is not a power of two"
    return None


def gemm_configs(elt: int = 2) -> list[dict]:
    """Pruned gemm configs for Hopper (228 KB shared memory per SM).

    Tried and dropped on the H100 (triton 3.6):
    - ``tl.range(..., flatten=True)`` over the tile loop (Triton's Hopper persistent-matmul
      tutorial): its 128x256x64 / 256x128x64 3-stage configs ran out of shared memory and the
      ones that fit never won at any BENCH.md shape.
    - h = x @ a.T made inside the forward gemm (no fwd_h pass): the first tile of each row
      block also accumulated x_tile @ a_tile.T in its K loop, stored h and set a ready flag
      (release); the other tiles of the row waited on the flag (acquire) before their LoRA
      dot; those first tiles were scheduled before all others. Correct on the GPU, but a
      producer tile ran 1.20x a plain one at r=16 (every tile a producer: 90.0 vs 75.2 us;
      its r / BLOCK_N share of the MMA work predicts 1.06x) and its a tiles push r=64 to 2
      stages, so the first wave's wait ate the saved pass. Fused over
      fwd_h + gemm, best config each: 1.00 at 8192x4096x4096 r=16, 0.98 at 8192x4096x14336
      r=16, 1.09 at 2048x4096x4096 r=16, 1.11 and 1.09 at the two r=64 shapes
      (bench/results/diag-fused-h-nvidia-h100-80gb-hbm3.json). Its spin-wait also deadlocks
      when not every program is resident (MPS or green-context SM limits): not worth ~2% at
      one shape.
    - Two flags on the 128x256x64 tile: the h and u loads issued before the K loop instead of
      after it, and y stored in two TMA halves so a 4th stage fits (229376 bytes). In one
      interleaved CUDA-graph A/B over the 24 gemm shapes of the BENCH.md set at M >= 8192
      (old picks against picks made with the flags in the search), neither moved our gemm's
      ratio to cuBLAS beyond the +-2% noise; the 4-stage split store averaged ~1% slower.
      (bench/results/diag-gemm-nvidia-h100-80gb-hbm3.json holds the first comparison.)
    """

    def keep(conf: dict) -> bool:
        bm, bn = conf["BLOCK_M"], conf["BLOCK_N"]
        if smem_bytes("gemm", conf, 16, elt) > 220 * 1024:
            return False
        # a 128x256 fp32 accumulator is 256 registers/thread at 4 warps: spills
        if bm * bn >= 128 * 256 and conf["num_warps"] < 8:
            return False
        return not (bm * bn <= 128 * 128 and conf["num_warps"] > 4 and bm < 256)

    out = []
    for bm, bn, bk in ((128, 256, 64), (128, 128, 64), (128, 128, 128), (256, 128, 64), (128, 256, 128)):
        for stages in (3, 4, 5):
            for warps in (4, 8):
                conf = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk if elt == 2 else bk // 2,
                            GROUP_M=8, num_warps=warps, num_stages=stages)
                if keep(conf) and conf not in out:
                    out.append(conf)
    return out


def fwd_h_configs() -> list[dict]:
    """Skinny x @ a.T: bandwidth-bound, small BLOCK_M so M=2048 still fills 132 SMs.

    USE_TMA=1 loads x (and a) through device-side TMA descriptors (needs 16-byte strides; the
    launcher falls back to pointer loads otherwise).
    """
    out = []
    for tma in (0, 1):
        for bm, bk in ((32, 128), (32, 256), (64, 128), (64, 256), (128, 128)):
            for stages in (3, 4):
                for warps in ((4, 8) if bm * bk >= 128 * 128 else (4,)):
                    out.append(dict(BLOCK_M=bm, BLOCK_K=bk, USE_TMA=tma, num_warps=warps, num_stages=stages))
    return out


def bwd_dy_configs() -> list[dict]:
    """One pass over dy; SPLIT_N trades db partials (M/BLOCK_M * N * R) for dh atomics (SPLIT_N * M * R).

    DB_PARTIAL=1 stores each m-block's db partial (plain stores) and sums them in a second small
    kernel; DB_PARTIAL=0 adds them into one fp32 buffer with atomics.
    """
    out = []
    for tma in (0, 1):
        for partial in (0, 1):
            for bm, bn in ((128, 64), (256, 64), (128, 128)):
                for split in ((1, 2, 4) if bm == 128 else (2, 4, 8)):
                    for warps in ((4, 8) if bm * bn >= 256 * 64 else (4,)):
                        out.append(dict(BLOCK_M=bm, BLOCK_N=bn, SPLIT_N=split, USE_TMA=tma, DB_PARTIAL=partial,
                                        num_warps=warps, num_stages=3))
    return out


def bwd_da_configs() -> list[dict]:
    """dh.T @ d: split M over SPLIT_M programs per K block, reduced with fp32 atomics."""
    out = []
    for tma in (0, 1):
        for bm, bk in ((64, 64), (64, 128), (128, 128), (64, 256)):
            for split in (4, 8, 16):
                for warps in ((4, 8) if bm * bk >= 128 * 128 else (4,)):
                    out.append(dict(BLOCK_M=bm, BLOCK_K=bk, SPLIT_M=split, USE_TMA=tma, num_warps=warps,
                                    num_stages=3))
    return out


CONFIGS = {"gemm": gemm_configs, "fwd_h": fwd_h_configs, "bwd_dy": bwd_dy_configs, "bwd_da": bwd_da_configs}

# Untuned defaults on CUDA. gemm: 128x256x64, 3 stages, 8 warps is the best Hopper bf16 config of
# Triton's persistent-matmul tutorial and of the BENCH.md sweep (1.00-1.05x cuBLAS on H200).
DEFAULTS = {
    "gemm": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    "gemm_plain": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=3),
    # skinny kernels: the most frequent fastaf-tune winners on H200 (triton 3.6), e.g. fwd_h 28.8 us,
    # bwd_dy 45.6 us, bwd_da 32.0 us at M=8192 K=N=4096 r=64; TMA loads and db partials won only
    # at a few shapes (bwd_dy M<=8192 N=4096 r=16: 48.8 vs 53.4 us)
    "fwd_h": dict(BLOCK_M=64, BLOCK_K=128, USE_TMA=0, num_warps=4, num_stages=4),
    "bwd_dy": dict(BLOCK_M=256, BLOCK_N=64, SPLIT_N=4, USE_TMA=0, DB_PARTIAL=0, num_warps=4, num_stages=3),
    "bwd_da": dict(BLOCK_M=64, BLOCK_K=128, SPLIT_M=8, USE_TMA=0, num_warps=4, num_stages=3),
    "bwd_db": dict(BLOCK=1024, num_warps=4, num_stages=1),
}
# fp32 tiles take twice the shared memory: 128x256x64 x 3 stages needed 393 KB (limit 227 KB).
DEFAULTS_FP32 = {
    "gemm": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, num_warps=8, num_stages=3),
    "gemm_plain": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, num_warps=8, num_stages=3),
}
# TRITON_INTERPRET=1 (CPU tests): small blocks so odd shapes exercise every tail and the
# persistent loop runs more than one tile per program.
INTERPRET = {
    "gemm": dict(BLOCK_M=32, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=1),
    "fwd_h": dict(BLOCK_M=16, BLOCK_K=32, USE_TMA=0, num_warps=4, num_stages=1),
    "bwd_dy": dict(BLOCK_M=16, BLOCK_N=16, SPLIT_N=2, USE_TMA=0, DB_PARTIAL=1, num_warps=4, num_stages=1),
    "bwd_da": dict(BLOCK_M=16, BLOCK_K=32, SPLIT_M=2, USE_TMA=0, num_warps=4, num_stages=1),
    "bwd_db": dict(BLOCK=64, num_warps=4, num_stages=1),
}
_INTERPRET_PROGRAMS = 2  # persistent grid size under the interpreter

# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


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
        acc = tl.dot(x, at, acc, input_precision=DOT_PRECISION)
    if HAS_DROPOUT:
        acc = acc * (1.0 / (1.0 - dropout_p))
    tl.store(h_ptr + offs_m[:, None] * stride_hm + offs_r[None, :] * stride_hr,
             acc.to(h_ptr.dtype.element_ty), mask=mask_m[:, None] & (offs_r[None, :] < R))


@triton.jit
def _lora_linear_gemm_kernel(
    # pointers
    x_ptr, w_ptr, h_ptr, u_ptr, bias_ptr, seed_ptr, y_ptr,
    # sizes
    M, N, K, R,
    # strides
    stride_xm, stride_xk, stride_wk, stride_wn, stride_hm, stride_hr, stride_ur, stride_un,
    stride_ym, stride_yn,
    # scalars
    NUM_PROGRAMS, l_scale, dropout_p,
    # meta
    HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, USE_TMA: tl.constexpr,
    W_K_CONTIG: tl.constexpr, R_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Persistent y = x @ w + [bias] + [mask *] (l_scale * h) @ u, one (BLOCK_M, BLOCK_N) tile at a time.

    x (M, K), w (K, N), h (M, R), u (R, N) by strides; y (M, N). The LoRA dot runs after the K
    loop so the main loop stays pipelined (BENCH.md: before the loop it halved the speed).
    USE_TMA needs unit stride on x's K, y's N and one of w's dims (W_K_CONTIG: w's K).
    """
    dtype = y_ptr.dtype.element_ty
    start = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    if USE_TMA:
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
        if W_K_CONTIG:  # w is (N, K) row-major in memory: load (BLOCK_N, BLOCK_K), transpose
            w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[stride_wn, 1],
                                               block_shape=[BLOCK_N, BLOCK_K])
        else:
            w_desc = tl.make_tensor_descriptor(w_ptr, shape=[K, N], strides=[stride_wk, 1],
                                               block_shape=[BLOCK_K, BLOCK_N])
        y_desc = tl.make_tensor_descriptor(y_ptr, shape=[M, N], strides=[stride_ym, 1],
                                           block_shape=[BLOCK_M, BLOCK_N])
    for tile_id in range(start, num_tiles, NUM_PROGRAMS):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        offs_m = (off_m + tl.arange(0, BLOCK_M)).to(tl.int64)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
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
                    mask=mask_n[:, None] & mask_r[None, :], other=0.0)  # (BLOCK_N, R_PAD)
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


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available(x: torch.Tensor) -> bool:
    """True when the Triton path can run on ``x``: CUDA tensor, or CPU tensor under TRITON_INTERPRET=1."""
    return x.is_cuda or (x.device.type == "cpu" and _interpret())


def _r_pad(r: int) -> int:
    return max(16, triton.next_power_of_2(r))


def _dot_precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"  # ignored by tl.dot for 16-bit operands


@functools.lru_cache(maxsize=None)
def _device_info(index: int) -> tuple[str, int, int, int]:
    """(name, SM count, compute capability major, shared memory per block in bytes)."""
    props = torch.cuda.get_device_properties(index)
    smem = getattr(props, "shared_memory_per_block_optin", 0) or 227 * 1024  # Hopper: 227 KB
    return props.name, props.multi_processor_count, props.major, smem


def _smem_limit(device: torch.device) -> int:
    return _device_info(device.index)[3] if device.type == "cuda" else 1 << 30


def _torch_scratch(size: int, alignment: int, stream: Optional[int]) -> torch.Tensor:
    return torch.empty(size, device="cuda", dtype=torch.int8)


def _ensure_allocator() -> None:
    """Device-side TMA descriptors need global scratch; Triton gets it from this allocator.

    Set before every launch, not once: Triton keeps the allocator in a ContextVar, and the
    backward runs on autograd's own thread, where a once-set allocator is not visible.
    """
    triton.set_allocator(_torch_scratch)


def _tma_ready(*views: tuple[torch.Tensor, int]) -> bool:
    """Every (tensor, unit-stride dim) pair is TMA-addressable: 16-byte base and other strides."""
    for t, dim in views:
        if t.stride(dim) != 1 or t.data_ptr() % 16:
            return False
        if any((s * t.element_size()) % 16 for d, s in enumerate(t.stride()) if d != dim):
            return False
    return True


def _tma_2d(t: torch.Tensor, dim: int) -> bool:
    """A 2-D tensor with unit stride on ``dim`` is TMA-addressable: 16-byte base and other stride."""
    return (t.stride(dim) == 1 and (t.stride(1 - dim) * t.element_size()) % 16 == 0
            and t.data_ptr() % 16 == 0)


def _rows_tma_ready(t: torch.Tensor) -> bool:
    """The skinny kernels' x, a, dy: unit stride on dim 1, TMA-addressable."""
    return _tma_2d(t, 1)


def _key(**kw: Any) -> dict:
    return {k: (str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else v) for k, v in kw.items()}


def _gemm_key(M: int, N: int, K: int, R: int, dtype: torch.dtype, w_kn: torch.Tensor) -> dict:
    """Cache key of the gemm; ``layout`` tells w's unit-stride dim ("nk": K, as weight.T in forward)."""
    return _key(M=M, N=N, K=K, R=R, dtype=dtype, layout="nk" if w_kn.stride(0) == 1 else "kn")


_config_memo: dict[tuple, dict] = {}
_choice_memo: dict[tuple, str] = {}
_plan_memo: dict[tuple, tuple] = {}


def clear_memos() -> None:
    """Forget memoized configs, launch plans and dispatch choices (after the tuning cache changed)."""
    _config_memo.clear()
    _choice_memo.clear()
    _plan_memo.clear()
    _cache.forget()


def _config(phase: str, device: torch.device, key: dict, override: Optional[dict] = None) -> dict:
    """Override, else the tuning cache's nearest entry, else the default for ``phase``.

    A cached config may predate a meta-parameter (USE_TMA, DB_PARTIAL): the default fills it in.
    A cached config tuned at another shape may not fit this one's shared memory (``fit``): its
    stages are lowered, else the default (fitted the same way) is used.
    """
    if override is not None:
        return override
    if device.type != "cuda":
        return INTERPRET["gemm" if phase == "gemm_plain" else phase]
    if key.get("dtype") == "float32" and phase.startswith("gemm"):
        phase_default = DEFAULTS_FP32[phase]
    else:
        phase_default = DEFAULTS[phase]
    memo_key = (phase, device.index, tuple(sorted(key.items())))
    conf = _config_memo.get(memo_key)
    if conf is None:
        entry = _cache.lookup("kernels", f"lora_linear.{phase}", key)
        conf = entry["config"] if entry is not None and isinstance(entry.get("config"), dict) else phase_default
        # the default's keys exactly: it fills in a meta-parameter the entry predates, and a key
        # this version's kernel does not take (a cache from another fastaf) is dropped
        conf = {k: conf.get(k, v) for k, v in phase_default.items()}
        problem = config_problem(conf)
        if problem is not None:  # memoized below: one warning per phase and shape
            warnings.warn(f"fastaf: ignoring the tuning cache's lora_linear.{phase} config for "
                          f"{key}: {problem}; using the default", stacklevel=2)
            conf, entry = dict(phase_default), None
        if entry is None or entry.get("key") != key:  # borrowed from another shape: may not fit this one
            fits = functools.partial(fit, phase, r_pad=_r_pad(key.get("R", 1)), limit=_smem_limit(device),
                                     elt=4 if key.get("dtype") == "float32" else 2)
            conf = fits(conf) or fits(phase_default) or phase_default
        _config_memo[memo_key] = conf
    return conf


def _plan(memo_key: Optional[tuple], build) -> tuple:
    """Memoized launch plan (grid, meta, meta_key, ...) of one launcher; ``memo_key=None``: no memo."""
    if memo_key is None:
        return build()
    plan = _plan_memo.get(memo_key)
    if plan is None:
        plan = _plan_memo[memo_key] = build()
    return plan


def _meta(**meta: Any) -> tuple[dict, tuple]:
    """Kernel meta-parameters and their hashable key for the launch site."""
    return meta, tuple(meta.items())


def _check(name: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype) -> None:
    if t.dtype not in _DTYPES:
        raise ValueError(f"lora_linear: {name} has unsupported dtype {t.dtype} (shape {tuple(t.shape)}); "
                         "expected float16, bfloat16 or float32")
    if t.dtype != dtype:
        raise ValueError(f"lora_linear: {name} {tuple(t.shape)} has dtype {t.dtype}, expected {dtype} like x")
    if t.shape != shape:
        raise ValueError(f"lora_linear: {name} has shape {tuple(t.shape)} ({t.dtype}), expected {shape}")


def _check_inputs(x, weight, bias, a, b, dropout_p, seed) -> tuple[int, int, int, int]:
    if x.dim() != 2:
        raise ValueError(f"lora_linear: x must be 2-D (M, K), got shape {tuple(x.shape)} ({x.dtype})")
    if x.dtype not in _DTYPES:
        raise ValueError(f"lora_linear: x has unsupported dtype {x.dtype} (shape {tuple(x.shape)}); "
                         "expected float16, bfloat16 or float32")
    M, K = x.shape
    if weight.dim() != 2 or a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"lora_linear: weight, a, b must be 2-D, got {tuple(weight.shape)}, "
                         f"{tuple(a.shape)}, {tuple(b.shape)}")
    N, R = weight.shape[0], a.shape[0]
    _check("weight", weight, (N, K), x.dtype)
    _check("a", a, (R, K), x.dtype)
    _check("b", b, (N, R), x.dtype)
    if bias is not None:
        _check("bias", bias, (N,), x.dtype)
    if R < 1:
        raise ValueError(f"lora_linear: rank must be >= 1, got a of shape {tuple(a.shape)}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"lora_linear: dropout_p must be in [0, 1), got {dropout_p}")
    if dropout_p > 0 and (seed is None or seed.dtype != torch.int64 or seed.numel() != 1):
        raise ValueError("lora_linear: dropout_p > 0 needs seed, an int64 tensor of shape (1,), got "
                         f"{None if seed is None else (tuple(seed.shape), seed.dtype)}")
    return M, K, N, R


def _choose(impl: str, phase: str, x: torch.Tensor, M: int, K: int, N: int, R: int) -> str:
    if impl == "triton":
        if not available(x):
            raise RuntimeError(f"lora_linear: impl='triton' needs a CUDA tensor or TRITON_INTERPRET=1, "
                               f"got x on {x.device}")
        if R > MAX_RANK:
            raise ValueError(f"lora_linear: the Triton path supports rank <= {MAX_RANK}, got {R}")
        return "triton"
    if impl not in ("auto", "addmm"):
        raise ValueError(f"lora_linear: impl must be 'auto', 'triton' or 'addmm', got {impl!r}")
    if impl == "addmm" or not x.is_cuda or R > MAX_RANK:
        return "addmm"
    # memoized: the cache lookup cost ~0.1 ms of host time per call, which doubled the
    # launch-bound M=2048 K=N=4096 forward (1.98x vs 1.21x base on H200)
    memo_key = (phase, x.device.index, M, K, N, R, x.dtype)
    choice = _choice_memo.get(memo_key)
    if choice is None:
        gpu = _device_info(x.device.index)[0]
        choice = _dispatch.choose("lora_linear", phase, _key(M=M, K=K, N=N, R=R, dtype=x.dtype), gpu)
        _choice_memo[memo_key] = choice
    return choice


def _dropped(x: torch.Tensor, seed: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """dropout(x) in torch (the addmm path): x * keep / (1 - p)."""
    keep = keep_mask(seed, x.shape[0], x.shape[1], dropout_p, x.device)
    return x * keep / (1.0 - dropout_p)


def _num_programs(device: torch.device, tiles: int) -> int:
    if device.type != "cuda":
        return max(1, min(_INTERPRET_PROGRAMS, tiles))
    return max(1, min(_device_info(device.index)[1], tiles))


def _hopper(device: torch.device) -> bool:
    """TMA descriptors can be used: Hopper or newer, or the CPU interpreter."""
    return device.type == "cpu" or _device_info(device.index)[2] >= 9


def _conf_key(config: Optional[dict]) -> tuple:
    return () if config is None else tuple(sorted(config.items()))


def _tf32(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32


def _elt(dtype: torch.dtype) -> int:
    return 4 if dtype == torch.float32 else 2


def _skinny_conf(phase: str, dev: torch.device, key: dict, config: Optional[dict], tma_ok: bool,
                 flags: tuple[str, ...] = ("USE_TMA",)) -> tuple[dict, bool, dict]:
    """(config, whether its USE_TMA applies here, config less the launcher-decided ``flags``)."""
    conf = _config(phase, dev, key, config)
    tma = bool(conf.get("USE_TMA", 0)) and tma_ok and _hopper(dev)
    return conf, tma, {k: v for k, v in conf.items() if k not in flags}


def fwd_h(x: torch.Tensor, a: torch.Tensor, dropout_p: float, seed: Optional[torch.Tensor],
          *, config: Optional[dict] = None) -> torch.Tensor:
    """h = dropout(x) @ a.T, (M, R) in x's dtype. x (M, K), a (R, K)."""
    M, K = x.shape
    R = a.shape[0]
    dev, dtype = x.device, x.dtype
    tma_ok = _rows_tma_ready(x) and _rows_tma_ready(a)
    has_dropout = dropout_p > 0

    def build():
        conf, tma, meta = _skinny_conf("fwd_h", dev, _key(M=M, K=K, R=R, dtype=dtype), config, tma_ok)
        return ((triton.cdiv(M, conf["BLOCK_M"]),), tma,
                *_meta(HAS_DROPOUT=has_dropout, USE_TMA=tma, R_PAD=_r_pad(R),
                       DOT_PRECISION=_dot_precision(dtype), **meta))

    memo = ("fwd_h", dev.index, M, K, R, dtype, has_dropout, tma_ok, _tf32(dtype), _conf_key(config))
    grid, tma, meta, meta_key = _plan(memo, build)
    h = torch.empty((M, R), device=dev, dtype=dtype)
    if tma and x.is_cuda:
        _ensure_allocator()
    _SITES["fwd_h"](grid, (
        x, a, seed if has_dropout else x, h,
        M, K, R,
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), h.stride(0), h.stride(1),
        float(dropout_p),
    ), meta, meta_key)
    return h


def gemm(x: torch.Tensor, w_kn: torch.Tensor, h: torch.Tensor, u_rn: torch.Tensor, bias: Optional[torch.Tensor],
         l_scale: float, dropout_p: float, seed: Optional[torch.Tensor], out_dtype: torch.dtype,
         *, config: Optional[dict] = None, use_tma: Optional[bool] = None) -> torch.Tensor:
    """y = x @ w_kn + bias + [keep/(1-p) *] (l_scale * h) @ u_rn, (M, N) in ``out_dtype``.

    x (M, K); w_kn (K, N) any strides (a transposed view is fine); h (M, R) any float dtype;
    u_rn (R, N) any strides; bias (N,) or None. The dropout mask is that of an (M, N) input.
    """
    M, K = x.shape
    N = w_kn.shape[1]
    R = h.shape[1]
    dev = x.device
    w_k_contig = w_kn.stride(0) == 1
    # y is allocated contiguous below: TMA-ready iff its row stride N * elt is a multiple of 16 bytes
    tma_possible = (_rows_tma_ready(x) and _tma_2d(w_kn, 0 if w_k_contig else 1)
                    and (N * _elt(out_dtype)) % 16 == 0 and _hopper(dev))
    tma = tma_possible if use_tma is None else (use_tma and tma_possible)
    if use_tma and not tma_possible:
        raise ValueError("lora_linear.gemm: use_tma=True but the operands are not TMA-addressable")
    has_bias, has_dropout = bias is not None, dropout_p > 0

    def build():
        phase = "gemm" if tma else "gemm_plain"
        conf = _config(phase, dev, _gemm_key(M, N, K, R, x.dtype, w_kn), config)
        tiles = triton.cdiv(M, conf["BLOCK_M"]) * triton.cdiv(N, conf["BLOCK_N"])
        programs = _num_programs(dev, tiles)
        return ((programs,), programs,
                *_meta(HAS_BIAS=has_bias, HAS_DROPOUT=has_dropout, USE_TMA=tma, W_K_CONTIG=w_k_contig,
                       R_PAD=_r_pad(R), DOT_PRECISION=_dot_precision(x.dtype), **conf))

    memo = ("gemm", dev.index, M, N, K, R, x.dtype, h.dtype, out_dtype, w_k_contig, tma, has_bias, has_dropout,
            _tf32(x.dtype), _conf_key(config))
    grid, programs, meta, meta_key = _plan(memo, build)
    y = torch.empty((M, N), device=dev, dtype=out_dtype)
    if tma and x.is_cuda:
        _ensure_allocator()
    _SITES["gemm"](grid, (
        x, w_kn, h, u_rn, bias if has_bias else x, seed if has_dropout else x, y,
        M, N, K, R,
        x.stride(0), x.stride(1), w_kn.stride(0), w_kn.stride(1), h.stride(0), h.stride(1),
        u_rn.stride(0), u_rn.stride(1), y.stride(0), y.stride(1),
        programs, float(l_scale), float(dropout_p),
    ), meta, meta_key)
    return y


def _bwd_dy_plan(dy: torch.Tensor, R: int, config: Optional[dict]) -> tuple:
    """(grid, partials P or 0, SPLIT_N, use TMA, (bwd_db meta, key), meta, meta_key) of a bwd_dy launch."""
    M, N = dy.shape
    dev, dtype = dy.device, dy.dtype
    tma_ok = _rows_tma_ready(dy)

    def build():
        conf, tma, meta = _skinny_conf("bwd_dy", dev, _key(M=M, N=N, R=R, dtype=dtype), config, tma_ok,
                                       ("USE_TMA", "DB_PARTIAL"))
        partial = bool(conf.get("DB_PARTIAL", 0))
        grid = (triton.cdiv(M, conf["BLOCK_M"]), conf["SPLIT_N"])
        db_conf = INTERPRET["bwd_db"] if dev.type != "cuda" else DEFAULTS["bwd_db"]
        db_meta = _meta(**db_conf)
        return (grid, grid[0] if partial else 0, conf["SPLIT_N"], tma, db_meta,
                *_meta(USE_TMA=tma, DB_PARTIAL=partial, R_PAD=_r_pad(R), DOT_PRECISION=_dot_precision(dtype),
                       **meta))

    return _plan(("bwd_dy", dev.index, M, N, R, dtype, tma_ok, _tf32(dtype), _conf_key(config)), build)


def bwd_dy(dy: torch.Tensor, b: torch.Tensor, h: torch.Tensor, scale: float,
           *, config: Optional[dict] = None, dh: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dh, db) = (s * dy @ b as fp32 (M, R), s * dy.T @ h in b's dtype (N, R)). dy (M, N), b (N, R), h (M, R).

    ``dh``: optional fp32 (M, R) contiguous output, zero-filled by the caller (lets the
    backward zero dh and da with one memset).
    """
    M, N = dy.shape
    R = b.shape[1]
    dev = dy.device
    grid, partials, split, tma, (db_meta, db_meta_key), meta, meta_key = _bwd_dy_plan(dy, R, config)
    if dh is None:
        dh = (torch.empty if split == 1 else torch.zeros)((M, R), device=dev, dtype=torch.float32)
    if partials:
        db_buf = torch.empty((partials, N, R), device=dev, dtype=torch.float32)
    else:
        db_buf = torch.zeros((N, R), device=dev, dtype=torch.float32)
    if tma and dy.is_cuda:
        _ensure_allocator()
    _SITES["bwd_dy"](grid, (
        dy, b, h, dh, db_buf,
        M, N, R,
        dy.stride(0), dy.stride(1), b.stride(0), b.stride(1), h.stride(0), h.stride(1),
        float(scale),
    ), meta, meta_key)
    if not partials:
        return dh, db_buf.to(b.dtype)
    db = torch.empty((N, R), device=dev, dtype=b.dtype)
    _SITES["bwd_db"]((triton.cdiv(N * R, db_meta["BLOCK"]),), (db_buf, db, N * R, partials, float(scale)),
                     db_meta, db_meta_key)
    return dh, db


def _bwd_da_plan(x: torch.Tensor, R: int, has_dropout: bool, config: Optional[dict]) -> tuple:
    """(grid, SPLIT_M, use TMA, meta, meta_key) of a bwd_da launch."""
    M, K = x.shape
    dev, dtype = x.device, x.dtype
    tma_ok = _rows_tma_ready(x)

    def build():
        conf, tma, meta = _skinny_conf("bwd_da", dev, _key(M=M, K=K, R=R, dtype=dtype), config, tma_ok)
        return ((triton.cdiv(K, conf["BLOCK_K"]), conf["SPLIT_M"]), conf["SPLIT_M"], tma,
                *_meta(HAS_DROPOUT=has_dropout, USE_TMA=tma, R_PAD=_r_pad(R), DOT_PRECISION=_dot_precision(dtype),
                       **meta))

    return _plan(("bwd_da", dev.index, M, K, R, dtype, has_dropout, tma_ok, _tf32(dtype), _conf_key(config)), build)


def bwd_da(dh: torch.Tensor, x: torch.Tensor, dropout_p: float, seed: Optional[torch.Tensor],
           *, config: Optional[dict] = None, da: Optional[torch.Tensor] = None) -> torch.Tensor:
    """da = dh.T @ dropout(x) as fp32 (R, K). dh contiguous fp32 (M, R), x (M, K).

    ``da``: optional fp32 (R, K) contiguous output, zero-filled by the caller.
    """
    M, K = x.shape
    R = dh.shape[1]
    has_dropout = dropout_p > 0
    grid, split, tma, meta, meta_key = _bwd_da_plan(x, R, has_dropout, config)
    if da is None:
        da = (torch.empty if split == 1 else torch.zeros)((R, K), device=x.device, dtype=torch.float32)
    if tma and x.is_cuda:
        _ensure_allocator()
    _SITES["bwd_da"](grid, (
        dh, x, seed if has_dropout else x, da,
        M, K, R,
        x.stride(0), x.stride(1),
        float(dropout_p),
    ), meta, meta_key)
    return da


# (kernel, pointer args, int args): the launch sites key on those (see _launch)
_SITES = {
    "fwd_h": _launch.LaunchSite(_lora_linear_fwd_h_kernel, 4, 9),
    "gemm": _launch.LaunchSite(_lora_linear_gemm_kernel, 7, 15),
    "bwd_dy": _launch.LaunchSite(_lora_linear_bwd_dy_kernel, 5, 9),
    "bwd_db": _launch.LaunchSite(_lora_linear_bwd_db_kernel, 2, 2),
    "bwd_da": _launch.LaunchSite(_lora_linear_bwd_da_kernel, 4, 5),
}


def lora_linear_fwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], a: torch.Tensor,
                    b: torch.Tensor, scale: float, dropout_p: float, seed: Optional[torch.Tensor],
                    *, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Forward of the LoRA linear.

    Args:
        x: (M, K) input, float16 / bfloat16 / float32.
        weight: (N, K) frozen weight, any strides (a transposed or tied view is fine).
        bias: (N,) or None.
        a: (R, K) LoRA down-projection.  b: (N, R) LoRA up-projection.
        scale: LoRA scale s.  dropout_p: LoRA dropout probability in [0, 1).
        seed: int64 tensor of shape (1,); may be None when dropout_p == 0.
        impl: "auto" (dispatch table), "triton" (fused kernels) or "addmm" (cuBLAS + addmm_).
    Returns:
        y (M, N) = x @ weight.T + bias + scale * h @ b.T and h (M, R) = dropout(x) @ a.T, x's dtype.
    """
    _check_inputs(x, weight, bias, a, b, dropout_p, seed)
    return lora_linear_fwd_unchecked(x, weight, bias, a, b, scale, dropout_p, seed, impl)


def lora_linear_fwd_unchecked(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                              a: torch.Tensor, b: torch.Tensor, scale: float, dropout_p: float,
                              seed: Optional[torch.Tensor], impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``lora_linear_fwd`` without its input checks, for callers that validated already.

    fastaf's eager op path checks once at the public function: the checks here cost ~10 us of
    host time per call, which counts where M=2048 calls are host-bound.
    """
    (M, K), N, R = x.shape, weight.shape[0], a.shape[0]
    if _choose(impl, "fwd", x, M, K, N, R) == "addmm":
        h = (_dropped(x, seed, dropout_p) if dropout_p > 0 else x) @ a.T  # (M, R)
        y = torch.nn.functional.linear(x, weight, bias)  # (M, N)
        y.addmm_(h, b.T, alpha=scale)
        return y, h
    h = fwd_h(x, a, dropout_p, seed)  # (M, R)
    y = gemm(x, weight.T, h, b.T, bias, scale, 0.0, None, x.dtype)  # (M, N)
    return y, h


def lora_linear_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    h: torch.Tensor, scale: float, dropout_p: float, seed: Optional[torch.Tensor],
                    needs_dx: bool, *, impl: str = "auto") -> tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Backward of the LoRA linear (the frozen weight and bias get no gradient here).

    Args:
        dy: (M, N) output gradient.  x, weight, a, b, scale, dropout_p, seed: as in forward.
        h: (M, R) the forward's second output.
        needs_dx: compute dx; when False the dx GEMM is skipped and None returned.
        impl: "auto", "triton" or "addmm".
    Returns:
        dx (M, K) or None, da (R, K), db (N, R), in x's dtype.
    """
    M, K, N, R = _check_inputs(x, weight, None, a, b, dropout_p, seed)
    _check("dy", dy, (M, N), x.dtype)
    _check("h", h, (M, R), x.dtype)
    return lora_linear_bwd_unchecked(dy, x, weight, a, b, h, scale, dropout_p, seed, needs_dx, impl)


def lora_linear_bwd_unchecked(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, a: torch.Tensor,
                              b: torch.Tensor, h: torch.Tensor, scale: float, dropout_p: float,
                              seed: Optional[torch.Tensor], needs_dx: bool,
                              impl: str) -> tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """``lora_linear_bwd`` without its input checks, for callers that validated already."""
    (M, K), N, R = x.shape, weight.shape[0], a.shape[0]
    if _choose(impl, "bwd", x, M, K, N, R) == "addmm":
        # addmm with beta=0 applies the scale in the GEMM's fp32 epilogue: one launch where
        # mm + mul_ took two (host time at launch-bound M) and one rounding instead of two.
        # With beta=0 torch ignores the added input (documented), so h and b stand in for it.
        dh = torch.addmm(h, dy, b, beta=0, alpha=scale)  # (M, R)
        db = torch.addmm(b, dy.T, h, beta=0, alpha=scale)  # (N, R)
        d = _dropped(x, seed, dropout_p) if dropout_p > 0 else x
        da = torch.mm(dh.T, d)  # (R, K)
        dx = None
        if needs_dx:
            dx = torch.mm(dy, weight)  # (M, K)
            if dropout_p > 0:
                dx += (dh @ a) * keep_mask(seed, M, K, dropout_p, x.device) / (1.0 - dropout_p)
            else:
                dx.addmm_(dh, a)
        return dx, da, db
    # dh (when split over N) and da (when split over M) are atomically reduced: one memset for both
    split_n = _bwd_dy_plan(dy, R, None)[2]
    split_m = _bwd_da_plan(x, R, dropout_p > 0, None)[1]
    work = (torch.zeros if split_n > 1 or split_m > 1 else torch.empty)(
        M * R + R * K, device=x.device, dtype=torch.float32)
    dh, db = bwd_dy(dy, b, h, scale, dh=work[:M * R].view(M, R))  # fp32 (M, R), (N, R) in b's dtype
    da = bwd_da(dh, x, dropout_p, seed, da=work[M * R:].view(R, K))  # fp32 (R, K)
    dx = gemm(dy, weight, dh, a, None, 1.0, dropout_p, seed, x.dtype) if needs_dx else None  # (M, K)
    return dx, da.to(a.dtype), db
