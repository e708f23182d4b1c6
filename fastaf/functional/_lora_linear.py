"""The fused LoRA linear: ``y = x @ W.T + bias + scale * (dropout(x) @ A.T) @ B.T``.

Layers of this file, bottom up:

1. The torch reference (the specification, and the CPU path).
2. Two ``torch.library`` ops, ``fastaf::lora_linear_fwd`` and ``fastaf::lora_linear_bwd``, each
   with a fake (shape-only) implementation and a vmap rule. They dispatch to the Triton kernels
   (``fastaf.kernels.lora_linear``) or to the reference.
3. ``_LoRALinearFn``, a new-style ``autograd.Function`` (forward without ctx, ``setup_context``,
   ``backward``, ``vmap``) joining the two ops. Not ``register_autograd``: that form fails under
   ``torch.func.grad`` on torch 2.11 (DESIGN.md, known traps). Plain eager calls and one eager
   ``torch.func.grad`` level take ``_LoRALinearDirect`` instead: the same implementations and
   VJP without the group axis, whose views and casts cost host time at small M.
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

import contextlib
import functools
import hashlib
import threading
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor

from ..kernels._dispatch import atomics_ok
from ..kernels.dropout_hash import element_index, hash_uniform
from ._adapter import LoRA

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


_PLAIN_TYPES = (Tensor, torch.nn.Parameter)
_functorch = torch._C._functorch
_is_wrapped = _functorch.is_functorch_wrapped_tensor
_GRAD, _JVP, _VMAP = _functorch.TransformType.Grad, _functorch.TransformType.Jvp, _functorch.TransformType.Vmap


def _traced() -> bool:
    """A tracer (torch.compile) or a dispatch mode is watching: they must see the registered op."""
    return torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0


def _direct_ok(*tensors: Optional[Tensor]) -> bool:
    """True when the op implementations may be called directly instead of through the dispatcher.

    Only tracers (``torch.compile``), dispatch modes and functorch-*wrapped* tensors (vmap's
    batched tensors, which need the ops' vmap rules) need the registered op. The dispatcher's
    Python custom-op path costs ~150 us of host time per call on the H200 machine, ~17 ms per
    step for the 112 adapted layers of a 1B model.
    """
    if _traced():
        return False
    for t in tensors:  # a loop, not all(genexpr): this runs per op call on the host's hot path
        if t is not None and (type(t) not in _PLAIN_TYPES or _is_wrapped(t)):
            return False
    return True


def _direct_level(*tensors: Optional[Tensor], factors: tuple = (), weight: Optional[Tensor] = None,
                  x: Optional[Tensor] = None) -> int:
    """Where ``_LoRALinearDirect`` can serve: 0 in plain eager autograd, the grad level when the
    innermost transform is the only ``torch.func.grad`` (vmap levels below it are fine), else -1.

    Above one grad level (grad of grad, jvp), or where plain autograd records beneath the level
    (``tracked_beneath`` of the layer's ``factors``, ``weight`` and input ``x``), the op needs functorch's generic handling of ``_LoRALinearFn``, which
    differentiates through the backward; it costs ~0.5-1 ms of host time per call (a new Function
    class per call), so first-order grad, the common case, skips it.
    """
    if _traced():
        return -1  # tracers see _LoRALinearFn and the registered ops
    stack = _functorch.get_interpreter_stack()
    if not stack:
        return 0 if _direct_ok(*tensors) else -1
    if stack[-1].key() != _GRAD or sum(i.key() in (_GRAD, _JVP) for i in stack) != 1:
        return -1
    return -1 if tracked_beneath(factors, weight, (x,)) else stack[-1].level()


@torch.compiler.assume_constant_result
def _traced_levels() -> tuple[int, int]:
    """(vmap levels active, derivative levels: grad or jvp). Dynamo runs it once while tracing and
    keeps the result as a constant: torch 2.11 refuses to trace the interpreter stack queries
    (skipped functions), and the transforms of a traced function are fixed by its code (dynamo
    traces no function called under levels opened outside it)."""
    stack = _functorch.get_interpreter_stack() or ()
    return sum(i.key() == _VMAP for i in stack), sum(i.key() in (_GRAD, _JVP) for i in stack)


def _higher_order_traced() -> bool:
    """Two or more derivative levels (grad of grad, jvp of grad) inside ``torch.compile``.

    There the op runs as its torch reference: the Functions' backwards are not differentiable
    under compile (``_differentiated`` cannot see the outer level there; compiled grad of grad
    gave zero second derivatives on the Function), and the reference is plain torch that every
    transform and Inductor handle. ``vmap(grad)`` keeps the Function and its vmap rule (opaque to
    dynamo since ``_traced_apply``; before it, pytorch#129845 made dynamo's template of a traced
    Function unvmappable, and this held for every two transforms).
    """
    return torch.compiler.is_compiling() and _traced_levels()[1] >= 2


def _vmapped_traced() -> bool:
    """A vmap level inside ``torch.compile``: siblings' shared-h Functions have no vmap rule."""
    return torch.compiler.is_compiling() and _traced_levels()[0] > 0


def _bottom(t: Tensor) -> Tensor:
    """``t`` with every functorch wrapper (grad levels, vmap levels) taken off."""
    while _is_wrapped(t):
        t = _functorch.get_unwrapped(t)
    return t


def _requires_grad_beneath(t: Optional[Tensor]) -> bool:
    return t is not None and _bottom(t).requires_grad


def _op_tracked(factors: tuple, weight: Optional[Tensor], activations: tuple) -> bool:
    """One layer's own sign that plain autograd records beneath the transforms: one of its LoRA
    ``factors`` requires grad there, or, unless its ``weight`` requires grad, one of its
    ``activations`` does (through another layer's factors or a tracked input). An unfrozen
    weight makes every activation require grad, in every step: no sign then. (No weight: the
    activations count.)"""
    if any(_requires_grad_beneath(f) for f in factors):
        return True
    return not _requires_grad_beneath(weight) and any(map(_requires_grad_beneath, activations))


def _entered_in_grad_mode() -> Optional[bool]:
    """Whether the outermost grad level was entered in grad mode (None: no grad level)."""
    outer = next((i for i in _functorch.get_interpreter_stack() or () if i.key() == _GRAD), None)
    return None if outer is None else _functorch.CGradInterpreterPtr(outer).prevGradMode()


class _CallState(threading.local):
    tracked = False  # functional_call's inputs are tracked beneath (``tracked_call``)


_CALL = _CallState()


@contextlib.contextmanager
def tracked_call():
    """Every op in the block takes the exact path beneath the transforms (``tracked_beneath``):
    ``functional_call`` enters it when one of its inputs is tracked, so a layer whose own factors
    and weights give no sign (an unfrozen base) still leaves its graph beneath."""
    previous, _CALL.tracked = _CALL.tracked, True
    try:
        yield
    finally:
        _CALL.tracked = previous


def tracked_beneath(factors: tuple = (), weight: Optional[Tensor] = None, activations: tuple = (),
                    *, inputs: tuple = ()) -> bool:
    """Plain autograd records beneath the torch.func transforms, eagerly: the outermost grad level
    was entered in grad mode, and a call's ``inputs`` or a layer (``_op_tracked``) shows it. That
    is ``torch.autograd`` over ``torch.func.grad``'s result (MAML's outer step): the ops under the
    level must then leave their graph beneath it, and their backward must be differentiable."""
    if not _entered_in_grad_mode():
        return False
    if _CALL.tracked or any(map(_requires_grad_beneath, inputs)) or _op_tracked(factors, weight, activations):
        _warn_tracked()
        return True
    return False


_warned_tracked = False


def _warn_tracked() -> None:
    global _warned_tracked
    if _warned_tracked:
        return
    _warned_tracked = True
    warnings.warn(
        "fastaf: tensors that require grad reach its ops beneath torch.func's grad level (LoRA factors, "
        "inputs or activations): fastaf keeps plain autograd's graph beneath the level on its exact, "
        "slower per-layer path, so that torch.autograd over the result is exact (MAML). Pass detached "
        "tensors to torch.func if you do not differentiate its result again.",
        stacklevel=3,
    )


def _differentiated(dy: Tensor, *, factors: tuple = (), weight: Optional[Tensor] = None, x: Optional[Tensor] = None,
                    call: bool = False) -> bool:
    """The backward itself is being differentiated: under torch.func, a second grad (or jvp) level
    is active (one level's backward runs with create_graph, which alone needs no higher order) or
    plain autograd records beneath the levels (``tracked_beneath``; ``call``: the forward ran in
    a ``tracked_call``); under plain autograd, create_graph (the engine runs a backward in grad
    mode exactly then). A constant cotangent counts too: from ``y.sum()``, dA = s * (dy @ B).T @ x
    still depends on B.

    Inside ``torch.compile``: a backward traced in grad mode (a grad level's, which runs with
    create_graph; the joint's first-order backward runs without), under a grad level entered in
    grad mode, where the layer shows plain autograd beneath (``_op_tracked``), as an outer
    autograd over a compiled ``torch.func.grad`` asks. ``functional_call``'s inputs are not seen
    there: with an unfrozen base, a layer whose own factors are not tracked runs first order."""
    if torch.compiler.is_compiling():
        return (torch.is_grad_enabled() and _entered_in_grad_mode() is not False
                and _op_tracked(factors, weight, (x, dy)))
    stack = _functorch.get_interpreter_stack()
    if stack:
        levels = sum(i.key() in (_GRAD, _JVP) for i in stack)
        return levels >= 2 or call or tracked_beneath(factors, weight, (x, dy))
    return torch.is_grad_enabled()


def _sum_to(grad: Tensor, shape: torch.Size) -> Tensor:
    """Reduce a per-group gradient (G, ...) to an input that broadcast over groups (1, ...)."""
    return grad.sum(0, keepdim=True) if grad.shape[0] != shape[0] else grad


def _vjp_weight_bias(dy2: Tensor, x2: Tensor, needs_weight: bool, needs_bias: bool) -> tuple:
    """Gradients of the frozen weight and bias, only when they ask: (N, K) and (N,) or None."""
    return (dy2.transpose(-1, -2) @ x2 if needs_weight else None), (dy2.sum(-2) if needs_bias else None)


class _LoRALinearFn(torch.autograd.Function):
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
        ctx.save_for_backward(x, weight, a, b, output[1], seed)
        ctx.scale, ctx.dropout_p, ctx.impl = scale, dropout_p, impl
        ctx.call = _CALL.tracked
        ctx.bias_shape = None if bias is None else bias.shape
        ctx.mark_non_differentiable(output[1])
        ctx.set_materialize_grads(False)  # h is never differentiated: skip a zero-fill per backward

    @staticmethod
    def backward(ctx, dy, _dh):
        x, weight, a, b, h, seed = ctx.saved_tensors
        if dy is None:
            return (None,) * 9
        needs = ctx.needs_input_grad
        operands = (dy, x, weight, a, b, h, seed)
        if _differentiated(dy, factors=(a, b), weight=weight, x=x, call=ctx.call):
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
        out = _LoRALinearFn.apply(x, weight, bias, a, b, scale, dropout_p, seed, impl)
        return _unfold(info.batch_size, out)


def _traced_apply(fn: type[torch.autograd.Function]) -> Any:
    """``fn.apply`` as one opaque call to dynamo (``torch.compiler.allow_in_graph``), to be bound
    in ``fn``'s module as ``<fn name>_apply``.

    Dynamo would otherwise speculate ``fn``'s forward and backward as bytecode at every adapted
    layer. Opaque, AOTAutograd traces ``fn`` itself, on fake tensors, into the same graphs (the
    forward's and backward's registered ops). On the H100 host (torch 2.11) the 1B model's
    compiled ``grad_and_value`` step took 45-46 s to trace before, 31-36 s after (dynamo and
    AOTAutograd; 58 s against 100 s with Inductor), with equal step times. Eagerly it is
    ``fn.apply`` behind one more Python call (the paths that reach a Function eagerly, vmap and
    grad of grad, are not the host-bound ones); under ``backend="eager"`` the call runs eagerly,
    on the direct path.
    """
    def apply(*args: Any) -> Any:
        return fn.apply(*args)

    # named as the caller binds it, in fn's module: AOTAutograd's cache pickles the graphs' calls
    # by module and name, which must find this very function
    apply.__name__ = apply.__qualname__ = f"{fn.__name__}_apply"
    apply.__module__ = fn.__module__
    _mark_cacheable(apply)
    return torch.compiler.allow_in_graph(apply)


def _mark_cacheable(apply: Any) -> None:
    """Let AOTAutograd's cache keep the graphs that call ``apply``, keyed by fastaf's source.

    AOTAutograd caches only graphs whose calls it can vouch for; an opaque function it cannot,
    so every compiled fastaf forward+backward was traced again in each new process (on the CPU,
    a 1-layer model's warm first step 6.7 s against the base model's 3.7-4.1 s). What ``apply``
    traces to is fixed by its inputs (in the cache key), the grad mode and fastaf's code: the key
    given here is a hash of that code, so an edited or upgraded fastaf misses. Kernel choices
    are made inside the registered ops when they run, not in the cached graphs."""
    marked = getattr(getattr(torch, "_inductor").config, "unsafe_marked_cacheable_functions", None)
    if isinstance(marked, dict):  # torch's hook for exactly this (a name -> key dict since 2.6)
        marked[f"{apply.__module__}.{apply.__name__}"] = _source_key()


@functools.cache
def _source_key() -> str:
    """sha256 of fastaf's Python sources (the functional core and the kernels), read once."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted((*root.glob("functional/*.py"), *root.glob("kernels/*.py"))):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return f"fastaf-{digest.hexdigest()[:16]}"


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


_NO_SCOPE = contextlib.nullcontext()  # stateless: one instance serves every call and thread


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
            unwrap = _functorch._unwrap_for_grad
            x, weight, a, b = unwrap(x, level), unwrap(weight, level), unwrap(a, level), unwrap(b, level)
            bias = None if bias is None else unwrap(bias, level)
            seed = None if seed is None else unwrap(seed, level)
            saved_layer = _functorch.pop_dynamic_layer_stack()
        try:
            x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # (M, K)
            ctx.a_dtype, ctx.b_dtype = a.dtype, b.dtype
            # level 0: lora_linear's _direct_level found the operands plain already
            ctx.triton = (not level or _direct_ok(x2, weight, bias, a, b)) and _use_triton(impl, x2)
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
                _functorch.push_dynamic_layer_stack(saved_layer)
        # x as it came, not x2: a double backward's reshape of it is then part of the graph (a 3-D
        # x reshaped in here, where grad is off, lost every term through x)
        ctx.save_for_backward(x, weight, a, b, h, seed)
        ctx.level, ctx.scale, ctx.dropout_p, ctx.impl = level, scale, dropout_p, impl
        ctx.set_materialize_grads(False)
        return _functorch._wrap_for_grad(y, level) if level else y

    @staticmethod
    def backward(ctx, dy):
        if dy is None:
            return (None,) * 10
        x, weight, a, b, h, seed = ctx.saved_tensors
        need_x, need_w, need_bias, need_a, need_b = ctx.needs_input_grad[1:6]
        saved_layer = None
        if ctx.level:
            dy = _functorch._unwrap_for_grad(dy, ctx.level)
            saved_layer = _functorch.pop_dynamic_layer_stack()
        # Under a grad level functorch runs backward with create_graph; this VJP is first order
        # there. Plain autograd's double backward (create_graph) takes the reference's ops,
        # differentiable, with h recomputed from x.
        double = not ctx.level and _differentiated(dy)
        # plain autograd runs a first-order backward with grad off already: no scope to enter
        scope = torch.no_grad() if not double and torch.is_grad_enabled() else _NO_SCOPE
        try:
            with scope:
                dy2 = dy if dy.dim() == 2 else dy.reshape(-1, weight.shape[0])  # (M, N)
                x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # (M, K)
                if double:
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
                _functorch.push_dynamic_layer_stack(saved_layer)
        return None, dx if need_x else None, dweight, dbias, da, db, None, None, None, None


_unsafe_view = torch.ops.aten._unsafe_view.default


def _unflatten(y: Tensor, x: Tensor) -> Tensor:
    """A Function's (M, N) output y back to x's leading dims, (..., N). Not a view for autograd:
    models modify a layer's output in place (Falcon), which autograd forbids on a view made
    inside a custom Function."""
    if x.dim() == 2:
        return y
    shape = (*x.shape[:-1], y.shape[-1])
    return _unsafe_view(y, shape) if _direct_ok(y) else y.view(shape)
_direct_apply = _LoRALinearDirect.apply  # the C apply: no functorch dispatch, no argument binding
_LoRALinearFn_apply = _traced_apply(_LoRALinearFn)
_single_level_allowed = _functorch.get_single_level_autograd_function_allowed
_allow_single_level = _functorch.set_single_level_autograd_function_allowed


def _apply_single_level(apply: Any, level: int, *args: Any) -> Any:
    """``apply(level, *args)`` of a ``_SingleLevelFunction`` at grad level ``level`` (0: none)."""
    if not level:
        return apply(0, *args)
    # functorch refuses a _SingleLevelFunction under its transforms unless this flag is set;
    # it is set for this one call, as functorch's own grad rule does
    previous = _single_level_allowed()
    _allow_single_level(True)
    try:
        return apply(level, *args)
    finally:
        _allow_single_level(previous)


def _apply_direct(level: int, *args: Any) -> Tensor:
    return _apply_single_level(_direct_apply, level, *args)


@contextlib.contextmanager
def _below(level: int, *tensors: Optional[Tensor]):
    """Yield ``tensors`` unwrapped at grad level ``level`` and run the body below that level (its
    layer popped: new tensors come out plain), as ``_LoRALinearDirect`` does; level 0: as given."""
    if not level:
        yield tensors
        return
    unwrapped = tuple(None if t is None else _functorch._unwrap_for_grad(t, level) for t in tensors)
    layer = _functorch.pop_dynamic_layer_stack()
    try:
        yield unwrapped
    finally:
        _functorch.push_dynamic_layer_stack(layer)


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
    _check_use(x, weight, bias, lora, where)
    if lora.stacked:
        raise ValueError(
            f"{where}: stacked LoRA A {tuple(lora.A.shape)}; map over the stack with torch.func.vmap"
        )
    for name, t in (("A", lora.A), ("B", lora.B)):
        if t.device != x.device:
            raise ValueError(f"{where}: {name} {tuple(t.shape)} is on {t.device} but x is on {x.device}")


def _check_use(x: Tensor, weight: Tensor, bias: Optional[Tensor], lora: LoRA, where: str) -> None:
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
    return _lora_linear(x, weight, bias, lora, impl, training)


def routed_lora_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], lora: LoRA, impl: str,
                       training: bool, where: str) -> Tensor:
    """``lora_linear`` for a use of a weight whose LoRA a call fitted to it before it ran
    (``functional_call``'s routes: its stacking, shape and device checked against the weight, the
    impl against ``IMPLS``): only the use is checked here (x, and the bias the model passed).
    The checks are host time on every adapted layer's eager call."""
    x, weight, bias = _autocast(x, weight, bias)
    if not torch.compiler.is_compiling():
        _check_use(x, weight, bias, lora, where)
    return _lora_linear(x, weight, bias, lora, impl, training)


def _lora_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], lora: LoRA, impl: str, training: bool) -> Tensor:
    """``lora_linear`` on checked operands."""
    p = float(lora.dropout) if training else 0.0
    seed = torch.randint(0, 2**31 - 1, (1,), device=x.device) if p > 0.0 else None
    level = _direct_level(x, weight, bias, lora.A, lora.B, factors=(lora.A, lora.B), weight=weight, x=x)
    if level == 0:  # plain eager autograd: the Function's C apply, no level flag to set
        return _direct_apply(0, x, weight, bias, lora.A, lora.B, float(lora.scale), p, seed, impl)
    if level > 0:
        return _apply_direct(level, x, weight, bias, lora.A, lora.B, float(lora.scale), p, seed, impl)
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
    y, _ = reference_fwd(*args[:-1]) if _higher_order_traced() else _LoRALinearFn_apply(*args)
    return y.reshape(*lead, weight.shape[0])
