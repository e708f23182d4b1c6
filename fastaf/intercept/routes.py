"""Where an adapter's LoRAs go in a model: one ``Route`` per targeted weight (its adapter key,
module, LoRA and layout), validated against the model before anything runs or changes.

``resolve_routes`` checks a whole adapter (paths, shapes, devices, stacking, tied weights) for
``functional_call`` and ``adapter_mode``; ``module_routes`` makes one module's routes unchecked for
the stateful layer, which checked the adapter when it was added. ``link_siblings`` marks linear
layers that may share an input (q/k/v/o, gate/up) from the model's structure.
"""
from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from .._adapter import Adapter, LoRA
from .._layouts import LinearSpec, ParamSpec, linear_spec, param_spec
from ..ops import refuse_ids_under_vmap


@dataclasses.dataclass
class Route:
    """Where one targeted weight goes: its adapter key, module, LoRA and layout."""

    path: str  # the adapter key: a module path, or a parameter's name for an expert LoRA
    module: nn.Module  # the module holding the weight
    weight: Tensor
    lora: LoRA
    spec: LinearSpec | ParamSpec  # ParamSpec: substituted by W + ΔW wherever it is used
    name: str = "weight"  # the weight's attribute on ``module``
    # a quantized linear (``LinearSpec.branch``): the LoRA is added to the module's output by
    # hooks, and its weight is never intercepted (``ops.lora_branch``)
    branch: bool = False
    hits: int = 0  # uses of the weight sent through lora_linear (or substituted)
    calls: int = 0  # module runs (the mode's per-call hooks), or uses no rule adapted (a carrier)
    merged: Tensor | None = None  # W + ΔW, made at its first use that needs it in the call
    tied: bool = False  # the weight is also another (non-linear) module's: an embedding's
    gradless: int = 0  # adapted uses with grad off inside a call with grad on: none reaches A, B
    # candidate siblings sharing this layer's input (this route included); () when it has none
    siblings: tuple[Route, ...] = dataclasses.field(default=(), repr=False, compare=False)



def is_dtensor(t: Any) -> bool:
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
        if f"_orig_mod.{path}" in modules:  # torch.compile's wrapper (OptimizedModule) of the model
            raise ValueError(
                f"adapter path {path!r} is not a module of {where}, torch.compile's wrapper: pass the model it wraps, "
                "compiled._orig_mod, or compile the function that calls fastaf.functional_call"
            )
        close = [p for p in modules if p.endswith(path.rsplit(".", 1)[-1])][:3]
        raise ValueError(
            f"adapter path {path!r} is not a module of {where}" + (f" (similar: {close})" if close else "")
        )
    spec = linear_spec(module)
    if spec is None:
        raise ValueError(f"adapter path {path!r} is a {type(module).__name__}, not a linear layer")
    return module, "weight", spec


def held_tensor(module: nn.Module, name: str, spec: LinearSpec | ParamSpec) -> Tensor:
    """The tensor a route is keyed by: the module's weight, or for a quantized linear without one
    (GPTQ's ``qweight``) its first own parameter or buffer (its device is the layer's)."""
    held = module._parameters.get(name)  # a registered parameter: without nn.Module.__getattr__'s lookups
    if held is not None:
        return held
    if not (isinstance(spec, LinearSpec) and spec.branch) or isinstance(getattr(module, name, None), Tensor):
        return getattr(module, name)
    return next(t for t in (*module._parameters.values(), *module._buffers.values()) if isinstance(t, Tensor))


def _check_fits(path: str, lora: LoRA, module: nn.Module, weight: Tensor, spec: LinearSpec | ParamSpec,
                stacked: bool) -> None:
    """The LoRA's stacking, shapes and device against the weight it adapts."""
    if lora.stacked != stacked:
        if stacked:  # vmap over the stack took its leading axis away: "needs a stacked adapter" misled
            refuse_ids_under_vmap(path, f"A {tuple(lora.A.shape)} as vmap hands it over")
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
        n = "n, " if lora.stacked else ""  # a stack's leading axis, in what is expected too
        raise ValueError(
            f"{path}: LoRA A {tuple(lora.A.shape)} / B {tuple(lora.B.shape)} does not fit "
            f"{type(module).__name__}({spec.in_features} -> {spec.out_features}): expected "
            f"A ({n}r, {spec.in_features}) and B ({n}{spec.out_features}, r)"
        )
    if lora.A.device != weight.device:
        raise ValueError(
            f"{path}: LoRA A {tuple(lora.A.shape)} is on {lora.A.device} but the weight is on {weight.device}"
        )



