"""The harness every bench script shares: timing, the correctness check, results as CSV rows.

Timing is ``triton.testing.do_bench``: the median with the 20th and 80th percentiles, of one
provider (``time_fn``) or of all a case's providers in interleaved rounds (``time_interleaved``).
A script collects one dict per provider and case and hands them to a ``Results``, which appends
them to ``bench/results/<bench>.csv`` (and to ``$OUT/<bench>.csv`` when $OUT is set) with the
columns ``META``, then the script's case columns, then its figures. ``ratio_table`` prints each
provider's time over the ``base`` row of the same case. ``random_llama`` builds the models the
scripts time.
"""
from __future__ import annotations

import csv
import json
import os
import random
import secrets
import statistics
import subprocess
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

import torch

# where rows go: bench/results, or $FASTAF_BENCH_RESULTS (the test suite's smoke runs write to a
# temporary folder, never into the committed rows)
RESULTS = Path(os.environ.get("FASTAF_BENCH_RESULTS") or Path(__file__).resolve().parent / "results")
# the columns every row opens with: who measured what, where
META = ("run", "date", "sha", "gpu", "torch", "triton", "provider")


# ---- models --------------------------------------------------------------------------------

# a 2-layer Llama for the scripts' --tiny smoke runs (hidden 64: bitsandbytes' 64-value blocks fill)
TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512)


def random_llama(config: Optional[Path], device: str):
    """A ``LlamaForCausalLM`` with random bf16 weights (seed 0) on ``device``: the shape of
    ``config`` (an HF ``config.json``, ``bench/configs/``), or ``TINY_LLAMA`` when None."""
    from transformers import LlamaConfig, LlamaForCausalLM

    size = TINY_LLAMA if config is None else {k: v for k, v in json.loads(config.read_text()).items()
                                              if k != "model_type"}
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(LlamaConfig(**size, max_position_embeddings=2048)).to(torch.bfloat16)


# ---- timing ----------------------------------------------------------------------------------


def time_fn(fn: Callable[[], object], warmup: int = 25, rep: int = 200) -> dict:
    """Median, 20th and 80th percentile milliseconds of ``fn`` (``triton.testing.do_bench``)."""
    import triton.testing

    p50, p20, p80 = triton.testing.do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.5, 0.2, 0.8])
    return {"ms": p50, "p20": p20, "p80": p80}


