"""Siblings that read one input (q/k/v, gate/up) run as one op at the first one's call.

An eager call learns which adapted layers the model runs one after another on the same input
tensor (HF attention's q/k/v on the normed hidden states, an MLP's gate/up). From then on the
first of such a group computes every member's output in one op (``kernels.lora_group``: h in one
pass over x, dA in one, dx summed inside the GEMMs, one autograd node and one graph replay each
way for the group) and holds the others' outputs until their own calls, which take them
when their input is still that tensor, unchanged (its version counter), with the same weight,
bias (their versions too) and grad mode, outside autocast. A member called otherwise, or not at
all before the call ends, computes alone (at its call), and its leader never groups again. Inputs
are compared by weak reference: grouping keeps no activation alive. A write that bypasses the
version counter (through ``x.data``, a NumPy view) between the members' calls is not seen;
inference tensors (``torch.inference_mode``) have no version counter and do not group.

Learned groups are kept per module (weakly: the model is not touched), so every later call of
the model, with any adapter, starts grouped. A call reads a leader's group once, at its first
call in the call, and keeps that for the rest of the call: an activation-checkpointing recompute
(after the call returned, in its backward) must make the same ops as the forward did, also when
the forward itself learned or forgot the group. Only plain eager autograd on the Triton kernels
groups (also below an eager ``torch.func`` grad level, where the model runs as plain autograd;
not under vmap or compile, nor with dropout, autocast, ``adapter_ids`` or trainable weights);
everything else runs the single op as before. ``GROUP`` turns it off (benchmarks
compare both in one process).
"""
from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch import Tensor, nn

from ..ops import check_use, group_fits, group_kernels_apply, lora_group

# leader module -> the modules that followed it on its input, in call order; weak both ways (a
# follower that refers to the model, a hook's closure say, must not keep the model alive)
_LEARNED: "weakref.WeakKeyDictionary[nn.Module, tuple[weakref.ref, ...]]" = weakref.WeakKeyDictionary()
_GIVEN_UP: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # leaders whose group was a wrong guess


