"""Sibling projections that read one input (q/k/v, gate/up): their h in one pass over x.

For siblings i = 1..n over the same x (M, K), each with its own W_i, A_i (r_i, K), B_i, s_i:

    [h_1 .. h_n] = x @ [A_1; ..; A_n].T       one pass over x for all i          ``shared_h``
    y_i = x @ W_i.T + bias_i + s_i * h_i @ B_i.T                                  ``lora_linear_given_h``

and in backward

    dh_i = s_i * dy_i @ B_i,  dB_i = s_i * dy_i.T @ h_i,  dx_i = dy_i @ W_i + dh_i @ A_i   (given_h)
    [dA_1 .. dA_n] = [dh_1 .. dh_n].T @ x     one pass over x for all i          (shared_h)

where ``lora_linear`` per sibling reads x twice more (h in forward, dA in backward) for each
extra sibling. The VJP is split across the two ops: ``given_h`` returns dB_i and dh_i, and
``shared_h`` the A gradients. x's gradient comes one of two ways. Given the siblings' weights
(``shared_h_fanned``), ``shared_h`` also hands each sibling a token t_i (M, N_i), a zero-stride
view; ``given_h`` returns dy_i as t_i's gradient instead of a dx of its own, and ``shared_h``'s
backward, which autograd runs after every sibling's, makes

    dx = sum_i dy_i @ W_i + [dh_1 .. dh_n] @ [A_1; ..; A_n]    one GEMM launch, dx written once

(``lora_siblings_dx``), where per-sibling dx would take n GEMMs and a later pass to add them.
Without tokens ``given_h`` returns x's whole gradient through its sibling (dh_i @ A_i folded
into its dX GEMM, as ``lora_linear`` does). Summed over the graph either way is the exact VJP of
y_i(x, A_i, B_i). A differentiated backward (grad of grad, ``create_graph``) runs the
reference's ops, which record how each computed gradient depends on x and the factors, so higher
orders stay exact; there ``given_h`` returns its own dx.

Only ``functional_call`` uses these, for siblings it has seen take the same x object, outside
``torch.func.vmap`` and without LoRA dropout; the ops have no vmap rule for that reason.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .._adapter import LoRA
from .lora_linear import (_OP_DTYPES, _as_dtype, _autocast, _check, _kernels, _unflatten, _use_triton,
                           _vjp_weight_bias)
from ._levels import (_apply_single_level, _below, _differentiated, _direct_level, _direct_ok, _double_backward,
                      _higher_order_traced, level_left, level_token, note_factors, own_level, _traced_apply,
                      _vmapped_traced, wrap_for_grad)

# ---- 1. reference ------------------------------------------------------------------------------


def reference_given_h_fwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], h: Tensor, b: Tensor,
                          scale: float) -> Tensor:
    """y (M, N) = x @ weight.T + bias + scale * h @ b.T; x (M, K), h (M, R), b (N, R) in any float dtype."""
    return F.linear(x, weight, bias) + scale * (h @ _as_dtype(b, x.dtype).T)


def reference_given_h_bwd(dy: Tensor, weight: Tensor, a: Tensor, b: Tensor, h: Tensor, scale: float,
                          needs_dx: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dx (M, K) or (0, 0), dh (M, R), dB (N, R) in b's dtype) of one sibling; dA is ``shared_h``'s."""
    b_dtype = b.dtype
    a, b = _as_dtype(a, dy.dtype), _as_dtype(b, dy.dtype)
    dh = scale * (dy @ b)
    db = scale * (dy.T @ h)
    dx = dy @ weight + dh @ a if needs_dx else dy.new_empty(0, 0)
    return dx, dh, _as_dtype(db, b_dtype)


def _recomputed_h(x2: Tensor, a: Tensor) -> Tensor:
    """h = x @ A.T again, for a differentiated backward: dB = s * dy.T @ h then depends on x and A
    in its own graph. The saved h cannot carry that: shared_h passes no gradient to x (given_h's
    dx carries the path through h, first order)."""
    return x2 @ _as_dtype(a, x2.dtype).T


def _da_dtype(x: Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)  # fp32, or fp64 on the reference


# ---- 2. torch.library ops ----------------------------------------------------------------------


def _shared_h_impl(x: Tensor, a: Tensor, n: int, r: int, impl: str) -> Tensor:
    """h (M, R) = x @ a.T in x's dtype; x (M, K), a (R, K) the siblings' A stacked on rank, in any
    float dtype. ``n``, ``r``: the first sibling's N and rank, for the dispatch choice."""
    if _use_triton(impl, x):
        return _kernels().shared_h(x, a, n, r, impl)
    return x @ _as_dtype(a, x.dtype).T


