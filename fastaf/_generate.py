"""``fastaf.generate``: Hugging Face ``generate`` with an explicit adapter, or a stack and per-row ids."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ._adapter import Adapter
from ._layouts import check_module
from .intercept import scoped_call


def generate(
    model: nn.Module,
    adapter: Adapter | list[Adapter] | None,
    input_ids: torch.Tensor | None = None,
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
        input_ids: (batch, seq), or None for models whose inputs come in ``generate_kwargs``
            (Whisper's ``input_features``): the batch is then the first of those tensors' sizes.
        adapter_ids: (batch,) int tensor for a stacked adapter: row i decodes with slot
            ``adapter_ids[i]``, -1 with the base model. With ``num_beams`` or
            ``num_return_sequences`` above 1 (as keywords or in a ``generation_config``) generate
            repeats each row max(num_beams, num_return_sequences) times for the decoding steps,
            and each id with it; an encoder (T5, BART, Whisper) or a vision tower (LLaVA) that
            generate runs before that, on the rows as given, takes the ids as given.
        **generate_kwargs: passed to ``model.generate``.
    Returns:
        What ``model.generate`` returns.
    """
    check_module(model, "fastaf.generate")
    if input_ids is not None:
        generate_kwargs["input_ids"] = input_ids
    batch = _batch(generate_kwargs)
    ids: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = adapter_ids
    if isinstance(adapter_ids, torch.Tensor) and adapter_ids.dim() == 1 and adapter_ids.shape[0] == batch:
        # generate expands each row max(num_beams, num_return_sequences) times (repeat_interleave,
        # transformers 5's _expand_inputs_for_generation) after it ran the encoder or the vision
        # tower on the rows as given: each layer takes the ids that fit its rows (check_rows), and
        # scoped_call checks the ids as given, first
        expand = max(_setting(model, generate_kwargs, "num_beams"), _setting(model, generate_kwargs, "num_return_sequences"))
        if expand > 1:
            ids = (adapter_ids, adapter_ids.repeat_interleave(expand))
    return scoped_call(model, adapter, lambda: model.generate(**generate_kwargs), adapter_ids=ids, batch=batch)


def _setting(model: nn.Module, generate_kwargs: dict, field: str) -> int:
    """A generation setting as generate resolves it: the keyword, else the passed
    ``generation_config``'s value where set (transformers 5 leaves unset fields None), else the
    model's ``generation_config`` (BART's and T5's ship num_beams 4-5), else 1."""
    passed = generate_kwargs.get("generation_config")
    for value in (generate_kwargs.get(field), getattr(passed, field, None),
                  getattr(getattr(model, "generation_config", None), field, None)):
        if value is not None:
            return int(value) or 1
    return 1


def _batch(generate_kwargs: dict) -> int:
    """The number of rows: ``input_ids``' first size, else that of the first tensor argument."""
    first = generate_kwargs.get("input_ids")
    if first is None:
        first = next((v for v in generate_kwargs.values() if isinstance(v, torch.Tensor) and v.dim() > 0), None)
    if first is None:
        raise ValueError("fastaf.generate: no input_ids and no tensor input in generate_kwargs (e.g. input_features)")
    return first.shape[0]
