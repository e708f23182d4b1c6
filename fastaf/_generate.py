"""``fastaf.generate``: Hugging Face ``generate`` with an explicit adapter, or a stack and per-row ids."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .functional import Adapter
from .functional._call import scoped_call


def generate(
    model: nn.Module,
    adapter: Adapter | list[Adapter] | None,
    input_ids: torch.Tensor,
    *,
    adapter_ids: torch.Tensor | None = None,
    **generate_kwargs: Any,
) -> Any:
    """``model.generate(input_ids, **generate_kwargs)`` with ``adapter`` applied wherever its
    modules run (the encoder of an encoder-decoder too); the model is left as it was.

    Args:
        model: a Hugging Face model with ``generate``; plain or ``fastaf.init``-ed (the explicit
            adapter stands in for the active one).
        adapter: an ``Adapter``, a list of them (their deltas add), or a stacked one with
            ``adapter_ids``.
        input_ids: (batch, seq).
        adapter_ids: (batch,) int tensor for a stacked adapter: row i decodes with slot
            ``adapter_ids[i]``, -1 with the base model. Beams and ``num_return_sequences`` repeat
            each row's id, as generate repeats the row.
        **generate_kwargs: passed to ``model.generate``.
    Returns:
        What ``model.generate`` returns.
    """
    return scoped_call(model, adapter, lambda: model.generate(input_ids, **generate_kwargs),
                       adapter_ids=adapter_ids, inputs=((input_ids,), {}))
