"""Eager ``torch.func.grad`` over a whole call at plain autograd's cost.

Under a ``torch.func.grad`` level every torch call on a tensor the level tracks goes through
functorch's dispatch: on the H100 the 1B step under eager ``grad_and_value`` spent ~10 ms more
host time than the same step under plain autograd (157.9 vs 147.7 ms), and
an old-style ``autograd.Function`` anywhere in the model (BLOOM's GELU, bitsandbytes' 4-bit
matmul, FSDP2's all-gather) makes functorch raise. When the only transform active is one grad
level, ``functional_call`` runs the model *below* it, as one ``_SingleLevelFunction``:

- forward unwraps the level's tensors among the call's inputs (the adapter's factors, any
  differentiated argument), makes them fresh leaves and runs the call under plain autograd with
  the level popped, so the model sees plain tensors; the outputs are wrapped back at the level;
- backward is one ``torch.autograd.grad`` over that inner graph, returned to the level as
  constants (first order: the fast path is taken only when no second level exists to
  differentiate it).

The inner graph is kept until the level frees its own (``retain_graph``): functorch's ``vjp``
may call its ``vjp_fn`` more than once, and a level's graph already holds every saved tensor
until it is freed, so peak memory is what the per-op path had.

Tensors that the output holds outside pytree nodes (an HF ``Cache``'s keys and values) are found
by a bounded walk and wrapped back in place, so a loss computed from them is differentiated too.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from .. import _config
from ..ops import (GRAD, allow_single_level, differentiated_around, entered_in_grad_mode, get_unwrapped,
                   grad_mode_beneath, interpreter_stack, is_wrapped, level_left, level_token, maybe_level, pop_layer,
                   push_layer, single_level_allowed, unwrap_for_grad, wrap_for_grad)

_ATOMS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)
_WALK_DEPTH = 4  # Cache -> layers list -> layer object -> keys tensor is depth 3


def grad_level(model: nn.Module, inputs: Any) -> int:
    """The grad level a call on ``inputs`` can run below, or 0 to take the per-op path.

    Eligible: eager (no tracer, no dispatch mode), exactly one functorch transform active and it a
    grad level, at least one input wrapped at that level, every wrapped input at that level and
    visible to pytree, no wrapped parameter or buffer in the model (an outer
    ``torch.func.functional_call`` differentiating the base weights), and no input that plain
    autograd records beneath the level (``tracked_scope``: ``torch.autograd`` over the grad's
    result, as in MAML, needs the per-op path's graph beneath; this node's inner graph starts from
    fresh leaves).
    """
    if not _config.flags().below_grad or torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return 0
    stack = interpreter_stack()
    if not stack or len(stack) != 1 or stack[0].key() != GRAD:
        return 0
    level = stack[0].level()
    # plain autograd can record beneath only when the level was entered in grad mode
    beneath = grad_mode_beneath(stack[0])
    found = tracked = False
    for leaf in pytree.tree_leaves(inputs):
        if isinstance(leaf, Tensor):
            if is_wrapped(leaf):
                if maybe_level(leaf) != level:
                    return 0  # a wrapper of an exited level, or nested wrappers
                found = True
                tracked = tracked or (beneath and get_unwrapped(leaf).requires_grad)
            else:
                tracked = tracked or (beneath and leaf.requires_grad)
        elif not isinstance(leaf, _ATOMS) and any(is_wrapped(t) for _, _, t in _hidden_tensors(leaf)):
            return 0  # e.g. a Cache filled under this level: it cannot be unwrapped from outside
    if not found or tracked:  # tracked: functional_call's tracked_scope serves the call
        return 0
    for t in _module_tensors(model):
        if t is not None and is_wrapped(t):
            return 0
    return level


def call_below(level: int, fn: Callable[[Any], Any], inputs: Any) -> Any:
    """``fn(inputs)`` run below grad level ``level`` (from ``grad_level``) as one autograd node."""
    leaves, spec = pytree.tree_flatten(inputs)
    wrapped = [i for i, t in enumerate(leaves) if isinstance(t, Tensor) and is_wrapped(t)]
    run = _Run(fn, leaves, spec, wrapped)
    previous = single_level_allowed()
    # functorch refuses a _SingleLevelFunction under its transforms unless this flag is set
    allow_single_level(True)
    try:
        outs = _BelowGrad.apply(level, run, *(leaves[i] for i in wrapped))
    finally:
        allow_single_level(previous)
    return run.rebuild(outs)


class _Run:
    """One call's inputs, the function, and what forward learns about its outputs."""

    def __init__(self, fn: Callable[[Any], Any], leaves: list, spec: Any, wrapped: list[int]) -> None:
        self.fn, self.leaves, self.spec, self.wrapped = fn, leaves, spec, wrapped
        self.out_leaves: list = []
        self.out_spec: Any = None
        self.slots: list[tuple[Any, Any, int]] = []  # (container, key, index into the Function's outputs)
        self.positions: list[int] = []  # out_leaves index -> index into the Function's outputs (-1: none)

    def forward(self, inner: list[Tensor]) -> tuple[Tensor, ...]:
        """Run ``fn`` on the inner leaves; return the distinct output tensors, in order."""
        leaves = list(self.leaves)
        for i, t in zip(self.wrapped, inner):
            leaves[i] = t
        out = self.fn(pytree.tree_unflatten(leaves, self.spec))
        self.out_leaves, self.out_spec = pytree.tree_flatten(out)
        tensors: list[Tensor] = []
        index: dict[int, int] = {}

        def take(t: Tensor) -> int:
            if id(t) not in index:
                index[id(t)] = len(tensors)
                tensors.append(t)
            return index[id(t)]

        for leaf in self.out_leaves:
            self.positions.append(take(leaf) if isinstance(leaf, Tensor) else -1)
        for leaf in self.out_leaves:
            if not isinstance(leaf, (Tensor, *_ATOMS)):
                self.slots += [(c, k, take(t)) for c, k, t in _hidden_tensors(leaf) if t.requires_grad]
        return tuple(tensors)

    def rebuild(self, outs: tuple[Tensor, ...]) -> Any:
        """The output pytree with the level's wrapped tensors; hidden ones written back in place."""
        for container, key, i in self.slots:
            if isinstance(container, (dict, list)):
                container[key] = outs[i]
            else:
                setattr(container, key, outs[i])
        leaves = [outs[p] if p >= 0 else leaf for leaf, p in zip(self.out_leaves, self.positions)]
        return pytree.tree_unflatten(leaves, self.out_spec)


