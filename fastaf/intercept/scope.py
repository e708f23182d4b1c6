"""One call's scope: an adapter applied to every use of a model's targeted weights, and undone.

``scoped_call(model, adapter, run)`` builds the call's routes (``routes``) and mode (``mode``),
then runs ``run()``. Eagerly, where nothing needs the mode, the targeted weights carry the adapter
instead (``carrier``: the same rules, seen only by calls that receive an adapted weight; on the
H100 a Liger-patched 1B step took 121 ms this way against 143 ms under the mode). With the mode,
eagerly, per-call pre-hooks on the targeted modules (``_WeightWatch``) count their calls and
follow a weight swapped in when its module runs (FSDP2's unsharded weight); they are removed when
the call returns or raises, so the model is left as it was. Quantized layers get an instance
``forward`` for the call instead (``Forwards``), which runs them with their LoRA. Under
``torch.compile`` the mode runs with ``Forwards`` alone (tracers follow a mode and instance
forwards set in the graph, not hooks registered there), which count every targeted module's runs
too. A targeted module that runs without its weight meeting a rule is an error after the call,
never a silently unadapted output.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from .. import _config
from .._adapter import Adapter
from .._layouts import LinearSpec, compiled_class
from ..ops import interpreter_stack
from . import carrier, use
from .mode import LoRAMode, adapter_mode
from .routes import Route, is_dtensor, walked_modules


def combine(adapter: Adapter | Sequence[Adapter] | None) -> Adapter | None:
    """One Adapter for what the entry points take: an Adapter, a list of them (their deltas add:
    rank concatenation) or None."""
    if adapter is None or isinstance(adapter, Adapter):
        return adapter
    if isinstance(adapter, Sequence) and not isinstance(adapter, (str, bytes)):
        for i, a in enumerate(adapter):
            if not isinstance(a, Adapter):
                raise TypeError(
                    f"fastaf: adapter[{i}] is {type(a).__name__}, not a fastaf.Adapter (adapter is a "
                    f"{type(adapter).__name__} of {len(adapter)}, whose Adapters' deltas add: leave out items "
                    "that are not Adapters, such as None)"
                )
        if not adapter:
            return None
        total = adapter[0]
        for a in adapter[1:]:
            total = total + a  # exact: rank concatenation, one fused op per layer
        return total
    raise TypeError(
        f"adapter must be a fastaf.Adapter, a list of Adapters or None, got {type(adapter).__name__}"
    )


_local = threading.local()  # per thread: the eager functional_call scopes, innermost last


def _scopes() -> list[_WeightWatch]:
    if not hasattr(_local, "scopes"):
        _local.scopes = []
    return _local.scopes


class Forwards:
    """For one call, an instance ``forward`` on modules the call must see run, set where
    ``nn.Module.__call__`` finds it (``module.__dict__``) and put back on exit.

    A quantized layer (``mode.branches``) runs ``use.quantized_call``: its own forward plus the
    LoRA, or fastaf's op that dequantizes its weight. With ``counted`` (a call traced by
    ``torch.compile``, where no hook can be registered), every other targeted module counts its
    runs too, so a module whose weight met no rule (a forward reading ``weight.data``) is the
    same error at trace time as eagerly. Dynamo traces an instance ``forward`` set inside the
    graph (hooks registered there break it). ``active``: whether a call of the forward belongs to
    this call (eagerly, the innermost call of the running thread); others run the module as it
    was.
    """

    def __init__(self, mode: LoRAMode, *, counted: bool, active: Any = None) -> None:
        self.mode, self.active = mode, active
        by_module: dict[int, list[Route]] = {}
        for route in (*mode.routes.values(), *mode.params.values()) if counted else ():
            by_module.setdefault(id(route.module), []).append(route)
        self.counted = [routes for routes in by_module.values()
                        if not any(r.module is b.module for b in mode.branches for r in routes)]
        self.installed: list[tuple[nn.Module, Any]] = []

    def __enter__(self) -> Forwards:
        for route in self.mode.branches:
            self._install(route.module, functools.partial(self._quantized, route))
        for routes in self.counted:
            self._install(routes[0].module, functools.partial(self._counting, routes))
        return self

    def __exit__(self, *exc: Any) -> None:
        for module, before in reversed(self.installed):
            if before is _NONE:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = before
        self.installed.clear()

    def _install(self, module: nn.Module, make: Any) -> None:
        before = module.__dict__.get("forward", _NONE)
        module.__dict__["forward"] = make(module.forward, before is _NONE)  # no __setattr__: not a submodule
        self.installed.append((module, before))

    def _quantized(self, route: Route, forward: Any, own: bool) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            if self.active is not None and not self.active():
                return forward(*args, **kwargs)
            if self.mode.counts():  # not in a user-compiled forward during an eager generate
                route.calls += 1
                route.hits += 1
            if not torch.compiler.is_compiling():
                return use.quantized_call(route.path, route.module, forward, args, kwargs, route.lora, self.mode.ids,
                                          self.mode.impl, own)
            # traced, with torch functions off: dynamo recursed without end on bitsandbytes' weight
            # class (its __torch_function__ defers to the mode's, which calls it again); nothing
            # in the layer is the mode's to adapt
            with torch._C.DisableTorchFunction():
                return use.quantized_call(route.path, route.module, forward, args, kwargs, route.lora, self.mode.ids,
                                          self.mode.impl, own)
        return run

    @staticmethod
    def _counting(routes: list[Route], forward: Any, own: bool) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            for route in routes:
                route.calls += 1
            return forward(*args, **kwargs)
        return run


_NONE = object()  # no instance forward before the call
# Whether dynamo traces the removal of an instance forward set in the graph (``Forwards`` under
# torch.compile): torch 2.11's does not (neither del nor dict.pop on a module's __dict__; delattr
# reaches the real module, where the set is still pending), torch 2.13's does.
TRACED_FORWARDS = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)


class _WeightWatch:
    """Per-call pre-hooks on each targeted module, for an eager ``functional_call``'s mode.

    When a targeted module starts, its hook counts the call and, if the module now holds another
    weight object than at the call's start (FSDP2 registers its unsharded weight in its own
    pre-forward hook, which runs first), keys the mode's route by that weight too. The mode itself
    spans the whole call, so a weight used outside its module (``nn.MultiheadAttention`` reads
    ``out_proj.weight`` from the parent's forward) is still adapted, and leaving it with ``with``
    is safe on any exception, interrupts included. A hook acts only for the innermost call of the
    thread running the module, so concurrent and nested calls on one model stay apart. The hooks
    are removed on exit.
    """

    def __init__(self, mode: LoRAMode, *, hooks: bool = True) -> None:
        self.mode = mode
        # without hooks only the scope is kept: a carried call's weights count their own uses
        self.hooks = hooks
        self.handles: list[Any] = []
        self.forwards = Forwards(mode, counted=False, active=self._mine)

    def __enter__(self) -> _WeightWatch:
        try:
            for route in self.mode.all_routes() if self.hooks else ():
                if not route.branch:
                    self.handles.append(route.module.register_forward_pre_hook(functools.partial(self._starts, route)))
            # carried or not: nothing else adapts a quantized layer
            self.forwards.__enter__()
        except BaseException:
            self._remove()
            raise
        _scopes().append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _scopes().remove(self)
        self._remove()

    def _remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.forwards.__exit__()

    def _mine(self) -> bool:
        """Whether this thread's innermost call is this one (a quantized layer's forward acts then)."""
        scopes = _scopes()
        return bool(scopes) and scopes[-1] is self

    def _starts(self, route: Route, module: nn.Module, args: Any) -> None:
        scopes = _scopes()
        if not scopes or scopes[-1] is not self:
            return  # another thread's call, or an outer call of this thread
        if not torch.compiler.is_compiling():  # traced, a count is a guard on its value (``LoRAMode._count``)
            route.calls += 1
        weight = getattr(module, route.name)
        if weight is not route.weight:
            self.mode.key(route, weight)
        if isinstance(route.spec, LinearSpec):
            self.mode.current = route



def explicit_mode_active() -> bool:
    """True inside ``functional_call`` (or an ``adapter_mode``): its adapter stands in for others.
    An eager call is one of this thread's scopes, with its mode entered or its weights carrying it."""
    return bool(_scopes()) or any(isinstance(m, LoRAMode) and m.explicit for m in _mode_stack())


