"""Merging and adapter arithmetic as pure functions: ``merge``, ``merge_into``, ``extract_adapter``.

Everything happens in ΔW space, per module path. A LoRA's delta is ``ΔW = scale · B @ A`` with
A (r, in) and B (out, r); n adapters with weights w_i give task deltas ``w_i · ΔW_i`` (out, in).

- ``linear``: Σ w_i ΔW_i. The low-rank family is closed under weighted sums, so this is exact
  (rank concatenation) unless ``r`` asks for a truncated SVD.
- ``cat``: Σ w_i ΔW_i as rank concatenation, always exact: A = [A_1; ...; A_n] (Σr_i, in),
  B = [w_1 s_1 B_1 | ... | w_n s_n B_n] (out, Σr_i).
- ``svd``: Σ w_i ΔW_i re-factored to rank r by truncated SVD (exact when r >= Σ r_i). The sum is
  never formed: QR of the concatenated factors leaves an (Σr_i, Σr_i) core to decompose.
- ``ties`` (Yadav et al. 2023): trim each ΔW_i to its ``density`` fraction of largest-magnitude
  entries, elect a sign per entry from the sum of the trimmed ΔW_i, then average w_i ΔW_i over
  the tasks that agree with it (a disjoint mean).
- ``dare_linear`` / ``dare_ties`` (Yu et al. 2023): keep each entry of every ΔW_i with
  probability ``density`` and rescale by 1/density, then sum (linear) or elect and average (ties).
- ``magnitude_prune``: trim as in ``ties``, then Σ w_i ΔW_i.

The last four leave the low-rank family; they form the dense (out, in) result and re-factor it
to rank r by truncated SVD. Sign election uses the unweighted trimmed deltas and the weights
enter the disjoint mean, as in PEFT's ``ties``; where PEFT combines A and B separately (its
``linear``, ``ties`` and ``dare_*``), fastaf does not: its results are the ΔW-space ones.

Merged LoRAs carry scale 1.0 and dropout 0.0. Factors from an SVD split the singular values
evenly, B = U·sqrt(S) and A = sqrt(S)·Vᵀ, so neither factor dwarfs the other. An expert LoRA
(A (E, r, in), a targeted parameter) is merged expert by expert, each as above.
"""
from __future__ import annotations

import math
import numbers
import sys
import time
import warnings
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .._adapter import Adapter, LoRA, as_scalar, layout_mismatch
from .._layouts import LinearSpec, ParamSpec, fold_param, linear_spec, param_spec, selects

METHODS = ("linear", "cat", "svd", "ties", "dare_linear", "dare_ties", "magnitude_prune")
_DENSE = frozenset({"ties", "dare_linear", "dare_ties", "magnitude_prune"})  # need `density`
_RANDOM = frozenset({"dare_linear", "dare_ties"})  # draw masks, take `seed`
_AUTO_VERBOSE_PATHS = 32  # above this many modules, progress goes to stderr unless verbose=False


# ---- merge -------------------------------------------------------------------------------------


def merge(
    adapters: Sequence[Adapter],
    weights: Sequence[float] | None = None,
    *,
    method: str = "linear",
    r: int | None = None,
    density: float | None = None,
    seed: int | None = None,
    verbose: bool | None = None,
) -> Adapter:
    """Merge n adapters into one, per module path, in ΔW space (see the module docstring).

    Args:
        adapters: unstacked Adapters. A path missing from some adapters counts as ΔW = 0 there.
        weights: one real number per adapter, multiplying its delta; None means 1.0 each
            (a plain sum for ``linear``/``cat``/``svd``).
        method: one of ``METHODS``.
        r: output rank. Not allowed with ``cat`` (its rank is Σ r_i). With ``linear``, None keeps
            the exact concatenated factors and an int truncates by SVD. For the other methods it
            defaults to Σ r_i at each path (``svd`` is then exact). Capped at min(out, in); an
            SVD result of lower rank is zero-padded, so each path gets exactly that rank.
        density: fraction of entries kept, in (0, 1]; required by ``ties``, ``dare_*`` and
            ``magnitude_prune``, refused by the others.
        seed: seeds the ``dare_*`` keep masks (refused by the other methods). Each path draws
            from its own generator, seeded from ``seed`` and the path, on the adapters' device:
            a merge is reproducible on one device type, but CPU and CUDA draw different masks.
            None draws from torch's global RNG.
        verbose: progress lines on stderr; None prints them when there are more than 32 paths.

    Returns:
        A new Adapter with LoRA(A (r', in), B (out, r'), scale=1.0, dropout=0.0) per path, on the
        adapters' device, in the promoted dtype of their factors.
    """
    adapters = _check_adapters(adapters)
    weights = _check_weights(weights, len(adapters))
    r, density, seed = _check_options(method, r, density, seed)
    terms = _terms_by_path(adapters, weights)
    progress = _Progress("fastaf.merge", len(terms), verbose)
    merged = {}
    for path, path_terms in terms.items():
        merged[path] = _merge_path(path, path_terms, method, r, density, seed)
        progress.step()
    return Adapter(merged)


