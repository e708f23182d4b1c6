"""Which modules a LoRA can sit on, and how their weights are laid out.

Two layouts are supported: ``nn.Linear`` (weight (out, in), ``F.linear``) and Hugging Face's
GPT-2 ``Conv1D`` (weight (in, out), ``torch.addmm(bias, x, weight)``). The functional core
recognises Conv1D by its class without importing transformers.
"""
from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Sequence

from torch import nn


@dataclasses.dataclass(frozen=True)
class LinearSpec:
    """in/out features of a LoRA-able module and whether its weight is stored (in, out)."""

    in_features: int
    out_features: int
    transposed: bool


def _is_hf_conv1d(module: nn.Module) -> bool:
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers") and hasattr(module, "nf")


def linear_spec(module: nn.Module) -> LinearSpec | None:
    """The LinearSpec of ``module``, or None when it is not a linear layer fastaf can adapt."""
    if isinstance(module, nn.Linear):
        return LinearSpec(module.in_features, module.out_features, transposed=False)
    if _is_hf_conv1d(module):
        k, n = module.weight.shape
        return LinearSpec(k, n, transposed=True)
    return None


def _output_embedding_paths(model: nn.Module) -> set[str]:
    """Paths of the output projection, which PEFT's "all-linear" leaves out."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return {name for name, m in model.named_modules() if head is not None and m is head}


def selects(target: str, path: str) -> bool:
    """PEFT's list rule: ``target`` selects a module path equal to it or ending in ``.target``."""
    return path == target or path.endswith("." + target)


def match_targets(model: nn.Module, targets: str | Sequence[str]) -> list[str]:
    """Module paths that ``targets`` selects, the way PEFT's ``target_modules`` does.

    A string is a regular expression matched against the whole path (``re.fullmatch``), except
    ``"all-linear"``: every linear layer but the output projection. A list matches a path equal
    to an entry or ending in ``"." + entry``.

    Raises:
        ValueError: a list entry matches no module, or a match is not a linear layer.
    """
    named = dict(model.named_modules())
    if isinstance(targets, str):
        if targets == "all-linear":
            skip = _output_embedding_paths(model)
            paths = [p for p, m in named.items() if p and p not in skip and linear_spec(m) is not None]
            fused = [n for n, p in model.named_parameters() if p.dim() == 3]
            if fused:  # PEFT's "all-linear" adapts these too (target_parameters); say what is left out
                warnings.warn(
                    f"fastaf: 'all-linear' adapts the {len(paths)} linear modules of {type(model).__name__} but "
                    f"not its {len(fused)} fused 3-D (MoE expert) parameters, which fastaf cannot adapt yet: "
                    f"{fused[:3]}",
                    stacklevel=3,
                )
        else:
            paths = [p for p in named if p and re.fullmatch(targets, p)]
        if not paths:
            raise ValueError(f"target {targets!r} matches no module of {type(model).__name__}")
    else:
        paths, unmatched = [], []
        for t in targets:
            hits = [p for p in named if selects(t, p)]
            if not hits:
                unmatched.append(t)
            paths.extend(hits)
        if unmatched:
            raise ValueError(
                f"targets {unmatched} match no module of {type(model).__name__} "
                f"(module names look like {[p for p in named if p][-3:]})"
            )
        paths = list(dict.fromkeys(p for p in named if p in set(paths)))  # model order, no repeats
    for p in paths:
        if linear_spec(named[p]) is None:
            raise ValueError(
                f"target matches {p!r}, a {type(named[p]).__name__}; LoRA applies to nn.Linear "
                "and transformers Conv1D layers only"
            )
    return paths


