"""Siblings over one input (q/k/v, gate/up) as one autograd node: y_i = x @ W_iᵀ + b_i + s_i·(x @ A_iᵀ) @ B_iᵀ.

x (..., K); W_i (N_i, K); A_i (r_i, K); B_i (N_i, r_i). One launch computes h for every member
in one pass over x and each output in the GEMMs (``kernels.lora_group``); the backward reads x
once for every dA and sums dx inside the GEMMs. Eager plain autograd only (a
``_SingleLevelFunction``): the interception (``intercept.groups``) decides when members group.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor

from .._adapter import LoRA
from ..kernels import atomics_ok
from ._levels import _direct_level, _double_backward
from .lora_linear import _use_triton, reference_bwd
from .lora_siblings import _flat


# ---- 1. reference ----------------------------------------------------------------------------


def _reference_bwd(dys, x2, weights, a, b, scales, need_x):
    """The group's VJP from each sibling's reference (differentiable: create_graph)."""
    dx, das, dbs = None, [], []
    for dy, w, a_i, b_i, s in zip(dys, weights, a, b, scales):
        if dy is None:
            das.append(None)
            dbs.append(None)
            continue
        h = x2 @ a_i.to(x2.dtype).T  # recomputed with its history, as the single op's double backward does
        dx_i, da, db = (t[0] for t in reference_bwd(dy[None], x2[None], w[None], a_i[None], b_i[None], h[None], s,
                                                     0.0, None, need_x))
        dx = dx_i if dx is None else dx + dx_i
        das.append(da)
        dbs.append(db)
    return (dx if need_x else None), das, dbs


# ---- 2. the kernels (no registered op: eager plain autograd only) -----------------------------


def _group_kernels():
    from ..kernels import lora_group

    return lora_group


# ---- 3. the differentiable op ------------------------------------------------------------------


class _LoRAGroupDirect(torch.autograd.function._SingleLevelFunction):
    """Outputs y_1..y_n of n siblings over one x as one autograd node (plain eager autograd).

    Inputs after (n, scales, paths: the members' module paths, for errors, impl): x (..., K),
    then W_1..W_n, bias_1..bias_n (or None), A_1..A_n, B_1..B_n. The frozen weights and biases get
    no gradient (the caller groups only those). A differentiated backward (create_graph), or one
    under torch's deterministic mode turned on after the forward with impl "auto" (the kernels sum
    with atomics; a forced "triton" alerts), runs the reference's ops per sibling. A sibling whose output got no gradient gets none for its
    factors, as its own op would give.
    """

    @staticmethod
    def forward(ctx, n, scales, paths, impl, x, *tensors):
        weights, biases, a, b = tensors[:n], tensors[n:2 * n], tensors[2 * n:3 * n], tensors[3 * n:]
        x2 = _flat(x)  # (M, K)
        lead = x.shape[:-1] if x.dim() > 2 else ()
        ys, h = _group_kernels().group_fwd(x2, weights, biases, a, b, scales, lead=lead, graphed=True)
        ctx.save_for_backward(x, h, weights[0], *a, *b)  # not x2: a double backward's reshape must be in its graph
        # The followers' weights with their versions, not saved: a follower whose weight is written
        # before its own call (a pre-hook) computes alone, and this node's backward must not raise
        # for a weight it will not use. One whose output came from here must find it unchanged.
        ctx.followers = [(w, w._version) for w in weights[1:]]
        ctx.n, ctx.scales, ctx.paths, ctx.impl, ctx.x_shape = n, scales, paths, impl, x.shape
        ctx.set_materialize_grads(False)
        return tuple(ys)

    @staticmethod
    def backward(ctx, *dys):
        n = ctx.n
        x, h, first, *rest = ctx.saved_tensors
        x2 = _flat(x)
        a, b = rest[:n], rest[n:]
        weights = [first] + [w for w, _ in ctx.followers]
        for dy, (w, version), path in zip(dys[1:], ctx.followers, ctx.paths[1:]):
            if dy is not None and w._version != version:
                raise RuntimeError(
                    f"fastaf: {path}: its frozen weight {tuple(w.shape)} was modified by an inplace operation after "
                    f"its forward (version {version} then, {w._version} now); its gradient needs it"
                )
        need_x = ctx.needs_input_grad[4]
        dys2 = [None if d is None else d.reshape(-1, d.shape[-1]) for d in dys]
        kernels_ok = atomics_ok(ctx.impl, lambda: f"the grouped siblings' backward of {', '.join(ctx.paths)}")
        if not kernels_ok or _double_backward(0, *dys2):  # made at level 0, as _LoRALinearDirect's
            dx, das, dbs = _reference_bwd(dys2, x2, weights, a, b, ctx.scales, need_x)
        else:
            dx, das, dbs = _group_kernels().group_bwd(dys2, x2, weights, a, b, h, ctx.scales, need_x, graphed=True)
        if dx is not None:
            dx = dx.view(ctx.x_shape)
        needs = ctx.needs_input_grad[5 + 2 * n:]
        das = [d if need else None for d, need in zip(das, needs[:n])]
        dbs = [d if need else None for d, need in zip(dbs, needs[n:])]
        return (None, None, None, None, dx if need_x else None, *([None] * (2 * n)), *das, *dbs)


# ---- 4. public functions -----------------------------------------------------------------------


def group_kernels_apply(x: Tensor, weights: Sequence[Tensor], loras: Sequence[LoRA], impl: str) -> bool:
    """Whether the grouped kernels may run these siblings on ``x``: the Triton path chosen for
    ``impl`` and no functorch level among the tensors (checked before the members' own checks)."""
    if not _use_triton(impl, x):
        return False
    return not _direct_level(x, *weights, *(l.A for l in loras), *(l.B for l in loras))


def group_fits(x: Tensor, weights: Sequence[Tensor], loras: Sequence[LoRA], impl: str) -> bool:
    """Whether one grouped launch takes these siblings (shapes, ranks and shared memory)."""
    return _group_kernels().fits(_flat(x), list(weights), [l.rank for l in loras], impl)


def lora_group(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Optional[Tensor]], loras: Sequence[LoRA],
               paths: Sequence[str], impl: str) -> tuple[Tensor, ...]:
    """Every sibling's output, (..., N_i) each, as one autograd node (frozen weights and biases)."""
    return _LoRAGroupDirect.apply(len(loras), tuple(float(l.scale) for l in loras), tuple(paths), impl, x,
                                  *weights, *biases, *(l.A for l in loras), *(l.B for l in loras))
