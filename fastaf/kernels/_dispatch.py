"""Dispatch: which implementation ``impl="auto"`` runs per op phase and shape, from measurements.

The data is the tuning cache's ``dispatch`` section (``_cache``): per shape, the fused Triton
path's and the cuBLAS + ``addmm`` path's measured GPU times. Its source, in order: the user's own
``fastaf-tune`` run on this GPU and triton version; else the cache fastaf ships for this GPU in
``fastaf/kernels/tuned/`` (measured by us: NVIDIA H100 80GB HBM3 and H200); else nothing, and ``DEFAULT``.
An untuned shape takes the nearest tuned one (``_cache.nearest``).

The decision charges the fused path its host cost, because an op called on its own is
host-bound where that cost exceeds its GPU win: before fastaf's own launch path
(``_launch.LaunchSite``) a Triton launch cost ~27 us of host time and at M=2048, K=N=4096 the
fused forward, 6 us faster on the GPU, ran at 3x the base through autograd where addmm ran at
1.26x. With it a launch costs ~14 us plus a ~6 us allocation, about a cuBLAS call's 15-23 us on
the H200 machine's host (bench/diag_linear.py, 2026-11-22). ``HOST_MS_PER_LAUNCH`` keeps 10 us
per Triton launch for what remains and for timing noise: "triton" is chosen only when
``triton_ms + HOST_MS_PER_LAUNCH * LAUNCHES[phase] < addmm_ms``. The cuBLAS path's own launches
(5 forward, 9 backward with fp32 factors) are not charged. Inside a whole eager step that rule
chose cuBLAS for a 1B model's layers at M=4096 where the Triton path, graphed and grouped, made
the step 1.33x the base instead of 1.74x (H100, README "Known gap").

Two things overrule the data: torch's deterministic mode (``atomics_ok``: the paths that sum
with fp32 atomics give way) and ``OVERRIDE``, which benchmarks set to time one path everywhere.
"""
from __future__ import annotations

import warnings

import torch

from fastaf.kernels import _cache

DEFAULT = "addmm"  # cuBLAS + fused epilogue: never slower than itself
# benchmarks only: "triton" or "addmm" for every shape in place of the measured choice, so one
# process can time both paths inside a whole step (bench_e2e's -triton / -addmm providers)
OVERRIDE: str | None = None
HOST_MS_PER_LAUNCH = 0.01
LAUNCHES = {"fwd": 2, "bwd": 3}  # Triton launches per phase: fwd_h + gemm; bwd_dy + bwd_da + gemm


def atomics_ok(impl: str, op: str) -> bool:
    """Whether a Triton path that sums with fp32 atomics (``op``, named in the message) may run:
    always, but under ``torch.use_deterministic_algorithms(True)``, where impl="auto" takes its
    deterministic path (False: cuBLAS or torch ops) and a forced impl="triton" alerts as torch's own
    nondeterministic ops do (raises; warns and runs under ``warn_only=True``)."""
    if not torch.are_deterministic_algorithms_enabled():
        return True
    if impl != "triton":
        return False
    msg = (f"{op} with impl='triton' sums with fp32 atomics, which is not deterministic, and "
           "torch.use_deterministic_algorithms(True) is set; impl='auto' takes a deterministic path "
           "(cuBLAS or torch ops) in this mode")
    if not torch.is_deterministic_algorithms_warn_only_enabled():
        raise RuntimeError(msg)
    warnings.warn(msg, stacklevel=3)
    return True


def decide(phase: str, ms: dict[str, float]) -> str:
    """"triton" or "addmm" from measured GPU times ``{"triton": ms, "addmm": ms}``."""
    margin = HOST_MS_PER_LAUNCH * LAUNCHES.get(phase, 1)
    return "triton" if ms["triton"] + margin < ms["addmm"] else "addmm"


def choose(op: str, phase: str, key: _cache.Key, gpu: str) -> str:
    """Implementation for ``op``'s ``phase`` ("fwd" or "bwd") at ``key`` on the GPU named ``gpu``.

    Args:
        op: kernel family, e.g. "lora_linear".
        phase: "fwd" or "bwd".
        key: {"M", "K", "N", "R": ints, "dtype": str}.
        gpu: ``torch.cuda.get_device_name()``; selects the shipped cache when the user has none.
    """
    entry = _cache.lookup("dispatch", f"{op}.{phase}", key, gpu=gpu)
    if entry is None:
        return DEFAULT
    ms = entry.get("ms")
    if isinstance(ms, dict) and isinstance(ms.get("triton"), (int, float)) and isinstance(ms.get("addmm"), (int, float)):
        return decide(phase, ms)
    return entry["winner"] if entry.get("winner") in ("triton", "addmm") else DEFAULT
