"""``functional_call``: run an unmodified model with an adapter passed explicitly.

A ``TorchFunctionMode`` routes every use of a targeted module's weight that computes a linear
layer into ``lora_linear``, so the base GEMM and the LoRA term run as one fused op:
``F.linear(x, W, b)`` (``nn.Linear``), ``torch.addmm(b, x, W)`` (GPT-2's ``Conv1D``) and
``x @ W.T`` (Falcon's ``FalconLinear``; any transpose of W, ``@`` / ``matmul``).

The mode spans the call, so a weight is adapted wherever it is used, inside its module or not.
Eagerly, where nothing needs the mode, the weights carry the adapter instead (``_carrier``: the
same rules, seen only by calls that receive an adapted weight; on the H100, Liger-patched 1B
step 121 vs 143 ms, ``e2e-liger-carry3-*.json``). With the mode, eagerly, per-call pre-hooks on
the targeted modules (``_WeightWatch``) count their calls and follow a weight swapped in when its
module runs (FSDP2's unsharded weight); they are removed when
the call returns or raises, so the model is left as it was. Under ``torch.compile`` the mode runs
alone: tracers follow a mode, not hooks registered inside the graph. A targeted module that runs
without its weight meeting a rule is an error after the call, never a silently unadapted output.

An expert LoRA (a targeted parameter: a fused 3-D MoE expert parameter, a router weight) has no
linear rule to fuse into: every torch call that receives the parameter gets ``W + ΔW`` instead,
made once per call at its first use (``fold_param``, one ``baddbmm``, as PEFT's ParamWrapper
does), so indexing, transposes and grouped matmuls of the experts all see the adapted weight.
Calls that only read metadata (``size``, ``data_ptr``, ...) see the parameter itself.

Linear layers under one parent with one in_features (q/k/v/o, gate/up) are candidate siblings:
under torch.compile (``SHARE_INPUT``), when the first of them runs, h for all of them comes from
one pass over its input
(``_siblings.shared_h``), and a sibling that then runs on that very tensor takes its slice
(``lora_linear_given_h``). One that runs on another tensor (o_proj, a cross-attention's k and v)
starts again with the siblings that have not taken a slice yet. The mode holds one input at a time.
Eagerly, siblings that the calls show running one after another on one input run as one op at
the first one's call instead (``_group``: one node, h and dA in one pass each, dx summed in the
GEMMs).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._functorch import pyfunctorch
from torch.overrides import TorchFunctionMode

from ._adapter import Adapter, LoRA
from . import _carrier, _group
from . import _rules as rules
from ._below_grad import call_below, grad_level
from ._lora_linear import IMPLS, routed_lora_linear
from ._transforms import tracked_scope
from ._modules import LinearSpec, ParamSpec, compiled_class, fold_linear, fold_param, linear_spec, param_spec
from ._multi import check_rows, lora_linear_multi
from ._siblings import lora_linear_given_h, shareable, shared_h

# When siblings take their h from one pass over their shared input: "compiled" (under
# torch.compile only), "always" or "never" (tests; benchmarks that run both paths in one process).
# Eagerly the extra autograd node per group costs more host time than the pass saves device
# time, and an eager LoRA step is host-bound: on the H100 (1B shape, e2e-shared-il-*.json) the
# device time fell 1.5 ms per step while the eager autograd step went from 147.7 to 156.6 ms and
# the torch.func one from 157.9 to 199.1 ms; compiled, the step went from 108.4 to 106.9 ms.
SHARE_INPUT = "compiled"

# Whether an eager call may carry the adapter on its weights (``_carrier``) instead of entering a
# mode over the whole call; benchmarks flip it for an A/B in one process, tests for both paths.
CARRY = True


@dataclasses.dataclass
class _Route:
    """Where one targeted weight goes: its adapter key, module, LoRA and layout."""

    path: str  # the adapter key: a module path, or a parameter's name for an expert LoRA
    module: nn.Module  # the module holding the weight
    weight: Tensor
    lora: LoRA
    spec: LinearSpec | ParamSpec  # ParamSpec: substituted by W + ΔW wherever it is used
    name: str = "weight"  # the weight's attribute on ``module``
    hits: int = 0  # uses of the weight sent through lora_linear (or substituted)
    calls: int = 0  # module runs (the mode's per-call hooks), or uses no rule adapted (a carrier)
    merged: Tensor | None = None  # W + ΔW, made at its first use that needs it in the call
    tied: bool = False  # the weight is also another (non-linear) module's: an embedding's
    gradless: int = 0  # adapted uses with grad off inside a call with grad on: none reaches A, B
    # candidate siblings sharing this layer's input (this route included); () when it has none
    siblings: tuple[_Route, ...] = dataclasses.field(default=(), repr=False, compare=False)


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


class _LoRAMode(TorchFunctionMode):
    """Sends the targeted weights' linear calls through ``lora_linear``."""

    def __init__(self, routes: dict[int, _Route], impl: str, *, explicit: bool = True,
                 ids: Tensor | None = None) -> None:
        super().__init__()
        if impl not in IMPLS:  # once per call: the layers' op calls (routed_lora_linear) do not check it
            raise ValueError(f"fastaf: impl must be one of {IMPLS}, got {impl!r}")
        # linear routes (fused into lora_linear) and parameter routes (substituted), by weight id
        self.routes = {k: r for k, r in routes.items() if isinstance(r.spec, LinearSpec)}
        self.params = {k: r for k, r in routes.items() if isinstance(r.spec, ParamSpec)}
        # made inside a trace (functional_call under torch.compile), not eagerly around compiled blocks
        self.traced = torch.compiler.is_compiling()
        # a routed linear weight that is no nn.Parameter (params=): traced folds scan every call
        self.plain_weights = any(not isinstance(r.weight, nn.Parameter) for r in self.routes.values())
        # made inside a trace with linear routes on parameters alone: dynamo traces this mode's
        # Python for every op of the model at compile time, so an op no rule takes goes the short
        # way (__torch_function__)
        self.lean = self.traced and len(self.routes) > 0 and not self.params and not self.plain_weights
        self.impl = impl
        self.grad = torch.is_grad_enabled()  # the call's grad mode: a use with grad off inside it is gradless
        self.explicit = explicit  # functional_call's (an adapter passed explicitly), or one module's
        self.ids = ids  # adapter_ids: the LoRAs are stacked and example i uses slot ids[i]
        # transposed views of routed weights made during the call: id -> (route, view); the view
        # is held so its id is not reused
        self.views: dict[int, tuple[_Route, Tensor]] = {}
        # the latest input shared by siblings: (x, x's version then, their h by path, the paths
        # that took theirs)
        self.shared: tuple[Tensor, int, dict[str, Tensor], set[str]] | None = None
        # the linear route whose module started last (its _WeightWatch hook's): _route tries it first.
        # In a block compiled inside an eager call, dynamo reaches it through the block's own
        # module hooks, so the block's graph does not guard on every route the scan would pass
        # (on the H100's 16-layer 1B model dynamo's cache lookups went from 12.2 to 8.5 ms a step)
        self.current: _Route | None = None
        # siblings run as one op at the first one's call (_group): eager functional_call modes
        self.groups = (_group.Groups(self.routes, impl)
                       if explicit and ids is None and not self.traced and not self.plain_weights else None)
        self.shared_groups = False  # the groups belong to the stateful layer's modes together (module_mode)

    def __enter__(self) -> _LoRAMode:
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

    def all_routes(self) -> list[_Route]:
        return [*self.routes.values(), *self.params.values()]

    def key(self, route: _Route, weight: Tensor) -> None:
        """Route ``weight`` too (a weight swapped into the module when it runs)."""
        route.weight, route.merged = weight, None
        (self.params if isinstance(route.spec, ParamSpec) else self.routes)[id(weight)] = route

    def _route(self, weight: Any, routes: dict[int, _Route] | None = None) -> _Route | None:
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

    def folded(self, route: _Route, use: Any) -> Tensor:
        """``route``'s W + ΔW, made once per entry of the mode (or per carried call): an expert
        LoRA's at every use, a linear layer's at a use no fused rule takes (``use``, warned once)."""
        if route.merged is not None:
            route.hits += 1
            return route.merged
        weight, lora = _carrier.raw(route.weight), route.lora
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

    def _count(self, route: _Route) -> None:
        """Count an adapted use of ``route``'s weight: a hit, or a gradless one (``_gradless``)."""
        if self._gradless(route):
            route.gradless += 1
        else:
            route.hits += 1

    def _gradless(self, route: _Route) -> bool:
        """A use that adapts the value but passes no gradient to factors that want one: grad is
        off here (a no_grad block, a custom Function's forward) though the call runs with it. It
        does not count as adapting: a module whose weight met only such uses lost its LoRA's
        gradient, which the call reports."""
        lora = route.lora
        return self.grad and not torch.is_grad_enabled() and (lora.A.requires_grad or lora.B.requires_grad)

    def folds(self, route: _Route) -> bool:
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

    def _view(self, t: Any) -> _Route | None:
        """The route whose weight ``t`` is a transposed view of (made during this call), or None."""
        if torch.compiler.is_compiling():
            route = next((route for route, view in self.views.values() if view is t), None)
            return route if route is not None else self._transposed_base(t)
        view = self.views.get(id(t))
        return view[0] if view is not None and view[1] is t else None

    def _transposed_base(self, t: Any) -> _Route | None:
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
        if route is None and torch._C._functorch.peek_interpreter_stack() is not None:
            level = pyfunctorch.retrieve_current_functorch_interpreter().level()  # dynamo traces these two
            # the unwrapped weight is made in the graph, whose id dynamo does not give
            route = _scan(self.routes, torch._C._functorch._unwrap_for_grad(base, level))
        return route

    def _as_kn(self, t: Any) -> tuple[_Route, Tensor] | tuple[None, None]:
        """(route, its (N, K) weight) when ``t`` is a routed weight laid out (K, N), as the right
        operand of ``x @ t``: W.T of an (N, K) weight, or a Conv1D weight itself."""
        route = self._view(t)
        if route is not None and not route.spec.transposed:
            return route, route.weight
        route = self._route(t)
        if route is not None and route.spec.transposed:
            return route, route.weight.t()
        return None, None

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
        if func in rules.MATMULS and len(args) == 2 and not kwargs:
            route, weight = self._as_kn(args[1])
            if route is not None:
                return self._apply(route, args[0], weight, None)
        elif func is F.linear:
            x, weight, bias = rules.linear_parts(args, kwargs)
            route = self._route(weight)
            if route is not None and not route.spec.transposed:
                return self._apply(route, x, route.weight, bias)
        elif func is torch.addmm:
            parts = rules.addmm_parts(args, kwargs)
            route = None if parts is None else self._route(parts[2])
            if route is not None and route.spec.transposed:
                # Conv1D stores W as (in, out): W.T is the (N, K) view lora_linear takes.
                return self._apply(route, parts[1], route.weight.t(), parts[0], flattened=True)
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
            elif type(a) in (list, tuple) and self._holds_routed(a):
                return True
        return False

    def _apply(self, route: _Route, x: Tensor, weight: Tensor, bias: Tensor | None, *,
               flattened: bool = False) -> Tensor:
        """``flattened``: x is Conv1D's batch-major (batch * seq, K) view, for ``adapter_ids``."""
        self._count(route)  # inside a custom Function's forward, say, no gradient leaves
        weight = _carrier.raw(weight)  # a mode inside a carried call: compute on the weight itself
        if self.ids is not None:
            ids = check_rows(self.ids, x.shape[0], route.path, flattened=flattened)
            return lora_linear_multi(x, weight, bias, route.lora, ids, training=route.module.training,
                                     impl=self.impl, where=route.path)
        # not in a block compiled inside an eager call (FSDP2 recipes): the groups' bookkeeping
        # (weak references, version counters) breaks dynamo's graph there, and grouping is eager-only
        if route.siblings and self.groups is not None and _group.GROUP and SHARE_INPUT != "always" \
                and not torch.compiler.is_compiling():
            y = self.groups.take(route, x, weight, bias)
            if y is None:
                y = routed_lora_linear(x, weight, bias, route.lora, self.impl, route.module.training, route.path)
                self.groups.saw(route, x)
            return y
        if route.siblings and (SHARE_INPUT == "always" or SHARE_INPUT == "compiled" and torch.compiler.is_compiling()):
            h = self._shared_h(route, x)
            if h is not None:
                return lora_linear_given_h(x, weight, bias, h, route.lora, impl=self.impl, where=route.path)
        return routed_lora_linear(x, weight, bias, route.lora, self.impl, route.module.training, route.path)

    def _shared_h(self, route: _Route, x: Tensor) -> Tensor | None:
        """``route``'s h from one pass over ``x`` shared with its siblings, or None (alone)."""
        slot = self.shared
        # eagerly x's version counter catches in-place writes; traced, __torch_function__ does
        version = 0 if torch.compiler.is_compiling() else x._version
        # A slice is taken once: a layer that runs again (the next pass of a held mode, a module
        # applied twice) starts a new group, as does an input changed in place since.
        fresh = slot is not None and route.path in slot[2] and route.path not in slot[3]
        if fresh and slot[0] is x and slot[1] == version:
            slot[3].add(route.path)
            return slot[2][route.path]
        # another input: the siblings that have not run on the current one yet (o_proj alone; a
        # cross-attention's k with v); a layer running again: all of them
        ran = slot[3] if fresh else ()
        group = [route] + [r for r in route.siblings if r is not route and r.path not in ran]
        if len(group) < 2 or any(r.module.training and r.lora.dropout for r in group):
            return None  # dropout draws a mask per layer: no shared h
        loras = [r.lora for r in group]
        if not shareable(x, loras):
            return None
        hs = shared_h(x, loras, impl=self.impl)
        self.shared = (x, version, {r.path: h for r, h in zip(group, hs)}, {route.path})
        return hs[0]


