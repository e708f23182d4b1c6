"""An adapter's factors packed into one flat buffer per dtype and device, static for dynamo: what a
compiled decoding step reads (``fastaf.generate``'s and the stateful layer's ``generate``)."""
from __future__ import annotations

import itertools
import weakref

import torch

from ._adapter import Adapter, LoRA

_ALIGN = 64  # elements: each factor's view starts 128-byte aligned in its buffer, as an allocation would
_PACKED = itertools.count()  # each Packed's layout key
_LAYOUTS: dict[str, dict] = {}  # layout key -> {path: (A's spec, B's spec, scale, dropout, experts)}, never changed


@torch._dynamo.assume_constant_result
def _paths(key: str) -> tuple[str, ...]:
    """The paths packed under ``key``. A constant for dynamo: read through the Packed, the layout
    was guarded entry by entry (each path, offset, size and scale: ~40 guards per adapted layer,
    4480 for a 1B model's 112, checked at every decoding step); a key's layout never changes."""
    return tuple(_LAYOUTS[key])


@torch._dynamo.assume_constant_result
def _spec(key: str, path: str) -> tuple:
    """``path``'s entry in the layout under ``key`` (a constant for dynamo, as ``_paths``)."""
    return _LAYOUTS[key][path]


class Packed:
    """An adapter's factors in one flat static buffer per (dtype, device), for a compiled decode step.

    ``traced()`` builds the Adapter inside the trace, each factor a view of its buffer, so the
    graph takes one tensor per buffer as input instead of two per adapted layer (each an input
    fetched through its object path and checked at every call: 75 against 14 us a call for 224
    of them against one, on a CPU); ``lora(path)`` one LoRA so. ``eager`` is the same Adapter
    built once, for the calls that run eagerly (the prefill). ``fill`` refreshes the values.
    """

    def __init__(self, adapter: Adapter) -> None:
        sizes: dict[tuple[torch.dtype, torch.device], int] = {}

        def place(t: torch.Tensor) -> tuple[int, int, tuple[int, ...]]:
            where = (t.dtype, t.device)
            start = sizes.get(where, 0)
            sizes[where] = start + -(-t.numel() // _ALIGN) * _ALIGN
            return list(sizes).index(where), start, tuple(t.shape)

        self._file({path: (place(l.A), place(l.B), float(l.scale), float(l.dropout), bool(l.experts))
                    for path, l in adapter.items()})
        self.buffers = tuple(marked_static(torch.empty(max(size, 1), dtype=dtype, device=device))
                             for (dtype, device), size in sizes.items())
        self.eager = self.traced()

    def _file(self, layout: dict) -> None:
        """Keep ``layout`` under a key of its own, read as constants (``_paths``, ``_spec``): the
        graph guards on the key alone, and a second structure's offsets are other constants,
        never the same ints changed."""
        self.key = f"packed-{next(_PACKED)}"
        _LAYOUTS[self.key] = layout
        weakref.finalize(self, _LAYOUTS.pop, self.key, None)

    def __getstate__(self) -> dict:  # a copy or a pickle
        return {"buffers": self.buffers, "layout": _LAYOUTS[self.key]}

    def __setstate__(self, state: dict) -> None:
        self.buffers = tuple(marked_static(b) for b in state["buffers"])
        self._file(state["layout"])  # its own key: the original's layout goes with the original
        self.eager = self.traced()  # views of these buffers (a pickle does not keep views' sharing)

    def _view(self, spec: tuple[int, int, tuple[int, ...]]) -> torch.Tensor:
        which, start, shape = spec
        numel = 1
        for size in shape:
            numel *= size
        return self.buffers[which][start:start + numel].view(shape)

    def traced(self) -> Adapter:
        """The adapter as views of the buffers (inside a trace: views in the graph)."""
        return Adapter._unchecked({path: self.lora(path) for path in _paths(self.key)})

    def lora(self, path: str) -> LoRA:
        """``path``'s LoRA as views of the buffers."""
        a, b, scale, dropout, experts = _spec(self.key, path)
        return LoRA(self._view(a), self._view(b), scale, dropout, experts)

    def fill(self, adapter: Adapter) -> None:
        """Copy ``adapter``'s values (its structure the one packed) into the buffers, in place."""
        with torch.no_grad():
            dst = [t for l in self.eager.values() for t in (l.A, l.B)]  # (cast where the dtypes differ)
            torch._foreach_copy_(dst, [t.detach() for l in adapter.values() for t in (l.A, l.B)])


def marked_static(t: torch.Tensor) -> torch.Tensor:
    """``t``, marked for dynamo as static in address and in shape.

    The address: CUDA-graph replays read it in place. The shape: a decode step compiled for a
    second structure (a stack after one adapter, say: the factors' rank changes) would otherwise
    compile with every factor's sizes symbolic (dynamo's automatic dynamic shapes), and read
    448 sizes in Python at every step for a 1B model's r=16 LoRA on 7 projections (H200, cProfile
    of ``fa.generate``: 7.3 ms a step compiled second against 5.2 compiled first, in two runs).
    Each structure compiles its own static graph instead.
    """
    torch._dynamo.mark_static_address(t)  # guarded on its address: it stays one tensor while kept
    torch._dynamo.mark_static(t)
    return t
