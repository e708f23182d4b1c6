"""Adapters as immutable pytrees: ``LoRA(A, B, scale)`` and ``Adapter`` (module path -> LoRA).

A LoRA's delta is ``ΔW = scale · B @ A`` with A (r, in_features) and B (out_features, r). A
*stacked* LoRA carries a leading axis n on both factors, A (n, r, in) and B (n, out, r), one slot
per adapter; ``torch.func.vmap`` maps over that axis.

An *expert* LoRA (``experts=True``) adapts a parameter directly, as PEFT's ``target_parameters``
does: a fused 3-D MoE expert parameter gets one LoRA per expert, A (E, r, in) and B (E, out, r),
``ΔW_e = scale · B_e @ A_e``; a 2-D parameter (a router's weight) is one expert, E = 1. Its
Adapter key is the parameter's name (``model.named_parameters()``), and the call substitutes the
parameter with ``W + ΔW`` (see ``functional_call``). Stacked, both factors get the leading n.

Both classes are registered with ``torch.utils._pytree`` (what ``torch.func`` and
``torch.compile`` see) and with optree under the namespace ``"fastaf"``. Flattening keeps
``scale`` and ``dropout`` static, so ``torch.func.grad`` over an Adapter returns an Adapter of
gradients with the same structure. Unflattening skips validation on purpose: transforms rebuild
the tree with wrapped tensors, shapes or ``None`` leaves.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import ItemsView, Iterable, Iterator, KeysView, Mapping, ValuesView
from typing import Any

import optree
import torch
import torch.utils._pytree as torch_pytree

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _is_compiling() -> bool:
    return torch.compiler.is_compiling()


@dataclasses.dataclass(frozen=True, eq=False)
class LoRA:
    """One low-rank update ``ΔW = scale · B @ A``.

    Attributes:
        A: (r, in_features), or (n, r, in_features) when stacked.
        B: (out_features, r), or (n, out_features, r) when stacked.
        scale: float multiplier (alpha / r, or alpha / sqrt(r) with rsLoRA).
        dropout: probability with which ``x`` is dropped before ``A`` while the host module is
            training (PEFT's ``lora_dropout``); static, like ``scale``. Expert LoRAs have none.
        experts: one LoRA per expert of a parameter: A (E, r, in), B (E, out, r), or
            (n, E, r, in) / (n, E, out, r) when stacked; static.
    """

    A: torch.Tensor
    B: torch.Tensor
    scale: float = 1.0
    dropout: float = 0.0
    experts: bool = False

    # numpy scalars then return NotImplemented from ``np.float64(0.5) * lora``, so Python calls
    # ``lora.__rmul__`` instead of numpy trying to make an array of the LoRA
    __array_ufunc__ = None

    def __post_init__(self) -> None:
        if not _is_compiling():
            _check_lora(self, "LoRA")

    # ---- shape helpers -------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.A.shape[-2]

    @property
    def in_features(self) -> int:
        return self.A.shape[-1]

    @property
    def out_features(self) -> int:
        return self.B.shape[-2]

    @property
    def num_experts(self) -> int:
        """E for an expert LoRA, else 0."""
        return self.A.shape[-3] if self.experts else 0

    @property
    def stacked(self) -> bool:
        return self.A.dim() == (4 if self.experts else 3)

    def delta(self) -> torch.Tensor:
        """ΔW = scale · B @ A: (out, in), with the leading (E,) of an expert LoRA and (n,) when stacked."""
        return self.scale * (self.B @ self.A)

    # ---- arithmetic ------------------------------------------------------------------------
    def __mul__(self, c: Any) -> LoRA:
        return dataclasses.replace(self, scale=self.scale * as_scalar(c))

    __rmul__ = __mul__

    def __neg__(self) -> LoRA:
        return dataclasses.replace(self, scale=-self.scale)

    def __add__(self, other: LoRA) -> LoRA:
        return _concat_ranks(self, other, where="LoRA")

    def __sub__(self, other: LoRA) -> LoRA:
        return self + (-other)

    def __repr__(self) -> str:
        return (
            f"LoRA(A={tuple(self.A.shape)}, B={tuple(self.B.shape)}, scale={self.scale:g}, "
            f"dtype={self.A.dtype}, device={self.A.device}"
            + (f", dropout={self.dropout:g}" if self.dropout else "")
            + (", experts=True)" if self.experts else ")")
        )


def as_scalar(c: Any) -> float:
    if isinstance(c, torch.Tensor) and c.numel() == 1 and not c.requires_grad:
        value = float(c)
    elif isinstance(c, numbers.Real) and not isinstance(c, bool):  # numpy scalars included
        value = float(c)
    else:
        raise TypeError(f"an adapter can only be scaled by a real number, got {type(c).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"an adapter can only be scaled by a finite number, got {value}")
    return value


def _check_lora(lora: LoRA, where: str) -> None:
    """Validate factor shapes, dtypes and devices; ``where`` names the module path."""
    A, B = lora.A, lora.B
    for name, t in (("A", A), ("B", B)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(
                f"{where}: {name} {tuple(t.shape)} has dtype {t.dtype}; LoRA factors must be "
                "float16, bfloat16, float32 or float64"
            )
    if not isinstance(lora.experts, bool):
        raise TypeError(f"{where}: experts must be True or False, got {lora.experts!r}")
    dims = 3 if lora.experts else 2
    if A.dim() not in (dims, dims + 1) or A.dim() != B.dim():
        raise ValueError(
            f"{where}: A {tuple(A.shape)} and B {tuple(B.shape)} must both be (E, r, in) / (E, out, r) for an "
            "expert LoRA, or both 4-D when stacked" if lora.experts else
            f"{where}: A {tuple(A.shape)} and B {tuple(B.shape)} must both be 2-D "
            "(r, in) / (out, r), or both 3-D when stacked"
        )
    if A.shape[-2] != B.shape[-1]:
        raise ValueError(
            f"{where}: rank mismatch, A {tuple(A.shape)} is (r, in) with r={A.shape[-2]} but "
            f"B {tuple(B.shape)} is (out, r) with r={B.shape[-1]}"
        )
    if A.shape[-2] == 0:
        raise ValueError(f"{where}: rank 0 (A {tuple(A.shape)}); a LoRA needs r >= 1")
    if A.shape[:-2] != B.shape[:-2]:
        raise ValueError(
            f"{where}: A {tuple(A.shape)} and B {tuple(B.shape)} differ in their leading "
            + ("(stack, expert) axes" if lora.experts and A.dim() == 4 else "expert axis" if lora.experts else "stack axis")
        )
    if A.device != B.device:
        raise ValueError(f"{where}: A is on {A.device} but B is on {B.device}")
    if A.dtype != B.dtype:
        raise TypeError(f"{where}: A is {A.dtype} but B is {B.dtype}")
    if not isinstance(lora.scale, numbers.Real) or isinstance(lora.scale, bool):
        raise TypeError(f"{where}: scale must be a float, got {type(lora.scale).__name__}")
    if not math.isfinite(lora.scale):
        raise ValueError(f"{where}: scale must be finite, got {lora.scale}")
    if not isinstance(lora.dropout, numbers.Real) or isinstance(lora.dropout, bool):
        raise TypeError(f"{where}: dropout must be a number, got {lora.dropout!r}")
    if not 0.0 <= lora.dropout < 1.0:
        raise ValueError(f"{where}: dropout must be in [0, 1), got {lora.dropout}")
    if lora.experts and lora.dropout:
        raise ValueError(
            f"{where}: an expert LoRA (A {tuple(A.shape)}) cannot have dropout ({lora.dropout}): its delta is "
            "folded into the parameter, so there is no input to drop (PEFT refuses it too)"
        )


def layout_mismatch(a: LoRA, b: LoRA) -> str | None:
    """Why ``a`` and ``b`` cannot be combined at one path (summed, stacked, merged), or None."""
    if (a.in_features, a.out_features) != (b.in_features, b.out_features):
        return "feature sizes differ"
    if a.experts != b.experts:
        return "one is an expert LoRA and the other is not"
    if a.num_experts != b.num_experts:
        return "expert counts differ"
    return None


def _concat_ranks(a: LoRA, b: LoRA, where: str) -> LoRA:
    """Exact sum of two deltas: ranks concatenate (a's first), the sum keeps the scale of larger
    magnitude and the other's ratio to it is folded into its B:

    a.scale·Ba@Aa + b.scale·Bb@Ab = a.scale · [Ba | (b.scale/a.scale)·Bb] @ [Aa; Ab]   (|a.scale| >= |b.scale|)

    A ratio of at most 1 cannot overflow 16-bit factors (folding 1/1e-6 into fp16 ones made inf),
    and the sum does not depend on the operands' order.
    """
    if (a.in_features, a.out_features) != (b.in_features, b.out_features):
        raise ValueError(
            f"{where}: cannot add A {tuple(a.A.shape)}/B {tuple(a.B.shape)} and "
            f"A {tuple(b.A.shape)}/B {tuple(b.B.shape)}: feature sizes differ"
        )
    if a.experts != b.experts or a.A.shape[:-2] != b.A.shape[:-2]:
        why = ("an expert LoRA and a plain one" if a.experts != b.experts else
               "a stacked LoRA and an unstacked one" if a.stacked != b.stacked else
               f"stack sizes {a.A.shape[0]} and {b.A.shape[0]}" if a.stacked and a.A.shape[0] != b.A.shape[0] else
               f"expert counts {a.A.shape[-3]} and {b.A.shape[-3]}")
        raise ValueError(f"{where}: cannot add A {tuple(a.A.shape)} and A {tuple(b.A.shape)}: {why}")
    if a.dropout != b.dropout:
        raise ValueError(
            f"{where}: cannot add LoRAs with dropout {a.dropout} and {b.dropout}; set one with "
            "dataclasses.replace(lora, dropout=...) first"
        )
    if a.A.device != b.A.device:
        raise ValueError(
            f"{where}: cannot add a LoRA on {a.A.device} and one on {b.A.device} "
            f"(A {tuple(a.A.shape)} / {tuple(b.A.shape)}); move one with .to() first"
        )
    dtype = torch.promote_types(a.A.dtype, b.A.dtype)
    scale = _common_scale([a, b])
    A = torch.cat([a.A.to(dtype), b.A.to(dtype)], dim=-2)
    return LoRA(A, torch.cat([_folded_B(a, scale, dtype), _folded_B(b, scale, dtype)], dim=-1), scale, a.dropout,
                a.experts)


def _common_scale(loras: list[LoRA]) -> float:
    """The scale LoRAs summed or stacked share: the largest in magnitude, so every other's ratio to
    it, folded into its B (``_folded_B``), is at most 1 and cannot overflow 16-bit factors."""
    scale = loras[0].scale
    for lora in loras[1:]:  # a loop, not max(key=abs): dynamo traces sums of adapters (a list of them in a call)
        if abs(lora.scale) > abs(scale):
            scale = lora.scale
    return scale


def _folded_B(lora: LoRA, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``lora.B`` in ``dtype`` times its scale's ratio to ``scale`` (``_common_scale``'s: a zero
    ``scale`` means every scale is zero, and B is left as it is)."""
    B = lora.B.to(dtype)
    return B if lora.scale == scale else B * (lora.scale / scale)


class Adapter(Mapping[str, LoRA]):
    """Immutable mapping from module path (``model.named_modules()`` names) to ``LoRA``; an expert
    LoRA's key is its parameter's name (``model.named_parameters()``).

    ``a + b`` sums deltas exactly (rank concatenation; paths in only one side are kept),
    ``c * a`` and ``-a`` scale every delta. Every operation returns a new Adapter.
    """

    __slots__ = ("_loras", "__weakref__")  # weak references: a model's last resolved adapter (routes)
    __array_ufunc__ = None  # as LoRA's: ``np.float64(0.5) * adapter`` reaches ``__rmul__``

    def __init__(self, loras: Mapping[str, LoRA] | Iterable[tuple[str, LoRA]] = ()) -> None:
        if isinstance(loras, Mapping):
            items = dict(loras)
        else:  # pairs: a path given twice would keep its last LoRA without a word
            pairs = list(loras)
            items = dict(pairs)
            if len(items) != len(pairs) and not _is_compiling():
                seen: set = set()
                twice = [p for p, _ in pairs if p in seen or seen.add(p)]
                raise ValueError(f"Adapter: path {twice[0]!r} is given more than once; add their LoRAs (a + b) "
                                 "to sum the deltas")
        if not _is_compiling():
            for path, lora in items.items():
                if not isinstance(path, str):
                    raise TypeError(f"Adapter keys must be module paths (str), got {path!r}")
                if not isinstance(lora, LoRA):
                    raise TypeError(f"{path}: expected fastaf.LoRA, got {type(lora).__name__}")
                _check_lora(lora, path)
        object.__setattr__(self, "_loras", items)

    @classmethod
    def _unchecked(cls, loras: dict[str, LoRA]) -> Adapter:
        new = cls.__new__(cls)
        object.__setattr__(new, "_loras", loras)
        return new

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("fastaf.Adapter is immutable; build a new one")

    def __reduce__(self) -> tuple:
        # pickle, torch.save and copy.deepcopy rebuild through __init__ (and its checks): the
        # default restore of __slots__ would go through the __setattr__ above
        return (Adapter, (self._loras,))

    def __getitem__(self, path: str) -> LoRA:
        try:
            return self._loras[path]
        except KeyError:
            raise KeyError(f"no LoRA for module path {path!r}; adapter has {list(self._loras)[:8]}...") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._loras)

    def __len__(self) -> int:
        return len(self._loras)

    # the dict's own views: Mapping's reach each entry through __iter__ and __getitem__ in Python,
    # host time at every call that walks the adapter (one per adapted layer per call)
    def keys(self) -> KeysView[str]:
        return self._loras.keys()

    def values(self) -> ValuesView[LoRA]:
        return self._loras.values()

    def items(self) -> ItemsView[str, LoRA]:
        return self._loras.items()

    def __repr__(self) -> str:
        body = ",\n".join(f"  {p!r}: {l!r}" for p, l in self._loras.items())
        return f"Adapter({{\n{body}\n}})" if body else "Adapter({})"

    @property
    def stacked(self) -> bool:
        """True when every LoRA carries a leading stack axis (see ``fastaf.stack``)."""
        return bool(self._loras) and all(l.stacked for l in self._loras.values())

    def map(self, fn: Any) -> Adapter:
        """A new Adapter with ``fn(path, lora) -> LoRA`` applied to every entry."""
        return Adapter({p: fn(p, l) for p, l in self._loras.items()})

    def __mul__(self, c: Any) -> Adapter:
        s = as_scalar(c)
        return Adapter({p: l * s for p, l in self._loras.items()})

    __rmul__ = __mul__

    def __neg__(self) -> Adapter:
        return Adapter({p: -l for p, l in self._loras.items()})

    def __add__(self, other: Adapter) -> Adapter:
        if not isinstance(other, Adapter):
            return NotImplemented
        out = dict(self._loras)
        for path, lora in other._loras.items():
            out[path] = _concat_ranks(out[path], lora, where=path) if path in out else lora
        return Adapter(out)

    def __sub__(self, other: Adapter) -> Adapter:
        if not isinstance(other, Adapter):
            return NotImplemented
        return self + (-other)


# ---- pytree registration ------------------------------------------------------------------


def _lora_flatten(l: LoRA) -> tuple[list[Any], tuple[float, float, bool]]:
    return [l.A, l.B], (l.scale, l.dropout, l.experts)


def _lora_unflatten(aux: tuple[float, float, bool], children: Iterable[Any]) -> LoRA:
    A, B = children
    new = object.__new__(LoRA)
    object.__setattr__(new, "A", A)
    object.__setattr__(new, "B", B)
    object.__setattr__(new, "scale", aux[0])
    object.__setattr__(new, "dropout", aux[1])
    object.__setattr__(new, "experts", aux[2])
    return new


def _adapter_flatten(a: Adapter) -> tuple[list[Any], tuple[str, ...]]:
    return list(a._loras.values()), tuple(a._loras)


def _adapter_unflatten(paths: tuple[str, ...], children: Iterable[Any]) -> Adapter:
    return Adapter._unchecked(dict(zip(paths, children)))


# torch's unflatten takes (children, context); optree's takes (metadata, children).
torch_pytree.register_pytree_node(
    LoRA,
    _lora_flatten,
    lambda children, aux: _lora_unflatten(aux, children),
    serialized_type_name="fastaf.LoRA",
    flatten_with_keys_fn=lambda l: (
        [(torch_pytree.GetAttrKey("A"), l.A), (torch_pytree.GetAttrKey("B"), l.B)],
        (l.scale, l.dropout, l.experts),
    ),
)
torch_pytree.register_pytree_node(
    Adapter,
    _adapter_flatten,
    lambda children, paths: _adapter_unflatten(paths, children),
    serialized_type_name="fastaf.Adapter",
    flatten_with_keys_fn=lambda a: (
        [(torch_pytree.MappingKey(p), l) for p, l in a._loras.items()],
        tuple(a._loras),
    ),
)
optree.register_pytree_node(
    LoRA,
    lambda l: ([l.A, l.B], (l.scale, l.dropout, l.experts), ("A", "B")),
    _lora_unflatten,
    namespace="fastaf",
)
optree.register_pytree_node(
    Adapter,
    lambda a: (list(a._loras.values()), tuple(a._loras), tuple(a._loras)),
    _adapter_unflatten,
    namespace="fastaf",
)