def _mode_stack() -> list:
    return torch.overrides._get_current_function_mode_stack()


def checkpoint_context() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """``context_fn`` for ``torch.utils.checkpoint`` that replays the adapter during recompute.

    Activation checkpointing re-runs a layer's forward during backward, after ``functional_call``
    has removed its hooks; without the adapter the recompute differs from the forward
    (non-reentrant checkpointing raises a CheckpointError). Pass this function as ``context_fn``::

        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": checkpoint_context})

    It is called at forward time, captures the call's mode, and re-enters it for the recompute.
    (The stateful layer's hooks stay on the model and apply during recomputes by themselves.)
    """
    modes = [m for m in _mode_stack() if isinstance(m, LoRAMode) and m.explicit]
    if not modes and _scopes():  # an eager call whose weights carry the adapter: its mode recomputes
        modes = [_scopes()[-1].mode]
    return contextlib.nullcontext(), (modes[-1] if modes else contextlib.nullcontext())


def scoped_call(
    model: nn.Module,
    adapter: Adapter | Sequence[Adapter] | None,
    run: Any,
    *,
    params: Mapping[str, Tensor] | None = None,
    adapter_ids: Tensor | None = None,
    impl: str = "auto",
    batch: int | tuple[int, str] | None = None,
    carry: bool = True,
    warn_unused: bool = True,
) -> Any:
    """``run()`` with ``adapter`` applied to ``model``'s targeted layers: ``functional_call``'s
    machinery, for callers that run the model another way (``fastaf.generate``).

    ``adapter_ids``: as ``functional_call``'s, or a tuple of such tensors for a run whose layers
    see the batch at several sizes, the ids as given first (``fastaf.generate``: they and the ids
    repeated per beam); each layer takes the one that fits its rows (``lora_multi.check_rows``).
    ``batch``: the number of examples the ids as given must match (or that and the input it was
    read from). ``carry``: False when ``run`` compiles the model inside (transformers' static-cache
    decode step): carried weights, tensor subclasses, must not reach the tracer, which follows the
    mode instead. ``warn_unused``: warn for targeted modules that did not run (False where each
    call runs a part of the model: ``generate``'s encoder, then its decoder).
    """
    adapter = combine(adapter)
    if adapter is None or len(adapter) == 0:
        if adapter_ids is not None:
            raise ValueError("fastaf: adapter_ids was given without an adapter (a stacked one, from fastaf.stack)")
        return run()
    compiling = torch.compiler.is_compiling()
    if compiling:
        # transformers' layers carry ``gradient_checkpointing``, set on the instance where it is on
        # (its model-level property warns). Read from each module's __dict__: a getattr of a name a
        # module lacks is a guard that calls nn.Module.__getattr__ (which raises) at every call of
        # the graph, on every module of the model
        if any(m.__dict__.get("gradient_checkpointing") is True and m.training for m in walked_modules(model).values()):
            # dynamo traces a checkpointed layer as a subgraph of its own, where the mode is not
            # dispatched: the layers would run without the adapter, silently
            raise NotImplementedError(
                f"fastaf: torch.compile over functional_call of a {type(model).__name__} with gradient "
                "checkpointing on: dynamo traces each checkpointed layer apart from functional_call's mode, so "
                "those layers would run without the adapter. Call model.gradient_checkpointing_disable(), run "
                "functional_call eagerly (fastaf.functional.checkpoint_context), or use the stateful layer "
                "(fastaf.init), whose compiled, checkpointed model keeps the adapter"
            )
    if adapter_ids is not None:
        _check_ids(adapter_ids, adapter, batch, values=not compiling)
    mode = adapter_mode(model, adapter, params=params, impl=impl, adapter_ids=adapter_ids)
    routes = mode.all_routes()  # before _WeightWatch keys a route by a second weight
    if not compiling and interpreter_stack() and any(is_dtensor(r.weight) for r in routes):
        raise NotImplementedError(
            f"fastaf.functional_call: {type(model).__name__} holds FSDP2 (fully_shard) modules, whose hooks "
            "do not run under torch.func transforms on CUDA (an all-gather copying into captured tensors, "
            "an old-style autograd.Function; torch 2.11): differentiate with one eager torch.func.grad "
            "level alone (the model then runs below it) or with autograd, torch.autograd.grad(loss, adapter leaves)"
        )
    if compiling and not TRACED_FORWARDS:
        if mode.branches:
            first = mode.branches[0]
            raise NotImplementedError(
                f"fastaf: {first.path} ({type(first.module).__name__}) is a quantized linear layer, which "
                f"torch.compile over functional_call takes from torch 2.13 on (torch {torch.__version__}'s dynamo "
                "cannot remove the layer's forward for the call inside the graph). Run the call eagerly, or use the "
                "stateful layer (fastaf.init), whose hooks a compiled model keeps"
            )
        with mode:  # modules' runs uncounted: a lost LoRA is seen eagerly and by the stateful layer
            return run()
    if compiling:
        # tracers see the mode and instance forwards (no hooks can be registered inside a graph):
        # the forwards run quantized layers and count the other modules' runs, so a module that
        # lost its LoRA is the same error at trace time as eagerly
        with mode, Forwards(mode, counted=True):
            out = run()
        lost = lost_message(routes, "fastaf.functional_call")
        if lost is not None:
            if _fullgraph():
                raise ValueError(lost)  # dynamo's error for it quotes this one whole
            _raise_traced(lost)
        return out
    try:
        if carry and _config.flags().carry and carrier.eligible(model, mode, params):
            # only calls that receive an adapted weight reach Python, not every torch call of the model
            with carrier.carried(mode), _WeightWatch(mode, hooks=False):
                out = run()
        else:
            _warn_recompile_limit(model, routes)
            with mode, _WeightWatch(mode):
                out = run()
    finally:
        if mode.groups is not None:  # outputs held for members that never ran: not kept past the call
            mode.groups.close()
    _check_applied(model, routes, warn_unused)
    return out


