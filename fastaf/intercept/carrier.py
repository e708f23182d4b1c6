"""Eager ``functional_call`` without a mode: for the call, each targeted weight carries its adapter.

A ``TorchFunctionMode`` spanning the call sends every torch call of the model through Python,
~3-5 us each: on a Liger-patched Llama-3.2-1B that is ~3,200 calls and ~10 ms of host time per
forward on the H100 machine, in a step that is host-bound (``bench/e2e.py``: ``fastaf-autograd``
against ``fastaf-autograd-mode``). Here each targeted weight is swapped, for the call, for a
``Carrier``: a tensor subclass aliasing the weight's storage, whose ``__torch_function__`` sees
only the torch calls that receive it. The linear rules (``rules.linear_use``) send those to
``use.call_op`` with the call's mode (so both interceptions compute the same op); any other call runs on the
weight as it is, or, where it returns a tensor, again on W + ΔW (``LoRAMode.folded``: exact,
slower, warned once).

The swap is an entry in the module's ``_parameters`` (no ``__setattr__``, no hooks), undone when
the call returns or raises. An ``nn.Linear`` itself (its class exactly, no ``forward`` of its own
set on it) also gets, for as long as its weight is carried, an instance ``forward`` that hands
its input to the LoRA op directly (``_linear_forward``): the subclass's ``__torch_function__``
dispatch costs ~6 us per call on a fast CPU (the op stubbed: a carried nn.Linear 19.8 us, plain
13.4 us, with this forward 13.9 us), ~2-3x that on the H100 machine's host. It does exactly what the carrier would do, and defers to it where the carrier's path
could differ: another torch function mode active (a mode inside the call sees ``F.linear``
first), an input that is not a plain tensor, torch functions disabled, a trace. A detaching use of a carried weight (``W.data``, ``W.detach()``) is
counted on its route: a weight used only that way lost its LoRA (no gradient reaches A and B), an
error after the call as with the mode (where a per-call hook counts the module's runs instead).

Other threads see the carrier too, so it adapts only for the threads whose calls installed it:
per thread, a stack of (mode, route), innermost last (a nested call on the same model adapts with
its own adapter, as the inner mode would). Concurrent calls share one carrier per weight; the
last to leave puts the weight back.

Used where it is exactly the mode's behaviour: eagerly (no tracer, no functorch transform
active: one grad level is peeled off before, ``below_grad``), linear routes only (an expert
LoRA substitutes W + ΔW into any call: the mode's job), plain registered
parameters (no FSDP2 DTensor, no other subclass), no ``params=`` (torch.func's swap ties weights
by identity, which a carrier hides), no forward pre-hook in the model (one may swap a weight in,
as FSDP2 does) and no compiled module (dynamo would trace the carrier). ``adapter_ids`` are read
from the call's mode by ``use.call_op`` as in the mode's path: a mixed batch's eager decoding step
ran every torch call of the model through the mode before.
"""
from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._layouts import compiled_class
from ..ops import interpreter_stack
from . import rules, use

# A call's entry on a carrier is (its LoRAMode, the Route): typed loosely here, since the mode
# (mode.py) builds on this module and not the other way round.
LoRAMode = Route = Any

_lock = threading.Lock()  # installs and removals of carriers (concurrent calls on one model)
_PLAIN = (Tensor, nn.Parameter)


