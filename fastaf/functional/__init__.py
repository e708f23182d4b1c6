"""The pure functional core: adapter pytrees, the fused ops and ``functional_call``."""
from ._adapter import Adapter, LoRA
from ._call import functional_call
from ._config import LoRAConfig, init_adapter
from ._lora_linear import lora_linear
from ._stack import stack, unstack

__all__ = [
    "Adapter",
    "LoRA",
    "LoRAConfig",
    "functional_call",
    "init_adapter",
    "lora_linear",
    "stack",
    "unstack",
]
