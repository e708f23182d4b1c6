"""Tuning cache: the configs and dispatch winners that ``fastaf-tune`` measured, one JSON per GPU.

File: ``$FASTAF_CACHE_DIR`` (default ``~/.cache/fastaf``) / ``tune-<gpu-slug>-triton<version>.json``::

    {"version": 1, "gpu": "NVIDIA H100 80GB HBM3", "triton": "3.6.0", "torch": "2.11.0+cu130",
     "date": "2026-11-22T10:00:00Z",
     "kernels":  {"lora_linear.gemm": [{"key": {"M": 8192, "N": 4096, "K": 4096, "R": 16,
                                                "dtype": "bfloat16", "tma": 1},
                                        "config": {"BLOCK_M": 128, ..., "num_warps": 8}, "ms": 0.41}]},
     "dispatch": {"lora_linear.fwd": [{"key": {...}, "winner": "triton",
                                       "ms": {"triton": 0.42, "addmm": 0.45}}]}}

Lookup takes the entry whose key matches every string field (dtype) exactly and is nearest in
the integer fields (sum of |log2(a / b)|), so an untuned shape uses the nearest tuned one; with
no candidate the caller falls back to its default. A corrupt or foreign file, and a malformed
entry, is reported with a one-line warning and ignored, never raised.
"""
from __future__ import annotations

import json
import math
import os
import re
import tempfile
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

CACHE_VERSION = 1
Key = dict[str, Any]
SHIPPED_DIR = Path(__file__).parent / "tuned"  # caches measured by fastaf's maintainers, per GPU

_memo: dict[Path, dict] = {}


