"""The stateful convenience layer: ``fastaf.init(model)`` and the ``model.add_new_adapter`` family.

A thin layer over the functional core for code that expects a stateful model (HF ``Trainer``,
``generate``). ``init`` changes one model *instance*, never a transformers class:

- ``model.fastaf``, a ``_Registry`` submodule, holds every adapter's factors as ``nn.Parameter``s
  at ``fastaf.adapters.<name>.<module path, "." -> "__">.{A,B}``, so ``model.parameters()``,
  optimizers and ``Trainer`` see them. The base parameters are frozen; only the active adapter's
  factors require grad, so an optimizer built from the trainable parameters gets exactly those.
- Each module the active adapter targets gets a forward pre-hook and an always-called forward
  hook that enter and leave a mode adapting that module's weights (``functional.module_mode``;
  for an expert LoRA, the module holding the parameter, e.g. ``mlp.experts``):
  the same fused ``lora_linear`` op as ``fastaf.functional_call``, wherever the module runs:
  ``model(...)``, ``generate``'s encoder and vision tower, a submodule called on its own, a
  checkpointed layer's recompute. ``forward`` is the class's own.
- Compiled (the model whole or block by block), each activation is seen: dynamo does not guard on
  hooks (``torch._dynamo.config.skip_nnmodule_hook_guards``), so every module some adapter targets
  keeps its always-called hook, active or not, and that hook reads ``registry.active`` on every
  call, which the compiled graph guards on (an adapter coming back finds its graph cached); so
  does the model's own always-called hook, inlined where a compiled function calls the model. A
  graph ``torch.compile(model)`` or a compiled block traced (at its first call) before any
  adapter targeted a module inside it, or traced for another instance of the class, reads no
  such hook and may go on serving calls: add adapters before the first compiled call. Modules
  no adapter targets carry no hook and pay nothing; one that only an inactive adapter targets
  pays its hook's call (~1.5 us on a CPU). The module hooks hold the registry's key, not the
  registry (``_REGISTRIES``): traced, each reaches it one way, with no identity check per hook
  that Python evaluates at every call of the graph.
- A module replaced after activation (``resize_token_embeddings``' new lm_head) would run
  without its LoRA: the model's call refuses it, one dict lookup per targeted module.
- Siblings over one input (q/k/v, gate/up) run as one op at the first one's call, as in an eager
  ``functional_call`` (``intercept.groups``): the modes share the active adapter's routes,
  kept between calls, and each thread's grouping over them (``_Grouping``). Hooks on the model
  mark where a call of it starts and ends (held outputs go with the call). Not inside a
  non-reentrant activation checkpoint, whose recompute (on autograd's device thread, maybe after
  later calls) must make the ops its forward made.
- Bound methods: ``add_new_adapter``, ``set_active_adapter``, ``remove_adapter``, ``get_adapter``;
  ``active_adapter`` is the active adapter's name; ``save_pretrained`` and ``load_state_dict`` are
  bound over the class's own (HF's save path), and ``forward`` is set on the instance (``_Forward``).
  ``generate``, where the class has one, is bound over it too: a ``generate`` whose decoding step
  compiles runs as ``fastaf.generate`` does, the active adapter copied into one static buffer per
  dtype (``_generate.adapted_decoding``), with the hooks lifted meanwhile (``_Registry.hooks_lifted``):
  traced, each hook is a dozen guards per adapted layer that dynamo checks before every step.

Inside ``fastaf.functional_call(model, adapter, ...)`` the explicit adapter stands in for the
active one, as ``params`` stand in for the model's own parameters; with ``adapter=None`` the
active one applies.

Under FSDP2 (``fully_shard``, as HF ``Trainer`` and accelerate apply it) the registry's
Parameters belong to the root module's group: sharded between steps, gathered while the root
runs, their gradients averaged by FSDP2 itself. Add adapters before sharding (afterwards FSDP2
would not manage them: refused). ``get_adapter`` and ``save_adapter_to_local_dir`` gather the
factors, a collective: call them on every rank (rank 0 writes).

"""
from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import tempfile
import threading
import types
import uuid
import warnings
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as torch_pytree
from safetensors.torch import save_file
from torch import nn

from . import _config
from ._layouts import check_module, linear_spec
from ._generate import (adapted_decoding, adapting_calls, compiles_decode_step, drop_foreign_compiled_call,
                        refuse_checkpointing)
from .functional import Adapter, LoRA, LoRAConfig, adapter_mode, init_adapter
from .intercept import (TRACED_FORWARDS, Groups, branch_output, check_lost, dequantized, explicit_mode_active,
                        link_siblings, module_mode, module_routes, packed_4bit, scoped_call)
from .ops import decoding, linear_rows, traced_decode

_ATTR = "fastaf"  # name of the registry submodule on the model
_DECODE = "decode"  # an open module's entry without a mode: its ``_DecodeForward`` runs the layer with its LoRA
_BRANCH = "branch"  # the same for a quantized linear, whose forward fastaf never adapts (``ops.lora_branch``)
_DONE = "done"  # an entry whose call ran fastaf's op, its LoRA included (a decoding step's, a 4-bit layer's)


def _quantized(module: nn.Module) -> bool:
    spec = linear_spec(module)
    return spec is not None and spec.branch


class _LoRAParams(nn.Module):
    """One adapter key's LoRA factors, trainable: A (r, in), B (out, r), or (E, r, in) /
    (E, out, r) for an expert LoRA."""

    def __init__(self, path: str, lora: LoRA) -> None:
        super().__init__()
        self.path = path
        self.scale = float(lora.scale)
        self.dropout = float(lora.dropout)
        self.experts = lora.experts
        # Copies: optimizers update these in place, and the caller's Adapter is a value.
        self.A = nn.Parameter(lora.A.detach().clone(), requires_grad=False)
        self.B = nn.Parameter(lora.B.detach().clone(), requires_grad=False)

    def lora(self, *, detach: bool) -> LoRA:
        if detach:
            return LoRA(_whole(self.A), _whole(self.B), self.scale, self.dropout, self.experts)
        return LoRA(self.A, self.B, self.scale, self.dropout, self.experts)

    @property
    def owner(self) -> str:
        """The path of the module whose forward applies this LoRA (a parameter's module for experts)."""
        return self.path.rpartition(".")[0] if self.experts else self.path

    def extra_repr(self) -> str:
        return (f"path={self.path!r}, r={self.A.shape[-2]}, scale={self.scale:g}, dropout={self.dropout:g}"
                + (f", experts={self.A.shape[0]}" if self.experts else ""))


def _sharded(t: torch.Tensor) -> bool:
    # by name: torch.distributed.tensor may not be imported (or built)
    return type(t).__name__ == "DTensor"


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A detached copy of all of ``t``: a factor FSDP2 sharded (a DTensor) is all-gathered first,
    a collective every rank must join."""
    return (t.full_tensor() if _sharded(t) else t).detach().clone()


class _AdapterSlot(nn.ModuleDict):
    """One named adapter: escaped module path -> ``_LoRAParams``, plus its config if known."""

    def __init__(self, adapter: Adapter, config: LoRAConfig | None) -> None:
        # ModuleDict keys cannot contain "."; the real path lives on each entry.
        super().__init__({path.replace(".", "__"): _LoRAParams(path, lora) for path, lora in adapter.items()})
        if len(self) != len(adapter):
            raise ValueError(f"module paths collide once '.' is escaped to '__': {list(adapter)}")
        self.config = config

    def adapter(self, *, detach: bool) -> Adapter:
        return Adapter({p.path: p.lora(detach=detach) for p in self.values()})

    def held(self) -> Adapter:
        """The slot's Parameters themselves as an Adapter, unchecked (they were when added): what
        a compiled generate copies from, and another thread's call applies, as they are now."""
        return Adapter._unchecked({p.path: p.lora(detach=False) for p in self.values()})


class _Grouping:
    """The active adapter's routes, kept between calls so that the per-module modes can group
    siblings across modules, and each thread's ``Groups`` over them (``registry.grouping``).
    A copy or a pickle keeps the routes (no call's tensors: a mode drops its W + ΔW on exit)
    and starts with no thread's bookkeeping."""

    def __init__(self, routes: dict[nn.Module, dict[int, Any]]) -> None:
        self.routes = routes  # module -> its routes (``module_routes``)
        everyone = [r for rs in routes.values() for r in rs.values()]
        link_siblings(everyone)
        self.by_id = {id(r): r for r in everyone}
        self.local = threading.local()

    def __getstate__(self) -> dict:
        return {"routes": self.routes}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["routes"])

    def groups(self) -> Groups:
        """This thread's grouping over the routes, each leader's group read afresh: the per-call
        reading (``Groups.plan``) serves a checkpointed recompute, where this layer never groups,
        and kept from a first call it would hold off groups learned since while only submodules run."""
        groups = getattr(self.local, "groups", None)
        if groups is None:
            groups = self.local.groups = Groups(self.by_id, _config.flags().stateful_impl)
        groups.impl = _config.flags().stateful_impl
        groups.plan.clear()
        return groups

    def end_call(self, raised: bool = False) -> None:
        """A call of the model ends (or starts): outputs still held belong to members that never
        ran, and their leader never groups again; after a call that ``raised``, they are only
        dropped (the members did not get to run)."""
        groups = getattr(self.local, "groups", None)
        if groups is not None:
            if raised:
                groups.reset()
            else:
                groups.close()


