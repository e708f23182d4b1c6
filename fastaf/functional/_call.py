"""``functional_call``: run an unmodified model with an adapter passed explicitly.

The call checks its arguments, runs below an eager ``torch.func.grad`` level where it can
(``intercept.call_below``: the model then runs as plain autograd), and hands the model's run to
``intercept.scoped_call``, which applies the adapter to every use of a targeted weight and raises
after the call for a targeted module whose LoRA was lost. The model is left exactly as it was.
"""
from __future__ import annotations

import functools
import inspect
import warnings
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .._adapter import Adapter
from .._layouts import check_module
from ..intercept import call_below, checkpoint_context, grad_level, scoped_call
from ..ops import bottom, tracked_scope


def _check_recompute_sees_the_adapter(model: nn.Module) -> None:
    """Refuse a training call whose transformers gradient checkpointing would recompute a layer
    without the adapter (no ``checkpoint_context``): torch's non-reentrant checkpoint then failed
    in backward ("A different number of tensors was saved"), the reentrant one with fastaf's
    unused-weight error, neither naming the fix. One walk over the modules, on a grad-enabled call
    (transformers sets the flag on each instance: its class default stays False)."""
    for module in model.modules():  # __dict__: nn.Module's __getattr__ for each module was 0.3 ms a call
        if module.__dict__.get("gradient_checkpointing") is True and module.training:
            fn = getattr(module, "_gradient_checkpointing_func", None)
            if isinstance(fn, functools.partial) and fn.keywords.get("context_fn") is checkpoint_context:
                continue
            path = next(p for p, m in model.named_modules() if m is module) or "the model"
            raise ValueError(
                f"fastaf.functional_call: {path} ({type(module).__name__}) runs under transformers' gradient "
                "checkpointing, whose recompute in backward would run without the adapter: enable it with fastaf's "
                "context, model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={\"use_reentrant\": "
                "False, \"context_fn\": fastaf.functional.checkpoint_context}), or use the stateful layer "
                "(fastaf.init), whose hooks apply during recomputes"
            )


_checked_frozen: weakref.WeakSet = weakref.WeakSet()  # models whose base was looked at once


def _warn_unfrozen(model: nn.Module) -> None:
    """Warn once per model when its base parameters require grad: autograd then computes and keeps
    a gradient for every base weight besides the adapter's (on SmolLM2-135M a step took 1.62x the
    frozen one and 540 MB more), which a LoRA step never needs. The stateful layer's registry
    (``model.fastaf``, the adapters' own factors) is not the base."""
    if model in _checked_frozen:
        return
    _checked_frozen.add(model)
    trainable = [p for name, p in model.named_parameters() if p.requires_grad and not name.startswith("fastaf.")]
    if trainable:
        warnings.warn(
            f"fastaf.functional_call: {len(trainable)} of {type(model).__name__}'s base parameters "
            f"({sum(p.numel() for p in trainable):,} values) require grad, so a backward computes and keeps a "
            "gradient for each of them besides the adapter's (time and memory a LoRA step does not need): "
            "freeze the base with model.requires_grad_(False) unless you train it too",
            stacklevel=3,
        )


def _keyword_inputs(model: nn.Module, args: Mapping) -> bool:
    """Whether a mapping passed as ``args`` holds keyword inputs of ``model.forward`` (an HF batch:
    input_ids, labels, ...), not one positional argument of a forward that takes a dict."""
    try:
        names = set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return False
    return len(args) > 0 and all(isinstance(k, str) and k in names for k in args)