def _check_adapters(adapters: Any) -> list[Adapter]:
    if isinstance(adapters, Adapter) or not isinstance(adapters, Sequence):
        raise TypeError(
            f"fastaf.merge takes a list of Adapters, got {type(adapters).__name__}"
            + (" (wrap a single adapter in a list)" if isinstance(adapters, Adapter) else "")
        )
    if not adapters:
        raise ValueError("fastaf.merge needs at least one adapter")
    for i, ad in enumerate(adapters):
        if not isinstance(ad, Adapter):
            raise TypeError(f"fastaf.merge: item {i} is {type(ad).__name__}, not fastaf.Adapter")
        _check_unstacked(ad, f"fastaf.merge: adapter {i}")
    return list(adapters)


def _check_unstacked(adapter: Adapter, where: str) -> None:
    for path, lora in adapter.items():
        if lora.stacked:
            raise ValueError(
                f"{where} at {path!r} is stacked (A {tuple(lora.A.shape)}); merge unstacked "
                "adapters (fastaf.unstack)"
            )


def _check_weights(weights: Sequence[Any] | None, n: int) -> list[float]:
    if weights is None:
        return [1.0] * n
    weights = [as_scalar(w) for w in weights]
    if len(weights) != n:
        raise ValueError(f"fastaf.merge: {len(weights)} weights for {n} adapters")
    if not all(math.isfinite(w) for w in weights):
        raise ValueError(f"fastaf.merge: weights must be finite, got {weights}")
    return weights