class _Carries(Tensor):
    """Common ``__torch_function__`` of a carried weight and of its transposed views."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        found = rules.linear_use(func, args, kwargs, _LOOKUP)
        if found is not None:
            (mode, route), x, weight, bias, flattened = found
            return use.call_op(mode, route, x, weight, bias, flattened=flattened)
        if (func in rules.TRANSPOSES or func in rules.TRANSPOSE_DIMS) and args and _entry(args[0]) is not None:
            if args[0].dim() == 2 and rules.reverses(func, args, kwargs):
                with torch._C.DisableTorchFunctionSubclass():
                    out = func(*args, **kwargs)
                return View.of(out, args[0])
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if not isinstance(out, Tensor) or func in rules.VALUE_FREE:  # W.shape, W.dtype, empty_like(W)
            return out
        if func in rules.DETACHING:  # W.detach(), W.data: no gradient could reach A and B
            _count_unadapted(args, kwargs)
            return out
        if not rules.foldable(func, args, out):  # W.to(W.dtype): still the carrier, for the rules next
            return out
        # a use no rule fuses (einsum, W @ x, W.to(...)): computed again on W + ΔW, exact
        swapped = rules.substitute(args, kwargs, lambda t: _folded(t, func))
        if swapped is None:
            return out
        with torch._C.DisableTorchFunctionSubclass():
            return func(*swapped[0], **swapped[1])


def _folded(t: Tensor, use: Any) -> Tensor | None:
    """W + ΔW for a carried weight of this thread's call, (W + ΔW).T for a view of one, else None."""
    entry = _entry(t.source if type(t) is View else t)
    if entry is None:
        return None
    if not entry[0].folds(entry[1]):  # a tied weight: stays unadapted, reported if that was all
        entry[1].calls += 1
        return None
    merged = entry[0].folded(entry[1], use)
    return merged.t() if type(t) is View else merged


def _count_unadapted(args: tuple, kwargs: dict) -> None:
    """Count a use of each carried weight among ``args`` (one level deep) that no rule adapted:
    a module whose weight saw only such uses lost its LoRA, which the call reports as an error."""
    for t in (*args, *kwargs.values()):
        entry = _entry(t if type(t) is not View else t.source)
        if entry is not None:
            entry[1].calls += 1


class Carrier(_Carries):
    """A targeted weight during eager calls: its storage (``raw``, the module's own tensor),
    per thread the calls that adapt it, and the ``forward`` set on its ``nn.Linear``, if any."""

    raw: Tensor
    calls: dict[int, list[tuple[LoRAMode, Route]]]
    forward: Callable[[Tensor], Tensor] | None

    @staticmethod
    def of(raw: Tensor) -> Carrier:
        carrier = raw.as_subclass(Carrier)
        carrier.raw, carrier.calls, carrier.forward = raw, {}, None
        return carrier


def _linear_forward(module: nn.Linear) -> Callable[[Tensor], Tensor]:
    """``nn.Linear.forward`` for ``module`` while its weight is carried: the carrier's F.linear
    rule without its ``__torch_function__`` dispatch (module docstring)."""

    def forward(input: Tensor) -> Tensor:  # nn.Linear.forward's parameter name: module(input=x) works
        weight, bias = module._parameters["weight"], module._parameters["bias"]
        if (type(input) is Tensor and torch._C._len_torch_function_stack() == 0
                and torch._C._is_torch_function_enabled() and not torch.compiler.is_compiling()):
            entry = _entry(weight)
            if entry is not None and not entry[1].spec.transposed:
                return use.call_op(entry[0], entry[1], input, weight.raw, bias)
        return F.linear(input, weight, bias)  # the carrier's own path, as nn.Linear.forward

    return forward


def _takes_forward(module: nn.Module, name: str) -> bool:
    """Whether a carried weight's module may get ``_linear_forward``: an ``nn.Linear`` exactly
    (a subclass may compute otherwise) without a ``forward`` set on the instance (accelerate's
    hooks set one), its ``weight`` carried."""
    return type(module) is nn.Linear and name == "weight" and "forward" not in module.__dict__


class View(_Carries):
    """A transposed view of a carried weight (``W.T``), for ``x @ W.T``."""

    source: Carrier

    @staticmethod
    def of(view: Tensor, source: Carrier) -> View:
        out = view.as_subclass(View)
        out.source = source
        return out


def _entry(t: Any) -> tuple[LoRAMode, Route] | None:
    """(mode, route) of the innermost call of this thread that adapts ``t``, or None."""
    if type(t) is not Carrier:
        return None
    stack = t.calls.get(threading.get_ident())
    return stack[-1] if stack else None


