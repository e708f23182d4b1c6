"""Global torch modes a test turns on for a block, restored after whatever the block raised."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
import torch

# the grouped op runs the Triton kernels: the interpreter on the CPU
needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="the grouped op runs the Triton kernels (the interpreter on the CPU)")


@contextlib.contextmanager
def deterministic(warn_only: bool = False) -> Iterator[None]:
    """``torch.use_deterministic_algorithms(True, warn_only=warn_only)`` inside the block."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
