"""Every switch fastaf reads, in one place: defaults, the ``FASTAF_*`` variable of each, validation.

The switches are read from the environment once, at import, and validated there, so a typo in
``FASTAF_DISPATCH`` fails at ``import fastaf`` and not deep inside a step. Code reads them through
``flags()``; tests and benchmarks change them for a block with ``override(**flags)``, never by
setting module attributes::

    from fastaf import _config
    with _config.override(carry=False, dispatch="addmm"):
        step()

None of them changes a result beyond rounding: each picks one of two correct paths, so that one
process can time both (``bench/e2e.py``'s provider suffixes) and tests can cover both.

| flag | variable | default | what it picks |
|---|---|---|---|
| ``carry`` | ``FASTAF_CARRY`` | on | eager calls: targeted weights carry the adapter (fewer Python frames per use); off: one ``TorchFunctionMode`` intercepts the whole call |
| ``share_input`` | ``FASTAF_SHARE_INPUT`` | ``compiled`` | q/k/v and gate/up take h = x @ Aᵀ from one pass over x: ``compiled`` (under ``torch.compile``), ``always``, ``never`` |
| ``group`` | ``FASTAF_GROUP`` | on | eager sibling projections run as one grouped launch where the kernels allow it; in a compiled decoding step they share one shrink launch (with a stack and ids too) |
| ``below_grad`` | ``FASTAF_BELOW_GRAD`` | on | eager ``torch.func.grad`` runs the call below its one grad level, as plain autograd |
| ``dispatch`` | ``FASTAF_DISPATCH`` | ``measured`` | the LoRA linear's CUDA path: ``measured`` (the tuning cache decides per shape), ``triton`` or ``addmm`` everywhere |
| ``multi_fuse`` | ``FASTAF_MULTI_FUSE`` | ``measured`` | many adapters per batch: the base GEMM and the LoRA expand fused in one persistent GEMM from ``kernels.lora_multi.FUSE_MIN_ROWS`` rows (``measured``), wherever it can run (``fused``), or never (``unfused``) |
| ``stateful_impl`` | ``FASTAF_STATEFUL_IMPL`` | ``auto`` | the op's ``impl`` in the stateful layer (``auto``, ``triton``, ``torch``) |
| ``fast_launch`` | ``FASTAF_FAST_LAUNCH`` | on | Triton kernels launched from a cache of compiled kernels, past Triton's launcher (read when a kernel is first launched) |
| ``launch_graphs`` | ``FASTAF_LAUNCH_GRAPHS`` | on | eager launches of a repeated call replayed from a CUDA graph |
| ``decode_kernel`` | ``FASTAF_DECODE_KERNEL`` | on | where a compiled decoding step's LoRA (at most 64 rows, grad off) is added to cuBLAS's GEMM, two Triton launches; off: plain ops |
| ``eager_decode_kernel`` | ``FASTAF_EAGER_DECODE_KERNEL`` | on | an eager inference call's LoRA (at most 1024 rows on CUDA, grad off) as one Triton launch; off: cuBLAS's ``mm`` + ``addmm_`` |
| ``decode_linear`` | ``FASTAF_DECODE_LINEAR`` | on | an inference call's adapted linear on a 16-bit CUDA tensor (grad off; eager: at most 512 rows, compiled: at most 64) as one Triton launch, its base GEMM included; off: cuBLAS's GEMM, then the LoRA (``eager_decode_kernel``, ``decode_kernel``) |
| ``decode_multi_linear`` | ``FASTAF_DECODE_MULTI_LINEAR`` | ``eager`` | an inference call with a stack and per-row ids on a 16-bit CUDA tensor (grad off, at most 64 rows) computes the base GEMM in the LoRA's launch, each row's LoRA in its epilogue (two launches, the shrink grouped by slot first): in ``eager`` calls only, bound by host time per launch (H200: 16 adapters' eager generate 18% faster in runs f3fe and cc6c), ``always`` (slower compiled: its GEMM loses to cuBLAS's), or ``never`` (cuBLAS's GEMM, then the shrink and an expand) |
| ``dequant`` | ``FASTAF_DEQUANT`` | on | a training call of a bitsandbytes 4-bit layer under ``functional_call`` dequantizes its weight inside fastaf's fused op (``ops.lora_dequant``); off: the layer's own forward plus the LoRA as a branch |
| ``dequant_kernel`` | ``FASTAF_DEQUANT_KERNEL`` | on | that dequantization as fastaf's one-launch Triton kernel on CUDA; off: bitsandbytes' ops (two launches under double quantization) |

``FASTAF_CACHE_DIR`` (where ``fastaf-tune`` writes its cache) is a path, not a switch, and is read
where the cache is opened, so a test's ``monkeypatch.setenv`` reaches it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Iterator
from typing import Any

_SHARE_INPUT = ("compiled", "always", "never")
_DISPATCH = ("measured", "triton", "addmm")
_MULTI_FUSE = ("measured", "fused", "unfused")
_DECODE_MULTI_LINEAR = ("eager", "always", "never")
_IMPLS = ("auto", "triton", "torch")
_TRUE, _FALSE = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


@dataclasses.dataclass(frozen=True)
class Flags:
    """The switches' values; one frozen instance is current at a time (``flags()``)."""

    carry: bool = True
    share_input: str = "compiled"
    group: bool = True
    below_grad: bool = True
    dispatch: str = "measured"
    multi_fuse: str = "measured"
    stateful_impl: str = "auto"
    fast_launch: bool = True
    launch_graphs: bool = True
    decode_kernel: bool = True
    eager_decode_kernel: bool = True
    decode_linear: bool = True
    decode_multi_linear: str = "eager"
    dequant: bool = True
    dequant_kernel: bool = True

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type == "bool" and not isinstance(value, bool):
                raise TypeError(f"fastaf flag {field.name!r} takes True or False, got {value!r} "
                                f"({type(value).__name__})")
        for name, allowed in (("share_input", _SHARE_INPUT), ("dispatch", _DISPATCH), ("multi_fuse", _MULTI_FUSE),
                              ("stateful_impl", _IMPLS), ("decode_multi_linear", _DECODE_MULTI_LINEAR)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"fastaf flag {name!r} takes one of {allowed}, got {getattr(self, name)!r}")


