"""Adapter folders in PEFT's layout (``peft_layout``): ``save_adapter`` writes them, ``read_adapter``
reads them, ``PeftModel.save_pretrained`` / ``from_pretrained`` interchange them.

Reading is strict where PEFT is lenient: an unknown key, a feature fastaf does not implement
(DoRA, LoRA biases, embeddings, modules_to_save, ...) or a key without the
``base_model.model.`` prefix is an error naming the file and the key, never dropped; so are
factors that the folder's config would not make PEFT create.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import math
import numbers
import os
import re
import struct
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save_file
from torch import nn

from .. import distributed
from ..functional import Adapter, LoRA, LoRAConfig, adapter_mode
from . import atomic
from .peft_layout import (_BASE_PARAMS, NAME_KEY, _NESTED, _PARAMS_KEY, _PREFIX, CONFIG_NAME, WEIGHTS_NAME,
                           _alpha_for, _in_layers, _parse_config, _pattern_key, _pattern_keys, _peft_scale,
                           _selected_by, _split_key, _targets_match)


# ---- save ---------------------------------------------------------------------------------------


def check_adapter_name(name: Any) -> None:
    """``name`` can name an adapter: the stateful layer's registry keys (an ``nn.ModuleDict``'s:
    non-empty, no '.', none of its own attribute names), which a file's recorded name becomes."""
    if not isinstance(name, str) or not name or "." in name:
        raise ValueError(f"adapter name must be a non-empty str without '.', got {name!r}")
    if hasattr(nn.ModuleDict(), name):  # ModuleDict would refuse its own attribute names
        raise ValueError(f"adapter name {name!r} is reserved (an nn.ModuleDict attribute); pick another")


def _check_savable(adapter: Adapter, config: LoRAConfig | None) -> float:
    """Validate ``adapter`` for the PEFT layout; returns its (single) dropout."""
    if not isinstance(adapter, Adapter):
        raise TypeError(f"save_adapter needs a fastaf.Adapter, got {type(adapter).__name__}")
    if len(adapter) == 0:
        raise ValueError("save_adapter: the adapter is empty; nothing to save")
    if config is not None and not isinstance(config, LoRAConfig):
        raise TypeError(f"save_adapter: config must be a fastaf.LoRAConfig, got {type(config).__name__}")
    for path, lora in adapter.items():
        if lora.stacked:
            raise ValueError(
                f"save_adapter: {path}: stacked LoRA A {tuple(lora.A.shape)}; PEFT's layout holds one "
                "adapter per file: save each of fastaf.unstack(adapter) separately"
            )
        meta = next((n for n, t in (("A", lora.A), ("B", lora.B)) if t.is_meta), None)
        if meta is not None:
            raise ValueError(f"save_adapter: {path}: factor {meta} {tuple(getattr(lora, meta).shape)} is on the meta "
                             "device and has no values to write; materialise the adapter first (to_empty, or an "
                             "init on a real device)")
        if not math.isfinite(lora.scale):
            raise ValueError(f"save_adapter: {path}: scale {lora.scale} is not finite")
        if config is not None and not _targets_match(config.targets, path):
            raise ValueError(
                f"save_adapter: {path} is not selected by config.targets={config.targets!r}; "
                "PEFT would not create its layer and would drop its weights"
            )
    dropouts: dict[float, list[str]] = {}  # dropout -> the paths that have it
    for path, lora in adapter.items():
        dropouts.setdefault(lora.dropout, []).append(path)
    if len(dropouts) > 1:
        # each value with its first few modules: enough to find the odd ones among hundreds
        where = "; ".join(f"{d} at {', '.join(paths[:3])}" + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
                          for d, paths in sorted(dropouts.items()))
        raise ValueError(f"save_adapter: PEFT stores one lora_dropout per adapter, got {sorted(dropouts)}: {where}")
    dropout = next(iter(dropouts))
    if config is not None and config.dropout != dropout:
        raise ValueError(f"save_adapter: config.dropout={config.dropout} but the adapter's LoRAs have {dropout}")
    return dropout


