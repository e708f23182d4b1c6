"""The LoRA linear over a 4-bit weight dequantized inside the op:
``y = x @ deq(W).T + bias + scale * (dropout(x) @ A.T) @ B.T``.

A bitsandbytes NF4 / FP4 weight (``Linear4bit``: QLoRA's base) is packed two values a byte with
one absmax per block of 64 (``blocksize``), the absmaxes themselves 8-bit quantized under double
quantization. This op dequantizes it in one launch of fastaf's kernel (``kernels.dequant_4bit``; the
registered op ``fastaf::dequant_4bit`` under tracers and transforms), or with bitsandbytes' registered
ops where the kernel cannot run (``torch.ops.bitsandbytes``), and runs fastaf's fused LoRA linear on the
dense weight (``lora_linear``'s implementations: the Triton kernels on CUDA, the reference
elsewhere). Nothing dense is kept: the backward dequantizes again for dX, and eagerly on CUDA each
dequantization writes into one buffer per device, dtype and stream, reused by every layer
(no bf16 copy of the model, no allocation per layer). On the H200
(``bench/results/dequant-4bit.csv``) bitsandbytes dequantized a 4096 x 14336 NF4 weight in 0.076 ms
against 0.69 ms for its 4096-row GEMM.

Shapes: x (M, K); packed weight (ceil(N * K / 2), 1) uint8; bias (N,) | None; A (R, K); B (N, R)
-> y (M, N). The op is a new-style ``autograd.Function`` (``setup_context``): plain autograd,
``torch.func.grad`` and ``torch.compile`` take it; vmap does not (under vmap the caller dequantizes
and runs ``F.linear`` plus the LoRA as a branch: ``intercept.use``).
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Optional

import torch
from torch import Tensor

from .. import _config
from .._adapter import LoRA
from .lora_linear import _as_dtype, _autocast, _direct_bwd, _direct_fwd, _kernel_factor, _use_triton, check_use
from ._levels import _direct_ok, _traced_apply, interpreter_stack


@dataclasses.dataclass(frozen=True)
class Layout4bit:
    """What dequantizing one 4-bit weight needs besides its tensors.

    ``shape`` (N, K) and ``dtype`` are the dense weight's; ``nested_blocksize`` is the block size
    of the absmaxes' own 8-bit quantization (double quantization), 0 without it."""

    blocksize: int
    quant_type: str  # "nf4" or "fp4"
    shape: tuple[int, int]
    dtype: torch.dtype
    nested_blocksize: int = 0


@dataclasses.dataclass(frozen=True)
class Packed4bit:
    """One 4-bit weight: its layout and tensors. ``absmax`` is fp32 (one per block), or uint8
    under double quantization, with ``absmax2`` (fp32), ``code2`` (256 fp32) and ``offset`` (a
    0-d fp32 tensor) to dequantize it; those three are None without it."""

    layout: Layout4bit
    packed: Tensor
    absmax: Tensor
    absmax2: Optional[Tensor] = None
    code2: Optional[Tensor] = None
    offset: Optional[Tensor] = None

    @property
    def tensors(self) -> tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
        return self.packed, self.absmax, self.absmax2, self.code2, self.offset


_buffers: dict[tuple, Tensor] = {}  # (device, dtype, stream) -> one flat buffer, grown to the largest weight
_buffer_lock = threading.Lock()  # held from a dequantization into a buffer until its reader is enqueued


