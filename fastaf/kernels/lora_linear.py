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
Every launch goes through ``launch_sites.LaunchSite``, which calls the compiled kernel directly after
the first launch per specialization (~14 us of host time instead of ~27 us on the H200 machine).

``impl="auto"`` asks ``dispatch.choose`` per phase: "triton" runs the Triton kernels, "addmm"
runs cuBLAS (F.linear / torch.mm) with the LoRA term added by ``addmm_``.

The family, in reading order: ``lora_linear_configs`` (config spaces, defaults, shared-memory
fit), ``lora_linear_kernels`` (the ``@triton.jit`` kernels), ``lora_linear_plan`` (config choice,
memoized launch plans, dispatch choice) and this module: input checks, the launchers and
``lora_linear_fwd`` / ``lora_linear_bwd``. ``hardware`` says what the GPU offers.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
import triton

from fastaf.kernels import launch_graphs, launch_sites
from fastaf.kernels.hardware import _ensure_allocator, _hopper, _rows_tma_ready, _tma_2d
from fastaf.kernels.hardware import available  # noqa: F401 - fastaf.ops asks lora_linear.available
from fastaf.kernels.dropout_hash import keep_mask
from fastaf.kernels.lora_linear_configs import DEFAULTS, INTERPRET, MAX_RANK
from fastaf.kernels.lora_linear_kernels import (_lora_linear_bwd_da_kernel, _lora_linear_bwd_db_kernel,
                                                _lora_linear_bwd_dy_kernel, _lora_linear_fwd_h_kernel,
                                                _lora_linear_gemm_kernel)
from fastaf.kernels.lora_linear_plan import (_call_plan, _conf_key, _dot_precision, _elt, _key, _meta, _num_programs,
                                             _plan, _skinny_conf, _tf32, aligned, choose_impl, gemm_key, launch_config,
                                             padded_rank)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check(name: str, t: torch.Tensor, shape: tuple, dtype: Optional[torch.dtype]) -> None:
    """``dtype`` None: any of float16 / bfloat16 / float32 (the LoRA factors: fp32 masters are read as they are)."""
    if t.dtype not in _DTYPES:
        raise ValueError(f"lora_linear: {name} has unsupported dtype {t.dtype} (shape {tuple(t.shape)}); "
                         "expected float16, bfloat16 or float32")
    if dtype is not None and t.dtype != dtype:
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
    _check("a", a, (R, K), None)
    _check("b", b, (N, R), None)
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


