"""Dispatch: which implementation ``impl="auto"`` runs per op phase and shape, from measurements.

The data is the tuning cache's ``dispatch`` section (``cache``): per shape, the fused Triton
path's and the cuBLAS + ``addmm`` path's measured GPU and host times. Its source, in order: the
user's own ``fastaf-tune`` run on this GPU and triton version; else the cache fastaf ships for
this GPU in ``fastaf/kernels/tuned/`` (measured by us: NVIDIA H100 80GB HBM3 and H200); else
nothing, and ``DEFAULT``. An untuned shape takes the nearest tuned one (``cache.nearest``).

Each path costs the slower of its two sides, ``max(gpu_ms, host_ms)``. ``fastaf-tune`` measures
both (``tuning``): the GPU time of the launches alone (one CUDA graph's replays) and the host
time of one call as the eager op makes it (the Triton launches replayed from a launch graph,
``launch_graphs``; cuBLAS's 5 forward and 9 backward launches with fp32 factors, casts included). A
step overlaps a call's host side with the GPU work of the calls before it, so the slower side is
what the step pays where neighbouring calls are like it. There is no margin for noise: the
per-op times leave out what the Triton path gains only inside a step (siblings grouped, h
shared), and near-ties went its way there (1B step, 8 x 1024 tokens, every layer on cuBLAS
159.6 ms, on Triton 144.0).

Why both sides: a do_bench time of the ungraphed call is, at small M, the host's. The Triton
backward of a 1B model's q at M=4096 reads 215 us that way against cuBLAS's 145, where its
kernels take 93 us on the GPU and its graphed call 83 us of host (cuBLAS: 96 and 167); chosen on
those single times, such layers take cuBLAS and the eager H100 step at 4 x 1024 tokens runs 1.86x
the base, against 1.19x chosen on both sides. A cache without host times (``ms`` without
``host_ms``, as the shipped H200 one) is decided on its single times:
``triton_ms + HOST_MS_PER_LAUNCH * LAUNCHES[phase] < addmm_ms``.

Two things overrule the data: torch's deterministic mode (``atomics_ok``: the paths that sum
with fp32 atomics give way) and the ``dispatch`` flag
(``fastaf._config``), which benchmarks set to time one path everywhere.
"""
from __future__ import annotations

import warnings
from typing import Callable

import torch

from fastaf.kernels import cache

DEFAULT = "addmm"  # cuBLAS + fused epilogue: never slower than itself
IMPLS = ("triton", "addmm")  # the paths a dispatch entry times
# the single-time rule, for caches without host times: a Triton launch's host cost, launches per phase
HOST_MS_PER_LAUNCH = 0.01
LAUNCHES = {"fwd": 2, "bwd": 3}  # fwd_h + gemm; bwd_dy + bwd_da + gemm


def atomics_ok(impl: str, op: str | Callable[[], str]) -> bool:
    """Whether a Triton path that sums with fp32 atomics (``op``, named in the message) may run:
    always, but under ``torch.use_deterministic_algorithms(True)``, where impl="auto" takes its
    deterministic path (False: cuBLAS or torch ops) and a forced impl="triton" alerts as torch's own
    nondeterministic ops do (raises; warns and runs under ``warn_only=True``). ``op`` may be a
    function making the name: the callers sit on per-layer hot paths, and only an alert reads it."""
    if not torch.are_deterministic_algorithms_enabled():
        return True
    if impl != "triton":
        return False
    op = op() if callable(op) else op
    msg = (f"{op} with impl='triton' sums with fp32 atomics, which is not deterministic, and "
           "torch.use_deterministic_algorithms(True) is set; impl='auto' takes a deterministic path "
           "(cuBLAS or torch ops) in this mode")
    if not torch.is_deterministic_algorithms_warn_only_enabled():
        raise RuntimeError(msg)
    warnings.warn(msg, stacklevel=3)
    return True


def decide(phase: str, ms: dict[str, float], host_ms: dict[str, float] | None = None) -> str:
    """"triton" or "addmm" from measured times per path, ``{"triton": ms, "addmm": ms}``: the GPU
    time ``ms`` and the host time ``host_ms`` of one call; each path costs the larger of its two
    (a tie goes to cuBLAS). Without ``host_ms`` (a cache without host times), ``ms`` is a
    do_bench time and the Triton path is charged ``LAUNCHES[phase]`` launches on top."""
    if host_ms is None:
        margin = HOST_MS_PER_LAUNCH * LAUNCHES.get(phase, 1)
        return "triton" if ms["triton"] + margin < ms["addmm"] else "addmm"
    cost = {p: max(ms[p], host_ms[p]) for p in IMPLS}
    return "triton" if cost["triton"] < cost["addmm"] else "addmm"


def timed(ms: object) -> bool:
    return isinstance(ms, dict) and all(isinstance(ms.get(p), (int, float)) for p in IMPLS)


def choose(op: str, phase: str, key: cache.Key, gpu: str) -> str:
    """Implementation for ``op``'s ``phase`` ("fwd" or "bwd") at ``key`` on the GPU named ``gpu``.

    Args:
        op: kernel family, e.g. "lora_linear".
        phase: "fwd" or "bwd".
        key: {"M", "K", "N", "R": ints, "dtype": str}.
        gpu: ``torch.cuda.get_device_name()``; selects the shipped cache when the user has none.
    """
    entry = cache.lookup("dispatch", f"{op}.{phase}", key, gpu=gpu)
    if entry is None:
        return DEFAULT
    ms, host_ms = entry.get("ms"), entry.get("host_ms")
    if timed(ms):
        return decide(phase, ms, host_ms if timed(host_ms) else None)
    return entry["winner"] if entry.get("winner") in IMPLS else DEFAULT