def _buffer(shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> Optional[Tensor]:
    """A reused (N, K) view of the one buffer of this device, dtype and stream, or None (allocate):
    on the CPU, under a tracer (the compiler plans its own memory) and inside a CUDA-graph capture
    (a replay must not share it with eager calls). One buffer, not one per shape: at any moment one
    dense weight is alive, as where each layer allocates its own (bitsandbytes' path, whose peak
    memory this matches); the forward and autograd's backward thread take turns on it (the lock,
    and the stream orders the kernels)."""
    if device.type != "cuda" or torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
        return None
    key = (device, dtype, torch.cuda.current_stream(device).stream_id)
    numel = shape[0] * shape[1]
    buf = _buffers.get(key)
    if buf is None or buf.numel() < numel:
        buf = _buffers[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel].view(shape)


_kernel_module = None


def _kernel():
    """``fastaf.kernels.dequant_4bit``, imported on first use (triton loads with it)."""
    global _kernel_module
    if _kernel_module is None:
        from ..kernels import dequant_4bit

        _kernel_module = dequant_4bit
    return _kernel_module


def _dequant_kernel_impl(packed: Tensor, absmax: Tensor, absmax2: Optional[Tensor], code2: Optional[Tensor],
                         offset: Optional[Tensor], quant_type: str, blocksize: int, nested_blocksize: int,
                         shape: list[int], dtype: torch.dtype) -> Tensor:
    """``fastaf::dequant_4bit``: the kernel into a new tensor (the op a trace records)."""
    out = torch.empty(shape, dtype=dtype, device=packed.device)
    return _kernel().dequant_4bit(packed, absmax, absmax2, code2, offset, quant_type, blocksize, nested_blocksize, out)


dequant_4bit_op = torch.library.custom_op("fastaf::dequant_4bit", mutates_args=())(_dequant_kernel_impl)


@dequant_4bit_op.register_fake
def _(packed, absmax, absmax2, code2, offset, quant_type, blocksize, nested_blocksize, shape, dtype):
    return packed.new_empty(shape, dtype=dtype)


def dequantize(layout: Layout4bit, packed: Tensor, absmax: Tensor, absmax2: Optional[Tensor],
               code2: Optional[Tensor], offset: Optional[Tensor], *, reuse: bool = False) -> Tensor:
    """The dense (N, K) weight in ``layout.dtype``: fastaf's one-launch kernel on CUDA (or
    interpreted), else bitsandbytes' ops. ``reuse``: into the shared buffer (valid until the next
    dequantization on this device and stream: hold ``_buffer_lock`` until its reader is enqueued)."""
    shape = list(layout.shape)
    if layout.shape[0] * layout.shape[1] % 2 == 0 and _kernel_ok(packed, layout):
        # traced, or under a functorch transform (which wraps the output it would allocate): the registered op
        if not _direct_ok(packed, absmax, absmax2, code2, offset) or interpreter_stack():
            return torch.ops.fastaf.dequant_4bit(packed, absmax, absmax2, code2, offset, layout.quant_type,
                                                 layout.blocksize, layout.nested_blocksize, shape, layout.dtype)
        buf = _buffer(layout.shape, layout.dtype, packed.device) if reuse else None
        out = torch.empty(layout.shape, dtype=layout.dtype, device=packed.device) if buf is None else buf
        return _kernel().dequant_4bit(packed, absmax, absmax2, code2, offset, layout.quant_type, layout.blocksize,
                                      layout.nested_blocksize, out)
    if layout.nested_blocksize:
        absmax = torch.ops.bitsandbytes.dequantize_blockwise(absmax, absmax2, code2, layout.nested_blocksize,
                                                             torch.float32) + offset
    buf = _buffer(layout.shape, layout.dtype, packed.device) if reuse else None
    args = (packed, absmax, layout.blocksize, layout.quant_type, shape, layout.dtype)
    if buf is None:
        return torch.ops.bitsandbytes.dequantize_4bit.default(*args)
    torch.ops.bitsandbytes.dequantize_4bit.out(*args, out=buf)
    return buf


def _kernel_ok(packed: Tensor, layout: Layout4bit) -> bool:
    """fastaf's kernel takes the weight: on CUDA or interpreted (``FASTAF_DEQUANT_KERNEL``)."""
    if not _config.flags().dequant_kernel:
        return False
    return _kernel().supported(packed, layout.blocksize)


def _dense(layout: Layout4bit, tensors: tuple, dtype: torch.dtype) -> Tensor:
    """The weight in the op's compute ``dtype`` (a cast only where the layout's differs)."""
    w = dequantize(layout, *tensors, reuse=layout.dtype == dtype)
    return w if w.dtype == dtype else w.to(dtype)


def _fwd(x, w, bias, a, b, scale, dropout_p, seed, impl):
    """(y (M, N), h (M, R)) of the fused LoRA linear on a dense ``w``."""
    if not _direct_ok(x, w, bias, a, b, seed):  # traced: the registered op (its kernels are opaque)
        y, h = torch.ops.fastaf.lora_linear_fwd(x[None], w[None], None if bias is None else bias[None], a[None],
                                                b[None], scale, dropout_p, seed, impl)
        return y[0], h[0]
    triton = _use_triton(impl, x)
    cast = _kernel_factor if triton else _as_dtype  # the kernels read fp32 master factors as they are
    return _direct_fwd(x, w, bias, cast(a, x.dtype), cast(b, x.dtype), scale, dropout_p, seed, impl, triton)


def _bwd(dy, x, w, a, b, h, scale, dropout_p, seed, needs_dx, impl):
    """(dx (M, K) or empty, dA (R, K) in a's dtype, dB (N, R) in b's dtype) on a dense ``w``."""
    if not _direct_ok(dy, x, w, a, b, h, seed):
        dx, da, db = torch.ops.fastaf.lora_linear_bwd(dy[None], x[None], w[None], a[None], b[None], h[None], scale,
                                                      dropout_p, seed, needs_dx, impl)
        return dx[0], da[0], db[0]
    triton = _use_triton(impl, x)
    cast = _kernel_factor if triton else _as_dtype
    dx, da, db = _direct_bwd(dy, x, w, cast(a, x.dtype), cast(b, x.dtype), h, scale, dropout_p, seed, needs_dx, impl,
                             triton)
    return dx, _as_dtype(da, a.dtype), _as_dtype(db, b.dtype)


class LoRALinear4bitFn(torch.autograd.Function):
    """The VJP: the packed weight is saved, never the dense one; the backward dequantizes again.
    The layout comes as its fields (plain constants: ``_traced_apply`` hands them to the graph)."""

    @staticmethod
    def forward(x, bias, a, b, packed, absmax, absmax2, code2, offset, blocksize, quant_type, shape, dtype, nested,
                scale, dropout_p, seed, impl):
        layout = Layout4bit(blocksize, quant_type, shape, dtype, nested)
        with _buffer_lock:
            w = _dense(layout, (packed, absmax, absmax2, code2, offset), x.dtype)
            return _fwd(x, w, bias, a, b, scale, dropout_p, seed, impl)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, bias, a, b, packed, absmax, absmax2, code2, offset, *layout, scale, dropout_p, seed, impl = inputs
        ctx.save_for_backward(x, a, b, output[1], seed, packed, absmax, absmax2, code2, offset)
        ctx.layout, ctx.scale, ctx.dropout_p, ctx.impl = Layout4bit(*layout), scale, dropout_p, impl
        ctx.mark_non_differentiable(output[1])
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, dy, _dh):
        x, a, b, h, seed, *quantized = ctx.saved_tensors
        if dy is None:
            return (None,) * 18
        needs = ctx.needs_input_grad
        with torch.no_grad(), _buffer_lock:  # first order (torch.func.grad runs the backward with create_graph)
            w = _dense(ctx.layout, tuple(quantized), x.dtype)
            dx, da, db = _bwd(dy, x, w, a, b, h, ctx.scale, ctx.dropout_p, seed, needs[0], ctx.impl)
        return (dx if needs[0] else None, dy.sum(0) if needs[1] else None, da if needs[2] else None,
                db if needs[3] else None) + (None,) * 14