def walked_modules(model: nn.Module) -> dict[str, nn.Module]:
    """``dict(model.named_modules())`` less the subtrees of the model's children that hold
    ``fastaf_holds_no_targets`` (the stateful layer's registry of factors, one module per adapted
    layer): no adapter targets a module there, and traced, each module walked is guards dynamo
    checks at every call of the graph. (Read from the children's ``__dict__``: a guard each, C++.)

    Eagerly the walk is a plain recursion over ``_modules``, in ``named_modules``' order and with
    its rule for a module reachable twice (the first path only): half its host time (~60 against
    ~120 us for a 16-layer Llama on a CPU), at every ``functional_call``. Traced, it is
    ``named_modules`` itself, whose guards dynamo knows."""
    skipped = {child for child in model._modules.values()
               if child is not None and child.__dict__.get("fastaf_holds_no_targets", False)}
    if torch.compiler.is_compiling() or type(model).named_modules is not _NAMED_MODULES:
        return dict(model.named_modules(memo=skipped))
    seen = skipped | {model}  # modules, as named_modules' memo (their own __hash__ and __eq__)
    walked = {"": model}
    own_walk = []  # a module whose class walks its children its own way

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module._modules.items():
            if child is None or child in seen:
                continue
            if type(child).named_modules is not _NAMED_MODULES:
                own_walk.append(child)
                return
            seen.add(child)
            path = prefix + name
            walked[path] = child
            if child._modules:
                visit(path + ".", child)

    visit("", model)
    return dict(model.named_modules(memo=skipped)) if own_walk else walked


_NAMED_MODULES = nn.Module.named_modules


def resolve_routes(model: nn.Module, adapter: Adapter, params: Mapping[str, Tensor], *,
            stacked: bool = False, modules: Mapping[str, nn.Module] | None = None) -> dict[int, Route]:
    """Validate every path of ``adapter`` against ``model`` and map weight ids to routes.

    ``stacked``: the call has ``adapter_ids``, so every LoRA must carry the stack axis.
    ``modules``: ``walked_modules(model)``, where the caller walked it already.
    """
    modules = walked_modules(model) if modules is None else modules
    check = not torch.compiler.is_compiling()
    # the last adapter resolved on this model, again (an inference loop's every call): its paths'
    # modules, layouts and fits stand while the model holds the same modules and weights
    last = _resolved.get(model) if check and not params else None
    again = last is not None and last[0]() is adapter and last[1] == stacked and last[2] == list(modules) \
        and all(a() is b for a, b in zip(last[3], modules.values()))
    routes: dict[int, Route] = {}
    resolved = []
    for i, (path, lora) in enumerate(adapter.items()):
        if again:
            module, kept, fields = last[4][i]
            module = module()
            weight = None if module is None else held_tensor(module, fields["name"], fields["spec"])
            if weight is None or (id(weight), weight.shape, weight.dtype) != kept or weight.device != lora.A.device:
                del _resolved[model]  # it no longer holds: from scratch
                return resolve_routes(model, adapter, params, stacked=stacked, modules=modules)
            route = object.__new__(Route)  # the first resolution's fields, fresh counters (dataclass __init__: host time)
            route.__dict__.update(fields, module=module, weight=weight, lora=lora)
            routes[id(weight)] = route
            continue
        module, name, spec = _resolve(modules, path, lora, model)
        weight = params.get(path if lora.experts else f"{path}.weight", held_tensor(module, name, spec))
        if not check and is_dtensor(weight):
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
            other = routes[id(weight)].path
            raise ValueError(
                f"{other} and {path} share one weight tensor (tied), which fastaf adapts at every use: it cannot "
                f"hold a LoRA per module. Untie them to adapt each: {_untie(path, other)}"
            )
        route = routes[id(weight)] = Route(path, module, weight, lora, spec, name,
                                           branch=isinstance(spec, LinearSpec) and spec.branch)
        if check and not params:
            # its fields as made, before any use, less the module, weight and LoRA (nothing here
            # keeps them alive): a call again with this adapter copies them, the module and weight
            # found the same ones, the LoRA the adapter's. Eager only: torch 2.11's dynamo cannot
            # trace a __dict__ read
            fields = {k: v for k, v in route.__dict__.items() if k not in ("module", "weight", "lora")}
            resolved.append((weakref.ref(module), (id(weight), weight.shape, weight.dtype), fields))
    made = list(routes.values())  # in the adapter's order
    if again:  # the siblings as linked the first time, by their places in that order
        for group in last[5]:
            members = tuple(made[i] for i in group)
            for route in members:
                route.siblings = members
    else:
        link_siblings(made)
    if check and not params and not again:
        place = {id(r): i for i, r in enumerate(made)}
        groups = {id(r.siblings): tuple(place[id(m)] for m in r.siblings) for r in made if r.siblings}
        _resolved[model] = (weakref.ref(adapter), stacked, list(modules), [weakref.ref(m) for m in modules.values()],
                            resolved, tuple(groups.values()))
    # traced too: a tied embedding's read of lm_head's weight must not fold W + ΔW under compile
    for path, module in modules.items():
        weight = _weight_attr(module)
        # a module without one: dynamo (torch 2.11) cannot trace id(None)
        route = routes.get(id(weight)) if isinstance(weight, Tensor) else None
        if route is not None and route.module is not module:
            if linear_spec(module):  # compiled too: it ran with both adapted, silently
                raise ValueError(
                    f"{route.path} is adapted, but its weight is the same tensor as {path}'s (tied), and fastaf "
                    f"adapts a weight at every use: {path} would get the same LoRA, which PEFT does not give it. "
                    f"Untie them to adapt {route.path} alone: {_untie(path, route.path)}"
                )
            route.tied = True  # an embedding's too: its uses there stay the base weight's
    return routes



