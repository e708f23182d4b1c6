"""``fastaf.generate``: Hugging Face ``generate`` with an explicit adapter, or a stack and per-row ids."""
from __future__ import annotations

import collections
import contextlib
import inspect
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ._adapter import Adapter, LoRA
from ._layouts import check_module
from ._packed import Packed, marked_static
from .intercept import combine, explicit_mode_active, scoped_call


def generate(
    model: nn.Module,
    adapter: Adapter | list[Adapter] | None,
    input_ids: torch.Tensor | None = None,
    *,
    adapter_ids: torch.Tensor | None = None,
    **generate_kwargs: Any,
) -> Any:
    """``model.generate(input_ids, **generate_kwargs)`` with ``adapter`` applied wherever its
    modules run (the encoder of an encoder-decoder too); the model is left as it was.

    Args:
        model: a Hugging Face model with ``generate``; plain or ``fastaf.init``-ed (the explicit
            adapter stands in for the active one).
        adapter: an ``Adapter``, a list of them (their deltas add), or a stacked one with
            ``adapter_ids``.
        input_ids: (batch, seq), or None for models whose inputs come in ``generate_kwargs``
            (Whisper's ``input_features``): the batch is then the first of those tensors' sizes.
        adapter_ids: (batch,) int tensor for a stacked adapter: row i decodes with slot
            ``adapter_ids[i]``, -1 with the base model. With ``num_beams`` or
            ``num_return_sequences`` above 1 (as keywords or in a ``generation_config``) generate
            repeats each row max(num_beams, num_return_sequences) times for the decoding steps,
            and each id with it; an encoder (T5, BART, Whisper) or a vision tower (LLaVA) that
            generate runs before that, on the rows as given, takes the ids as given.
        **generate_kwargs: passed to ``model.generate``.
    Returns:
        What ``model.generate`` returns.
    """
    check_module(model, "fastaf.generate")
    if input_ids is not None:
        generate_kwargs["input_ids"] = input_ids
    batch = _batch(generate_kwargs)
    ids: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = adapter_ids
    if isinstance(adapter_ids, torch.Tensor) and adapter_ids.dim() == 1 and adapter_ids.shape[0] == batch:
        # generate expands each row max(num_beams, num_return_sequences) times (repeat_interleave,
        # transformers 5's _expand_inputs_for_generation) after it ran the encoder or the vision
        # tower on the rows as given: each layer takes the ids that fit its rows (check_rows), and
        # scoped_call checks the ids as given, first
        expand = max(_setting(model, generate_kwargs, "num_beams"), _setting(model, generate_kwargs, "num_return_sequences"))
        if expand > 1:
            ids = (adapter_ids, adapter_ids.repeat_interleave(expand))
    run = lambda: model.generate(**generate_kwargs)  # noqa: E731
    adapter = combine(adapter)
    present = adapter is not None and len(adapter) > 0
    if compiles_decode_step(model, generate_kwargs):
        refuse_checkpointing(model)
        drop_foreign_compiled_call(model)
        with adapted_decoding(model, adapter if present else None, ids):
            return run()
    if present:
        adapter = in_compute_dtype(model, adapter)
    return scoped_call(model, adapter, run, adapter_ids=ids, batch=batch)


@contextlib.contextmanager
def adapted_decoding(model: nn.Module, adapter: Adapter | None, ids: Any = None) -> Iterator[None]:
    """``model`` (and its encoder) applying ``adapter`` (or None) and ``ids`` inside each call
    while the block runs: the way a ``generate`` whose decode step compiles runs, the step's graph
    holding the LoRA ops over a static copy of the factors, cast to the weights' half dtypes
    (``_static_copy``, ``_AdaptedForward``). The stateful layer's ``generate`` runs the same way."""
    if adapter is not None:
        adapter, ids = _static_copy(model, adapter, ids)
    with _adapted_calls(model, adapter, ids):
        yield