def graph_us(fn: Callable[[], object], calls: int, reps: int = 20) -> float:
    """``fn`` (``calls`` linears) captured in one CUDA graph; the best of 5 timings of ``reps``
    replays, per call, in us."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(), fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / reps / calls)
    return best


def time_interleaved(fns: dict, rounds: int = 3, warmup: int = 25, rep: int = 200) -> dict:
    """Time every ``fns[key]`` in ``rounds`` interleaved rounds of ``rep / rounds`` ms each.

    A provider timed in one block sees one moment of the GPU's clocks and temperature; a large
    GEMM at the H200's power limit drifts by several percent over a run, which in one block shows
    up as a provider's ratio to the base. Interleaving spreads that drift over every provider.
    Returns ``{key: {"ms", "p20", "p80", "rounds": [per-round medians]}}`` over the pooled samples;
    the spread of a provider's per-round medians is its noise.
    """
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
            times = triton.testing.do_bench(fns[key], warmup=warmup, rep=max(1, rep // rounds), return_mode="all")
            samples[key] += times
            medians[key].append(round(statistics.median(times), 5))
    out = {}
    for key, times in samples.items():
        q = statistics.quantiles(times, n=10, method="inclusive") if len(times) > 1 else times * 9
        out[key] = {"ms": statistics.median(times), "p20": q[1], "p80": q[7], "rounds": medians[key]}
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64: the correctness check before a provider is timed."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# ---- where and what ran ------------------------------------------------------------------------


def git_sha() -> str:
    """``$FASTAF_SHA`` (a copy of the tree without its .git, or another tree's build), else HEAD's."""
    sha = os.environ.get("FASTAF_SHA")
    if sha:
        return sha
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent, timeout=10)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def gpu_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3' (chart file names)."""
    import re

    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _triton_version() -> str:
    try:
        import triton
    except ImportError:  # a CPU-only machine without triton: the CPU smoke runs still write rows
        return ""
    return triton.__version__


def run_meta() -> dict:
    """The META columns but ``provider``, one value per invocation: the run id is UTC time plus a
    random suffix, so two runs started in the same second on two machines stay apart."""
    now = datetime.now(timezone.utc)
    return {"run": now.strftime("%Y%m%dT%H%M%SZ-") + secrets.token_hex(2), "date": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "sha": git_sha(), "gpu": gpu_name(), "torch": torch.__version__, "triton": _triton_version()}


# ---- results as rows ---------------------------------------------------------------------------


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _header(path: Path) -> Optional[list[str]]:
    if not path.exists() or path.stat().st_size == 0:
        return None
    with path.open(newline="") as f:
        return next(csv.reader(f), None)


def _check_header(path: Path, columns: tuple[str, ...]) -> None:
    """A file written with other columns is an error, not an append: its rows would misalign."""
    found = _header(path)
    if found is not None and tuple(found) != columns:
        raise SystemExit(f"{path} has the columns\n  {','.join(found)}\nbut this script writes\n  {','.join(columns)}\n"
                         f"Write to another file (--name) or convert {path.name} to the new columns first.")


class Results:
    """Rows of one bench, appended to ``<directory>/<bench>.csv`` and, when $OUT is set, to
    ``$OUT/<bench>.csv``.

    Columns: ``META``, then ``case`` (what was measured: shapes, modes, batch), then ``figures``
    (what came out: ``ms``, ``p20``, ``p80``, ``max_mem_gib``, ...). Both files' headers are
    checked when the Results is made, before anything is timed, and again at each append. A row
    may leave any case or figure column out (an empty cell); a key outside the columns is an error.
    """

    def __init__(self, bench: str, case: Sequence[str], figures: Sequence[str], directory: Path = RESULTS):
        self.columns = META + tuple(case) + tuple(figures)
        if len(set(self.columns)) != len(self.columns):
            raise ValueError(f"duplicate columns in {self.columns}")
        self.paths = [Path(directory) / f"{bench}.csv"]
        if os.environ.get("OUT"):
            self.paths.append(Path(os.environ["OUT"]) / f"{bench}.csv")
        for path in self.paths:
            _check_header(path, self.columns)
        self.meta = run_meta()

    def append(self, rows: list[dict]) -> Path:
        """Append ``rows`` (each with its ``provider``; the run's META filled in) to every file."""
        lines = []
        for row in rows:
            extra = sorted(set(row) - set(self.columns))
            if extra:
                raise ValueError(f"row for {row.get('provider')!r} has keys outside the columns: {extra}")
            full = {**self.meta, **row}
            lines.append([_cell(full.get(c)) for c in self.columns])
        for path in self.paths:
            _check_header(path, self.columns)
            path.parent.mkdir(parents=True, exist_ok=True)
            new = _header(path) is None
            with path.open("a", newline="") as f:
                out = csv.writer(f)
                if new:
                    out.writerow(self.columns)
                out.writerows(lines)
        return self.paths[0]


def read(bench: str, directory: Path = RESULTS) -> list[dict]:
    """Every row of ``<bench>.csv`` in file order (oldest first: runs only append), as strings."""
    path = Path(directory) / f"{bench}.csv"
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


# ---- the printed table ---------------------------------------------------------------------------


def ratio_table(rows: list[dict], case: Sequence[str], base: str = "base",
                label: Callable[[dict], str] = lambda r: r["provider"]) -> str:
    """One line per case: the ``base`` row's ms, then each other row's ms over it ("-" where the
    case has no base row). ``case``: the columns that must match the base row's."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r.get(k) for k in case), []).append(r)
    lines = []
    for key, group in groups.items():
        ref = next((r["ms"] for r in group if r["provider"] == base and r.get("ms")), None)
        head = " ".join(f"{k}={v}" for k, v in zip(case, key))
        cells = [f"{base} {ref:.4g} ms" if ref else f"{base} -"]
        for r in group:
            if r["provider"] == base or r.get("ms") is None:
                continue
            cells.append(f"{label(r)} {r['ms'] / ref:.3f}x" if ref else f"{label(r)} {r['ms']:.4g} ms")
        lines.append(f"{head}: " + "  ".join(cells))
    return "\n".join(lines)