_warned_folds: set[tuple[str, str]] = set()


def _scan(routes: dict[int, _Route], weight: Any) -> _Route | None:
    """Traced: the route whose weight is ``weight``. Dynamo (torch 2.11) cannot id() a tensor made
    inside the graph: compare identities, which it folds while tracing (in a block compiled inside
    an eager call, a guard on each route it passes)."""
    return next((r for r in routes.values() if r.weight is weight), None)


def _check_foldable(route: _Route, use: Any) -> None:
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


def _is_dtensor(t: Any) -> bool:
    # by name: torch.distributed.tensor may not be imported (or built), and this runs while tracing
    return type(t).__name__ == "DTensor"


def _resolve(modules: Mapping[str, nn.Module], path: str, lora: LoRA, model: nn.Module
             ) -> tuple[nn.Module, str, LinearSpec | ParamSpec]:
    """(module holding the weight, its attribute name, layout) for adapter key ``path``."""
    where = type(model).__name__
    owner, _, name = path.rpartition(".")
    if lora.experts:
        module = modules.get(owner)
        spec = param_spec(module, name) if module is not None else None
        if spec is None:
            what = (f"a {type(modules[path]).__name__} module" if path in modules else
                    "no parameter" if module is None or name not in module._parameters else
                    f"a parameter {tuple(module._parameters[name].shape)} that is not 2-D or 3-D float")
            raise ValueError(
                f"adapter key {path!r} holds an expert LoRA (A {tuple(lora.A.shape)}), whose key must name a 2-D "
                f"or 3-D float parameter of {where} (model.named_parameters()); it is {what}"
            )
        return module, name, spec
    module = modules.get(path)
    if module is None:
        if owner in modules and param_spec(modules[owner], name) is not None:
            raise ValueError(
                f"adapter key {path!r} is a parameter of {where}, not a module: a parameter takes an expert "
                f"LoRA (experts=True, A (E, r, in), B (E, out, r)); got A {tuple(lora.A.shape)}"
            )
        close = [p for p in modules if p.endswith(path.rsplit(".", 1)[-1])][:3]
        raise ValueError(
            f"adapter path {path!r} is not a module of {where}" + (f" (similar: {close})" if close else "")
        )
    spec = linear_spec(module)
    if spec is None:
        raise ValueError(f"adapter path {path!r} is a {type(module).__name__}, not a linear layer")
    return module, "weight", spec


