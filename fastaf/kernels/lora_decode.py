"""A decoding step's LoRA linear: ``out = x @ W.T + s * (x @ A.T) @ B.T`` for few rows.

``linear``: the base GEMM and the LoRA in one launch (``_decode_linear_kernel``), what decoding
runs for 16-bit inputs: one launch per adapted linear, as the base model's. With narrow N tiles
and long K tiles (``linear_tiles``) it costs 0.8-1.1 us over cuBLAS's GEMM alone at 32 rows and
K = 2048 inside a CUDA graph, 3.7 at 8192 (``bench/decode.py --sweep-linear``, H200).

The split kernels keep cuBLAS's GEMM (``F.linear``) and add the LoRA to its output: a shrink
split over K (``_decode_shrink_kernel``, partial h per split, no memset) and an expand that sums
the partials (``_decode_expand_kernel``). One shrink reads up to four siblings' A (``shrink``:
q/k/v on one x), each then expanded into its own output (``expand``). At a decoding step's few
rows each launch costs mostly its fixed latency, and inside a CUDA graph (a compiled decoding
step) nothing else: cuBLAS's ``mm`` + ``addmm_`` take two launches too, but their shrink runs K
serially in few programs (``bench/decode.py``, H200, 32 rows, per layer over the base GEMM: 8.1 us
at K = 2048 and 7.8 at 8192 for cuBLAS, 5.1 and 6.9 for these kernels; 3.5 per sibling at
K = 2048 when three share one shrink), and an unfused graph three (two GEMMs and an add). Eager
calls that keep cuBLAS's GEMM, bound by host time per launch, add the LoRA in one launch
(``add_lora_fused``).

A stack with per-row ids: ``multi_add_`` keeps cuBLAS's GEMM and adds each row's LoRA in two
launches, the shrink grouped by slot (``multi_shrink``: each slot's A read once, by its own
programs, partials without a zeroed buffer) and the grouped expand summing the partials
(``kernels.lora_multi.expand_``). ``multi_linear`` takes one launch less: the same shrink, then
the base GEMM with each row's LoRA in its epilogue (``_multi_decode_linear_kernel``), slower on
the GPU than cuBLAS's GEMM (H200, run f3fe: 2029 us a step for the 110 linears against about 930
for cuBLAS's GEMMs) but one host launch fewer, which eager decoding is bound by
(``decode_multi_linear``). One launch in all (each program computing its rows' h slot by slot
over all of K beside the GEMM) was measured and lost: 106-365 us of GPU a call against 14-33 for
the pair, at 32 rows, 16 slots and the 1B widths (CUDA-graph replays, H200), so an eager step
waited on the GPU instead of the host (16 adapters' eager generate 1.35 against 1.44 s for the
pair in run 2259, 1.63 against 1.63 in run 1095: within the host's drift).

Factors are read in their own dtype (fp32 masters are cast in registers), so a stateful model's
fp32 parameters need no cast kernels in a compiled step. Kernels: ``lora_decode_kernels``.
"""
from __future__ import annotations

import torch

from . import launch_sites
from .hardware import available
from .lora_decode_kernels import (_decode_expand_kernel, _decode_fused_kernel, _decode_linear_kernel,
                                  _decode_shrink_kernel, _multi_decode_linear_kernel, _multi_decode_shrink_kernel)
from .lora_linear_configs import MAX_RANK
from .lora_linear_plan import _MEMOS, _dot_precision, _meta, _tf32, padded_rank
from .lora_multi import expand_