def _shared_da_impl(dh: Tensor, x: Tensor, n: int, r: int, impl: str) -> Tensor:
    """dA (R, K) = dh.T @ x in fp32 (fp64 for fp64 x); dh (M, R) contiguous."""
    if _use_triton(impl, x):
        return _as_dtype(_kernels().shared_da(dh, x, n, r, impl), torch.float32)
    return (dh.T @ x).to(_da_dtype(x))


def _given_h_fwd_impl(x: Tensor, weight: Tensor, bias: Optional[Tensor], h: Tensor, b: Tensor, scale: float,
                      impl: str) -> Tensor:
    if _use_triton(impl, x):
        return _kernels().given_h_fwd(x, weight, bias, h, b, scale, impl)
    return reference_given_h_fwd(x, weight, bias, h, b, scale)


def _given_h_bwd_impl(dy: Tensor, x: Tensor, weight: Tensor, a: Tensor, b: Tensor, h: Tensor, scale: float,
                      needs_dx: bool, impl: str) -> tuple[Tensor, Tensor, Tensor]:
    """(dx (M, K) or (0, 0), dh (M, R) in h's dtype, dB (N, R) in b's dtype)."""
    if _use_triton(impl, x):
        dx, dh, db = _kernels().given_h_bwd(dy, x, weight, a, b, h, scale, needs_dx, impl)
        return (dy.new_empty(0, 0) if dx is None else dx), _as_dtype(dh, h.dtype), _as_dtype(db, b.dtype)
    return reference_given_h_bwd(dy, weight, a, b, h, scale, needs_dx)


def _siblings_dx_impl(dys: list[Tensor], weights: list[Tensor], dh: Tensor, a: Tensor, n: int, r: int,
                      impl: str) -> Tensor:
    """dx (M, K) = sum_i dys[i] @ weights[i] + dh @ a in dys' dtype; dh (M, R), a (R, K) any float dtype."""
    if _use_triton(impl, dys[0]):
        return _kernels().siblings_dx(dys, weights, dh, a, n, r, impl)
    return _reference_siblings_dx(dys, weights, dh, a)


def _reference_siblings_dx(dys: Sequence[Tensor], weights: Sequence[Tensor], dh: Tensor, a: Tensor) -> Tensor:
    dtype = dys[0].dtype
    return sum(dy @ w for dy, w in zip(dys, weights)) + _as_dtype(dh, dtype) @ _as_dtype(a, dtype)


lora_shared_h = torch.library.custom_op("fastaf::lora_shared_h", mutates_args=())(_shared_h_impl)
lora_siblings_dx = torch.library.custom_op("fastaf::lora_siblings_dx", mutates_args=())(_siblings_dx_impl)
lora_shared_da = torch.library.custom_op("fastaf::lora_shared_da", mutates_args=())(_shared_da_impl)
lora_given_h_fwd = torch.library.custom_op("fastaf::lora_given_h_fwd", mutates_args=())(_given_h_fwd_impl)
lora_given_h_bwd = torch.library.custom_op("fastaf::lora_given_h_bwd", mutates_args=())(_given_h_bwd_impl)


@lora_shared_h.register_fake
def _(x, a, n, r, impl):
    return x.new_empty(x.shape[0], a.shape[0])


@lora_siblings_dx.register_fake
def _(dys, weights, dh, a, n, r, impl):
    return dys[0].new_empty(dys[0].shape[0], weights[0].shape[1])


@lora_shared_da.register_fake
def _(dh, x, n, r, impl):
    return x.new_empty(dh.shape[1], x.shape[1], dtype=_da_dtype(x))


@lora_given_h_fwd.register_fake
def _(x, weight, bias, h, b, scale, impl):
    return x.new_empty(x.shape[0], weight.shape[0])


@lora_given_h_bwd.register_fake
def _(dy, x, weight, a, b, h, scale, needs_dx, impl):
    dx = dy.new_empty(x.shape) if needs_dx else dy.new_empty(0, 0)
    return dx, h.new_empty(h.shape), b.new_empty(b.shape)


# ---- 3. the differentiable ops -----------------------------------------------------------------


def _flat(x: Tensor) -> Tensor:
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])