def _check_fits(path: str, lora: LoRA, module: nn.Module, weight: Tensor, spec: LinearSpec | ParamSpec,
                stacked: bool) -> None:
    """The LoRA's stacking, shapes and device against the weight it adapts."""
    if lora.stacked != stacked:
        raise ValueError(
            f"{path}: stacked LoRA A {tuple(lora.A.shape)} without adapter_ids: pass "
            "adapter_ids=, or call functional_call inside torch.func.vmap over the stack"
            if lora.stacked else
            f"{path}: adapter_ids needs a stacked adapter (fastaf.stack), got A {tuple(lora.A.shape)}"
        )
    if isinstance(spec, ParamSpec):
        if stacked:
            raise ValueError(
                f"{path}: adapter_ids cannot give each example its own LoRA on a parameter (its W + ΔW is one "
                "tensor per call); call torch.func.vmap over the stack, or one call per adapter"
            )
        if (lora.num_experts, lora.in_features, lora.out_features) != (spec.num_experts, spec.in_features, spec.out_features):
            raise ValueError(
                f"{path}: expert LoRA A {tuple(lora.A.shape)} / B {tuple(lora.B.shape)} does not fit the parameter "
                f"{tuple(weight.shape)} ({weight.dtype}, {spec.num_experts} expert(s) of {spec.in_features} -> "
                f"{spec.out_features}): expected A ({spec.num_experts}, r, {spec.in_features}) and "
                f"B ({spec.num_experts}, {spec.out_features}, r)"
            )
    elif (lora.in_features, lora.out_features) != (spec.in_features, spec.out_features):
        raise ValueError(
            f"{path}: LoRA A {tuple(lora.A.shape)} / B {tuple(lora.B.shape)} does not fit "
            f"{type(module).__name__}({spec.in_features} -> {spec.out_features}): expected "
            f"A (r, {spec.in_features}) and B ({spec.out_features}, r)"
        )
    if lora.A.device != weight.device:
        raise ValueError(
            f"{path}: LoRA A {tuple(lora.A.shape)} is on {lora.A.device} but the weight is on {weight.device}"
        )


