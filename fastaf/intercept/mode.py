"""The ``TorchFunctionMode`` that adapts a model's targeted weights wherever they are used.

``LoRAMode`` routes every use of a targeted module's weight that computes a linear layer into
``lora_linear``, so the base GEMM and the LoRA term run as one fused op: ``F.linear(x, W, b)``
(``nn.Linear``), ``torch.addmm(b, x, W)`` (GPT-2's ``Conv1D``) and ``x @ W.T`` (Falcon's
``FalconLinear``; any transpose of W, ``@`` / ``matmul``). Any other use that makes a tensor from
the weight computes with W + ΔW (``folded``: exact, warned once).

The mode spans a call, so a weight is adapted wherever it is used, inside its module or not.
``functional_call`` (through ``scope.scoped_call``) enters it over the whole call, or lets the weights carry the
adapter instead (``carrier``: the same rules, seen only by calls that receive an adapted
weight); the stateful layer enters one per module (``module_mode``). Under ``torch.compile`` it is
what the tracer follows.

An expert LoRA (a targeted parameter: a fused 3-D MoE expert parameter, a router weight) has no
linear rule to fuse into: every torch call that receives the parameter gets ``W + ΔW`` instead,
made once per call at its first use (``fold_param``, one ``baddbmm``, as PEFT's ParamWrapper
does), so indexing, transposes and grouped matmuls of the experts all see the adapted weight.
Calls that only read metadata (``size``, ``data_ptr``, ...) see the parameter itself.

Linear layers under one parent with one in_features (q/k/v/o, gate/up) are candidate siblings:
under torch.compile (``share_input`` in ``fastaf._config``), when the first of them runs, h for all of them comes from
one pass over its input (``lora_siblings.shared_h``), and a sibling that then runs on that very tensor takes its slice
(``lora_linear_given_h``). One that runs on another tensor (o_proj, a cross-attention's k and v)
starts again with the siblings that have not taken a slice yet. The mode holds one input at a time.
Eagerly, siblings that the calls show running one after another on one input run as one op at
the first one's call instead (``groups``: one node, h and dA in one pass each, dx summed in the
GEMMs).
"""
from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from .._adapter import Adapter, LoRA
from .._layouts import LinearSpec, ParamSpec, check_module, fold_linear, fold_param
from ..ops import IMPLS, current_level, noted, peek_interpreter, unwrap_for_grad
from . import carrier, rules, use
from .groups import Groups
from .routes import Route, module_routes, resolve_routes, walked_modules

# When siblings take their h from one pass over their shared input: ``_config.flags().share_input``,
# "compiled" by default. Eagerly the extra autograd node per group costs more host time than the
# pass saves device time, and an eager LoRA step is host-bound: on the H100 (1B shape) the device
# time fell 1.5 ms per step while the eager autograd step went from 147.7 to 156.6 ms and the
# torch.func one from 157.9 to 199.1 ms; compiled, the step went from 108.4 to 106.9 ms.


_TensorBase = torch._C.TensorBase
# calls that read only a tensor's metadata: a substituted parameter is not made for these
_METADATA = {
    _TensorBase.size, _TensorBase.dim, _TensorBase.ndimension, _TensorBase.numel, _TensorBase.nelement,
    _TensorBase.stride, _TensorBase.storage_offset, _TensorBase.data_ptr, _TensorBase.untyped_storage,
    _TensorBase.is_contiguous, _TensorBase.element_size, _TensorBase.get_device, _TensorBase.is_floating_point,
    _TensorBase.__len__, torch.Tensor.__hash__,
}


# Tensor methods that write their tensor (x.mul_(2), x[i] = v): an input of siblings written in
# place no longer matches their shared h. A set, not a name test: torch.compile traces the mode,
# and a membership test is what it folds (reading func.__name__ broke the graph).
_IN_PLACE = frozenset(
    [getattr(_TensorBase, n) for n in dir(_TensorBase) if n.endswith("_") and not n.startswith("_")]
    + [_TensorBase.__setitem__]
)
# calls a rule of the mode takes (or watches, for the siblings' input), before the fold's scan
_RULED = frozenset(_IN_PLACE | rules.TRANSPOSES | rules.TRANSPOSE_DIMS | rules.MATMULS | {F.linear, torch.addmm})