def _as_int(value: Any) -> int | None:
    """A Python int for an integer (numpy's and 0-d integer tensors' too), None for anything else
    (a bool, a float)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point() \
            and value.dtype != torch.bool:
        return int(value)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    return None


def _check_options(method: str, r: Any, density: Any, seed: Any) -> tuple[int | None, float | None, int | None]:
    """(r, density, seed) checked and as Python numbers: numpy scalars and 0-d tensors are taken
    as the merge weights are; a bool is no number here."""
    if method not in METHODS:
        raise ValueError(f"fastaf.merge: unknown method {method!r}; choose one of {list(METHODS)}")
    if r is not None:
        given, r = r, _as_int(r)
        if r is None or r < 1:
            raise ValueError(f"fastaf.merge: r must be an int >= 1 or None, got {given!r}")
    if method == "cat" and r is not None:
        raise ValueError("fastaf.merge: method='cat' is exact and its rank is the sum of the ranks; "
                         "use method='svd' to choose r")
    if method in _DENSE:
        if density is None:
            raise ValueError(f"fastaf.merge: method={method!r} needs density in (0, 1]")
        try:
            is_bool = isinstance(density, torch.Tensor) and density.dtype == torch.bool
            value = math.nan if is_bool else as_scalar(density)
        except (TypeError, ValueError):
            value = math.nan
        if not 0.0 < value <= 1.0:
            raise ValueError(f"fastaf.merge: density must be in (0, 1], got {density!r}")
        density = value
    elif density is not None:
        raise ValueError(f"fastaf.merge: method={method!r} takes no density (got {density})")
    if seed is not None:
        if method not in _RANDOM:
            raise ValueError(f"fastaf.merge: seed only applies to dare_linear/dare_ties, not {method!r}")
        given, seed = seed, _as_int(seed)
        if seed is None:
            raise TypeError(f"fastaf.merge: seed must be an int, got {type(given).__name__}")
    return r, density, seed


def _terms_by_path(adapters: list[Adapter], weights: list[float]) -> dict[str, list[tuple[float, LoRA]]]:
    """path -> [(w_i, LoRA_i)] for the adapters that have the path; checked before any math."""
    paths = dict.fromkeys(p for ad in adapters for p in ad)
    terms = {p: [(w, ad[p]) for ad, w in zip(adapters, weights) if p in ad] for p in paths}
    for path, path_terms in terms.items():
        first = path_terms[0][1]
        for _, lora in path_terms[1:]:
            if why := layout_mismatch(lora, first):
                raise ValueError(
                    f"{path}: cannot merge A {tuple(lora.A.shape)}/B {tuple(lora.B.shape)} with "
                    f"A {tuple(first.A.shape)}/B {tuple(first.B.shape)}: {why}"
                )
            if lora.A.device != first.A.device:
                raise ValueError(f"{path}: adapters to merge are on {first.A.device} and {lora.A.device}")
    return terms


def _merge_path(
    path: str, terms: list[tuple[float, LoRA]], method: str, r: int | None, density: float | None,
    seed: int | None,
) -> LoRA:
    first = terms[0][1]
    generator = _path_generator(seed, path, first.A.device) if method in _RANDOM else None
    if not first.experts:
        return _merge_terms(terms, method, r, density, generator)
    per_expert = [
        _merge_terms([(w, LoRA(l.A[e], l.B[e], l.scale)) for w, l in terms], method, r, density, generator)
        for e in range(first.num_experts)
    ]
    return LoRA(torch.stack([l.A for l in per_expert]), torch.stack([l.B for l in per_expert]), 1.0, 0.0, True)


def _merge_terms(
    terms: list[tuple[float, LoRA]], method: str, r: int | None, density: float | None,
    generator: torch.Generator | None,
) -> LoRA:
    """One 2-D LoRA merged from ``terms`` (see ``merge``)."""
    out_dtype = _promoted_dtype(l.A.dtype for _, l in terms)
    work = _work_dtype(out_dtype)
    A_cat, B_cat = _weighted_concat(terms, work)  # (R, in), (out, R); B_cat @ A_cat = Σ w_i ΔW_i
    if method == "cat" or (method == "linear" and r is None):
        A, B = A_cat, B_cat
    else:
        rank = r if r is not None else A_cat.shape[0]
        if method in ("linear", "svd"):
            A, B = _factor_low_rank(B_cat, A_cat, rank)
        else:
            deltas = torch.stack([l.scale * (l.B.to(work) @ l.A.to(work)) for _, l in terms])
            w = torch.tensor([w for w, _ in terms], dtype=work, device=deltas.device)
            dense = _combine_dense(method, deltas, w, density, generator)  # (out, in)
            A, B = _factor_dense(dense, rank)
    return LoRA(A.to(out_dtype), B.to(out_dtype), 1.0, 0.0)


def _promoted_dtype(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    dtypes = list(dtypes)
    out = dtypes[0]
    for dt in dtypes[1:]:
        out = torch.promote_types(out, dt)
    return out


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for the decompositions (fp16/bf16 SVD is unsupported or too coarse), fp64 kept."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _weighted_concat(terms: list[tuple[float, LoRA]], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """A (Σr_i, in) and B (out, Σr_i) with B @ A = Σ w_i · scale_i · B_i @ A_i exactly."""
    A = torch.cat([l.A.to(dtype) for _, l in terms], dim=0)
    B = torch.cat([(w * l.scale) * l.B.to(dtype) for w, l in terms], dim=1)
    return A, B


# ---- dense combinations (ties, dare, magnitude pruning), per path -------------------------------


def _combine_dense(
    method: str, deltas: Tensor, weights: Tensor, density: float, generator: torch.Generator | None
) -> Tensor:
    """Combine task deltas (n, out, in) with weights (n,) into one (out, in).

    Trimming and dropping act on each unweighted delta; the TIES sign is elected from the
    unweighted survivors and the weights enter the sum or the disjoint mean.
    """
    if method in _RANDOM:
        deltas = _drop_and_rescale(deltas, density, generator)
    else:
        deltas = torch.stack([_keep_largest(d, density) for d in deltas])
    weighted = deltas * weights[:, None, None]
    if method in ("ties", "dare_ties"):
        return _disjoint_mean(weighted, _agreement(deltas))
    return weighted.sum(dim=0)


def _keep_largest(delta: Tensor, density: float) -> Tensor:
    """Zero all but the int(density · numel) entries of largest magnitude (ties by index order)."""
    k = int(density * delta.numel())
    if k >= delta.numel():
        return delta
    flat = delta.reshape(-1)
    keep = torch.zeros_like(flat, dtype=torch.bool)
    keep[torch.topk(flat.abs(), k, sorted=False).indices] = True
    return (flat * keep).reshape(delta.shape)


def _drop_and_rescale(deltas: Tensor, density: float, generator: torch.Generator | None) -> Tensor:
    """DARE: keep each entry with probability ``density`` and divide by it (E[result] = deltas)."""
    keep = torch.rand(deltas.shape, generator=generator, device=deltas.device) < density
    return deltas * keep / density


def _agreement(deltas: Tensor) -> Tensor:
    """TIES sign election on (n, out, in): True where a task's entry has the elected sign.

    The elected sign of an entry is the sign of its sum over tasks (+ on a tie). Zeros (trimmed
    or dropped) never agree, so they do not dilute the disjoint mean.
    """
    elected = torch.where(deltas.sum(dim=0) >= 0, 1.0, -1.0).to(deltas.dtype)  # (out, in)
    return deltas.sign() == elected  # (n, out, in)


def _disjoint_mean(weighted: Tensor, agree: Tensor) -> Tensor:
    """Mean over the agreeing tasks: (n, out, in), (n, out, in) bool -> (out, in)."""
    return (weighted * agree).sum(dim=0) / agree.sum(dim=0).clamp_min(1)


def _path_generator(seed: int | None, path: str, device: torch.device) -> torch.Generator | None:
    """A generator for one path's masks, so a path's draws do not depend on the other paths."""
    if seed is None:
        return None
    mixed = (seed * 0x9E3779B1 + zlib.crc32(path.encode())) % (2**63)
    return torch.Generator(device=device).manual_seed(mixed)


# ---- truncated SVD into LoRA factors ----------------------------------------------------------


def _factor_dense(delta: Tensor, r: int) -> tuple[Tensor, Tensor]:
    """Best rank-r factors of ``delta`` (out, in): A (r', in), B (out, r'), r' = min(r, out, in)."""
    U, S, Vh = torch.linalg.svd(delta, full_matrices=False)  # (out, k), (k,), (k, in)
    return _split_singular_values(U, S, Vh, min(r, *delta.shape))


