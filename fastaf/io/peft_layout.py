"""PEFT's adapter folder layout: ``adapter_model.safetensors`` + ``adapter_config.json``.

A LoRA at module path ``p`` is stored as ``base_model.model.<p>.lora_A.weight`` (r, in) and
``base_model.model.<p>.lora_B.weight`` (out, r), which is what ``PeftModel.save_pretrained``
writes for the default adapter and what ``PeftModel.from_pretrained`` reads. The scale lives in
the config: PEFT computes ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``),
with per-module ``rank_pattern`` / ``alpha_pattern`` overrides whose keys are regexes matched
against the end of the module path (``re.match(rf"(.*\\.)?({key})$", path)``, first key wins).

An expert LoRA (a targeted parameter, keyed by its name) is PEFT's ``target_parameters`` layout
(its ``lora.ParamWrapper``): ``base_model.model.<module>.lora_A.weight`` (E·r, in), row e·r + j
holding A[e, j], and ``lora_B.weight`` (out, r·E), column j·E + e holding B[e, :, j], with the
parameter's name in the config's ``target_parameters``. Several parameters of one module nest,
the one registered first innermost: ``<module>.base_layer.lora_A.weight`` for the first of two.
PEFT's scale is per expert rank, ``lora_alpha / r``. The file's metadata names each nested
prefix's parameter (``fastaf.parameters``); PEFT's own files need the model to say it.

Here: the file and key names, how PEFT turns ``r`` / ``lora_alpha`` / the patterns into each
layer's scale, which modules its config selects, and the checks of a config and of a key. What
reads and writes the files (``save_adapter``, ``read_adapter``) is ``io``.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .._layouts import selects

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
_PREFIX = "base_model.model."
NAME_KEY = "fastaf.name"  # safetensors metadata: the adapter's name (PEFT ignores metadata)
_PARAMS_KEY = "fastaf.parameters"  # metadata: JSON {key prefix: parameter name} of expert LoRAs
_NESTED = ".base_layer"  # PEFT's prefix step for each ParamWrapper a parameter's LoRA sits inside
_FACTOR_SUFFIXES = {".lora_A.weight": "A", ".lora_B.weight": "B"}

# PEFT's save_embedding_layers: with an embedding layer targeted (lm_head), its base weight
# (and bias) too
_BASE_PARAMS = (".base_layer.weight", ".base_layer.bias")

# Key fragments of PEFT features that change what the adapter computes; fastaf has none of them.
_UNSUPPORTED_KEYS = {
    "lora_magnitude_vector": "DoRA magnitudes (use_dora)",
    "lora_embedding_A": "a LoRA on an embedding layer",
    "lora_embedding_B": "a LoRA on an embedding layer",
    "modules_to_save": "a fully trained module copy (modules_to_save)",
    "lora_B.bias": "a LoRA bias (lora_bias)",
    "trainable_tokens": "trainable token embeddings (trainable_token_indices)",
}

# Config fields that, when set, change the forward pass or the layout; fastaf supports none.
# Initialisation-only fields (init_lora_weights, loftq/eva/corda/lora_ga configs) are ignored,
# but for the inits below.
_UNSUPPORTED_CONFIG = {
    "use_dora": "DoRA",
    "lora_bias": "LoRA biases",
    "modules_to_save": "modules_to_save",
    "trainable_token_indices": "trainable tokens",
    "layer_replication": "layer replication",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
    "use_qalora": "QALoRA",
    "use_bdlora": "block-diagonal LoRA",
    "arrow_config": "Arrow routing",
    "monteclora_config": "MonteCLoRA",
    "kasa_config": "KaSA",
    "velora_config": "VeLoRA",
    "megatron_config": "Megatron parallel layers",
}

# init_lora_weights values (prefixes) whose init also rewrites the base weight, W - s·B0@A0 (PiSSA,
# CorDA, OLoRA, LoRA-GA) or a quantized W (LoftQ), which PEFT redoes at every load: the factors were
# trained on that weight, not the model's own, so fastaf would apply them to the wrong one.
_BASE_CHANGING_INITS = ("pissa", "corda", "olora", "loftq", "lora_ga")


# ---- scale <-> (r, lora_alpha) ----------------------------------------------------------------


def _peft_scale(alpha: float, r: int, rslora: bool) -> float:
    """PEFT's ``scaling`` for one layer, computed exactly as its LoraLayer.update_layer does."""
    return alpha / math.sqrt(r) if rslora else alpha / r