_HALF = (torch.float16, torch.bfloat16)


def in_compute_dtype(model: nn.Module, adapter: Adapter, *, shapes_only: bool = False) -> Adapter:
    """``adapter`` with its fp32 (or fp64) factors cast once to the dtype of the half-precision
    weight each adapts: the ops cast them to the input's dtype at every call otherwise, two launches
    per adapted layer per decoding step (fp32 master factors are how adapters train and load).
    The factors of weights in another dtype, or not found, stay as they are. ``shapes_only``: the
    cast factors as their shapes and dtypes alone (nothing allocated, nothing copied), for a
    ``Packed`` that ``fill`` casts into."""
    loras = {}
    for path, lora in adapter.items():
        dtype = _weight_dtype(model, path)
        if dtype in _HALF and lora.A.dtype not in _HALF:
            cast = (lambda t: torch.empty((), dtype=dtype, device=t.device).expand(t.shape)) if shapes_only \
                else (lambda t: t.to(dtype))
            lora = LoRA(cast(lora.A), cast(lora.B), lora.scale, lora.dropout, lora.experts)
        loras[path] = lora
    return Adapter._unchecked(loras) if shapes_only else Adapter(loras)


def _weight_dtype(model: nn.Module, path: str) -> torch.dtype | None:
    """The dtype of the weight an adapter's ``path`` targets (a module's ``weight`` or, for expert
    LoRAs, a parameter), None where ``path`` names neither."""
    try:
        target = model.get_submodule(path)
    except AttributeError:
        try:
            target = model.get_parameter(path)
        except AttributeError:
            return None
    weight = getattr(target, "weight", None) if isinstance(target, nn.Module) else target
    return weight.dtype if isinstance(weight, torch.Tensor) else None


class _StandIn:
    """A callable set on a module's instance for the length of a ``fastaf.generate`` whose decode
    step compiles, applying the generate's adapter around ``inner``: the model it adapts, the
    adapter (a ``Packed`` static copy, or an Adapter) and ids, and the generating thread."""

    def __init__(self) -> None:
        self.module: Any = None  # the model whose routes the adapter takes
        self.inner: Any = None  # what it stands in for
        self.adapter: Any = None
        self.ids: Any = None
        self.thread: int | None = None

    def hold(self, model: nn.Module, inner: Any, adapter: Any, ids: Any) -> None:
        self.module, self.inner, self.adapter, self.ids = model, inner, adapter, ids
        self.thread = threading.get_ident()

    def release(self) -> None:
        """Hold nothing of the model's: the model can go."""
        self.module = self.inner = self.adapter = self.ids = self.thread = None


class _AdaptedForward(_StandIn):
    """A module's ``forward`` for the length of a ``fastaf.generate`` whose decode step compiles:
    each call applies the adapter inside the call (``scoped_call``), so the compiled step's graph
    holds the LoRA ops and no mode outside it sees the graph's own calls again at run time.

    One per module, kept (weakly) across calls and reading the adapter from its fields: a compiled
    step guards on the ``forward`` it traced, and a new one per call would compile a new graph.
    Only the thread running the generate gets the adapter: another thread's call of the model in
    the meantime runs it as it was. (``inner``: the class's forward, or one set on the instance.)
    """

    @property
    def fastaf_stands_in_for(self) -> Any:
        """The forward this one runs: ``_layouts.compiled_class`` looks through it, so a module
        whose own forward the user compiled counts as compiled, and an eager call of it (the
        prefill) takes the mode, never weights that carry the adapter into dynamo's trace."""
        return self.inner

    @property
    def __signature__(self) -> inspect.Signature:
        """The forward's it stands in for: ``generate`` reads it to pick the inputs it prepares
        (``position_ids`` from the attention mask, which a left-padded batch needs where positions
        are absolute, GPT-2's; ``logits_to_keep``), and this object's own ``(*args, **kwargs)``
        would hide them."""
        inner = self.inner
        return inspect.signature(inner if inner is not None else self.__call__)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling() and threading.get_ident() != self.thread:
            return self.inner(*args, **kwargs)  # (traced, it is the generating thread's decode step)
        adapter, compiling = self.adapter, torch.compiler.is_compiling()
        if isinstance(adapter, Packed):  # traced, its LoRAs are views made inside the graph
            adapter = adapter.traced() if compiling else adapter.eager
        # an eager call (the prefill, a step dynamo left eager) carries the adapted weights, as
        # functional_call does: under the mode every torch call of the model reached Python (a 1B
        # model's prefill of 32 x 128 tokens: 86k Python calls against 46k carried, cProfile on
        # the H200). A traced call takes the mode whatever ``carry`` says
        return scoped_call(self.module, adapter, lambda: self.inner(*args, **kwargs), adapter_ids=self.ids,
                           carry=not compiling, warn_unused=False)


_FORWARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> its _AdaptedForward


class _AdaptedFeatures(_StandIn):
    """A multimodal model's feature encoder (``get_image_features``, ``_FEATURES``) for the length
    of a ``fastaf.generate`` whose decode step compiles. transformers (5.24) runs it before the
    decoding loop, outside the model's forward (``_prepare_multimodal_encoder_kwargs_for_generation``),
    and the modules it runs (LLaVA's vision tower and projector) decoded without their LoRA:
    silently, the base model's output. A call already inside the model's adapted forward (older
    transformers run it there), traced, or from another thread runs the method as it is.
    (``inner``: the bound method.)"""

    @property
    def __signature__(self) -> inspect.Signature:
        """The method's: generate picks the keyword inputs it passes from its parameters."""
        return inspect.signature(self.inner)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if (torch.compiler.is_compiling() or threading.get_ident() != self.thread or explicit_mode_active()):
            return self.inner(*args, **kwargs)
        adapter = self.adapter.eager if isinstance(self.adapter, Packed) else self.adapter
        return scoped_call(self.module, adapter, lambda: self.inner(*args, **kwargs), adapter_ids=self.ids,
                           warn_unused=False)


# the methods transformers' generate calls on ``model.base_model`` outside the model's forward
_FEATURES = ("get_image_features", "get_video_features", "get_audio_features")
_METHODS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> {name: its _AdaptedFeatures}
_lock = threading.Lock()  # installs and restores of the forwards


def refuse_checkpointing(model: nn.Module) -> None:
    """Raise, before anything runs, where a module of ``model`` checkpoints (transformers'
    ``gradient_checkpointing``, on in training mode only): dynamo traces a checkpointed layer apart
    from the adapter's mode, and a decoding step compiled there ran those layers without it."""
    on = [path for path, m in model.named_modules() if m.__dict__.get("gradient_checkpointing") is True and m.training]
    if on:
        raise NotImplementedError(
            f"fastaf: {type(model).__name__} has gradient checkpointing on in training mode ({on[0] or 'the model'}"
            f"{f' and {len(on) - 1} more' if len(on) > 1 else ''}), which a compiled decoding step cannot follow "
            "(dynamo traces each checkpointed layer apart from the adapter): call model.eval() first (checkpointing "
            "runs in training only), or generate without a static cache or compile_config"
        )


def drop_foreign_compiled_call(model: nn.Module) -> None:
    """Drop the compiled ``__call__`` transformers keeps on ``model`` (``_compiled_call``, made at
    the first ``generate`` whose decode step compiles) where it calls another model: a deep copy
    (``copy.deepcopy``, ``fa.init(copy.deepcopy(model))``) keeps the original's, bound to the
    original, and its decoding steps ran the original model, not the copy nor its adapter. The
    next ``generate`` compiles one for ``model``."""
    compiled = model.__dict__.get("_compiled_call")
    bound = getattr(getattr(compiled, "_torchdynamo_orig_callable", None), "__self__", model)
    if bound is not model:
        del model.__dict__["_compiled_call"]


