"""Which torch calls on a targeted weight compute a linear layer: the one table both interceptions
consult, the mode over a whole call (``mode.LoRAMode``) and the weights that carry their adapter
(``carrier``). ``linear_use`` is the table:

    F.linear(x, W, b)        nn.Linear                          W (N, K)
    torch.addmm(b, x, W)     GPT-2's Conv1D                     W (K, N): the layout is "transposed"
    x @ W.T, x @ W           Falcon's FalconLinear; Conv1D's W  any transpose of an (N, K) W

Every other call on a targeted weight is one of: a transpose (recorded, for ``x @ W.T``), a
detaching or value-free read (``DETACHING``, ``VALUE_FREE``: never adapted), or a use of its
values that computes again on W + ΔW (``foldable`` and ``substitute``).
"""
from __future__ import annotations

from typing import Any, Optional, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

_TensorBase = torch._C.TensorBase
# funcs a mode sees for W.T, W.mT, W.t(), torch.t(W) and W.transpose(0, 1): each reverses a 2-D W
TRANSPOSES = {_TensorBase.T.__get__, _TensorBase.mT.__get__, _TensorBase.t, torch.t}
TRANSPOSE_DIMS = {_TensorBase.transpose, torch.transpose}
MATMULS = {_TensorBase.matmul, torch.matmul}  # x @ y reaches a mode as Tensor.matmul
# uses that detach a weight: W + ΔW must not stand in (no gradient could reach A and B); the
# weight stays unadapted there, which the call reports when that was its only use
DETACHING = frozenset({_TensorBase.data.__get__, _TensorBase.detach, torch.detach, _TensorBase.detach_})
# uses that read only a weight's shape, dtype or device (metadata, factories "like" it): no fold,
# and they are not uses of its values either
VALUE_FREE = frozenset({
    _TensorBase.size, _TensorBase.stride, _TensorBase.data_ptr, _TensorBase.untyped_storage,
    torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like, torch.rand_like, torch.randn_like,
    torch.randint_like, _TensorBase.new_empty, _TensorBase.new_zeros, _TensorBase.new_ones,
    _TensorBase.new_full, _TensorBase.new_empty_strided, _TensorBase.new_tensor,
})


def swaps(args: tuple, kwargs: dict) -> bool:
    """Whether ``transpose(t, dim0, dim1)`` of a 2-D t swaps its two dims (0/-2 with 1/-1)."""
    dims = list(args[1:3]) + [kwargs[k] for k in ("dim0", "dim1") if k in kwargs]
    return len(dims) == 2 and dims[0] % 2 != dims[1] % 2


def reverses(func, args: tuple, kwargs: dict) -> bool:
    """Whether ``func(*args, **kwargs)`` is a transpose of its first argument (a 2-D tensor)."""
    return func in TRANSPOSES or (func in TRANSPOSE_DIMS and swaps(args, kwargs))


def addmm_parts(args: tuple, kwargs: dict):
    """(bias, x, W) of a plain ``torch.addmm(bias, x, W)`` (beta = alpha = 1, no out=), else None."""
    if kwargs.get("out") is not None or kwargs.get("beta", 1) != 1 or kwargs.get("alpha", 1) != 1:
        return None
    names = ("input", "mat1", "mat2")
    parts = [args[i] if len(args) > i else kwargs.get(n) for i, n in enumerate(names)]
    return None if parts[1] is None or parts[2] is None else tuple(parts)


def linear_parts(args: tuple, kwargs: dict):
    """(x, W, bias) of ``F.linear``'s arguments."""
    x = args[0] if args else kwargs["input"]
    weight = args[1] if len(args) > 1 else kwargs.get("weight")
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    return x, weight, bias


_OPS = (torch._ops.OpOverload, torch._ops.OpOverloadPacket)


def foldable(func, args: tuple, out) -> bool:
    """Whether W + ΔW may stand in for a weight in ``func(*args) -> out``: a use of its values in
    the model's own code. Not a detach or a value-free read (``DETACHING``, ``VALUE_FREE``), not
    a call that returns its argument itself (``W.to(W.dtype)``, ``.contiguous()``, an in-place
    op: the weight stays the weight, which the rules meet next), not an op of a graph
    (``torch.ops.*``: a compiled graph run eagerly under the mode calls fastaf's own ops with
    the weight, already adapted)."""
    if func in DETACHING or func in VALUE_FREE or isinstance(func, _OPS):
        return False
    return not any(out is a for a in args)


def substitute(args: tuple, kwargs: dict, replace) -> tuple[tuple, dict] | None:
    """``args`` / ``kwargs`` with each tensor ``t`` (also one list or tuple deep) for which
    ``replace(t)`` is not None replaced by it; None when ``replace`` replaced nothing."""
    def one(t):
        return replace(t) if isinstance(t, torch.Tensor) else None

    def sub(a):
        if type(a) in (list, tuple):
            new = [one(t) for t in a]
            if all(n is None for n in new):
                return None
            items = [o if n is None else n for n, o in zip(new, a)]
            return items if type(a) is list else tuple(items)
        return one(a)

    new_args = [sub(a) for a in args]
    new_kwargs = {k: sub(v) for k, v in kwargs.items()}
    if all(n is None for n in new_args) and all(n is None for n in new_kwargs.values()):
        return None
    return (tuple(a if n is None else n for n, a in zip(new_args, args)),
            {k: kwargs[k] if n is None else n for k, n in new_kwargs.items()})


class Lookup(Protocol):
    """How an interception finds the target (its own handle on a route) behind a weight."""

    def nk(self, t: Any) -> Optional[tuple[Any, Tensor]]:
        """(target, its plain (N, K) weight) when ``t`` is a targeted weight used as F.linear's, or None."""

    def kn(self, t: Any) -> Optional[tuple[Any, Tensor, bool]]:
        """(target, its plain (N, K) weight, whether the module stores it (K, N)) when ``t`` is a
        targeted weight laid out (K, N) (W.T of an (N, K) weight, a Conv1D weight), or None."""


def linear_use(func: Any, args: tuple, kwargs: dict,
               lookup: Lookup) -> Optional[tuple[Any, Tensor, Tensor, Optional[Tensor], bool]]:
    """(target, x, weight (N, K), bias, flattened) when ``func(*args, **kwargs)`` computes a linear
    layer of a targeted weight, else None. ``flattened``: x is the (batch * seq, K) view GPT-2's
    Conv1D passes to ``torch.addmm``. Identity and membership tests only: dynamo folds them when it
    traces the mode."""
    if func is F.linear:
        x, weight, bias = linear_parts(args, kwargs)
        found = lookup.nk(weight)
        return None if found is None else (found[0], x, found[1], bias, False)
    if func in MATMULS:
        if len(args) != 2 or kwargs:
            return None
        found = lookup.kn(args[1])
        return None if found is None else (found[0], args[0], found[1], None, False)
    if func is torch.addmm:
        parts = addmm_parts(args, kwargs)
        found = None if parts is None else lookup.kn(parts[2])
        if found is None or not found[2]:  # only a Conv1D's own (K, N) weight: addmm(b, x, W)
            return None
        return (found[0], parts[1], found[1], parts[0], True)
    return None
