"""fastaf: functional LoRA for PyTorch, with fused Triton kernels.

Adapters are immutable pytrees passed explicitly into ``functional_call``; the model is never
rewritten. See README.md for the quick start and ../DESIGN.md for the architecture.
"""
from . import functional
from .functional import (
    Adapter,
    LoRA,
    LoRAConfig,
    functional_call,
    init_adapter,
    stack,
    unstack,
)

__version__ = "0.1.0"

__all__ = [
    "Adapter",
    "LoRA",
    "LoRAConfig",
    "functional",
    "functional_call",
    "init_adapter",
    "stack",
    "unstack",
]
