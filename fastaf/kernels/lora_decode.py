"""A decoding step's LoRA in two launches: ``out = y + s * (x @ A.T) @ B.T`` for at most 64 rows.

The base GEMM stays cuBLAS's (``F.linear``); these kernels add the LoRA to its output: a shrink
split over K (``_decode_shrink_kernel``, partial h per split, no memset) and an expand that sums
the partials (``_decode_expand_kernel``). At a decoding step's few rows each launch costs mostly
its fixed latency, and inside a CUDA graph (a compiled decoding step) nothing else: cuBLAS's
``mm`` + ``addmm_`` take two launches too, but their shrink runs K serially in few programs
(``bench/decode.py``, H200, 32 rows, per layer over the base GEMM: 8.1 us at K = 2048 and 7.8 at
8192 for cuBLAS, 5.1 and 6.9 for these kernels), and an unfused graph three (two GEMMs and an add).

Factors are read in their own dtype (fp32 masters are cast in registers), so a stateful model's
fp32 parameters need no cast kernels in a compiled step. Kernels: ``lora_decode_kernels``.
"""
from __future__ import annotations

import torch

from . import launch_sites
from .hardware import available
from .lora_decode_kernels import _decode_expand_kernel, _decode_shrink_kernel
from .lora_linear_configs import MAX_RANK
from .lora_linear_plan import _MEMOS, _dot_precision, _meta, _tf32, padded_rank

MAX_ROWS = 64  # the (BLOCK_M, BLOCK_K) x tile and (BLOCK_M, R_PAD) h stay in registers
MAX_PARTIAL_ROWS = 1024  # partial rows an expand program sums at most where the kernels win (``wins``)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# the shrink's K tile, the K each split covers, the expand's N tile, warps and stages;
# interpreted: small tiles, so odd shapes exercise every tail and several splits
CUDA_CONFIG = dict(BLOCK_K=128, K_PER_SPLIT=256, BLOCK_N=64, num_warps=4, num_stages=3)
INTERPRET_CONFIG = dict(BLOCK_K=16, K_PER_SPLIT=32, BLOCK_N=16, num_warps=4, num_stages=1)

SHRINK = launch_sites.LaunchSite(_decode_shrink_kernel, 3, 7)  # pointers, ints (see launch_sites)
EXPAND = launch_sites.LaunchSite(_decode_expand_kernel, 4, 9)
_plans: dict[tuple, tuple] = {}
_MEMOS.append(_plans)


def supported(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """The kernels can run: x (M, K) with M <= MAX_ROWS on CUDA (or interpreted), float dtypes,
    rank <= MAX_RANK."""
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and available(x) and x.dtype in _DTYPES
            and a.dtype in _DTYPES and b.dtype in _DTYPES and a.shape[0] <= MAX_RANK)


def wins(x: torch.Tensor) -> bool:
    """The kernels beat cuBLAS's ``mm`` + ``addmm_`` on x (M, K) (``bench/decode.py``, H200,
    CUDA graphs): everywhere measured but where each expand program sums more than
    ``MAX_PARTIAL_ROWS`` partial rows (M times the splits of K): 64 rows at K = 8192, 11.8 us a
    layer over the base GEMM against 9.8 for cuBLAS (32 rows there: 6.9 against 7.8)."""
    M, K = x.shape
    conf = CUDA_CONFIG if x.is_cuda else INTERPRET_CONFIG
    return M * -(-K // conf["K_PER_SPLIT"]) <= MAX_PARTIAL_ROWS


def _plan(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, config: dict | None) -> tuple:
    """(shrink grid, shrink meta, its key, expand grid, expand meta, its key), memoized per shape:
    the launcher runs at every adapted layer of every eager step."""
    (M, K), (N, R) = x.shape, b.shape
    memo = (x.device, x.dtype, a.dtype, b.dtype, _tf32(x.dtype), M, N, K, R,
            None if config is None else tuple(config.items()))
    plan = _plans.get(memo)
    if plan is None:
        conf = dict(CUDA_CONFIG if x.is_cuda else INTERPRET_CONFIG, **(config or {}))
        block_m = padded_rank(M)  # tl.dot's 16, else the next power of two
        split = max(1, -(-K // conf["K_PER_SPLIT"]))
        common = dict(R_PAD=padded_rank(R), BLOCK_M=block_m, SPLIT_K=split, DOT_PRECISION=_dot_precision(x.dtype),
                      num_warps=conf["num_warps"])
        plan = _plans[memo] = (
            (-(-M // block_m), split), *_meta(BLOCK_K=conf["BLOCK_K"], num_stages=conf["num_stages"], **common),
            (-(-N // conf["BLOCK_N"]), -(-M // block_m)), *_meta(BLOCK_N=conf["BLOCK_N"], num_stages=1, **common))
    return plan


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float,
             out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """out = y + scale * (x @ a.T) @ b.T; returns out (y itself, updated in place, by default).

    Args:
        y: (M, N) in x's dtype, any strides (a linear map's fresh output).
        x: (M, K), M <= MAX_ROWS (``supported``).
        a: (R, K), b: (N, R): float16 / bfloat16 / float32, any strides.
        scale: the LoRA's scale.
        out: (M, N) in y's dtype, any strides, or None (in place).
        config: overrides of ``CUDA_CONFIG``'s keys (benchmarks sweep tiles).
    """
    (M, K), (N, R) = x.shape, b.shape
    s_grid, s_meta, s_key, e_grid, e_meta, e_key = _plan(x, a, b, config)
    part = torch.empty((s_grid[1], M, s_meta["R_PAD"]), device=x.device, dtype=torch.float32)
    SHRINK(s_grid, (x, a, part, M, K, R, x.stride(0), x.stride(1), a.stride(0), a.stride(1)), s_meta, s_key)
    out = y if out is None else out
    EXPAND(e_grid, (part, b, y, out, M, N, R, b.stride(0), b.stride(1), y.stride(0), y.stride(1), out.stride(0),
                    out.stride(1), float(scale)), e_meta, e_key)
    return out
