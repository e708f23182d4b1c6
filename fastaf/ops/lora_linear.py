"""The fused LoRA linear: ``y = x @ W.T + bias + scale * (dropout(x) @ A.T) @ B.T``.

Layers of this file, bottom up:

1. The torch reference (the specification, and the CPU path).
2. Two ``torch.library`` ops, ``fastaf::lora_linear_fwd`` and ``fastaf::lora_linear_bwd``, each
   with a fake (shape-only) implementation and a vmap rule. They dispatch to the Triton kernels
   (``fastaf.kernels.lora_linear``) or to the reference.
3. ``LoRALinearFn``, a new-style ``autograd.Function`` (forward without ctx, ``setup_context``,
   ``backward``, ``vmap``) joining the two ops. Not ``register_autograd``: that form fails under
   ``torch.func.grad`` on torch 2.11 (pytorch#168393; ops/README.md). Plain eager calls and one eager
   ``torch.func.grad`` level take ``_LoRALinearDirect`` instead: the same implementations and
   VJP without the group axis, whose views and casts cost host time at small M. Which one a call
   takes, and when a backward must be differentiable, is ``_levels``' to say.
4. ``lora_linear``, the public function.

Inside the ops every tensor carries a leading *group* axis, so one op call serves one adapter
(G = 1) or a batch of adapters (vmap over a stack folds the vmap axis into G):

    x (Gx, M, K)   weight (Gw, N, K)   bias (Gc, N) | None   A (Ga, R, K)   B (Gb, N, R)
    seed (Gs,) int64 | None            each G* is 1 (broadcast) or G
    -> y (G, M, N), h = dropout(x) @ A.T (G, M, R)

A and B come in their own float dtype (fp32 master factors beside bf16 x): the kernels read them
as they are, the references cast them, and dA, dB come back in it, so a compiled step neither
launches casts for them nor rounds their gradients to x's dtype (vmap over a stack still casts:
the grouped kernels take one dtype; float64 factors are cast for the kernels too).

h is an op output so the backward reuses it instead of recomputing x @ A.T. Dropout masks come
from a counter-based hash of (seed, m * K + k) (``fastaf.kernels.dropout_hash``), so the backward
recomputes the mask and the Triton kernels match this reference bit for bit.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..kernels import atomics_ok
from ..kernels import element_index, hash_uniform
from .._adapter import LoRA
from ._levels import (_apply_single_level, _CALL, _differentiated, _direct_level, _direct_ok, _double_backward,
                      _higher_order_traced, is_wrapped, level_left, level_token, _NO_SCOPE, note_factors, own_level,
                      pop_layer, push_layer, _tangent_sum, _traced_apply, tracked_scope, unwrap_for_grad, wrap_for_grad)

IMPLS = ("auto", "triton", "torch")
_OP_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ---- 1. reference --------------------------------------------------------------------------


def _dropout_scale(x: Tensor, p: float, seed: Optional[Tensor]) -> Optional[Tensor]:
    """keep / (1 - p) as x's dtype, (Gs, M, K); None when p == 0."""
    if p == 0.0:
        return None
    M, K = x.shape[-2:]
    keep = hash_uniform(seed.view(-1, 1, 1), element_index(M, K, x.device)) >= p  # (Gs, M, K)
    return keep.to(x.dtype) * (1.0 / (1.0 - p))


def _group_size(*tensors: Optional[Tensor]) -> int:
    return max(t.shape[0] for t in tensors if t is not None)


def _t(t: Tensor) -> Tensor:
    return t.transpose(-1, -2)