def adapting_calls(model: nn.Module) -> bool | None:
    """None where no ``fastaf.generate`` whose decode step compiles runs on ``model``; else
    whether it applies an adapter of its own (its forward is an ``_AdaptedForward`` meanwhile)."""
    forward = model.__dict__.get("forward")
    return forward.adapter is not None if isinstance(forward, _AdaptedForward) else None


@contextlib.contextmanager
def _adapted_calls(model: nn.Module, adapter: Any, ids: Any) -> Iterator[None]:
    """``model`` (and the encoder ``generate`` runs apart, if any) adapting each call inside it;
    the forwards it had are back on exit, also on error."""
    encoder = None  # an encoder-decoder's encoder runs apart from the model's forward in generate
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False) and callable(getattr(model, "get_encoder", None)):
        encoder = model.get_encoder()
    modules = [model] + ([encoder] if isinstance(encoder, nn.Module) and encoder is not model else [])
    installed: list = []
    with _lock:
        try:
            for module in modules:
                forward = _FORWARDS.get(module)
                if forward is None:
                    forward = _FORWARDS[module] = _AdaptedForward()
                own = module.__dict__.get("forward")  # accelerate's hooks set one; fa.init does
                if own is forward:
                    raise RuntimeError(f"fastaf.generate: a generate on {type(module).__name__} is already running "
                                       "with a compiled decode step; one at a time per model")
                forward.hold(model, own if own is not None else module.forward, adapter, ids)
                module.__dict__["forward"] = forward  # no __setattr__: not a submodule
                installed.append((module, "forward", own, forward))
            owner = getattr(model, "base_model", model)
            for name in _FEATURES if adapter is not None and isinstance(owner, nn.Module) else ():
                method = getattr(owner, name, None)
                if not callable(method):
                    continue
                features = _METHODS.setdefault(owner, {}).setdefault(name, _AdaptedFeatures())
                features.hold(model, method, adapter, ids)
                own = owner.__dict__.get(name)
                owner.__dict__[name] = features
                installed.append((owner, name, own, features))
        except BaseException:
            _restore(installed)
            raise
    try:
        yield
    finally:
        with _lock:
            _restore(installed)


def _restore(installed: list) -> None:
    """Put back the forwards and methods ``_adapted_calls`` replaced, and let go of the model."""
    for module, name, own, stand_in in reversed(installed):
        if own is None:
            module.__dict__.pop(name, None)
        else:
            module.__dict__[name] = own
        stand_in.release()


# per model, the static copies of the last few adapter structures and id shapes it decoded with
_STATIC: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_STATIC_KEPT = 4  # structures per model: each holds a copy of an adapter's factors on its device


def _static_copy(model: nn.Module, adapter: Adapter, ids: Any) -> tuple[Packed, Any]:
    """``adapter`` (its fp32 factors cast to the half dtype of the weights they adapt,
    ``in_compute_dtype``) and ``ids`` copied into tensors kept per model and structure (paths, shapes,
    dtypes, devices, scales) and marked static for dynamo: the adapter packed into one flat
    buffer per dtype and device (``Packed``).

    A compiled decode step under CUDA graphs (``mode="reduce-overhead"``) copies every tensor
    input that is not static into a graph buffer at each replay: one copy per factor per step, 2 x
    112 small copies a token for a 1B model's r=16 LoRA on q, k, v, o and the MLP. Static tensors
    are read in place, as parameters are. And each tensor input costs host time at every call
    (fetched through its object path, checked, passed along): the packed factors are one input
    per dtype. The copies here are made once per ``generate`` call, on the current stream before
    the replays that read them; a new adapter of the same structure reuses the buffers (same
    addresses: no new graph, no new recording), as new ids of the same shape do.
    """
    kept = _STATIC.get(model)
    if kept is None:
        kept = _STATIC[model] = collections.OrderedDict()
    shaped = in_compute_dtype(model, adapter, shapes_only=True)  # fill casts: fp32 masters copied once, as bf16
    key = ("adapter",) + tuple((path, l.A.shape, l.A.dtype, l.A.device, l.B.shape, l.B.dtype, l.scale, l.dropout,
                                l.experts) for path, l in shaped.items())
    held = _kept(kept, key, lambda: Packed(shaped))
    held.fill(adapter)
    if isinstance(ids, torch.Tensor):
        ids = _static_ids(kept, ids)
    elif isinstance(ids, tuple):
        ids = tuple(_static_ids(kept, one, i) for i, one in enumerate(ids))
    return held, ids