def _routes(model: nn.Module, adapter: Adapter, params: Mapping[str, Tensor], *,
            stacked: bool = False) -> dict[int, _Route]:
    """Validate every path of ``adapter`` against ``model`` and map weight ids to routes.

    ``stacked``: the call has ``adapter_ids``, so every LoRA must carry the stack axis.
    """
    modules = dict(model.named_modules())
    check = not torch.compiler.is_compiling()
    routes: dict[int, _Route] = {}
    for path, lora in adapter.items():
        module, name, spec = _resolve(modules, path, lora, model)
        weight = params.get(path if lora.experts else f"{path}.weight", getattr(module, name))
        if not check and _is_dtensor(weight):
            # compiled, one mode keys the weights at the call's start; FSDP2 swaps in the
            # unsharded weight later, which that mode would miss without a word
            raise NotImplementedError(
                f"{path}: its weight is a sharded DTensor (FSDP2); torch.compile over "
                "fastaf.functional_call does not follow FSDP2's unsharding (its hooks are not traced): "
                "compile each block after fully_shard (layer.compile()) and call functional_call eagerly"
            )
        if check:
            _check_fits(path, lora, module, weight, spec, stacked)
        if id(weight) in routes:
            raise ValueError(f"{path} and {routes[id(weight)].path} share one weight tensor; adapt only one")
        routes[id(weight)] = _Route(path, module, weight, lora, spec, name)
    link_siblings(routes.values())
    # traced too: a tied embedding's read of lm_head's weight must not fold W + ΔW under compile
    for path, module in modules.items():
        weight = getattr(module, "weight", None)
        # a module without one: dynamo (torch 2.11) cannot trace id(None)
        route = routes.get(id(weight)) if isinstance(weight, Tensor) else None
        if route is not None and route.module is not module:
            if check and linear_spec(module):
                raise ValueError(
                    f"{route.path} is adapted but its weight is tied to {path}, which would "
                    "get the same LoRA; adapt both or neither"
                )
            route.tied = True  # an embedding's too: its uses there stay the base weight's
    return routes


