"""Shared pytest set-up: the repo root on sys.path (for tests._models, tests._tolerances),
GPU tests skipped cleanly without CUDA, and every test seeded."""
import contextlib
import importlib
import os
import sys
from pathlib import Path

import pytest
import torch

from fastaf import _config
from fastaf.intercept import groups as _group

_group_op = importlib.import_module("fastaf.ops.lora_group")  # the module, not its public function

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

# under pytest-xdist (``make test`` runs a worker per core), each worker's torch keeps to its
# share of the cores instead of each one using all of them
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, _cores // _WORKERS))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def counted(monkeypatch):
    """Counts of the grouped kernels' forward and backward calls; learned groups start empty."""
    monkeypatch.setattr(_group, "_LEARNED", type(_group._LEARNED)())
    monkeypatch.setattr(_group, "_GIVEN_UP", type(_group._GIVEN_UP)())
    kernels, calls = _group_op._group_kernels(), {"fwd": 0, "bwd": 0}

    class Counting:
        fits = staticmethod(kernels.fits)

        @staticmethod
        def group_fwd(*args, **kwargs):
            calls["fwd"] += 1
            return kernels.group_fwd(*args, **kwargs)

        @staticmethod
        def group_bwd(*args, **kwargs):
            calls["bwd"] += 1
            return kernels.group_bwd(*args, **kwargs)

    monkeypatch.setattr(_group_op, "_group_kernels", lambda: Counting)
    return calls


@pytest.fixture
def set_flags():
    """``set_flags(**flags)``: fastaf's switches (``fastaf._config``) changed until the test ends."""
    with contextlib.ExitStack() as stack:
        yield lambda **flags: stack.enter_context(_config.override(**flags))