def _file_prefixes(adapter: Adapter, model: nn.Module | None) -> dict[str, str]:
    """Adapter key -> the module prefix of its factors' keys. An expert LoRA sits at its
    parameter's module, nested in one ``base_layer`` per later parameter of that module, as PEFT
    nests its ParamWrappers: in the module's parameter order, taken from ``model`` when given,
    else from the adapter's key order (init_adapter and read_adapter keep the model's; ``a + b``
    of one LoRA each need not, hence the warning)."""
    owners: dict[str, list[str]] = {}
    for key, lora in adapter.items():
        if lora.experts:
            owners.setdefault(key.rpartition(".")[0], []).append(key)
    if model is not None:
        owners = {owner: _in_parameter_order(model, owner, keys) for owner, keys in owners.items()}
    elif shared := [owner for owner, keys in owners.items() if len(keys) > 1]:
        names = ", ".join(k.rpartition(".")[2] for k in owners[shared[0]])
        more = f" (and {len(shared) - 1} more modules)" if len(shared) > 1 else ""
        warnings.warn(
            f"save_adapter: {shared[0]}{more} has LoRAs on several of its parameters ({names}); PEFT nests them "
            "in the module's parameter order, which without model= is taken to be the adapter's key order: pass "
            "save_adapter(..., model=model) so that PEFT loads each onto its own parameter", stacklevel=3)
    prefixes = {key: key for key, lora in adapter.items() if not lora.experts}
    for owner, keys in owners.items():
        for depth, key in enumerate(reversed(keys)):
            prefixes[key] = owner + _NESTED * depth
    return prefixes


def _in_parameter_order(model: nn.Module, owner: str, keys: list[str]) -> list[str]:
    """``keys`` (expert LoRAs of module ``owner``) in the order ``model``'s module registers their
    parameters; a key that names no parameter of it is an error."""
    try:
        module = model.get_submodule(owner)
    except AttributeError:
        raise ValueError(f"save_adapter: {keys[0]} is an expert LoRA, but model has no module {owner!r}") from None
    order = [name for name, _ in module.named_parameters(recurse=False)]
    missing = [k for k in keys if k.rpartition(".")[2] not in order]
    if missing:
        raise ValueError(f"save_adapter: {missing[0]} names no parameter of {owner} ({type(module).__name__}: "
                         f"{order})")
    return sorted(keys, key=lambda k: order.index(k.rpartition(".")[2]))


def _plain_number(value: float) -> float | int:
    """``value`` as the Python int or float that JSON writes (a numpy scalar is neither)."""
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def _peft_config(adapter: Adapter, config: LoRAConfig | None, dropout: float) -> dict[str, Any]:
    """The adapter_config.json contents: a LoraConfig that rebuilds every rank and scale."""
    rslora = config.rslora if config is not None else False
    ranks = {p: l.rank for p, l in adapter.items()}
    alphas = {p: _alpha_for(l.scale, l.rank, rslora) for p, l in adapter.items()}
    if config is not None:  # numpy numbers pass LoRAConfig's checks but not json.dumps
        r, alpha, targets = int(config.r), _plain_number(config.alpha), config.targets
    else:
        r = collections.Counter(ranks.values()).most_common(1)[0][0]
        alpha = collections.Counter(a for p, a in alphas.items() if ranks[p] == r).most_common(1)[0][0]
    if config is None or targets == "all-linear":
        # PEFT reads a str as a regex over whole module paths: the escaped paths select exactly
        # these modules, where bare last components ("head") could select others too. "all-linear"
        # is PEFT's own rule over the model it loads into (no output layer, for one): written as
        # it is, an adapter holding any other module (an lm_head from extract_adapter) lost it there
        targets = "|".join(re.escape(p) for p in adapter)
    params = [p for p, l in adapter.items() if l.experts]
    if params:
        # Full paths as lists: PEFT selects exactly these, and its transformers-5 conversion of
        # Mixtral-style configs (targets named w1/w3, "all-linear") leaves them alone.
        targets = [p for p, l in adapter.items() if not l.experts]
    keys = _pattern_keys(list(adapter))
    rank_pattern = {keys[p]: ranks[p] for p in adapter if ranks[p] != r}
    alpha_pattern = {
        keys[p]: alphas[p] for p, l in adapter.items() if _peft_scale(alpha, ranks[p], rslora) != l.scale
    }
    return {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": None,
        "revision": None,
        "inference_mode": True,
        "r": r,
        "lora_alpha": alpha,
        "target_modules": targets if isinstance(targets, str) else list(targets),
        "target_parameters": params or None,
        "lora_dropout": float(dropout),
        "use_rslora": rslora,
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "bias": "none",
        # PEFT sets fan_in_fan_out itself (with a warning) for GPT-2's Conv1D layers; the factors
        # are stored (r, in) / (out, r) either way.
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
    }


