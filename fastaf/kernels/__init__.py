"""fastaf's Triton kernels and their launchers: no autograd, no functorch, no model.

Per family a launcher file beside a kernels file: ``lora_linear`` (launchers) with
``lora_linear_kernels`` (``@triton.jit``), ``lora_linear_configs`` and ``lora_linear_plan``
(memoised launch plans); ``lora_multi`` with ``lora_multi_kernels`` (stacks and per-row ids);
``lora_group`` (siblings over one input); ``lora_decode`` (a decoding step's few rows) and
``dequant_4bit`` (a bitsandbytes 4-bit weight to floats in one launch). ``dispatch`` chooses between
the Triton path and cuBLAS + ``addmm`` per shape from measurements in the tuning ``cache``
(``tuning`` measures, ``fastaf-tune`` runs it). The launcher modules import triton: ops/ imports
them lazily, at the first kernel call, so ``import fastaf`` does not pay for triton.
"""
from .dispatch import atomics_ok
from .dropout_hash import element_index, hash_uniform, keep_mask