class LoRAMode(TorchFunctionMode):
    """Sends the targeted weights' linear calls through ``lora_linear``."""

    def __init__(self, routes: dict[int, Route], impl: str, *, explicit: bool = True,
                 ids: Tensor | None = None) -> None:
        super().__init__()
        if impl not in IMPLS:  # once per call: the layers' op calls (routed_lora_linear) do not check it
            raise ValueError(f"fastaf: impl must be one of {IMPLS}, got {impl!r}")
        # linear routes (fused into lora_linear) and parameter routes (substituted), by weight id
        self.routes = {k: r for k, r in routes.items() if isinstance(r.spec, LinearSpec) and not r.branch}
        self.params = {k: r for k, r in routes.items() if isinstance(r.spec, ParamSpec)}
        # quantized linears: their LoRA is added to their output by the caller's hooks, their
        # weights pass through this mode untouched
        self.branches = [r for r in routes.values() if r.branch]
        # made inside a trace (functional_call under torch.compile), not eagerly around compiled blocks
        self.traced = torch.compiler.is_compiling()
        # a routed linear weight that is no nn.Parameter (params=): traced folds scan every call
        self.plain_weights = any(not isinstance(r.weight, nn.Parameter) for r in self.routes.values())
        # made inside a trace with linear routes on parameters alone: dynamo traces this mode's
        # Python for every op of the model at compile time, so an op no rule takes goes the short
        # way (__torch_function__)
        self.lean = self.traced and len(self.routes) > 0 and not self.params and not self.plain_weights
        self.impl = impl
        self.modules: dict[str, nn.Module] | None = None  # the model's modules by path, where ``adapter_mode`` walked them
        self.grad = torch.is_grad_enabled()  # the call's grad mode: a use with grad off inside it is gradless
        self.explicit = explicit  # functional_call's (an adapter passed explicitly), or one module's
        self.ids = ids  # adapter_ids: the LoRAs are stacked and example i uses slot ids[i]
        # transposed views of routed weights made during the call: id -> (route, view); the view
        # is held so its id is not reused
        self.views: dict[int, tuple[Route, Tensor]] = {}
        # the latest input shared by siblings: (x, x's version then, what each takes by path, the
        # paths that took theirs, "h" (use._shared_h: h and a token) or "decode" / "multi-decode"
        # (use._shared_decode: one shrink's partials, with ids or not, and an index))
        self.shared: tuple[Tensor, int, dict[str, tuple], set[str], str] | None = None
        # the linear route whose module started last (its _WeightWatch hook's): _route tries it first.
        # In a block compiled inside an eager call, dynamo reaches it through the block's own
        # module hooks, so the block's graph does not guard on every route the scan would pass
        # (on the H100's 16-layer 1B model dynamo's cache lookups went from 12.2 to 8.5 ms a step)
        self.current: Route | None = None
        # siblings run as one op at the first one's call (groups): eager functional_call modes
        self.groups = (Groups(self.routes, impl)
                       if explicit and ids is None and not self.traced and not self.plain_weights else None)
        self.shared_groups = False  # the groups belong to the stateful layer's modes together (module_mode)

    def __enter__(self) -> LoRAMode:
        # A W + ΔW lives for one entry of the mode: checkpoint_context re-enters it for an
        # activation-checkpointing recompute, which must make (and save) its own.
        for route in self.all_routes():
            route.merged = None
        self.shared = None  # likewise the siblings' h: a recompute's x is a new tensor
        if self.groups is not None and not self.shared_groups:
            self.groups.reset()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self.shared_groups:  # kept routes outlive the mode: its W + ΔW must not (memory, graphs)
            for route in self.all_routes():
                route.merged = None
        super().__exit__(*exc)

    def all_routes(self) -> list[Route]:
        return [*self.routes.values(), *self.params.values(), *self.branches]

    def key(self, route: Route, weight: Tensor) -> None:
        """Route ``weight`` too (a weight swapped into the module when it runs)."""
        route.weight, route.merged = weight, None
        (self.params if isinstance(route.spec, ParamSpec) else self.routes)[id(weight)] = route

    def _route(self, weight: Any, routes: dict[int, Route] | None = None) -> Route | None:
        routes = self.routes if routes is None else routes
        current = self.current
        if current is not None and routes is self.routes and current.weight is weight:
            return current
        # traced, dynamo gives a parameter's id (a graph input's, not a tensor made inside): the
        # lookup below; any other traced weight is scanned
        if torch.compiler.is_compiling() and not (
                self.traced and not self.plain_weights and isinstance(weight, nn.Parameter)):
            if not self.traced and not self.plain_weights and not isinstance(weight, nn.Parameter):
                # a block compiled inside an eager call routes parameters only (FSDP2's unsharded
                # weights are parameters too): an activation's transpose is no weight, unscanned
                return None
            return _scan(routes, weight)
        route = routes.get(id(weight))
        return route if route is not None and route.weight is weight else None

    def folded(self, route: Route, use: Any) -> Tensor:
        """``route``'s W + ΔW, made once per entry of the mode (or per carried call): an expert
        LoRA's at every use, a linear layer's at a use no fused rule takes (``use``, warned once)."""
        if route.merged is not None:
            route.hits += 1
            return route.merged
        weight, lora = carrier.raw(route.weight), route.lora
        if torch.compiler.is_compiling():  # a meta-parameter here marks the compile (note_factors)
            lora = dataclasses.replace(lora, **dict(zip(("A", "B"), noted(lora.A, lora.B))))
        if isinstance(route.spec, ParamSpec):
            route.merged = fold_param(weight, lora, route.spec)
            route.hits += 1
            return route.merged
        _check_foldable(route, use)
        merged = fold_linear(weight, lora, route.spec)
        if torch.is_grad_enabled() or not (lora.A.requires_grad or lora.B.requires_grad):
            route.merged = merged
            route.hits += 1
        else:
            # grad is off here but the factors want one (a no_grad block, a custom Function's
            # forward): exact values without a gradient, not kept for later uses
            self._count(route)
        return merged

    def counts(self) -> bool:
        """Whether a use may be counted here: not in a block compiled inside an eager call
        (transformers' compiled decode step, FSDP2's compiled layers, a user-compiled forward): a
        count read there is a guard on its value, and each step recompiled."""
        return self.traced or not torch.compiler.is_compiling()

    def _count(self, route: Route) -> None:
        """Count an adapted use of ``route``'s weight (where ``counts``): a hit, or a gradless one
        (``_gradless``)."""
        if not self.counts():
            return
        if self._gradless(route):
            route.gradless += 1
        else:
            route.hits += 1

    def _gradless(self, route: Route) -> bool:
        """A use that adapts the value but passes no gradient to factors that want one: grad is
        off here (a no_grad block, a custom Function's forward) though the call runs with it. It
        does not count as adapting: a module whose weight met only such uses lost its LoRA's
        gradient, which the call reports."""
        lora = route.lora
        return self.grad and not torch.is_grad_enabled() and (lora.A.requires_grad or lora.B.requires_grad)

    def folds(self, route: Route) -> bool:
        """Whether a linear route's use no rule takes may compute with W + ΔW: not for a weight tied
        to another module (an embedding reads lm_head's weight: PEFT adapts lm_head alone)."""
        return not route.tied

    def _folded_param(self, t: Tensor) -> Tensor | None:
        route = self._route(t, self.params)
        return None if route is None else self.folded(route, None)

    def _folded_linear(self, t: Tensor, use: Any) -> Tensor | None:
        """W + ΔW for a routed linear weight ``t``, (W + ΔW).T for a transposed view of one."""
        route, view = self._route(t), False
        if route is None:
            route, view = self._view(t), True
        if route is None or not self.folds(route):
            return None
        merged = self.folded(route, use)
        return merged.t() if view else merged

    def _view(self, t: Any) -> Route | None:
        """The route whose weight ``t`` is a transposed view of (made during this call), or None."""
        if torch.compiler.is_compiling():
            route = next((route for route, view in self.views.values() if view is t), None)
            return route if route is not None else self._transposed_base(t)
        view = self.views.get(id(t))
        return view[0] if view is not None and view[1] is t else None

    def _transposed_base(self, t: Any) -> Route | None:
        """Traced: the route whose 2-D weight ``t`` is the transpose of, by its view base. Dynamo
        takes ``W.T`` (FalconLinear's ``x @ self.weight.T``) without calling the mode, so no view
        was recorded; the base and the reversed sizes and strides identify it. Under
        ``torch.func.grad`` the transpose ran at the grad level: its base is that level's wrapper
        of the weight, unwrapped once (at the innermost transform's level) to compare."""
        base = getattr(t, "_base", None) if isinstance(t, Tensor) else None
        if base is None or t.dim() != 2 or base.dim() != 2:
            return None
        # the whole base, reversed (an offset view of that size would not fit in its storage)
        if (t.shape[0], t.shape[1], t.stride(0), t.stride(1)) != (base.shape[1], base.shape[0], base.stride(1),
                                                                   base.stride(0)):
            return None
        route = self._route(base)
        if route is None and peek_interpreter() is not None:
            # the unwrapped weight is made in the graph, whose id dynamo does not give
            route = _scan(self.routes, unwrap_for_grad(base, current_level()))
        return route

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.lean and func not in _RULED:
            # no rule takes func: the fold's checks run only for a call that may receive a routed
            # weight (_holds_routed)
            out = func(*args, **kwargs) if kwargs else func(*args)
            if self._holds_routed(args) or kwargs and self._holds_routed(kwargs.values()):
                return self._fold(func, args, kwargs or {}, out)
            return out
        kwargs = kwargs or {}
        if self.shared is not None and func in _IN_PLACE and args and args[0] is self.shared[0]:
            self.shared = None  # the siblings' input changes: their h no longer holds
        if self.params and func not in _METADATA:
            swapped = rules.substitute(args, kwargs, self._folded_param)
            if swapped is not None:
                return func(*swapped[0], **swapped[1])
        if func in rules.TRANSPOSES or func in rules.TRANSPOSE_DIMS:
            out = func(*args, **kwargs)
            route = self._route(args[0] if args else None)
            if route is not None and route.weight.dim() == 2 and rules.reverses(func, args, kwargs):
                self.views[len(self.views) if torch.compiler.is_compiling() else id(out)] = (route, out)
            return out
        found = rules.linear_use(func, args, kwargs, self)
        if found is not None:
            return self._apply(*found[:4], flattened=found[4])
        out = func(*args, **kwargs)
        return self._fold(func, args, kwargs, out) if self._may_fold(args, kwargs) else out

    def _fold(self, func, args: tuple, kwargs: dict, out: Any) -> Any:
        """``out`` of ``func(*args, **kwargs)``, or, where a routed weight is among the arguments of
        a use no rule fuses (einsum, W @ x, W.to(...)), the call again on W + ΔW (exact)."""
        if isinstance(out, Tensor) and rules.foldable(func, args, out):
            swapped = rules.substitute(args, kwargs, lambda t: self._folded_linear(t, func))
            if swapped is not None:
                return func(*swapped[0], **swapped[1])
        return out

    def _may_fold(self, args: tuple, kwargs: dict) -> bool:
        """Whether a call's arguments may hold a routed weight, for the fold's scan. Traced, the
        scan would otherwise compare every tensor of every op with every route at compile time:
        only a routed parameter, or a transposed view of one (recorded in the call, or made by
        dynamo unseen: ``_holds_routed``), can be one (a weight given as a plain tensor, through
        ``params=``, turns the filter off). Eagerly, any call while routes
        exist (the lookup is by id). Not in blocks compiled inside an eager call (FSDP2 recipes):
        there the mode was made outside the trace, and dynamo reading its routes breaks on the
        weights FSDP2's hook keys in; such a use stays the base weight's there."""
        if not torch.compiler.is_compiling():
            return bool(self.routes)
        if not self.traced:
            return False
        if not self.routes or self.plain_weights:
            return len(self.routes) > 0  # torch 2.11's dynamo cannot bool() a dict
        # a transposed view recorded in this call is a 2-D view of a 2-D weight: _holds_routed's too
        return self._holds_routed(args) or (len(kwargs) > 0 and self._holds_routed(kwargs.values()))

    def _holds_routed(self, items: Any) -> bool:
        """Traced, the routed weights parameters: whether one of ``items`` (or of a list or tuple
        among them) is a routed weight (dynamo gives a parameter's id, a graph input's), or may be
        a transposed view of one that dynamo made without calling the mode (``W.T``: a 2-D view of
        a 2-D tensor, which the fold's ``_transposed_base`` then identifies). Dynamo traces this for
        every op of the model, so it tests as little as it can per argument."""
        for a in items:
            if isinstance(a, Tensor):
                if isinstance(a, nn.Parameter):
                    if id(a) in self.routes:
                        return True
                elif a.dim() == 2 and a._base is not None and a._base.dim() == 2:
                    return True
            elif isinstance(a, (list, tuple)) and self._holds_routed(a):  # (type(a) in ...: a Python guard per arg)
                return True
        return False

    def _apply(self, route: Route, x: Tensor, weight: Tensor, bias: Tensor | None, *,
               flattened: bool = False) -> Tensor:
        # a mode inside a carried call: compute on the weight itself
        return use.call_op(self, route, x, carrier.raw(weight), bias, flattened=flattened)

    # rules.linear_use's lookup: the mode finds routes by weight id (or scans, traced)
    def nk(self, t: Any) -> tuple[Route, Tensor] | None:
        """(route, its weight) when ``t`` is a routed (N, K) weight, used as F.linear's weight."""
        route = self._route(t)
        return (route, route.weight) if route is not None and not route.spec.transposed else None

    def kn(self, t: Any) -> tuple[Route, Tensor, bool] | None:
        """(route, its (N, K) weight, whether its layout is (K, N)) when ``t`` is a routed weight laid
        out (K, N), as the right operand of ``x @ t``: W.T of an (N, K) weight, or a Conv1D weight."""
        route = self._view(t)
        if route is not None and not route.spec.transposed:
            return route, route.weight, False
        route = self._route(t)
        if route is not None and route.spec.transposed:
            return route, route.weight.t(), True
        return None