def _as_dtype(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t if t.dtype == dtype else t.to(dtype)


_KERNEL_FACTOR_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _kernel_factor(t: Tensor, dtype: torch.dtype) -> Tensor:
    """A LoRA factor for the kernels: as it is in a dtype they read (fp32 masters), else (float64)
    cast to x's ``dtype``."""
    return t if t.dtype in _KERNEL_FACTOR_DTYPES else t.to(dtype)


def reference_fwd(x, weight, bias, a, b, scale, dropout_p, seed):
    """Torch reference of the forward op; shapes as in the module docstring. a and b may be in
    another float dtype than x (fp32 master factors): they are cast to x's, as the kernels do in
    registers."""
    G = _group_size(x, weight, bias, a, b, seed)
    a, b = _as_dtype(a, x.dtype), _as_dtype(b, x.dtype)
    mask = _dropout_scale(x, dropout_p, seed)
    xd = x if mask is None else x * mask
    h = xd @ _t(a)  # (G, M, R)
    y = x @ _t(weight)  # (G, M, N)
    if bias is not None:
        y = y + bias[:, None, :]
    y = y + scale * (h @ _t(b))
    M, N, R = x.shape[1], weight.shape[1], a.shape[1]
    return y.expand(G, M, N).contiguous(), h.expand(G, M, R).contiguous()


def reference_bwd(dy, x, weight, a, b, h, scale, dropout_p, seed, needs_dx):
    """Torch reference of the backward op: (dx (G, M, K) or empty, dA (G, R, K) in a's dtype,
    dB (G, N, R) in b's dtype)."""
    G, M, N = dy.shape
    K, R = x.shape[2], a.shape[1]
    a_dtype, b_dtype = a.dtype, b.dtype
    a, b = _as_dtype(a, x.dtype), _as_dtype(b, x.dtype)
    mask = _dropout_scale(x, dropout_p, seed)
    dh = scale * (dy @ b)  # (G, M, R)
    db = scale * (_t(dy) @ h)  # (G, N, R)
    xd = x if mask is None else x * mask
    da = _t(dh) @ xd  # (G, R, K)
    if needs_dx:
        lora_dx = dh @ a  # (G, M, K)
        dx = dy @ weight + (lora_dx if mask is None else lora_dx * mask)
        dx = dx.expand(G, M, K).contiguous()
    else:
        dx = dy.new_empty(G, 0, 0)
    return dx, _as_dtype(da.expand(G, R, K).contiguous(), a_dtype), _as_dtype(db.expand(G, N, R).contiguous(), b_dtype)


# ---- 2. torch.library ops -------------------------------------------------------------------


_kernels_module = None


def _kernels():
    """``fastaf.kernels.lora_linear``, imported on first use: triton loads only when a kernel runs."""
    global _kernels_module
    if _kernels_module is None:
        from ..kernels import lora_linear

        _kernels_module = lora_linear
    return _kernels_module


def _multi_kernels():
    """``fastaf.kernels.lora_multi``, imported on first use (grouped calls: vmap over a stack)."""
    from ..kernels import lora_multi

    return lora_multi


def _use_triton(impl: str, x: Tensor) -> bool:
    if impl == "torch" or x.dtype == torch.float64:
        if impl == "triton":
            raise TypeError(f"impl='triton' does not take float64 input x {tuple(x.shape)}")
        return False
    if impl == "triton":
        if not _kernels().available(x):
            raise RuntimeError(
                f"impl='triton' needs a CUDA tensor (or TRITON_INTERPRET=1 for CPU tensors); x is on {x.device}"
            )
        return True
    return x.is_cuda and _kernels().available(x)


def _single_group(*tensors: Optional[Tensor]) -> bool:
    return all(t is None or t.shape[0] == 1 for t in tensors)


def _grouped_layout(x: Tensor, weight: Tensor, bias: Optional[Tensor], a: Tensor, b: Tensor,
                    dropout_p: float) -> Optional[str]:
    """How the grouped kernels take a call with G > 1 adapters over one shared weight (vmap over a
    stack): "segments" when x is batched (G groups of M rows, the base GEMM once over all G * M
    rows), "shared" when it is not (every adapter over the same x), else None (the reference)."""
    G = a.shape[0]
    if not (G > 1 and b.shape[0] == G and weight.shape[0] == 1 and x.shape[1] > 0 and dropout_p == 0.0
            and (bias is None or bias.shape[0] == 1) and _multi_kernels().supported(x, a)):
        return None
    return "segments" if x.shape[0] == G else "shared" if x.shape[0] == 1 else None


def _fwd_impl(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    a: Tensor,
    b: Tensor,
    scale: float,
    dropout_p: float,
    seed: Optional[Tensor],
    impl: str,
) -> tuple[Tensor, Tensor]:
    """Forward op: (y (G, M, N), h (G, M, R)); see the module docstring for shapes."""
    if _single_group(x, weight, bias, a, b, seed) and _use_triton(impl, x):
        y, h = _kernels().lora_linear_fwd(
            x[0], weight[0], None if bias is None else bias[0], _kernel_factor(a[0], x.dtype),
            _kernel_factor(b[0], x.dtype), scale, dropout_p, seed, impl=impl,
        )
        return y[None], h[None]
    layout = (_grouped_layout(x, weight, bias, a, b, dropout_p)
              if _use_triton(impl, x) and atomics_ok(impl, "a stack's grouped forward") else None)
    if layout is not None:
        G, M, K = a.shape[0], x.shape[1], x.shape[2]
        bias0 = None if bias is None else bias[0]
        # the grouped kernels read fp32 master factors as they are; float64 ones are cast
        a, b = _kernel_factor(a, x.dtype), _kernel_factor(b, x.dtype)
        if layout == "segments":
            ids = torch.arange(G, device=x.device)
            y, h = _multi_kernels().multi_fwd(x.reshape(G * M, K), weight[0], bias0, a, b, ids, scale)
        else:
            y, h = _multi_kernels().shared_fwd(x[0], weight[0], bias0, a, b, scale)
        return y.view(G, M, -1), h.to(x.dtype).view(G, M, -1)
    return reference_fwd(x, weight, bias, a, b, scale, dropout_p, seed)


lora_linear_fwd = torch.library.custom_op("fastaf::lora_linear_fwd", mutates_args=())(_fwd_impl)


@lora_linear_fwd.register_fake
def _(x, weight, bias, a, b, scale, dropout_p, seed, impl):
    G = _group_size(x, weight, bias, a, b, seed)
    M, N, R = x.shape[1], weight.shape[1], a.shape[1]
    return x.new_empty(G, M, N), x.new_empty(G, M, R)


def _bwd_impl(
    dy: Tensor,
    x: Tensor,
    weight: Tensor,
    a: Tensor,
    b: Tensor,
    h: Tensor,
    scale: float,
    dropout_p: float,
    seed: Optional[Tensor],
    needs_dx: bool,
    impl: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """Backward op: (dx (G, M, K), or (G, 0, 0) when not needed; dA (G, R, K); dB (G, N, R))."""
    if _single_group(dy, x, weight, a, b, h, seed) and _use_triton(impl, x):
        dx, da, db = _kernels().lora_linear_bwd(
            dy[0], x[0], weight[0], _kernel_factor(a[0], x.dtype), _kernel_factor(b[0], x.dtype), h[0],
            scale, dropout_p, seed, needs_dx, impl=impl,
        )
        dx = dy.new_empty(1, 0, 0) if dx is None else dx[None]
        # where cuBLAS ran, the factors' gradients come in x's dtype: the op's are the factors'
        return dx, _as_dtype(da, a.dtype)[None], _as_dtype(db, b.dtype)[None]
    layout = (_grouped_layout(x, weight, None, a, b, dropout_p)
              if _use_triton(impl, x) and atomics_ok(impl, "a stack's grouped backward") else None)
    if layout is not None:
        G, M, K, N = a.shape[0], x.shape[1], x.shape[2], dy.shape[2]
        dy2, h2 = dy.reshape(G * M, N), h.reshape(G * M, -1).contiguous()
        a_dtype, b_dtype = a.dtype, b.dtype
        # fp32 masters as they are: dA, dB come back in fp32, unrounded (but for the shared layout's
        # dA, one cuBLAS GEMM in x's dtype); float64 ones are cast, their gradients cast back
        a, b = _kernel_factor(a, x.dtype), _kernel_factor(b, x.dtype)
        if layout == "segments":
            ids = torch.arange(G, device=x.device)
            dx, da, db = _multi_kernels().multi_bwd(dy2, x.reshape(G * M, K), weight[0], a, b, h2, ids, scale,
                                                    needs_dx)
        else:
            dx, da, db = _multi_kernels().shared_bwd(dy2, x[0], weight[0], a, b, h2, scale, needs_dx)
        dx = dy.new_empty(G, 0, 0) if dx is None else dx.view(G, M, K)
        return dx, _as_dtype(da, a_dtype), _as_dtype(db, b_dtype)
    return reference_bwd(dy, x, weight, a, b, h, scale, dropout_p, seed, needs_dx)


lora_linear_bwd = torch.library.custom_op("fastaf::lora_linear_bwd", mutates_args=())(_bwd_impl)


@lora_linear_bwd.register_fake
def _(dy, x, weight, a, b, h, scale, dropout_p, seed, needs_dx, impl):
    G, M, N = dy.shape
    K, R = x.shape[2], a.shape[1]
    dx = dy.new_empty(G, M, K) if needs_dx else dy.new_empty(G, 0, 0)
    return dx, a.new_empty(G, R, K), b.new_empty(G, N, R)


def _fold_vmap_axis(n: int, tensors: tuple[Optional[Tensor], ...], dims: tuple[Optional[int], ...]):
    """Fold a vmap axis of size n into the group axis of every grouped tensor.

    A batched tensor (n, g, ...) becomes (n * G, ...); an unbatched one with g == 1 stays
    (1, ...) and broadcasts; an unbatched one with g == G > 1 (nested vmap) is repeated n times.
    """
    moved = [None if t is None else (t if d is None else t.movedim(d, 0)) for t, d in zip(tensors, dims)]
    G = max(t.shape[1] if d is not None else t.shape[0] for t, d in zip(moved, dims) if t is not None)
    out = []
    for t, d in zip(moved, dims):
        if t is None:
            out.append(None)
        elif d is None:
            out.append(t if t.shape[0] == 1 else t.unsqueeze(0).expand(n, *t.shape).flatten(0, 1))
        else:
            out.append(t.expand(n, G, *t.shape[2:]).flatten(0, 1))
    return out


def _unfold(n: int, outputs: tuple[Tensor, ...]) -> tuple[tuple[Tensor, ...], tuple[int, ...]]:
    return tuple(o.unflatten(0, (n, -1)) for o in outputs), (0,) * len(outputs)


@lora_linear_fwd.register_vmap
def _(info, in_dims, x, weight, bias, a, b, scale, dropout_p, seed, impl):
    x, weight, bias, a, b, seed = _fold_vmap_axis(
        info.batch_size, (x, weight, bias, a, b, seed), in_dims[:5] + in_dims[7:8]
    )
    out = lora_linear_fwd(x, weight, bias, a, b, scale, dropout_p, seed, impl)
    return _unfold(info.batch_size, out)


@lora_linear_bwd.register_vmap
def _(info, in_dims, dy, x, weight, a, b, h, scale, dropout_p, seed, needs_dx, impl):
    dy, x, weight, a, b, h, seed = _fold_vmap_axis(
        info.batch_size, (dy, x, weight, a, b, h, seed), in_dims[:6] + in_dims[8:9]
    )
    out = lora_linear_bwd(dy, x, weight, a, b, h, scale, dropout_p, seed, needs_dx, impl)
    return _unfold(info.batch_size, out)


# ---- 3. the differentiable op -----------------------------------------------------------------


def _sum_to(grad: Tensor, shape: torch.Size) -> Tensor:
    """Reduce a per-group gradient (G, ...) to an input that broadcast over groups (1, ...)."""
    return grad.sum(0, keepdim=True) if grad.shape[0] != shape[0] else grad


def _vjp_weight_bias(dy2: Tensor, x2: Tensor, needs_weight: bool, needs_bias: bool) -> tuple:
    """Gradients of the frozen weight and bias, only when they ask: (N, K) and (N,) or None."""
    return (dy2.transpose(-1, -2) @ x2 if needs_weight else None), (dy2.sum(-2) if needs_bias else None)


class LoRALinearFn(torch.autograd.Function):
    """Custom VJP of the fused LoRA linear over grouped tensors (see the module docstring), for
    tracers (``torch.compile``) and for transforms ``_LoRALinearDirect`` does not serve (vmap
    innermost, grad of grad). Its vmap rule folds the vmap axis into the group axis."""

    @staticmethod
    def forward(x, weight, bias, a, b, scale, dropout_p, seed, impl):
        fwd = _fwd_impl if _direct_ok(x, weight, bias, a, b, seed) else torch.ops.fastaf.lora_linear_fwd
        return fwd(x, weight, bias, a, b, scale, dropout_p, seed, impl)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, a, b, scale, dropout_p, seed, impl = inputs
        note_factors(a, b)
        ctx.own = own_level()
        ctx.save_for_backward(x, weight, a, b, output[1], seed)
        ctx.scale, ctx.dropout_p, ctx.impl = scale, dropout_p, impl
        ctx.call = _CALL.tracked
        ctx.bias_shape = None if bias is None else bias.shape
        ctx.mark_non_differentiable(output[1])
        ctx.set_materialize_grads(False)  # h is never differentiated: skip a zero-fill per backward
        ctx.save_for_forward(x, weight, bias, a, b, seed)

    @staticmethod
    def jvp(ctx, x_t, weight_t, bias_t, a_t, b_t, *_):
        """Forward mode (torch.func.jvp, jacfwd, jvp of grad, linearize): the tangent of
        ``reference_fwd``, written out. With xd = x * mask (dropout scales x on the LoRA path
        alone) and h = xd @ A.T,

            y_t = x_t @ W.T + x @ W_t.T + bias_t + s * ((xd_t @ A.T + xd @ A_t.T) @ B.T + h @ B_t.T)

        over the group axis as the reference broadcasts it; a None tangent is zero and its terms
        are left out (``_tangent_sum``). A and B and their tangents in x's dtype, as the reference
        casts them."""
        x, weight, bias, a, b, seed = ctx.saved_tensors
        a, b = _as_dtype(a, x.dtype), _as_dtype(b, x.dtype)  # (Ga, R, K), (Gb, N, R)
        mask = _dropout_scale(x, ctx.dropout_p, seed)  # (Gs, M, K) or None
        xd = x if mask is None else x * mask
        xd_t = x_t if x_t is None or mask is None else x_t * mask
        h_t = _tangent_sum(None if xd_t is None else xd_t @ _t(a),
                          None if a_t is None else xd @ _t(_as_dtype(a_t, x.dtype)))  # (G, M, R)
        lora_t = _tangent_sum(None if h_t is None else h_t @ _t(b),
                             None if b_t is None else (xd @ _t(a)) @ _t(_as_dtype(b_t, x.dtype)))  # (G, M, N)
        y_t = _tangent_sum(None if x_t is None else x_t @ _t(weight),
                          None if weight_t is None else x @ _t(weight_t),
                          None if bias_t is None else bias_t[:, None, :],
                          None if lora_t is None else ctx.scale * lora_t)
        G, M, N = _group_size(x, weight, bias, a, b, seed), x.shape[1], weight.shape[1]
        y_t = x.new_zeros(G, M, N) if y_t is None else y_t.expand(G, M, N).contiguous()
        return y_t, None  # h is marked non-differentiable

    @staticmethod
    def backward(ctx, dy, _dh):
        x, weight, a, b, h, seed = ctx.saved_tensors
        if dy is None:
            return (None,) * 9
        needs = ctx.needs_input_grad
        operands = (dy, x, weight, a, b, h, seed)
        if _differentiated(dy, factors=(a, b), weight=weight, x=x, call=ctx.call, own=ctx.own):
            # grad of grad: the reference's ops, differentiable, with h recomputed from x
            dropout_scale = _dropout_scale(x, ctx.dropout_p, seed)
            h = (x if dropout_scale is None else x * dropout_scale) @ _t(_as_dtype(a, x.dtype))
            dx, da, db = reference_bwd(dy, x, weight, a, b, h, ctx.scale, ctx.dropout_p, seed, needs[0])
        else:
            # First order: torch.func.grad runs backward with create_graph=True, and the op's
            # default autograd kernel would then wrap it in an old-style Function that functorch
            # rejects. no_grad keeps the call a plain op call.
            bwd = _bwd_impl if _direct_ok(*operands) else torch.ops.fastaf.lora_linear_bwd
            with torch.no_grad():
                dx, da, db = bwd(*operands[:6], ctx.scale, ctx.dropout_p, seed, needs[0], ctx.impl)
        dweight, dbias = _vjp_weight_bias(dy, x, needs[1], needs[2])
        return (
            _sum_to(dx, x.shape) if needs[0] else None,
            None if dweight is None else _sum_to(dweight, weight.shape),
            None if dbias is None else _sum_to(dbias, ctx.bias_shape),
            _sum_to(da, a.shape) if needs[3] else None,
            _sum_to(db, b.shape) if needs[4] else None,
            None, None, None, None,
        )

    @staticmethod
    def vmap(info, in_dims, x, weight, bias, a, b, scale, dropout_p, seed, impl):
        # Re-enter the Function on folded tensors so outer grad levels still see this VJP.
        x, weight, bias, a, b, seed = _fold_vmap_axis(
            info.batch_size, (x, weight, bias, a, b, seed), in_dims[:5] + in_dims[7:8]
        )
        out = LoRALinearFn.apply(x, weight, bias, a, b, scale, dropout_p, seed, impl)
        return _unfold(info.batch_size, out)


def _opt(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t[None]


def _direct_fwd(x2, weight, bias, a, b, scale, dropout_p, seed, impl, triton: bool, lead: tuple = ()):
    """(y (M, N), h (M, R)) on plain tensors (kernels or reference) or on vmap-batched ones (the
    registered op, whose vmap rule reaches the grouped path). ``lead``: the kernels may make y
    (*lead, N) directly (the caller's leading dims)."""
    if triton:
        return _kernels().lora_linear_fwd_unchecked(x2, weight, bias, a, b, scale, dropout_p, seed, impl, lead=lead,
                                                    graphed=True)
    fwd = reference_fwd if _direct_ok(x2, weight, bias, a, b) else torch.ops.fastaf.lora_linear_fwd
    extra = () if fwd is reference_fwd else (impl,)
    y, h = fwd(x2[None], weight[None], _opt(bias), a[None], b[None], scale, dropout_p, seed, *extra)
    return y[0], h[0]


def _direct_bwd(dy2, x2, weight, a, b, h, scale, dropout_p, seed, needs_dx, impl, triton: bool):
    """(dx (M, K) or empty, dA (R, K), dB (N, R)), as ``_direct_fwd`` chooses its path."""
    if triton:
        return _kernels().lora_linear_bwd_unchecked(dy2, x2, weight, a, b, h, scale, dropout_p, seed, needs_dx, impl,
                                                    shared_grads=True, graphed=True)
    plain = _direct_ok(dy2, x2, weight, a, b, h)
    bwd = reference_bwd if plain else torch.ops.fastaf.lora_linear_bwd
    extra = () if plain else (impl,)
    out = bwd(dy2[None], x2[None], weight[None], a[None], b[None], h[None], scale, dropout_p, seed, needs_dx, *extra)
    return tuple(t[0] for t in out)




class _LoRALinearDirect(torch.autograd.function._SingleLevelFunction):
    """The VJP for plain eager autograd and for one ``torch.func.grad`` level, without the group
    axis and without functorch's per-call Function machinery.

    Under a grad level ``_direct_level``, forward unwraps its operands at that level, computes
    below it (the layer popped: new tensors come out plain, or vmap-batched when vmap runs
    outside grad) and wraps y back, which is what functorch's own grad rule for an
    ``autograd.Function`` does, less its per-call class: 3.2x less host time per call on the CPU
    (88 -> 55 ms for 112 tiny layers, plain autograd 33 ms). The backward is first order: it
    computes on unwrapped tensors below the level and returns them plain, which the grad level
    takes as constants. Applied with functorch's single-level flag set (``_apply_direct``).

    Each skipped no-op (reshape, view, cast) is ~2-7 us of host time per call: at M=2048,
    K=N=4096 on the H200 the op was host-bound at 2.1x the base forward where a bare addmm
    Function ran at 1.26x. A and B keep their own dtype: the kernels read fp32 master factors as
    they are (a cast launch per factor and call less), the reference casts them; gradients come
    back in the factors' dtype.
    """

    @staticmethod
    def forward(ctx, level, x, weight, bias, a, b, scale, dropout_p, seed, impl):
        saved_layer = None
        if level:
            unwrap = unwrap_for_grad
            x, weight, a, b = unwrap(x, level), unwrap(weight, level), unwrap(a, level), unwrap(b, level)
            bias = None if bias is None else unwrap(bias, level)
            seed = None if seed is None else unwrap(seed, level)
            saved_layer = pop_layer()
        try:
            x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # (M, K)
            ctx.a_dtype, ctx.b_dtype = a.dtype, b.dtype
            # level 0: lora_linear's _direct_level found the operands plain already
            ctx.triton = (not level or _direct_ok(x2, weight, bias, a, b)) and _use_triton(impl, x2)
            factors = a, b
            if not ctx.triton:  # the kernels read fp32 master factors as they are; torch casts
                a, b = _as_dtype(a, x.dtype), _as_dtype(b, x.dtype)  # (R, K), (N, R)
            else:
                a, b = _kernel_factor(a, x.dtype), _kernel_factor(b, x.dtype)
            lead = x.shape[:-1] if x.dim() > 2 else ()
            y, h = _direct_fwd(x2, weight, bias, a, b, scale, dropout_p, seed, impl, ctx.triton, lead)
            if y.dim() != x.dim():  # the Triton GEMM made y (*lead, N) already
                y = _unflatten(y, x)
        finally:
            if saved_layer is not None:
                push_layer(saved_layer)
        # x as it came, not x2, and the factors as they came where they were cast: a double
        # backward's reshape and casts of them are then part of its graph (made in here, where grad
        # is off, they lost every term through x, and through fp32 master factors)
        cast = factors if factors[0] is not a or factors[1] is not b else ()
        ctx.save_for_backward(x, weight, a, b, h, seed, *cast)
        ctx.level, ctx.scale, ctx.dropout_p, ctx.impl = level, scale, dropout_p, impl
        ctx.token = level_token(level)  # the level's, while it lives: a vjp_fn may run backward after it
        ctx.set_materialize_grads(False)
        return wrap_for_grad(y, level) if level else y

    @staticmethod
    def backward(ctx, dy):
        if dy is None:
            return (None,) * 10
        x, weight, a, b, h, seed, *factors = ctx.saved_tensors
        need_x, need_w, need_bias, need_a, need_b = ctx.needs_input_grad[1:6]
        # Under a grad level functorch runs backward with create_graph; this VJP is first order
        # there unless a cotangent is tracked beneath. Plain autograd's double backward
        # (create_graph) takes the reference's ops, differentiable, with h recomputed from x.
        left = level_left(ctx.level, ctx.token)  # a vjp_fn's backward after its level
        double = _double_backward(ctx.level, dy, left=left)
        saved_layer = None
        if ctx.level and not left:
            dy = unwrap_for_grad(dy, ctx.level)
            saved_layer = pop_layer()
        # plain autograd runs a first-order backward with grad off already: no scope to enter
        scope = torch.enable_grad() if double else torch.no_grad() if torch.is_grad_enabled() else _NO_SCOPE
        try:
            with scope:
                dy2 = dy if dy.dim() == 2 else dy.reshape(-1, weight.shape[0])  # (M, N)
                x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # (M, K)
                if double:
                    a, b = factors or (a, b)
                    a, b = _as_dtype(a, x2.dtype), _as_dtype(b, x2.dtype)  # saved as they came (kernels)
                    keep = _dropout_scale(x2[None], ctx.dropout_p, seed)
                    h = (x2 if keep is None else x2 * keep[0]) @ a.T
                    dx, da, db = (t[0] for t in reference_bwd(dy2[None], x2[None], weight[None], a[None], b[None],
                                                               h[None], ctx.scale, ctx.dropout_p, seed, need_x))
                else:
                    dx, da, db = _direct_bwd(dy2, x2, weight, a, b, h, ctx.scale, ctx.dropout_p, seed, need_x,
                                             ctx.impl, ctx.triton)
                if need_x and dy.dim() != 2:
                    dx = dx.view(*dy.shape[:-1], x2.shape[-1])
                dweight, dbias = _vjp_weight_bias(dy2, x2, need_w, need_bias)  # the frozen weight: only when it asks
                da = _as_dtype(da, ctx.a_dtype) if need_a else None
                db = _as_dtype(db, ctx.b_dtype) if need_b else None
        finally:
            if saved_layer is not None:
                push_layer(saved_layer)
        return None, dx if need_x else None, dweight, dbias, da, db, None, None, None, None


_unsafe_view = torch.ops.aten._unsafe_view.default


def _inference(x: Tensor, weight: Tensor, bias: Optional[Tensor], a: Tensor, b: Tensor, scale: float,
               dropout_p: float, seed: Optional[Tensor], impl: str) -> Tensor:
    """``_LoRALinearDirect``'s forward with grad off and no level: no Function (its apply is host
    time at every adapted layer of every eager decode step) and nothing saved. (..., N)."""
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # (M, K)
    triton = _use_triton(impl, x2)
    cast = _kernel_factor if triton else _as_dtype  # the kernels read fp32 master factors as they are
    y, _ = _direct_fwd(x2, weight, bias, cast(a, x.dtype), cast(b, x.dtype), scale, dropout_p, seed, impl, triton,
                       x.shape[:-1] if x.dim() > 2 else ())
    return y if y.dim() == x.dim() else y.view(*x.shape[:-1], y.shape[-1])


def _unflatten(y: Tensor, x: Tensor) -> Tensor:
    """A Function's (M, N) output y back to x's leading dims, (..., N). Not a view for autograd:
    models modify a layer's output in place (Falcon), which autograd forbids on a view made
    inside a custom Function."""
    if x.dim() == 2:
        return y
    shape = (*x.shape[:-1], y.shape[-1])
    return _unsafe_view(y, shape) if _direct_ok(y) else y.view(shape)
_direct_apply = _LoRALinearDirect.apply  # the C apply: no functorch dispatch, no argument binding
LoRALinearFn_apply = _traced_apply(LoRALinearFn)
def _apply_direct(level: int, *args: Any) -> Tensor:
    return _apply_single_level(_direct_apply, level, *args)


# ---- 4. public function -----------------------------------------------------------------------


# one flag read; the per-device query below it costs a torch.device per call
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def _autocast(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor]
              ) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """x, weight and bias as autocast would cast them for F.linear (the custom ops sit below it)."""
    if _any_autocast() and torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x = x.to(dtype)
        weight = None if weight is None else weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    return x, weight, bias


def _check(x: Tensor, weight: Tensor, bias: Optional[Tensor], lora: Any, impl: str, where: str) -> None:
    if not isinstance(lora, LoRA):
        raise TypeError(f"{where}: lora must be a fastaf.LoRA, got {type(lora).__name__}")
    if impl not in IMPLS:
        raise ValueError(f"{where}: impl must be one of {IMPLS}, got {impl!r}")
    check_use(x, weight, bias, lora, where)
    if lora.stacked:
        raise ValueError(
            f"{where}: stacked LoRA A {tuple(lora.A.shape)}; map over the stack with torch.func.vmap"
        )
    for name, t in (("A", lora.A), ("B", lora.B)):
        if t.device != x.device:
            raise ValueError(f"{where}: {name} {tuple(t.shape)} is on {t.device} but x is on {x.device}")


def check_use(x: Tensor, weight: Tensor, bias: Optional[Tensor], lora: LoRA, where: str) -> None:
    """One use's x, weight and bias against each other and the LoRA's shape (a 2-D LoRA, its
    factors on the weight's device: ``_check`` or the caller checked those)."""
    if not isinstance(x, Tensor) or x.dim() == 0:
        what = f"a 0-d tensor ({x.dtype})" if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{where}: input x must be a tensor of shape (..., K), got {what}")
    if x.dtype not in _OP_DTYPES:
        raise TypeError(f"{where}: input x {tuple(x.shape)} has dtype {x.dtype}; lora_linear takes {_OP_DTYPES}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"{where}: weight {tuple(weight.shape)} is not (N, K) for input x {tuple(x.shape)} with K={x.shape[-1]}"
        )
    if weight.dtype != x.dtype:
        raise TypeError(f"{where}: weight {tuple(weight.shape)} is {weight.dtype} but x {tuple(x.shape)} is {x.dtype}")
    N, K = weight.shape
    if bias is not None and (bias.shape != (N,) or bias.dtype != x.dtype):
        raise ValueError(f"{where}: bias {tuple(bias.shape)} {bias.dtype} is not ({N},) {x.dtype}")
    if (lora.in_features, lora.out_features) != (K, N):
        raise ValueError(
            f"{where}: LoRA A {tuple(lora.A.shape)} / B {tuple(lora.B.shape)} does not fit weight "
            f"{tuple(weight.shape)}: expected A (r, {K}) and B ({N}, r)"
        )
    device = x.device
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.device != device:
            raise ValueError(f"{where}: {name} {tuple(t.shape)} is on {t.device} but x is on {device}")


def lora_linear(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    lora: LoRA,
    *,
    impl: str = "auto",
    training: bool = True,
    where: str = "lora_linear",
) -> Tensor:
    """``x @ weight.T + bias + lora.scale * (dropout(x) @ lora.A.T) @ lora.B.T``.

    Args:
        x: (..., K) float16 / bfloat16 / float32 (float64 on the torch path).
        weight: (N, K) in x's dtype; may be a transposed view or tied to another module.
        bias: (N,) or None.
        lora: ``LoRA`` with A (r, K) and B (N, r); cast to x's dtype inside (gradients flow back
            to the factors' own dtype, so fp32 master factors work with bf16 activations).
        impl: "auto" (Triton on CUDA where it wins, else the reference), "triton", or "torch".
        training: apply ``lora.dropout`` (as ``F.dropout``'s flag).
        where: name used in error messages (functional_call passes the module path).
    Returns:
        (..., N) in x's dtype.
    """
    x, weight, bias = _autocast(x, weight, bias)
    if not torch.compiler.is_compiling():
        _check(x, weight, bias, lora, impl, where)
        with tracked_scope((x, weight, bias, lora.A, lora.B)):  # its operands are the call's inputs
            return _lora_linear(x, weight, bias, lora, impl, training)
    return _lora_linear(x, weight, bias, lora, impl, training)


def routed_lora_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], lora: LoRA, impl: str,
                       training: bool, where: str) -> Tensor:
    """``lora_linear`` for a use of a weight whose LoRA a call fitted to it before it ran
    (``functional_call``'s routes: its stacking, shape and device checked against the weight, the
    impl against ``IMPLS``): only the use is checked here (x, and the bias the model passed).
    The checks are host time on every adapted layer's eager call."""
    x, weight, bias = _autocast(x, weight, bias)
    if not torch.compiler.is_compiling():
        check_use(x, weight, bias, lora, where)
    return _lora_linear(x, weight, bias, lora, impl, training)


