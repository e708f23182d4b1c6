"""Where an op call runs, and the ``autograd.Function`` plumbing every fastaf op shares.

- Tracers and functorch's levels: whether the op implementations may be called directly
  (``_direct_ok``), at which grad level a single-level Function serves (``_direct_level``), how
  many levels a traced function runs under (``_traced_levels``).
- Plain autograd beneath the levels (MAML's outer step over ``torch.func.grad``):
  ``tracked_beneath``, ``tracked_call`` / ``tracked_scope``, and ``_differentiated``, which
  tells a backward to be differentiable.
- Running below a grad level (``_below``, ``_apply_single_level``) and handing a Function to
  dynamo as one opaque, cacheable call (``_traced_apply``).

Nothing here knows the LoRA math: ``lora_linear``, ``lora_siblings``, ``lora_multi`` and ``lora_group``
build their ops on it. This is the one file that touches ``torch._C._functorch``.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import threading
import warnings
import weakref
from pathlib import Path
from typing import Any, Optional

import torch
import torch.autograd.forward_ad as _forward_ad
from torch import Tensor
from torch.utils import _pytree as pytree

from torch._functorch import pyfunctorch

PLAIN_TYPES = (Tensor, torch.nn.Parameter)
_functorch = torch._C._functorch
GRAD, _JVP, _VMAP = _functorch.TransformType.Grad, _functorch.TransformType.Jvp, _functorch.TransformType.Vmap

# functorch's level plumbing under fastaf's names: the rest of the package reaches functorch
# through these alone (dynamo treats an alias as the function itself)
is_wrapped = _functorch.is_functorch_wrapped_tensor
interpreter_stack = _functorch.get_interpreter_stack
peek_interpreter = _functorch.peek_interpreter_stack
wrap_for_grad = _functorch._wrap_for_grad
unwrap_for_grad = _functorch._unwrap_for_grad
pop_layer = _functorch.pop_dynamic_layer_stack
push_layer = _functorch.push_dynamic_layer_stack
maybe_level = _functorch.maybe_get_level
get_unwrapped = _functorch.get_unwrapped
single_level_allowed = _functorch.get_single_level_autograd_function_allowed
allow_single_level = _functorch.set_single_level_autograd_function_allowed


def current_level() -> int:
    """The innermost functorch transform's level (dynamo traces this call)."""
    return pyfunctorch.retrieve_current_functorch_interpreter().level()


def grad_mode_beneath(interpreter: Any) -> bool:
    """The grad mode a grad ``interpreter`` (from ``interpreter_stack()``) was entered under."""
    return _functorch.CGradInterpreterPtr(interpreter).prevGradMode()


def _traced() -> bool:
    """A tracer (torch.compile) or a dispatch mode is watching: they must see the registered op."""
    return torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0


def _direct_ok(*tensors: Optional[Tensor]) -> bool:
    """True when the op implementations may be called directly instead of through the dispatcher.

    Only tracers (``torch.compile``), dispatch modes and functorch-*wrapped* tensors (vmap's
    batched tensors, which need the ops' vmap rules) need the registered op. The dispatcher's
    Python custom-op path costs ~150 us of host time per call on the H200 machine, ~17 ms per
    step for the 112 adapted layers of a 1B model.
    """
    if _traced():
        return False
    for t in tensors:  # a loop, not all(genexpr): this runs per op call on the host's hot path
        if t is not None and (type(t) not in PLAIN_TYPES or is_wrapped(t)):
            return False
    return True


def _direct_level(*tensors: Optional[Tensor], factors: tuple = (), weight: Optional[Tensor] = None,
                  x: Optional[Tensor] = None) -> int:
    """Where ``_LoRALinearDirect`` can serve: 0 in plain eager autograd, the grad level when the
    innermost transform is the only ``torch.func.grad`` (vmap levels below it are fine), else -1.

    Above one grad level (grad of grad, jvp), or where plain autograd records beneath the level
    (``tracked_beneath`` of the layer's ``factors``, ``weight`` and input ``x``), the op needs
    functorch's generic handling of ``LoRALinearFn``, which differentiates through the backward;
    it costs ~0.5-1 ms of host time per call (a new Function class per call), so first-order
    grad, the common case, skips it.
    """
    if _traced():
        return -1  # tracers see LoRALinearFn and the registered ops
    if _forward_ad._current_level >= 0:
        return -1  # eager forward AD (dual tensors) needs the Function's jvp rule
    stack = _functorch.get_interpreter_stack()
    if not stack:
        return 0 if _direct_ok(*tensors) else -1
    if stack[-1].key() != GRAD or sum(i.key() in (GRAD, _JVP) for i in stack) != 1:
        return -1
    return -1 if tracked_beneath(factors, weight, (x,)) else stack[-1].level()


