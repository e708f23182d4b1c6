"""Stacking adapters along a leading axis, for ``torch.func.vmap`` and multi-adapter serving.

``stack([a1, ..., an])`` gives every LoRA factors A (n, r_max, in) and B (n, out, r_max). It is
exact for adapters of different ranks and scales: smaller ranks are zero-padded (zero rows of A
and columns of B add nothing to B @ A), and when scales differ each slot's ratio to the largest
scale is folded into its B so that the stack shares that scale. A path missing from some
adapters gets zero factors in those slots, which is the exact delta of "no LoRA there". An expert LoRA (A (E, r, in)) stacks
the same way, to A (n, E, r_max, in) and B (n, E, out, r_max).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

from ._adapter import Adapter, LoRA, _common_scale, _folded_B, layout_mismatch


def stack(adapters: Sequence[Adapter]) -> Adapter:
    """Stack n adapters into one whose factors carry a leading axis of size n.

    Args:
        adapters: unstacked Adapters; a path's LoRAs must agree in in/out features, expert count
            and dropout.
    Returns:
        Adapter with A (n, r_max, in) and B (n, out, r_max) per path (A (n, E, r_max, in) and
        B (n, E, out, r_max) for expert LoRAs).

    Training the stack's own tensors: where a path's scales differ, a slot's B is stored times
    its ratio ρ (at most 1) to the stack's scale, so its gradient is the adapter's own B gradient
    over ρ: an SGD step moves that adapter's B 1/ρ² as far as training it alone, an Adam step
    1/ρ. The forward and every ΔW are exact, and so are the gradients that reach each adapter's
    own factors through a stack made again each step. Give the adapters one scale to train the
    stack's tensors as they train alone.
    """
    if isinstance(adapters, Mapping):  # an Adapter, or a dict of named ones: list() would walk the keys
        hint = ("wrap a single adapter in a list" if isinstance(adapters, Adapter) else
                "pass its adapters as a list, list(adapters.values()), in the order adapter_ids will name them")
        raise TypeError(f"fastaf.stack takes a list of Adapters, got {type(adapters).__name__} ({hint})")
    adapters = list(adapters)
    if not adapters:
        raise ValueError("fastaf.stack needs at least one adapter")
    for i, ad in enumerate(adapters):
        if not isinstance(ad, Adapter):
            raise TypeError(f"fastaf.stack: item {i} is {type(ad).__name__}, not fastaf.Adapter")
        if any(l.stacked for l in ad.values()):
            raise ValueError(f"fastaf.stack: adapter {i} is already stacked")
    paths = list(dict.fromkeys(p for ad in adapters for p in ad))
    return Adapter({p: _stack_path(p, [ad.get(p) for ad in adapters]) for p in paths})


def _stack_path(path: str, loras: list[LoRA | None]) -> LoRA:
    present = [l for l in loras if l is not None]
    first = present[0]
    for l in present[1:]:
        if why := layout_mismatch(l, first):
            raise ValueError(
                f"{path}: cannot stack A {tuple(l.A.shape)}/B {tuple(l.B.shape)} with "
                f"A {tuple(first.A.shape)}/B {tuple(first.B.shape)}: {why}"
            )
        if l.dropout != first.dropout:
            raise ValueError(f"{path}: cannot stack LoRAs with dropout {first.dropout} and {l.dropout}")
        if l.A.device != first.A.device:
            raise ValueError(f"{path}: LoRAs to stack are on {first.A.device} and {l.A.device}")
    dtype = first.A.dtype
    for l in present[1:]:
        dtype = torch.promote_types(dtype, l.A.dtype)
    r_max = max(l.rank for l in present)
    scale = _common_scale(present)  # a scale folded in whole overflowed 16-bit factors
    lead = first.A.shape[:-2]  # (E,) for an expert LoRA
    A_slots, B_slots = [], []
    for l in loras:
        if l is None:
            A_slots.append(first.A.new_zeros((*lead, r_max, first.in_features), dtype=dtype))
            B_slots.append(first.B.new_zeros((*lead, first.out_features, r_max), dtype=dtype))
            continue
        pad = r_max - l.rank
        A_slots.append(F.pad(l.A.to(dtype), (0, 0, 0, pad)))  # (..., r_max, in)
        B_slots.append(F.pad(_folded_B(l, scale, dtype), (0, pad)))  # (..., out, r_max)
    return LoRA(torch.stack(A_slots), torch.stack(B_slots), scale, first.dropout, first.experts)


def unstack(stacked: Adapter) -> list[Adapter]:
    """Split a stacked Adapter back into n Adapters (ranks stay padded; deltas are exact)."""
    if not isinstance(stacked, Adapter) or not stacked.stacked:
        raise ValueError("fastaf.unstack needs an Adapter made by fastaf.stack (A and B with a leading stack axis)")
    sizes = {l.A.shape[0] for l in stacked.values()}
    if len(sizes) != 1:
        raise ValueError(f"fastaf.unstack: paths disagree on the stack size: {sorted(sizes)}")
    (n,) = sizes
    return [
        Adapter({p: LoRA(l.A[i], l.B[i], l.scale, l.dropout, l.experts) for p, l in stacked.items()})
        for i in range(n)
    ]
