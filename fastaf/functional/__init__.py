"""The pure functional core: adapter pytrees, the fused ops, ``functional_call`` and merging."""
from .._adapter import Adapter, LoRA
from .._stack import stack, unstack
from ..intercept import adapter_mode, checkpoint_context
from ..ops import lora_linear
from ._call import functional_call
from ._init import LoRAConfig, init_adapter
from ._merge import extract_adapter, merge, merge_into

__all__ = [
    "Adapter",
    "LoRA",
    "LoRAConfig",
    "adapter_mode",
    "checkpoint_context",
    "extract_adapter",
    "functional_call",
    "init_adapter",
    "lora_linear",
    "merge",
    "merge_into",
    "stack",
    "unstack",
]
