"""``functional_call``: run an unmodified model with an adapter passed explicitly.

The model is never touched. For the duration of the call a ``TorchFunctionMode`` routes the
base layers' own ``F.linear(x, W, b)`` (``nn.Linear``) and ``torch.addmm(b, x, W)`` (GPT-2's
``Conv1D``) calls whose weight is a targeted module's weight into ``lora_linear``, so the base
GEMM and the LoRA term run as one fused op. No hooks, patched methods or swapped modules are
left to clean up; ``params`` are swapped by ``torch.func.functional_call``, which restores them.
The mode is a plain Python object, so ``torch.func`` transforms and ``torch.compile`` trace
through it (checked with ``torch._dynamo.explain`` in the tests).
"""
from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from ._adapter import Adapter, LoRA
from ._lora_linear import lora_linear
from ._modules import LinearSpec, linear_spec


@dataclasses.dataclass
class _Route:
    """Where one targeted module's weight goes: its path, module, LoRA and layout."""

    path: str
    module: nn.Module
    weight: Tensor
    lora: LoRA
    spec: LinearSpec
    hits: int = 0


class _LoRAMode(TorchFunctionMode):
    """Sends the targeted weights' linear calls through ``lora_linear``."""

    def __init__(self, routes: dict[int, _Route], impl: str) -> None:
        super().__init__()
        self.routes = routes
        self.impl = impl

    def _route(self, weight: Any) -> _Route | None:
        route = self.routes.get(id(weight))
        return route if route is not None and route.weight is weight else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            route = self._route(args[1] if len(args) > 1 else kwargs.get("weight"))
            if route is not None and not route.spec.transposed:
                x = args[0] if args else kwargs["input"]
                bias = args[2] if len(args) > 2 else kwargs.get("bias")
                return self._apply(route, x, route.weight, bias)
        elif func is torch.addmm:
            route = self._route(args[2] if len(args) > 2 else kwargs.get("mat2"))
            if route is not None and route.spec.transposed and not kwargs.get("out"):
                if kwargs.get("beta", 1) == 1 and kwargs.get("alpha", 1) == 1:
                    bias = args[0] if args else kwargs["input"]
                    x = args[1] if len(args) > 1 else kwargs["mat1"]
                    # Conv1D stores W as (in, out): W.T is the (N, K) view lora_linear takes.
                    return self._apply(route, x, route.weight.t(), bias)
        return func(*args, **kwargs)

    def _apply(self, route: _Route, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        route.hits += 1
        return lora_linear(
            x, weight, bias, route.lora, impl=self.impl, training=route.module.training, where=route.path
        )


def _combine(adapter: Adapter | Sequence[Adapter] | None) -> Adapter | None:
    if adapter is None or isinstance(adapter, Adapter):
        return adapter
    if isinstance(adapter, Sequence) and all(isinstance(a, Adapter) for a in adapter):
        if not adapter:
            return None
        total = adapter[0]
        for a in adapter[1:]:
            total = total + a  # exact: rank concatenation, one fused op per layer
        return total
    raise TypeError(
        f"adapter must be a fastaf.Adapter, a list of Adapters or None, got {type(adapter).__name__}"
    )


def _routes(model: nn.Module, adapter: Adapter, params: Mapping[str, Tensor]) -> dict[int, _Route]:
    """Validate every path of ``adapter`` against ``model`` and map weight ids to routes."""
    modules = dict(model.named_modules())
    check = not torch.compiler.is_compiling()
    routes: dict[int, _Route] = {}
    for path, lora in adapter.items():
        module = modules.get(path)
        if module is None:
            close = [p for p in modules if p.endswith(path.rsplit(".", 1)[-1])][:3]
            raise ValueError(
                f"adapter path {path!r} is not a module of {type(model).__name__}"
                + (f" (similar: {close})" if close else "")
            )
        spec = linear_spec(module)
        if spec is None:
            raise ValueError(f"adapter path {path!r} is a {type(module).__name__}, not a linear layer")
        weight = params.get(f"{path}.weight", module.weight)
        if check:
            if lora.stacked:
                raise ValueError(
                    f"{path}: stacked LoRA A {tuple(lora.A.shape)}; call functional_call inside "
                    "torch.func.vmap over the stack"
                )
            if (lora.in_features, lora.out_features) != (spec.in_features, spec.out_features):
                raise ValueError(
                    f"{path}: LoRA A {tuple(lora.A.shape)} / B {tuple(lora.B.shape)} does not fit "
                    f"{type(module).__name__}({spec.in_features} -> {spec.out_features}): expected "
                    f"A (r, {spec.in_features}) and B ({spec.out_features}, r)"
                )
            if lora.A.device != weight.device:
                raise ValueError(
                    f"{path}: LoRA A {tuple(lora.A.shape)} is on {lora.A.device} but the weight is on {weight.device}"
                )
        if id(weight) in routes:
            raise ValueError(f"{path} and {routes[id(weight)].path} share one weight tensor; adapt only one")
        routes[id(weight)] = _Route(path, module, weight, lora, spec)
    if check:
        for path, module in modules.items():
            w = getattr(module, "weight", None)
            if w is not None and id(w) in routes and routes[id(w)].path != path and linear_spec(module):
                raise ValueError(
                    f"{routes[id(w)].path} is adapted but its weight is tied to {path}, which would "
                    "get the same LoRA; adapt both or neither"
                )
    return routes


def adapter_mode(
    model: nn.Module,
    adapter: Adapter,
    *,
    params: Mapping[str, Tensor] | None = None,
    impl: str = "auto",
) -> _LoRAMode:
    """A context manager under which ``model``'s targeted layers run with ``adapter``.

    The building block of ``functional_call`` and of the stateful layer (``fastaf.init``).
    Validates every path first (errors name the path and shapes) and changes nothing.
    ``params`` names the tensors that will stand in for the model's own during the call.
    """
    return _LoRAMode(_routes(model, adapter, dict(params or {})), impl)


def checkpoint_context() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """``context_fn`` for ``torch.utils.checkpoint`` that replays the adapter during recompute.

    Activation checkpointing re-runs a layer's forward during backward, after ``functional_call``
    (or ``model(...)`` of a ``fastaf.init`` model) has left its adapter mode; without the adapter
    the recompute differs from the forward (non-reentrant checkpointing raises a CheckpointError).
    Pass this function as ``context_fn``::

        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": checkpoint_context})

    It is called at forward time, captures the active fastaf mode, and re-enters it for the
    recompute.
    """
    from torch.overrides import _get_current_function_mode_stack

    modes = [m for m in _get_current_function_mode_stack() if isinstance(m, _LoRAMode)]
    return contextlib.nullcontext(), (modes[-1] if modes else contextlib.nullcontext())


def functional_call(
    model: nn.Module,
    adapter: Adapter | Sequence[Adapter] | None,
    args: Any = (),
    kwargs: dict[str, Any] | None = None,
    *,
    params: Mapping[str, Tensor] | None = None,
    impl: str = "auto",
) -> Any:
    """Call ``model(*args, **kwargs)`` with ``adapter`` applied to its targeted linear layers.

    Args:
        model: any ``nn.Module`` (a plain Hugging Face model works as is); it is left exactly as
            it was, also when the call raises.
        adapter: an ``Adapter``, a list of Adapters (their deltas add), or None.
        args: positional arguments (a single tensor is wrapped in a tuple).
        kwargs: keyword arguments.
        params: name -> tensor replacing the model's parameters/buffers for this call, as in
            ``torch.func.functional_call``.
        impl: kernel choice for every adapted layer ("auto", "triton", "torch").
    Returns:
        Whatever the model returns.
    """
    if not isinstance(args, tuple):
        args = (args,)
    kwargs = kwargs or {}
    adapter = _combine(adapter)
    params = dict(params) if params else {}

    def run() -> Any:
        if params:
            return torch.func.functional_call(model, params, args, kwargs)
        return model(*args, **kwargs)

    if adapter is None or len(adapter) == 0:
        return run()
    mode = adapter_mode(model, adapter, params=params, impl=impl)
    with mode:
        out = run()
    if not torch.compiler.is_compiling():
        missed = [r.path for r in mode.routes.values() if r.hits == 0]
        if missed:
            warnings.warn(
                f"fastaf.functional_call: the LoRA of {len(missed)} module(s) was never applied "
                f"(their weight was not used by F.linear/addmm during the call): {missed[:5]}",
                stacklevel=2,
            )
    return out