_warned_limits: set[tuple[str, int, int]] = set()


def _warn_recompile_limit(model: nn.Module, routes: list[Route]) -> None:
    """Warn once when more compiled blocks of one class hold targeted modules than dynamo's
    ``recompile_limit`` (FSDP2 recipes compile each decoder layer and call the model eagerly).

    Under the call's mode each such block compiles a graph of its own, since each reads its own
    layer's factors, where the frozen model's blocks share one; dynamo runs the blocks past the
    limit eagerly, and the step with them. On the H100 (1B shape, 16 layers, torch 2.11):
    143.3 ms a step at the default limit of 8, 127.5 ms
    with 16.
    """
    targeted = {id(r.module) for r in routes}
    blocks: dict[type, int] = {}
    for m in model.modules():
        cls = compiled_class(m)
        if cls is not None and any(id(s) in targeted for s in m.modules()):
            blocks[cls] = blocks.get(cls, 0) + 1
    limit = torch._dynamo.config.recompile_limit
    for cls, n in blocks.items():
        if n > limit and (cls.__qualname__, n, limit) not in _warned_limits:
            _warned_limits.add((cls.__qualname__, n, limit))
            warnings.warn(
                f"fastaf.functional_call: {n} compiled {cls.__name__} blocks hold adapted modules; under the "
                f"call each compiles a graph of its own (it reads its own layer's LoRA factors), and dynamo's "
                f"recompile_limit ({limit}) runs every block past the first {limit} eagerly. Set "
                f"torch._dynamo.config.recompile_limit = {n} (or more) before the first call",
                stacklevel=4,
            )


