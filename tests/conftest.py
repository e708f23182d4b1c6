"""Shared pytest set-up: the repo root on sys.path (for tests._models, tests._tolerances),
GPU tests skipped cleanly without CUDA, and every test seeded."""
import sys
from pathlib import Path

import pytest
import torch

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