class _Registry(nn.Module):
    """Every adapter of one model (``model.fastaf``), which one is active, and its module hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.fastaf_holds_no_targets = True  # the routes' walk of the model skips it (``intercept.walked_modules``)
        self.adapters = nn.ModuleDict()
        self.active: str | None = None
        self.active_loras: dict[str, tuple] = {}  # key -> (its slot module, its LoRA): the active slot's, cached
        self.cast_loras: dict[str, tuple] = {}  # key -> (A, A's version, B, B's version, that LoRA in a half dtype)
        self.entered: dict[str, tuple[nn.Module, int]] = {}  # active adapter's module path -> (module, pre-hook id)
        # active adapter's plain nn.Linear and bitsandbytes 4-bit modules -> the instance forward set on
        # each (``_DecodeForward``, ``_Quantized4bitForward``)
        self.forwards: dict[str, tuple[nn.Module, Any]] = {}
        # module path -> the forward made for it, set again at each activation: a compiled call guards
        # on the forward object, and a new one per activation would recompile for an adapter coming back
        self.kept_forwards: dict[str, Any] = {}
        self.watched: dict[str, tuple[nn.Module, int]] = {}  # any adapter's module path -> (module, hook id)
        self.call_hooks: tuple = ()  # the model's (pre-hook id or None, hook id): ``start_call``, ``end_call``
        self.grouping: _Grouping | None = None  # the active adapter's (eager calls)
        self.checked_training = False  # ``check_training`` ran since the last activation
        self.own_forward: Any = None  # a forward set on the model instance before init (accelerate's), if any
        self.lifted: int | None = None  # the thread whose generate runs with the hooks off (``hooks_lifted``)
        self.unkeyed = False  # hooks of a copy still hold its original's key (``__setstate__``)
        _keyed(self)  # ``self.key``: what its module hooks hold to find it

    def __setstate__(self, state: dict) -> None:
        """A deep copy, or a registry unpickled beside the one it was saved from: under a key of
        its own, its hooks (on the copied modules) keyed again. Were one of those modules still
        being copied here (one that holds the registry, as the model does: no adapter fastaf
        registers targets the model itself), at the model's next call (``start_call``)."""
        super().__setstate__(state)
        self.__dict__.setdefault("unkeyed", False)
        self.fastaf_holds_no_targets = True
        self.lifted = None
        key = self.__dict__.get("key", "")  # (none where the pickled hooks are bound to the registry)
        held = getattr(_REGISTRIES, key, None) if key else None
        if held is not None and held() is not None and held() is not self:
            _keyed(self)
            self.unkeyed = not self.rekey_hooks()
        else:
            _keyed(self, key or None)

    def rekey_hooks(self) -> bool:
        """Set this registry's key into its modules' hooks (each a ``functools.partial`` of
        ``_enter_module`` or ``_leave_module``); False where a module is not complete yet."""
        placed = [(m, i, "_forward_pre_hooks") for m, i in self.entered.values()] + \
                 [(m, i, "_forward_hooks") for m, i in self.watched.values()]
        if not all(where in m.__dict__ for m, _, where in placed):
            return False
        for module, hook_id, where in placed:
            hook = module.__dict__[where].get(hook_id)
            if isinstance(hook, functools.partial) and hook.func in (_enter_module, _leave_module):
                module.__dict__[where][hook_id] = functools.partial(hook.func, self.key, *hook.args[1:])
        return True

    def forward(self, x: Any) -> Any:
        """The identity: a container that calls its children in order (``nn.Sequential``) reaches
        the registry last, after the model's own layers, and must get their output back."""
        return x

    def extra_repr(self) -> str:
        return f"active={self.active!r}"

    def slot(self, name: Any) -> _AdapterSlot:
        if not isinstance(name, str):
            raise TypeError(f"an adapter name is a str, got {type(name).__name__} {name!r}; "
                            f"this model has {list(self.adapters)}")
        if name not in self.adapters:
            raise KeyError(f"no adapter named {name!r}; this model has {list(self.adapters)}")
        return self.adapters[name]

    def attach(self, model: nn.Module) -> None:
        """The model's always-called hook (``end_call``), for good: with no adapter active too it
        checks a training call (``check_training``)."""
        self.call_hooks = (None, model.register_forward_hook(self.end_call, always_call=True).id)

    def activate(self, model: nn.Module, name: str | None) -> None:
        """Make ``name`` active: entry hooks on exactly its modules, only its factors trainable."""
        _close_stale(self)  # a mode an interrupted forward left open in this thread
        self.detach_entries(model)
        self.active, self.grouping, self.checked_training = name, None, False
        self.watch(model)  # ``leave_module`` on every adapter's modules, whatever is active
        modules = dict(model.named_modules())
        owners: dict[str, list[str]] = {}  # module path -> the keys its forward applies
        loras: dict[str, dict[str, LoRA]] = {}  # module path -> its LoRAs (factors maybe still FSDP2 shards)
        for p in [] if name is None else self.slot(name).values():
            owners.setdefault(p.owner, []).append(p.path)
            loras.setdefault(p.owner, {})[p.path] = p.lora(detach=False)
        self.active_loras, self.cast_loras = {}, {}
        for path, keys in owners.items():
            # ``functools.partial`` equal in content across activations: dynamo's guards on it pass
            # again when an adapter comes back (a cached graph, not a recompile)
            hook = modules[path].register_forward_pre_hook(functools.partial(_enter_module, self.key, tuple(keys)))
            self.entered[path] = (modules[path], hook.id)
            module = modules[path]
            if len(keys) == 1 and "forward" not in module.__dict__:
                forward = self.kept_forwards.get(path)
                if forward is None or forward.module is not module:
                    forward = (_DecodeForward(module) if type(module) is nn.Linear else
                               _Quantized4bitForward(module, self, keys[0]) if packed_4bit(module) is not None else
                               None)
                    self.kept_forwards[path] = forward
                if forward is not None:
                    module.__dict__["forward"] = forward  # not a submodule
                    self.forwards[path] = (module, forward)
        for slot_name, slot in self.adapters.items():
            for p in slot.parameters():
                p.requires_grad_(slot_name == name)
        if owners:  # each mode refreshes its routes' LoRAs and weights (``mode``)
            self.grouping = _Grouping({modules[path]: module_routes(modules[path], loras[path]) for path in owners})
            # the parents go with the model's own hook, not the registry: a deep copy of one layer
            # (its hooks' registry) must not copy the whole model
            start = functools.partial(self.start_call, _Placed(model, list(owners)))
            self.call_hooks = (model.register_forward_pre_hook(start).id, self.call_hooks[1])

    def detach_entries(self, model: nn.Module) -> None:
        """Remove the active adapter's pre-hooks, from the modules that hold them (maybe replaced since)."""
        for module, hook_id in self.entered.values():
            module._forward_pre_hooks.pop(hook_id, None)
        self.entered = {}
        for module, forward in self.forwards.values():
            if module.__dict__.get("forward") is forward:
                del module.__dict__["forward"]
        self.forwards = {}
        if self.call_hooks and self.call_hooks[0] is not None:
            model._forward_pre_hooks.pop(self.call_hooks[0], None)
            self.call_hooks = (None, self.call_hooks[1])

    def liftable(self, model: nn.Module) -> bool:
        """Whether a compiled ``generate`` may run with the hooks lifted, as ``fastaf.generate``
        runs: no other generate has them lifted, no quantized layer where this torch's dynamo
        cannot trace its forward's removal (``TRACED_FORWARDS``), no FSDP2-sharded factor. Else
        the hooks stay, and the compiled steps run them."""
        if self.lifted is not None:
            return False
        if not TRACED_FORWARDS and any(_quantized(m) for m, _ in self.entered.values()):
            return False
        active = [] if self.active is None else self.slot(self.active).values()
        return not any(_sharded(p.A) or _sharded(p.B) for p in active)

    @contextlib.contextmanager
    def hooks_lifted(self, model: nn.Module) -> Iterator[None]:
        """The hooks this registry put on ``model`` and its modules, and the active adapter's decode
        forwards, off them while the block runs in this thread (``lifted``, set before the first
        is off and cleared after the last is back: another thread's call of the model sees it
        whenever a hook is missing); back on exit, also on error, each hook in its place among the
        others (a user's hook registered after fastaf's still sees the adapted output). An
        activation meanwhile (``set_active_adapter``, ``remove_adapter``) registers its own hooks:
        only the ones the registry still holds come back. Refused while another thread's generate
        has them lifted."""
        with _LIFTING:
            if self.lifted is not None:
                raise RuntimeError("fastaf: another generate with a compiled decoding step runs on this model "
                                   "with its hooks lifted; one at a time per model")
            self.lifted = threading.get_ident()
        taken: dict[int, tuple[dict, list, dict]] = {}  # id(hook dict) -> (it, its items before, id -> hook taken)
        forwards: list[tuple[nn.Module, Any]] = []
        try:
            placed = [(m._forward_pre_hooks, i) for m, i in self.entered.values()]
            placed += [(m.__dict__[where], i) for m, i in self.watched.values()
                       for where in ("_forward_hooks", "_forward_hooks_always_called")]
            pre, post = self.call_hooks or (None, None)
            placed += [(model._forward_pre_hooks, pre)] if pre is not None else []
            placed += [(model.__dict__[where], post) for where in ("_forward_hooks", "_forward_hooks_always_called")
                       if post is not None]
            for hooks, hook_id in placed:
                if hook_id in hooks:
                    held = taken.setdefault(id(hooks), (hooks, list(hooks.items()), {}))
                    held[2][hook_id] = hooks.pop(hook_id)
            for module, forward in self.forwards.values():
                if module.__dict__.get("forward") is forward:
                    del module.__dict__["forward"]
                    forwards.append((module, forward))
            yield
        finally:
            held_ids = {i for _, i in self.entered.values()} | {i for _, i in self.watched.values()} \
                | {i for i in self.call_hooks if i is not None}
            for hooks, before, lifted in taken.values():
                _put_back(hooks, before, {k: v for k, v in lifted.items() if k in held_ids})
            kept = {id(f) for _, f in self.forwards.values()}  # (an activation meanwhile set its own)
            for module, forward in forwards:
                if id(forward) in kept:
                    module.__dict__.setdefault("forward", forward)
            self.lifted = None

    def __getstate__(self) -> dict:
        if self.lifted is not None:  # its model's hooks are off: a copy would keep none
            raise RuntimeError("fastaf: a model cannot be copied or pickled while a generate with a compiled "
                               "decoding step runs on it (its hooks are lifted until it ends); copy it before or after")
        return super().__getstate__()

    def watch(self, model: nn.Module) -> None:
        """An always-called hook (``leave_module``) on each module some adapter's LoRA applies to,
        and on no other: moved to a module that replaced one, removed with the last adapter there."""
        modules = dict(model.named_modules())
        wanted = {p.owner for slot in self.adapters.values() for p in slot.values()}
        for path, (module, hook_id) in list(self.watched.items()):
            if path not in wanted or modules.get(path) is not module:
                module._forward_hooks.pop(hook_id, None)
                module._forward_hooks_always_called.pop(hook_id, None)
                del self.watched[path]
        new = [path for path in sorted(wanted - self.watched.keys()) if path in modules]
        for path in new:  # (one gone from the model: ``set_active_adapter`` refuses its adapter)
            hook = modules[path].register_forward_hook(functools.partial(_leave_module, self.key), always_call=True)
            self.watched[path] = (modules[path], hook.id)
        _warn_compiled_above(modules, new)

    def active_lora(self, path: str) -> LoRA:
        """The active slot's LoRA at ``path``, from the Parameters it holds now: rebuilt when they
        were replaced (``load_state_dict(assign=True)``, ``to_empty``), else the cached one (read
        at every adapted layer of every step: the slot module is cached with it, and its
        Parameters are compared through ``_parameters``, not ``Module.__getattr__``)."""
        # traced: from the slot's Parameters directly, with no cache (the cache's LoRA and the slot
        # reach the same tensors two ways: identity guards evaluated in Python at every call)
        traced = torch.compiler.is_compiling()
        held = None if traced else self.active_loras.get(path)
        if held is not None:
            params, lora = held
            own = params._parameters
            if own["A"] is lora.A and own["B"] is lora.B:
                return lora
        params = self.adapters[self.active][path.replace(".", "__")]
        if _sharded(params.A) or _sharded(params.B):
            raise RuntimeError(
                f"fastaf: adapter {self.active!r} at {path}: its factors are FSDP2 shards (DTensor) here; "
                "FSDP2 gathers them (they belong to the root module's group) only while the whole model "
                "runs: call the model, not one of its submodules alone"
            )
        lora = params.lora(detach=False)
        if not traced:
            self.active_loras[path] = (params, lora)
        return lora

    def enter_module(self, keys: tuple[str, ...], module: nn.Module, args: Any) -> None:
        # Targeted modules do not nest (``_register`` checks), so an entry of this registry still
        # open here was left by a forward that an interrupt (KeyboardInterrupt skips always-called
        # hooks) cut short.
        _close_stale(self)
        stack = _open_modes()
        lora = self.decodes(keys, module, args)
        if lora is not None:  # no mode: leave_module adds the LoRA to the output
            stack.append((module, _DECODE, self, (keys[0], lora)))
            return
        if _quantized(module) and not explicit_mode_active():  # its weights are packed: a branch on its output
            stack.append((module, _BRANCH, self, keys[0]))
            return
        # inside functional_call the explicit adapter stands in for the active one
        mode = None if explicit_mode_active() else self.mode(keys, module)
        counts = None
        if mode is not None:
            routes = mode.all_routes()
            if torch.compiler.is_compiling():  # this run's uses (leave_module checks them), from zero:
                for route in routes:          # a count read from before would be a guard on its value
                    route.hits = route.gradless = 0
            else:  # eagerly threads share the kept routes: this entry's uses are the counts' growth
                counts = [(route.hits, route.gradless) for route in routes]
            mode.__enter__()
        stack.append((module, mode, self, counts))

    def decodes(self, keys: tuple[str, ...], module: nn.Module, args: Any) -> LoRA | None:
        """The active LoRA when this call of a plain ``nn.Linear`` is a decoding step its forward
        (``_DecodeForward``) computes with the LoRA, no mode entered: an eager
        inference call (``decoding``: grad off, at most 1024 rows on CUDA), or any traced call with
        grad off and no dropout drawn (a compiled decoding step). A mode per call is host time at
        every adapted layer of every step: eagerly its entry, its exit and the F.linear dispatched
        through it; compiled, the routes' counters and the mode's state, which dynamo writes back
        after every replay of the graph. Not inside ``functional_call`` (its adapter stands in),
        nor for a weight passed for one call, nor for an input by keyword; else None."""
        if type(module) is not nn.Linear or len(keys) != 1 or len(args) != 1:
            return None
        # read as ``Module.__call__`` reads it: traced, a second way to the same object is an identity
        # guard that Python evaluates at every call of the graph (one per adapted layer a step)
        if not isinstance(module.forward, _DecodeForward):
            return None
        x, weight = args[0], module._parameters["weight"]
        if not isinstance(x, torch.Tensor) or type(weight) is not nn.Parameter or x.dtype != weight.dtype:
            return None
        impl = _config.flags().stateful_impl
        if torch.compiler.is_compiling() and (torch.is_grad_enabled() or impl != "auto"):
            return None  # a training step: the mode's op path
        lora = self.active_lora(keys[0])
        if torch.compiler.is_compiling():
            inference = not (module.training and lora.dropout)
        else:
            inference = type(x) is torch.Tensor and decoding(x, lora, impl, module.training)
        return lora if inference and not explicit_mode_active() else None

    def decode_lora(self, key: str, lora: LoRA, dtype: torch.dtype) -> LoRA:
        """The active ``lora`` at ``key`` with its factors in ``dtype``: fp32 masters cast once while
        they stay as they are (their version counters), not at every step (two launches a layer)."""
        if lora.A.dtype == dtype and lora.B.dtype == dtype:
            return lora
        held = self.cast_loras.get(key)
        if held is None or held[0] is not lora.A or held[1] != lora.A._version or held[2] is not lora.B \
                or held[3] != lora.B._version or held[4].A.dtype != dtype:
            cast = LoRA(lora.A.detach().to(dtype), lora.B.detach().to(dtype), lora.scale, lora.dropout)
            held = self.cast_loras[key] = (lora.A, lora.A._version, lora.B, lora.B._version, cast)
        return held[4]

    def mode(self, keys: tuple[str, ...], module: nn.Module) -> Any:
        """The mode around ``module``'s forward: on its kept routes, grouping with its siblings
        (eagerly); traced or checkpointed, new routes per call, each layer alone (dynamo cannot
        trace the grouping's bookkeeping; ``_checkpointed``)."""
        grouping = None if torch.compiler.is_compiling() or _checkpointed() else self.grouping
        kept = () if grouping is None else grouping.routes.get(module, {}).values()  # (a layer copied alone: none)
        members = [m for route in kept for m in route.siblings or (route,)]
        weights = [getattr(m.module, m.name) for m in members]
        # weights passed for one call (torch.func.functional_call): the kept routes must not keep
        # them (nor their graphs) past it
        if not kept or not all(isinstance(w, nn.Parameter) for w in weights):
            return module_mode(module, {k: self.active_lora(k) for k in keys}, impl=_config.flags().stateful_impl)
        # the siblings too: a leader computes their outputs with the weights and factors they hold
        # now (FSDP2 swaps in unsharded weights; load_state_dict(assign=True) new factors)
        for member, weight in zip(members, weights):
            member.lora, member.weight = self.active_lora(member.path), weight
        return module_mode(module, impl=_config.flags().stateful_impl, routes={id(r.weight): r for r in kept}, groups=grouping.groups())

    def start_call(self, placed: _Placed, model: nn.Module, args: Any) -> None:
        if self.unkeyed:
            _rekey_later(self)
        # checked compiled too: it reads no tensor, and traced it becomes identity guards
        self.check_placed(placed, model)
        if not torch.compiler.is_compiling() and self.grouping is not None:
            self.grouping.end_call()

    def check_placed(self, placed: _Placed, model: nn.Module) -> None:
        """Each module the active adapter's hooks sit on (``placed``) is still
        where it was: a module put in its place since, or in an ancestor's (``resize_token_embeddings``'
        new lm_head, an assignment, a fresh attention block), has no hook and would run without its
        LoRA. One dict lookup per link of the paths (each link once); on a change, each path is
        resolved again through the wrappers a module may get in place (``torch.compile``'s,
        activation checkpointing's), which still run the hooked module."""
        # by id (the child is held here too, so its id is not reused): traced, ``is`` between the
        # module read through the model and the one held here is an identity guard Python evaluates
        # at every call; an id is a constant, guarded in C++ by the module's own identity
        walked = [model]  # each module read one way, from the model down (traced: one source each)
        for parent_at, name, _, child_id in placed.links:
            child = walked[parent_at]._modules.get(name)
            if child is None or id(child) != child_id:  # (dynamo, torch 2.11, cannot trace id(None))
                break
            walked.append(child)
        else:
            return
        for path, module in placed.targets:
            now = _resolved(model, path)
            if now is not module:
                what = "gone" if now is None else f"another {type(now).__name__} now than the one it was activated on"
                raise RuntimeError(
                    f"fastaf: adapter {self.active!r} is active on {path}, but {type(model).__name__}.{path} is "
                    f"{what} (it or a module above it replaced since, e.g. by resize_token_embeddings or an "
                    f"assignment), which runs without its LoRA; call model.set_active_adapter({self.active!r}) "
                    "again to check the adapter against the model as it is now and apply it there, or "
                    "set_active_adapter(None)"
                )
        # every module in its place, or the model deep-copied (the ids are the copy's original's): ids
        # as they are now, for the next call's one walk. Through a wrapper put in place since
        # (activation checkpointing's, FSDP's) no direct walk reaches them: this check runs each call
        try:
            now = _Placed(model, [path for path, _ in placed.targets])
        except KeyError:
            return
        if all(a is b for (_, a), (_, b) in zip(now.targets, placed.targets)):
            placed.links = now.links

    def end_call(self, model: nn.Module, args: Any, output: Any) -> None:
        # ``self.active`` read on every call, compiled too: a compiled function that calls the model
        # (a train step) guards on it as on ``leave_module``'s. (``torch.compile(model)`` runs the
        # model's own hooks outside its graph.)
        if self.active is None:
            if not torch.compiler.is_compiling() and sys.exc_info()[0] is None:
                self.check_training(model, output)
        elif not torch.compiler.is_compiling() and self.grouping is not None:
            self.grouping.end_call(raised=sys.exc_info()[0] is not None)  # always called: also on a raise

    def check_training(self, model: nn.Module, output: Any) -> None:
        """Warn, once per activation, at the first training call (train mode, grad enabled) with
        adapters but none active where nothing requires grad: its backward is bound to fail with
        torch's "element 0 of tensors does not require grad", which names neither cause nor cure.
        A warning, not an error: the call itself is sound, and a caller may train something the
        model cannot see (a loss on inputs that require grad, ``torch.autograd.grad`` elsewhere)."""
        if self.checked_training or not self.adapters or not model.training or not torch.is_grad_enabled():
            return
        self.checked_training = True  # one scan of the parameters, not one a call
        if any(p.requires_grad for p in model.parameters()):
            return
        if any(isinstance(t, torch.Tensor) and t.requires_grad for t in torch_pytree.tree_leaves(output)):
            return
        warnings.warn(
            f"fastaf: {type(model).__name__} runs in training mode with grad enabled, but no adapter is active "
            f"(it has {list(self.adapters)}) and fastaf.init froze its base, so nothing it computes requires "
            "grad and a backward will fail ('element 0 of tensors does not require grad'): call "
            f"model.set_active_adapter(name) first, e.g. model.set_active_adapter({next(iter(self.adapters))!r})",
            stacklevel=6,  # the caller's model(...): past end_call and Module's inner, _call_impl, __call__
        )

    def leave_module(self, module: nn.Module, args: Any, output: Any) -> Any:
        # On every module some adapter targets, active or not, and ``self.active`` read on every
        # call: dynamo does not guard on hooks (torch._dynamo.config.skip_nnmodule_hook_guards),
        # so a graph compiled with no adapter active would never see one activated later; this
        # read is what it guards on (compiled whole or per block).
        if self.active is None:
            return
        stack = _open_modes()
        if stack and stack[-1][0] is module:
            _, mode, _, counts = stack.pop()
            if mode is _DONE:  # fastaf's op ran the layer, its LoRA included (``_DecodeForward``, ``_Quantized4bitForward``)
                return
            if mode is _BRANCH:  # a quantized linear's output plus its LoRA (``ops.lora_branch``)
                if sys.exc_info()[0] is None:
                    return branch_output(counts, module, args, output, self.active_lora(counts))
                return
            _close(mode)
            if mode is not None and sys.exc_info()[0] is None:
                # the module ran: a weight it used in no way fastaf adapts (a forward reading
                # weight.data) lost its LoRA, as functional_call reports. A loop first: this runs at
                # every adapted module's every call
                routes = mode.all_routes()
                before = counts or [(0, 0)] * len(routes)
                for route, (hits, _) in zip(routes, before):
                    if route.hits == hits:
                        ran = [types.SimpleNamespace(path=r.path, module=r.module, hits=r.hits - h, calls=1,
                                                     gradless=r.gradless - g) for r, (h, g) in zip(routes, before)]
                        check_lost(ran, f"fastaf: the active adapter {self.active!r}")
                        break