def save_adapter(
    adapter: Adapter,
    directory: str | os.PathLike,
    *,
    config: LoRAConfig | None = None,
    name: str | None = None,
    model: nn.Module | None = None,
) -> Path:
    """Write ``adapter`` in PEFT's layout, loadable by ``peft.PeftModel.from_pretrained``.

    Writes ``adapter_model.safetensors`` (each factor in its own dtype) and
    ``adapter_config.json`` as one unit (``atomic``): a reader sees the old pair or the
    new one, also when the process is killed mid-save; other files there are kept.

    Args:
        adapter: an unstacked Adapter; all LoRAs share one dropout (PEFT has one per adapter).
        directory: created if missing.
        config: the LoRAConfig the adapter was made with. It supplies ``target_modules``,
            ``use_rslora`` and the global ``r`` / ``lora_alpha``; without it the targets are the
            adapter's module paths (an exact regex), rsLoRA is off and the most common rank is the
            global one. An adapter with expert LoRAs always lists its module paths and its
            parameter names (``target_parameters``) in full. Ranks and scales that differ from
            the global go to ``rank_pattern`` / ``alpha_pattern``, so every LoRA's scale is
            reproduced.
        name: kept in the weights file's metadata; ``fastaf.load_adapter`` registers the
            adapter under it, so it must be a name the stateful layer takes (non-empty, no '.').
        model: the model the adapter is for. Only expert LoRAs need it: where one module has LoRAs
            on several parameters (Mixtral's ``gate_up_proj`` and ``down_proj``), PEFT nests them in
            the module's parameter order, which is read from ``model``; without it, from the
            adapter's key order (a warning says so).
    Returns:
        The directory. Under ``torch.distributed`` only rank 0 writes (every rank checks the
        adapter); other ranks that read the files next must first wait for it, e.g. with
        ``torch.distributed.barrier()``.
    """
    dropout = _check_savable(adapter, config)
    if name is not None:
        if not isinstance(name, str):
            raise TypeError(f"save_adapter: name must be a str, got {type(name).__name__}")
        try:
            check_adapter_name(name)  # load_adapter would refuse the file's name
        except ValueError as err:
            raise ValueError(f"save_adapter: {err}") from err
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"save_adapter: model must be an nn.Module, got {type(model).__name__}")
    peft_config = _peft_config(adapter, config, dropout)
    prefixes = _file_prefixes(adapter, model)
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(f"save_adapter: {directory} is a file; PEFT's layout is a directory of two files")
    if not distributed.is_writer():
        return directory
    tensors = {}
    for path, lora in adapter.items():
        A, B = lora.A.detach(), lora.B.detach()
        if lora.experts:  # PEFT's (E·r, in) and (out, r·E)
            E, rank, k = A.shape
            A, B = A.reshape(E * rank, k), B.permute(1, 2, 0).reshape(B.shape[1], rank * E)
        # copy=True: safetensors refuses tensors sharing storage (views from fastaf.unstack).
        tensors[f"{_PREFIX}{prefixes[path]}.lora_A.weight"] = A.to("cpu", copy=True).contiguous()
        tensors[f"{_PREFIX}{prefixes[path]}.lora_B.weight"] = B.to("cpu", copy=True).contiguous()
    metadata = {"format": "pt", **({NAME_KEY: name} if name is not None else {})}
    nested = {prefixes[p]: p for p, l in adapter.items() if l.experts}
    if nested:
        metadata[_PARAMS_KEY] = json.dumps(nested)
    config_text = json.dumps(peft_config, indent=2, sort_keys=True) + "\n"
    atomic.replace_files(directory, {
        WEIGHTS_NAME: lambda path: save_file(tensors, str(path), metadata=metadata),
        CONFIG_NAME: lambda path: path.write_text(config_text),
    })
    return directory


# ---- read ---------------------------------------------------------------------------------------


def _is_repo_id(text: str) -> bool:
    """``name`` or ``namespace/name`` as the hub spells repository ids."""
    return re.fullmatch(r"[\w.-]+(/[\w.-]+)?", text) is not None and not text.startswith((".", "-"))


