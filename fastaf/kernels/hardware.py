"""What the GPU offers a launch: SM count, shared memory, TMA addressability, TMA scratch.

Under TRITON_INTERPRET=1 the Triton path runs on CPU tensors (``available``); the CPU then counts
as Hopper (TMA descriptors work in the interpreter) with unbounded shared memory.
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import triton


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available(x: torch.Tensor) -> bool:
    """True when the Triton path can run on ``x``: CUDA tensor, or CPU tensor under TRITON_INTERPRET=1."""
    return x.is_cuda or (x.device.type == "cpu" and _interpret())


@functools.lru_cache(maxsize=None)
def _device_info(index: int) -> tuple[str, int, int, int]:
    """(name, SM count, compute capability major, shared memory per block in bytes)."""
    props = torch.cuda.get_device_properties(index)
    smem = getattr(props, "shared_memory_per_block_optin", 0) or 227 * 1024  # Hopper: 227 KB
    return props.name, props.multi_processor_count, props.major, smem


def smem_limit(device: torch.device) -> int:
    return _device_info(device.index)[3] if device.type == "cuda" else 1 << 30


def _torch_scratch(size: int, alignment: int, stream: Optional[int]) -> torch.Tensor:
    # a fresh block per launch, from the caching allocator: a buffer kept across launches could be
    # a CUDA-graph pool's block (cudagraph trees warm up in their pool without capturing)
    return torch.empty(size, device="cuda", dtype=torch.int8)


def _ensure_allocator() -> None:
    """Device-side TMA descriptors need global scratch; Triton gets it from this allocator.

    Set before every launch, not once: Triton keeps the allocator in a ContextVar, and the
    backward runs on autograd's own thread, where a once-set allocator is not visible.
    """
    triton.set_allocator(_torch_scratch)


def _tma_ready(*views: tuple[torch.Tensor, int]) -> bool:
    """Every (tensor, unit-stride dim) pair is TMA-addressable: 16-byte base and other strides."""
    for t, dim in views:
        if t.stride(dim) != 1 or t.data_ptr() % 16:
            return False
        if any((s * t.element_size()) % 16 for d, s in enumerate(t.stride()) if d != dim):
            return False
    return True


def _tma_2d(t: torch.Tensor, dim: int) -> bool:
    """A 2-D tensor with unit stride on ``dim`` is TMA-addressable: 16-byte base and other stride."""
    strides = t.stride()  # one call for both (this runs per operand and launch)
    return strides[dim] == 1 and (strides[1 - dim] * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def _rows_tma_ready(t: torch.Tensor) -> bool:
    """The skinny kernels' x, a, dy: unit stride on dim 1, TMA-addressable."""
    return _tma_2d(t, 1)


def _hopper(device: torch.device) -> bool:
    """TMA descriptors can be used: Hopper or newer, or the CPU interpreter."""
    return device.type == "cpu" or _device_info(device.index)[2] >= 9
