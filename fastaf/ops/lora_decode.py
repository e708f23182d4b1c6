"""Inference calls of few rows: the LoRA linear with nothing but the math.

An eager inference call (grad off) of at most ``EAGER_ROWS`` rows of a CUDA tensor is bound by
host time: it skips the op's Function, dispatch lookup and sibling grouping
(``lora_linear_decode``); up to 512 rows of a 16-bit input one Triton launch computes the base
GEMM and the LoRA (``linear_rows``), the base model's one launch per linear; elsewhere cuBLAS's
GEMM (``F.linear``) takes one launch and the LoRA added to its output another (``add_lora_rows``);
with per-row adapter ids (``lora_multi_decode``; traced, ``fastaf::lora_multi_decode_linear``) up
to ``DECODE_ROWS`` rows cuBLAS's GEMM, a shrink grouped by slot and an expand, or with
``decode_multi_linear`` the shrink and the GEMM with each row's LoRA in its epilogue
(``multi_decodes``, ``multi_fused``), above that the grouped kernels' shrink and expand. A
traced one with grad off (a compiled decoding step, replayed from a CUDA graph) is bound by its
launches' fixed GPU latency: up to ``DECODE_ROWS`` rows of a 16-bit input it is one launch too
(``fastaf::lora_decode_linear``, ``traced_decode``), else the LoRA is added to cuBLAS's GEMM with
``fastaf::lora_decode_add``, two Triton launches (``fastaf.kernels.lora_decode``) that read fp32
master factors as they are (``added_lora``), or with siblings' shared shrink
(``lora_decode_shrink``, ``lora_decode_expand``; with ids ``lora_multi_decode_shrink``,
``lora_multi_decode_expanded``). The ``decode_linear`` and ``decode_kernel``
flags (``fastaf._config``) switch those off, for benchmarks to time them side by side; on a CPU
tensor (no Triton) the ops run the torch reference.

Layers, as in the other op files: the torch reference; the ``fastaf::`` ops with their fakes; the
functions the interception and the stateful layer call (``decoding``, ``lora_linear_decode``,
``linear_rows``, ``add_lora_rows``, ``multi_decodes``, ``lora_multi_decode``, ``added_lora``,
``linear_decodes``, ``traced_decode``).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from .. import _config
from .._adapter import LoRA
from ._levels import is_wrapped
from .lora_linear import _as_dtype, _autocast, check_use

DECODE_ROWS = 64  # rows (batch x new tokens) up to which an inference call is a decoding step
# rows up to which an eager inference call is host-bound (H200, Llama-3.2-1B shapes: the base
# GEMM of a projection at 1024 rows takes 10-50 us of GPU, an adapted layer's Python ~50 us)
EAGER_ROWS = 1024


# ---- 1. reference --------------------------------------------------------------------------


def reference_add(y: Tensor, x: Tensor, a: Tensor, b: Tensor, scale: float) -> Tensor:
    """y + scale * (x @ a.T) @ b.T, the factors cast to x's dtype. y (M, N), x (M, K), a (R, K),
    b (N, R) -> (M, N)."""
    h = x @ _as_dtype(a, x.dtype).T  # (M, R)
    return torch.addmm(y, h, _as_dtype(b, x.dtype).T, alpha=float(scale))


# ---- 2. the op -------------------------------------------------------------------------------


def _kernels():
    """``fastaf.kernels.lora_decode``, imported at the first call: triton loads only when needed."""
    from ..kernels import lora_decode

    return lora_decode


def _add_impl(y: Tensor, x: Tensor, a: Tensor, b: Tensor, scale: float) -> Tensor:
    """``reference_add`` as the decode kernels' two launches where they run (CUDA, or
    TRITON_INTERPRET=1), else the reference. A fresh (M, N) output: inside a compiled graph y may
    be read again."""
    kernels = _kernels()
    if kernels.supported(x, a, b):
        return kernels.add_lora(y, x, a, b, scale, out=torch.empty_like(y))
    return reference_add(y, x, a, b, scale)


lora_decode_add = torch.library.custom_op("fastaf::lora_decode_add", mutates_args=())(_add_impl)


@lora_decode_add.register_fake
def _add_fake(y: Tensor, x: Tensor, a: Tensor, b: Tensor, scale: float) -> Tensor:
    return torch.empty_like(y)


def part_shape(x: Tensor, factors: list[Tensor]) -> tuple[int, int, int, int]:
    """The shape of ``lora_decode_shrink``'s partials for x (M, K) and siblings' A (R_i, K):
    (siblings, splits of K, M, padded rank) where the kernels run, one split elsewhere."""
    rank = max(a.shape[0] for a in factors)
    kernels = _kernels()
    if kernels.supported(x, factors[0], factors[0]):
        return kernels.part_shape(x, rank, len(factors))
    return len(factors), 1, x.shape[0], rank


def _shrink_impl(x: Tensor, factors: list[Tensor]) -> Tensor:
    """Every sibling's partial h over x (M, K) in one launch (``kernels.lora_decode.shrink``), or
    the reference's x @ A_i.T as one split where the kernels do not run. fp32 ``part_shape``."""
    kernels = _kernels()
    if kernels.supported(x, factors[0], factors[0]):
        return kernels.shrink(x, list(factors))
    part = x.new_zeros(part_shape(x, factors), dtype=torch.float32)
    for i, a in enumerate(factors):
        part[i, 0, :, :a.shape[0]] = (x @ _as_dtype(a, x.dtype).T).float()
    return part