_warned_folds: set[tuple[str, str]] = set()


def _scan(routes: dict[int, Route], weight: Any) -> Route | None:
    """Traced: the route whose weight is ``weight``. Dynamo (torch 2.11) cannot id() a tensor made
    inside the graph: compare identities, which it folds while tracing (in a block compiled inside
    an eager call, a guard on each route it passes)."""
    return next((r for r in routes.values() if r.weight is weight), None)


def _check_foldable(route: Route, use: Any) -> None:
    """A linear weight's use with no fused rule computes with W + ΔW: exact without LoRA dropout
    (which applies to the LoRA path's input, not to a weight); warned once per path and use,
    eagerly (under torch.compile a warning would break the graph)."""
    traced = torch.compiler.is_compiling()
    name = getattr(use, "__qualname__", None) or getattr(use, "__name__", None) or str(use)
    if traced or "descriptor" in name:  # dynamo answers a torch function's __name__ with a
        name = "a call"  # descriptor's (torch 2.11: even where is_compiling() is False); its error shows the source line
    if route.module.training and route.lora.dropout:
        raise ValueError(
            f"{route.path} ({type(route.module).__name__}) uses its weight through {name}, which no fused "
            f"LoRA rule takes, so fastaf would compute with W + scale·B@A; LoRA dropout "
            f"({route.lora.dropout}) cannot apply to a merged weight: use dropout 0 for this module, or eval()"
        )
    if not traced and (route.path, name) not in _warned_folds:  # traced, a warning breaks the graph
        _warned_folds.add((route.path, name))
        warnings.warn(
            f"fastaf: {route.path} ({type(route.module).__name__}) uses its weight through {name}, which no "
            "fused LoRA rule takes: it computes with W + scale·B@A materialised (exact, slower)",
            stacklevel=4,
        )



