"""The LoRA as a branch beside a layer: ``scale * dropout(x) @ A.T @ B.T``, added to the output of
a linear layer fastaf does not run itself.

A quantized linear (bitsandbytes' ``Linear4bit`` and ``Linear8bitLt``, GPTQ, AWQ, HQQ layers)
computes ``x @ W.T + bias`` from packed weights in its own forward. Its LoRA is added to that
output (exact for a linear map: PEFT's QLoRA does the same), so the module runs as it is and its
weights are never read by fastaf. Plain torch ops: autograd, ``torch.func`` and ``torch.compile``
take them as they are.
"""
from __future__ import annotations

import torch
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


def lora_branch_multi(x: Tensor, lora: LoRA, ids: Tensor, training: bool) -> Tensor:
    """``lora_branch`` with one slot of a stack per example: example i (the rows x[i]) takes slot
    ``ids[i]``, and nothing where ``ids[i] == -1``.

    Args:
        x: (batch, ..., K) with batch == len(ids).
        lora: stacked, A (n, r, K), B (n, N, r) (``fastaf.stack``: one scale).
        ids: (batch,) int in [-1, n), on any device.
        training: draw ``lora.dropout``.
    Returns:
        (batch, ..., N).
    """
    n = ids.shape[0]
    ids = ids.to(x.device)
    slot = ids.clamp(min=0)
    a = lora.A[slot].to(x.dtype)  # (batch, r, K)
    b = lora.B[slot].to(x.dtype)  # (batch, N, r)
    rows = x.reshape(n, -1, x.shape[-1])  # (batch, S, K)
    dropped = F.dropout(rows, float(lora.dropout), training) if training and lora.dropout else rows
    y = torch.bmm(torch.bmm(dropped, a.transpose(1, 2)), b.transpose(1, 2)) * float(lora.scale)  # (batch, S, N)
    y = y * (ids >= 0).to(y.dtype)[:, None, None]
    return y.reshape(*x.shape[:-1], y.shape[-1])