def link_siblings(routes: Iterable[_Route]) -> None:
    """Mark linear routes under one parent with one in_features as candidate siblings (q/k/v/o,
    gate/up), over a call's routes or the stateful layer's (made module by module, ``module_routes``).
    A guess from the structure: the call shares h only between siblings that really get the same
    input tensor, so a wrong guess (o_proj) costs r more columns of h, no more."""
    groups: dict[tuple[str, int], list[_Route]] = {}
    for route in routes:
        if isinstance(route.spec, LinearSpec):
            groups.setdefault((route.path.rpartition(".")[0], route.spec.in_features), []).append(route)
    for members in groups.values():
        if len(members) > 1:
            for route in members:
                route.siblings = tuple(members)


def adapter_mode(
    model: nn.Module,
    adapter: Adapter,
    *,
    params: Mapping[str, Tensor] | None = None,
    impl: str = "auto",
    adapter_ids: Tensor | None = None,
) -> _LoRAMode:
    """A context manager under which ``model``'s targeted layers run with ``adapter``.

    The building block of ``functional_call`` and of the stateful layer (``fastaf.init``).
    Validates every path first (errors name the path and shapes) and changes nothing.
    ``params`` names the tensors that will stand in for the model's own during the call;
    ``adapter_ids`` (checked by the caller) selects a stack slot per example.
    """
    routes = _routes(model, adapter, dict(params or {}), stacked=adapter_ids is not None)
    return _LoRAMode(routes, impl, ids=adapter_ids)