def _factor_low_rank(B: Tensor, A: Tensor, r: int) -> tuple[Tensor, Tensor]:
    """Best rank-r factors of B @ A, B (out, R), A (R, in), without forming the (out, in) product.

    B = Qb Rb and Aᵀ = Qa Ra (reduced QR) give B @ A = Qb (Rb Raᵀ) Qaᵀ: only the small core needs
    an SVD, and its singular values are those of B @ A.
    """
    Qb, Rb = torch.linalg.qr(B)  # (out, kb), (kb, R)
    Qa, Ra = torch.linalg.qr(A.T)  # (in, ka), (ka, R)
    U, S, Vh = torch.linalg.svd(Rb @ Ra.T, full_matrices=False)  # core (kb, ka)
    return _split_singular_values(Qb @ U, S, Vh @ Qa.T, min(r, B.shape[0], A.shape[1]))


def _split_singular_values(U: Tensor, S: Tensor, Vh: Tensor, r: int) -> tuple[Tensor, Tensor]:
    """A = sqrt(S)·Vᵀ (r, in) and B = U·sqrt(S) (out, r), zero-padded to r if fewer components."""
    k = min(r, S.shape[0])
    root = S[:k].sqrt()
    A = root[:, None] * Vh[:k]  # (k, in)
    B = U[:, :k] * root  # (out, k)
    if k < r:  # zero rows of A / columns of B add nothing to B @ A
        A = torch.cat([A, A.new_zeros(r - k, A.shape[1])])
        B = torch.cat([B, B.new_zeros(B.shape[0], r - k)], dim=1)
    return A, B