def _dropped(x: torch.Tensor, seed: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """dropout(x) in torch (the addmm path): x * keep / (1 - p)."""
    keep = keep_mask(seed, x.shape[0], x.shape[1], dropout_p, x.device)
    return x * keep / (1.0 - dropout_p)


def _fwd_h_plan(x: torch.Tensor, a: torch.Tensor, has_dropout: bool, config: Optional[dict]) -> tuple:
    """(grid, use TMA, whether a is read in its own dtype, meta, meta_key) of a fwd_h launch."""
    M, K = x.shape
    R = a.shape[0]
    dev, dtype = x.device, x.dtype
    tma_ok = _rows_tma_ready(x) and _rows_tma_ready(a)

    def build():
        conf, tma, meta, a_fits = _skinny_conf("fwd_h", dev, _key(M=M, K=K, R=R, dtype=dtype), config, tma_ok,
                                               factor=a.dtype)
        tma = tma and (a_fits or K * _elt(dtype) % 16 == 0)  # a cast to x's dtype: rows still 16-byte aligned
        return ((triton.cdiv(M, conf["BLOCK_M"]),), tma, a_fits,
                *_meta(HAS_DROPOUT=has_dropout, USE_TMA=tma, R_PAD=padded_rank(R),
                       DOT_PRECISION=_dot_precision(dtype), **meta))

    return _plan(("fwd_h", dev.index, M, K, R, dtype, a.dtype, has_dropout, tma_ok, _tf32(dtype), _conf_key(config)),
                 build)


def launch_planned(site: launch_sites.LaunchSite, plan: list, slot: int, grid: tuple, args: tuple, meta: dict,
                    meta_key: tuple, *, alike: bool = True) -> None:
    """Launch through ``site``; ``plan[slot]`` keeps the kernel it launched, which the next call
    with the same plan (``call_memo``: the same call signature) relaunches without a key.
    ``alike``: the outputs the plan does not describe (views into a caller's buffer) are 16-byte
    aligned as well, so the call matches the kernel kept; else the site's key decides."""
    entry = plan[slot] if alike else None
    if entry is None or not site.again(entry, grid, args):
        launched = site(grid, args, meta, meta_key)
        if alike:
            plan[slot] = launched


def fwd_h(x: torch.Tensor, a: torch.Tensor, dropout_p: float, seed: Optional[torch.Tensor],
          *, config: Optional[dict] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """h = dropout(x) @ a.T, (M, R) in x's dtype. x (M, K), a (R, K). ``out``: h's contiguous
    (M, R) buffer, allocated by the caller (a graphed call: ``launch_graphs``)."""
    M, K = x.shape
    R = a.shape[0]
    dtype, has_dropout = x.dtype, dropout_p > 0
    # the call's signature: with it the plan is one lookup (~10 us of host time less per launch)
    call = (("fwd_h", x.get_device(), M, K, R, x.stride(), a.stride(), dtype, a.dtype,
             seed.dtype if has_dropout else None, _tf32(dtype))
            if config is None and aligned(x, a, seed) else None)
    plan = _call_plan(call, lambda: _fwd_h_plan(x, a, has_dropout, config))
    grid, tma, a_fits, meta, meta_key, _ = plan
    if not a_fits:  # an fp32 a's tiles fit no config at this rank: read it in x's dtype
        a = a.to(dtype)
    h = torch.empty((M, R), device=x.device, dtype=dtype) if out is None else out
    if tma and x.is_cuda:
        _ensure_allocator()
    xs, as_ = x.stride(), a.stride()
    launch_planned(SITES["fwd_h"], plan, 5, grid, (
        x, a, seed if has_dropout else x, h,
        M, K, R,
        xs[0], xs[1], as_[0], as_[1], R, 1,
        float(dropout_p),
    ), meta, meta_key, alike=out is None or aligned(out))
    return h


def _gemm_plan(x: torch.Tensor, w_kn: torch.Tensor, h: torch.Tensor, out_dtype: torch.dtype, has_bias: bool,
               has_dropout: bool, config: Optional[dict], use_tma: Optional[bool], extra: tuple = ()) -> tuple:
    """(grid, programs, use TMA, meta, meta_key) of a gemm launch; ``extra``: ``gemm``'s."""
    M, K = x.shape
    N = w_kn.shape[1]
    R = h.shape[1]
    dev = x.device
    w_k_contig = w_kn.stride(0) == 1
    w_dim = 0 if w_k_contig else 1
    # y is allocated contiguous: TMA-ready iff its row stride N * elt is a multiple of 16 bytes
    tma_possible = (_rows_tma_ready(x) and _tma_2d(w_kn, w_dim) and (N * _elt(out_dtype)) % 16 == 0 and _hopper(dev)
                    and all(_rows_tma_ready(xj) and _tma_2d(wj, w_dim) for xj, wj in extra))
    tma = tma_possible if use_tma is None else (use_tma and tma_possible)
    if use_tma and not tma_possible:
        raise ValueError("lora_linear.gemm: use_tma=True but the operands are not TMA-addressable")
    k_total = K + sum(xj.shape[1] for xj, _ in extra)  # the segments make one long K loop: tuned as such

    def build():
        phase = "gemm" if tma else "gemm_plain"
        conf = launch_config(phase, dev, gemm_key(M, N, k_total, R, x.dtype, w_kn), config)
        tiles = triton.cdiv(M, conf["BLOCK_M"]) * triton.cdiv(N, conf["BLOCK_N"])
        programs = _num_programs(dev, tiles)
        return ((programs,), programs,
                *_meta(HAS_BIAS=has_bias, HAS_DROPOUT=has_dropout, USE_TMA=tma, W_K_CONTIG=w_k_contig,
                       R_PAD=padded_rank(R), DOT_PRECISION=_dot_precision(x.dtype), NUM_SEG=1 + len(extra), **conf))

    memo = ("gemm", dev.index, M, N, K, R, x.dtype, h.dtype, out_dtype, w_k_contig, tma, has_bias, has_dropout,
            _tf32(x.dtype), _conf_key(config), tuple(xj.shape[1] for xj, _ in extra))
    grid, programs, meta, meta_key = _plan(memo, build)
    return grid, programs, tma, meta, meta_key


def segments_fit(x: torch.Tensor, w_kn: torch.Tensor, extra: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Whether ``gemm`` sums ``extra`` (x_j, w_j) segments beside (x, w_kn) in its launch: at most
    two, each x_j (M, K_j) in x's dtype with unit stride on K_j, each w_j (K_j, N) in w_kn's dtype
    with w_kn's unit-stride dim."""
    M, N, layout = x.shape[0], w_kn.shape[1], w_kn.stride(0) == 1
    return len(extra) <= 2 and all(
        xj.shape[0] == M and xj.stride(1) == 1 and xj.dtype == x.dtype and wj.shape == (xj.shape[1], N)
        and wj.dtype == w_kn.dtype and (wj.stride(0) == 1) == layout for xj, wj in extra)


def gemm(x: torch.Tensor, w_kn: torch.Tensor, h: torch.Tensor, u_rn: torch.Tensor, bias: Optional[torch.Tensor],
         l_scale: float, dropout_p: float, seed: Optional[torch.Tensor], out_dtype: torch.dtype,
         *, config: Optional[dict] = None, use_tma: Optional[bool] = None, lead: tuple = (),
         out: Optional[torch.Tensor] = None, extra: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> torch.Tensor:
    """y = x @ w_kn [+ sum_j x_j @ w_j] + bias + [keep/(1-p) *] (l_scale * h) @ u_rn, (M, N) in ``out_dtype``.

    x (M, K); w_kn (K, N) any strides (a transposed view is fine); h (M, R) any float dtype;
    u_rn (R, N) any strides; bias (N,) or None. The dropout mask is that of an (M, N) input.
    ``extra``: up to two more (x_j (M, K_j) with unit stride on K_j, w_j (K_j, N) with w_kn's
    unit-stride dim) summed in the same launch (siblings' dX: y written once, no add pass).
    ``lead``: y is allocated (*lead, N) instead (prod(lead) == M, contiguous: the same memory),
    which spares a caller's reshape of a flattened input's output. ``out``: y's contiguous buffer
    of that shape, allocated by the caller (a graphed call: ``launch_graphs``).
    """
    M, K = x.shape
    N = w_kn.shape[1]
    R = h.shape[1]
    extra = tuple(extra)
    if extra and not segments_fit(x, w_kn, extra):  # the common call has none: no checks on its host path
        raise ValueError(f"lora_linear.gemm: extra segments must be at most two (x_j (M={M}, K_j) in x's dtype with "
                         f"unit stride on K_j, w_j (K_j, N={N}) in w_kn's dtype and layout); got "
                         f"{[(tuple(xj.shape), xj.stride(), xj.dtype, tuple(wj.shape), wj.stride(), wj.dtype) for xj, wj in extra]}")
    has_bias, has_dropout = bias is not None, dropout_p > 0
    xs, ws, hs, us = x.stride(), w_kn.stride(), h.stride(), u_rn.stride()
    call = (("gemm", x.get_device(), M, N, K, R, xs, ws, hs, us, x.dtype, w_kn.dtype, h.dtype, u_rn.dtype,
             out_dtype, None if bias is None else bias.dtype, seed.dtype if has_dropout else None, _tf32(x.dtype),
             *[(xj.shape[1], xj.stride(), wj.stride(), xj.dtype, wj.dtype) for xj, wj in extra])
            if config is None and use_tma is None and aligned(x, w_kn, h, u_rn, bias, seed, *sum(extra, ()))
            else None)
    plan = _call_plan(call, lambda: _gemm_plan(x, w_kn, h, out_dtype, has_bias, has_dropout, config, use_tma, extra))
    grid, programs, tma, meta, meta_key, _ = plan
    y = torch.empty((*lead, N) if lead else (M, N), device=x.device, dtype=out_dtype) if out is None else out
    if tma and x.is_cuda:
        _ensure_allocator()
    (x2, w2), (x3, w3) = extra + ((x, w_kn),) * (2 - len(extra))  # unused segments: any tensors, K_j = 0
    k2 = x2.shape[1] if len(extra) >= 1 else 0
    k3 = x3.shape[1] if len(extra) >= 2 else 0
    launch_planned(SITES["gemm"], plan, 5, grid, (
        x, w_kn, h, u_rn, bias if has_bias else x, seed if has_dropout else x, y, x2, w2, x3, w3,
        M, N, K, R, k2, k3,
        xs[0], xs[1], ws[0], ws[1], hs[0], hs[1], us[0], us[1], N, 1,
        x2.stride(0), w2.stride(0), w2.stride(1), x3.stride(0), w3.stride(0), w3.stride(1),
        programs, float(l_scale), float(dropout_p),
    ), meta, meta_key, alike=out is None or aligned(out))
    return y


def bwd_dy_plan(dy: torch.Tensor, b: torch.Tensor, h: torch.Tensor, config: Optional[dict]) -> list:
    """[grid, partials P or 0, SPLIT_N, use TMA, whether b is read in its own dtype (else in dy's),
    (bwd_db meta, key), meta, meta_key, bwd_dy's and bwd_db's launched kernels] of a bwd_dy launch,
    memoized per call signature where it can be (``call_memo``)."""
    M, N = dy.shape
    R = b.shape[1]
    dtype, b_dtype = dy.dtype, b.dtype
    call = (("bwd_dy", dy.get_device(), M, N, R, dy.stride(), b.stride(), h.stride(), dtype, b_dtype, h.dtype,
             _tf32(dtype)) if config is None and aligned(dy, b, h) else None)
    return _call_plan(call, lambda: _bwd_dy_launch_plan(dy, R, b_dtype, config), slots=2)


def _bwd_dy_launch_plan(dy: torch.Tensor, R: int, b_dtype: torch.dtype, config: Optional[dict]) -> tuple:
    """``bwd_dy_plan``'s entries before the kernel slots, by config and shape (``_plan``)."""
    M, N = dy.shape
    dev, dtype = dy.device, dy.dtype
    tma_ok = _rows_tma_ready(dy)

    def build():
        conf, tma, meta, b_fits = _skinny_conf("bwd_dy", dev, _key(M=M, N=N, R=R, dtype=dtype), config, tma_ok,
                                               ("USE_TMA", "DB_PARTIAL"), factor=b_dtype)
        partial = bool(conf.get("DB_PARTIAL", 0))
        grid = (triton.cdiv(M, conf["BLOCK_M"]), conf["SPLIT_N"])
        db_conf = INTERPRET["bwd_db"] if dev.type != "cuda" else DEFAULTS["bwd_db"]
        db_meta = _meta(**db_conf)
        return (grid, grid[0] if partial else 0, conf["SPLIT_N"], tma, b_fits, db_meta,
                *_meta(USE_TMA=tma, DB_PARTIAL=partial, R_PAD=padded_rank(R), DOT_PRECISION=_dot_precision(dtype),
                       **meta))

    return _plan(("bwd_dy", dev.index, M, N, R, dtype, b_dtype, tma_ok, _tf32(dtype), _conf_key(config)), build)


def bwd_dy(dy: torch.Tensor, b: torch.Tensor, h: torch.Tensor, scale: float,
           *, config: Optional[dict] = None, dh: Optional[torch.Tensor] = None,
           db_sum: Optional[torch.Tensor] = None, plan: Optional[list] = None,
           db_out: Optional[torch.Tensor] = None, cast: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(dh, db) = (s * dy @ b as fp32 (M, R), s * dy.T @ h in b's dtype (N, R)). dy (M, N), b (N, R), h (M, R).

    ``dh``: optional fp32 (M, R) contiguous output, zero-filled by the caller (lets the
    backward zero dh and da with one memset). ``db_sum``: likewise db's fp32 (N, R) atomic
    accumulator, zero-filled by the caller; used where the plan adds db atomically (no partials).
    ``plan``: ``bwd_dy_plan``'s, when the caller has it. ``db_out``: db's (N, R) buffer in b's
    dtype where the plan sums partials (a graphed call allocates every output before). ``cast``
    False: an atomically summed db comes back fp32 (the graphed caller casts it outside the graph).
    """
    M, N = dy.shape
    R = b.shape[1]
    dev = dy.device
    plan = bwd_dy_plan(dy, b, h, config) if plan is None else plan
    grid, partials, split, tma, b_fits, (db_meta, db_meta_key), meta, meta_key = plan[:8]
    b_dtype = b.dtype  # db comes back in it
    if not b_fits:  # an fp32 b's tiles fit no config at this rank: read it in dy's dtype
        b = b.to(dy.dtype)
    if dh is None:
        dh = (torch.empty if split == 1 else torch.zeros)((M, R), device=dev, dtype=torch.float32)
    if partials:
        db_buf = torch.empty((partials, N, R), device=dev, dtype=torch.float32)
    else:
        db_buf = torch.zeros((N, R), device=dev, dtype=torch.float32) if db_sum is None else db_sum
    if tma and dy.is_cuda:
        _ensure_allocator()
    ds, bs, hs = dy.stride(), b.stride(), h.stride()
    launch_planned(SITES["bwd_dy"], plan, 8, grid, (
        dy, b, h, dh, db_buf,
        M, N, R,
        ds[0], ds[1], bs[0], bs[1], hs[0], hs[1],
        float(scale),
    ), meta, meta_key, alike=aligned(dh, db_buf))
    if not partials:
        return dh, db_buf if b_dtype == torch.float32 or not cast else db_buf.to(b_dtype)
    db = torch.empty((N, R), device=dev, dtype=b_dtype) if db_out is None else db_out
    launch_planned(SITES["bwd_db"], plan, 9, (triton.cdiv(N * R, db_meta["BLOCK"]),),
                    (db_buf, db, N * R, partials, float(scale)), db_meta, db_meta_key,
                    alike=db_out is None or (db_out.dtype == b_dtype and aligned(db_out)))
    return dh, db


def bwd_da_plan(x: torch.Tensor, R: int, has_dropout: bool, seed: Optional[torch.Tensor],
                 config: Optional[dict], dh_dtype: torch.dtype = torch.float32) -> list:
    """[grid, SPLIT_M, use TMA, meta, meta_key, the launched kernel] of a bwd_da launch, memoized
    per call signature where it can be (``call_memo``). ``dh_dtype``: the kernel kept is
    specialized on it (an fp32 dh read through a kernel built for bf16 gives garbage)."""
    M, K = x.shape
    dtype = x.dtype
    call = (("bwd_da", x.get_device(), M, K, R, x.stride(), dtype, dh_dtype, seed.dtype if has_dropout else None,
             _tf32(dtype)) if config is None and aligned(x, seed) else None)
    return _call_plan(call, lambda: _bwd_da_launch_plan(x, R, has_dropout, config))


def _bwd_da_launch_plan(x: torch.Tensor, R: int, has_dropout: bool, config: Optional[dict]) -> tuple:
    """``bwd_da_plan``'s entries before the kernel slot, by config and shape (``_plan``)."""
    M, K = x.shape
    dev, dtype = x.device, x.dtype
    tma_ok = _rows_tma_ready(x)

    def build():
        conf, tma, meta, _ = _skinny_conf("bwd_da", dev, _key(M=M, K=K, R=R, dtype=dtype), config, tma_ok)
        return ((triton.cdiv(K, conf["BLOCK_K"]), conf["SPLIT_M"]), conf["SPLIT_M"], tma,
                *_meta(HAS_DROPOUT=has_dropout, USE_TMA=tma, R_PAD=padded_rank(R), DOT_PRECISION=_dot_precision(dtype),
                       **meta))

    return _plan(("bwd_da", dev.index, M, K, R, dtype, has_dropout, tma_ok, _tf32(dtype), _conf_key(config)), build)


def bwd_da(dh: torch.Tensor, x: torch.Tensor, dropout_p: float, seed: Optional[torch.Tensor],
           *, config: Optional[dict] = None, da: Optional[torch.Tensor] = None,
           plan: Optional[list] = None) -> torch.Tensor:
    """da = dh.T @ dropout(x) as fp32 (R, K). dh contiguous (M, R), fp32 (the backward's own) or
    x's dtype (a compiled graph's), x (M, K).

    ``da``: optional fp32 (R, K) contiguous output, zero-filled by the caller. ``plan``:
    ``bwd_da_plan``'s for an fp32 dh, when the caller has it.
    """
    M, K = x.shape
    R = dh.shape[1]
    has_dropout = dropout_p > 0
    # a caller's plan was built for an fp32 dh: another dtype must not relaunch its kernel
    alike = plan is None or dh.dtype == torch.float32
    plan = bwd_da_plan(x, R, has_dropout, seed, config, dh.dtype) if plan is None else plan
    grid, split, tma, meta, meta_key = plan[:5]
    if da is None:
        da = (torch.empty if split == 1 else torch.zeros)((R, K), device=x.device, dtype=torch.float32)
    if tma and x.is_cuda:
        _ensure_allocator()
    xs = x.stride()
    launch_planned(SITES["bwd_da"], plan, 5, grid, (
        dh, x, seed if has_dropout else x, da,
        M, K, R,
        xs[0], xs[1],
        float(dropout_p),
    ), meta, meta_key, alike=alike and aligned(dh, da))
    return da


# (kernel, pointer args, int args): the launch sites key on those (see launch_sites)
SITES = {
    "fwd_h": launch_sites.LaunchSite(_lora_linear_fwd_h_kernel, 4, 9),
    "gemm": launch_sites.LaunchSite(_lora_linear_gemm_kernel, 11, 23),
    "bwd_dy": launch_sites.LaunchSite(_lora_linear_bwd_dy_kernel, 5, 9),
    "bwd_db": launch_sites.LaunchSite(_lora_linear_bwd_db_kernel, 2, 2),
    "bwd_da": launch_sites.LaunchSite(_lora_linear_bwd_da_kernel, 4, 5),
}


def lora_linear_fwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], a: torch.Tensor,
                    b: torch.Tensor, scale: float, dropout_p: float, seed: Optional[torch.Tensor],
                    *, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Forward of the LoRA linear.

    Args:
        x: (M, K) input, float16 / bfloat16 / float32.
        weight: (N, K) frozen weight, any strides (a transposed or tied view is fine).
        bias: (N,) or None.
        a: (R, K) LoRA down-projection.  b: (N, R) LoRA up-projection. Any of x's float dtypes:
            the kernels cast them in registers (fp32 master factors cost no cast launch).
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
                              seed: Optional[torch.Tensor], impl: str, *,
                              lead: tuple = (), graphed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``lora_linear_fwd`` without its input checks, for callers that validated already.

    fastaf's eager op path checks once at the public function: the checks here cost ~10 us of
    host time per call, which counts where M=2048 calls are host-bound. ``lead``: the Triton
    GEMM allocates y as (*lead, N) (the caller's leading dims, prod(lead) == M); cuBLAS's stays
    (M, N). ``graphed``: the two Triton launches may replay from a CUDA graph (``launch_graphs``;
    the eager op path sets it, whose outputs nothing else writes).
    """
    (M, K), N, R = x.shape, weight.shape[0], a.shape[0]
    choice = choose_impl(impl, "fwd", x, M, K, N, R)
    if choice == "triton" and graphed and launch_graphs.usable(x):
        return _graphed_fwd(x, weight, bias, a, b, scale, dropout_p, seed, lead)
    if choice == "addmm":
        h = (_dropped(x, seed, dropout_p) if dropout_p > 0 else x) @ a.to(x.dtype).T  # (M, R)
    else:
        h = fwd_h(x, a, dropout_p, seed)  # (M, R)
    return _up(choice, x, weight, bias, h, b, scale, lead), h


def _graphed_fwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], a: torch.Tensor,
                 b: torch.Tensor, scale: float, dropout_p: float, seed: Optional[torch.Tensor],
                 lead: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton forward's two launches as one graph replay where this call was seen before."""
    (M, K), N, R = x.shape, weight.shape[0], a.shape[0]
    h = torch.empty((M, R), device=x.device, dtype=x.dtype)
    y = torch.empty((*lead, N) if lead else (M, N), device=x.device, dtype=x.dtype)
    # every tensor the two launches read or write, and every float and flag they take
    key = launch_graphs.call_key((x, weight, bias, a, b, seed, h, y), "fwd", scale, dropout_p, _tf32(x.dtype))

    def launch() -> None:
        fwd_h(x, a, dropout_p, seed, out=h)
        gemm(x, weight.T, h, b.T, bias, scale, 0.0, None, x.dtype, out=y)

    launch_graphs.GRAPHS.run(key, x.get_device(), launch)
    return y, h


def _up(choice: str, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], h: torch.Tensor,
        b: torch.Tensor, scale: float, lead: tuple = ()) -> torch.Tensor:
    """y (M, N) = x @ weight.T + bias + scale * h @ b.T on the implementation ``choice`` names
    ((*lead, N) from the Triton GEMM when ``lead`` is given)."""
    if choice == "addmm":
        y = torch.nn.functional.linear(x, weight, bias)
        return y.addmm_(h, b.to(x.dtype).T, alpha=scale)  # cuBLAS takes one dtype
    return gemm(x, weight.T, h, b.T, bias, scale, 0.0, None, x.dtype, lead=lead)


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
        dx (M, K) or None in x's dtype; da (R, K) in a's dtype; db (N, R) in b's dtype, or x's
        where cuBLAS ran.
    """
    M, K, N, R = _check_inputs(x, weight, None, a, b, dropout_p, seed)
    _check("dy", dy, (M, N), x.dtype)
    _check("h", h, (M, R), x.dtype)
    return lora_linear_bwd_unchecked(dy, x, weight, a, b, h, scale, dropout_p, seed, needs_dx, impl)


def lora_linear_bwd_unchecked(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, a: torch.Tensor,
                              b: torch.Tensor, h: torch.Tensor, scale: float, dropout_p: float,
                              seed: Optional[torch.Tensor], needs_dx: bool, impl: str, *,
                              shared_grads: bool = False,
                              graphed: bool = False) -> tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """``lora_linear_bwd`` without its input checks, for callers that validated already.

    ``shared_grads``: da and db may be views of one buffer (one zero-fill launch less, ~15 us of
    host time per layer). Plain autograd takes them as they are; a custom op may not return
    outputs that share storage, so the registered ops leave it False. ``graphed`` (with
    ``shared_grads``): the memset and the Triton launches may replay from a CUDA graph
    (``launch_graphs``).
    """
    (M, K), N, R = x.shape, weight.shape[0], a.shape[0]
    if choose_impl(impl, "bwd", x, M, K, N, R) == "addmm":
        a, b = a.to(x.dtype), b.to(x.dtype)  # cuBLAS takes one dtype
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
    # dh (when split over N) and da (when split over M) are atomically reduced: one memset for both.
    # The plans are made once here and handed down (each lookup is host time at launch-bound M).
    dy_plan = bwd_dy_plan(dy, b, h, None)
    da_plan = bwd_da_plan(x, R, dropout_p > 0, seed, None)
    if graphed and shared_grads and launch_graphs.usable(x):
        return _graphed_bwd(dy, x, weight, a, b, h, scale, dropout_p, seed, needs_dx, dy_plan, da_plan)
    db_rows = N if shared_grads and not dy_plan[1] else 0  # db atomically summed: zeroed with the rest
    work = (torch.zeros if dy_plan[2] > 1 or da_plan[1] > 1 or db_rows else torch.empty)(
        R * K + db_rows * R + M * R, device=x.device, dtype=torch.float32)
    # da first: with fp32 factors it is returned as it is, and a custom op's output must start
    # its storage (its fake says so; Inductor asserts 16-byte alignment of it)
    end = R * K + db_rows * R
    db_sum = work[R * K:end].view(N, R) if db_rows else None
    dh, db = bwd_dy(dy, b, h, scale, dh=work[end:].view(M, R), db_sum=db_sum, plan=dy_plan)  # fp32 (M, R), (N, R)
    da = bwd_da(dh, x, dropout_p, seed, da=work[:R * K].view(R, K), plan=da_plan)  # fp32 (R, K)
    dx = gemm(dy, weight, dh, a, None, 1.0, dropout_p, seed, x.dtype) if needs_dx else None  # (M, K)
    return dx, da if a.dtype == torch.float32 else da.to(a.dtype), db


def _graphed_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 h: torch.Tensor, scale: float, dropout_p: float, seed: Optional[torch.Tensor], needs_dx: bool,
                 dy_plan: list, da_plan: list) -> tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """``lora_linear_bwd_unchecked``'s Triton path (shared_grads) with its memsets and launches as
    one graph replay where this call was seen before. Every output is allocated here, before.

    dh has a buffer of its own, not a slice of da's and db's (the eager path's one memset): the
    gradients A.grad and B.grad, views of that buffer, would keep dh's M x R floats alive until
    they are zeroed. A second memset costs no host time inside a graph. It is allocated here, not
    inside the launches: made there (by the allocator when launching, from the graphs' pool when
    capturing) it shifts the addresses of the calls after it from step to step, and on the H100
    their keys then never recur three times."""
    (M, K), N, R = x.shape, weight.shape[0], a.shape[0]
    dev = x.device
    partials = dy_plan[1]
    db_rows = 0 if partials else N  # db atomically summed into the zeroed buffer, or its partials summed
    zero_grads, zero_dh = da_plan[1] > 1 or db_rows, dy_plan[2] > 1  # split-M da, db, split-N dh: atomics
    end = R * K + db_rows * R
    work = torch.empty(end, device=dev, dtype=torch.float32)  # da, db (atomic)
    dh = torch.empty((M, R), device=dev, dtype=torch.float32)
    db_out = torch.empty((N, R), device=dev, dtype=b.dtype) if partials else None
    dx = torch.empty((M, K), device=dev, dtype=x.dtype) if needs_dx else None
    key = launch_graphs.call_key((dy, x, weight, a, b, h, seed, work, dh, db_out, dx), "bwd", scale, dropout_p,
                           _tf32(x.dtype))

    def launch() -> None:
        if zero_grads:
            work.zero_()
        if zero_dh:
            dh.zero_()
        bwd_dy(dy, b, h, scale, dh=dh, db_sum=work[R * K:end].view(N, R) if db_rows else None, plan=dy_plan,
               db_out=db_out, cast=False)
        bwd_da(dh, x, dropout_p, seed, da=work[:R * K].view(R, K), plan=da_plan)
        if needs_dx:
            gemm(dy, weight, dh, a, None, 1.0, dropout_p, seed, x.dtype, out=dx)

    launch_graphs.GRAPHS.run(key, dev.index, launch)
    da = work[:R * K].view(R, K)
    db = db_out if partials else work[R * K:end].view(N, R)
    return (dx, da if a.dtype == torch.float32 else da.to(a.dtype),
            db if db.dtype == b.dtype else db.to(b.dtype))


# ---- projections that share one input (q/k/v, gate/up): h and dA in one pass over x each ----
#
# The siblings' A factors are stacked on the rank axis, a (R, K) with R the sum of their ranks:
# h (M, R) = x @ a.T is one fwd_h launch and dA (R, K) = dh.T @ x one bwd_da launch, where each
# sibling alone would read x once more in forward and once more in backward. Each sibling's own
# GEMM then takes its column slice of h (any strides). ``n`` and ``r`` are the first sibling's N
# and rank: the dispatch follows the choice its own forward or backward would make at (M, K, n, r),
# not the summed rank's (r=16 q/k/v at 48 resolve to the r=64 entries). An eager group asks
# every sibling (``lora_group.fits``); here the others' choices apply to their own GEMMs only.


def shared_h(x: torch.Tensor, a: torch.Tensor, n: int, r: int, impl: str) -> torch.Tensor:
    """h = x @ a.T, (M, R) in x's dtype. x (M, K), a (R, K) the siblings' A stacked."""
    M, K = x.shape
    # cuBLAS where the dispatch says so, or where the summed rank is beyond the kernels' padding
    if a.shape[0] > MAX_RANK or choose_impl(impl, "fwd", x, M, K, n, r) == "addmm":
        return x @ a.to(x.dtype).T  # cuBLAS takes one dtype
    return fwd_h(x, a, 0.0, None)


def shared_da(dh: torch.Tensor, x: torch.Tensor, n: int, r: int, impl: str) -> torch.Tensor:
    """dA = dh.T @ x, (R, K) in fp32 (the kernel) or x's dtype (cuBLAS). dh (M, R) contiguous."""
    M, K = x.shape
    if dh.shape[1] > MAX_RANK or choose_impl(impl, "bwd", x, M, K, n, r) == "addmm":
        return torch.mm(dh.T, x)
    return bwd_da(dh.contiguous(), x, 0.0, None)  # the kernel takes dh's rows packed


def siblings_dx(dys: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], dh: torch.Tensor, a: torch.Tensor,
                n: int, r: int, impl: str) -> torch.Tensor:
    """dx = sum_i dys[i] @ weights[i] + dh @ a, (M, K) in dys' dtype: the siblings' input gradient.

    dys[i] (M, N_i); weights[i] (N_i, K); dh (M, R) any float dtype, a (R, K) the stacked A
    factors in any float dtype. Up to three siblings take one gemm launch (their K loops into one
    tile, dx written once: 0.92x cuBLAS's mm per sibling and the later sum at the 1B q/k/v shapes)
    where the dispatch gives the first sibling's backward to the kernels;
    else cuBLAS sums into one buffer.
    """
    M, K = dys[0].shape[0], weights[0].shape[1]
    extra = list(zip(dys[1:], weights[1:]))
    if (a.shape[0] <= MAX_RANK and segments_fit(dys[0], weights[0], extra)
            and choose_impl(impl, "bwd", dys[0], M, K, n, r) == "triton"):
        return gemm(dys[0], weights[0], dh, a, None, 1.0, 0.0, None, dys[0].dtype, extra=extra)
    dtype = dys[0].dtype
    dx = torch.mm(dys[0], weights[0])
    for dy, w in zip(dys[1:], weights[1:]):
        dx.addmm_(dy, w)  # cuBLAS sums into dx: no separate add pass
    return dx.addmm_(dh.to(dtype), a.to(dtype))  # cuBLAS takes one dtype


def given_h_fwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], h: torch.Tensor,
                b: torch.Tensor, scale: float, impl: str) -> torch.Tensor:
    """y = x @ weight.T + bias + scale * h @ b.T, (M, N), with h (M, R) given (any strides)."""
    (M, K), N, R = x.shape, weight.shape[0], h.shape[1]
    return _up(choose_impl(impl, "fwd", x, M, K, N, R), x, weight, bias, h, b, scale)


def given_h_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                h: torch.Tensor, scale: float, needs_dx: bool,
                impl: str) -> tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """(dx (M, K) = dy @ weight + dh @ a or None, dh (M, R) = s * dy @ b, db (N, R) = s * dy.T @ h).

    dA is left to ``shared_da``, once for all siblings; dh comes back in fp32 (kernel) or dy's dtype.
    """
    (M, K), N, R = x.shape, weight.shape[0], h.shape[1]
    if choose_impl(impl, "bwd", x, M, K, N, R) == "addmm":
        a, b = a.to(dy.dtype), b.to(dy.dtype)  # cuBLAS takes one dtype
        dh = torch.addmm(h, dy, b, beta=0, alpha=scale)  # (M, R); beta=0: h only lends its shape
        db = torch.addmm(b, dy.T, h, beta=0, alpha=scale)  # (N, R)
        dx = torch.mm(dy, weight).addmm_(dh, a) if needs_dx else None
        return dx, dh, db
    dh, db = bwd_dy(dy, b, h, scale)  # fp32 (M, R), (N, R) in b's dtype
    dx = gemm(dy, weight, dh, a, None, 1.0, 0.0, None, dy.dtype) if needs_dx else None
    return dx, dh, db
