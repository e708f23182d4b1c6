"""One intercepted use of a targeted weight -> one op call: the single op, a grouped one, a shared h,
or per-row adapter ids.

Both interceptions end here: the mode (``mode.LoRAMode``) and the weights that carry their
adapter (``carrier``) find a linear use through ``rules.linear_use`` and hand it to ``call_op``
with the call's mode, which holds what the choice needs (the impl, the ids, the groups, the
siblings' shared h).
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _config
from .._adapter import LoRA
from ..ops import PLAIN_TYPES, check_rows, decoding, expanded_decode, linear_decodes, lora_branch, \
    lora_branch_multi, lora_decode_shrink, lora_linear_decode, lora_linear_given_h, lora_linear_multi, \
    lora_multi_decode, lora_multi_decode_shrink, multi_decoding, multi_expanded_decode, multi_shares_decode, \
    routed_lora_linear, shareable, shared_h_fanned, shares_decode, \
    transform_levels
from ..ops.lora_dequant import Layout4bit, Packed4bit, dequantize, lora_linear_4bit


def call_op(mode: Any, route: Any, x: Tensor, weight: Tensor, bias: Tensor | None, *,
            flattened: bool = False) -> Tensor:
    """``route``'s LoRA linear on ``x`` (..., K) with its plain ``weight`` (N, K), under ``mode``.

    ``flattened``: x is Conv1D's batch-major (batch * seq, K) view, for ``adapter_ids``.
    """
    mode._count(route)  # inside a custom Function's forward, say, no gradient leaves
    if mode.ids is not None:
        ids = check_rows(mode.ids, x.shape[0], route.path, flattened=flattened)
        if multi_decoding(x, route.lora, mode.impl, route.module.training):
            return lora_multi_decode(x, weight, bias, route.lora, ids)
        if route.siblings and _config.flags().group and mode.traced and not torch.is_grad_enabled():
            # a compiled decoding step with ids: q/k/v (gate/up) take h from one grouped shrink
            shared = _shared_decode(mode, route, x, weight, ids)
            if shared is not None:
                return multi_expanded_decode(x, weight, bias, *shared, route.lora, ids)
        return lora_linear_multi(x, weight, bias, route.lora, ids, training=route.module.training,
                                 impl=mode.impl, where=route.path)
    lora = route.lora
    if not lora.stacked and not lora.experts and decoding(x, lora, mode.impl, route.module.training):
        return lora_linear_decode(x, weight, bias, lora, route.path)  # no groups: the fewest launches
    flags = _config.flags()
    # not in a block compiled inside an eager call (FSDP2 recipes): the groups' bookkeeping
    # (weak references, version counters) breaks dynamo's graph there, and grouping is eager-only
    if route.siblings and mode.groups is not None and flags.group and flags.share_input != "always" \
            and not torch.compiler.is_compiling():
        y = mode.groups.take(route, x, weight, bias)
        if y is None:
            y = routed_lora_linear(x, weight, bias, route.lora, mode.impl, route.module.training, route.path)
            mode.groups.saw(route, x)
        return y
    if route.siblings and flags.group and mode.traced and not torch.is_grad_enabled() \
            and not linear_decodes(x.reshape(-1, x.shape[-1]), weight, route.lora, mode.impl):
        # a compiled decoding step that does not take the one-launch linear: q/k/v (gate/up)
        # take h from one shrink launch over x
        shared = _shared_decode(mode, route, x)
        if shared is not None:  # (not under autocast: _shared_decode declines there)
            return expanded_decode(x, weight, bias, *shared, route.lora)
    share = flags.share_input
    # "compiled": a mode made inside the trace (functional_call under torch.compile); one made
    # eagerly around a compiled block holds its shared h across the block's calls, which a graph
    # cannot
    # (with grad off the op is plain torch ops under a trace, which Inductor fuses: nothing to share)
    if route.siblings and (share == "always" or share == "compiled" and mode.traced and torch.is_grad_enabled()):
        shared = _shared_h(mode, route, x)
        if shared is not None:
            h, token, fanned_weight = shared
            # the token sums this sibling's dx with the others' over the weight it was made
            # for; a call on another weight (a pre-hook's) makes its own
            token = token if fanned_weight is weight else None
            return lora_linear_given_h(x, weight, bias, h, route.lora, impl=mode.impl, where=route.path,
                                       token=token)
    return routed_lora_linear(x, weight, bias, route.lora, mode.impl, route.module.training, route.path)


def _shared_h(mode: Any, route: Any, x: Tensor) -> tuple[Tensor, Tensor | None, Tensor] | None:
    """``route``'s (h, token, the weight the token is for) from one pass over ``x`` shared with
    its siblings (``shared_h_fanned``), or None (alone). The mode holds one input at a time."""
    slot = mode.shared
    # eagerly x's version counter catches in-place writes; traced, the mode's __torch_function__ does
    version = 0 if torch.compiler.is_compiling() else x._version
    # A slice is taken once: a layer that runs again (the next pass of a held mode, a module
    # applied twice) starts a new group, as does an input changed in place since.
    fresh = slot is not None and slot[4] == "h" and route.path in slot[2] and route.path not in slot[3]
    if fresh and slot[0] is x and slot[1] == version:
        slot[3].add(route.path)
        return slot[2][route.path]
    # another input: the siblings that have not run on the current one yet (o_proj alone; a
    # cross-attention's k with v); a layer running again: all of them
    ran = slot[3] if fresh else ()
    group = [route] + [r for r in route.siblings if r is not route and r.path not in ran]
    if len(group) < 2 or any(r.module.training and r.lora.dropout for r in group):
        return None  # dropout draws a mask per layer: no shared h
    loras = [r.lora for r in group]
    if not shareable(x, loras):
        return None
    weights = [r.weight for r in group]
    # dx summed over plain (N, K) weights only: the op mixes no DTensor (FSDP2) with plain
    # gradients, and a Conv1D's (K, N) weight is not what its tokens are shaped by
    fanned = weights if all(type(r.weight) in PLAIN_TYPES and not r.spec.transposed for r in group) else ()
    hs, tokens = shared_h_fanned(x, loras, fanned, impl=mode.impl)
    mode.shared = (x, version, {r.path: s for r, s in zip(group, zip(hs, tokens, weights))}, {route.path}, "h")
    return hs[0], tokens[0], weights[0]


def _shared_decode(mode: Any, route: Any, x: Tensor, weight: Tensor | None = None,
                   ids: Tensor | None = None) -> tuple[Tensor, int] | None:
    """``route``'s (partials, index) from one shrink launch over ``x`` shared with its siblings, in
    a traced call with grad off, or None (it decodes alone): ``lora_decode_shrink``, or with a
    stack and ``ids`` (``weight`` the one this call computes with) ``lora_multi_decode_shrink``,
    each row with its segment's slot. Held in the mode's ``shared`` slot, as ``_shared_h``'s h: a
    write to x in place drops it (the mode's ``__torch_function__``), and each sibling takes its
    slice once."""
    tag = "decode" if ids is None else "multi-decode"
    slot = mode.shared
    fresh = slot is not None and slot[4] == tag and route.path in slot[2] and route.path not in slot[3]
    if fresh and slot[0] is x:
        slot[3].add(route.path)
        return slot[2][route.path]
    if torch.is_autocast_enabled(x.device.type) or x.dim() < 2:
        return None
    # another input: the siblings that have not run on the current one (o_proj alone), as _shared_h
    ran = slot[3] if fresh else ()
    group = [route] + [r for r in route.siblings if r is not route and r.path not in ran]
    if any(r.module.training and r.lora.dropout for r in group):
        return None
    x2 = x.reshape(-1, x.shape[-1])  # (M, K)
    loras = [r.lora for r in group]
    if ids is None:
        if not shares_decode(x2, loras, mode.impl):
            return None
        part = lora_decode_shrink(x2, [lo.A for lo in loras])
    else:
        if not multi_shares_decode(x2, [weight] + [r.weight for r in group[1:]], loras, mode.impl):
            return None
        part = lora_multi_decode_shrink(x2, [lo.A for lo in loras], ids.to(x.device, non_blocking=True).contiguous())
    mode.shared = (x, 0, {r.path: (part, i) for i, r in enumerate(group)}, {route.path}, tag)
    return part, 0


def branch_output(path: str, module: Any, args: tuple, output: Any, lora: LoRA, ids: Any = None) -> Tensor:
    """A quantized layer's ``output`` plus its LoRA (``ops.lora_branch``) from its positional input
    ``args[0]``: what the per-call hooks of ``functional_call`` and the stateful layer's hooks
    return. ``ids``: the call's adapter_ids (a stacked ``lora``), or None."""
    if not args or not isinstance(args[0], Tensor) or not isinstance(output, Tensor):
        _refuse_branch(path, module, args, f" -> {type(output).__name__}")
    x = args[0]
    if ids is None:
        return output + lora_branch(x, lora, module.training).to(output.dtype)
    return output + lora_branch_multi(x, lora, check_rows(ids, x.shape[0], path), module.training).to(output.dtype)


def _refuse_branch(path: str, module: Any, args: tuple, got_output: str = "") -> None:
    """The error for a quantized layer's call fastaf cannot add a LoRA branch to: its input not the
    first positional argument, or (``got_output``) its output not a tensor."""
    raise ValueError(
        f"{path} ({type(module).__name__}) is a quantized linear layer, whose LoRA fastaf adds to its output "
        "from its input: it needs the input as its first positional argument and a tensor output; got "
        f"{type(args[0]).__name__ if args else 'no positional argument'}{got_output}"
    )


def packed_4bit(module: Any) -> Packed4bit | None:
    """A bitsandbytes ``Linear4bit``'s weight as ``ops.lora_dequant`` takes it (NF4 or FP4, double
    quantization or not), or None for any other module (read by its attributes: bitsandbytes is
    not imported). Its quantization state is the weight's, or the module's where the weight lost it
    (FSDP; bitsandbytes' forward restores it from there too); a weight repacked for the CPU's
    AVX512 path (bitsandbytes does that in eval mode) is not the layout the op reads."""
    weight = module._parameters.get("weight")
    traced = torch.compiler.is_compiling()
    if not traced:  # the layer's weight and state as last read: the same layout and tensors (host time per call)
        cached = _packed.get(module)
        if cached is not None and cached[0] is weight and cached[1] is getattr(weight, "quant_state", None):
            return cached[2]
    state = getattr(weight, "quant_state", None) or getattr(module, "quant_state", None)
    if weight is None or state is None or getattr(state, "quant_type", None) not in ("nf4", "fp4") \
            or getattr(state, "packing_format_for_cpu", False) or weight.dtype != torch.uint8:
        return None
    nested = bool(getattr(state, "nested", False))
    layout = Layout4bit(int(state.blocksize), state.quant_type, tuple(state.shape), state.dtype,
                        int(state.state2.blocksize) if nested else 0)
    # the bytes as a plain tensor: bitsandbytes' Params4bit sends every torch call on it through its
    # __torch_function__, and no op of fastaf's takes its eager path for a tensor subclass
    packed = weight if traced else weight.as_subclass(Tensor)
    if nested:
        offset = state.offset if isinstance(state.offset, Tensor) else torch.tensor(float(state.offset))
        found = Packed4bit(layout, packed, state.absmax, state.state2.absmax, state.state2.code, offset.to(packed.device))
    else:
        found = Packed4bit(layout, packed, state.absmax)
    if not traced and getattr(weight, "quant_state", None) is state:  # one kept on the module only (FSDP): read again
        _packed[module] = (weight, state, found)
    return found


# module -> (its weight, its quant_state, the Packed4bit read from them); weak: not kept past the module
_packed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def dequantized(path: str, module: Any, args: tuple, kwargs: dict, lora: LoRA, ids: Any, impl: str,
                own: bool) -> Tensor | None:
    """A bitsandbytes 4-bit layer's call with its LoRA through ``ops.lora_linear_4bit`` (its weight
    dequantized inside fastaf's fused op, the dense weight never kept: ``FASTAF_DEQUANT``), or None
    where that does not apply. It takes a training call (grad on) of one LoRA with the input alone,
    the module's own forward (``own``: not one set on the instance, such as accelerate's hooks) and
    no vmap level (the op has no vmap rule); inference keeps bitsandbytes' forward, whose few-row
    kernel reads the packed weight directly."""
    if not own or ids is not None or lora.stacked or not torch.is_grad_enabled() or len(args) != 1 or kwargs \
            or not isinstance(args[0], Tensor) or not _config.flags().dequant or transform_levels()[0]:
        return None
    packed = packed_4bit(module)
    if packed is None:
        return None
    x = args[0]
    dtype, bias = _compute(module, x)
    return lora_linear_4bit(x.to(dtype), packed, bias, lora, impl=impl, training=module.training,
                            where=path).to(x.dtype)


def _compute(module: Any, x: Tensor) -> tuple[torch.dtype, Tensor | None]:
    """(the dtype a bitsandbytes layer computes in, its bias in it): its ``compute_dtype``, else x's."""
    dtype = getattr(module, "compute_dtype", None) or x.dtype
    return dtype, module.bias if module.bias is None else module.bias.to(dtype)


def quantized_call(path: str, module: Any, forward: Any, args: tuple, kwargs: dict, lora: LoRA, ids: Any,
                   impl: str, own: bool) -> Tensor:
    """A quantized layer's call with its LoRA: ``dequantized``, or ``forward(*args, **kwargs)`` (the
    module's own) plus the LoRA (``branch_output``)."""
    y = dequantized(path, module, args, kwargs, lora, ids, impl, own)
    if y is not None:
        return y
    vmaps, derivatives = transform_levels()
    if vmaps and not torch.compiler.is_compiling():
        return _vmapped(path, module, args, kwargs, lora, own)
    if torch.compiler.is_compiling() and (vmaps or derivatives):
        raise NotImplementedError(
            f"{path} ({type(module).__name__}) is a quantized layer that runs its own forward, its LoRA added to the "
            "output, and torch.func transforms inside torch.compile cannot trace that forward (bitsandbytes reads "
            "its weight's storage). Compile the call with plain autograd (loss.backward()), or run torch.func "
            "eagerly"
        )
    if not args or not isinstance(args[0], Tensor):  # before the layer runs: nothing of it half done
        _refuse_branch(path, module, args)
    return branch_output(path, module, args, forward(*args, **kwargs), lora, ids)


def _vmapped(path: str, module: Any, args: tuple, kwargs: dict, lora: LoRA, own: bool) -> Tensor:
    """A quantized layer's call under ``torch.func.vmap`` (over a stack of adapters): bitsandbytes'
    forwards are old-style autograd Functions, which vmap refuses. A 4-bit layer computes what its
    forward does, the weight dequantized (not batched: one for every slot) and ``F.linear``, plus
    the LoRA as a branch; the dense weight lives while autograd needs it, as PEFT's would."""
    packed = packed_4bit(module) if own and len(args) == 1 and not kwargs and isinstance(args[0], Tensor) else None
    if packed is None:
        raise NotImplementedError(
            f"{path} ({type(module).__name__}) is a quantized layer whose own forward runs under torch.func.vmap, "
            "which fastaf does for bitsandbytes' 4-bit layers alone, from their dequantized weight (their autograd "
            "Functions, like other quantized forwards, have no vmap rule): call functional_call once per "
            "adapter, or use adapter_ids with a stack"
        )
    x = args[0]
    dtype, bias = _compute(module, x)
    w = dequantize(packed.layout, *packed.tensors)
    base = F.linear(x.to(dtype), w if w.dtype == dtype else w.to(dtype), bias)
    return (base + lora_branch(x.to(dtype), lora, module.training)).to(x.dtype)