def _static_ids(kept: collections.OrderedDict, ids: torch.Tensor, which: int = 0) -> torch.Tensor:
    """``ids``' values in the kept static tensor of its shape, dtype and device (copied without a
    host sync). ``which``: generate's ids as given (0) or repeated per beam (1)."""
    held = _kept(kept, ("ids", which, ids.shape, ids.dtype, ids.device), lambda: _static_like(ids))
    held.copy_(ids)
    return held


def _kept(kept: collections.OrderedDict, key: tuple, make: Any) -> Any:
    """The value under ``key``, made where missing; the least recently used go past ``_STATIC_KEPT``."""
    value = kept.pop(key, None)
    if value is None:
        value = make()
    kept[key] = value
    while len(kept) > _STATIC_KEPT:
        kept.popitem(last=False)
    return value


def _static_like(t: torch.Tensor) -> torch.Tensor:
    """An empty tensor like ``t`` that dynamo takes as static in address and in shape (``marked_static``)."""
    return marked_static(torch.empty_like(t, requires_grad=False, memory_format=torch.contiguous_format))


# caches transformers' generate can compile a decode step over (their shapes are fixed)
_COMPILEABLE_CACHES = ("static", "offloaded_static", "sliding_window", "hybrid", "hybrid_chunked")


def compiles_decode_step(model: nn.Module, generate_kwargs: dict) -> bool:
    """Whether this generate may compile the decode step (``model.get_compiled_call``): a
    ``compile_config`` passed, a static-shape cache asked for (``cache_implementation`` as a keyword,
    else in the ``generation_config`` passed, else in the model's own) or passed (``past_key_values``)."""
    if generate_kwargs.get("compile_config") is not None:
        return True
    passed, own = generate_kwargs.get("generation_config"), getattr(model, "generation_config", None)
    for asked in (generate_kwargs.get("cache_implementation"), getattr(passed, "cache_implementation", None),
                  getattr(own, "cache_implementation", None)):
        if asked is not None:
            return asked in _COMPILEABLE_CACHES
    return bool(getattr(generate_kwargs.get("past_key_values"), "is_compileable", False))


def _setting(model: nn.Module, generate_kwargs: dict, field: str) -> int:
    """A generation setting as generate resolves it: the keyword, else the passed
    ``generation_config``'s value where set (transformers 5 leaves unset fields None), else the
    model's ``generation_config`` (BART's and T5's ship num_beams 4-5), else 1."""
    passed = generate_kwargs.get("generation_config")
    for value in (generate_kwargs.get(field), getattr(passed, field, None),
                  getattr(getattr(model, "generation_config", None), field, None)):
        if value is not None:
            return int(value) or 1
    return 1


def _batch(generate_kwargs: dict) -> int:
    """The number of rows: ``input_ids``' first size, else that of the first tensor argument."""
    first = generate_kwargs.get("input_ids")
    if first is None:
        first = next((v for v in generate_kwargs.values() if isinstance(v, torch.Tensor) and v.dim() > 0), None)
    if first is None:
        raise ValueError("fastaf.generate: no input_ids and no tensor input in generate_kwargs (e.g. input_features)")
    return first.shape[0]