lora_decode_shrink = torch.library.custom_op("fastaf::lora_decode_shrink", mutates_args=())(_shrink_impl)


@lora_decode_shrink.register_fake
def _shrink_fake(x: Tensor, factors: list[Tensor]) -> Tensor:
    return x.new_empty(part_shape(x, factors), dtype=torch.float32)


def _expand_impl(y: Tensor, part: Tensor, index: int, b: Tensor, scale: float) -> Tensor:
    """y + scale * h @ b.T as a fresh (M, N) tensor, h sibling ``index``'s partials summed and
    rounded to y's dtype (``kernels.lora_decode.expand``, or the same in torch ops)."""
    kernels = _kernels()
    if kernels.supported(y, b.T, b):  # y's rows and dtype, b's dtype and rank (b.T in A's place)
        return kernels.expand(y, part[index], b, scale, out=torch.empty_like(y))
    h = part[index].sum(0)[:, :b.shape[1]].to(y.dtype)  # (M, R)
    return torch.addmm(y, h, _as_dtype(b, y.dtype).T, alpha=float(scale))


lora_decode_expand = torch.library.custom_op("fastaf::lora_decode_expand", mutates_args=())(_expand_impl)


@lora_decode_expand.register_fake
def _expand_fake(y: Tensor, part: Tensor, index: int, b: Tensor, scale: float) -> Tensor:
    return torch.empty_like(y)


def _linear_impl(x: Tensor, weight: Tensor, bias: Optional[Tensor], a: Tensor, b: Tensor, scale: float) -> Tensor:
    """x @ weight.T + bias + scale * (x @ a.T) @ b.T, x (M, K) -> (M, N): one Triton launch
    (``kernels.lora_decode.linear``) where it runs, else ``F.linear`` and the reference."""
    kernels = _kernels()
    if kernels.linear_supported(x, weight, a, b):
        return kernels.linear(x, weight, bias, a, b, scale)
    return reference_add(F.linear(x, weight, bias), x, a, b, scale)


lora_decode_linear = torch.library.custom_op("fastaf::lora_decode_linear", mutates_args=())(_linear_impl)


@lora_decode_linear.register_fake
def _linear_fake(x: Tensor, weight: Tensor, bias: Optional[Tensor], a: Tensor, b: Tensor, scale: float) -> Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


def _multi_linear_impl(x: Tensor, weight: Tensor, bias: Optional[Tensor], a: Tensor, b: Tensor, ids: Tensor,
                       scale: float, fused: bool) -> Tensor:
    """x @ weight.T + bias + scale * (x @ A[g].T) @ B[g].T per segment of slot g = ids[i], x (M, K)
    -> (M, N): ``_multi_kernels`` where they run, else the grouped op's reference."""
    if _kernels().multi_supported(x, weight, a, b):
        return _multi_kernels(x, weight, bias, a, b, ids, scale, fused)
    from .lora_multi import reference_fwd

    return reference_fwd(x, weight, bias, a, b, ids, scale)[0]