MAX_ROWS = 64  # the (BLOCK_M, BLOCK_K) x tile and (BLOCK_M, R_PAD) h stay in registers
FUSED_MAX_ROWS = 1024  # rows add_lora_fused takes (in row blocks of at most FUSED_BLOCK_M)
FUSED_BLOCK_M = 64
# elements of x (M * K) up to which add_lora_fused beats cuBLAS's mm + addmm_ (H200, bf16, r = 16,
# an eager call's host time with its base GEMM: 37.3 against 47.0 us at 32 x 2048, 51.4 against
# 71.1 at 32 x 8192, 36.1 against 46.6 at 512 x 2048; 61.2 against 54.0 at 512 x 8192, where
# every program computing its rows' h over all of K waits on the GPU)
FUSED_MAX_ELEMENTS = 512 * 2048
MAX_PARTIAL_ROWS = 1024  # partial rows an expand program sums at most where the kernels win (``wins``)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# the shrink's K tile, the K each split covers, the expand's N tile, warps and stages;
# interpreted: small tiles, so odd shapes exercise every tail and several splits
CUDA_CONFIG = dict(BLOCK_K=128, K_PER_SPLIT=256, BLOCK_N=64, num_warps=4, num_stages=3)
INTERPRET_CONFIG = dict(BLOCK_K=16, K_PER_SPLIT=32, BLOCK_N=16, num_warps=4, num_stages=1)
# ``linear``'s tiles by rows and width: (BLOCK_N, BLOCK_K, num_warps, num_stages). At 32 rows
# narrow N tiles and long K tiles in two warps (H200, graph-replayed, ``bench/decode.py
# --sweep-linear``, run ed40: 0.8-1.1 us over cuBLAS's base GEMM at K = 2048, 3.7 at 8192, where
# the first tiles (32, 128, 4, 3) took 8.5-41); more rows take wider tiles (eager calls).
_LINEAR_TILES = {  # (most rows, at least N) -> tiles; the first that fits
    (32, 4096): (32, 128, 2, 5),
    (32, 0): (16, 256, 2, 4),
    (64, 0): (32, 128, 4, 4),
    (1 << 30, 0): (128, 64, 8, 3),
}
LINEAR_INTERPRET_CONFIG = dict(BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=1)
LINEAR_MAX_ROWS = 512  # rows ``linear`` takes: as far as it was measured to win (``linear_supported``)

SHRINK = launch_sites.LaunchSite(_decode_shrink_kernel, 6, 10)  # pointers, ints (see launch_sites)
EXPAND = launch_sites.LaunchSite(_decode_expand_kernel, 4, 9)
FUSED = launch_sites.LaunchSite(_decode_fused_kernel, 5, 14)
LINEAR = launch_sites.LaunchSite(_decode_linear_kernel, 6, 14)
MULTI_SHRINK = launch_sites.LaunchSite(_multi_decode_shrink_kernel, 7, 12)
MULTI_LINEAR = launch_sites.LaunchSite(_multi_decode_linear_kernel, 7, 15)
MAX_SIBLINGS = 4  # A's one shrink launch reads (q/k/v and a wrongly guessed o_proj)
_plans: dict[tuple, tuple] = {}
_MEMOS.append(_plans)


def supported(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """The kernels can run: x (M, K) with M <= MAX_ROWS on CUDA (or interpreted), float dtypes,
    rank <= MAX_RANK."""
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and available(x) and x.dtype in _DTYPES
            and a.dtype in _DTYPES and b.dtype in _DTYPES and a.shape[0] <= MAX_RANK)


def shares(a: torch.Tensor, others: list[torch.Tensor]) -> bool:
    """One shrink launch can read ``a`` with ``others`` (at most MAX_SIBLINGS in all): one dtype,
    one K and the same strides (the kernel takes one pair of A strides)."""
    return len(others) < MAX_SIBLINGS and all(
        o.dtype == a.dtype and o.shape[1] == a.shape[1] and o.stride() == a.stride() and o.shape[0] <= MAX_RANK
        for o in others)