def cache_dir() -> Path:
    """``$FASTAF_CACHE_DIR`` if set, else ``~/.cache/fastaf``."""
    env = os.environ.get("FASTAF_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "fastaf"


def slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def device_name(device: Any = None) -> str:
    """GPU name of ``device`` (current CUDA device by default); 'cpu' without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    return torch.cuda.get_device_name(device)


def triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except ImportError:  # pragma: no cover - the cache is only consulted where triton runs
        return "none"


def cache_path(gpu: str | None = None, triton: str | None = None) -> Path:
    """Path of the cache file for ``gpu`` and ``triton`` (defaults: this machine)."""
    gpu = device_name() if gpu is None else gpu
    triton = triton_version() if triton is None else triton
    return cache_dir() / f"tune-{slug(gpu)}-triton{triton}.json"


def empty(gpu: str, triton: str) -> dict:
    import torch

    return {"version": CACHE_VERSION, "gpu": gpu, "triton": triton, "torch": torch.__version__,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "kernels": {}, "dispatch": {}}


def _valid(data: Any) -> bool:
    return (isinstance(data, dict) and data.get("version") == CACHE_VERSION
            and isinstance(data.get("gpu"), str) and isinstance(data.get("triton"), str)
            and isinstance(data.get("kernels"), dict) and isinstance(data.get("dispatch"), dict))


def _entry_ok(entry: Any, section: str) -> bool:
    """``{"key": {field: str | int}, ...}`` with a ``config`` dict (kernels) or a ``winner`` /
    ``ms`` pair (dispatch): what ``lookup`` and ``fastaf-tune --list`` read."""
    if not isinstance(entry, dict) or not isinstance(entry.get("key"), dict):
        return False
    if not all(isinstance(v, str) or (type(v) is int and v > 0) for v in entry["key"].values()):
        return False
    if section == "kernels":
        return isinstance(entry.get("config"), dict)
    ms = entry.get("ms")
    timed = isinstance(ms, dict) and all(type(ms.get(p)) in (int, float) for p in ("triton", "addmm"))
    return timed or entry.get("winner") in ("triton", "addmm")


def _drop_malformed(data: dict, path: Path) -> dict:
    """``data`` without the entries ``_entry_ok`` refuses; one warning names what went."""
    dropped = []
    for section in ("kernels", "dispatch"):
        for name, entries in list(data[section].items()):
            good = [e for e in entries if _entry_ok(e, section)] if isinstance(entries, list) else []
            if not isinstance(entries, list) or len(good) != len(entries):
                bad = len(entries) - len(good) if isinstance(entries, list) else "all"
                dropped.append(f"{section}.{name} ({bad})")
            data[section][name] = good
    if dropped:
        warnings.warn(f"fastaf: tuning cache {path}: ignoring malformed entries of {', '.join(dropped)}",
                      stacklevel=3)
    return data


def load(path: Path | None = None) -> dict | None:
    """The cache at ``path`` (default: this machine's), memoized; None when absent or corrupt."""
    path = cache_path() if path is None else Path(path)
    if path in _memo:
        return _memo[path]
    data = None
    if path.exists():
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            warnings.warn(f"fastaf: ignoring unreadable tuning cache {path}: {err}", stacklevel=2)
            data = None
        if data is not None and not _valid(data):
            warnings.warn(f"fastaf: ignoring tuning cache {path}: not a version-{CACHE_VERSION} "
                          "fastaf cache (run `fastaf-tune --clear`)", stacklevel=2)
            data = None
        if data is not None:
            data = _drop_malformed(data, path)
    _memo[path] = data
    return data


def save(data: dict, path: Path | None = None) -> Path:
    """Write ``data`` atomically (temp file + rename); the next ``load`` reads it back."""
    path = cache_path(data["gpu"], data["triton"]) if path is None else Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tune-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)  # no half-written temp file left beside the cache
        raise
    _memo.pop(path, None)  # re-read through load's checks rather than trusting ``data``
    return path


def forget() -> None:
    """Drop the in-memory copies (after the file changed on disk)."""
    _memo.clear()


def distance(a: Key, b: Key) -> float:
    """inf unless the string fields agree; else the sum of |log2| ratios of the numeric fields."""
    d = 0.0
    for name in set(a) | set(b):
        va, vb = a.get(name), b.get(name)
        if isinstance(va, str) or isinstance(vb, str) or va is None or vb is None:
            if va != vb:
                return math.inf
        else:
            d += abs(math.log2(max(va, 1) / max(vb, 1)))
    return d


def nearest(entries: list[dict], key: Key) -> dict | None:
    """The entry whose ``"key"`` is nearest to ``key`` (first one on ties); None if none match."""
    best, best_d = None, math.inf
    for entry in entries:
        d = distance(entry.get("key", {}), key)
        if d < best_d:
            best, best_d = entry, d
    return best


def upsert(entries: list[dict], entry: dict) -> None:
    """Replace the entry with the same key, or append."""
    for i, old in enumerate(entries):
        if old.get("key") == entry["key"]:
            entries[i] = entry
            return
    entries.append(entry)


def shipped_path(gpu: str | None = None) -> Path | None:
    """The cache fastaf ships for ``gpu`` (default: this machine's): this triton's, else the newest."""
    gpu = device_name() if gpu is None else gpu
    exact = SHIPPED_DIR / f"tune-{slug(gpu)}-triton{triton_version()}.json"
    if exact.exists():
        return exact
    files = sorted(SHIPPED_DIR.glob(f"tune-{slug(gpu)}-triton*.json"))
    return files[-1] if files else None


def lookup(section: str, name: str, key: Key, path: Path | None = None, gpu: str | None = None) -> dict | None:
    """Nearest entry of ``data[section][name]`` for ``key``; None without a usable cache.

    ``path=None`` reads this machine's cache (``gpu``, default this machine's GPU), falling back
    to the cache fastaf ships for that GPU when the user has not tuned.
    """
    data = load(path if path is not None else cache_path(gpu))
    if data is None and path is None and (shipped := shipped_path(gpu)) is not None:
        data = load(shipped)
    if data is None:
        return None
    return nearest(data[section].get(name, []), key)  # load dropped malformed entries