def _multi_kernels(x: Tensor, weight: Tensor, bias: Optional[Tensor], a: Tensor, b: Tensor, ids: Tensor,
                   scale: float, fused: bool) -> Tensor:
    """``_multi_linear_impl`` on the kernels (``multi_supported``): cuBLAS's GEMM, then the shrink
    grouped by slot and the expand (``kernels.lora_decode.multi_add_``), or with ``fused`` the
    shrink and the GEMM with each row's LoRA in its epilogue (``multi_linear``)."""
    kernels = _kernels()
    if fused:
        return kernels.multi_linear(x, weight, bias, a, b, ids, scale)
    return kernels.multi_add_(F.linear(x, weight, bias), x, a, b, ids, scale)


lora_multi_decode_linear = torch.library.custom_op("fastaf::lora_multi_decode_linear",
                                                   mutates_args=())(_multi_linear_impl)


@lora_multi_decode_linear.register_fake
def _multi_linear_fake(x: Tensor, weight: Tensor, bias: Optional[Tensor], a: Tensor, b: Tensor, ids: Tensor,
                       scale: float, fused: bool) -> Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


def multi_part_shape(x: Tensor, stacks: list[Tensor]) -> tuple[int, int, int, int]:
    """The shape of ``lora_multi_decode_shrink``'s partials for x (M, K) and siblings' stacks
    (n, R_i, K): (siblings, splits of K, M, padded rank) where the kernels run, one split elsewhere."""
    rank = max(a.shape[1] for a in stacks)
    if _kernels().available(x):
        return _kernels().part_shape(x, rank, len(stacks))
    return len(stacks), 1, x.shape[0], rank