def module_routes(module: nn.Module, loras: Mapping[str, LoRA]) -> dict[int, _Route]:
    """``module``'s routes for ``loras`` (adapter key -> LoRA: the module's own path, and names of
    its parameters for expert LoRAs), by weight id, unchecked (``module_mode``)."""
    routes = {}
    for key, lora in loras.items():
        if lora.experts:
            name = key.rpartition(".")[2]
            spec: LinearSpec | ParamSpec = param_spec(module, name)
        else:
            name, spec = "weight", linear_spec(module)
        weight = getattr(module, name)
        routes[id(weight)] = _Route(key, module, weight, lora, spec, name)
    return routes


def module_mode(module: nn.Module, loras: Mapping[str, LoRA] | None = None, *, impl: str = "auto",
                routes: dict[int, _Route] | None = None, groups: _group.Groups | None = None) -> _LoRAMode:
    """A mode adapting one module's weights with ``loras``, unchecked: the stateful layer enters it
    around that module's forward, after checking the adapter once when it was added.

    ``routes``: the module's routes that the caller keeps between calls (``module_routes``, their
    siblings linked across modules, keyed by the weights the module holds now, with current
    LoRAs), in place of new ones from ``loras``; ``groups``: the grouping those routes share with
    the other modules' modes, so siblings in different modules run as one op (``_group``). The
    caller owns its bookkeeping: entering this mode does not reset it, and leaving it drops the
    W + ΔW its routes made.
    """
    mode = _LoRAMode(module_routes(module, loras or {}) if routes is None else routes, impl, explicit=False)
    if groups is not None and not mode.traced and not mode.plain_weights:
        mode.groups, mode.shared_groups = groups, True
    return mode


_local = threading.local()  # per thread: the eager functional_call scopes, innermost last


def _scopes() -> list[_WeightWatch]:
    if not hasattr(_local, "scopes"):
        _local.scopes = []
    return _local.scopes


class _WeightWatch:
    """Per-call pre-hooks on each targeted module, for an eager ``functional_call``'s mode.

    When a targeted module starts, its hook counts the call and, if the module now holds another
    weight object than at the call's start (FSDP2 registers its unsharded weight in its own
    pre-forward hook, which runs first), keys the mode's route by that weight too. The mode itself
    spans the whole call, so a weight used outside its module (``nn.MultiheadAttention`` reads
    ``out_proj.weight`` from the parent's forward) is still adapted, and leaving it with ``with``
    is safe on any exception, interrupts included. A hook acts only for the innermost call of the
    thread running the module, so concurrent and nested calls on one model stay apart. The hooks
    are removed on exit.
    """

    def __init__(self, mode: _LoRAMode, *, hooks: bool = True) -> None:
        self.mode = mode
        # without hooks only the scope is kept: a carried call's weights count their own uses
        self.hooks = hooks
        self.handles: list[Any] = []

    def __enter__(self) -> _WeightWatch:
        try:
            for route in self.mode.all_routes() if self.hooks else ():
                self.handles.append(route.module.register_forward_pre_hook(functools.partial(self._starts, route)))
        except BaseException:
            self._remove()
            raise
        _scopes().append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _scopes().remove(self)
        self._remove()

    def _remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _starts(self, route: _Route, module: nn.Module, args: Any) -> None:
        scopes = _scopes()
        if not scopes or scopes[-1] is not self:
            return  # another thread's call, or an outer call of this thread
        route.calls += 1
        weight = getattr(module, route.name)
        if weight is not route.weight:
            self.mode.key(route, weight)
        if isinstance(route.spec, LinearSpec):
            self.mode.current = route


def explicit_mode_active() -> bool:
    """True inside ``functional_call`` (or an ``adapter_mode``): its adapter stands in for others.
    An eager call is one of this thread's scopes, with its mode entered or its weights carrying it."""
    return bool(_scopes()) or any(isinstance(m, _LoRAMode) and m.explicit for m in _mode_stack())


def _mode_stack() -> list:
    return torch.overrides._get_current_function_mode_stack()