def _alpha_for(scale: float, r: int, rslora: bool) -> float | int:
    """A ``lora_alpha`` from which PEFT computes exactly ``scale``.

    ``scale * r`` can be one ulp off after PEFT divides again, so the neighbouring floats are
    tried too; if none divides back exactly, the nearest (within an ulp) is kept.
    """
    scale = float(scale)  # a numpy scalar's arithmetic stays numpy, which json.dumps refuses
    alpha = scale * (math.sqrt(r) if rslora else r)
    candidates = [alpha]
    lo = hi = alpha
    for _ in range(4):
        lo, hi = math.nextafter(lo, -math.inf), math.nextafter(hi, math.inf)
        candidates += [lo, hi]
    exact = next((a for a in candidates if _peft_scale(a, r, rslora) == scale), alpha)
    return int(exact) if float(exact).is_integer() and abs(exact) < 2**53 else exact


# ---- rank_pattern / alpha_pattern keys ---------------------------------------------------------


def _pattern_key(patterns: Mapping[str, Any], path: str) -> str | None:
    """The key of ``patterns`` PEFT applies to ``path`` (its ``get_pattern_key``), or None."""
    return next((k for k in patterns if re.match(rf"(.*\.)?({k})$", path)), None)


def _pattern_keys(paths: list[str]) -> dict[str, str]:
    """A pattern key per path that, under PEFT's matching, selects that path and no other.

    The plain path (what PEFT itself writes) when it is unambiguous among ``paths``; otherwise
    the escaped path anchored at the start.
    """
    keys = {}
    for p in paths:
        plain_ok = re.escape(p) == p.replace(".", r"\.") and not any(
            q != p and re.match(rf"(.*\.)?({p})$", q) for q in paths
        )
        keys[p] = p if plain_ok else "^" + re.escape(p)
    return keys


# ---- which modules a config selects -------------------------------------------------------------


def _selected_by(entries: Any, path: str) -> bool:
    """PEFT's test of ``target_modules`` / ``exclude_modules`` against a module path: a str is a
    regex over the whole path, a list holds paths or their last components."""
    if isinstance(entries, str):
        return re.fullmatch(entries, path) is not None
    return any(selects(t, path) for t in entries or ())


def _targets_match(targets: str | tuple[str, ...], path: str) -> bool:
    """Whether PEFT's ``target_modules`` selects ``path`` ("all-linear" cannot be checked here)."""
    return targets == "all-linear" or _selected_by(targets, path)


def _in_layers(cfg: Mapping[str, Any], path: str) -> bool:
    """PEFT's ``layers_to_transform`` filter of a path a ``target_modules`` list entry ends: its
    first numbered segment after ``layers_pattern`` (any name when none) is one of the layers."""
    layers, patterns = cfg.get("layers_to_transform"), cfg.get("layers_pattern")
    if layers is None or layers == []:
        return True
    if not patterns:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", path)
    else:
        match = None
        for pattern in [patterns] if isinstance(patterns, str) else patterns:
            match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", path)
            if match is not None:
                break
    if match is None:
        return False
    index = int(match["idx"])
    return index == layers if isinstance(layers, int) else index in layers


# ---- checks of a config and of a key ------------------------------------------------------------


def _number(cfg: Mapping[str, Any], field: str, file: Path, *, integer: bool = False) -> float:
    value = cfg.get(field)
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if not ok or isinstance(value, bool) or not math.isfinite(value):
        kind = "an int" if integer else "a finite number"
        raise ValueError(f"read_adapter: {file}: {field} must be {kind}, got {value!r}")
    return value


def _check_patterns(cfg: Mapping[str, Any], field: str, file: Path, *, integer: bool) -> None:
    """``rank_pattern`` / ``alpha_pattern``: {regex: rank or alpha} (or null)."""
    patterns = cfg.get(field) or {}
    if not isinstance(patterns, dict):
        raise ValueError(f"read_adapter: {file}: {field} must be a JSON object of regex -> value, got {patterns!r}")
    for key in patterns:
        try:
            re.compile(key)
        except re.error as err:
            raise ValueError(f"read_adapter: {file}: {field} key {key!r} is not a valid regex: {err}") from None
        _number(patterns, key, file, integer=integer)
        if integer and patterns[key] < 1:
            raise ValueError(f"read_adapter: {file}: {field}[{key!r}] must be >= 1, got {patterns[key]}")