def _variable(name: str) -> str:
    return "FASTAF_" + name.upper()


def _from_env(environ: Any = os.environ) -> Flags:
    """The flags as the ``FASTAF_*`` variables set them; unset ones keep their defaults."""
    values: dict[str, Any] = {}
    for field in dataclasses.fields(Flags):
        raw = environ.get(_variable(field.name))
        if raw is None:
            continue
        if field.type == "bool":
            word = raw.strip().lower()
            if word not in _TRUE + _FALSE:
                raise ValueError(f"{_variable(field.name)}={raw!r}: expected one of {_TRUE + _FALSE}")
            values[field.name] = word in _TRUE
        else:
            values[field.name] = raw.strip()
    try:
        return Flags(**values)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{err} (from the FASTAF_* environment variables)") from None


_current = _from_env()
_lock = threading.RLock()


def flags() -> Flags:
    """The current flags (a frozen value: read a field, never set one)."""
    return _current


@contextlib.contextmanager
def override(**changes: Any) -> Iterator[Flags]:
    """Set flags for the duration of a ``with`` block, and restore them after it, also on error.

    Thread-safe: overrides from several threads are serialised (one holds the lock until its block
    ends; the same thread may nest them), so a restore never undoes another thread's change. The
    flags are process-wide: other threads read the overridden values while the block runs.
    """
    global _current
    unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(Flags)})
    if unknown:
        raise TypeError(f"fastaf has no flag(s) {unknown}; its flags: {[f.name for f in dataclasses.fields(Flags)]}")
    with _lock:
        previous = _current
        _current = dataclasses.replace(previous, **changes)
        try:
            yield _current
        finally:
            _current = previous
