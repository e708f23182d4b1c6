"""Grouped LoRA kernels: many adapters in one batch, one segment of rows per adapter slot.

    y[t] = x[t] @ W.T + bias + s * (x[t] @ A[g].T) @ B[g].T,   g = ids[t // S],  ids[...] = -1: base only

x (T, K) holds ``len(ids)`` segments of S consecutive rows (a batch of ``len(ids)`` examples of S
tokens each, or the vmap axis folded over M rows); A (n, R, K) and B (n, N, R) are the stacked
factors (ranks zero-padded to R by ``fastaf.stack``); ids (len(ids),) int32/int64 stays on the
device: every kernel reads its segment's slot itself, so nothing syncs with the host and the
launches are CUDA-graph safe. This is what SGMV (punica) does for serving, with the backward too.

Jobs, as launches:
- ``fwd``: h = x @ A[g].T (``_multi_h_kernel``, fp32 (T, R)), the base GEMM y = x @ W.T + bias
  (cuBLAS), then y += s * h @ B[g].T (``_multi_expand_kernel``, in place, skipped for -1 rows);
- ``bwd``: dh = s * dy @ B[g] (``_multi_dh_kernel``), dB[g] = s * dy.T @ h and dA[g] = dh.T @ x
  (``_multi_dfactor_kernel``: one program per slot and block sums the slot's segments, so the
  weight gradients take no atomics and come out in the factors' dtype; h and dh themselves are
  summed with atomics when their reduction is split over programs), then
  dx = dy @ W (cuBLAS) += dh @ A[g] (the expand kernel again).
From ``FUSE_MIN_ROWS`` rows, y and dx come from one persistent TMA GEMM with a per-segment LoRA
epilogue (``_multi_gemm_kernel``) instead of cuBLAS plus the expand kernel.

Every kernel's grid is (segment, block within the segment, split): a block never straddles two
segments, so each program does dense tensor-core dots against one adapter's factors. A decode
batch (S = 1) runs 16-row blocks with one live row, K split over programs to fill the GPU; the
factors it reads are what it must read. A one-launch decode kernel (per row, h and the update as
vector FMAs, each program of a row re-reading all of A[g]) was measured slower on the H100: 2.91x
the base GEMM against 1.70x for these kernels, CUDA-graph replays at 64 rows x 1 token.
"""
from __future__ import annotations

from typing import Optional

import torch

from fastaf import _config

from . import launch_sites
from .lora_multi_kernels import (_multi_dfactor_kernel, _multi_dh_kernel, _multi_expand_kernel, _multi_gemm_kernel,
                                 _multi_h_kernel)
from .hardware import _device_info, _ensure_allocator, _hopper, _rows_tma_ready, _tma_2d, available, smem_limit
from .lora_linear_configs import MAX_RANK
from .lora_linear_plan import _MEMOS, _dot_precision, _meta, _tf32, gemm_key, launch_config, padded_rank

# ----------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------

INTERPRET_BLOCKS = dict(BLOCK_K=32, BLOCK_N=16)  # small tiles: odd shapes exercise every tail
# The segment kernels' tiles along K and N, reductions split until FILL programs per SM, and their
# warps: best or within 0.3 us of it at every bench/multi.py case on the H100 (64 x 64 h 11.9 us
# over 32 MB of x, decode h 5.9 and expand 4.4 us over 8 MB of factors each).
CUDA_BLOCKS = dict(BLOCK_K=128, BLOCK_N=128)
FILL = 2
WARPS = 4
# From this many rows, in segments of at least FUSE_MIN_SEGMENT, the fused GEMM replaces cuBLAS + the
# expand kernel (H100: 1.15x vs 1.22x the base at 64 x 64, 1.07x vs 1.17x at 8 x 1024, forward).
# Shorter segments would run one rank dot per segment in each 128-row tile's epilogue: unmeasured.
FUSE_MIN_ROWS = 1024
FUSE_MIN_SEGMENT = 64


def _block_m(S: int) -> int:
    """Rows per block: the segment length rounded up to tl.dot's 16, at most 64 (the skinny
    kernels' (BLOCK_M, R_PAD) accumulators and tiles stay in registers; lora_linear's fwd_h and
    dh defaults use 64 as well)."""
    return min(64, padded_rank(S))


def _blocks(device: torch.device) -> dict:
    return INTERPRET_BLOCKS if device.type != "cuda" else CUDA_BLOCKS