class _Table:
    """Every live registry, as an attribute named by its key (a weak reference). Its module hooks
    hold the key, not the registry: traced, every hook then reaches it one way (``getattr`` of a
    constant name, guarded in C++), where a registry bound into each hook was an identity check per
    hook that Python evaluated at every call of the graph (two per adapted module). Attributes, not
    a dict: dynamo reads a global dict whole, each entry, where a registry collected meanwhile
    changed its size."""


_REGISTRIES = _Table()


_LIFTING = threading.Lock()  # a registry's ``lifted``: checked and set as one step


def _put_back(hooks: dict, before: list, lifted: dict) -> None:
    """Put the ``lifted`` hooks (id -> hook) back into ``hooks``, each right after the hook that
    preceded it in ``before`` (the dict's items when they were lifted) and is still there, else
    right before the one that followed it, else last (after hooks added meanwhile, which keep their
    places: a ``prepend=True`` one first)."""
    if len(hooks) + len(lifted) == len(before) and all(k in lifted or k in hooks for k, _ in before):
        # nothing added or removed meanwhile (every generate's case): the order lifted, in one pass
        values = {**hooks, **lifted}
        hooks.clear()
        hooks.update((k, values[k]) for k, _ in before)
        return
    order = [k for k in hooks]
    values = dict(hooks)
    for at, (key, _) in enumerate(before):
        if key not in lifted:
            continue
        after = next((k for k, _ in reversed(before[:at]) if k in values), None)
        ahead = next((k for k, _ in before[at + 1:] if k in values), None)
        order.insert(order.index(after) + 1 if after is not None else
                     order.index(ahead) if ahead is not None else len(order), key)
        values[key] = lifted[key]
    hooks.clear()
    hooks.update((k, values[k]) for k in order)