class _BelowGrad(torch.autograd.function._SingleLevelFunction):
    """The call as one node of the grad level; the model runs below it under plain autograd."""

    @staticmethod
    def forward(ctx, level: int, run: _Run, *wrapped: Tensor) -> tuple[Tensor, ...]:
        unwrapped = [unwrap_for_grad(t, level) for t in wrapped]
        layer = pop_layer()
        try:
            # The level off the stack, the caller's torch.inference_mode is back, under which
            # enable_grad alone records nothing (every gradient came back zero): leave it too.
            with torch.inference_mode(False), _saved_tensor_hooks_allowed():
                # fresh leaves: the level's gradient is taken with respect to these alone
                inner = [_fresh_leaf(t) for t in unwrapped]
                with torch.enable_grad():
                    outs = run.forward(inner)
            # detached: what the level hands back at its end must not hold the inner graph (a
            # loss kept by the caller would keep every activation alive)
            plain = [t.detach() for t in outs]
        finally:
            push_layer(layer)
        ctx.level, ctx.inner, ctx.outs = level, inner, outs  # the inner graph lives with this node
        ctx.token = level_token(level)  # the level's while it lives: a vjp_fn may run backward after it
        ctx.set_materialize_grads(False)
        result = tuple(wrap_for_grad(t, level) for t in plain)
        ctx.mark_non_differentiable(*(r for r, t in zip(result, outs) if not t.requires_grad))
        return result

    @staticmethod
    def backward(ctx, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        # torch.func.vjp's vjp_fn may run this after its level has exited, under another transform
        # or under vmap (jacrev): the cotangents are then that transform's, and the inner graph's
        # backward runs on them as they are, differentiable, for it to differentiate or batch
        left = level_left(ctx.level, ctx.token)
        pairs = [(t, g if left else unwrap_for_grad(g, ctx.level))
                 for t, g in zip(ctx.outs, grads) if g is not None and t.requires_grad]
        needs = [t for t in ctx.inner if t.requires_grad]
        found: tuple = ()
        if pairs and needs:
            layer = None if left else pop_layer()
            # a cotangent that plain autograd records beneath the level (MAML's outer objective
            # through a head outside the call): the inner backward must be differentiable in it
            create_graph = (differentiated_around(*(g for _, g in pairs)) if left else
                            any(g.requires_grad for _, g in pairs) and entered_in_grad_mode() is not False)
            try:
                with torch.inference_mode(False), _saved_tensor_hooks_allowed():
                    found = torch.autograd.grad([t for t, _ in pairs], needs, [g for _, g in pairs],
                                                retain_graph=True, allow_unused=True, create_graph=create_graph)
            finally:
                if layer is not None:
                    push_layer(layer)
        by_id = dict(zip(map(id, needs), found))
        return (None, None, *(by_id.get(id(t)) for t in ctx.inner))


@contextlib.contextmanager
def _saved_tensor_hooks_allowed() -> Iterator[None]:
    """Saved-tensor hooks allowed for the model run below the level: torch.func's grad forbids them
    (its wrapped tensors), but below it every tensor is plain, and non-reentrant activation
    checkpointing (fastaf.functional.checkpoint_context) is built on them."""
    message = torch._C._autograd._saved_tensors_hooks_get_disabled_error_message()
    if message is None:
        yield
        return
    torch._C._autograd._saved_tensors_hooks_enable()
    try:
        yield
    finally:
        torch._C._autograd._saved_tensors_hooks_disable(message)


def _fresh_leaf(t: Tensor) -> Tensor:
    """A leaf requiring grad with ``t``'s values (a copy of an inference tensor, which cannot
    require grad outside inference mode); ``t`` itself where it cannot have a gradient."""
    if not (t.is_floating_point() or t.is_complex()):
        return t
    return (t.clone() if t.is_inference() else t).detach().requires_grad_()


def _module_tensors(model: nn.Module) -> Iterator[Tensor]:
    for module in model.modules():
        yield from module._parameters.values()
        yield from module._buffers.values()


def _hidden_tensors(obj: Any, depth: int = _WALK_DEPTH, seen: set | None = None) -> Iterator[tuple[Any, Any, Tensor]]:
    """(container, key, tensor) for tensors held by a non-pytree object: its attributes, and the
    lists and dicts among them, ``depth`` levels down. Modules are not entered (the model's own)."""
    seen = set() if seen is None else seen
    if depth == 0 or id(obj) in seen or isinstance(obj, (Tensor, nn.Module, *_ATOMS)):
        return
    seen.add(id(obj))
    if isinstance(obj, dict):
        items = list(obj.items())
    elif isinstance(obj, (list, tuple)):
        items = list(enumerate(obj))
    else:
        items = list(getattr(obj, "__dict__", {}).items())
    for key, value in items:
        if isinstance(value, Tensor):
            if not isinstance(obj, tuple):  # a tuple cannot take the wrapped tensor back
                yield obj, key, value
        else:
            yield from _hidden_tensors(value, depth - 1, seen)
