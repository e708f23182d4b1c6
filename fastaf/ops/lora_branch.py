"""The LoRA as a branch beside a layer: ``scale * dropout(x) @ A.T @ B.T``, added to the output of
a linear layer fastaf does not run itself.

A quantized linear (bitsandbytes' ``Linear4bit`` and ``Linear8bitLt``, GPTQ, AWQ, HQQ layers)
computes ``x @ W.T + bias`` from packed weights in its own forward. Its LoRA is added to that
output (exact for a linear map: PEFT's QLoRA does the same), so the module runs as it is and its
weights are never read by fastaf. Plain torch ops: autograd, ``torch.func`` and ``torch.compile``
take them as they are.
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from .._adapter import LoRA


def lora_branch(x: Tensor, lora: LoRA, training: bool) -> Tensor:
    """``lora.scale * (dropout(x) @ A.T) @ B.T``, in x's dtype (the factors are cast to it).

    Args:
        x: (..., K), the layer's input.
        lora: A (r, K), B (N, r), not stacked.
        training: draw ``lora.dropout`` (the layer's ``training`` flag, as PEFT's).
    Returns:
        (..., N), to be added to the layer's output.
    """
    a, b = lora.A.to(x.dtype), lora.B.to(x.dtype)
    dropped = F.dropout(x, float(lora.dropout), training) if training and lora.dropout else x
    return F.linear(F.linear(dropped, a), b) * float(lora.scale)
