"""Dispatch table: which implementation ``impl="auto"`` runs per op phase, shape, dtype and GPU.

Two sources, in order:
1. the tuning cache's ``dispatch`` section, written by ``fastaf-tune`` on this GPU (the nearest
   tuned shape wins, see ``_cache.nearest``);
2. ``TABLE`` below: rows measured by ``bench/bench_linear.py`` (``bench/results/linear-*.json``),
   keyed by a GPU-name substring, dtype and phase; the nearest row's ``impl`` is used.
With neither, ``DEFAULT`` ("addmm": cuBLAS + fused epilogue, never slower than itself).

Implementations: "triton" (fused Triton kernels) or "addmm" (cuBLAS base GEMM, LoRA term added
by addmm / mm). A kernel that loses to "addmm" at a shape must not appear as "triton" there.
"""
from __future__ import annotations

from fastaf.kernels import _cache

DEFAULT = "addmm"

# {gpu substring: {dtype: {phase: [row, ...]}}}; row = {"M", "K", "N", "R", "impl"}.
# GPU families without rows (H100 so far: not measured) fall through to DEFAULT.
# H200 rows: fastaf-tune winners (median, do_bench rep 40 ms), NVIDIA H200, torch 2.11, triton 3.6,
# 2026-11-22; comment = fused triton vs addmm ms. Margins under ~2% are within run-to-run noise.
TABLE: dict[str, dict[str, dict[str, list[dict]]]] = {
    "H200": {
        "bfloat16": {
            "fwd": [
                {"M": 2048, "K": 4096, "N": 4096, "R": 16, "impl": "triton"},  # 0.109 vs 0.115 ms
                {"M": 2048, "K": 4096, "N": 4096, "R": 64, "impl": "addmm"},  # 0.115 vs 0.114 ms
                {"M": 2048, "K": 4096, "N": 14336, "R": 16, "impl": "triton"},  # 0.332 vs 0.376 ms
                {"M": 2048, "K": 4096, "N": 14336, "R": 64, "impl": "triton"},  # 0.340 vs 0.393 ms
                {"M": 2048, "K": 14336, "N": 4096, "R": 16, "impl": "addmm"},  # 0.347 vs 0.344 ms
                {"M": 2048, "K": 14336, "N": 4096, "R": 64, "impl": "addmm"},  # 0.351 vs 0.337 ms
                {"M": 8192, "K": 4096, "N": 4096, "R": 16, "impl": "triton"},  # 0.389 vs 0.433 ms
                {"M": 8192, "K": 4096, "N": 4096, "R": 64, "impl": "triton"},  # 0.403 vs 0.431 ms
                {"M": 8192, "K": 4096, "N": 14336, "R": 16, "impl": "triton"},  # 1.300 vs 1.460 ms
                {"M": 8192, "K": 4096, "N": 14336, "R": 64, "impl": "triton"},  # 1.326 vs 1.528 ms
                {"M": 8192, "K": 14336, "N": 4096, "R": 16, "impl": "triton"},  # 1.289 vs 1.382 ms
                {"M": 8192, "K": 14336, "N": 4096, "R": 64, "impl": "triton"},  # 1.290 vs 1.460 ms
                {"M": 16384, "K": 4096, "N": 4096, "R": 16, "impl": "triton"},  # 0.770 vs 0.905 ms
                {"M": 16384, "K": 4096, "N": 4096, "R": 64, "impl": "triton"},  # 0.791 vs 0.905 ms
                {"M": 16384, "K": 4096, "N": 14336, "R": 16, "impl": "triton"},  # 2.540 vs 3.075 ms
                {"M": 16384, "K": 4096, "N": 14336, "R": 64, "impl": "triton"},  # 2.769 vs 3.122 ms
                {"M": 16384, "K": 14336, "N": 4096, "R": 16, "impl": "triton"},  # 2.660 vs 2.993 ms
                {"M": 16384, "K": 14336, "N": 4096, "R": 64, "impl": "triton"},  # 2.655 vs 2.963 ms
            ],
            "bwd": [
                {"M": 2048, "K": 4096, "N": 4096, "R": 16, "impl": "addmm"},  # 0.222 vs 0.137 ms
                {"M": 2048, "K": 4096, "N": 4096, "R": 64, "impl": "addmm"},  # 0.208 vs 0.140 ms
                {"M": 2048, "K": 4096, "N": 14336, "R": 16, "impl": "triton"},  # 0.359 vs 0.373 ms
                {"M": 2048, "K": 4096, "N": 14336, "R": 64, "impl": "addmm"},  # 0.431 vs 0.373 ms
                {"M": 2048, "K": 14336, "N": 4096, "R": 16, "impl": "addmm"},  # 0.412 vs 0.403 ms
                {"M": 2048, "K": 14336, "N": 4096, "R": 64, "impl": "addmm"},  # 0.490 vs 0.405 ms
                {"M": 8192, "K": 4096, "N": 4096, "R": 16, "impl": "triton"},  # 0.441 vs 0.482 ms
                {"M": 8192, "K": 4096, "N": 4096, "R": 64, "impl": "triton"},  # 0.465 vs 0.480 ms
                {"M": 8192, "K": 4096, "N": 14336, "R": 16, "impl": "triton"},  # 1.403 vs 1.481 ms
                {"M": 8192, "K": 4096, "N": 14336, "R": 64, "impl": "triton"},  # 1.545 vs 1.579 ms
                {"M": 8192, "K": 14336, "N": 4096, "R": 16, "impl": "addmm"},  # 1.589 vs 1.535 ms
                {"M": 8192, "K": 14336, "N": 4096, "R": 64, "impl": "triton"},  # 1.613 vs 1.628 ms
                {"M": 16384, "K": 4096, "N": 4096, "R": 16, "impl": "triton"},  # 0.887 vs 0.946 ms
                {"M": 16384, "K": 4096, "N": 4096, "R": 64, "impl": "triton"},  # 0.864 vs 0.993 ms
                {"M": 16384, "K": 4096, "N": 14336, "R": 16, "impl": "triton"},  # 2.872 vs 3.044 ms
                {"M": 16384, "K": 4096, "N": 14336, "R": 64, "impl": "addmm"},  # 3.202 vs 3.189 ms
                {"M": 16384, "K": 14336, "N": 4096, "R": 16, "impl": "triton"},  # 2.962 vs 3.152 ms
                {"M": 16384, "K": 14336, "N": 4096, "R": 64, "impl": "addmm"},  # 3.310 vs 3.251 ms
            ],
        },
    },
}


def choose(op: str, phase: str, key: _cache.Key, gpu: str) -> str:
    """Implementation for ``op``'s ``phase`` ("fwd" or "bwd") at ``key`` on GPU named ``gpu``.

    Args:
        op: kernel family, e.g. "lora_linear".
        phase: "fwd" or "bwd".
        key: {"M", "K", "N", "R": ints, "dtype": str}.
        gpu: ``torch.cuda.get_device_name()``.
    """
    tuned = _cache.lookup("dispatch", f"{op}.{phase}", key)
    if tuned is not None and tuned.get("winner") in ("triton", "addmm"):
        return tuned["winner"]
    for family, by_dtype in TABLE.items():
        if family in gpu:
            rows = by_dtype.get(key["dtype"], {}).get(phase, [])
            plain = {k: v for k, v in key.items() if k != "dtype"}
            row = _cache.nearest([{"key": {k: r[k] for k in plain}, "impl": r["impl"]} for r in rows], plain)
            if row is not None:
                return row["impl"]
    return DEFAULT
