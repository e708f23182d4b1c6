"""``LoRAConfig`` and ``init_adapter``: a fresh adapter initialised exactly as PEFT does."""
from __future__ import annotations

import dataclasses
import math
import numbers
import re
from collections.abc import Sequence

import torch
from torch import nn

from .._adapter import Adapter, LoRA
from .._layouts import LinearSpec, check_module, match_targets, target_spec
from ..intercept import held_tensor


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """What to adapt and how.

    Attributes:
        r: rank, >= 1.
        alpha: scale numerator: scale = alpha / r (alpha / sqrt(r) with ``rslora``).
        targets: module-name or parameter-name suffixes (list) or a regex / ``"all-linear"``
            (str), as PEFT's ``target_modules`` and ``target_parameters`` together; a parameter
            (a fused MoE expert parameter, a router weight) gets one LoRA per expert.
        dropout: LoRA dropout probability on the adapter's input, in [0, 1).
        rslora: rank-stabilised scaling (Kalajdzievski 2023).
    """

    r: int
    alpha: float
    targets: str | Sequence[str]
    dropout: float = 0.0
    rslora: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.r, int) or isinstance(self.r, bool):
            raise TypeError(f"LoRAConfig.r must be an int, got {self.r!r}")
        if self.r < 1:
            raise ValueError(f"LoRAConfig.r must be >= 1, got {self.r}")
        if not isinstance(self.alpha, numbers.Real) or isinstance(self.alpha, bool):
            raise TypeError(f"LoRAConfig.alpha must be a number, got {self.alpha!r}")
        if not math.isfinite(self.alpha):
            raise ValueError(f"LoRAConfig.alpha must be finite, got {self.alpha}")
        if not isinstance(self.dropout, numbers.Real) or isinstance(self.dropout, bool):
            raise TypeError(f"LoRAConfig.dropout must be a number, got {self.dropout!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRAConfig.dropout must be in [0, 1), got {self.dropout}")
        if not isinstance(self.rslora, bool):  # "no" would be truthy and turn rsLoRA on
            raise TypeError(f"LoRAConfig.rslora must be True or False, got {self.rslora!r}")
        if isinstance(self.targets, str):
            if not self.targets:
                raise ValueError("LoRAConfig.targets is empty")
            try:
                re.compile(self.targets)
            except re.error as err:
                raise ValueError(f"LoRAConfig.targets {self.targets!r} is not a valid regex: {err}") from None
        elif isinstance(self.targets, Sequence):
            targets = tuple(self.targets)
            if not targets or not all(isinstance(t, str) and t for t in targets):
                raise ValueError(f"LoRAConfig.targets must be non-empty module names, got {self.targets!r}")
            object.__setattr__(self, "targets", targets)
        else:
            raise TypeError(
                f"LoRAConfig.targets must be a list of module names or a regex str, got {self.targets!r}"
            )

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.r) if self.rslora else self.r)


def init_adapter(
    model: nn.Module,
    config: LoRAConfig,
    *,
    seed: int | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> Adapter:
    """A new Adapter for ``model``'s targeted linear layers and parameters, initialised as PEFT does.

    A (r, in) is kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in)); B (out, r) is
    zero, so the adapted model starts equal to the base. A targeted parameter gets an expert LoRA,
    A (E, r, in) and B (E, out, r), drawn as PEFT draws its (E·r, in) lora_A.

    Args:
        model: any module tree; targets are matched against ``model.named_modules()``.
        config: the LoRAConfig.
        seed: seeds a private generator (the global RNG is left alone); None uses the global RNG.
        dtype: factor dtype; default float32 (float64 for a float64 model), like PEFT's fp32
            adapters: the op casts them to the activation dtype on the fly.
        device: default: each module's weight device.
    """
    check_module(model, "fastaf.init_adapter")
    if not isinstance(config, LoRAConfig):
        raise TypeError(f"init_adapter needs a fastaf.LoRAConfig, got {type(config).__name__}")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise TypeError(f"init_adapter: seed must be an int or None, got {type(seed).__name__} {seed!r}")
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    keys = match_targets(model, config.targets)
    specs = {key: target_spec(modules, key) for key in keys}
    if config.dropout:
        fused = [k for k, spec in specs.items() if not isinstance(spec, LinearSpec)]
        if fused:
            raise ValueError(
                f"init_adapter: LoRAConfig.dropout={config.dropout} cannot apply to the targeted parameters "
                f"{fused[:3]}: their LoRA is folded into the weight, which leaves no input to drop (PEFT "
                "refuses lora_dropout with target_parameters too); use dropout=0 or target modules only"
            )
    loras = {}
    for key, spec in specs.items():
        # a linear's weight, or the tensor a packed layer without one keys (GPTQ's qweight): its
        # device, and float64 or not
        weight = held_tensor(modules[key], "weight", spec) if isinstance(spec, LinearSpec) else params[key]
        experts = 0 if isinstance(spec, LinearSpec) else spec.num_experts
        dt = dtype or (torch.float64 if weight.dtype == torch.float64 else torch.float32)
        A = torch.empty(max(experts, 1) * config.r, spec.in_features, dtype=torch.float32)
        # PEFT: nn.init.kaiming_uniform_(lora_A.weight, a=math.sqrt(5)); drawn on the CPU so a
        # seed gives the same adapter on every device. An expert LoRA's rows are PEFT's (E·r, in).
        nn.init.kaiming_uniform_(A, a=math.sqrt(5), generator=generator)
        dev = device if device is not None else weight.device
        if experts:
            A = A.reshape(experts, config.r, spec.in_features)
            B = torch.zeros(experts, spec.out_features, config.r, dtype=dt, device=dev)
        else:
            B = torch.zeros(spec.out_features, config.r, dtype=dt, device=dev)
        loras[key] = LoRA(A.to(device=dev, dtype=dt), B, config.scale, config.dropout, experts=bool(experts))
    return Adapter(loras)
