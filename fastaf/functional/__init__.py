"""The pure functional core: adapter pytrees, the fused ops, ``functional_call`` and merging."""
from ._adapter import Adapter, LoRA
from ._call import checkpoint_context, explicit_mode_active, functional_call, scoped_call
from ._mode import adapter_mode, module_mode
from ._routes import link_siblings, module_routes
from ._group import Groups
from ._config import LoRAConfig, init_adapter
from ._lora_linear import lora_linear
from ._merge import extract_adapter, merge, merge_into
from ._stack import stack, unstack

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