def wins(x: torch.Tensor) -> bool:
    """The kernels beat cuBLAS's ``mm`` + ``addmm_`` on x (M, K) (``bench/decode.py``, H200,
    CUDA graphs): everywhere measured but where each expand program sums more than
    ``MAX_PARTIAL_ROWS`` partial rows (M times the splits of K): 64 rows at K = 8192, 11.8 us a
    layer over the base GEMM against 9.8 for cuBLAS (32 rows there: 6.9 against 7.8)."""
    M, K = x.shape
    conf = CUDA_CONFIG if x.is_cuda else INTERPRET_CONFIG
    return M * -(-K // conf["K_PER_SPLIT"]) <= MAX_PARTIAL_ROWS


def _shrink_plan(x: torch.Tensor, n: int, rank: int, config: dict | None) -> tuple:
    """(grid, meta, its key) of a shrink over x (M, K) for ``n`` siblings' A of at most ``rank``,
    memoized: the launcher runs at every adapted layer of every eager step. (A's dtype is the
    launch site's key, not the plan's.)"""
    M, K = x.shape
    memo = ("shrink", x.device, x.dtype, _tf32(x.dtype), M, K, n, rank,
            None if config is None else tuple(config.items()))
    plan = _plans.get(memo)
    if plan is None:
        conf = dict(CUDA_CONFIG if x.is_cuda else INTERPRET_CONFIG, **(config or {}))
        block_m = padded_rank(M)  # tl.dot's 16, else the next power of two
        split = max(1, -(-K // conf["K_PER_SPLIT"]))
        plan = _plans[memo] = ((-(-M // block_m), split, n), *_meta(
            R_PAD=padded_rank(rank), BLOCK_M=block_m, BLOCK_K=conf["BLOCK_K"], SPLIT_K=split,
            DOT_PRECISION=_dot_precision(x.dtype), num_warps=conf["num_warps"], num_stages=conf["num_stages"]))
    return plan


def _expand_plan(y: torch.Tensor, split: int, r_pad: int, config: dict | None) -> tuple:
    """(grid, meta, its key) of an expand into y (M, N) summing ``split`` partials of ``r_pad``
    columns (the shrink's), memoized."""
    M, N = y.shape
    memo = ("expand", y.device, y.dtype, _tf32(y.dtype), M, N, split, r_pad,
            None if config is None else tuple(config.items()))
    plan = _plans.get(memo)
    if plan is None:
        conf = dict(CUDA_CONFIG if y.is_cuda else INTERPRET_CONFIG, **(config or {}))
        block_m = padded_rank(M)
        plan = _plans[memo] = ((-(-N // conf["BLOCK_N"]), -(-M // block_m)), *_meta(
            R_PAD=r_pad, BLOCK_M=block_m, BLOCK_N=conf["BLOCK_N"], SPLIT_K=split,
            DOT_PRECISION=_dot_precision(y.dtype), num_warps=conf["num_warps"], num_stages=1))
    return plan


def part_shape(x: torch.Tensor, rank: int, n: int) -> tuple[int, int, int, int]:
    """``shrink``'s (and ``multi_shrink_shared``'s) output shape for x (M, K) and ``n`` A's (or
    stacks) of at most ``rank``, as their plans size it. Not through a plan: traced with dynamic
    shapes (a fake's call), M is a symbol, which a plan's memo key cannot hold."""
    conf = CUDA_CONFIG if x.is_cuda else INTERPRET_CONFIG
    return n, max(1, -(-x.shape[1] // conf["K_PER_SPLIT"])), x.shape[0], padded_rank(rank)


def shrink(x: torch.Tensor, factors: list[torch.Tensor], config: dict | None = None) -> torch.Tensor:
    """The partial h of every A in ``factors`` over x, in one launch, for ``expand``.

    Args:
        x: (M, K), M <= MAX_ROWS (``supported``).
        factors: 1 to MAX_SIBLINGS A's (R_i, K), one dtype and strides (``shares``).
        config: overrides of ``CUDA_CONFIG``'s keys (benchmarks sweep tiles).
    Returns:
        fp32 (len(factors), SPLIT_K, M, R_PAD): sibling i's partials are ``[i]``.
    """
    (M, K), a = x.shape, factors[0]
    rank = max(f.shape[0] for f in factors)
    grid, meta, key = _shrink_plan(x, len(factors), rank, config)
    part = torch.empty((len(factors), grid[1], M, meta["R_PAD"]), device=x.device, dtype=torch.float32)
    ptrs = (factors + [a] * MAX_SIBLINGS)[:MAX_SIBLINGS]
    ranks = [f.shape[0] for f in ptrs]
    SHRINK(grid, (x, *ptrs, part, M, K, *ranks, x.stride(0), x.stride(1), a.stride(0), a.stride(1)), meta, key)
    return part


def expand(y: torch.Tensor, part: torch.Tensor, b: torch.Tensor, scale: float, out: torch.Tensor | None = None,
           config: dict | None = None) -> torch.Tensor:
    """out = y + scale * h @ b.T, h the sum of one sibling's partials (``shrink(...)[i]``); returns
    out (y itself, updated in place, by default).

    Args:
        y: (M, N) in x's dtype, any strides (a linear map's fresh output).
        part: (SPLIT_K, M, R_PAD) fp32, contiguous: one sibling's slice of ``shrink``'s output.
        b: (N, R), float16 / bfloat16 / float32, any strides, R <= R_PAD.
        scale: the LoRA's scale.
        out: (M, N) in y's dtype, any strides, or None (in place).
    """
    (M, N), R = y.shape, b.shape[1]
    grid, meta, key = _expand_plan(y, part.shape[0], part.shape[2], config)
    out = y if out is None else out
    EXPAND(grid, (part, b, y, out, M, N, R, b.stride(0), b.stride(1), y.stride(0), y.stride(1), out.stride(0),
            out.stride(1), float(scale)), meta, key)
    return out


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
    return expand(y, shrink(x, [a], config)[0], b, scale, out, config)


def fused_supported(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """``add_lora_fused`` can run and wins: x (M, K) with M <= FUSED_MAX_ROWS and M * K <=
    FUSED_MAX_ELEMENTS on CUDA (or interpreted), float dtypes, rank <= MAX_RANK."""
    return (x.dim() == 2 and 0 < x.shape[0] <= FUSED_MAX_ROWS and x.numel() <= FUSED_MAX_ELEMENTS
            and available(x) and x.dtype in _DTYPES
            and a.dtype in _DTYPES and b.dtype in _DTYPES and a.shape[0] <= MAX_RANK)


def _fused_plan(x: torch.Tensor, y: torch.Tensor, rank: int) -> tuple:
    """(grid, meta, its key) of ``add_lora_fused`` for x (M, K), y (M, N), memoized."""
    (M, K), N = x.shape, y.shape[1]
    memo = ("fused", x.device, x.dtype, _tf32(x.dtype), M, N, K, rank)
    plan = _plans.get(memo)
    if plan is None:
        conf = CUDA_CONFIG if x.is_cuda else INTERPRET_CONFIG
        block_m = min(padded_rank(M), FUSED_BLOCK_M)
        plan = _plans[memo] = ((-(-N // conf["BLOCK_N"]), -(-M // block_m)), *_meta(
            R_PAD=padded_rank(rank), BLOCK_M=block_m, BLOCK_N=conf["BLOCK_N"], BLOCK_K=conf["BLOCK_K"],
            DOT_PRECISION=_dot_precision(x.dtype), num_warps=conf["num_warps"], num_stages=conf["num_stages"]))
    return plan


def add_lora_fused(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """y += scale * (x @ a.T) @ b.T in place, in one launch (``_decode_fused_kernel``): each
    program computes all of h for its block of rows. An eager inference call of up to
    ``FUSED_MAX_ROWS`` rows is bound by host time, where one launch costs less than a split pair
    or cuBLAS's ``mm`` + ``addmm_``. y (M, N), x (M, K) (``fused_supported``), a (R, K), b (N, R)
    in any float dtype and strides; returns y."""
    (M, K), (N, R) = x.shape, b.shape
    grid, meta, key = _fused_plan(x, y, R)
    FUSED(grid, (x, a, b, y, y, M, N, K, R, x.stride(0), x.stride(1), a.stride(0), a.stride(1), b.stride(0),
                 b.stride(1), y.stride(0), y.stride(1), y.stride(0), y.stride(1), float(scale)), meta, key)
    return y


def linear_supported(x: torch.Tensor, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """``linear`` can run and wins: x (M, K) with M <= LINEAR_MAX_ROWS on CUDA (or interpreted), a
    16-bit x and a weight (N, K) in its dtype, float factors of rank <= MAX_RANK.

    Where it wins (H200, bf16, r = 16, an eager call's host time, ``bench/decode.py --eager``, run
    52b2): against cuBLAS's GEMM then the one-launch LoRA, 50.4 against 68.9 us at 32 x 2048 ->
    2048, 60.3 against 75.9 at 32 x 8192 -> 2048, 71.9 against 95.9 at 512 x 2048 -> 2048, 77.2
    against 88.7 at 512 x 8192 -> 2048; a tie at 32 x 2048 -> 8192 (73.2 against 70.9). Inside a
    CUDA graph, with ``linear_tiles``' 32-row tiles: 0.8-1.1 us over the base GEMM alone at
    K = 2048 and 3.7 at 8192, against 5.0-5.3 and 7.1 for the split pair (run ed40)."""
    return (x.dim() == 2 and 0 < x.shape[0] <= LINEAR_MAX_ROWS and available(x)
            and x.dtype in (torch.float16, torch.bfloat16) and weight.dtype == x.dtype
            and a.dtype in _DTYPES and b.dtype in _DTYPES and a.shape[0] <= MAX_RANK)


def linear_tiles(M: int, N: int) -> dict:
    """``linear``'s tiles on CUDA for M rows and N outputs (``_LINEAR_TILES``)."""
    tiles = next(t for (rows, width), t in _LINEAR_TILES.items() if M <= rows and N >= width)
    return dict(zip(("BLOCK_N", "BLOCK_K", "num_warps", "num_stages"), tiles))


def _linear_plan(x: torch.Tensor, N: int, rank: int, bias: bool, config: dict | None) -> tuple:
    """(grid, meta, its key) of ``linear`` for x (M, K) and N outputs, memoized."""
    M, K = x.shape
    memo = ("linear", x.device, x.dtype, M, N, K, rank, bias, None if config is None else tuple(config.items()))
    plan = _plans.get(memo)
    if plan is None:
        conf = dict(LINEAR_INTERPRET_CONFIG if not x.is_cuda else linear_tiles(M, N), **(config or {}))
        block_m = min(padded_rank(M), FUSED_BLOCK_M)
        plan = _plans[memo] = ((-(-N // conf["BLOCK_N"]), -(-M // block_m)), *_meta(
            HAS_BIAS=bias, R_PAD=padded_rank(rank), BLOCK_M=block_m, BLOCK_N=conf["BLOCK_N"],
            BLOCK_K=conf["BLOCK_K"], DOT_PRECISION=_dot_precision(x.dtype), num_warps=conf["num_warps"],
            num_stages=conf["num_stages"]))
    return plan


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor,
           scale: float, config: dict | None = None) -> torch.Tensor:
    """x @ weight.T + bias + scale * (x @ a.T) @ b.T in one launch (``_decode_linear_kernel``).

    Args:
        x: (M, K) float16 / bfloat16, M <= LINEAR_MAX_ROWS (``linear_supported``), any strides.
        weight: (N, K) in x's dtype, any strides; bias: (N,) or None.
        a: (R, K), b: (N, R): float16 / bfloat16 / float32, any strides (read as they are).
        scale: the LoRA's scale.
        config: overrides of ``linear_tiles``' keys (benchmarks sweep tiles).
    Returns:
        (M, N) in x's dtype, new.
    """
    (M, K), (N, R) = x.shape, b.shape
    grid, meta, key = _linear_plan(x, N, R, bias is not None, config)
    out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    # each tensor's strides in one call (host time per adapted layer of an eager step)
    LINEAR(grid, (x, weight, x if bias is None else bias, a, b, out, M, N, K, R, *x.stride(), *weight.stride(),
                  *a.stride(), *b.stride(), N, 1, float(scale)), meta, key)
    return out


def multi_supported(x: torch.Tensor, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """``multi_linear`` can run: x (M, K) with M <= MAX_ROWS on CUDA (or interpreted), a 16-bit x
    and a weight (N, K) in its dtype, a stack of float factors A (n, R, K), B (n, N, R) of rank
    <= MAX_RANK."""
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and available(x)
            and x.dtype in (torch.float16, torch.bfloat16) and weight.dtype == x.dtype and a.dim() == 3
            and a.dtype in _DTYPES and b.dtype in _DTYPES and a.shape[1] <= MAX_RANK)


def _multi_shrink_plan(x: torch.Tensor, n: int, rank: int, siblings: int = 1) -> tuple:
    """(grid, meta, key) of ``multi_shrink`` for x (M, K) and ``siblings`` stacks of ``n`` slots,
    memoized."""
    M, K = x.shape
    memo = ("multi-shrink", x.device, x.dtype, M, K, n, rank, siblings)
    plan = _plans.get(memo)
    if plan is None:
        conf = CUDA_CONFIG if x.is_cuda else INTERPRET_CONFIG
        split = max(1, -(-K // conf["K_PER_SPLIT"]))
        plan = _plans[memo] = ((n, split, siblings), *_meta(
            R_PAD=padded_rank(rank), BLOCK_M=padded_rank(M), BLOCK_K=conf["BLOCK_K"], SPLIT_K=split,
            DOT_PRECISION=_dot_precision(x.dtype), num_warps=conf["num_warps"], num_stages=conf["num_stages"]))
    return plan


def _multi_plans(x: torch.Tensor, n: int, N: int, rank: int, bias: bool, config: dict | None) -> tuple:
    """((shrink grid, meta, key), (linear grid, meta, key)) of ``multi_linear`` for x (M, K), a
    stack of ``n`` slots, N outputs, memoized."""
    M, K = x.shape
    memo = ("multi", x.device, x.dtype, M, N, K, n, rank, bias, None if config is None else tuple(config.items()))
    plans = _plans.get(memo)
    if plans is None:
        tiles = dict(LINEAR_INTERPRET_CONFIG if not x.is_cuda else linear_tiles(M, N), **(config or {}))
        shrink = _multi_shrink_plan(x, n, rank)
        meta = shrink[1]
        linear = ((-(-N // tiles["BLOCK_N"]), 1), *_meta(
            HAS_BIAS=bias, R_PAD=meta["R_PAD"], BLOCK_M=meta["BLOCK_M"], BLOCK_N=tiles["BLOCK_N"],
            BLOCK_K=tiles["BLOCK_K"], SPLIT_K=meta["SPLIT_K"], DOT_PRECISION=meta["DOT_PRECISION"],
            num_warps=tiles["num_warps"], num_stages=tiles["num_stages"]))
        plans = _plans[memo] = (shrink, linear)
    return plans


def multi_shrink(x: torch.Tensor, a: torch.Tensor, ids: torch.Tensor, plan: tuple | None = None) -> torch.Tensor:
    """The partials of h = x @ A[g].T per segment of slot g = ids[i], one launch grouped by slot
    (``_multi_decode_shrink_kernel``: each slot's A read once, by its own programs; no zeroed
    buffer). x (M, K) as in ``multi_linear``, a (n, R, K); ``plan``: its (grid, meta, key) from
    ``_multi_shrink_plan``, where the caller has it. Returns fp32 (SPLIT_K, M, R_PAD), summed over its
    first dim by the reader; rows of -1 segments are left unwritten."""
    return multi_shrink_shared(x, [a], ids, plan)[0]


def multi_shares(stacks: list[torch.Tensor]) -> bool:
    """One ``multi_shrink_shared`` launch can read these siblings' stacks (at most MAX_SIBLINGS):
    one dtype, one slot count, one K and the same strides (the kernel takes one set)."""
    a = stacks[0]
    return len(stacks) <= MAX_SIBLINGS and all(
        s.dtype == a.dtype and s.shape[0] == a.shape[0] and s.shape[2] == a.shape[2] and s.stride() == a.stride()
        and s.shape[1] <= MAX_RANK for s in stacks)


def multi_shrink_shared(x: torch.Tensor, stacks: list[torch.Tensor], ids: torch.Tensor,
                        plan: tuple | None = None) -> torch.Tensor:
    """``multi_shrink`` of siblings over one x (q/k/v, gate/up) in one launch: stacks, 1 to
    MAX_SIBLINGS A's (n, R_i, K) that ``multi_shares`` takes. Returns fp32 (len(stacks), SPLIT_K,
    M, R_PAD): sibling i's partials are ``[i]``."""
    (M, K), (n, _) = x.shape, stacks[0].shape[:2]
    rank = max(a.shape[1] for a in stacks)
    grid, meta, key = plan if plan is not None else _multi_shrink_plan(x, n, rank, len(stacks))
    part = torch.empty((len(stacks), meta["SPLIT_K"], M, meta["R_PAD"]), device=x.device, dtype=torch.float32)
    ptrs = (stacks + [stacks[0]] * MAX_SIBLINGS)[:MAX_SIBLINGS]
    MULTI_SHRINK(grid, (x, *ptrs, ids, part, M, K, *[a.shape[1] for a in ptrs], M // ids.shape[0], x.stride(0),
                        x.stride(1), *stacks[0].stride()), meta, key)
    return part


def multi_add_(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ids: torch.Tensor,
               scale: float) -> torch.Tensor:
    """y += scale * (x @ A[g].T) @ B[g].T per segment of slot g = ids[i], in place, in two launches:
    ``multi_shrink``, then the grouped expand summing its partials (``kernels.lora_multi.expand_``).
    The base GEMM stays cuBLAS's. y (M, N) in x's dtype; x, a, b, ids as in ``multi_linear``."""
    return expand_(y, multi_shrink(x, a, ids), b.transpose(1, 2), ids, scale)


def multi_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor,
                 ids: torch.Tensor, scale: float, config: dict | None = None) -> torch.Tensor:
    """x @ weight.T + bias + scale * (x @ A[g].T) @ B[g].T with each segment's own slot g, in two
    launches: the shrink grouped by slot (``_multi_decode_shrink_kernel``: each slot's A read
    once), then the base GEMM with every row's LoRA added in its epilogue
    (``_multi_decode_linear_kernel``).

    Args:
        x: (M, K) float16 / bfloat16, M <= MAX_ROWS (``multi_supported``), any strides.
        weight: (N, K) in x's dtype, any strides; bias: (N,) or None.
        a: (n, R, K), b: (n, N, R): float16 / bfloat16 / float32, any strides (read as they are).
        ids: (M // S,) int32 / int64 on x's device, contiguous, in [-1, n): segment i (rows
            i*S .. (i+1)*S) takes slot ids[i]; -1 the base alone. Read on the device (no sync).
        scale: the LoRA's scale.
        config: overrides of ``linear_tiles``' keys (benchmarks sweep tiles).
    Returns:
        (M, N) in x's dtype, new.
    """
    (M, K), (n, N, R) = x.shape, b.shape
    S = M // ids.shape[0]
    shrink, (l_grid, l_meta, l_key) = _multi_plans(x, n, N, R, bias is not None, config)
    part = multi_shrink(x, a, ids, shrink)
    out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    MULTI_LINEAR(l_grid, (x, weight, x if bias is None else bias, part, b, ids, out, M, N, K, R, S, n, x.stride(0),
                          x.stride(1), weight.stride(0), weight.stride(1), *b.stride(), out.stride(0),
                          out.stride(1), float(scale)), l_meta, l_key)
    return out