def _keyed(registry: _Registry, key: str | None = None) -> None:
    """File ``registry`` under ``key`` (a new one by default), for as long as it lives."""
    registry.key = key or f"r{uuid.uuid4().hex}"
    ref = weakref.ref(registry)
    setattr(_REGISTRIES, registry.key, ref)
    weakref.finalize(registry, _forget, registry.key, ref)


def _forget(key: str, ref: weakref.ref) -> None:
    if getattr(_REGISTRIES, key, None) is ref:
        delattr(_REGISTRIES, key)


def _registry_at(key: str) -> _Registry | None:
    ref = getattr(_REGISTRIES, key, None)
    return None if ref is None else ref()


@torch._dynamo.disable
def _rekey_later(registry: _Registry) -> None:
    """``rekey_hooks`` of a copy whose model was still being copied: at its first call, outside
    any trace (it rewrites hook dicts)."""
    registry.unkeyed = not registry.rekey_hooks()


def _enter_module(key: str, keys: tuple[str, ...], module: nn.Module, args: Any) -> None:
    """A targeted module's pre-hook: its registry's ``enter_module``."""
    registry = _registry_at(key)
    if registry is not None:  # (a layer copied alone outliving its model's registry runs as it is)
        registry.enter_module(keys, module, args)


def _leave_module(key: str, module: nn.Module, args: Any, output: Any) -> Any:
    """An adapted module's always-called hook: its registry's ``leave_module``."""
    registry = _registry_at(key)
    return None if registry is None else registry.leave_module(module, args, output)


