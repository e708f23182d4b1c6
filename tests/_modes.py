"""Global torch modes a test turns on for a block, restored after whatever the block raised."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def deterministic(warn_only: bool = False) -> Iterator[None]:
    """``torch.use_deterministic_algorithms(True, warn_only=warn_only)`` inside the block."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
