"""Per-example adapters from a stack: example i of the batch uses adapter ``ids[i]``.

    y[i] = x[i] @ W.T + b + s * (x[i] @ A[ids[i]].T) @ B[ids[i]].T,   ids[i] = -1: the base alone

x (batch, ..., K), W (N, K), stacked A (n, R, K), B (n, N, R) (``fastaf.stack``: one scale per
path, ranks zero-padded), ids (batch,) integers in [-1, n). This is the batched torch reference,
and what runs on every device until the grouped kernels exist: one gather of each example's
factors and two batched GEMMs, differentiable by autograd and ``torch.func`` (the gathers' VJP
adds each example's gradient into its own adapter's slot), traceable by ``torch.compile``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._adapter import LoRA


def check_rows(ids: Tensor, rows: int, where: str, *, flattened: bool = False) -> Tensor:
    """``ids`` for a layer's input of ``rows`` rows: one row per id; anything else is an error,
    never a guess (a layer laid out time-first, or over tokens gathered per expert, cannot be
    mapped to ids). ``flattened``: the layer flattened (batch, seq, K) to (batch * seq, K) in
    batch-major order (GPT-2's Conv1D before its addmm), so each id covers seq consecutive rows."""
    if flattened and ids.shape[0] and rows % ids.shape[0] == 0:
        return ids.repeat_interleave(rows // ids.shape[0])
    if rows != ids.shape[0]:
        raise ValueError(
            f"{where}: adapter_ids has {ids.shape[0]} entries but the layer's input has {rows} rows; "
            "adapter_ids needs layers whose first dimension is the batch"
        )
    return ids


def lora_linear_multi(x: Tensor, weight: Tensor, bias: Tensor | None, lora: LoRA, ids: Tensor, *,
                      training: bool = False) -> Tensor:
    """``F.linear(x, weight, bias)`` plus, for each example i, the LoRA of slot ``ids[i]``.

    Args:
        x: (batch, ..., K).
        weight: (N, K); bias: (N,) or None.
        lora: stacked, A (n, R, K) and B (n, N, R); cast to x's dtype (gradients flow back).
        ids: (batch,) int32/int64 in [-1, n); -1 is the base model.
        training: apply ``lora.dropout`` to the LoRA branch's input.
    Returns:
        (batch, ..., N).
    """
    base = F.linear(x, weight, bias)
    rows, K = x.shape[0], x.shape[-1]
    slot = ids.clamp(min=0).long()
    A = lora.A.to(x.dtype)[slot]  # (batch, R, K)
    B = lora.B.to(x.dtype)[slot]  # (batch, N, R)
    gate = (ids >= 0).to(x.dtype) * lora.scale  # (batch,): 0 for the base-only rows
    xs = x.reshape(rows, -1, K)  # (batch, T, K)
    if training and lora.dropout:
        xs = F.dropout(xs, lora.dropout, training=True)
    h = torch.bmm(xs, A.transpose(1, 2))  # (batch, T, R)
    delta = torch.bmm(h, B.transpose(1, 2)) * gate[:, None, None]  # (batch, T, N)
    return base + delta.reshape(base.shape)