def _cat_grads(dhs: Sequence[Optional[Tensor]], ranks: Sequence[int], x: Tensor) -> Tensor:
    """[dh_1 .. dh_n] (M, R); a sibling whose h got no gradient contributes zeros."""
    return torch.cat([x.new_zeros(x.shape[0], r) if d is None else d for d, r in zip(dhs, ranks)], dim=1)


class _SharedHFn(torch.autograd.Function):
    """``shared_h``'s VJP for tracers (``torch.compile``) and grad of grad: dA for every sibling,
    and with ``weights`` (the siblings' W_i) a token per sibling and dx summed over them."""

    @staticmethod
    def forward(x, a, ranks, n, impl, *weights):  # x (M, K); a (R, K) the A factors stacked, any float dtype
        op = _shared_h_impl if _direct_ok(x, a) else torch.ops.fastaf.lora_shared_h
        hs = tuple(op(x, a, n, ranks[0], impl).split(ranks, dim=1))
        # t_i (M, N_i): no memory, no compute; its gradient carries dy_i here (module docstring)
        return hs + tuple(x.new_zeros(()).expand(x.shape[0], w.shape[0]) for w in weights)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, a, ranks, n, impl, *weights = inputs
        note_factors(a)
        ctx.own = own_level()
        ctx.save_for_backward(x, a if weights else None, *weights)
        ctx.n, ctx.impl, ctx.ranks, ctx.a_dtype = n, impl, ranks, a.dtype
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, *grads):
        x, a, *weights = ctx.saved_tensors
        dhs, dys = grads[:len(ctx.ranks)], grads[len(ctx.ranks):]
        dh = _cat_grads(dhs, ctx.ranks, x)
        # dh carries the factors' history (A is not saved)
        differentiated = _differentiated(dh, factors=(dh,), own=ctx.own)
        if differentiated:
            da = dh.T @ x
        else:
            op = _shared_da_impl if _direct_ok(dh, x) else torch.ops.fastaf.lora_shared_da
            with torch.no_grad():  # first order: a plain op call (see LoRALinearFn.backward)
                da = op(dh, x, ctx.n, ctx.ranks[0], ctx.impl)  # dh: torch.cat's, contiguous
        dx = None
        posted = [i for i, dy in enumerate(dys) if dy is not None]
        if posted and ctx.needs_input_grad[0]:
            # the dh @ A term of the siblings that posted dy_i (one that returned its own dx has it)
            dh_x = dh if len(posted) == len(ctx.ranks) else _cat_grads(
                [d if i in posted else None for i, d in enumerate(dhs)], ctx.ranks, x)
            dys_x, ws_x = [dys[i] for i in posted], [weights[i] for i in posted]
            if differentiated:
                dx = _reference_siblings_dx(dys_x, ws_x, dh_x, a)
            else:
                op = _siblings_dx_impl if _direct_ok(x, a, dh_x, *dys_x, *ws_x) else torch.ops.fastaf.lora_siblings_dx
                with torch.no_grad():
                    dx = op(dys_x, ws_x, dh_x, a, ctx.n, ctx.ranks[0], ctx.impl)
        return dx, _as_dtype(da, ctx.a_dtype), None, None, None, *(None for _ in weights)


class _SharedHDirect(torch.autograd.function._SingleLevelFunction):
    """``_SharedHFn`` for plain eager autograd and one ``torch.func.grad`` level (see
    ``_LoRALinearDirect``); A keeps its own dtype (cast inside, gradients cast back)."""

    @staticmethod
    def forward(ctx, level, n, impl, x, *a):
        with _below(level, x, *a) as (x, *a):
            x2 = _flat(x)
            ctx.dtypes, ctx.ranks = [t.dtype for t in a], [t.shape[0] for t in a]
            h = _shared_h_impl(x2, torch.cat(a), n, ctx.ranks[0], impl)
            hs = h.split(ctx.ranks, dim=1)
        ctx.save_for_backward(x)  # not x2: a double backward's reshape must be in its graph
        ctx.level, ctx.n, ctx.impl = level, n, impl
        ctx.token = level_token(level)
        ctx.set_materialize_grads(False)
        return tuple(wrap_for_grad(t, level) for t in hs) if level else hs

    @staticmethod
    def backward(ctx, *dhs):
        (x,) = ctx.saved_tensors
        if all(d is None for d in dhs):
            return (None,) * (4 + len(dhs))
        # differentiated when any sibling's dh carries history (another's may be a constant)
        left = level_left(ctx.level, ctx.token)  # a vjp_fn's backward after its level
        double = _double_backward(ctx.level, *dhs, left=left)
        with _below(ctx.level, *dhs, left=left) as dhs, (torch.enable_grad() if double else torch.no_grad()):
            x2 = _flat(x)
            dh = _cat_grads(dhs, ctx.ranks, x2)
            da = dh.T @ x2 if double else _shared_da_impl(dh, x2, ctx.n, ctx.ranks[0], ctx.impl)
            das = tuple(_as_dtype(d, t) for d, t in zip(da.split(ctx.ranks), ctx.dtypes))
        return (None, None, None, None, *das)