def _warn_compiled_above(modules: Mapping[str, nn.Module], paths: list[str]) -> None:
    """Warn when modules that just got their first adapter sit in a block already compiled in
    place (``layer.compile()``): a graph it traced before saw no hook there and keeps serving the
    base model (``torch.compile(model)``'s wrapper cannot be seen from here: the docs say it)."""
    compiled = [p for p, m in modules.items() if getattr(m, "_compiled_call_impl", None) is not None]
    hit = [(path, block) for path in paths for block in compiled
           if block == "" or path == block or path.startswith(block + ".")]
    if hit:
        path, block = hit[0]
        warnings.warn(
            f"fastaf: {path} ({len(hit)} adapted module(s) in all) sits in {block or 'the model'}, compiled before "
            "its first adapter was added: a graph traced before does not run the adapter's hooks and keeps "
            "serving the base model there; add adapters before the first compiled call, or call "
            "torch._dynamo.reset() before the next one",
            stacklevel=6,
        )


class _Placed:
    """What ``check_placed`` compares: ``links``, every link on the way from ``model`` to the modules
    at ``paths``, each once, parents first, as (the parent's place in the walk, name, child, id of
    the child); ``targets``, (path, module) per path."""

    def __init__(self, model: nn.Module, paths: list[str]) -> None:
        links: dict[tuple[int, str], tuple[int, str, nn.Module, int]] = {}
        at = {id(model): 0}  # module -> its place in check_placed's walk (the model first)
        targets = []
        for path in paths:
            if not path:
                continue  # the model itself ("") cannot be replaced inside itself
            module = model
            for name in path.split("."):
                child = module._modules[name]
                if (id(module), name) not in links:
                    links[(id(module), name)] = (at[id(module)], name, child, id(child))
                    at[id(child)] = len(links)
                module = child
            targets.append((path, module))
        self.links, self.targets = tuple(links.values()), tuple(targets)


# where a module that wraps another in place keeps it: torch.compile's OptimizedModule, activation
# checkpointing's CheckpointWrapper, FSDP1's and DDP's wrappers
_WRAPPED = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module", "module")


def _unwrapped(module: nn.Module) -> nn.Module:
    for _ in range(8):  # wrappers of wrappers, not a cycle
        inner = next((module._modules[a] for a in _WRAPPED if module._modules.get(a) is not None), None)
        if inner is None:
            break
        module = inner
    return module


def _resolved(model: nn.Module, path: str) -> nn.Module | None:
    """The module at ``path`` under ``model``, looked up through wrappers put in place since
    (a name missing on a wrapper is looked for in the module it wraps), or None."""
    module = model
    for name in path.split("."):
        child = module._modules.get(name)
        if child is None:
            child = _unwrapped(module)._modules.get(name)
            if child is None:
                return None
        module = child
    return _unwrapped(module) if module is not None else None


def _checkpointed() -> bool:
    """Saved-tensor hooks are on: a non-reentrant activation checkpoint's forward or recompute, or
    activation offloading (``save_on_cpu``: the stack below its top cannot be read). The recompute
    runs in the backward, on autograd's device thread on CUDA and maybe after later calls, and
    must make the ops its forward made, which a grouping read per call and thread cannot promise.
    (Where torch lacks the query or it fails, never group.)"""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    try:
        return top is None or top(False) is not None
    except (TypeError, RuntimeError):  # another signature; a state where the stack cannot be read
        return True


def _close_stale(registry: _Registry) -> None:
    stack = _open_modes()
    while stack and stack[-1][2] is registry:
        _close(stack.pop()[1])


def _close(mode: Any) -> None:
    """Leave ``mode`` if it is the innermost torch function mode (leaving another would pop that one)."""
    stack = torch.overrides._get_current_function_mode_stack()
    if mode is not None and stack and stack[-1] is mode:
        mode.__exit__(None, None, None)


_local = threading.local()  # modes are per thread, and so is the stack of the hooks that opened them


def _open_modes() -> list:
    if not hasattr(_local, "modes"):
        _local.modes = []
    return _local.modes


def _check_new_name(name: Any, existing: Mapping[str, Any]) -> None:
    """``name`` can name a new adapter beside ``existing`` ones (``check_adapter_name``)."""
    from .io import check_adapter_name

    check_adapter_name(name)
    if name in existing:
        raise ValueError(f"an adapter named {name!r} already exists; this model has {list(existing)}")


def _check_unsharded(base: nn.Module, name: str) -> None:
    """Adapters join a model before FSDP2 shards it, or FSDP2 never manages their Parameters."""
    if any(_sharded(p) for p in base.parameters()):
        raise RuntimeError(
            f"fastaf: adapter {name!r} cannot be added to a model that FSDP2 (fully_shard) has already sharded: "
            "FSDP2 would neither gather its factors nor average their gradients, so each rank would train its "
            "own copy. Add adapters before sharding (before Trainer.train or accelerator.prepare)"
        )


# ---- the instance state -------------------------------------------------------------------------


def _registry(model: nn.Module) -> _Registry:
    registry = getattr(model, _ATTR, None)
    if not isinstance(registry, _Registry):
        inner = getattr(model, "module", None)  # DDP's and accelerate's wrappers hold the model there
        hint = (" (it wraps one that has them: pass its .module)"
                if isinstance(getattr(inner, _ATTR, None), _Registry) else "; call fastaf.init(model) first")
        raise RuntimeError(f"{type(model).__name__} has no fastaf adapters{hint}")
    return registry