# model -> (the adapter last resolved on it, stacked, the paths and modules walked then, per path
# its (module, the weight's id, shape and dtype, the Route's other fields as made: attribute and
# layout among them), the sibling groups by the routes' places in the adapter's order); the model, its modules and
# the adapter held weakly (nothing here keeps a model alive), the weights not at all
# (``torch.utils.swap_tensors``, which ``Module.to`` may use, refuses a tensor with a weak reference)
_resolved: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _weight_attr(module: nn.Module) -> Any:
    """``getattr(module, "weight", None)``, read from the module's dicts where it is there or cannot
    be elsewhere: ``nn.Module.__getattr__`` raises inside for a missing name, host time on each
    module of the model at every call."""
    params = module._parameters
    if "weight" in params:
        return params["weight"]
    for held in (module._buffers, module.__dict__):
        if "weight" in held:
            return held["weight"]
    if torch.compiler.is_compiling():
        # traced, what the dicts hold: a getattr of the missing name is a guard that calls
        # nn.Module.__getattr__ (which raises) at every call of the graph, on every module of the
        # model, and ``type(module)`` identity checks between the layers that Python evaluates. What
        # is missed is harmless here: a property (a parametrization's) makes a new tensor per read,
        # never a route's weight; a wrapper's __getattr__ reaches the weight of a module walked too
        return None
    cls = type(module)
    plain = _NO_CLASS_WEIGHT.get(cls)
    if plain is None:  # the walk meets the same few classes at every call
        plain = _NO_CLASS_WEIGHT[cls] = cls.__getattr__ is nn.Module.__getattr__ and not hasattr(cls, "weight")
    if plain:
        return None
    return getattr(module, "weight", None)  # a property (a parametrization), a class's own __getattr__


# class -> its instances without a registered "weight" have none (nn.Module's __getattr__, no class
# attribute of that name): read once per class (a plain dict: a weak one's lookups are Python calls)
_NO_CLASS_WEIGHT: dict[type, bool] = {}


def _untie(path: str, other: str) -> str:
    """The line that gives module ``path`` a weight of its own, a copy of module ``other``'s."""
    return (f'model.get_submodule("{path}").weight = '
            f'nn.Parameter(model.get_submodule("{other}").weight.detach().clone())')


def link_siblings(routes: Iterable[Route]) -> None:
    """Mark linear routes under one parent with one in_features as candidate siblings (q/k/v/o,
    gate/up), over a call's routes or the stateful layer's (made module by module, ``module_routes``).
    A guess from the structure: the call shares h only between siblings that really get the same
    input tensor, so a wrong guess (o_proj) costs r more columns of h, no more."""
    groups: dict[tuple[str, int], list[Route]] = {}
    for route in routes:
        if isinstance(route.spec, LinearSpec) and not route.branch:  # a branch shares nothing: no op call
            groups.setdefault((route.path.rpartition(".")[0], route.spec.in_features), []).append(route)
    for members in groups.values():
        if len(members) > 1:
            for route in members:
                route.siblings = tuple(members)



def module_routes(module: nn.Module, loras: Mapping[str, LoRA]) -> dict[int, Route]:
    """``module``'s routes for ``loras`` (adapter key -> LoRA: the module's own path, and names of
    its parameters for expert LoRAs), by weight id, unchecked (``module_mode``)."""
    routes = {}
    for key, lora in loras.items():
        if lora.experts:
            name = key.rpartition(".")[2]
            spec: LinearSpec | ParamSpec = param_spec(module, name)
        else:
            name, spec = "weight", linear_spec(module)
        weight = held_tensor(module, name, spec)
        routes[id(weight)] = Route(key, module, weight, lora, spec, name,
                                   branch=isinstance(spec, LinearSpec) and spec.branch)
    return routes