class _CarriedLookup:
    """``rules.linear_use``'s lookup over carriers: the target is this thread's (mode, route)."""

    @staticmethod
    def nk(t: Any) -> tuple[tuple[LoRAMode, Route], Tensor] | None:
        entry = _entry(t)
        return (entry, t.raw) if entry is not None and not entry[1].spec.transposed else None

    @staticmethod
    def kn(t: Any) -> tuple[tuple[LoRAMode, Route], Tensor, bool] | None:
        if type(t) is View:  # x @ W.T of an (N, K) weight
            entry = _entry(t.source)
            return (entry, t.source.raw, False) if entry is not None and not entry[1].spec.transposed else None
        entry = _entry(t)
        if entry is not None and entry[1].spec.transposed:  # x @ W of a Conv1D (K, N) weight
            return entry, t.raw.t(), True
        return None


_LOOKUP = _CarriedLookup()


def raw(t: Any) -> Any:
    """The module's own tensor behind a carrier or a carrier's transposed view (a mode inside a
    carried call keys the weight the module holds, the carrier, and computes on its tensor)."""
    if type(t) is Carrier:
        return t.raw
    return t.source.raw.t() if type(t) is View else t


def eligible(model: nn.Module, mode: LoRAMode, params: Mapping[str, Tensor] | None) -> bool:
    """Whether this eager call may carry its adapter on the weights instead of entering ``mode``."""
    # params=: torch.func.functional_call finds tied weights by identity, which a carrier hides
    if params or mode.params or interpreter_stack():
        return False
    if torch._C._len_torch_dispatch_stack() > 0:
        return False
    for route in mode.routes.values():  # linear routes (expert ones are mode.params)
        held = route.module._parameters.get(route.name)
        if held is not route.weight or type(raw(held)) not in _PLAIN:  # a registered plain parameter
            return False
    if nn.modules.module._global_forward_pre_hooks:
        return False
    # a pre-forward hook may swap a weight in (FSDP2 registers its unsharded one; a carrier swapped
    # out would lose the adapter, which the mode follows); a compiled module would trace a carrier
    walked = model.modules() if mode.modules is None else mode.modules.values()
    return not any(m._forward_pre_hooks or compiled_class(m) is not None for m in walked)


class carried:
    """Context manager: the routes' weights carry ``mode``'s adapter for this thread."""

    def __init__(self, mode: LoRAMode) -> None:
        self.mode = mode
        self.installed: list[tuple[nn.Module, str, Carrier, tuple]] = []

    def __enter__(self) -> carried:
        tid = threading.get_ident()
        with _lock:
            try:
                for route in self.mode.routes.values():
                    held = route.module._parameters[route.name]
                    carrier = held if type(held) is Carrier else Carrier.of(held)
                    entry = (self.mode, route)
                    carrier.calls.setdefault(tid, []).append(entry)
                    self.installed.append((route.module, route.name, carrier, entry))
                    route.module._parameters[route.name] = carrier
                    if carrier.forward is None and _takes_forward(route.module, route.name):
                        carrier.forward = _linear_forward(route.module)
                        route.module.__dict__["forward"] = carrier.forward  # no __setattr__: not a submodule
            except BaseException:  # an interrupt mid-install: nothing stays swapped
                self._remove(tid)
                raise
        return self

    def __exit__(self, *exc: Any) -> None:
        with _lock:
            self._remove(threading.get_ident())

    def _remove(self, tid: int) -> None:
        """Take this call's entries off its carriers (the lock held); put back a weight no call carries."""
        for module, name, carrier, entry in reversed(self.installed):
            stack = carrier.calls.get(tid, [])
            for i in range(len(stack) - 1, -1, -1):  # by identity: a route compares its tensors
                if stack[i] is entry:
                    del stack[i]
                    break
            if not stack:
                carrier.calls.pop(tid, None)
            if not carrier.calls and module._parameters.get(name) is carrier:
                module._parameters[name] = carrier.raw
                if carrier.forward is not None and module.__dict__.get("forward") is carrier.forward:
                    del module.__dict__["forward"]
                carrier.forward = None
        self.installed.clear()
