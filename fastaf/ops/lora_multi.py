"""Per-example adapters from a stack: example i of the batch uses adapter ``ids[i]``.

    y[i] = x[i] @ W.T + b + s * (x[i] @ A[ids[i]].T) @ B[ids[i]].T,   ids[i] = -1: the base alone

x (batch, ..., K), W (N, K), stacked A (n, R, K), B (n, N, R) (``fastaf.stack``: one scale per
path, ranks zero-padded), ids (batch,) integers in [-1, n). Each example is one *segment* of
``S = x.numel() // (batch * K)`` rows. Layers of this file, bottom up:

1. The torch reference: one gather of each segment's factors and two batched GEMMs.
2. Two ``torch.library`` ops, ``fastaf::lora_multi_fwd`` / ``fastaf::lora_multi_bwd``, on the
   grouped Triton kernels (``fastaf.kernels.lora_multi``: the base GEMM once, the LoRA per
   segment, ids read on the device) or on the reference, with fakes for ``torch.compile``.
3. ``_LoRAMultiDirect`` (a single-level Function, as ``_LoRALinearDirect``) for plain autograd
   and one ``torch.func.grad`` level; ``_LoRAMultiFn`` for tracers and other transforms.
4. ``lora_linear_multi``, what ``functional_call(..., adapter_ids=)`` calls per layer.

LoRA dropout in training takes the reference (a fresh torch dropout mask per call).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..kernels import atomics_ok
from .._adapter import LoRA
from .lora_linear import IMPLS, _autocast
from ._levels import (_apply_single_level, _below, _CALL, _differentiated, _direct_level, _direct_ok,
                      _double_backward, _higher_order_traced, interpreter_stack, level_left, level_token, note_factors,
                      own_level, _tangent_sum, _traced_apply, _VMAP, wrap_for_grad)

# ---- 1. reference ----------------------------------------------------------------------------


def check_rows(ids: Tensor | tuple[Tensor, ...], rows: int, where: str, *, flattened: bool = False) -> Tensor:
    """The ids for a layer's input of ``rows`` rows, one id per row.

    ``ids``: (batch,), or a tuple of candidates for a call whose layers see the batch at more
    than one size, shortest first: ``fastaf.generate`` with beams or several returned sequences
    passes the ids as given (for the encoder of T5, BART or Whisper and LLaVA's vision tower,
    which generate runs on the rows as given) and the same ids repeated as generate repeats each
    row (the decoding steps); each layer takes the one whose length is its row count.
    ``flattened``: the layer flattened (batch, seq, K) to (batch * seq, K) in batch-major order
    (GPT-2's Conv1D before its addmm), so each id covers seq consecutive rows: the segments
    ``lora_linear_multi`` derives from the row count (of candidates, the longest that divides it).

    A row count that fits no ids is an error. A fitting one is not proof: a layer laid out
    time-first (seq, batch, K), or over tokens gathered per expert, whose row count happens to
    equal the number of ids (seq == batch), or, flattened, to be a multiple of it, runs with
    each id applied to the wrong rows, silently; only layers that lead with the batch are
    supported.
    """
    if isinstance(ids, tuple):
        return _pick_rows(ids, rows, where, flattened)
    if flattened and ids.shape[0] and rows % ids.shape[0] == 0:
        return ids  # batch-major rows: example i is rows i*seq .. (i+1)*seq, one segment each
    if rows != ids.shape[0]:
        raise ValueError(
            f"{where}: adapter_ids has {ids.shape[0]} entries but the layer's input has {rows} rows; "
            "adapter_ids needs layers whose first dimension is the batch"
        )
    return ids


def refuse_ids_under_vmap(where: str, what: str) -> None:
    """adapter_ids under torch.func.vmap is an error naming the way out; ``what``: the operand
    that shows it (an input, or a stack's slot as vmap hands it over)."""
    if any(i.key() == _VMAP for i in interpreter_stack() or ()):
        raise NotImplementedError(
            f"{where}: adapter_ids does not run under torch.func.vmap ({what}): vmap over the stack "
            "without adapter_ids (each vmapped call then takes one adapter), or pass adapter_ids without vmap")


def _pick_rows(candidates: tuple[Tensor, ...], rows: int, where: str, flattened: bool) -> Tensor:
    """``check_rows`` over candidate ids, shortest first: the one with ``rows`` entries, else,
    ``flattened``, the longest that divides ``rows`` (generate's decoding batch, over the rows as
    given: a decoder's Conv1D at seq 1 has as many rows as the expanded ids)."""
    for ids in candidates:
        if ids.shape[0] == rows:
            return ids
    if flattened:
        for ids in reversed(candidates):
            if ids.shape[0] and rows % ids.shape[0] == 0:
                return ids
    sizes = " or ".join(str(ids.shape[0]) for ids in candidates)
    raise ValueError(
        f"{where}: adapter_ids has {sizes} entries (as given, and repeated as generate repeats each row) but "
        f"the layer's input has {rows} rows; adapter_ids needs layers whose first dimension is the batch"
    )


def _segments(t: Tensor, ids: Tensor) -> Tensor:
    """(T, D) rows -> (len(ids), S, D) segments."""
    return t.reshape(ids.shape[0], t.shape[0] // max(ids.shape[0], 1), t.shape[-1])


def _gathered(a: Tensor, b: Tensor, ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """Each segment's factors as ``dtype``, A (n_seg, R, K) and B (n_seg, N, R), and its 0/1 gate
    (n_seg, 1, 1)."""
    slot = ids.clamp(min=0).long()
    return a[slot].to(dtype), b[slot].to(dtype), (ids >= 0).to(dtype)[:, None, None]


def reference_fwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], a: Tensor, b: Tensor, ids: Tensor,
                  scale: float) -> tuple[Tensor, Tensor]:
    """(y (T, N), h fp32 (T, R)): x (T, K) in len(ids) segments, a (n, R, K), b (n, N, R) in any
    float dtype (computed in x's)."""
    A, B, gate = _gathered(a, b, ids, x.dtype)
    h = torch.bmm(_segments(x, ids), A.transpose(1, 2)) * gate  # (n_seg, S, R)
    y = F.linear(x, weight, bias) + scale * torch.bmm(h, B.transpose(1, 2)).reshape(x.shape[0], weight.shape[0])
    return y, h.reshape(x.shape[0], a.shape[1]).float()


def reference_bwd(dy: Tensor, x: Tensor, weight: Tensor, a: Tensor, b: Tensor, h: Tensor, ids: Tensor,
                  scale: float, needs_dx: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dx (T, K) or (0, 0), dA (n, R, K), dB (n, N, R) in the factors' dtypes): slots shared by
    segments add up."""
    A, B, gate = _gathered(a, b, ids, x.dtype)
    dys, hs = _segments(dy, ids), _segments(h.to(dy.dtype), ids)
    dh = scale * torch.bmm(dys, B) * gate  # (n_seg, S, R)
    slot = ids.clamp(min=0).long()
    db = torch.zeros(b.shape, device=b.device, dtype=torch.float32).index_add(
        0, slot, (scale * torch.bmm(dys.transpose(1, 2), hs) * gate).float()).to(b.dtype)
    da = torch.zeros(a.shape, device=a.device, dtype=torch.float32).index_add(
        0, slot, torch.bmm(dh.transpose(1, 2), _segments(x, ids)).float()).to(a.dtype)
    dx = (dy @ weight + torch.bmm(dh, A).reshape(x.shape)) if needs_dx else dy.new_empty(0, 0)
    return dx, da, db


def _differentiable_bwd(dy: Tensor, x: Tensor, weight: Tensor, a: Tensor, b: Tensor, ids: Tensor, scale: float,
                        needs_dx: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``reference_bwd`` for a backward that is itself differentiated: h recomputed from x, so
    its dependence on x and A is part of the graph."""
    A, _, gate = _gathered(a, b, ids, x.dtype)
    h = (torch.bmm(_segments(x, ids), A.transpose(1, 2)) * gate).reshape(x.shape[0], a.shape[1])
    return reference_bwd(dy, x, weight, a, b, h, ids, scale, needs_dx)


# ---- 2. torch.library ops ----------------------------------------------------------------------

_kernels_module = None


def _kernels():
    """``fastaf.kernels.lora_multi``, imported on first use: triton loads only when a kernel runs."""
    global _kernels_module
    if _kernels_module is None:
        from ..kernels import lora_multi

        _kernels_module = lora_multi
    return _kernels_module


def _use_kernels(impl: str, x: Tensor, a: Tensor) -> bool:
    """Whether lora_multi's Triton kernels run. They sum h and dh with fp32 atomics where a
    reduction is split: under torch's deterministic mode impl="auto" takes the reference (torch
    ops) and a forced impl="triton" alerts (``atomics_ok``)."""
    if impl == "torch" or x.shape[0] == 0:
        return False
    if impl == "triton":
        if not _kernels().supported(x, a):
            raise RuntimeError(f"impl='triton': the grouped kernels cannot run on x {tuple(x.shape)} {x.dtype} "
                               f"on {x.device} with a stack of rank {a.shape[1]}")
    elif not (x.is_cuda and _kernels().supported(x, a)):
        return False
    return atomics_ok(impl, "lora_linear_multi (many adapters)")


def _fwd_impl(x: Tensor, weight: Tensor, bias: Optional[Tensor], a: Tensor, b: Tensor, ids: Tensor,
                   scale: float, impl: str) -> tuple[Tensor, Tensor]:
    """(y (T, N), h fp32 (T, R)); see ``reference_fwd``."""
    if _use_kernels(impl, x, a):
        return _kernels().multi_fwd(x, weight, bias, a, b, ids, scale)
    return reference_fwd(x, weight, bias, a, b, ids, scale)


lora_multi_fwd = torch.library.custom_op("fastaf::lora_multi_fwd", mutates_args=())(_fwd_impl)


@lora_multi_fwd.register_fake
def _(x, weight, bias, a, b, ids, scale, impl):
    return x.new_empty(x.shape[0], weight.shape[0]), x.new_empty(x.shape[0], a.shape[1], dtype=torch.float32)


def _bwd_impl(dy: Tensor, x: Tensor, weight: Tensor, a: Tensor, b: Tensor, h: Tensor, ids: Tensor,
                   scale: float, needs_dx: bool, impl: str) -> tuple[Tensor, Tensor, Tensor]:
    """(dx (T, K), or (0, 0) when not needed; dA (n, R, K); dB (n, N, R))."""
    if _use_kernels(impl, x, a):
        dx, da, db = _kernels().multi_bwd(dy, x, weight, a, b, h, ids, scale, needs_dx)
        return (dy.new_empty(0, 0) if dx is None else dx), da, db
    return reference_bwd(dy, x, weight, a, b, h, ids, scale, needs_dx)


lora_multi_bwd = torch.library.custom_op("fastaf::lora_multi_bwd", mutates_args=())(_bwd_impl)


@lora_multi_bwd.register_fake
def _(dy, x, weight, a, b, h, ids, scale, needs_dx, impl):
    dx = dy.new_empty(x.shape) if needs_dx else dy.new_empty(0, 0)
    return dx, a.new_empty(a.shape), b.new_empty(b.shape)


# ---- 3. the differentiable op ------------------------------------------------------------------


class _LoRAMultiFn(torch.autograd.Function):
    """Custom VJP of the grouped LoRA linear: x (T, K), a / b stacked (any float dtype), ids per segment."""

    @staticmethod
    def forward(x, weight, bias, a, b, ids, scale, impl):
        # eager calls skip the dispatcher (~150 us of host time per call); tracers need the op
        fwd = _fwd_impl if _direct_ok(x, weight, bias, a, b, ids) else torch.ops.fastaf.lora_multi_fwd
        return fwd(x, weight, bias, a, b, ids, scale, impl)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, a, b, ids, scale, impl = inputs
        note_factors(a, b)
        ctx.own = own_level()
        ctx.save_for_backward(x, weight, a, b, output[1], ids)
        ctx.scale, ctx.impl, ctx.has_bias = scale, impl, bias is not None
        ctx.call = _CALL.tracked
        ctx.mark_non_differentiable(output[1])
        ctx.set_materialize_grads(False)
        ctx.save_for_forward(x, weight, bias, a, b, ids)

    @staticmethod
    def jvp(ctx, x_t, weight_t, bias_t, a_t, b_t, *_):
        """Forward mode (torch.func.jvp, jvp of grad, linearize): the tangent of ``reference_fwd``,
        written out. Per segment, with its slot's factors A, B, its gate g (0 for id -1) and
        h = g * x @ A.T,

            y_t = x_t @ W.T + x @ W_t.T + bias_t + s * ((g * (x_t @ A.T + x @ A_t.T)) @ B.T + h @ B_t.T)

        a None tangent zero, its terms left out (``_tangent_sum``); a stack's tangent is gathered
        and cast to x's dtype as its factors are. (No dropout: training with it takes
        ``_reference_with_dropout``, plain torch.)"""
        x, weight, bias, a, b, ids = ctx.saved_tensors
        T, N = x.shape[0], weight.shape[0]
        A, B, gate = _gathered(a, b, ids, x.dtype)  # (n_seg, R, K), (n_seg, N, R), (n_seg, 1, 1)
        slot = ids.clamp(min=0).long()
        xs = _segments(x, ids)  # (n_seg, S, K)
        h_t = _tangent_sum(None if x_t is None else torch.bmm(_segments(x_t, ids), A.transpose(1, 2)),
                          None if a_t is None else torch.bmm(xs, a_t[slot].to(x.dtype).transpose(1, 2)))
        h_t = None if h_t is None else h_t * gate  # (n_seg, S, R)
        lora_t = _tangent_sum(None if h_t is None else torch.bmm(h_t, B.transpose(1, 2)),
                             None if b_t is None else torch.bmm(torch.bmm(xs, A.transpose(1, 2)) * gate,  # h
                                                                b_t[slot].to(x.dtype).transpose(1, 2)))
        y_t = _tangent_sum(None if x_t is None else F.linear(x_t, weight),
                          None if weight_t is None else F.linear(x, weight_t),
                          bias_t,  # (N,): broadcasts over the rows
                          None if lora_t is None else ctx.scale * lora_t.reshape(T, N))
        y_t = x.new_zeros(T, N) if y_t is None else y_t.expand(T, N).contiguous()
        return y_t, None  # h is marked non-differentiable

    @staticmethod
    def backward(ctx, dy, _dh):
        if dy is None:
            return (None,) * 8
        x, weight, a, b, h, ids = ctx.saved_tensors
        needs = ctx.needs_input_grad
        # grad of grad, or plain autograd beneath the levels
        if _differentiated(dy, factors=(a, b), weight=weight, x=x, call=ctx.call, own=ctx.own):
            dx, da, db = _differentiable_bwd(dy, x, weight, a, b, ids, ctx.scale, needs[0])
        else:
            bwd = _bwd_impl if _direct_ok(dy, x, weight, a, b, h, ids) else torch.ops.fastaf.lora_multi_bwd
            with torch.no_grad():  # first order: keep the call a plain op call (see LoRALinearFn)
                dx, da, db = bwd(dy, x, weight, a, b, h, ids, ctx.scale, needs[0], ctx.impl)
        dw = dy.transpose(0, 1) @ x if needs[1] else None
        dbias = dy.sum(0) if needs[2] and ctx.has_bias else None
        # dA and dB unconditionally: under torch.compile, a stack that torch.func.grad wraps as a
        # graph input read as not requiring grad here when dynamo traced this backward (before
        # _traced_apply), and a None would silently drop its gradient
        return (dx if needs[0] else None), dw, dbias, da, db, None, None, None


class _LoRAMultiDirect(torch.autograd.function._SingleLevelFunction):
    """The same VJP for plain eager autograd and one ``torch.func.grad`` level, as
    ``_LoRALinearDirect``: the new-style ``apply`` binds its arguments with ``inspect.signature``
    on every call (~30 us of host time per layer), and functorch builds a Function class per call."""

    @staticmethod
    def forward(ctx, level, x, weight, bias, a, b, ids, scale, impl):
        with _below(level, x, weight, bias, a, b, ids) as (x, weight, bias, a, b, ids):
            y, h = _fwd_impl(x, weight, bias, a, b, ids, scale, impl)
        ctx.save_for_backward(x, weight, a, b, h, ids)
        ctx.level, ctx.scale, ctx.impl, ctx.has_bias = level, scale, impl, bias is not None
        ctx.token = level_token(level)
        ctx.set_materialize_grads(False)
        return wrap_for_grad(y, level) if level else y

    @staticmethod
    def backward(ctx, dy):
        if dy is None:
            return (None,) * 9
        x, weight, a, b, h, ids = ctx.saved_tensors
        need_x, need_w, need_bias, need_a, need_b = ctx.needs_input_grad[1:6]
        left = level_left(ctx.level, ctx.token)  # a vjp_fn's backward after its level
        double = _double_backward(ctx.level, dy, left=left)  # differentiable reference
        with _below(ctx.level, dy, left=left) as (dy,), (torch.enable_grad() if double else torch.no_grad()):
            if double:
                dx, da, db = _differentiable_bwd(dy, x, weight, a, b, ids, ctx.scale, need_x)
            else:
                dx, da, db = _bwd_impl(dy, x, weight, a, b, h, ids, ctx.scale, need_x, ctx.impl)
            dw = dy.transpose(0, 1) @ x if need_w else None
            dbias = dy.sum(0) if need_bias and ctx.has_bias else None
        return (None, dx if need_x else None, dw, dbias, da if need_a else None, db if need_b else None,
                None, None, None)


_multi_direct_apply = _LoRAMultiDirect.apply  # the C apply
_LoRAMultiFn_apply = _traced_apply(_LoRAMultiFn)


# ---- 4. the public function --------------------------------------------------------------------


def _reference_with_dropout(x: Tensor, weight: Tensor, bias: Optional[Tensor], lora: LoRA, ids: Tensor) -> Tensor:
    """Training with LoRA dropout: a torch dropout mask on the LoRA branch's input, autograd's VJP."""
    base = F.linear(x, weight, bias)
    A, B, gate = _gathered(lora.A, lora.B, ids, x.dtype)
    xs = F.dropout(_segments(x.reshape(-1, x.shape[-1]), ids), lora.dropout, training=True)
    delta = torch.bmm(torch.bmm(xs, A.transpose(1, 2)), B.transpose(1, 2)) * (gate * lora.scale)
    return base + delta.reshape(base.shape)


def lora_linear_multi(x: Tensor, weight: Tensor, bias: Tensor | None, lora: LoRA, ids: Tensor, *,
                      training: bool = False, impl: str = "auto", where: str = "lora_linear_multi") -> Tensor:
    """``F.linear(x, weight, bias)`` plus, for each example i, the LoRA of slot ``ids[i]``.

    Args:
        x: (batch, ..., K); example i is the S = x.numel() // (batch * K) rows x[i].
        weight: (N, K); bias: (N,) or None.
        lora: stacked, A (n, R, K) and B (n, N, R) in any float dtype: the kernels read them as
            they are (fp32 master factors need no cast), the reference casts to x's dtype.
        ids: (batch,) int32/int64 in [-1, n); -1 is the base model. Moved to x's device.
        training: apply ``lora.dropout`` to the LoRA branch's input.
        impl: "auto" (grouped kernels on CUDA, the reference elsewhere), "triton" or "torch".
        where: name used in error messages (functional_call passes the module path).
    Returns:
        (batch, ..., N).
    """
    if impl not in IMPLS:
        raise ValueError(f"{where}: impl must be one of {IMPLS}, got {impl!r}")
    if not torch.compiler.is_compiling():
        refuse_ids_under_vmap(where, f"x {tuple(x.shape)}")
    # the kernels read ids[seg] at unit stride, on x's device
    ids = ids.to(x.device, non_blocking=True).contiguous()
    x, weight, bias = _autocast(x, weight, bias)
    if training and lora.dropout:
        return _reference_with_dropout(x, weight, bias, lora, ids)
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    args = (x2, weight, bias, lora.A, lora.B, ids, float(lora.scale), impl)
    level = _direct_level(x2, weight, bias, lora.A, lora.B, factors=(lora.A, lora.B), weight=weight, x=x2)
    if level < 0 and torch.compiler.is_compiling() and not torch.is_grad_enabled() and not _higher_order_traced():
        # traced inference (a compiled decoding step): the decode kernels, no zeroed h, no Function
        from .lora_decode import lora_multi_decode_linear, multi_decodes, multi_fused

        if multi_decodes(x2, weight, lora, impl):
            y = lora_multi_decode_linear(x2, weight, bias, lora.A, lora.B, ids, float(lora.scale),
                                         multi_fused(traced=True))
            return y if x.dim() == 2 else y.view(*x.shape[:-1], weight.shape[0])
    if level == 0 and not torch.is_grad_enabled():
        # eager inference (a prefill with ids): nothing to record, so no Function (its apply is
        # host time at every adapted layer); the forward it would run, h dropped
        y = _fwd_impl(*args)[0]
    elif level >= 0:
        y = _apply_single_level(_multi_direct_apply, level, *args)
    else:
        y = _LoRAMultiFn_apply(*args)[0]
    return y if x.dim() == 2 else y.view(*x.shape[:-1], weight.shape[0])