def _multi_shrink_impl(x: Tensor, stacks: list[Tensor], ids: Tensor) -> Tensor:
    """Every sibling's partial h over x (M, K), each row with its segment's slot, in one launch
    (``kernels.lora_decode.multi_shrink_shared``), or x @ A_i[g].T as one split in torch ops where
    the kernels do not run. fp32 ``multi_part_shape``; rows of -1 segments are left as they are."""
    if _kernels().available(x):
        return _kernels().multi_shrink_shared(x, list(stacks), ids)
    part = x.new_zeros(multi_part_shape(x, stacks), dtype=torch.float32)
    slot = ids.repeat_interleave(x.shape[0] // ids.shape[0]).clamp(min=0)  # (M,)
    for i, a in enumerate(stacks):
        part[i, 0, :, :a.shape[1]] = torch.bmm(_as_dtype(a, x.dtype)[slot], x.unsqueeze(-1)).squeeze(-1).float()
    return part


lora_multi_decode_shrink = torch.library.custom_op("fastaf::lora_multi_decode_shrink",
                                                   mutates_args=())(_multi_shrink_impl)


@lora_multi_decode_shrink.register_fake
def _multi_shrink_fake(x: Tensor, stacks: list[Tensor], ids: Tensor) -> Tensor:
    return x.new_empty(multi_part_shape(x, stacks), dtype=torch.float32)


def _multi_expanded_impl(x: Tensor, weight: Tensor, bias: Optional[Tensor], part: Tensor, index: int, b: Tensor,
                         ids: Tensor, scale: float) -> Tensor:
    """x @ weight.T + bias + scale * h @ B[g].T per segment's slot g (-1 rows the base alone), h
    sibling ``index``'s partials summed (``lora_multi_decode_shrink``): cuBLAS's GEMM, then the
    grouped expand (``kernels.lora_multi.expand_``), or the same in torch ops. (M, N)."""
    y = F.linear(x, weight, bias)  # (M, N)
    if _kernels().available(x):
        from ..kernels import lora_multi

        return lora_multi.expand_(y, part[index], b.transpose(1, 2), ids, scale)
    rows = ids.repeat_interleave(x.shape[0] // ids.shape[0])  # (M,)
    h = part[index].sum(0)[:, :b.shape[2]].to(y.dtype)  # (M, R)
    delta = torch.bmm(_as_dtype(b, y.dtype)[rows.clamp(min=0)], h.unsqueeze(-1)).squeeze(-1)  # (M, N)
    return y + float(scale) * delta * (rows >= 0).to(y.dtype).unsqueeze(-1)


lora_multi_decode_expanded = torch.library.custom_op("fastaf::lora_multi_decode_expanded",
                                                     mutates_args=())(_multi_expanded_impl)


@lora_multi_decode_expanded.register_fake
def _multi_expanded_fake(x: Tensor, weight: Tensor, bias: Optional[Tensor], part: Tensor, index: int, b: Tensor,
                         ids: Tensor, scale: float) -> Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


# ---- 3. functions ----------------------------------------------------------------------------


def decoding(x: Tensor, lora: LoRA, impl: str, training: bool) -> bool:
    """Whether a use may take ``lora_linear_decode``: eager inference (grad off, no functorch
    level, not traced) of at most ``EAGER_ROWS`` rows of a plain CUDA tensor, impl "auto" or
    "addmm", no dropout drawn. There the call is host-bound: each launch and each Python layer
    counts."""
    return (not torch.is_grad_enabled() and type(x) is Tensor and x.is_cuda and impl in ("auto", "addmm")
            and x.numel() <= EAGER_ROWS * x.shape[-1] and not (training and lora.dropout)
            and not torch.compiler.is_compiling() and not is_wrapped(x))


def _use_kernel(x: Tensor, lora: LoRA, impl: str) -> bool:
    """The decode kernels for this call of at most ``DECODE_ROWS`` rows (M, K): the flag on,
    impl not "addmm" (cuBLAS asked for), a CUDA tensor the kernels take at a shape where they beat
    cuBLAS (``wins``). CPU tensors take the torch form (tests run the kernels themselves under the
    interpreter)."""
    return (x.is_cuda and impl != "addmm" and _config.flags().decode_kernel and x.shape[0] <= DECODE_ROWS
            and _kernels().supported(x, lora.A, lora.B) and _kernels().wins(x))


# factor -> (its version, dtype, the factor cast to it): eager decoding casts fp32 masters once
# while they stay as they are, not at every call (two launches per adapted layer per step)
_CASTS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def decode_factor(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` in ``dtype``, for an eager inference call: cast once per version of ``t`` (held while
    ``t`` lives), since a grad-off call records nothing that a cached copy could break."""
    if t.dtype == dtype:
        return t
    held = _CASTS.get(t)
    if held is None or held[0] != t._version or held[1] != dtype:
        held = _CASTS[t] = (t._version, dtype, t.detach().to(dtype))
    return held[2]


def add_lora_rows(y: Tensor, x: Tensor, lora: LoRA) -> Tensor:
    """``y += lora.scale * (x @ A.T) @ B.T`` in place, eager, grad off: y (M, N) a linear map's
    fresh output on x (M, K) (the stateful layer adds a decoding step's LoRA to ``nn.Linear``'s
    own output this way). Eagerly such a call is bound by host time per launch: on CUDA one Triton
    launch (``kernels.lora_decode.add_lora_fused``, the factors read as they are), else (or with
    ``eager_decode_kernel`` off) cuBLAS's ``mm`` + ``addmm_`` on factors cast once
    (``decode_factor``): two cuBLAS calls cost less host time than the split pair of decode
    launches (H200, 1B shape, 32 x 64 tokens: ``fa.generate`` 1.10 s against 1.21, the stateful
    layer 1.17 against 1.34; ``bench/results/generate-decode-ab.csv``). Returns y."""
    if x.is_cuda and _config.flags().eager_decode_kernel:
        kernels = _kernels()
        if kernels.fused_supported(x, lora.A, lora.B):
            return kernels.add_lora_fused(y, x, lora.A, lora.B, float(lora.scale))
    h = torch.mm(x, decode_factor(lora.A, x.dtype).T)  # (M, R)
    return y.addmm_(h, decode_factor(lora.B, x.dtype).T, alpha=float(lora.scale))


def linear_rows(x: Tensor, weight: Tensor, bias: Optional[Tensor], lora: LoRA) -> Tensor:
    """``x @ weight.T + bias + lora.scale * (x @ A.T) @ B.T`` for an eager inference call (grad
    off, checked operands), x (M, K) -> (M, N). Up to ``kernels.lora_decode.LINEAR_MAX_ROWS`` rows
    of a 16-bit CUDA tensor with ``decode_linear`` on, one Triton launch does the
    base GEMM and the LoRA (``kernels.lora_decode.linear``): the one launch per linear the base
    model itself pays, where such a call is bound by host time per launch. Else cuBLAS's GEMM,
    then ``add_lora_rows``."""
    if x.is_cuda and _config.flags().decode_linear:
        kernels = _kernels()
        if kernels.linear_supported(x, weight, lora.A, lora.B):
            return kernels.linear(x, weight, bias, lora.A, lora.B, float(lora.scale))
    return add_lora_rows(F.linear(x, weight, bias), x, lora)


def lora_linear_decode(x: Tensor, weight: Tensor, bias: Optional[Tensor], lora: LoRA, where: str) -> Tensor:
    """``lora_linear`` for a decoding step (``decoding``): ``linear_rows`` and nothing else. At 32
    rows of a 1B model the op's Function, dispatch lookup and sibling grouping are host time at
    every adapted layer of every step (H200: 166 us a call through the op against 85 for cuBLAS's
    three launches, under cProfile). (..., N) in x's dtype."""
    x, weight, bias = _autocast(x, weight, bias)
    check_use(x, weight, bias, lora, where)
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # (M, K)
    y = linear_rows(x2, weight, bias, lora)  # (M, N)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])


def multi_decodes(x: Tensor, weight: Tensor, lora: LoRA, impl: str) -> bool:
    """Whether an inference call on x (M, K) with a stack and per-segment ids takes the decode
    kernels (``_multi_linear_impl``: the shrink grouped by slot, no zeroed buffer): at most
    ``DECODE_ROWS`` rows of a 16-bit CUDA tensor, impl "auto", a stack the kernels take."""
    return (x.is_cuda and impl == "auto" and x.shape[0] <= DECODE_ROWS and lora.stacked and not lora.experts
            and _kernels().multi_supported(x, weight, lora.A, lora.B))


def multi_fused(traced: bool) -> bool:
    """Whether ``multi_decodes``' call computes the base GEMM in the LoRA's launch
    (``kernels.lora_decode.multi_linear``) rather than cuBLAS's (``multi_add_``): per
    ``decode_multi_linear``, ``eager`` calls only (bound by host time per launch), ``always`` or
    ``never``."""
    mode = _config.flags().decode_multi_linear
    return mode == "always" or (mode == "eager" and not traced)


def lora_multi_decode(x: Tensor, weight: Tensor, bias: Optional[Tensor], lora: LoRA, ids: Tensor) -> Tensor:
    """``lora_linear_multi`` for a decoding step (``decoding``) of a stack with one id per row
    (ids read on the device, -1 rows left alone): up to ``DECODE_ROWS`` rows of a 16-bit input the
    decode kernels (``multi_decodes``, ``_multi_kernels``), else cuBLAS's base GEMM then the grouped
    kernels' shrink and expand (``fastaf.kernels.lora_multi``); nothing else: the op's Function and level plumbing
    cost more host time than the launches. x (..., K) with x.numel() // K rows, a multiple of
    len(ids); lora stacked, A (n, R, K), B (n, N, R) in any float dtype (the kernels read them as
    they are). (..., N) in x's dtype."""
    x, weight, bias = _autocast(x, weight, bias)
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # (M, K)
    ids = ids.to(x.device, non_blocking=True).contiguous()
    if multi_decodes(x2, weight, lora, "auto"):
        y = _multi_kernels(x2, weight, bias, lora.A, lora.B, ids, float(lora.scale), multi_fused(traced=False))
    else:
        from ..kernels import lora_multi

        y = F.linear(x2, weight, bias)  # (M, N)
        lora_multi.expand_(y, lora_multi.shrink(x2, lora.A, ids), lora.B.transpose(1, 2), ids, float(lora.scale))
    return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])


def multi_decoding(x: Tensor, lora: LoRA, impl: str, training: bool) -> bool:
    """Whether a use with per-row ids may take ``lora_multi_decode``: ``decoding``, impl "auto",
    and the grouped kernels able to run on it (a CUDA tensor, a rank they take)."""
    if lora.experts or not (impl == "auto" and decoding(x, lora, impl, training)):
        return False
    from ..kernels import lora_multi

    return lora_multi.supported(x, lora.A)


def added_lora(y: Tensor, x: Tensor, lora: LoRA, impl: str = "auto") -> Tensor:
    """``y + lora.scale * (x @ A.T) @ B.T`` as a new tensor, for traced inference (grad off, no
    dropout): y (M, N) a linear map's output on x (M, K). ``fastaf::lora_decode_add`` on the
    factors as they are (no cast kernels in the graph) for at most ``DECODE_ROWS`` rows; above
    that, or with the kernel off, plain ops Inductor schedules with their neighbours. (M, N)."""
    if _use_kernel(x, lora, impl):
        return lora_decode_add(y, x, lora.A, lora.B, float(lora.scale))
    a, b = _as_dtype(lora.A, x.dtype), _as_dtype(lora.B, x.dtype)
    return y + float(lora.scale) * F.linear(F.linear(x, a), b)


def shares_decode(x: Tensor, loras: list[LoRA], impl: str) -> bool:
    """Siblings on x (M, K) (traced, grad off, ``decoding``'s conditions but tracing) can take
    their h from one shrink launch (``lora_decode_shrink``): each takes the decode kernel alone,
    and their A's one launch reads (``kernels.lora_decode.shares``)."""
    if len(loras) < 2 or any(lo.stacked or lo.experts for lo in loras):
        return False
    if not all(_use_kernel(x, lo, impl) for lo in loras):
        return False
    return _kernels().shares(loras[0].A, [lo.A for lo in loras[1:]])


def expanded_decode(x: Tensor, weight: Tensor, bias: Optional[Tensor], part: Tensor, index: int, lora: LoRA) -> Tensor:
    """``traced_decode`` given this sibling's partial h (``lora_decode_shrink(...)``, ``index``):
    the base GEMM, then one expand launch. x (..., K) -> (..., N)."""
    x2 = x.reshape(-1, x.shape[-1])  # (M, K)
    y = lora_decode_expand(F.linear(x2, weight, bias), part, index, lora.B, float(lora.scale))
    return y.view(*x.shape[:-1], y.shape[-1])


def multi_shares_decode(x: Tensor, weights: list[Tensor], loras: list[LoRA], impl: str) -> bool:
    """Siblings with a stack and ids on x (M, K) (traced, grad off) can take their h from one
    grouped shrink launch (``lora_multi_decode_shrink``): each takes the decode kernels
    (``multi_decodes``) through cuBLAS's GEMM (``decode_multi_linear`` not ``always``), and one
    launch reads their stacks (``kernels.lora_decode.multi_shares``)."""
    if len(loras) < 2 or multi_fused(traced=True):
        return False
    if not all(multi_decodes(x, w, lo, impl) for w, lo in zip(weights, loras)):
        return False
    return _kernels().multi_shares([lo.A for lo in loras])


def multi_expanded_decode(x: Tensor, weight: Tensor, bias: Optional[Tensor], part: Tensor, index: int, lora: LoRA,
                          ids: Tensor) -> Tensor:
    """A traced decoding call with ids given this sibling's partial h (``lora_multi_decode_shrink``,
    ``index``): cuBLAS's GEMM, then one grouped expand. x (..., K) -> (..., N)."""
    x2 = x.reshape(-1, x.shape[-1])  # (M, K)
    ids = ids.to(x.device, non_blocking=True).contiguous()
    y = lora_multi_decode_expanded(x2, weight, bias, part, index, lora.B, ids, float(lora.scale))
    return y.view(*x.shape[:-1], y.shape[-1])


def linear_decodes(x: Tensor, weight: Tensor, lora: LoRA, impl: str) -> bool:
    """Whether a traced inference call on x (M, K) takes ``fastaf::lora_decode_linear`` (the base
    GEMM and the LoRA in one launch): ``decode_linear`` on, at most ``DECODE_ROWS`` rows of a
    CUDA tensor, impl not "addmm", a single 16-bit LoRA the kernel takes. Graph-replayed on the
    H200 at 32 rows it costs 0.8-1.1 us over cuBLAS's GEMM alone at K = 2048 and 3.7 at 8192,
    where the GEMM and the split pair take 5.0-5.3 and 7.1, siblings sharing a shrink 3.3-3.9
    each (``bench/decode.py``, run ed40)."""
    return (x.is_cuda and impl != "addmm" and _config.flags().decode_linear and x.shape[0] <= DECODE_ROWS
            and not lora.stacked and not lora.experts and _kernels().linear_supported(x, weight, lora.A, lora.B))


def traced_decode(x: Tensor, weight: Tensor, bias: Optional[Tensor], lora: LoRA, impl: str) -> Tensor:
    """A traced inference call without dropout (a compiled decoding step, or a compiled no_grad
    forward): one launch for the base GEMM and the LoRA (``linear_decodes``), else the base GEMM,
    then ``added_lora``. (..., N)."""
    x2 = x.reshape(-1, x.shape[-1])  # (M, K)
    if linear_decodes(x2, weight, lora, impl):
        y = lora_decode_linear(x2, weight, bias, lora.A, lora.B, float(lora.scale))
    else:
        y = added_lora(F.linear(x2, weight, bias), x2, lora, impl)
    return y.view(*x.shape[:-1], y.shape[-1])