def functional_call(
    model: nn.Module,
    adapter: Adapter | Sequence[Adapter] | None,
    args: Any = (),
    kwargs: dict[str, Any] | None = None,
    *,
    params: Mapping[str, Tensor] | None = None,
    adapter_ids: Tensor | None = None,
    impl: str = "auto",
) -> Any:
    """Call ``model(*args, **kwargs)`` with ``adapter`` applied to its targeted linear layers.

    Args:
        model: any ``nn.Module`` (a plain Hugging Face model works as is); it is left exactly as
            it was, also when the call raises.
        adapter: an ``Adapter``, a list of Adapters (their deltas add), or None.
        args: positional arguments (a single tensor is wrapped in a tuple).
        kwargs: a dict of keyword arguments, or None.
        params: name -> tensor replacing the model's parameters/buffers for this call, as in
            ``torch.func.functional_call``.
        adapter_ids: (batch,) integer tensor with a stacked ``adapter`` (``fastaf.stack``):
            example i uses slot ``adapter_ids[i]``, -1 the base model alone. Checked before the
            model runs (one host sync for the range); under ``torch.compile`` the trace checks
            its type, shape and device, and the range is an assert where the ids are (on CUDA a
            device-side assert, as torch's own out-of-range indexing).
        impl: kernel choice for every adapted layer ("auto", "triton", "torch").
    Returns:
        Whatever the model returns.
    """
    check_module(model, "fastaf.functional_call")
    if isinstance(args, Mapping) and _keyword_inputs(model, args):
        raise TypeError(
            f"fastaf.functional_call: args is a {type(args).__name__} of keyword inputs ({', '.join(list(args)[:4])}"
            f"{', ...' if len(args) > 4 else ''}); a dict belongs in kwargs: functional_call(model, adapter, (), batch) "
            "or functional_call(model, adapter, kwargs=batch)"
        )
    if not isinstance(args, tuple):
        args = (args,)
    if kwargs is None:
        kwargs = {}
    elif not isinstance(kwargs, Mapping):
        what = f"a Tensor {tuple(kwargs.shape)}" if isinstance(kwargs, Tensor) else f"a {type(kwargs).__name__}"
        raise TypeError(f"fastaf.functional_call: kwargs must be a dict of keyword arguments or None, got {what}; "
                        "pass the model's positional inputs in args: functional_call(model, adapter, (x,))")
    if isinstance(adapter_ids, tuple):  # scoped_call's candidates are fastaf.generate's, not a caller's
        raise TypeError(f"fastaf: adapter_ids must be a torch.Tensor, got a tuple of {len(adapter_ids)}")
    inputs = (adapter, args, kwargs, params, adapter_ids)
    level = grad_level(model, inputs)
    if level:  # one eager torch.func.grad level: the model runs below it, as plain autograd
        call = lambda i: functional_call(model, i[0], i[1], i[2], params=i[3], adapter_ids=i[4], impl=impl)  # noqa: E731
        return call_below(level, call, inputs)
    if adapter and torch.is_grad_enabled() and not torch.compiler.is_compiling():  # not fastaf.generate's
        _check_recompute_sees_the_adapter(model)
        if not params:
            _warn_unfrozen(model)
    if params:
        given, tie = _tied_params(model, params)
        run = lambda: torch.func.functional_call(model, given, args, kwargs, tie_weights=tie)  # noqa: E731
    else:
        run = lambda: model(*args, **kwargs)  # noqa: E731
    batch = _batch_size(args, kwargs) if adapter_ids is not None else None
    with tracked_scope(inputs):  # MAML's outer autograd: every layer leaves its graph beneath the levels
        return scoped_call(model, adapter, run, params=params, adapter_ids=adapter_ids, impl=impl, batch=batch)


def _tied_params(model: nn.Module, params: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], bool]:
    """(the mapping to call with, torch.func's ``tie_weights``) for ``params``.

    Where ``params`` gives names of one tied parameter different tensors (``merge_into``'s W + ΔW
    for a tied lm_head beside the input embedding's W, as PEFT adapts lm_head alone), the call
    unties them, which torch.func's default (ties kept) refuses. Untied, no tie holds: every name
    of each tie that ``params`` leaves out is filled from the first name it gives (BART's four
    names of one embedding, lm_head given apart, keep the other three on the given shared
    weight). Otherwise ``params`` as it is, with ties kept. Tensors are told apart beneath
    torch.func's wrappers: a grad level wraps each name of one tensor apart."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    ties = [names for names in groups.values() if len(names) > 1]
    traced = torch.compiler.is_compiling()  # dynamo folds `is`; it does not trace the unwrapping

    def same(a: Tensor, b: Tensor) -> bool:
        return a is b or (not traced and bottom(a) is bottom(b))

    split = False
    for names in ties:
        given = [params[n] for n in names if n in params]
        split = split or any(not same(given[0], t) for t in given[1:])
    if not split:
        return dict(params), True
    filled = dict(params)
    for names in ties:
        given = next((n for n in names if n in params), None)
        if given is not None:
            for name in names:
                filled.setdefault(name, params[given])
    return filled, False


# keyword inputs whose leading size is the batch, in the order they are asked
_BATCH_INPUTS = ("input_ids", "inputs_embeds", "pixel_values", "input_features", "input_values")


def _batch_size(args: tuple, kwargs: dict) -> tuple[int, str] | None:
    """(the batch size, the input it was read from): the leading size of a model input known to
    lead with the batch, else of the first positional tensor; None when neither is there (a
    ``position_ids`` (1, T) or ``cache_position`` (T,) keyword gives no batch size). Each layer
    checks its rows against the ids anyway."""
    for name in _BATCH_INPUTS:
        t = kwargs.get(name)
        if isinstance(t, Tensor) and t.dim() > 0:
            return t.shape[0], f"{name} {tuple(t.shape)}"
    for i, t in enumerate(torch.utils._pytree.tree_leaves(args)):
        if isinstance(t, Tensor) and t.dim() > 0:
            return t.shape[0], f"positional input {i} {tuple(t.shape)}"
    return None