def _looks_local(text: str) -> bool:
    """A path the user meant on this machine: ``./``, ``../``, ``~``, absolute, or one whose
    parent directory exists (``ckpt/sql`` beside an existing ``ckpt``). It never goes to the hub:
    a typo must not download a stranger's repository of that name."""
    path = Path(text).expanduser()
    if text in (".", "..") or text.startswith(("./", "../", ".\\", "..\\", "~")) or path.is_absolute():
        return True
    return len(path.parts) > 1 and path.parent.is_dir()


def _resolve(source: str | os.PathLike, revision: str | None, token: str | bool | None) -> Path:
    """A local directory holding the two files: ``source`` itself or a hub download."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"read_adapter: {str(path)!r} is a file; pass the directory that holds {CONFIG_NAME}")
    text = str(source)
    if isinstance(source, os.PathLike) or _looks_local(text) or not _is_repo_id(text):
        raise FileNotFoundError(f"read_adapter: no directory {str(path)!r} (a local path, so the hub was not asked)")
    from . import hub  # huggingface_hub costs ~0.3 s to import; only hub ids need it

    try:
        return hub.download_files(text, [CONFIG_NAME, WEIGHTS_NAME], revision=revision, token=token)
    except FileNotFoundError:
        raise
    except Exception as err:
        raise OSError(
            f"read_adapter: {text!r} is not a local directory, and downloading it from the hub "
            f"failed: {type(err).__name__}: {err}"
        ) from err


def _header_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file (8-byte little-endian header size, JSON header)."""
    (size,) = struct.unpack("<Q", data[:8])
    metadata = json.loads(data[8 : 8 + size]).get("__metadata__") or {}
    return metadata if isinstance(metadata, dict) else {}


