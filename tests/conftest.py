"""Shared pytest set-up: the repo root on sys.path (for tests._models, tests._tolerances),
GPU tests skipped cleanly without CUDA, and every test seeded."""
import sys
from pathlib import Path

import pytest
import torch

from fastaf.functional import _group

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


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
    kernels, calls = _group._group_kernels(), {"fwd": 0, "bwd": 0}

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

    monkeypatch.setattr(_group, "_group_kernels", lambda: Counting)
    return calls