def _splits(device: torch.device, programs: int, steps: int) -> int:
    """Split a loop of ``steps`` blocks over enough programs to fill the GPU twice (<= steps)."""
    if device.type != "cuda":
        return min(2, steps)
    sms = _device_info(device.index)[1]
    return max(1, min(steps, -(-FILL * sms // max(programs, 1))))


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------

# (kernel, pointer args, int args): see launch_sites
SITES = {
    "h": launch_sites.LaunchSite(_multi_h_kernel, 4, 8),
    "expand": launch_sites.LaunchSite(_multi_expand_kernel, 4, 10),
    "dh": launch_sites.LaunchSite(_multi_dh_kernel, 4, 8),
    "dfactor": launch_sites.LaunchSite(_multi_dfactor_kernel, 4, 9),
    "gemm": launch_sites.LaunchSite(_multi_gemm_kernel, 7, 13),
}


def supported(x: torch.Tensor, a: torch.Tensor) -> bool:
    """The grouped kernels can run on x with a stack of rank ``a.shape[1]``."""
    return available(x) and x.dtype in (torch.float16, torch.bfloat16, torch.float32) and a.shape[1] <= MAX_RANK


# Launch plans are memoized per shape: each launcher runs once per adapted layer per step, and
# building grids and meta dicts cost ~10 us of host time per call (triton.cdiv and
# next_power_of_2 are constexpr functions in triton 3.6: a few us per host call).
_plans: dict[tuple, tuple] = {}
_MEMOS.append(_plans)  # fastaf-tune's clear_memos forgets them with lora_linear's (the fused GEMM reads tuned tiles)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _common(dtype: torch.dtype, R: int) -> dict:
    return dict(R_PAD=padded_rank(R), DOT_PRECISION=_dot_precision(dtype))


def fit_tiles(tiles, stages: int, block: int, limit: int) -> tuple[int, int]:
    """(num_stages, block) whose pipelined tiles, ``stages * tiles(block)`` bytes, fit ``limit``:
    stages lowered to 2 first, then the reduction block halved (not below 16).

    At the top ranks the factor's (block, R_PAD) tile dominates: at R_PAD=256, three stages of the
    h kernel's (64, 128) x and (128, 256) A tiles took 245760 bytes with bf16 factors and 376832
    with fp32 ones on the H100 (limit 232448): a vmap over a rank-256 stack raised OutOfResources.
    """
    while stages * tiles(block) > limit:
        if stages > 2:
            stages -= 1
        elif block > 16:
            block //= 2
        else:
            break  # the smallest tiles: let Triton say what it needs
    return stages, block


def _split_plan(name: str, dev: torch.device, dtype: torch.dtype, factor: torch.dtype, S: int, n_seg: int,
                L: int, R: int, block: str) -> tuple:
    """(grid, meta, key) of a segment kernel that reduces over L in blocks of ``block`` (BLOCK_K
    or BLOCK_N), split over ``SPLIT_K`` / ``SPLIT_N`` programs to fill the GPU. Per step of its
    loop it pipelines a (BLOCK_M, block) tile of x or dy (``dtype``) and a (block, R_PAD) tile of
    the factor (``factor``: fp32 masters are read as they are)."""
    memo = (name, dev, dtype, factor, _tf32(dtype), S, n_seg, L, R)
    plan = _plans.get(memo)
    if plan is None:
        bm = _block_m(S)
        per_col = bm * dtype.itemsize + padded_rank(R) * factor.itemsize
        stages, bl = fit_tiles(lambda b: per_col * b, 3, _blocks(dev)[block], smem_limit(dev))
        split = _splits(dev, n_seg * _cdiv(S, bm), _cdiv(L, bl))
        plan = _plans[memo] = ((n_seg, _cdiv(S, bm), split), *_meta(
            BLOCK_M=bm, **{block: bl, "SPLIT_" + block[-1]: split}, num_warps=WARPS, num_stages=stages,
            **_common(dtype, R)))
    return plan


def _rank_rows(T: int, R: int, grid: tuple, dev: torch.device) -> torch.Tensor:
    """An fp32 (T, R) output: a split kernel adds into zeros, an unsplit one stores every row."""
    return (torch.empty if grid[2] == 1 else torch.zeros)((T, R), device=dev, dtype=torch.float32)


def shrink(x: torch.Tensor, a: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """h = x @ A[g].T as fp32 (T, R), zero on -1 segments. x (T, K), a (n, R, K), ids (T // S,)."""
    T, K = x.shape
    R, n_seg = a.shape[1], ids.shape[0]
    S = T // n_seg
    grid, meta, key = _split_plan("h", x.device, x.dtype, a.dtype, S, n_seg, K, R, "BLOCK_K")
    h = _rank_rows(T, R, grid, x.device)
    SITES["h"](grid, (x, a, ids, h, S, K, R, x.stride(0), x.stride(1), *a.stride()), meta, key)
    return h


def expand_(y: torch.Tensor, h: torch.Tensor, u: torch.Tensor, ids: torch.Tensor, scale: float) -> torch.Tensor:
    """y += s * h @ u[g] in place, per segment. y (T, N), u (n, R, N) any strides; h fp32 (T, R),
    or the (SPLIT, T, >= R) partials of a split shrink, summed here (``kernels.lora_decode.
    multi_shrink``'s: no zeroed buffer, no atomics), each with the rank at unit stride."""
    T, N = y.shape
    parts = h if h.dim() == 3 else h.unsqueeze(0)  # (SPLIT, T, >= R)
    R, n_seg, split = u.shape[1], ids.shape[0], parts.shape[0]
    S = T // n_seg
    memo = ("expand", y.device, y.dtype, _tf32(y.dtype), S, n_seg, N, R, split)
    plan = _plans.get(memo)
    if plan is None:
        bm, bn = _block_m(S), _blocks(y.device)["BLOCK_N"]
        plan = _plans[memo] = ((n_seg, _cdiv(S, bm), _cdiv(N, bn)), *_meta(
            BLOCK_M=bm, BLOCK_N=bn, SPLIT=split, num_warps=WARPS, num_stages=2, **_common(y.dtype, R)))
    grid, meta, key = plan
    SITES["expand"](grid, (h, u, ids, y, S, N, R, parts.stride(0), parts.stride(1), *u.stride(), y.stride(0),
                           y.stride(1), float(scale)), meta, key)
    return y


def fused_ok(x: torch.Tensor, w_kn: torch.Tensor) -> bool:
    """The persistent TMA GEMM can run: Hopper (or the interpreter), 16-byte rows everywhere."""
    return (_hopper(x.device) and _rows_tma_ready(x) and (_tma_2d(w_kn, 0) or _tma_2d(w_kn, 1))
            and (w_kn.shape[1] * x.element_size()) % 16 == 0)


def _epilogue_fits(x: torch.Tensor, w_kn: torch.Tensor, u: torch.Tensor) -> bool:
    """The fused GEMM's epilogue tiles fit shared memory: an fp32 (BLOCK_M, R_PAD) tile of h and an
    (R_PAD, BLOCK_N) tile of u. Triton 3.6 sized them at exactly that, 262144 bytes, for 128 x 256
    tiles at R_PAD=256 with bf16 u on the H100 (limit 232448); rank 128 fits."""
    (T, K), N, R, dev = x.shape, w_kn.shape[1], u.shape[1], x.device
    memo = ("epilogue", dev, x.dtype, u.dtype, T, N, K, R)
    fits = _plans.get(memo)
    if fits is None:
        conf = launch_config("gemm", dev, gemm_key(T, N, K, R, x.dtype, w_kn))
        r_pad = padded_rank(R)
        fits = _plans[memo] = (conf["BLOCK_M"] * r_pad * 4 + r_pad * conf["BLOCK_N"] * u.element_size()
                               <= smem_limit(dev))
    return fits


def _fuse(x: torch.Tensor, w_kn: torch.Tensor, ids: torch.Tensor, u: torch.Tensor) -> bool:
    """The dispatch between the fused GEMM and cuBLAS + the expand kernel (FUSE_MIN_*, and the
    fused epilogue's tiles fitting shared memory: up to rank 128). u (n, R, N) as in fused_gemm."""
    forced = _config.flags().multi_fuse  # benchmarks time both paths in one process
    if forced == "unfused":
        return False
    T = x.shape[0]
    measured = forced == "fused" or (T >= FUSE_MIN_ROWS and T // ids.shape[0] >= FUSE_MIN_SEGMENT)
    return measured and fused_ok(x, w_kn) and _epilogue_fits(x, w_kn, u)


def fused_gemm(x: torch.Tensor, w_kn: torch.Tensor, bias: Optional[torch.Tensor], h: torch.Tensor,
               u: torch.Tensor, ids: torch.Tensor, scale: float) -> torch.Tensor:
    """y = x @ w_kn + bias + s * h @ u[g] per segment in one persistent kernel. x (T, K),
    w_kn (K, N) with unit stride on either dim (``weight.T`` in forward, ``weight`` for dx),
    h fp32 (T, R), u (n, R, N) any strides."""
    T, K = x.shape
    N, R = w_kn.shape[1], h.shape[1]
    k_contig = w_kn.stride(0) == 1
    dev = x.device
    memo = ("gemm", dev, x.dtype, _tf32(x.dtype), T, N, K, R, k_contig, bias is not None)
    plan = _plans.get(memo)
    if plan is None:
        conf = launch_config("gemm", dev, gemm_key(T, N, K, R, x.dtype, w_kn))  # lora_linear's tuned tiles
        tiles = _cdiv(T, conf["BLOCK_M"]) * _cdiv(N, conf["BLOCK_N"])
        programs = max(1, min(tiles, 2 if dev.type != "cuda" else _device_info(dev.index)[1]))
        plan = _plans[memo] = ((programs,), *_meta(HAS_BIAS=bias is not None, W_K_CONTIG=k_contig, **conf,
                                                   **_common(x.dtype, R)))
    grid, meta, key = plan
    y = torch.empty((T, N), device=dev, dtype=x.dtype)
    if x.is_cuda:
        _ensure_allocator()
    SITES["gemm"](grid, (
        x, w_kn, h, u, ids, x if bias is None else bias, y,
        T, N, K, R, T // ids.shape[0], ids.shape[0], x.stride(0), w_kn.stride(1 if k_contig else 0), *u.stride(),
        y.stride(0), grid[0], float(scale)), meta, key)
    return y


def multi_fwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], a: torch.Tensor,
              b: torch.Tensor, ids: torch.Tensor, scale: float,
              fused: Optional[bool] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y (T, N) in x's dtype, h fp32 (T, R)). x (T, K), weight (N, K), bias (N,) or None,
    a (n, R, K), b (n, N, R) in x's dtype, ids (T // S,) int32/int64 on x's device."""
    h = shrink(x, a, ids)
    if fused if fused is not None else _fuse(x, weight.T, ids, b.transpose(1, 2)):
        return fused_gemm(x, weight.T, bias, h, b.transpose(1, 2), ids, scale), h
    y = torch.nn.functional.linear(x, weight, bias)
    return expand_(y, h, b.transpose(1, 2), ids, scale), h


def _dfactor(lhs: torch.Tensor, rhs: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, scale: float) -> torch.Tensor:
    """out[g] (C, R) view = s * sum over g's segments of lhs[rows].T @ rhs[rows]; see the kernel."""
    T, C = lhs.shape
    R, n_seg = rhs.shape[1], ids.shape[0]
    S = T // n_seg
    memo = ("dfactor", lhs.device, lhs.dtype, _tf32(lhs.dtype), S, n_seg, C, R, out.shape[0])
    plan = _plans.get(memo)
    if plan is None:
        bm = _block_m(S)
        # per step: a (BLOCK_M, BLOCK_C) tile of lhs and a (BLOCK_M, R_PAD) fp32 tile of rhs
        stages, bc = fit_tiles(lambda c: bm * (c * lhs.element_size() + padded_rank(R) * 4), 3,
                             _blocks(lhs.device)["BLOCK_N"], smem_limit(lhs.device))
        plan = _plans[memo] = ((out.shape[0], _cdiv(C, bc)), *_meta(
            # ids scanned 64 at a time: one vector load each; a popular slot's segments are summed by
            # one program per block (skewed ids serialise there: a known cost, not measured)
            BLOCK_M=bm, BLOCK_C=bc, ID_CHUNK=min(64, padded_rank(n_seg)), num_warps=WARPS, num_stages=stages,
            **_common(lhs.dtype, R)))
    grid, meta, key = plan
    SITES["dfactor"](grid, (lhs, rhs, ids, out, S, n_seg, C, R, lhs.stride(0), lhs.stride(1), *out.stride(),
                             float(scale)), meta, key)
    return out


def _dh(dy: torch.Tensor, b: torch.Tensor, ids: torch.Tensor, scale: float) -> torch.Tensor:
    """dh = s * dy @ B[g] per segment, fp32 (T, R); zeros on -1 segments."""
    T, N = dy.shape
    R, n_seg = b.shape[2], ids.shape[0]
    S = T // n_seg
    grid, meta, key = _split_plan("dh", dy.device, dy.dtype, b.dtype, S, n_seg, N, R, "BLOCK_N")
    dh = _rank_rows(T, R, grid, dy.device)
    SITES["dh"](grid, (dy, b, ids, dh, S, N, R, dy.stride(0), dy.stride(1), *b.stride(), float(scale)), meta, key)
    return dh


def shared_fwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], a: torch.Tensor,
               b: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """G adapters over one shared x (vmap over a stack, x unbatched): (y (G*M, N), h fp32 (G*M, R)).

    h for every adapter is one cuBLAS GEMM against the stacked A (one pass over x); the base GEMM
    runs once and is written G times, then the expand kernel adds each group's up-projection.
    x (M, K), weight (N, K), a (G, R, K), b (G, N, R).
    """
    G, R, K = a.shape
    M = x.shape[0]
    h = (x @ a.reshape(G * R, K).to(x.dtype).T).view(M, G, R).transpose(0, 1).float().reshape(G * M, R)
    y = torch.nn.functional.linear(x, weight, bias).repeat(G, 1)  # (G * M, N)
    return expand_(y, h, b.transpose(1, 2), torch.arange(G, device=x.device), scale), h


def _mm_into(lhs: torch.Tensor, rhs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """lhs @ rhs in ``dtype`` from one cuBLAS GEMM of 16-bit operands: an fp32 result (fp32 master
    factors' gradients) is written by the GEMM's fp32 epilogue, never rounded through lhs's dtype."""
    if dtype == lhs.dtype:
        return lhs @ rhs
    if lhs.is_cuda and dtype == torch.float32 and hasattr(torch.ops.aten.mm, "dtype"):
        return torch.mm(lhs, rhs, out_dtype=dtype)  # torch >= 2.8 on CUDA
    return (lhs.float() @ rhs.float()).to(dtype)  # elsewhere (the interpreter's CPU tests): in fp32


def shared_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               h: torch.Tensor, scale: float, needs_dx: bool) -> tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Backward of ``shared_fwd``: (dx (G*M, K) per group or None, dA (G, R, K) in a's dtype,
    dB (G, N, R) in b's). dA for every adapter is one cuBLAS GEMM against x (fp32 out for fp32
    masters); dh, dB and dx's LoRA part are the kernels'."""
    G, R, K = a.shape
    M = x.shape[0]
    ids = torch.arange(G, device=x.device)
    dh = _dh(dy, b, ids, scale)  # (G * M, R)
    db = _dfactor(dy, h, ids, torch.empty(b.shape, device=b.device, dtype=b.dtype), scale)
    dh_m = dh.view(G, M, R).transpose(0, 1).reshape(M, G * R).to(x.dtype)
    da = _mm_into(dh_m.T, x, a.dtype).view(G, R, K)
    dx = expand_(dy @ weight, dh, a, ids, 1.0) if needs_dx else None
    return dx, da, db


def multi_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              h: torch.Tensor, ids: torch.Tensor, scale: float,
              needs_dx: bool, fused: Optional[bool] = None) -> tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """(dx (T, K) in x's dtype or None, dA (n, R, K) in a's dtype, dB (n, N, R) in b's dtype);
    shapes as in forward. dA and dB are each stored once per slot, without atomics."""
    dh = _dh(dy, b, ids, scale)
    # contiguous outputs whatever the stack's strides (the op's fake promises them)
    db = _dfactor(dy, h, ids, torch.empty(b.shape, device=b.device, dtype=b.dtype), scale)  # (n, N, R)
    da = torch.empty(a.shape, device=a.device, dtype=a.dtype)  # (n, R, K), written through its (n, K, R) view
    _dfactor(x, dh, ids, da.transpose(1, 2), 1.0)
    if not needs_dx:
        return None, da, db
    if fused if fused is not None else _fuse(dy, weight, ids, a):
        return fused_gemm(dy, weight, None, dh, a, ids, 1.0), da, db
    dx = expand_(dy @ weight, dh, a, ids, 1.0)
    return dx, da, db