# ---- merge_into: fold an adapter into base weights ---------------------------------------------


def merge_into(
    model_or_params: nn.Module | Mapping[str, Tensor],
    adapter: Adapter | Sequence[Adapter],
    *,
    model: nn.Module | None = None,
) -> dict[str, Tensor]:
    """Base parameters with every adapted weight replaced by W + scale·B@A (new tensors); a
    parameter's expert LoRA adds scale·B_e@A_e to each expert e (transposed where it is stored so).

    ``functional_call(model, None, args, params=merge_into(model, adapter))`` then equals
    ``functional_call(model, adapter, args)`` with no LoRA work left at inference.

    Args:
        model_or_params: a module (its ``named_parameters()``) or a name -> tensor mapping, with
            each adapted weight under ``"<path>.weight"`` (an expert LoRA's under its own key).
            An adapted ``lm_head`` tied to the input embedding gets W + ΔW under its own name,
            beside the embedding's W, as PEFT adapts it alone (``functional_call`` unties them).
        adapter: an Adapter, or a list of Adapters summed exactly (as ``functional_call`` does).
        model: with a mapping, the module whose layers say how weights are laid out (GPT-2's
            Conv1D stores W as (in, out) and gets (scale·B@A)ᵀ; experts that set ``is_transposed``
            store (E, in, out)). Without it every weight is taken as nn.Linear's (out, in), or
            (E, out, in), and one that only fits the other layout is refused; a square one
            cannot be told apart, so pass ``model`` for GPT-2-style models.

    Returns:
        A new dict with the same keys. Adapted entries are new tensors in the weight's dtype and
        device (the delta is formed and added in fp32, then cast); the others are the input
        tensors themselves, not copies. Neither the model nor the mapping is changed. The result
        is differentiable in the adapter's factors.
    """
    if not isinstance(model_or_params, (nn.Module, Mapping)):
        raise TypeError(
            "merge_into takes an nn.Module or a name -> tensor mapping, "
            f"got {type(model_or_params).__name__}"
        )
    adapter = _sum_adapters(adapter)
    if isinstance(model_or_params, nn.Module):
        model = model if model is not None else model_or_params
        params = dict(model_or_params.named_parameters())
        # a tied weight is listed once (the embedding's): an adapted tied lm_head gets its own
        # name for its W + ΔW, as PEFT adapts it alone (an unadapted alias would split the tie's
        # gradient under torch.func)
        aliases = dict(model_or_params.named_parameters(remove_duplicate=False))
        for path, lora in adapter.items():
            name = _param_name(path, lora)
            if name not in params and name in aliases:
                params[name] = aliases[name]
    else:
        params = dict(model_or_params)
    modules = dict(model.named_modules()) if model is not None else None
    layouts = {path: _check_fit(path, lora, params, modules) for path, lora in adapter.items()}
    if modules is None:
        square = [p for p, l in adapter.items() if not l.experts and l.in_features == l.out_features]
        # GPT-2's square c_proj merged as nn.Linear's was 0.55 logits off, without a word (not
        # while tracing: dynamo cannot trace a warning, and fullgraph would fail on it)
        if square and not torch.compiler.is_compiling():
            warnings.warn(
                f"merge_into: no model= to tell how {len(square)} square weight(s) are laid out ({square[0]!r}, "
                "...): each is taken as nn.Linear's (out, in); for a Conv1D (GPT-2) weight, stored (in, out), that "
                "adds ΔW where ΔWᵀ belongs. Pass model= to have the layout read from the model", stacklevel=2)
    for path, lora in adapter.items():  # every path was checked first: nothing is half-merged
        name = _param_name(path, lora)
        params[name] = _fold(params[name], lora, layouts[path])
    return params