def adapter_mode(
    model: nn.Module,
    adapter: Adapter,
    *,
    params: Mapping[str, Tensor] | None = None,
    impl: str = "auto",
    adapter_ids: Tensor | None = None,
) -> LoRAMode:
    """A context manager under which ``model``'s targeted layers run with ``adapter``.

    The building block of ``functional_call`` and of the stateful layer (``fastaf.init``).
    Validates every path first (errors name the path and shapes) and changes nothing.
    ``params`` names the tensors that will stand in for the model's own during the call;
    ``adapter_ids`` (checked by the caller) selects a stack slot per example.
    """
    check_module(model, "fastaf.functional.adapter_mode")
    modules = walked_modules(model)
    routes = resolve_routes(model, adapter, dict(params or {}), stacked=adapter_ids is not None, modules=modules)
    mode = LoRAMode(routes, impl, ids=adapter_ids)
    mode.modules = modules  # the walk the routes came from: the call's other checks read it, not a new one
    return mode



def module_mode(module: nn.Module, loras: Mapping[str, LoRA] | None = None, *, impl: str = "auto",
                routes: dict[int, Route] | None = None, groups: Groups | None = None) -> LoRAMode:
    """A mode adapting one module's weights with ``loras``, unchecked: the stateful layer enters it
    around that module's forward, after checking the adapter once when it was added.

    ``routes``: the module's routes that the caller keeps between calls (``module_routes``, their
    siblings linked across modules, keyed by the weights the module holds now, with current
    LoRAs), in place of new ones from ``loras``; ``groups``: the grouping those routes share with
    the other modules' modes, so siblings in different modules run as one op (``groups``). The
    caller owns its bookkeeping: entering this mode does not reset it, and leaving it drops the
    W + ΔW its routes made.
    """
    mode = LoRAMode(module_routes(module, loras or {}) if routes is None else routes, impl, explicit=False)
    if groups is not None and not mode.traced and not mode.plain_weights:
        mode.groups, mode.shared_groups = groups, True
    return mode

