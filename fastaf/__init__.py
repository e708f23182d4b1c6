"""fastaf: functional LoRA for PyTorch, with fused Triton kernels.

Adapters are immutable pytrees passed explicitly into ``functional_call``; the model is never
rewritten. The stateful layer (``init`` and the ``model.add_new_adapter`` family) and the file
I/O (PEFT's layout) sit on top of the functional core.
"""
from . import distributed, functional
from ._generate import generate
from .io import read_adapter, save_adapter
from ._stateful import init, load_adapter, push_adapter_to_hub, save_adapter_to_local_dir
from .functional import (
    Adapter,
    LoRA,
    LoRAConfig,
    extract_adapter,
    functional_call,
    init_adapter,
    merge,
    merge_into,
    stack,
    unstack,
)

__version__ = "0.1.0"

__all__ = [
    "Adapter",
    "LoRA",
    "LoRAConfig",
    "distributed",
    "extract_adapter",
    "functional",
    "functional_call",
    "generate",
    "init",
    "init_adapter",
    "load_adapter",
    "merge",
    "merge_into",
    "push_adapter_to_hub",
    "read_adapter",
    "save_adapter",
    "save_adapter_to_local_dir",
    "stack",
    "unstack",
]