def _sum_adapters(adapter: Any) -> Adapter:
    if isinstance(adapter, Adapter):
        total = adapter
    elif isinstance(adapter, Sequence) and adapter and all(isinstance(a, Adapter) for a in adapter):
        total = adapter[0]
        for a in adapter[1:]:
            total = total + a  # exact: rank concatenation
    else:
        raise TypeError(
            f"merge_into: adapter must be a fastaf.Adapter or a list of them, got {type(adapter).__name__}"
        )
    _check_unstacked(total, "merge_into: the adapter")
    return total


def _layouts(model: nn.Module) -> dict[str, LinearSpec | None]:
    """Module path -> LinearSpec (None for a module fastaf cannot adapt)."""
    return {path: linear_spec(m) for path, m in model.named_modules()}


def _param_name(path: str, lora: LoRA) -> str:
    """The parameter an adapter key adapts: the key itself for an expert LoRA, its module's weight else."""
    return path if lora.experts else f"{path}.weight"


def _check_fit(
    path: str, lora: LoRA, params: Mapping[str, Tensor], modules: Mapping[str, nn.Module] | None
) -> bool | ParamSpec:
    """Check that ``path``'s weight exists and fits ``lora``: True when a linear weight is stored
    (in, out), False when (out, in), a ParamSpec for an expert LoRA's parameter."""
    name = _param_name(path, lora)
    weight = params.get(name)
    if weight is None:
        leaf = path.rsplit(".", 1)[-1]
        close = [k for k in params if leaf in k][:3]
        raise ValueError(f"merge_into: no parameter {name!r} for adapter path {path!r}"
                         + (f" (similar: {close})" if close else ""))
    if not weight.is_floating_point():
        raise TypeError(
            f"merge_into: {name} {tuple(weight.shape)} has dtype {weight.dtype}; expected a float weight. A "
            "quantized layer's packed weight (bitsandbytes Linear4bit, Linear8bitLt, GPTQ, AWQ) cannot take W + ΔW: "
            "keep the adapter beside the model (functional_call, fastaf.init), or merge into the base loaded in "
            "bf16 or fp16"
        )
    if lora.A.is_meta and not weight.is_meta:  # no values to add (torch's "Cannot copy out of meta tensor")
        raise ValueError(f"merge_into: {path}: LoRA A {tuple(lora.A.shape)} is on meta (no values) but {name} is "
                         f"on {weight.device}; load or initialise the adapter first")
    if lora.experts:
        return _check_param_fit(name, lora, weight, modules)
    out_in, in_out = (lora.out_features, lora.in_features), (lora.in_features, lora.out_features)
    if modules is not None:
        spec = linear_spec(modules[path]) if path in modules else None
        if spec is None:
            raise ValueError(f"merge_into: adapter path {path!r} is not a linear layer of the model")
        transposed = spec.transposed
    elif tuple(weight.shape) == in_out != out_in:
        # Probably a Conv1D weight; refuse rather than guess, since a square one could not be told.
        raise ValueError(
            f"merge_into: {name} is {tuple(weight.shape)} ({weight.dtype}), which fits LoRA "
            f"A {tuple(lora.A.shape)}/B {tuple(lora.B.shape)} only as an (in, out) Conv1D weight; "
            "pass model= so the layout is known rather than guessed"
        )
    else:
        transposed = False
    expected = in_out if transposed else out_in
    if tuple(weight.shape) != expected:
        raise ValueError(
            f"merge_into: {name} is {tuple(weight.shape)} ({weight.dtype}) but LoRA "
            f"A {tuple(lora.A.shape)}/B {tuple(lora.B.shape)} needs {expected}"
        )
    return transposed