class _GivenHFn(torch.autograd.Function):
    """``lora_linear_given_h``'s VJP for tracers and grad of grad: dh, dB, and either dx or, given
    ``shared_h``'s token for this sibling, dy_i as the token's gradient; dA is ``shared_h``'s."""

    @staticmethod
    def forward(x, weight, bias, h, a, b, scale, impl, token):  # x (M, K), a / b in any float dtype
        op = _given_h_fwd_impl if _direct_ok(x, weight, bias, h, b) else torch.ops.fastaf.lora_given_h_fwd
        return op(x, weight, bias, h, b, scale, impl)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, h, a, b, scale, impl, token = inputs
        note_factors(a, b)
        ctx.own = own_level()
        ctx.save_for_backward(x, weight, h, a, b)
        ctx.scale, ctx.impl, ctx.has_bias = scale, impl, bias is not None
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, dy):
        if dy is None:
            return (None,) * 9
        x, weight, h, a, b = ctx.saved_tensors
        needs = ctx.needs_input_grad
        post = False
        if _differentiated(dy, factors=(a, b), weight=weight, x=x, own=ctx.own):
            dx, dh, db = reference_given_h_bwd(dy, weight, a, b, _recomputed_h(x, a), ctx.scale, needs[0])
        else:
            post = needs[8]  # shared_h sums dx over the siblings from their dy
            op = _given_h_bwd_impl if _direct_ok(dy, x, weight, a, b, h) else torch.ops.fastaf.lora_given_h_bwd
            with torch.no_grad():
                dx, dh, db = op(dy, x, weight, a, b, h, ctx.scale, needs[0] and not post, ctx.impl)
        dw, dbias = _vjp_weight_bias(dy, x, needs[1], needs[2] and ctx.has_bias)
        # dh and dB unconditionally: under torch.compile a factor that torch.func.grad wraps as a
        # graph input once read as not requiring grad here (see _LoRAMultiFn.backward)
        return ((dx if needs[0] and not post else None), dw, dbias, dh, None, db, None, None,
                (dy if post else None))


class _GivenHDirect(torch.autograd.function._SingleLevelFunction):
    """``_GivenHFn`` for plain eager autograd and one ``torch.func.grad`` level."""

    @staticmethod
    def forward(ctx, level, x, weight, bias, h, a, b, scale, impl):
        with _below(level, x, weight, bias, h, a, b) as (x, weight, bias, h, a, b):
            x2 = _flat(x)
            y = _unflatten(_given_h_fwd_impl(x2, weight, bias, h, b, scale, impl), x)
        ctx.save_for_backward(x, weight, h, a, b)  # not x2: a double backward's reshape must be in its graph
        ctx.level, ctx.scale, ctx.impl = level, scale, impl
        ctx.token = level_token(level)
        ctx.set_materialize_grads(False)
        return wrap_for_grad(y, level) if level else y

    @staticmethod
    def backward(ctx, dy):
        if dy is None:
            return (None,) * 9
        x, weight, h, a, b = ctx.saved_tensors
        need_x, need_w, need_bias, need_h, _, need_b = ctx.needs_input_grad[1:7]
        left = level_left(ctx.level, ctx.token)  # a vjp_fn's backward after its level
        double = _double_backward(ctx.level, dy, left=left)
        with _below(ctx.level, dy, left=left) as (dy,), (torch.enable_grad() if double else torch.no_grad()):
            dy2, x2 = _flat(dy), _flat(x)
            if double:
                dx, dh, db = reference_given_h_bwd(dy2, weight, a, b, _recomputed_h(x2, a), ctx.scale, need_x)
            else:
                dx, dh, db = _given_h_bwd_impl(dy2, x2, weight, a, b, h, ctx.scale, need_x, ctx.impl)
            if need_x and dy.dim() != 2:
                dx = dx.view(*dy.shape[:-1], x2.shape[-1])
            dw, dbias = _vjp_weight_bias(dy2, x2, need_w, need_bias)
        # db comes in b's dtype from either path
        return None, (dx if need_x else None), dw, dbias, (dh if need_h else None), None, (db if need_b else None), None, None


