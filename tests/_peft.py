"""PEFT as the reference: a PEFT model holding the same factors as a fastaf adapter, and the
factor layouts of PEFT's ``target_parameters`` (lora.ParamWrapper).

PEFT keeps an expert LoRA of E experts as lora_A (E·r, in), row e·r + j = A[e, j], and lora_B
(out, r·E), column j·E + e = B[e, :, j]; nested ParamWrappers hold several parameters of one
module (the one registered first innermost).
"""
from __future__ import annotations

import copy
import warnings

import peft
import torch

import fastaf as fa


def peft_config(adapter: fa.Adapter, r: int, alpha: float, targets=None) -> peft.LoraConfig:
    """A LoraConfig for ``adapter``'s keys: ``targets`` as target_modules when it has no expert
    LoRAs, else its module paths and its parameter names (target_parameters)."""
    params = [k for k, l in adapter.items() if l.experts]
    if not params and targets is not None:
        return peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0)
    modules = [k for k, l in adapter.items() if not l.experts]
    return peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=modules, target_parameters=params, lora_dropout=0.0)


def peft_layer(pm, key: str, lora: fa.LoRA):
    """PEFT's LoRA layer for ``key``: the module's, or the ParamWrapper of the parameter."""
    model = pm.base_model.model
    if not lora.experts:
        return model.get_submodule(key)
    path, _, name = key.rpartition(".")
    layer = model.get_submodule(path)
    while layer.parameter_name != name:
        layer = layer.base_layer
    return layer


def to_peft(lora: fa.LoRA) -> tuple[torch.Tensor, torch.Tensor]:
    """(lora_A, lora_B) in PEFT's layout."""
    if not lora.experts:
        return lora.A, lora.B
    E, r, k = lora.A.shape
    return lora.A.reshape(E * r, k), lora.B.permute(1, 2, 0).reshape(lora.B.shape[1], r * E)


def from_peft(A: torch.Tensor, B: torch.Tensor, like: fa.LoRA) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's (lora_A, lora_B) in fastaf's layout of ``like``."""
    if not like.experts:
        return A, B
    E, r, k = like.A.shape
    return A.reshape(E, r, k), B.reshape(B.shape[0], r, E).permute(2, 0, 1)


def peft_model_with(base, adapters: dict[str, fa.Adapter], targets, r_alpha):
    """A PEFT model built on a copy of ``base`` holding ``adapters`` with the same A/B values."""
    model = None
    for name, ad in adapters.items():
        r, alpha = r_alpha[name]
        cfg = peft_config(ad, r, alpha, targets)
        if model is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # GPT-2: "fan_in_fan_out set to True"
                model = peft.get_peft_model(copy.deepcopy(base), cfg, adapter_name=name)
        else:
            model.add_adapter(name, cfg)
        for path, lora in ad.items():
            layer = peft_layer(model, path, lora)
            A, B = to_peft(lora)
            with torch.no_grad():
                layer.lora_A[name].weight.copy_(A)
                layer.lora_B[name].weight.copy_(B)
    return model


def peft_grads(pm, adapter: fa.Adapter, name: str = "default") -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """key -> (dA, dB) of ``pm``'s adapter ``name`` after a backward, in fastaf's layout."""
    out = {}
    for key, lora in adapter.items():
        layer = peft_layer(pm, key, lora)
        # an unused layer (LLaVA's last vision layer, vision_feature_layer=-2) has no grad: zeros
        A, B = (f.weight.grad if f.weight.grad is not None else torch.zeros_like(f.weight)
                for f in (layer.lora_A[name], layer.lora_B[name]))
        out[key] = from_peft(A, B, lora)
    return out
