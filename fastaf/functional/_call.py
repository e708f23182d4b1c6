"""``functional_call``: run an unmodified model with an adapter passed explicitly.

The model is never touched. For the duration of the call a ``TorchFunctionMode`` routes every
use of a targeted module's weight that computes a linear layer into ``lora_linear``, so the base
GEMM and the LoRA term run as one fused op: ``F.linear(x, W, b)`` (``nn.Linear``),
``torch.addmm(b, x, W)`` (GPT-2's ``Conv1D``) and ``x @ W.T`` (Falcon's ``FalconLinear``; any
transpose of W, ``@`` / ``matmul``). A targeted module that runs without its weight meeting one
of these rules is an error after the call, never a silently unadapted output. No hooks, patched methods or swapped modules are
left to clean up; ``params`` are swapped by ``torch.func.functional_call``, which restores them.
The mode is a plain Python object, so ``torch.func`` transforms and ``torch.compile`` trace
through it (checked with ``torch._dynamo.explain`` in the tests).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from ._adapter import Adapter, LoRA
from ._lora_linear import lora_linear
from ._modules import LinearSpec, known_forward, linear_spec


@dataclasses.dataclass
class _Route:
    """Where one targeted module's weight goes: its path, module, LoRA and layout."""

    path: str
    module: nn.Module
    weight: Tensor
    lora: LoRA
    spec: LinearSpec
    hits: int = 0  # uses of the weight sent through lora_linear
    calls: int = 0  # calls of the module (counted in eager functional_call only)


_TensorBase = torch._C.TensorBase
# funcs a mode sees for W.T, W.mT, W.t(), torch.t(W) and W.transpose(0, 1): each reverses a 2-D W
_TRANSPOSES = {_TensorBase.T.__get__, _TensorBase.mT.__get__, _TensorBase.t, torch.t}
_TRANSPOSE_DIMS = {_TensorBase.transpose, torch.transpose}
_MATMULS = {_TensorBase.matmul, torch.matmul}  # x @ y reaches a mode as Tensor.matmul


def _swaps(args: tuple, kwargs: dict) -> bool:
    """Whether ``transpose(t, dim0, dim1)`` of a 2-D t swaps its two dims (0/-2 with 1/-1)."""
    dims = list(args[1:3]) + [kwargs[k] for k in ("dim0", "dim1") if k in kwargs]
    return len(dims) == 2 and dims[0] % 2 != dims[1] % 2


class _LoRAMode(TorchFunctionMode):
    """Sends the targeted weights' linear calls through ``lora_linear``."""

    def __init__(self, routes: dict[int, _Route], impl: str, *, explicit: bool = True) -> None:
        super().__init__()
        self.routes = routes
        self.impl = impl
        self.explicit = explicit  # functional_call's (an adapter passed explicitly), or one module's
        # transposed views of routed weights made during the call: id -> (route, view); the view
        # is held so its id is not reused
        self.views: dict[int, tuple[_Route, Tensor]] = {}

    def _route(self, weight: Any) -> _Route | None:
        route = self.routes.get(id(weight))
        return route if route is not None and route.weight is weight else None

    def _as_kn(self, t: Any) -> tuple[_Route, Tensor] | tuple[None, None]:
        """(route, its (N, K) weight) when ``t`` is a routed weight laid out (K, N), as the right
        operand of ``x @ t``: W.T of an (N, K) weight, or a Conv1D weight itself."""
        view = self.views.get(id(t))
        if view is not None and view[1] is t and not view[0].spec.transposed:
            return view[0], view[0].weight
        route = self._route(t)
        if route is not None and route.spec.transposed:
            return route, route.weight.t()
        return None, None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _TRANSPOSES or func in _TRANSPOSE_DIMS:
            out = func(*args, **kwargs)
            route = self._route(args[0] if args else None)
            if route is not None and route.weight.dim() == 2 and (func in _TRANSPOSES or _swaps(args, kwargs)):
                self.views[id(out)] = (route, out)
            return out
        if func in _MATMULS and len(args) == 2 and not kwargs:
            route, weight = self._as_kn(args[1])
            if route is not None:
                return self._apply(route, args[0], weight, None)
        elif func is F.linear:
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


def module_mode(path: str, module: nn.Module, lora: LoRA, *, impl: str = "auto") -> _LoRAMode:
    """A mode adapting one module's weight with ``lora``, unchecked: the stateful layer enters it
    around that module's forward, after checking the adapter once when it was added."""
    route = _Route(path, module, module.weight, lora, linear_spec(module))
    return _LoRAMode({id(module.weight): route}, impl, explicit=False)


def explicit_mode_active() -> bool:
    """True inside ``functional_call`` (or an ``adapter_mode``): its adapter stands in for others."""
    return any(isinstance(m, _LoRAMode) and m.explicit for m in torch.overrides._get_current_function_mode_stack())


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
    if torch.compiler.is_compiling():
        with mode:
            return run()
    # A module with a forward of its own may use its weight in a way no rule adapts: count its
    # calls (plain nn.Linear / Conv1D always meet a rule when they run, and need no hook).
    handles = [
        r.module.register_forward_pre_hook(functools.partial(_count_call, r))
        for r in mode.routes.values()
        if not known_forward(r.module)
    ]
    try:
        with mode:
            out = run()
    finally:
        for handle in handles:
            handle.remove()
    _check_applied(mode.routes.values())
    return out


def _count_call(route: _Route, module: nn.Module, args: Any) -> None:
    route.calls += 1


def _check_applied(routes: Any) -> None:
    """Raise for modules that ran with their LoRA unapplied; warn for modules that never ran."""
    lost = [r for r in routes if r.hits == 0 and r.calls > 0]
    if lost:
        raise ValueError(
            "fastaf.functional_call: "
            + "; ".join(f"{r.path} ({type(r.module).__name__}) ran {r.calls} time(s)" for r in lost[:5])
            + ", but used its weight in a way fastaf does not adapt (it adapts F.linear, torch.addmm "
            "and x @ weight.T); its LoRA would be silently lost. Merge it instead: "
            "fastaf.functional_call(model, None, args, params=fastaf.merge_into(model, adapter))"
        )
    missed = [r.path for r in routes if r.hits == 0]
    if missed:
        warnings.warn(
            f"fastaf.functional_call: {len(missed)} adapted module(s) did not run during the call, "
            f"so their LoRA was not needed: {missed[:5]}",
            stacklevel=3,
        )