_shared_direct_apply = _SharedHDirect.apply
_given_direct_apply = _GivenHDirect.apply
_SharedHFn_apply = _traced_apply(_SharedHFn)
_GivenHFn_apply = _traced_apply(_GivenHFn)


# ---- 4. entry points (functional_call's) ---------------------------------------------------------


def shareable(x: object, loras: Sequence[LoRA]) -> bool:
    """Whether siblings with ``loras`` can take their h from one ``shared_h`` over ``x``: a float
    tensor of their in_features, unstacked plain factors, outside vmap (the caller checks dropout)."""
    if not isinstance(x, Tensor) or x.dim() == 0 or x.numel() == 0 or x.dtype not in _OP_DTYPES:
        return False
    if any(l.stacked or l.experts or l.in_features != x.shape[-1] for l in loras):
        return False
    if torch.compiler.is_compiling():
        # grad of grad: each layer is lora_linear's reference; vmap: the shared-h Functions have
        # no vmap rule, so each layer is lora_linear's Function
        return not (_higher_order_traced() or _vmapped_traced())
    factors = (*(l.A for l in loras), *(l.B for l in loras))
    return _direct_level(x, *factors, factors=factors, x=x) >= 0


def shared_h(x: Tensor, loras: Sequence[LoRA], *, impl: str = "auto") -> tuple[Tensor, ...]:
    """h_i = x @ A_i.T for every LoRA, (M, r_i) each with M = x.numel() // K, from one pass over x.

    x: (..., K); each LoRA's A (r_i, K) in any float dtype (cast to x's, gradients cast back).
    Pass each h_i to ``lora_linear_given_h`` with the same x and LoRA.
    """
    return shared_h_fanned(x, loras, (), impl=impl)[0]


def shared_h_fanned(x: Tensor, loras: Sequence[LoRA], weights: Sequence[Tensor], *,
                    impl: str = "auto") -> tuple[tuple[Tensor, ...], tuple[Optional[Tensor], ...]]:
    """(h_i, token_i) per LoRA: ``shared_h``'s h, and with the siblings' ``weights`` (W_i (N_i, K),
    one per LoRA) a token for ``lora_linear_given_h``, through which x's gradient is summed over
    the siblings in one GEMM (module docstring). Tokens come on the traced path (the Function
    ``torch.compile`` and higher orders see); eagerly each sibling makes its own dx (None)."""
    x = _autocast(x, None, None)[0]
    n = loras[0].out_features
    factors = [l.A for l in loras]
    level = _direct_level(x, *factors, factors=tuple(factors), x=x)
    if level >= 0:
        return _apply_single_level(_shared_direct_apply, level, n, impl, x, *factors), (None,) * len(loras)
    # The factors stacked as they are (the kernels read fp32 masters, the references cast); the
    # stack sits outside the Function, whose signature stays fixed whatever the sibling count.
    weights = [w.to(x.dtype) for w in weights]  # autocast's cast, as lora_linear_given_h makes it
    out = _SharedHFn_apply(_flat(x), torch.cat(factors), tuple(l.rank for l in loras), n, impl, *weights)
    return out[:len(loras)], out[len(loras):] or (None,) * len(loras)


def lora_linear_given_h(x: Tensor, weight: Tensor, bias: Optional[Tensor], h: Tensor, lora: LoRA, *,
                        impl: str = "auto", where: str = "lora_linear", token: Optional[Tensor] = None) -> Tensor:
    """``lora_linear(x, weight, bias, lora)`` with its h (M, r) from ``shared_h`` over the same x.

    x: (..., K); weight (N, K); bias (N,) or None. Returns (..., N) in x's dtype. No dropout.
    ``token``: ``shared_h_fanned``'s for this sibling (x's gradient then comes from there).
    """
    x, weight, bias = _autocast(x, weight, bias)
    if not torch.compiler.is_compiling():
        _check(x, weight, bias, lora, impl, where)
    scale = float(lora.scale)
    level = _direct_level(x, weight, bias, h, lora.A, lora.B, factors=(lora.A, lora.B), weight=weight, x=x)
    if level >= 0:
        return _apply_single_level(_given_direct_apply, level, x, weight, bias, h, lora.A, lora.B, scale, impl)
    y = _GivenHFn_apply(_flat(x), weight, bias, h, lora.A, lora.B, scale, impl, token)
    return y.reshape(*x.shape[:-1], weight.shape[0])
