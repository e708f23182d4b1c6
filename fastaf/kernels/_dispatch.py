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
# Filled from measurements (see bench/results); empty GPU families fall through to DEFAULT.
TABLE: dict[str, dict[str, dict[str, list[dict]]]] = {}


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