def checkpoint_context() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """``context_fn`` for ``torch.utils.checkpoint`` that replays the adapter during recompute.

    Activation checkpointing re-runs a layer's forward during backward, after ``functional_call``
    has removed its hooks; without the adapter the recompute differs from the forward
    (non-reentrant checkpointing raises a CheckpointError). Pass this function as ``context_fn``::

        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": checkpoint_context})

    It is called at forward time, captures the call's mode, and re-enters it for the recompute.
    (The stateful layer's hooks stay on the model and apply during recomputes by themselves.)
    """
    modes = [m for m in _mode_stack() if isinstance(m, _LoRAMode) and m.explicit]
    if not modes and _scopes():  # an eager call whose weights carry the adapter: its mode recomputes
        modes = [_scopes()[-1].mode]
    return contextlib.nullcontext(), (modes[-1] if modes else contextlib.nullcontext())


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
        kwargs: keyword arguments.
        params: name -> tensor replacing the model's parameters/buffers for this call, as in
            ``torch.func.functional_call``.
        adapter_ids: (batch,) integer tensor with a stacked ``adapter`` (``fastaf.stack``):
            example i uses slot ``adapter_ids[i]``, -1 the base model alone.
        impl: kernel choice for every adapted layer ("auto", "triton", "torch").
    Returns:
        Whatever the model returns.
    """
    if not isinstance(args, tuple):
        args = (args,)
    kwargs = kwargs or {}
    inputs = (adapter, args, kwargs, params, adapter_ids)
    level = grad_level(model, inputs)
    if level:  # one eager torch.func.grad level: the model runs below it, as plain autograd
        call = lambda i: functional_call(model, i[0], i[1], i[2], params=i[3], adapter_ids=i[4], impl=impl)  # noqa: E731
        return call_below(level, call, inputs)
    if params:
        run = lambda: torch.func.functional_call(model, dict(params), args, kwargs)  # noqa: E731
    else:
        run = lambda: model(*args, **kwargs)  # noqa: E731
    batch = _batch_size((args, kwargs)) if adapter_ids is not None else None
    with tracked_scope(inputs):  # MAML's outer autograd: every layer leaves its graph beneath the levels
        return scoped_call(model, adapter, run, params=params, adapter_ids=adapter_ids, impl=impl, batch=batch)


def scoped_call(
    model: nn.Module,
    adapter: Adapter | Sequence[Adapter] | None,
    run: Any,
    *,
    params: Mapping[str, Tensor] | None = None,
    adapter_ids: Tensor | None = None,
    impl: str = "auto",
    batch: int | None = None,
) -> Any:
    """``run()`` with ``adapter`` applied to ``model``'s targeted layers: ``functional_call``'s
    machinery, for callers that run the model another way (``fastaf.generate``).

    ``batch``: the number of examples the run's layers see, which ``adapter_ids`` must match.
    """
    adapter = _combine(adapter)
    if adapter is None or len(adapter) == 0:
        if adapter_ids is not None:
            raise ValueError("fastaf: adapter_ids was given without an adapter (a stacked one, from fastaf.stack)")
        return run()
    compiling = torch.compiler.is_compiling()
    if adapter_ids is not None and not compiling:
        _check_ids(adapter_ids, adapter, batch)
    mode = adapter_mode(model, adapter, params=params, impl=impl, adapter_ids=adapter_ids)
    routes = mode.all_routes()  # before _WeightWatch keys a route by a second weight
    if not compiling and torch._C._functorch.get_interpreter_stack() and any(_is_dtensor(r.weight) for r in routes):
        raise NotImplementedError(
            f"fastaf.functional_call: {type(model).__name__} holds FSDP2 (fully_shard) modules, whose hooks "
            "do not run under torch.func transforms on CUDA (an all-gather copying into captured tensors, "
            "an old-style autograd.Function; torch 2.11): differentiate with one eager torch.func.grad "
            "level alone (the model then runs below it) or with autograd, torch.autograd.grad(loss, adapter leaves)"
        )
    if compiling:
        with mode:  # tracers see the mode alone (no hooks to register inside a graph)
            return run()
    try:
        if CARRY and _carrier.eligible(model, mode, params):
            # only calls that receive an adapted weight reach Python, not every torch call of the model
            with _carrier.carried(mode), _WeightWatch(mode, hooks=False):
                out = run()
        else:
            _warn_recompile_limit(model, routes)
            with mode, _WeightWatch(mode):
                out = run()
    finally:
        if mode.groups is not None:  # outputs held for members that never ran: not kept past the call
            mode.groups.close()
    _check_applied(routes)
    return out


_warned_limits: set[tuple[str, int, int]] = set()


def _warn_recompile_limit(model: nn.Module, routes: list[_Route]) -> None:
    """Warn once when more compiled blocks of one class hold targeted modules than dynamo's
    ``recompile_limit`` (FSDP2 recipes compile each decoder layer and call the model eagerly).

    Under the call's mode each such block compiles a graph of its own, since each reads its own
    layer's factors, where the frozen model's blocks share one; dynamo runs the blocks past the
    limit eagerly, and the step with them. On the H100 (1B shape, 16 layers, torch 2.11,
    ``diag-compiled-blocks-s33-current-*``): 143.3 ms a step at the default limit of 8, 127.5 ms
    with 16.
    """
    targeted = {id(r.module) for r in routes}
    blocks: dict[type, int] = {}
    for m in model.modules():
        cls = compiled_class(m)
        if cls is not None and any(id(s) in targeted for s in m.modules()):
            blocks[cls] = blocks.get(cls, 0) + 1
    limit = torch._dynamo.config.recompile_limit
    for cls, n in blocks.items():
        if n > limit and (cls.__qualname__, n, limit) not in _warned_limits:
            _warned_limits.add((cls.__qualname__, n, limit))
            warnings.warn(
                f"fastaf.functional_call: {n} compiled {cls.__name__} blocks hold adapted modules; under the "
                f"call each compiles a graph of its own (it reads its own layer's LoRA factors), and dynamo's "
                f"recompile_limit ({limit}) runs every block past the first {limit} eagerly. Set "
                f"torch._dynamo.config.recompile_limit = {n} (or more) before the first call",
                stacklevel=4,
            )


def _batch_size(inputs: Any) -> int | None:
    """The leading size of the first tensor among the call's inputs (input_ids, pixel_values, ...)."""
    leaves = torch.utils._pytree.tree_leaves(inputs)
    return next((t.shape[0] for t in leaves if isinstance(t, Tensor) and t.dim() > 0), None)