def _check_param_fit(name: str, lora: LoRA, weight: Tensor, modules: Mapping[str, nn.Module] | None) -> ParamSpec:
    """The layout of the parameter ``name`` an expert LoRA adds to; read from its module when known."""
    E, k, n = lora.num_experts, lora.in_features, lora.out_features
    if weight.dim() not in (2, 3):
        raise ValueError(f"merge_into: {name} is {tuple(weight.shape)} ({weight.dtype}); an expert LoRA adds to a 2-D or 3-D parameter")
    if modules is not None:
        owner, _, attr = name.rpartition(".")
        spec = param_spec(modules[owner], attr) if owner in modules else None
        if spec is None:
            raise ValueError(f"merge_into: {name!r} (an expert LoRA's key) is not a 2-D or 3-D parameter of the model")
    elif weight.dim() == 2:
        spec = ParamSpec(1, weight.shape[1], weight.shape[0], transposed=False, ndim=2)
    elif weight.dim() == 3 and tuple(weight.shape) == (E, k, n) != (E, n, k):
        raise ValueError(
            f"merge_into: {name} is {tuple(weight.shape)} ({weight.dtype}), which fits expert LoRA "
            f"A {tuple(lora.A.shape)}/B {tuple(lora.B.shape)} only as transposed (E, in, out) experts; "
            "pass model= so the layout is known rather than guessed"
        )
    else:
        spec = ParamSpec(weight.shape[0], weight.shape[-1], weight.shape[-2], transposed=False, ndim=weight.dim())
    if (spec.num_experts, spec.in_features, spec.out_features) != (E, k, n) or weight.dim() != spec.ndim:
        raise ValueError(
            f"merge_into: {name} is {tuple(weight.shape)} ({weight.dtype}) but expert LoRA "
            f"A {tuple(lora.A.shape)}/B {tuple(lora.B.shape)} needs {E} expert(s) of {k} -> {n}"
        )
    return spec


def _fold(weight: Tensor, lora: LoRA, layout: bool | ParamSpec) -> Tensor:
    """weight + scale·B@A (transposed for an (in, out) weight, per expert for a ParamSpec),
    formed in fp32, cast back."""
    work = _work_dtype(weight.dtype)
    A = lora.A.to(device=weight.device, dtype=work)
    B = lora.B.to(device=weight.device, dtype=work)
    if isinstance(layout, ParamSpec):
        return fold_param(weight.to(work), LoRA(A, B, lora.scale, 0.0, True), layout).to(weight.dtype)
    transposed = layout
    delta = lora.scale * (B @ A)  # (out, in)
    if transposed:
        delta = delta.T
    return (weight.to(work) + delta).to(weight.dtype)


# ---- extract_adapter: a full fine-tune's deltas as a LoRA adapter -------------------------------


def extract_adapter(
    base_params: nn.Module | Mapping[str, Tensor],
    tuned_params: nn.Module | Mapping[str, Tensor],
    r: int,
    *,
    model: nn.Module | None = None,
    names: Sequence[str] | None = None,
    verbose: bool | None = None,
) -> Adapter:
    """An Adapter whose deltas are the rank-r truncated SVDs of ``tuned - base``, per linear layer.

    Every 2-D float ``"<path>.weight"`` that differs between the two becomes a LoRA at ``path``
    (rank min(r, out, in), scale 1.0, fp32 factors — fp64 for fp64 weights — on the tuned
    weight's device). Biases, norms and other non-matrix changes are left out: a LoRA cannot
    carry them.

    Args:
        base_params: the base model or its name -> tensor mapping.
        tuned_params: the fine-tuned model or its mapping (same names and shapes).
        r: the rank, >= 1.
        model: the module that says each weight's layout; defaults to ``base_params`` or
            ``tuned_params``, whichever is a module. With it, only layers fastaf can adapt
            (nn.Linear, Conv1D) are extracted and Conv1D's (in, out) weights are transposed.
            Without it every differing matrix is taken as an (out, in) linear weight,
            embeddings included.
        names: module names to extract, matched like ``LoRAConfig.targets`` (a path equal to an
            entry or ending in "." + entry); None takes every differing weight.
        verbose: progress on stderr; None prints it when there are more than 32 layers.
    """
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"extract_adapter: r must be an int >= 1, got {r!r}")
    if model is None:
        model = next((m for m in (base_params, tuned_params) if isinstance(m, nn.Module)), None)
    base, tuned = _as_params(base_params, "base_params"), _as_params(tuned_params, "tuned_params")
    layouts = _layouts(model) if model is not None else None
    paths = _changed_paths(base, tuned, layouts, names)
    progress = _Progress("fastaf.extract_adapter", len(paths), verbose)
    loras = {}
    for path, transposed in paths.items():
        name = f"{path}.weight"
        work = _work_dtype(torch.promote_types(base[name].dtype, tuned[name].dtype))
        delta = tuned[name].to(work) - base[name].to(device=tuned[name].device, dtype=work)
        A, B = _factor_dense(delta.T if transposed else delta, r)
        loras[path] = LoRA(A, B, 1.0, 0.0)
        progress.step()
    return Adapter(loras)