LoRALinear4bitFn_apply = _traced_apply(LoRALinear4bitFn)


class _LoRALinear4bitDirect(torch.autograd.function._SingleLevelFunction):
    """``LoRALinear4bitFn`` for plain eager autograd (no functorch level, no tracer): the same
    forward and backward through the C apply, without ``Function.apply``'s argument binding and
    functorch checks (host time at every 4-bit layer of every step)."""

    @staticmethod
    def forward(ctx, *inputs):
        out = LoRALinear4bitFn.forward(*inputs)
        LoRALinear4bitFn.setup_context(ctx, inputs, out)
        return out

    @staticmethod
    def backward(ctx, dy, dh):
        return LoRALinear4bitFn.backward(ctx, dy, dh)


_direct_apply = _LoRALinear4bitDirect.apply  # the C apply


def lora_linear_4bit(x: Tensor, weight: Packed4bit, bias: Optional[Tensor], lora: LoRA, *, impl: str = "auto",
                     training: bool = True, where: str = "lora_linear_4bit") -> Tensor:
    """``x @ deq(weight).T + bias + lora.scale * (dropout(x) @ lora.A.T) @ lora.B.T``.

    Args:
        x: (..., K) in the compute dtype (the dense weight is dequantized to it; under autocast,
            autocast's dtype).
        weight: the packed 4-bit (N, K) weight.
        bias: (N,) in x's dtype, or None.
        lora: A (r, K), B (N, r), not stacked; gradients come back in the factors' own dtype.
        impl: "auto", "triton" or "torch", as ``lora_linear``'s.
        training: draw ``lora.dropout``.
        where: the module path, for errors.
    Returns:
        (..., N) in x's dtype.
    """
    N, K = weight.layout.shape
    x, _, bias = _autocast(x, None, bias)  # as autocast casts F.linear's operands (the weight follows x)
    if not torch.compiler.is_compiling():
        # the dense weight's shape and dtype, without dequantizing it
        check_use(x, _shape_of(weight, x), bias, lora, where)
    p = float(lora.dropout) if training else 0.0
    seed = torch.randint(0, 2**31 - 1, (1,), device=x.device) if p > 0.0 else None
    x2 = x.reshape(-1, K)
    layout = weight.layout
    args = (x2, bias, lora.A, lora.B, *weight.tensors, layout.blocksize, layout.quant_type, layout.shape, layout.dtype,
            layout.nested_blocksize, float(lora.scale), p, seed, impl)
    direct = not torch.compiler.is_compiling() and not interpreter_stack()
    y, _ = _direct_apply(*args) if direct else LoRALinear4bitFn_apply(*args)
    return y.view(*x.shape[:-1], N)


def _shape_of(weight: Packed4bit, x: Tensor) -> Tensor:
    """A tensor with the dense weight's shape, x's dtype and device (an expanded scalar: no memory),
    for ``check_use``."""
    return x.new_empty(()).expand(weight.layout.shape)