def _lora_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], lora: LoRA, impl: str, training: bool) -> Tensor:
    """``lora_linear`` on checked operands."""
    p = float(lora.dropout) if training else 0.0
    seed = torch.randint(0, 2**31 - 1, (1,), device=x.device) if p > 0.0 else None
    level = _direct_level(x, weight, bias, lora.A, lora.B, factors=(lora.A, lora.B), weight=weight, x=x)
    if level == 0 and not torch.is_grad_enabled():  # inference: the forward alone
        return _inference(x, weight, bias, lora.A, lora.B, float(lora.scale), p, seed, impl)
    if level == 0:  # plain eager autograd: the Function's C apply, no level flag to set
        return _direct_apply(0, x, weight, bias, lora.A, lora.B, float(lora.scale), p, seed, impl)
    if level > 0:
        return _apply_direct(level, x, weight, bias, lora.A, lora.B, float(lora.scale), p, seed, impl)
    if level < 0 and p == 0.0 and torch.compiler.is_compiling() and not torch.is_grad_enabled() \
            and not _higher_order_traced():
        # traced inference (a compiled decode step): cuBLAS's GEMM and one decode launch, or plain ops
        from .lora_decode import traced_decode

        return traced_decode(x, weight, bias, lora, impl)
    lead, K = x.shape[:-1], x.shape[-1]
    # The factors go in as they are (fp32 masters under bf16 x): the kernels read them in their
    # own dtype and return their gradients in it, the references cast; a cast here was two
    # launches per layer forward and two more backward in a compiled step.
    args = (
        x.reshape(1, -1, K),
        weight[None],
        None if bias is None else bias[None],
        lora.A[None],
        lora.B[None],
        float(lora.scale),
        p,
        seed,
        impl,
    )
    y, _ = reference_fwd(*args[:-1]) if _higher_order_traced() else LoRALinearFn_apply(*args)
    # not a view for autograd: models modify a layer's output in place (Falcon), which autograd
    # forbids on a view of a custom Function's output (see _unflatten)
    return _unsafe_view(y, (*lead, weight.shape[0]))
