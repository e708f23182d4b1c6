"""Shared benchmark harness (BENCH.md): do_bench medians with p20/p80, JSON records, ratio tables.

Every script builds its rows with ``time_fn`` and hands them to ``write_results``, which stamps
the GPU name, torch / triton versions, git SHA (or $FASTAF_SHA where the copy has no .git) and
the date, writes ``bench/results/<bench>-<gpu-slug>.json`` (and a copy under $OUT when set), and
``ratio_table`` prints each provider's time over the ``base`` row of the same shape and mode.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def time_fn(fn: Callable[[], object], warmup: int = 25, rep: int = 200) -> dict:
    """Median, 20th and 80th percentile milliseconds of ``fn`` (triton.testing.do_bench)."""
    import triton.testing

    p50, p20, p80 = triton.testing.do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.5, 0.2, 0.8])
    return {"ms": p50, "p20": p20, "p80": p80}


def time_interleaved(fns: dict, rounds: int = 3, warmup: int = 25, rep: int = 200) -> dict:
    """Time every ``fns[key]`` in ``rounds`` interleaved rounds of ``rep / rounds`` ms each.

    A provider timed in one block sees one moment of the GPU's clocks and temperature; a large
    GEMM at the H200's power limit drifts by several percent over a run, which in one block shows
    up as a provider's ratio to the base. Interleaving spreads that drift over every provider.
    Returns ``{key: {"ms", "p20", "p80", "rounds": [per-round medians]}}`` over the pooled samples;
    the spread of a provider's per-round medians is its noise.
    """
    import statistics

    import triton.testing

    samples: dict = {k: [] for k in fns}
    medians: dict = {k: [] for k in fns}
    # An untimed round first: on the H100 a provider's first round ran up to 13% slow.
    for fn in fns.values():
        triton.testing.do_bench(fn, warmup=warmup, rep=max(1, rep // (2 * rounds)))
    order = list(fns)
    for i in range(rounds):
        # a provider's clocks depend on the power drawn by the one timed just before it: a fresh
        # (seeded) order each round, so no provider always follows the same neighbour
        random.Random(i).shuffle(order)
        for key in order:
            fn = fns[key]
            times = triton.testing.do_bench(fn, warmup=warmup, rep=max(1, rep // rounds), return_mode="all")
            samples[key] += times
            medians[key].append(round(statistics.median(times), 5))
    out = {}
    for key, times in samples.items():
        q = statistics.quantiles(times, n=10, method="inclusive") if len(times) > 1 else times * 9
        out[key] = {"ms": statistics.median(times), "p20": q[1], "p80": q[7], "rounds": medians[key]}
    return out


def checked(candidates: dict, ref: torch.Tensor, label: str, tol: float = 1e-2) -> dict:
    """The ``candidates`` (name -> fn) whose output is within ``tol`` relative error of ``ref``;
    one that fails to build or run, or misses, is printed and left out (a finding, not a crash)."""
    kept = {}
    for name, fn in candidates.items():
        try:
            err = rel_err(fn(), ref)
        except Exception as e:  # noqa: BLE001 - a config Triton refuses is a finding
            print(f"  {label} {name}: {type(e).__name__}: {str(e)[:160]}")
            continue
        if not err < tol:
            print(f"  !! {label} {name}: rel err {err:.3g}")
            continue
        kept[name] = fn
    return kept


def graph_rounds(fns: dict, rounds: int, rep: int = 60) -> dict[str, list[float]]:
    """GPU microseconds of each ``fns[key]`` from CUDA-graph replays (``do_bench_cudagraph``'s
    median), one sample per interleaved round: host time drops out, the GPU's drift spreads over
    every key."""
    import triton.testing

    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for key, fn in fns.items():
            times[key].append(triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e3)
    return times


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def git_sha() -> str:
    sha = os.environ.get("FASTAF_SHA")
    if sha:
        return sha
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def gpu_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def slug(name: str) -> str:
    import re

    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def meta(**extra) -> dict:
    import triton

    return {"gpu": gpu_name(), "torch": torch.__version__, "triton": triton.__version__, "fastaf_sha": git_sha(),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), **extra}


def write_results(bench: str, rows: list[dict], extra_meta: Optional[dict] = None) -> Path:
    path = RESULTS / f"{bench}-{slug(gpu_name())}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta(**(extra_meta or {})), "rows": rows}, indent=1) + "\n")
    if os.environ.get("OUT"):
        shutil.copy(path, Path(os.environ["OUT"]) / path.name)
    return path


def ratio_table(rows: list[dict], shape_keys: tuple[str, ...], providers: list[str]) -> str:
    """One line per shape: each provider's fwd | fwd_bwd median over the base's."""
    shapes = []
    for r in rows:
        s = tuple(r[k] for k in shape_keys)
        if s not in shapes:
            shapes.append(s)
    by = {(tuple(r[k] for k in shape_keys), r["mode"], r["provider"]): r["ms"] for r in rows}
    head = " ".join(f"{k:>6s}" for k in shape_keys) + " | base ms fwd/fb | " + " | ".join(f"{p:>13s}" for p in providers)
    lines = [head, "-" * len(head)]
    for s in shapes:
        cells = []
        for p in providers:
            vals = []
            for mode in ("fwd", "fwd_bwd"):
                base, t = by.get((s, mode, "base")), by.get((s, mode, p))
                vals.append(f"{t / base:.3f}" if base and t else "  -  ")
            cells.append(f"{vals[0]:>6s}|{vals[1]:<6s}")
        base = [by.get((s, m, "base")) for m in ("fwd", "fwd_bwd")]
        bstr = "/".join(f"{b:.3f}" if b else "-" for b in base)
        lines.append(" ".join(f"{v:>6}" for v in s) + f" | {bstr:>15s} | " + " | ".join(f"{c:>13s}" for c in cells))
    return "\n".join(lines)