def _check_ids(ids: Any, adapter: Adapter, batch: int | None) -> None:
    """adapter_ids: a 1-D integer tensor, one id per example, each in [-1, n) (one host sync)."""
    if not isinstance(ids, Tensor):
        raise TypeError(f"fastaf: adapter_ids must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"fastaf: adapter_ids must be a 1-D int32/int64 tensor, got {tuple(ids.shape)} {ids.dtype}")
    devices = {l.A.device for l in adapter.values()}
    if ids.device not in devices:
        raise ValueError(f"fastaf: adapter_ids is on {ids.device} but the adapter is on {sorted(map(str, devices))}")
    n = {l.A.shape[0] for l in adapter.values() if l.stacked}
    if len(n) > 1:
        raise ValueError(f"fastaf: the stacked adapter's paths disagree on the stack size: {sorted(n)}")
    if batch is not None and ids.shape[0] != batch:
        raise ValueError(f"fastaf: adapter_ids has {ids.shape[0]} entries for a batch of {batch} examples")
    if n and ids.numel() and not (ids.is_cuda and torch.cuda.is_current_stream_capturing()):
        # the range check syncs with the device: skipped inside a CUDA-graph capture
        lo, hi = int(ids.min()), int(ids.max())
        if lo < -1 or hi >= next(iter(n)):
            raise ValueError(f"fastaf: adapter_ids must lie in [-1, {next(iter(n))}) for a stack of "
                             f"{next(iter(n))} adapters, got values from {lo} to {hi}")


_GRADLESS = (" only with grad disabled inside a call that runs with grad (a custom autograd.Function's forward, a "
             "no_grad block): the output is adapted but no gradient reaches its LoRA's factors, which would be "
             "silently lost. Differentiate through the weight's use, or call under torch.no_grad() throughout")
_UNADAPTED = (", but used its weight in a way fastaf does not adapt (it adapts F.linear, torch.addmm and x @ "
              "weight.T, and any other use of its values through W + scale·B@A; a targeted parameter, any torch "
              "call on it), or only detached (W.detach(), W.data), or not at all; its LoRA would be silently lost. "
              "Merge it instead: fastaf.functional_call(model, None, args, params=fastaf.merge_into(model, adapter))")


def _check_applied(routes: list[_Route]) -> None:
    """Raise for modules that ran with their LoRA unapplied (a carried weight: whose weight was used
    only in ways not adapted), or applied only where no gradient reaches it; warn for modules that
    never ran."""
    for count, what, why in (("gradless", "used its weight {} time(s)", _GRADLESS),
                             ("calls", "ran {} time(s)", _UNADAPTED)):
        lost = [r for r in routes if r.hits == 0 and getattr(r, count) > 0]
        if lost:
            raise ValueError("fastaf.functional_call: " + "; ".join(
                f"{r.path} ({type(r.module).__name__}) {what.format(getattr(r, count))}" for r in lost[:5]) + why)
    missed = [r.path for r in routes if r.hits == 0]
    if missed:
        warnings.warn(
            f"fastaf.functional_call: {len(missed)} adapted module(s) did not run during the call, "
            f"so their LoRA was not needed: {missed[:5]}",
            stacklevel=3,
        )