@contextlib.contextmanager
def _without_registry(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` with its registry detached, so target matching never sees the registry's modules."""
    registry = model._modules.pop(_ATTR)
    try:
        yield model
    finally:
        model._modules[_ATTR] = registry


def _register(model: nn.Module, name: str, adapter: Adapter, config: LoRAConfig | None) -> None:
    """Validate ``adapter`` against the model, then add it; nothing is added on error."""
    registry = _registry(model)
    with _without_registry(model) as base:
        _check_registrable(base, name, adapter, registry.adapters)
    _add_checked(model, name, adapter, config)


def _add_checked(model: nn.Module, name: str, adapter: Adapter, config: LoRAConfig | None) -> None:
    """Add ``adapter`` as ``name``, ``_check_registrable`` having passed."""
    registry = _registry(model)
    registry.adapters[name] = _AdapterSlot(adapter, config)
    with _without_registry(model) as base:
        registry.watch(base)  # its modules read the active adapter from now on (``leave_module``)


def _check_registrable(base: nn.Module, name: str, adapter: Adapter, existing: Mapping[str, Any]) -> None:
    """Raise unless ``adapter`` can be registered as ``name`` beside ``existing`` on ``base`` (the
    model without its registry); changes nothing, so a caller can check before ``init``."""
    _check_new_name(name, existing)
    if len(adapter) == 0:
        raise ValueError(f"adapter {name!r} is empty; it adapts no module")
    _check_unsharded(base, name)
    adapter_mode(base, adapter)  # raises on unknown paths, non-linear modules, shapes, devices
    owners = sorted({p.rpartition(".")[0] if l.experts else p for p, l in adapter.items()})
    nested = [(a, b) for a in owners for b in owners if a != b and (a == "" or b.startswith(a + "."))]
    if nested:
        raise ValueError(
            f"adapter {name!r} adapts weights of {nested[0][0]!r} and of its submodule {nested[0][1]!r}; the "
            "stateful layer applies a LoRA around its module's forward and cannot nest them: use "
            "fastaf.functional_call"
        )


# ---- the bound methods --------------------------------------------------------------------------


def _add_new_adapter(self: nn.Module, name: str, config: LoRAConfig | Adapter, *, seed: int | None = None) -> None:
    """Add a new, inactive adapter ``name``.

    Args:
        name: a new adapter name (no '.').
        config: a ``LoRAConfig`` (factors initialised like PEFT by ``fastaf.init_adapter``: fp32,
            B = 0, on each module's device), or an ``Adapter`` whose values are copied in (its
            factors must already sit on their modules' devices; the dtype is kept).
        seed: seeds ``init_adapter``'s generator (config only).
    Raises:
        ValueError: the name exists or is invalid, or the config/adapter does not fit the model;
            nothing is added then.
    """
    registry = _registry(self)
    _check_new_name(name, registry.adapters)  # before the (possibly large) init
    if isinstance(config, LoRAConfig):
        with _without_registry(self) as base:
            _check_unsharded(base, name)  # before the init
            adapter = init_adapter(base, config, seed=seed)
        _register(self, name, adapter, config)
    elif isinstance(config, Adapter):
        if seed is not None:
            raise TypeError(f"add_new_adapter({name!r}, ..., seed={seed!r}): seed seeds the initialisation of a "
                            "fastaf.LoRAConfig's factors; an Adapter brings its own: drop seed=")
        stacked = next(((p, l) for p, l in config.items() if l.stacked), None)
        if stacked is not None:
            path, lora = stacked
            raise ValueError(
                f"add_new_adapter({name!r}, ...): {path} holds a stacked LoRA, A {tuple(lora.A.shape)} (fastaf.stack); "
                "the stateful layer holds one adapter per name: add each of fastaf.unstack(adapter) under a name "
                "of its own, or pass the stack with adapter_ids to fastaf.generate or fastaf.functional_call"
            )
        _register(self, name, config, None)
    else:
        raise TypeError(
            f"add_new_adapter({name!r}, ...) needs a fastaf.LoRAConfig or Adapter, got {type(config).__name__}"
        )


def _set_active_adapter(self: nn.Module, name: str | None) -> None:
    """Make ``name`` the adapter that ``model(...)`` applies and the only trainable one; None: the base.

    The adapter is checked against the model as it is now, before anything changes: a model
    changed since the adapter was added (``resize_token_embeddings`` under an adapted lm_head)
    is an error here, not at the next forward."""
    registry = _registry(self)
    if name is not None and not isinstance(name, str):
        raise TypeError(f"set_active_adapter takes one adapter's name (a str) or None, got {type(name).__name__} "
                        f"{name!r}; this model has {list(registry.adapters)}")
    if name is not None:
        slot = registry.slot(name)  # KeyError naming the known adapters
    with _without_registry(self) as base:
        if name is not None:
            try:
                adapter_mode(base, slot.adapter(detach=True))  # validates paths, shapes and devices; changes nothing
            except ValueError as err:
                raise ValueError(f"set_active_adapter({name!r}): the adapter does not fit "
                                 f"{type(base).__name__} as it is now: {err}") from err
        registry.activate(base, name)
    self.active_adapter = name


def _remove_adapter(self: nn.Module, name: str) -> None:
    """Delete adapter ``name`` and its parameters; removing the active adapter deactivates it."""
    registry = _registry(self)
    registry.slot(name)
    if registry.active == name:
        _set_active_adapter(self, None)
    del registry.adapters[name]
    with _without_registry(self) as base:
        registry.watch(base)  # off the modules no adapter left targets


def _get_adapter(self: nn.Module, name: str) -> Adapter:
    """The current values of adapter ``name`` as a ``fastaf.Adapter`` (detached copies; factors
    that FSDP2 sharded are gathered, a collective every rank must join)."""
    return _registry(self).slot(name).adapter(detach=True)


# ---- Hugging Face's save and load path ------------------------------------------------------------

_HF_WEIGHTS = "model.safetensors"  # the file Trainer's resume_from_checkpoint and load_best_model_at_end read
_IGNORED_SAVE_KWARGS = ("safe_serialization", "max_shard_size")  # always safetensors, one small file


def _save_pretrained(self: nn.Module, save_directory: str | Path, state_dict: Mapping[str, torch.Tensor] | None = None,
                     is_main_process: bool = True, selected_adapters: list[str] | None = None, **kwargs: Any) -> None:
    """Write the adapters in PEFT's layout, as ``PeftModel.save_pretrained`` does, not the base weights.

    The active adapter (with none active, the only one) goes into ``save_directory`` itself, every
    other into ``save_directory/<name>/``, each as ``adapter_model.safetensors`` +
    ``adapter_config.json`` with its name recorded: ``PeftModel.from_pretrained(base, dir)`` and
    ``fastaf.load_adapter(model, dir)`` read them. Beside them, ``model.safetensors`` holds every
    adapter's factors under the model's own state-dict names (``fastaf.adapters.<name>...``), a few
    MB: HF Trainer's ``resume_from_checkpoint`` and ``load_best_model_at_end`` load that file with
    ``model.load_state_dict``, which an ``fa.init`` model reads as its adapters alone.

    Args:
        save_directory: the folder (created if missing).
        state_dict: the model's state dict, as Trainer passes it (gathered under FSDP): the factors
            are read from it, on the writing rank alone. Without it they are read from the model
            (factors FSDP2 sharded are gathered: call it on every rank).
        is_main_process: False on the ranks that do not write (Trainer's ``should_save``).
        selected_adapters: the adapters to write (default: all).
    """
    from .io import atomic, save_adapter

    unsupported = sorted(set(kwargs) - set(_IGNORED_SAVE_KWARGS))
    if unsupported:
        raise TypeError(
            f"save_pretrained of a fastaf.init model writes its adapters in PEFT's layout and takes no {unsupported}; "
            "to upload, use fastaf.push_adapter_to_hub(model, name=..., repo_id=...)"
        )
    registry = _registry(self)
    names = list(registry.adapters) if selected_adapters is None else list(selected_adapters)
    for name in names:
        registry.slot(name)  # unknown names fail before anything is written
    if not names:
        raise ValueError(f"save_pretrained: {type(self).__name__} has no fastaf adapters to save; add one first")
    top = registry.active if registry.active in names else (names[0] if len(names) == 1 else None)
    prefix = _ATTR + "."
    if state_dict is not None:  # a wrapper's keys lead with its own prefix (torch.compile's, DDP's)
        given = {}
        for key, value in state_dict.items():
            for lead in ("", "_orig_mod.", "module."):
                if key.startswith(lead + prefix):
                    given[key[len(lead + prefix):]] = value
        given = {k: v for k, v in given.items() if k.split(".")[1] in names}  # adapters.<name>.…
        adapters = {name: _slot_from(registry.slot(name), f"adapters.{name}.", given) for name in names}
        factors = {prefix + k: v for k, v in given.items()}
    else:  # every rank gathers (a collective under FSDP2); the writer writes
        adapters = {name: registry.slot(name).adapter(detach=True) for name in names}
        factors = {f"{prefix}adapters.{name}.{key}.{f}": _whole(getattr(p, f))
                   for name in names for key, p in registry.slot(name).items() for f in ("A", "B")}
    if not is_main_process:
        return
    directory = Path(save_directory)
    with _without_registry(self) as base:
        for name in names:
            target = directory if name == top else directory / name
            save_adapter(adapters[name], target, config=registry.slot(name).config, name=name, model=base)
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in factors.items()}
    atomic.replace_files(directory, {_HF_WEIGHTS: lambda path: save_file(tensors, str(path), metadata={"format": "pt"})})


def _slot_from(slot: _AdapterSlot, prefix: str, state: Mapping[str, torch.Tensor]) -> Adapter:
    """Adapter ``slot``'s LoRAs with the factors a state dict gives (keys below ``prefix``)."""
    loras = {}
    for key, p in slot.items():
        try:
            a, b = state[f"{prefix}{key}.A"], state[f"{prefix}{key}.B"]
        except KeyError as err:
            raise ValueError(f"save_pretrained: the state_dict passed lacks {_ATTR}.{err.args[0]} (adapter "
                             f"{prefix.split('.')[1]!r} at {p.path})") from None
        loras[p.path] = LoRA(a.detach(), b.detach(), p.scale, p.dropout, p.experts)
    return Adapter(loras)


def _load_state_dict(self: nn.Module, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
    """``nn.Module.load_state_dict``, but a state dict of the adapters alone (every key under
    ``fastaf.``: what ``save_pretrained`` writes for Trainer's resume) loads the adapters alone,
    with no base key reported missing. Keys of adapters the model lacks are unexpected keys."""
    prefix = _ATTR + "."
    if state_dict and all(isinstance(k, str) and k.startswith(prefix) for k in state_dict):
        result = _registry(self).load_state_dict({k[len(prefix):]: v for k, v in state_dict.items()},
                                                 strict=strict, assign=assign)
        return type(result)([prefix + k for k in result.missing_keys], [prefix + k for k in result.unexpected_keys])
    return type(self).load_state_dict(self, state_dict, strict=strict, assign=assign)


class _Method:
    """A stateful-API function bound to one model, as ``types.MethodType`` binds it, that pickles:
    a bound method pickles as ``getattr(model, function name)``, and the private function names
    are not the model's attributes, so a whole model saved with ``torch.save`` failed to load."""

    def __init__(self, fn: Any, model: nn.Module) -> None:
        self.__func__, self.__self__ = fn, model
        self.__name__, self.__doc__ = fn.__name__.lstrip("_"), fn.__doc__
        self.__qualname__ = f"{type(model).__name__}.{self.__name__}"

    @property
    def __signature__(self) -> inspect.Signature:
        signature = inspect.signature(self.__func__)  # less the model, as a bound method's
        return signature.replace(parameters=list(signature.parameters.values())[1:])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__func__(self.__self__, *args, **kwargs)

    def __reduce__(self) -> tuple:
        return type(self), (self.__func__, self.__self__)

    def __repr__(self) -> str:
        return f"<fastaf method {self.__name__} of {type(self.__self__).__name__} at {id(self.__self__):#x}>"


class _GenerateMethod(_Method):
    """``_generate`` bound to one model: its signature is the class's ``generate``'s, which
    callers read (pipelines, Trainer) as they would the method it stands over."""

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(type(self.__self__).generate.__get__(self.__self__))


class _DecodeForward:
    """The ``forward`` set on a plain ``nn.Linear`` while an adapter is active on it: a decoding
    call (``enter_module`` opened it as ``_DECODE``) computes the layer and its LoRA together
    (eagerly ``ops.linear_rows``, traced ``ops.traced_decode``: for few rows one Triton launch, the
    base model's one per linear) and marks the entry ``_DONE``, so ``leave_module`` adds nothing;
    any other call runs ``nn.Linear.forward``. An object, not a closure: a deep copy of the model
    gets one bound to the copied layer."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, input: torch.Tensor) -> torch.Tensor:  # nn.Linear.forward's parameter name
        module, stack = self.module, _open_modes()
        # traced, the entry on top is this layer's, pushed by its pre-hook just now (targeted modules
        # do not nest, and nn.Linear calls nothing): comparing the module read two ways would be an
        # identity guard evaluated in Python at every call of the graph
        if stack and stack[-1][1] is _DECODE and (torch.compiler.is_compiling() or stack[-1][0] is module):
            module, registry, (key, lora) = stack[-1][0], stack[-1][2], stack[-1][3]  # (traced: as the hook got it)
            weight, bias = module._parameters["weight"], module._parameters["bias"]
            stack[-1] = (module, _DONE, registry, key)
            if torch.compiler.is_compiling():  # the factors as they are: no cast kernels in the graph
                return traced_decode(input, weight, bias, lora, "auto")
            x = input.reshape(-1, input.shape[-1])  # (M, K)
            y = linear_rows(x, weight, bias, registry.decode_lora(key, lora, x.dtype))  # (M, N)
            return y.view(*input.shape[:-1], y.shape[-1])
        return nn.Linear.forward(module, input)


class _Quantized4bitForward:
    """The ``forward`` set on a bitsandbytes 4-bit layer while an adapter is active on it: a training
    call inside the layer's entry (``enter_module`` opened it as ``_BRANCH``) runs fastaf's op, the
    weight dequantized inside it (``intercept.dequantized``), and marks the entry ``_DONE`` so
    ``leave_module`` adds nothing; any other call runs the class's forward, its LoRA added by
    ``leave_module``. An object, not a closure: a deep copy of the model gets one bound to the
    copied layer."""

    def __init__(self, module: nn.Module, registry: Any, key: str) -> None:
        self.module, self.registry, self.key = module, registry, key

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module, stack = self.module, _open_modes()
        if stack and stack[-1][0] is module and stack[-1][1] is _BRANCH and self.registry.active is not None:
            y = dequantized(self.key, module, args, kwargs, self.registry.active_lora(self.key), None,
                            _config.flags().stateful_impl, True)
            if y is not None:
                stack[-1] = (module, _DONE, self.registry, self.key)
                return y
        return type(module).forward(module, *args, **kwargs)


class _Forward:
    """The model's ``forward``, set on the instance by ``init``: it calls the class's forward (or the
    one an instance had, accelerate's). A compiled call of the model (transformers' static-cache
    decode step compiles ``model.__call__``) guards on it, so a graph dynamo traced for another
    instance of the class, without this model's hooks (dynamo does not guard hooks), never serves
    this model: it ran the base model, silently. Its signature is the forward's: Trainer and
    generate read it to pick inputs. Pickles as ``_Method`` does."""

    def __init__(self, model: nn.Module) -> None:
        # a bound method's two attributes: accelerate rebinds a forward as MethodType(__func__, model)
        self.__self__, self.__func__ = model, _model_forward
        self.__name__ = self.__qualname__ = "forward"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _model_forward(self.__self__, *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:  # read when asked: the model may be unpickling at init
        model = self.__self__
        return inspect.signature(_registry(model).own_forward or type(model).forward.__get__(model))

    def __reduce__(self) -> tuple:
        return _Forward, (self.__self__,)

    def __repr__(self) -> str:
        return f"<fastaf forward of {type(self.__self__).__name__} at {id(self.__self__):#x}>"


def _generate(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The model class's ``generate``. One whose decoding step compiles (a static cache, a
    ``compile_config``) runs as ``fastaf.generate`` with the active adapter does (its factors
    copied, in the weights' dtypes, into the static buffers the step's graph reads), this
    registry's hooks lifted meanwhile (``_Registry.liftable``): traced, they were a dozen guards
    per adapted layer that dynamo checks before every step (16 layers of 7 adapted linears: twice
    ``fastaf.generate``'s guard time). Meanwhile another thread's call of the model applies the
    adapter through the model's forward (``_model_forward``); a submodule that thread calls alone
    runs without it. (Bound by ``init`` on models with a ``generate``.)"""
    registry = _registry(self)
    if not compiles_decode_step(self, kwargs):
        return type(self).generate(self, *args, **kwargs)
    if registry.lifted not in (None, threading.get_ident()):  # its compiled steps would trace the other's
        raise RuntimeError(f"fastaf: another thread's generate with a compiled decoding step runs on this "
                           f"{type(self).__name__}; one at a time per model")
    refuse_checkpointing(self)
    drop_foreign_compiled_call(self)
    explicit = adapting_calls(self)  # fastaf.generate runs: with its own adapter, or none (the active one)
    if explicit is False or not registry.liftable(self):
        return type(self).generate(self, *args, **kwargs)
    if registry.active is None or explicit:
        with registry.hooks_lifted(self):
            return type(self).generate(self, *args, **kwargs)
    active = registry.slot(registry.active).held()  # (packed in the weights' dtypes by adapted_decoding)
    with registry.hooks_lifted(self), adapted_decoding(self, active):
        return type(self).generate(self, *args, **kwargs)


def _model_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    registry = _registry(self)
    # (traced, the call is the lifting generate's decoding step, as ``fastaf.generate`` takes it)
    if not torch.compiler.is_compiling() and registry.lifted not in (None, threading.get_ident()) \
            and registry.active is not None:
        # another thread's generate lifted the hooks: the active adapter applied around the call
        return scoped_call(self, registry.slot(registry.active).held(),
                           lambda: _own_forward(self, registry.own_forward, args, kwargs))
    return _own_forward(self, registry.own_forward, args, kwargs)


def _own_forward(model: nn.Module, own: Any, args: tuple, kwargs: dict) -> Any:
    """The forward ``init`` found: one set on the instance before (accelerate's), else the class's."""
    return own(*args, **kwargs) if own is not None else type(model).forward(model, *args, **kwargs)


_METHODS = {
    "add_new_adapter": _add_new_adapter,
    "set_active_adapter": _set_active_adapter,
    "remove_adapter": _remove_adapter,
    "get_adapter": _get_adapter,
}
# Bound over the class's own: HF's save path (Trainer.save_model, checkpoints, resume) goes through
# them (``_save_pretrained``, ``_load_state_dict``)
_OVERRIDES = {
    "save_pretrained": _save_pretrained,
    "load_state_dict": _load_state_dict,
}


# ---- public functions ---------------------------------------------------------------------------


def init(model: nn.Module) -> nn.Module:
    """Prepare ``model`` for the stateful API (idempotent) and return it.

    Freezes every base parameter, registers the empty adapter registry ``model.fastaf``, binds
    ``add_new_adapter``, ``set_active_adapter``, ``remove_adapter``, ``get_adapter``,
    ``save_pretrained``, ``load_state_dict`` and (where the class has one) ``generate`` on this
    instance and sets ``active_adapter`` (the active adapter's name, None) and ``forward`` there
    (see the module docstring).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or is ``torch.compile``'s wrapper of one.
        ValueError: the model already has an attribute with one of those names.
    """
    check_module(model, "fastaf.init")
    if isinstance(getattr(model, _ATTR, None), _Registry):
        return model  # a compiled wrapper of an inited model too: it reads the model's attributes
    _refuse_wrapper(model, "fastaf.init")
    taken = [n for n in (_ATTR, *_METHODS, "active_adapter") if hasattr(model, n)]
    if taken:
        raise ValueError(f"fastaf.init: {type(model).__name__} already has attribute(s) {taken}")
    for p in model.parameters():
        p.requires_grad_(False)
    model.add_module(_ATTR, _Registry())
    getattr(model, _ATTR).attach(model)
    getattr(model, _ATTR).own_forward = model.__dict__.get("forward")
    model.__dict__["forward"] = _Forward(model)  # no __setattr__: not a submodule
    for name, fn in (*_METHODS.items(), *_OVERRIDES.items()):
        setattr(model, name, _Method(fn, model))
    if callable(getattr(type(model), "generate", None)) and "generate" not in model.__dict__:
        model.generate = _GenerateMethod(_generate, model)
    model.active_adapter = None  # the active adapter's name, as PEFT's property gives it
    if getattr(model, "is_quantized", False):
        # transformers' Trainer refuses to train a quantized base ("purely quantized models") unless
        # this says adapters are attached, as its own PEFT integration sets it; the only other
        # readers are its gradient checkpointing (input grads on, as for PEFT) and its
        # save_pretrained, which an inited model replaces
        model._hf_peft_config_loaded = True
    return model


def _refuse_wrapper(model: nn.Module, caller: str) -> None:
    """Refuse ``torch.compile``'s wrapper (``OptimizedModule``): it forwards attribute reads to the
    model it wraps but not ``add_module``, so the registry would land on the wrapper and the
    methods on the model, each unusable without the other. And DDP's (or DataParallel's): its
    reducer holds the parameters it had when it was built, so an adapter added under it is never
    averaged across ranks, silently."""
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        raise TypeError(
            f"{caller}: got {type(model).__name__} wrapping a {type(model.module).__name__}: it averages only the "
            "gradients of the parameters it held when it was built, so this adapter's would differ per rank. Call "
            "fastaf.init(model) and add the adapters before wrapping the model (or before accelerator.prepare)"
        )
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing was compiled
    if eval_frame is not None and isinstance(model, eval_frame.OptimizedModule):
        raise TypeError(
            f"{caller}: got torch.compile's wrapper (OptimizedModule) of a {type(model._orig_mod).__name__}, "
            "not the model: call fastaf.init(model) before torch.compile(model), or pass the model it wraps, "
            "compiled._orig_mod (the compiled model follows its adapters and set_active_adapter)"
        )


def save_adapter_to_local_dir(model: nn.Module, *, path: str | Path, name: str) -> Path:
    """Write adapter ``name`` into the directory ``path`` in PEFT's layout; returns ``path``.

    The files (``adapter_model.safetensors``, ``adapter_config.json``) go directly into ``path``,
    with ``name`` in the weights' metadata, so ``load_adapter(model, path_or_repo_id=path)``
    registers it as ``name`` again.

    Under ``torch.distributed`` call it on every rank: rank 0 writes, and factors that FSDP2
    sharded are gathered first (a collective; called on rank 0 alone it would wait forever).
    """
    from .io import save_adapter

    check_module(model, "fastaf.save_adapter_to_local_dir")
    slot = _registry(model).slot(name)
    save_adapter(slot.adapter(detach=True), path, config=slot.config, name=name, model=model)
    return Path(path)


def _default_name(path_or_repo_id: str | Path) -> str:
    """The last component of the path or repo id ('.' -> '_'), or "default" when there is none."""
    return Path(str(path_or_repo_id).rstrip("/\\")).name.replace(".", "_") or "default"


def load_adapter(
    model: nn.Module,
    path_or_repo_id: str | Path,
    *,
    name: str | None = None,
    revision: str | None = None,
    token: str | bool | None = None,
) -> str:
    """Read an adapter (local dir or hub repo id, PEFT layout) and register it, inactive.

    The file is read and checked against the model first; only then is ``fastaf.init(model)``
    called if needed, so a load that raises leaves the model exactly as it was. The factors go to
    their modules' devices in the file's dtype (``fastaf.read_adapter(..., model=model)``).

    Args:
        path_or_repo_id: a local directory or a hub repo id, as ``fastaf.read_adapter`` takes.
        name: the adapter's name; default: the name ``save_adapter_to_local_dir`` recorded in the
            files, else the last component of ``path_or_repo_id`` with '.' replaced by '_'
            (``"./ckpt/sql"`` -> ``"sql"``, ``"user/sql-lora"`` -> ``"sql-lora"``), or
            ``"default"`` when that is empty (``"."``).
        revision: hub branch, tag or commit (hub ids only).
        token: hub token (hub ids only).
    Returns:
        The name it was registered under; activate it with ``model.set_active_adapter(name)``.
    """
    from .io import read_adapter_and_name

    check_module(model, "fastaf.load_adapter")
    _refuse_wrapper(model, "load_adapter")
    registry = getattr(model, _ATTR, None)
    existing = registry.adapters if isinstance(registry, _Registry) else {}
    if name is not None:
        _check_new_name(name, existing)  # fail before reading (or downloading) anything
    # checked against the base model alone: the registry's own modules are not targets
    scope = lambda: _without_registry(model) if isinstance(registry, _Registry) else contextlib.nullcontext(model)  # noqa: E731
    with scope() as base:
        adapter, stored = read_adapter_and_name(path_or_repo_id, model=base, revision=revision, token=token)
    if name is None:
        name = stored or _default_name(path_or_repo_id)
        try:
            _check_new_name(name, existing)
        except ValueError as err:
            where = "recorded in its files" if stored else "taken from its path"
            raise ValueError(f"load_adapter: {path_or_repo_id}: the adapter name {where} cannot be used: {err}; "
                             "pass name= to load it under another") from err
    with scope() as base:
        _check_registrable(base, name, adapter, existing)  # before init changes the model
    init(model)
    _add_checked(model, name, adapter, None)
    return name


def push_adapter_to_hub(
    model: nn.Module,
    *,
    name: str,
    repo_id: str,
    token: str | bool | None = None,
    private: bool | None = None,
    commit_message: str | None = None,
) -> Any:
    """Upload adapter ``name`` to the hub repo ``repo_id`` in PEFT's layout.

    Saves into a temporary directory with ``save_adapter_to_local_dir`` and uploads that folder in
    one commit (``fastaf._hub.upload_folder_to_hub``; ``token`` and ``private`` as there).

    Returns:
        The URL of the commit (None on ranks other than 0 of a distributed run).
    """
    from . import distributed
    from .io import upload_folder_to_hub

    check_module(model, "fastaf.push_adapter_to_hub")
    _registry(model).slot(name)  # unknown names fail before anything is written
    if not distributed.is_writer():
        return None  # rank 0 uploads; the other ranks of a distributed run do nothing
    with tempfile.TemporaryDirectory(prefix="fastaf-push-") as tmp:
        save_adapter_to_local_dir(model, path=tmp, name=name)
        return upload_folder_to_hub(
            tmp,
            repo_id,
            token=token,
            private=private,
            commit_message=commit_message or f"Upload fastaf adapter {name!r}",
        )