def _as_params(params: nn.Module | Mapping[str, Tensor], what: str) -> dict[str, Tensor]:
    """A module's parameters by every name, a tied one's under each (a changed tied lm_head is
    extracted whether the tuned model comes as a module or as merge_into's mapping, which gives an
    adapted lm_head its own name; the embedding's side of the tie is no linear layer)."""
    if isinstance(params, nn.Module):
        return dict(params.named_parameters(remove_duplicate=False))
    if isinstance(params, Mapping):
        return dict(params)
    raise TypeError(f"extract_adapter: {what} must be an nn.Module or a name -> tensor mapping, "
                    f"got {type(params).__name__}")


def _changed_paths(
    base: Mapping[str, Tensor], tuned: Mapping[str, Tensor],
    layouts: Mapping[str, LinearSpec | None] | None, names: Sequence[str] | None,
) -> dict[str, bool]:
    """Paths whose weight differs -> whether it is stored (in, out); validated before any SVD."""
    if isinstance(names, str):
        names = [names]
    selected: dict[str, bool] = {}
    matched: set[str] = set()
    for name, weight in tuned.items():
        if not name.endswith(".weight") or weight.dim() != 2 or not weight.is_floating_point():
            continue
        path = name[: -len(".weight")]
        hits = [n for n in names if selects(n, path)] if names is not None else []
        if names is not None and not hits:
            continue
        if layouts is not None and layouts.get(path) is None:
            if hits:
                raise ValueError(
                    f"extract_adapter: {path!r} (matched by {hits}) is not a linear layer of the model"
                )
            continue
        matched.update(hits)
        ref = base.get(name)
        if ref is None:
            raise ValueError(
                f"extract_adapter: {name!r} {tuple(weight.shape)} is in tuned_params but not in base_params"
            )
        if ref.shape != weight.shape:
            raise ValueError(
                f"extract_adapter: {name} is {tuple(ref.shape)} ({ref.dtype}) in base_params but "
                f"{tuple(weight.shape)} ({weight.dtype}) in tuned_params"
            )
        if not torch.equal(ref.to(device=weight.device, dtype=weight.dtype), weight):
            selected[path] = layouts is not None and layouts[path].transposed
    if names is not None and (unmatched := [n for n in names if n not in matched]):
        raise ValueError(f"extract_adapter: names {unmatched} match no 2-D linear weight of tuned_params")
    return selected


# ---- progress ---------------------------------------------------------------------------------


class _Progress:
    """About ten plain progress lines on stderr for long per-module loops (no tqdm dependency)."""

    def __init__(self, what: str, total: int, verbose: bool | None) -> None:
        self.what, self.total, self.done = what, total, 0
        self.on = verbose if verbose is not None else total > _AUTO_VERBOSE_PATHS
        self.every = max(1, total // 10)
        self.start = time.perf_counter()

    def step(self) -> None:
        self.done += 1
        if self.on and (self.done % self.every == 0 or self.done == self.total):
            elapsed = time.perf_counter() - self.start
            print(f"{self.what}: {self.done}/{self.total} modules, {elapsed:.1f} s", file=sys.stderr, flush=True)