def _check_ids(ids: Any, adapter: Adapter, batch: int | tuple[int, str] | None, *, values: bool = True) -> None:
    """adapter_ids: a 1-D integer tensor, one id per example, each in [-1, n) (one host sync); or
    ``scoped_call``'s tuple of them, each checked, the first (the ids as given) against ``batch``.

    ``values`` False (traced): only what the trace knows (type, shape, dtype, device, the batch);
    the range needs the values. Nor are they read while make_fx traces (``torch.func.linearize``,
    whose eager call before its trace checked them; ``torch.export``), which refuses a read of a
    traced tensor: the range is then an assert in the graph, as under ``torch.compile``."""
    if isinstance(ids, tuple) and ids and all(isinstance(t, Tensor) for t in ids):
        for i, one in enumerate(ids):
            _check_ids(one, adapter, batch if i == 0 else None, values=values)
        return
    if not isinstance(ids, Tensor):
        raise TypeError(f"fastaf: adapter_ids must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"fastaf: adapter_ids must be a 1-D int32/int64 tensor, got {tuple(ids.shape)} {ids.dtype}")
    devices = {l.A.device for l in adapter.values()}
    if ids.device not in devices:
        raise ValueError(f"fastaf: adapter_ids is on {ids.device} but the adapter is on {sorted(map(str, devices))}")
    n = {l.A.shape[0] for l in adapter.values() if l.stacked}
    if len(n) > 1:
        raise ValueError(f"fastaf: the stacked adapter's paths disagree on the stack size: {sorted(n)}")
    size, source = batch if isinstance(batch, tuple) else (batch, None)
    if size is not None and ids.shape[0] != size:
        raise ValueError(f"fastaf: adapter_ids has {ids.shape[0]} entries for a batch of {size} examples"
                         + (f" (the leading size of {source})" if source else ""))
    if n and ids.numel() and not (values and get_proxy_mode() is None):
        # traced: checked where the ids are, without a host sync (on CUDA a device-side assert,
        # which ends the process as torch's own out-of-range indexing does)
        torch._assert_async(((ids >= -1) & (ids < next(iter(n)))).all(),
                            f"fastaf: adapter_ids must lie in [-1, {next(iter(n))}) for a stack of {next(iter(n))} adapters")
    elif n and ids.numel() and not (ids.is_cuda and torch.cuda.is_current_stream_capturing()):
        # the range check syncs with the device: skipped inside a CUDA-graph capture
        lo, hi = int(ids.min()), int(ids.max())
        if lo < -1 or hi >= next(iter(n)):
            raise ValueError(f"fastaf: adapter_ids must lie in [-1, {next(iter(n))}) for a stack of "
                             f"{next(iter(n))} adapters, got values from {lo} to {hi}")


_GRADLESS = (" only with grad disabled inside a call that runs with grad (a custom autograd.Function's forward, a "
             "no_grad block): the output is adapted but no gradient reaches its LoRA's factors, which would be "
             "silently lost. Differentiate through the weight's use, or call under torch.no_grad() throughout")
_UNADAPTED = (", but used its weight in a way fastaf does not adapt (it adapts F.linear, torch.addmm and x @ "
              "weight.T, and any other use of its values through W + scale·B@A; a targeted parameter, any torch "
              "call on it), or only detached (W.detach(), W.data), or not at all; its LoRA would be silently lost. "
              "Merge it instead: fastaf.functional_call(model, None, args, params=fastaf.merge_into(model, adapter))")


def lost_message(routes: list[Route], caller: str) -> str | None:
    """What ``check_lost`` raises for ``routes``, or None."""
    for count, what, why in (("gradless", "used its weight {} time(s)", _GRADLESS),
                             ("calls", "ran {} time(s)", _UNADAPTED)):
        lost = [r for r in routes if r.hits == 0 and getattr(r, count) > 0]
        if lost:
            return f"{caller}: " + "; ".join(
                f"{r.path} ({type(r.module).__name__}) {what.format(getattr(r, count))}" for r in lost[:5]) + why
    return None


def check_lost(routes: list[Route], caller: str) -> None:
    """Raise for modules that ran with their LoRA unapplied (their weight used only in ways not
    adapted: a forward reading ``weight.data``), or applied only where no gradient reaches it.
    Every entry point checks this after the modules ran: ``caller`` names it (``functional_call``,
    ``generate``, the stateful layer's forward)."""
    message = lost_message(routes, caller)
    if message is not None:
        raise ValueError(message)


def _raise_lost(message: str) -> None:
    raise ValueError(message)


# Raised from the trace without fullgraph, the error would be dynamo's to handle: an "observed
# exception" that falls back to running the frames eagerly, beneath a compiled region that then
# traces the model's frames again without the counts (the LoRA silently lost). Called as a
# function dynamo does not trace, it is raised when the graph runs: the same ValueError as eagerly.
@torch.compiler.assume_constant_result
def _fullgraph() -> bool:
    """Traced: whether dynamo compiles the call with ``fullgraph=True`` (run once while tracing, a
    constant to the graph). There an exception raised in the trace is dynamo's error, which quotes
    it whole; the call of ``_raise_traced`` would be refused with its fixed reason only."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        return bool(getattr(InstructionTranslator.current_tx(), "one_graph", False))
    except Exception:  # another dynamo's internals: the general path
        return False


_raise_traced = torch.compiler.disable(
    _raise_lost, reason="fastaf.functional_call: a targeted module ran without its LoRA (its forward uses the weight "
                        "in a way fastaf does not adapt, such as weight.data); run eagerly, the call raises a "
                        "ValueError naming the module, its class and the fix")


def _check_applied(model: nn.Module, routes: list[Route], warn_unused: bool) -> None:
    """``check_lost``, and a warning for modules that never ran (not where a compiled forward ran
    them: its graph counts no uses)."""
    check_lost(routes, "fastaf.functional_call")
    missed = [r.path for r in routes if r.hits == 0] if warn_unused else []
    if missed and not any(compiled_class(m) is not None for m in model.modules()):
        warnings.warn(
            f"fastaf.functional_call: {len(missed)} adapted module(s) did not run during the call, "
            f"so their LoRA was not needed: {missed[:5]}",
            stacklevel=3,
        )