class Groups:
    """One mode's grouping: what it learns from the calls, and the outputs a group holds."""

    def __init__(self, routes: dict[int, Any], impl: str) -> None:
        self.impl = impl
        self.by_module = {id(r.module): r for r in routes.values()}
        self.plan: dict[int, Optional[tuple[nn.Module, ...]]] = {}  # leader -> its group, as this call read it
        # the latest call: (route, x by weak reference, x's version): an input is not kept alive
        self.last: Optional[tuple[Any, weakref.ref, int]] = None
        self.chain: list[Any] = []  # routes run one after another on self.last's x
        # outputs held for the group's later members: (leader module, x by weak reference, x's
        # version, grad mode, {path: (weight, its version, bias, its version, y)})
        self.held: Optional[tuple[nn.Module, weakref.ref, int, bool, dict[str, tuple]]] = None

    def reset(self) -> None:
        """Forget this entry's calls (the mode is entered again: a checkpointed block's recompute),
        not the groups the call read (``plan``)."""
        self.last, self.chain, self.held = None, [], None

    def close(self) -> None:
        """The call is over: outputs still held belong to members that never ran, so their group was
        a guess (never grouped again); nothing of the call is kept."""
        if self.held is not None:
            _give_up(self.held[0])
        self.reset()

    def take(self, route: Any, x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Optional[Tensor]:
        """``route``'s output from its group (held, or computed now for all as its leader), or None."""
        if x.is_inference():  # no version counter: a write between the calls could not be seen
            return None
        held = self.held
        if held is not None:
            leader, x_ref, version, grad, outputs = held
            entry = outputs.pop(route.path, None)
            if entry is not None and x_ref() is x and version == x._version and grad == torch.is_grad_enabled() \
                    and not torch.is_autocast_enabled(x.device.type) and entry[0] is weight \
                    and entry[1] == weight._version and entry[2] is bias and entry[3] == _version(bias):
                if not outputs:
                    self.held = None
                self.saw(route, x)
                return entry[4]
            # a member called on another input, after a write, or another layer between: a guess
            _give_up(leader)
            self.reset()
        followers = self.plan.get(id(route.module), ())
        if followers == ():
            followers = self.plan[id(route.module)] = _learned(route.module)
        if not followers:
            return None
        members = [route] + [self.by_module.get(id(m)) for m in followers]
        if any(m is None for m in members):
            return None
        biases = [bias] + [m.module.bias if isinstance(getattr(m.module, "bias", None), Tensor) else None
                           for m in members[1:]]
        weights = [weight] + [m.weight for m in members[1:]]
        if not self._groupable(members, x, weights, biases):
            return None
        ys = lora_group(x, weights, biases, [m.lora for m in members], [m.path for m in members], self.impl)
        self.held = (route.module, weakref.ref(x), x._version, torch.is_grad_enabled(),
                     {m.path: (w, w._version, b, _version(b), y)
                      for m, w, b, y in zip(members[1:], weights[1:], biases[1:], ys[1:])})
        self.saw(route, x)
        return ys[0]

    def _groupable(self, members: list, x: Tensor, weights: list, biases: list) -> bool:
        # never under compile: the caller (use.call_op) groups only eager calls
        if x.dim() < 2 or x.numel() == 0 or torch.is_autocast_enabled(x.device.type):
            return False
        loras = [m.lora for m in members]
        if any(m.lora.stacked or m.lora.experts or (m.module.training and m.lora.dropout) for m in members):
            return False
        if any(t is not None and (t.requires_grad or t.is_inference()) for t in (*weights, *biases)):
            return False  # a trainable weight needs its own gradient (the single op has it); versions
        if not group_kernels_apply(x, weights, loras, self.impl):
            return False
        check_use(x, weights[0], biases[0], members[0].lora, members[0].path)  # the leader's own call's checks
        for m, w, bias in zip(members[1:], weights[1:], biases[1:]):
            try:
                check_use(x, w, bias, m.lora, m.path)
            except (TypeError, ValueError):  # a follower that would not take x (another dtype, say):
                _give_up(members[0].module)  # it runs alone, at its own call
                return False
        return group_fits(x, weights, loras, self.impl)

    def saw(self, route: Any, x: Tensor) -> None:
        """Learn from a call (alone or taken from a group): ``route`` ran on ``x``; it joins the
        chain when the chain's last ran on the same, unchanged x and is its sibling."""
        if x.is_inference():
            self.last, self.chain = None, []
            return
        last = self.last
        if last is not None and last[1]() is x and last[2] == x._version and _among(route, last[0].siblings) \
                and not _among(route, self.chain):
            self.chain.append(route)
            leader = self.chain[0].module
            if leader not in _GIVEN_UP:
                _LEARNED[leader] = tuple(weakref.ref(r.module) for r in self.chain[1:])
        else:
            self.chain = [route]
        self.last = (route, weakref.ref(x), x._version)


def _version(t: Optional[Tensor]) -> int:
    return -1 if t is None else t._version


def _learned(leader: nn.Module) -> Optional[tuple[nn.Module, ...]]:
    """The modules learned to follow ``leader``, or None (none, or one of them is gone)."""
    refs = _LEARNED.get(leader)
    followers = None if refs is None else tuple(r() for r in refs)
    return None if followers is None or any(m is None for m in followers) else followers


def learned() -> dict[nn.Module, tuple[nn.Module, ...]]:
    """Every learned group: leader -> the modules that follow it (tests and diagnostics)."""
    groups = {leader: _learned(leader) for leader in list(_LEARNED.keys())}
    return {leader: followers for leader, followers in groups.items() if followers}


def _give_up(leader: nn.Module) -> None:
    """A group of ``leader``'s was a wrong guess: it never groups again (no guess, fail, relearn cycle)."""
    _LEARNED.pop(leader, None)
    _GIVEN_UP.add(leader)


def _among(route: Any, routes: Any) -> bool:
    """``route`` is one of ``routes`` (identity: a route's fields hold tensors, which == compares)."""
    return any(r is route for r in routes)