@torch.compiler.assume_constant_result
def _traced_levels() -> tuple[int, int]:
    """(vmap levels active, derivative levels: grad or jvp). Dynamo runs it once while tracing and
    keeps the result as a constant: torch 2.11 refuses to trace the interpreter stack queries
    (skipped functions), and the transforms of a traced function are fixed by its code (dynamo
    traces no function called under levels opened outside it)."""
    stack = _functorch.get_interpreter_stack() or ()
    return sum(i.key() == _VMAP for i in stack), sum(i.key() in (GRAD, _JVP) for i in stack)


def transform_levels() -> tuple[int, int]:
    """(vmap levels, derivative levels) around the caller: eagerly the interpreter stack's, under
    ``torch.compile`` the traced function's (``_traced_levels``)."""
    if torch.compiler.is_compiling():
        return _traced_levels()
    stack = _functorch.get_interpreter_stack() or ()
    return sum(i.key() == _VMAP for i in stack), sum(i.key() in (GRAD, _JVP) for i in stack)


def _higher_order_traced() -> bool:
    """Two or more derivative levels (grad of grad, jvp of grad) inside ``torch.compile``.

    There the op runs as its torch reference: the Functions' backwards are not differentiable
    under compile (``_differentiated`` cannot see the outer level there; compiled grad of grad
    gave zero second derivatives on the Function), and the reference is plain torch that every
    transform and Inductor handle. ``vmap(grad)`` keeps the Function and its vmap rule (opaque to
    dynamo since ``_traced_apply``; before it, pytorch#129845 made dynamo's template of a traced
    Function unvmappable, and this held for every two transforms).
    """
    return torch.compiler.is_compiling() and _traced_levels()[1] >= 2


def _vmapped_traced() -> bool:
    """A vmap level inside ``torch.compile``: siblings' shared-h Functions have no vmap rule."""
    return torch.compiler.is_compiling() and _traced_levels()[0] > 0


def bottom(t: Tensor) -> Tensor:
    """``t`` with every functorch wrapper (grad levels, vmap levels) taken off."""
    while is_wrapped(t):
        t = _functorch.get_unwrapped(t)
    return t


def _requires_grad_beneath(t: Optional[Tensor]) -> bool:
    return t is not None and bottom(t).requires_grad


def _op_tracked(factors: tuple, weight: Optional[Tensor], activations: tuple) -> bool:
    """One layer's own sign that plain autograd records beneath the transforms: one of its LoRA
    ``factors`` requires grad there, or, unless its ``weight`` requires grad, one of its
    ``activations`` does (through another layer's factors or a tracked input). An unfrozen
    weight makes every activation require grad, in every step: no sign then. (No weight: the
    activations count.)"""
    if any(_requires_grad_beneath(f) for f in factors):
        return True
    return not _requires_grad_beneath(weight) and any(map(_requires_grad_beneath, activations))


# Compiles (torch._guards.TracingContext) in which a layer's forward saw a LoRA factor that
# requires grad beneath the transforms (``note_factors``).
_TRACKED_TRACES: weakref.WeakSet = weakref.WeakSet()


def note_factors(*factors: Optional[Tensor]) -> None:
    """Under ``torch.compile``, record that one of a layer's LoRA ``factors`` requires grad
    beneath the transforms (a meta-parameter), for the whole compile: every backward is traced
    after every forward, so each layer's backward then knows (``_differentiated``). A layer's own
    operands tell nothing when the base is unfrozen (every activation requires grad then), and the
    call's inputs are not seen inside the trace (dynamo cannot unwrap functorch's tensors)."""
    if torch.compiler.is_compiling() and any(map(_requires_grad_beneath, factors)):
        trace = torch._guards.TracingContext.try_get()
        if trace is not None:
            _TRACKED_TRACES.add(trace)


