"""Which modules and parameters a LoRA can sit on, and how their weights are laid out.

Two module layouts are supported: ``nn.Linear`` (weight (out, in), ``F.linear``) and Hugging
Face's GPT-2 ``Conv1D`` (weight (in, out), ``torch.addmm(bias, x, weight)``). The functional core
recognises Conv1D by its class without importing transformers.

A parameter can be targeted directly, as PEFT's ``target_parameters``: a fused 3-D MoE expert
parameter, E linear maps stored (E, out, in) (transformers' experts; (E, in, out) where the
experts module sets ``is_transposed``, as PEFT reads it), or a 2-D one such as a router's weight
(out, in), one expert.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ._adapter import LoRA


@dataclasses.dataclass(frozen=True)
class LinearSpec:
    """in/out features of a LoRA-able module, whether its weight is stored (in, out), and whether
    it is a quantized linear (``branch``: its weight is no float matrix, so its LoRA is a branch
    added to the module's own output, exact for a linear map)."""

    in_features: int
    out_features: int
    transposed: bool
    branch: bool = False


def _is_hf_conv1d(module: nn.Module) -> bool:
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers") and hasattr(module, "nf")


def _packed(module: nn.Module) -> bool:
    """``module`` holds its weights as no float tensor: a parameter or buffer of its own is an
    integer one (packed 4-bit, int8) and none is a float matrix named ``weight``."""
    weight = module._parameters.get("weight")
    if isinstance(weight, torch.Tensor) and weight.is_floating_point():
        return False
    own = [*module._parameters.values(), *module._buffers.values()]
    return any(isinstance(t, torch.Tensor) and not t.is_floating_point() and not t.is_complex() for t in own)


def linear_spec(module: nn.Module) -> LinearSpec | None:
    """The LinearSpec of ``module``, or None when it is not a linear layer fastaf can adapt.

    Quantized linears are linear layers too (``LinearSpec.branch``): bitsandbytes' ``Linear4bit``
    and ``Linear8bitLt`` (``nn.Linear`` subclasses holding packed uint8 or int8), and any other
    module with integer ``in_features`` and ``out_features`` whose weights are packed integers
    (GPTQ, AWQ, HQQ layers)."""
    if isinstance(module, nn.Linear):
        return LinearSpec(module.in_features, module.out_features, transposed=False, branch=_packed(module))
    if _is_hf_conv1d(module):
        k, n = module.weight.shape
        return LinearSpec(k, n, transposed=True)
    k, n = getattr(module, "in_features", None), getattr(module, "out_features", None)
    if type(k) is int and type(n) is int and _packed(module):
        return LinearSpec(k, n, transposed=False, branch=True)
    return None


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """A targeted parameter's layout: E linear maps in_features -> out_features, stored
    (E, out, in), (E, in, out) when ``transposed``, or (out, in) when ``ndim`` is 2 (E = 1)."""

    num_experts: int
    in_features: int
    out_features: int
    transposed: bool
    ndim: int


def param_spec(module: nn.Module, name: str) -> ParamSpec | None:
    """The ParamSpec of ``module``'s own parameter ``name``, or None when it is not a 2-D or 3-D
    float parameter."""
    t = module._parameters.get(name)
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() not in (2, 3):
        return None
    if t.dim() == 2:
        return ParamSpec(1, t.shape[1], t.shape[0], transposed=False, ndim=2)
    transposed = bool(getattr(module, "is_transposed", False))  # PEFT's ParamWrapper reads the same flag
    e, d1, d2 = t.shape
    return ParamSpec(e, d1, d2, transposed, 3) if transposed else ParamSpec(e, d2, d1, transposed, 3)


def fold_param(weight: torch.Tensor, lora: LoRA, spec: ParamSpec) -> torch.Tensor:
    """``weight + scale·ΔW`` for an expert LoRA, in weight's dtype and layout, in one (b)addmm as
    PEFT's ParamWrapper folds it (factors cast to the weight's dtype). A new tensor."""
    A, B = lora.A.to(weight.dtype), lora.B.to(weight.dtype)  # (E, r, in), (E, out, r)
    if spec.ndim == 2:
        return torch.addmm(weight, B[0], A[0], alpha=lora.scale)
    if spec.transposed:  # stored (E, in, out): add (B_e @ A_e)ᵀ = A_eᵀ @ B_eᵀ
        return torch.baddbmm(weight, A.transpose(-1, -2), B.transpose(-1, -2), alpha=lora.scale)
    return torch.baddbmm(weight, B, A, alpha=lora.scale)


def fold_linear(weight: torch.Tensor, lora: LoRA, spec: LinearSpec) -> torch.Tensor:
    """``weight + scale·B@A`` of a linear layer, in weight's dtype and layout (an (in, out) Conv1D
    weight gets (B@A)ᵀ = Aᵀ@Bᵀ), in one addmm. A new tensor, differentiable in A and B."""
    A, B = lora.A.to(weight.dtype), lora.B.to(weight.dtype)  # (r, in), (out, r)
    if spec.transposed:
        return torch.addmm(weight, A.T, B.T, alpha=lora.scale)
    return torch.addmm(weight, B, A, alpha=lora.scale)


def target_spec(modules: Mapping[str, nn.Module], key: str) -> LinearSpec | ParamSpec | None:
    """How adapter key ``key`` sits on the model whose ``named_modules()`` are ``modules``: a
    linear module's LinearSpec, a parameter's ParamSpec, or None when it is neither."""
    if key in modules:
        return linear_spec(modules[key])
    owner, _, name = key.rpartition(".")
    return param_spec(modules[owner], name) if owner in modules else None


def _is_expert_param(module: nn.Module, t: torch.Tensor) -> bool:
    """A fused MoE expert parameter: 3-D, first axis the owner's ``num_experts`` (transformers'
    experts modules; convolutions and 3-D embeddings have no such attribute)."""
    return t.dim() == 3 and t.is_floating_point() and getattr(module, "num_experts", None) == t.shape[0]


def _parameter_names(model: nn.Module) -> dict[str, tuple[str, nn.Module]]:
    """Parameter name -> (owner path, owner) for every 2-D / 3-D float parameter that a
    parameter LoRA can target: those of modules that are not linear layers (a linear layer's
    weight is targeted through its module)."""
    out = {}
    for path, module in model.named_modules():
        if linear_spec(module) is not None:
            continue
        for name in module._parameters:
            if param_spec(module, name) is not None:
                out[f"{path}.{name}" if path else name] = (path, module)
    return out


def _all_linear_parameters(model: nn.Module) -> list[str]:
    """What PEFT's "all-linear" adds on transformers-5 MoE models through ``target_parameters``:
    every fused expert parameter, and the 2-D ``weight`` of each non-linear module beside an
    experts module (the router, ``mlp.gate``)."""
    modules = dict(model.named_modules())
    experts = {p for p, m in modules.items() if any(_is_expert_param(m, t) for t in m._parameters.values() if t is not None)}
    parents = {p.rpartition(".")[0] for p in experts}
    names = []
    for path, module in modules.items():
        if path in experts:
            names += [f"{path}.{n}" for n, t in module._parameters.items() if t is not None and _is_expert_param(module, t)]
        elif path and path.rpartition(".")[0] in parents and linear_spec(module) is None:
            spec = param_spec(module, "weight")
            if spec is not None and spec.ndim == 2:
                names.append(f"{path}.weight")
    return names


def _output_embedding_paths(model: nn.Module) -> set[str]:
    """Paths of the output projection, which PEFT's "all-linear" leaves out."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return {name for name, m in model.named_modules() if head is not None and m is head}


def selects(target: str, path: str) -> bool:
    """PEFT's list rule: ``target`` selects a module path equal to it or ending in ``.target``."""
    return path == target or path.endswith("." + target)


def match_targets(model: nn.Module, targets: str | Sequence[str]) -> list[str]:
    """Adapter keys that ``targets`` selects, the way PEFT's ``target_modules`` and
    ``target_parameters`` do: module paths of linear layers, and parameter names.

    A string is a regular expression matched against the whole module path or parameter name
    (``re.fullmatch``), except ``"all-linear"``: every linear layer but the output projection,
    and on MoE models every fused expert parameter and router weight (PEFT 0.21's "all-linear"
    on transformers 5). A list matches a path or name equal to an entry or ending in
    ``"." + entry`` (``"gate_up_proj"``, ``"mlp.gate.weight"``). Parameters of linear layers are
    reached through their module. Keys come in model order: parameters follow their module.

    Raises:
        ValueError: a list entry matches nothing, or a matched module is not a linear layer.
    """
    named = dict(model.named_modules())
    params = _parameter_names(model)
    if isinstance(targets, str):
        if targets == "all-linear":
            skip = _output_embedding_paths(model)
            paths = [p for p, m in named.items() if p and p not in skip and linear_spec(m) is not None]
            keys = set(paths) | set(_all_linear_parameters(model))
        else:
            keys = {p for p in [*named, *params] if p and re.fullmatch(targets, p)}
        if not keys:
            ends = [p for p in [*named, *params] if p.endswith("." + targets)][:3]
            hint = (f"; a str is a regex over whole paths (these end in it: {ends}): pass [{targets!r}] to select "
                    "modules by name, or a regex such as '.*\\." + targets + "'") if ends else ""
            raise ValueError(f"target {targets!r} matches no module or parameter of {type(model).__name__}{hint}")
    else:
        keys, unmatched = set(), []
        for t in targets:
            hits = [p for p in [*named, *params] if p and selects(t, p)]
            if not hits:
                unmatched.append(t)
            keys.update(hits)
        if unmatched:
            leaves = sorted({p.rpartition(".")[2] for p in [*named, *params] if p})
            close = sorted({c for t in unmatched for c in difflib.get_close_matches(t.rpartition(".")[2], leaves, n=3)})
            raise ValueError(
                f"targets {unmatched} match no module of {type(model).__name__} "
                + (f"(close names: {close})" if close else f"(module names look like {[p for p in named if p][-3:]})")
            )
    ordered = []  # model order: a module, then its own parameters
    for path, module in named.items():
        if path in keys:
            if linear_spec(module) is None:
                own = [n for n in params if params[n][0] == path]
                raise ValueError(
                    f"target matches {path!r}, a {type(module).__name__}; LoRA applies to nn.Linear "
                    "and transformers Conv1D layers, and to parameters by name"
                    + (f" (this module's: {own})" if own else "")
                )
            ordered.append(path)
        ordered += [f"{path}.{n}" if path else n for n in module._parameters if (f"{path}.{n}" if path else n) in keys]
    return ordered


def compiled_class(module: nn.Module) -> type | None:
    """The class whose forward dynamo compiles for ``module``: the wrapped module's for
    ``torch.compile(m)`` (an ``OptimizedModule``), its own for ``m.compile()``; None when the
    module is not compiled. Also a compiled forward set on the instance
    (``m.forward = torch.compile(m.forward)``, as transformers' docs and users do)."""
    # dict reads, not getattr: eager calls ask this of every module of the model (an nn.Module's
    # __getattr__ raises internally for a missing name)
    own = module.__dict__
    if own.get("_compiled_call_impl") is not None:
        return type(module)
    inner = own.get("_modules", {}).get("fastaf")  # fa.init keeps the forward it replaced there
    if "forward" not in own and inner is None:  # (an OptimizedModule sets its forward on the instance)
        return None
    if isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
        return type(module._orig_mod)
    forward = own.get("forward")
    # fastaf.generate's stand-in for the length of a generate (``_generate._AdaptedForward``): the
    # forward it runs is the one compiled or not
    forward = getattr(forward, "fastaf_stands_in_for", forward)
    compiled = any(getattr(f, "_torchdynamo_orig_callable", None) is not None
                   for f in (forward, getattr(inner, "own_forward", None)))
    return type(module) if compiled else None


def check_module(model: Any, where: str) -> None:
    """Raise a TypeError naming what ``where`` (a public entry point) got when ``model`` is not an
    ``nn.Module`` (a dict of tensors, a path, a pipeline), before anything runs."""
    if isinstance(model, nn.Module):
        return
    shown = repr(model)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    raise TypeError(f"{where} needs an nn.Module as its model, got a {type(model).__name__}: {shown}")