def _parse_tensors(data: bytes | None, folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The weights file's tensors and its metadata."""
    file = folder / WEIGHTS_NAME
    if data is None:
        legacy = folder / "adapter_model.bin"
        hint = f"; found {legacy.name}, a pickle, which fastaf does not load" if legacy.exists() else ""
        raise FileNotFoundError(f"read_adapter: {file} is missing{hint}")
    try:
        return load(data), _header_metadata(data)
    except (SafetensorError, OSError, ValueError, RuntimeError, struct.error) as err:
        raise ValueError(
            f"read_adapter: {file} is not a readable safetensors file (truncated or corrupted?): {err}"
        ) from err


def _pair_factors(tensors: Mapping[str, torch.Tensor], file: Path) -> dict[str, dict[str, torch.Tensor]]:
    """{path: {"A": tensor, "B": tensor}}, with both factors present for every path."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key in sorted(tensors):  # sorted: the first bad key named is the same on every run
        tensor = tensors[key]
        path, factor = _split_key(key, file)
        pairs.setdefault(path, {})[factor] = tensor
    for path, pair in pairs.items():
        if len(pair) != 2:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise ValueError(f"read_adapter: {file}: {path} has no {missing}.weight ({_PREFIX}{path}.{missing}.weight)")
    if not pairs:
        raise ValueError(f"read_adapter: {file} holds no LoRA factors")
    return pairs


def _targeted_names(owner: str, names: list[str], *, bare: bool = True) -> list[str]:
    """The parameter names of module ``owner`` that PEFT's ``target_parameters`` entries select
    (``<owner>.<name>`` equal to an entry or ending in ``"." + entry``), in entry order;
    ``bare=False`` leaves out entries that name no module (``"down_proj"``)."""
    out = []
    for entry in names:
        entry_owner, _, name = entry.rpartition(".")
        if (bare and not entry_owner) or (entry_owner and (owner == entry_owner or owner.endswith("." + entry_owner))):
            out.append(name)
    return list(dict.fromkeys(out))


def _check_selected(paths: list[str], cfg: Mapping[str, Any], file: Path) -> None:
    """Every module LoRA in the file is one PEFT would create from the config: where
    ``target_modules`` does not select a path (or ``exclude_modules`` or ``layers_to_transform``
    leave it out), PEFT drops its factors without a word, and fastaf reading them would disagree
    with it on one file. ("all-linear" and a missing ``target_modules`` depend on the model: not
    checked here.) PEFT's order: an exclusion first; a str target is a regex over the whole path;
    a list entry equal to the path selects it, one it ends in selects it within the layers."""
    targets, excluded = cfg.get("target_modules"), cfg.get("exclude_modules")
    for path in paths:
        if excluded and _selected_by(excluded, path):
            selected = False
        elif targets in (None, "all-linear") or isinstance(targets, str):
            selected = targets in (None, "all-linear") or _selected_by(targets, path)
        else:
            selected = path in targets or (_selected_by(targets, path) and _in_layers(cfg, path))
        if not selected:
            raise ValueError(
                f"read_adapter: {file}: {path} has LoRA factors, but target_modules={targets!r}"
                + "".join(f" with {field}={cfg[field]!r}" for field in ("exclude_modules", "layers_to_transform",
                                                                        "layers_pattern") if cfg.get(field))
                + " does not select it: PEFT would not create its layer and would drop them. Fix the config "
                "or the weights file"
            )


def _holds_parameter(owner: str, cfg: Mapping[str, Any], modules: Mapping[str, nn.Module]) -> bool:
    """Whether a LoRA at ``owner`` (not nested) adapts one of its parameters rather than the module."""
    names = cfg["target_parameters"]
    if modules:
        module = modules.get(owner)
        return module is not None and any(n in _targeted_names(owner, names) for n in module._parameters)
    if _targeted_names(owner, names, bare=False):
        return True
    # an entry that names no module ("down_proj") could be any module's: target_modules decides
    targets = cfg.get("target_modules")
    if not _targeted_names(owner, names) or targets in (None, "all-linear"):
        return False
    return not _selected_by(targets, owner)


def _parameter_keys(prefixes: list[str], cfg: Mapping[str, Any], metadata: Mapping[str, str],
                    model: nn.Module | None, file: Path) -> dict[str, str]:
    """Key prefix -> parameter name, for the prefixes holding an expert LoRA (PEFT's ParamWrapper).

    A prefix is ``<module>`` plus one ``.base_layer`` per wrapper outside it; which parameter each
    depth holds follows the module's parameter order (the last targeted one outermost). The
    file's own record says it (fastaf's files), else the model, else a module with a single
    targeted parameter.
    """
    if not cfg.get("target_parameters"):
        return {}
    names = cfg["target_parameters"]
    recorded = json.loads(metadata.get(_PARAMS_KEY) or "{}")
    modules = dict(model.named_modules()) if model is not None else {}
    depths: dict[str, dict[int, str]] = {}  # module -> depth -> prefix
    for prefix in prefixes:
        owner, depth = prefix, 0
        while owner.endswith(_NESTED):
            owner, depth = owner[: -len(_NESTED)], depth + 1
        if depth or prefix in recorded or _holds_parameter(owner, cfg, modules):
            depths.setdefault(owner, {})[depth] = prefix
    out = {}
    for owner, at in depths.items():
        if all(at[d] in recorded for d in at):
            out.update({at[d]: recorded[at[d]] for d in at})
            continue
        targeted = _targeted_names(owner, names)
        if owner in modules:
            own = [n for n in modules[owner]._parameters if n in targeted]
        elif model is not None:
            raise ValueError(f"read_adapter: {file}: {owner!r} (a parameter LoRA's module in the file) is not a "
                             f"module of {type(model).__name__}")
        elif len(targeted) == 1 and set(at) == {0}:
            own = targeted
        else:
            raise ValueError(
                f"read_adapter: {file}: module {owner!r} holds {len(at)} parameter LoRA(s) of target_parameters "
                f"{targeted}; which parameter each one adapts follows the module's parameter order: pass model="
            )
        if sorted(at) != list(range(len(own))):
            raise ValueError(
                f"read_adapter: {file}: module {owner!r} has parameter LoRAs at nesting depths {sorted(at)}, but "
                f"target_parameters select {len(own)} of its parameters ({own})"
            )
        out.update({at[d]: f"{owner}.{own[-1 - d]}" for d in at})
    return out


def _build_lora(path: str, A: torch.Tensor, B: torch.Tensor, cfg: Mapping[str, Any], file: Path, *,
                experts: bool = False) -> LoRA:
    """One LoRA, its rank checked against r / rank_pattern and its scale from PEFT's formula;
    ``experts``: PEFT's ParamWrapper factors, A (E·r, in) and B (out, r·E), for parameter ``path``."""
    where = f"read_adapter: {file}: {path}"
    for name, t in (("lora_A", A), ("lora_B", B)):
        if t.dim() != 2 or not t.is_floating_point():
            raise ValueError(f"{where}: {name} {tuple(t.shape)} {t.dtype} must be a 2-D float tensor")
    rank_pattern, alpha_pattern = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    rank_key, alpha_key = _pattern_key(rank_pattern, path), _pattern_key(alpha_pattern, path)
    r = rank_pattern[rank_key] if rank_key is not None else cfg["r"]
    alpha = alpha_pattern[alpha_key] if alpha_key is not None else cfg["lora_alpha"]
    E = A.shape[0] // r if experts else 1
    if E < 1 or A.shape[0] != E * r or B.shape[1] != E * r:
        source = f"rank_pattern[{rank_key!r}]" if rank_key is not None else "r"
        raise ValueError(
            f"{where}: lora_A {tuple(A.shape)} / lora_B {tuple(B.shape)} do not have rank {r} "
            + ("per expert (E·r rows of lora_A and columns of lora_B) " if experts else "")
            + f"({source} in {CONFIG_NAME})"
        )
    if A.dtype != B.dtype:
        raise ValueError(f"{where}: lora_A is {A.dtype} but lora_B is {B.dtype}")
    if experts:  # (E·r, in) -> (E, r, in); (out, r·E) -> (E, out, r)
        A, B = A.reshape(E, r, A.shape[1]), B.reshape(B.shape[0], r, E).permute(2, 0, 1).contiguous()
    scale = _peft_scale(alpha, r, bool(cfg.get("use_rslora", False)))
    try:
        return LoRA(A, B, scale, float(cfg.get("lora_dropout") or 0.0), experts)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: {err}") from err


def _check_base_weights(weights: Mapping[tuple[str, str], torch.Tensor], adapter: Adapter, model: nn.Module | None,
                        file: Path) -> None:
    """The base parameters a PEFT folder carries beside a targeted embedding layer's LoRA (its
    ``save_embedding_layers``: ``lm_head.base_layer.weight``, ``.bias``), by (path, name). fastaf
    adapts the model's own weights and never loads base ones: with ``model`` each must equal the
    model's (compared in the lower precision of the two), else the adapter was trained over other
    base weights (a resized or trained embedding); without it, a warning says they were not checked."""
    for (path, name), saved in weights.items():
        what = f"{path}.{name} {tuple(saved.shape)}"
        if path not in adapter:
            raise ValueError(
                f"read_adapter: {file}: holds the base parameter {what} without a LoRA at {path} (a trained "
                "or resized module), which fastaf does not load"
            )
        if model is None:
            warnings.warn(
                f"read_adapter: {file} also holds the base parameter {what}, as PEFT saves a targeted embedding "
                "layer's; fastaf keeps the model's own. Pass model= to check they are equal", stacklevel=4)
            continue
        own = getattr(dict(model.named_modules()).get(path), name, None)
        low = None if own is None else saved.dtype if saved.element_size() <= own.element_size() else own.dtype
        if own is None or saved.shape != own.shape or not torch.equal(saved.to(own.device, low), own.detach().to(low)):
            raise ValueError(
                f"read_adapter: {file}: its base parameter {what} differs from the model's "
                f"{None if own is None else tuple(own.shape)}: the adapter was trained over other base weights (a "
                "resized or trained embedding). fastaf adapts the model's own frozen weights: load those into the "
                "model first"
            )


def _natural_key(path: str) -> list[Any]:
    """Sort key putting ``layers.2`` before ``layers.10`` (model order for numbered layers)."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in path.split(".")]


def _in_model_order(adapter: Adapter, model: nn.Module) -> Adapter:
    """``adapter``'s keys in ``model``'s order, as ``init_adapter`` makes them (an Adapter's pytree
    structure holds its key order: a re-read adapter must tree_map with the one that was saved).
    A module, then its own parameters (expert LoRAs' keys), module by module; keys the model lacks
    go last (the check after names them)."""
    rank: dict[str, int] = {}
    for path, module in model.named_modules():
        rank[path] = len(rank)
        for name in module._parameters:
            rank[f"{path}.{name}" if path else name] = len(rank)
    ordered = sorted(adapter, key=lambda key: rank.get(key, len(rank)))  # stable: the file's order among the rest
    return Adapter({key: adapter[key] for key in ordered})


def _place(adapter: Adapter, model: nn.Module | None, device: torch.device | str | None) -> Adapter:
    """Move the factors to ``device``, or to each module's weight device when a model is given."""
    if device is not None:
        return adapter.map(lambda p, l: dataclasses.replace(l, A=l.A.to(device), B=l.B.to(device)))
    if model is None:
        return adapter
    modules, params = dict(model.named_modules()), dict(model.named_parameters())

    def to_module(path: str, lora: LoRA) -> LoRA:
        weight = params.get(path) if lora.experts else getattr(modules.get(path), "weight", None)
        if not isinstance(weight, torch.Tensor):
            return lora  # adapter_mode below names the bad path
        return dataclasses.replace(lora, A=lora.A.to(weight.device), B=lora.B.to(weight.device))

    return adapter.map(to_module)


def read_adapter(
    dir_or_repo_id: str | os.PathLike,
    *,
    model: nn.Module | None = None,
    device: torch.device | str | None = None,
    revision: str | None = None,
    token: str | bool | None = None,
) -> Adapter:
    """Read a PEFT LoRA adapter (what ``save_pretrained`` or ``fastaf.save_adapter`` wrote).

    Ranks come from the tensors and must agree with ``r`` / ``rank_pattern``; each scale is
    PEFT's ``lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``), ``alpha_pattern`` included;
    ``lora_dropout`` becomes every LoRA's dropout. Factors keep the file's dtype.

    Args:
        dir_or_repo_id: a local directory, or a hub repository id (``"user/name"``) downloaded
            with huggingface_hub (its cache, ``HF_ENDPOINT`` and token apply).
        model: when given, every path must be a linear module of ``model`` with matching
            in/out features (checked now, not at the first call), the factors go to each
            module's weight device, and the keys come in the model's order, as
            ``init_adapter`` makes them (without it, numbered layers in order, each layer's
            modules by name).
        device: where to put the factors (overrides the model's devices); default CPU.
        revision: hub branch, tag or commit (hub ids only).
        token: hub token (hub ids only).
    Raises:
        FileNotFoundError: no such directory, or a file of the pair is missing.
        ValueError: corrupted or truncated safetensors, invalid config, unsupported PEFT
            features, keys that are not LoRA factors, ranks that disagree with the config, or
            (with ``model``) paths and shapes that do not fit the model.
    """
    return read_adapter_and_name(dir_or_repo_id, model=model, device=device, revision=revision, token=token)[0]


def read_adapter_and_name(
    dir_or_repo_id: str | os.PathLike,
    *,
    model: nn.Module | None = None,
    device: torch.device | str | None = None,
    revision: str | None = None,
    token: str | bool | None = None,
) -> tuple[Adapter, str | None]:
    """``read_adapter``, and the name ``save_adapter`` recorded (None for files without one)."""
    folder = _resolve(dir_or_repo_id, revision, token)
    files = atomic.read_files(folder, [CONFIG_NAME, WEIGHTS_NAME])  # one consistent pair
    cfg = _parse_config(files[CONFIG_NAME], folder / CONFIG_NAME)
    tensors, metadata = _parse_tensors(files[WEIGHTS_NAME], folder)
    file = folder / WEIGHTS_NAME
    base_weights = {(key[len(_PREFIX):].rpartition(".base_layer.")[0], key.rpartition(".")[2]): tensors.pop(key)
                    for key in list(tensors) if key.startswith(_PREFIX) and key.endswith(_BASE_PARAMS)}
    pairs = _pair_factors(tensors, file)
    params = _parameter_keys(list(pairs), cfg, metadata, model, file)
    _check_selected([p for p in pairs if p not in params], cfg, file)
    # numbered layers in order; a module's nested parameter LoRAs innermost (registered first) first
    prefixes = sorted(pairs, key=lambda p: (_natural_key(p.split(_NESTED)[0]), -p.count(_NESTED)))
    adapter = Adapter({
        params.get(p, p): _build_lora(params.get(p, p), pairs[p]["A"], pairs[p]["B"], cfg, file, experts=p in params)
        for p in prefixes
    })
    if model is not None:
        adapter = _in_model_order(adapter, model)
    adapter = _place(adapter, model, device)
    if model is not None:
        try:
            adapter_mode(model, adapter)  # validates paths, layer types, shapes and devices; changes nothing
        except ValueError as err:
            raise ValueError(f"read_adapter: {file} does not fit {type(model).__name__}: {err}") from err
    _check_base_weights(base_weights, adapter, model, file)
    name = metadata.get(NAME_KEY)
    return adapter, name if isinstance(name, str) and name else None