def _parse_config(text: bytes | None, file: Path) -> dict[str, Any]:
    """adapter_config.json as a dict, checked to describe a plain LoRA with sane values."""
    if text is None:
        trainer = (file.parent / "model.safetensors").exists()  # a Trainer checkpoint of a fa.init model
        hint = ("; this folder holds a whole model (model.safetensors: a Trainer checkpoint, every adapter of a "
                "fastaf.init model inside): resume it with Trainer(resume_from_checkpoint=...), or write an adapter "
                "folder with fastaf.save_adapter_to_local_dir") if trainer else ""
        raise FileNotFoundError(f"read_adapter: {file} is missing; a PEFT adapter folder needs {CONFIG_NAME}{hint}")
    try:
        cfg = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"read_adapter: {file} is not valid JSON: {err}") from err
    if not isinstance(cfg, dict):
        raise ValueError(f"read_adapter: {file} must hold a JSON object, got {type(cfg).__name__}")
    if cfg.get("peft_type") != "LORA":
        raise ValueError(f"read_adapter: {file}: peft_type is {cfg.get('peft_type')!r}; fastaf reads LORA only")
    for field, what in _UNSUPPORTED_CONFIG.items():
        if cfg.get(field):
            raise ValueError(
                f"read_adapter: {file}: {field}={cfg[field]!r} ({what}) is not supported by fastaf; "
                "refusing to load the adapter without it"
            )
    init = cfg.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        fix = ("LoftQ's quantized weight has no plain-LoRA form (PEFT converts PiSSA, CorDA, OLoRA and LoRA-GA only)"
               if init.lower() == "loftq" else "convert the adapter to a plain LoRA first with PEFT: "
               "model.save_pretrained(dir, path_initial_model_for_weight_conversion=...)")
        raise ValueError(
            f"read_adapter: {file}: init_lora_weights={init!r} trained the factors on a base weight that PEFT "
            "rewrites at load (W minus the initial B @ A, or a quantized W); fastaf adapts the model's own weight, "
            f"so the result would be wrong: {fix}"
        )
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"read_adapter: {file}: bias={cfg['bias']!r} (trained base biases) is not supported")
    if _number(cfg, "r", file, integer=True) < 1:
        raise ValueError(f"read_adapter: {file}: r must be >= 1, got {cfg['r']}")
    _number(cfg, "lora_alpha", file)
    # PEFT would take the string "false" as true: only a JSON boolean is read
    if not isinstance(cfg.get("use_rslora", False), bool):
        raise ValueError(f"read_adapter: {file}: use_rslora must be true or false, got {cfg['use_rslora']!r}")
    if cfg.get("lora_dropout") is not None and not 0.0 <= _number(cfg, "lora_dropout", file) < 1.0:
        raise ValueError(f"read_adapter: {file}: lora_dropout must be in [0, 1), got {cfg['lora_dropout']}")
    _check_patterns(cfg, "rank_pattern", file, integer=True)
    _check_patterns(cfg, "alpha_pattern", file, integer=False)
    names = cfg.get("target_parameters") or []
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"read_adapter: {file}: target_parameters must be a list of parameter names, got {names!r}")
    return cfg


def _split_key(key: str, file: Path) -> tuple[str, str]:
    """``base_model.model.<path>.lora_A.weight`` -> (path, "A"); any other key is an error."""
    if not key.startswith(_PREFIX):
        raise ValueError(
            f"read_adapter: {file}: key {key!r} lacks the {_PREFIX!r} prefix (PEFT would skip it "
            "with only a warning, leaving that layer unadapted)"
        )
    for suffix, factor in _FACTOR_SUFFIXES.items():
        if key.endswith(suffix) and len(key) > len(_PREFIX) + len(suffix):
            return key[len(_PREFIX) : -len(suffix)], factor
    what = next((w for frag, w in _UNSUPPORTED_KEYS.items() if frag in key), None)
    why = f"holds {what}, which fastaf does not support" if what else "is not a LoRA factor"
    raise ValueError(f"read_adapter: {file}: key {key!r} {why} (expected *.lora_A.weight / *.lora_B.weight)")