class _Noted(torch.autograd.Function):
    """The identity on a layer's LoRA factors, for a layer no fastaf Function computes (a weight
    folded to W + ΔW, an expert LoRA): opaque under ``torch.compile``, its ``setup_context`` marks
    the compile as the Functions' do (``note_factors``), so a meta-parameter only such a layer
    holds still makes every backward exact."""

    generate_vmap_rule = True

    @staticmethod
    def forward(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
        return a.view_as(a), b.view_as(b)

    @staticmethod
    def setup_context(ctx, inputs, output):
        note_factors(*inputs)

    @staticmethod
    def backward(ctx, da, db):
        return da, db


def noted(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """(a, b), through ``_Noted`` while compiling (``note_factors``); as they are eagerly."""
    return _Noted_apply(a, b) if torch.compiler.is_compiling() else (a, b)


def _trace_tracked() -> bool:
    """``note_factors`` saw a tracked factor in the compile being traced."""
    trace = torch._guards.TracingContext.try_get()
    return trace is not None and trace in _TRACKED_TRACES


def entered_in_grad_mode() -> Optional[bool]:
    """Whether the outermost grad level was entered in grad mode (None: no grad level)."""
    outer = next((i for i in _functorch.get_interpreter_stack() or () if i.key() == GRAD), None)
    return None if outer is None else _functorch.CGradInterpreterPtr(outer).prevGradMode()


class _CallState(threading.local):
    tracked = False  # functional_call's inputs are tracked beneath (``tracked_call``)


_CALL = _CallState()


_NO_SCOPE = contextlib.nullcontext()  # stateless: one instance serves every call and thread


@contextlib.contextmanager
def tracked_call():
    """Every op in the block takes the exact path beneath the transforms (``tracked_beneath``):
    ``functional_call`` enters it when one of its inputs is tracked, so a layer whose own factors
    and weights give no sign (an unfrozen base) still leaves its graph beneath."""
    previous, _CALL.tracked = _CALL.tracked, True
    try:
        yield
    finally:
        _CALL.tracked = previous


def tracked_beneath(factors: tuple = (), weight: Optional[Tensor] = None, activations: tuple = (),
                    *, inputs: tuple = ()) -> bool:
    """Plain autograd records beneath the torch.func transforms, eagerly: the outermost grad level
    was entered in grad mode, and a call's ``inputs`` or a layer (``_op_tracked``) shows it. That
    is ``torch.autograd`` over ``torch.func.grad``'s result (MAML's outer step): the ops under the
    level must then leave their graph beneath it, and their backward must be differentiable."""
    if not entered_in_grad_mode():
        return False
    if _CALL.tracked or any(map(_requires_grad_beneath, inputs)) or _op_tracked(factors, weight, activations):
        _warn_tracked()
        return True
    return False


def tracked_scope(inputs: Any) -> contextlib.AbstractContextManager:
    """``tracked_call()`` when, eagerly under the transforms, a tensor among ``inputs`` (a pytree:
    a call's inputs, an op's operands) is tracked beneath them (``tracked_beneath``); else a
    context that does nothing."""
    if torch.compiler.is_compiling() or not _functorch.get_interpreter_stack():
        return _NO_SCOPE
    tensors = tuple(t for t in pytree.tree_leaves(inputs) if isinstance(t, Tensor))
    return tracked_call() if tracked_beneath(inputs=tensors) else _NO_SCOPE


@functools.cache  # once per process
def _warn_tracked() -> None:
    warnings.warn(
        "fastaf: tensors that require grad reach its ops beneath torch.func's grad level (LoRA factors, "
        "inputs or activations): fastaf keeps plain autograd's graph beneath the level on its exact, "
        "slower per-layer path, so that torch.autograd over the result is exact (MAML). Pass detached "
        "tensors to torch.func if you do not differentiate its result again.",
        stacklevel=3,
    )


def own_level() -> tuple[int, Optional[Tensor]]:
    """The transform level a Function's ``setup_context`` runs at (the innermost; 0: none), which
    is the level its backward belongs to, with its ``level_token`` (a grad level's, eagerly):
    ``_differentiated``'s ``own``."""
    stack = _functorch.get_interpreter_stack()
    if not stack:
        return 0, None
    top = stack[-1]
    token = level_token(top.level()) if top.key() == GRAD and not torch.compiler.is_compiling() else None
    return top.level(), token


def _differentiated(dy: Tensor, *, factors: tuple = (), weight: Optional[Tensor] = None, x: Optional[Tensor] = None,
                    call: bool = False, own: Optional[tuple[int, Optional[Tensor]]] = None) -> bool:
    """The backward itself is being differentiated: under torch.func, a second grad (or jvp) level
    is active (one level's backward runs with create_graph, which alone needs no higher order) or
    plain autograd records beneath the levels (``tracked_beneath``; ``call``: the forward ran in
    a ``tracked_call``); under plain autograd, create_graph (the engine runs a backward in grad
    mode exactly then). A constant cotangent counts too: from ``y.sum()``, dA = s * (dy @ B).T @ x
    still depends on B. ``own``: the Function's level and token (``own_level`` at its setup); any
    grad or jvp level on the stack but that one, while it lives, differentiates the backward
    (torch.func.vjp's vjp_fn runs it after the level exited; functorch numbers levels by depth,
    so a later level can carry its number). Without ``own``: a second level.

    Inside ``torch.compile``: a backward traced in grad mode (a grad level's, which runs with
    create_graph; the joint's first-order backward runs without), under a grad level entered in
    grad mode, where the layer shows plain autograd beneath (``_op_tracked``) or any layer's
    forward saw a tracked factor (``note_factors``), as an outer autograd over a compiled
    ``torch.func.grad`` asks. ``functional_call``'s inputs are not seen there: with an unfrozen
    base, a tracked input (not a factor) leaves the layers first order."""
    if torch.compiler.is_compiling():
        return (torch.is_grad_enabled() and entered_in_grad_mode() is not False
                and (_op_tracked(factors, weight, (x, dy)) or _trace_tracked()))
    stack = _functorch.get_interpreter_stack()
    if stack:
        if own is None:
            higher = sum(i.key() in (GRAD, _JVP) for i in stack) >= 2
        else:  # hessian, jacfwd(jacrev), jvp or grad of a vjp_fn: their second derivatives came out zero
            level, token = own
            alive = level if token is None or not _functorch.is_dead_tensor_wrapper(token) else None
            higher = any(i.key() in (GRAD, _JVP) and i.level() != alive for i in stack)
        return higher or call or tracked_beneath(factors, weight, (x, dy))
    return torch.is_grad_enabled()


def _transformed_backward(*cotangents: Optional[Tensor]) -> bool:
    """A backward whose own level has gone (``level_left``) runs under what is around it: it must
    be differentiable where a grad or jvp level is on the stack or a cotangent requires grad
    beneath, and batchable where a cotangent is another level's (vmap: jacrev). Otherwise (a
    vjp_fn called at top level) it is an ordinary first-order backward."""
    return differentiated_around(*cotangents) or any(c is not None and is_wrapped(c) for c in cotangents)


def differentiated_around(*cotangents: Optional[Tensor]) -> bool:
    """A grad or jvp level is on the stack, or a cotangent requires grad beneath every level."""
    stack = _functorch.get_interpreter_stack() or ()
    return any(i.key() in (GRAD, _JVP) for i in stack) or any(map(_requires_grad_beneath, cotangents))


def _double_backward(level: int, *cotangents: Optional[Tensor], left: bool = False) -> bool:
    """A single-level Function's backward must be differentiable (or batchable: plain torch ops):
    at level 0, plain autograd's create_graph, any grad or jvp level around it, or a cotangent of
    another level's (a vmap's, under a vjp_fn's backward); beneath grad level ``level``, a
    cotangent that plain autograd records beneath it (an outer objective through a head outside
    the call: functorch's generic rule would differentiate the backward there). Ask it with the
    level still on the stack; compute such a backward below the level in grad mode. ``left``: the
    level has gone (``level_left``), ``_transformed_backward`` decides."""
    if not level:  # made outside every level
        return any(c is not None and (is_wrapped(c) or _differentiated(c, own=(0, None))) for c in cotangents)
    if left:
        return _transformed_backward(*cotangents)
    return entered_in_grad_mode() is not False and any(map(_requires_grad_beneath, cotangents))


def level_left(level: int, token: Optional[Tensor]) -> bool:
    """A single-level Function's backward runs with its grad ``level`` no longer innermost:
    torch.func.vjp's vjp_fn, called after vjp returned (at top level, under another transform, or
    under vmap: jacrev). Its operands are then plain or another level's, and its backward must be
    plain torch ops, which whatever transform is around differentiates or batches: unwrapping
    and popping as if at its level asserted inside functorch, or popped the other level (a grad
    over a vjp_fn came out wrong). functorch numbers levels by depth, so a later grad level can
    carry the same number: ``token`` (``level_token`` at the forward) tells them apart."""
    if not level:
        return False
    stack = _functorch.get_interpreter_stack()
    return (not stack or stack[-1].level() != level or stack[-1].key() != GRAD
            or token is None or _functorch.is_dead_tensor_wrapper(token))


class _Tokens(threading.local):
    def __init__(self) -> None:
        self.by_level: dict[int, Tensor] = {}


_TOKENS = _Tokens()
_PLAIN = torch.empty(0)  # made outside every level: one made under a grad level is that level's


def level_token(level: int) -> Optional[Tensor]:
    """A tensor wrapped at grad ``level`` while it lives (``level_left``): one per level, made
    again once a level of that number has exited (its wrapper then reads dead). None at 0."""
    if not level:
        return None
    tokens = _TOKENS.by_level
    token = tokens.get(level)
    if token is None or _functorch.is_dead_tensor_wrapper(token):
        token = tokens[level] = _functorch._wrap_for_grad(_PLAIN, level)
    return token


def _tangent_sum(*terms: Optional[Tensor]) -> Optional[Tensor]:
    """A jvp rule's tangent, the sum of its product-rule ``terms``: each None where the operand it
    differentiates has a None tangent (an input forward mode does not vary: the frozen weight, no
    bias), so no GEMM runs against a zero tangent. None when every term is.

    The ops' jvp rules write their tangents out with this rather than running ``torch.func.jvp``
    over their references: ``torch.func.linearize`` traces a rule inside a forward-AD level of its
    own, where a nested one is refused ("Nested forward mode AD is not supported")."""
    total = None
    for term in terms:
        if term is not None:
            total = term if total is None else total + term
    return total


def _traced_apply(fn: type[torch.autograd.Function]) -> Any:
    """``fn.apply`` as one opaque call to dynamo (``torch.compiler.allow_in_graph``), to be bound
    in ``fn``'s module as ``<fn name>_apply``.

    Dynamo would otherwise speculate ``fn``'s forward and backward as bytecode at every adapted
    layer. Opaque, AOTAutograd traces ``fn`` itself, on fake tensors, into the same graphs (the
    forward's and backward's registered ops). On the H100 host (torch 2.11) the 1B model's
    compiled ``grad_and_value`` step took 45-46 s to trace before, 31-36 s after (dynamo and
    AOTAutograd; 58 s against 100 s with Inductor), with equal step times. Eagerly it is
    ``fn.apply`` behind one more Python call (the paths that reach a Function eagerly, vmap and
    grad of grad, are not the host-bound ones); under ``backend="eager"`` the call runs eagerly,
    on the direct path.
    """
    def apply(*args: Any) -> Any:
        return fn.apply(*args)

    # named as the caller binds it, in fn's module: AOTAutograd's cache pickles the graphs' calls
    # by module and name, which must find this very function
    apply.__name__ = apply.__qualname__ = f"{fn.__name__}_apply"
    apply.__module__ = fn.__module__
    _mark_cacheable(apply)
    return torch.compiler.allow_in_graph(apply)


def _mark_cacheable(apply: Any) -> None:
    """Let AOTAutograd's cache keep the graphs that call ``apply``, keyed by fastaf's source.

    AOTAutograd caches only graphs whose calls it can vouch for; an opaque function it cannot,
    so every compiled fastaf forward+backward was traced again in each new process (on the CPU,
    a 1-layer model's warm first step 6.7 s against the base model's 3.7-4.1 s). What ``apply``
    traces to is fixed by its inputs (in the cache key), the grad mode and fastaf's code: the key
    given here is a hash of that code, so an edited or upgraded fastaf misses. Kernel choices
    are made inside the registered ops when they run, not in the cached graphs."""
    marked = getattr(getattr(torch, "_inductor").config, "unsafe_marked_cacheable_functions", None)
    if isinstance(marked, dict):  # torch's hook for exactly this (a name -> key dict since 2.6)
        marked[f"{apply.__module__}.{apply.__name__}"] = _source_key()


@functools.cache
def _source_key() -> str:
    """sha256 of fastaf's Python sources (the ops and the kernels), read once."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted((*root.glob("ops/*.py"), *root.glob("kernels/*.py"))):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return f"fastaf-{digest.hexdigest()[:16]}"


def _apply_single_level(apply: Any, level: int, *args: Any) -> Any:
    """``apply(level, *args)`` of a ``_SingleLevelFunction`` at grad level ``level`` (0: none)."""
    if not level:
        return apply(0, *args)
    # functorch refuses a _SingleLevelFunction under its transforms unless this flag is set;
    # it is set for this one call, as functorch's own grad rule does
    previous = single_level_allowed()
    allow_single_level(True)
    try:
        return apply(level, *args)
    finally:
        allow_single_level(previous)



@contextlib.contextmanager
def _below(level: int, *tensors: Optional[Tensor], left: bool = False):
    """Yield ``tensors`` unwrapped at grad level ``level`` and run the body below that level (its
    layer popped: new tensors come out plain), as ``_LoRALinearDirect`` does; level 0, or in a
    backward whose level has gone (``left``: ``level_left``), as given."""
    if not level or left:  # a vjp_fn's backward after its level: as given
        yield tensors
        return
    unwrapped = tuple(None if t is None else _functorch._unwrap_for_grad(t, level) for t in tensors)
    layer = _functorch.pop_dynamic_layer_stack()
    try:
        yield unwrapped
    finally:
        _functorch.push_dynamic_layer_stack(layer)


_Noted_apply = _traced_apply(_Noted)
