"""Quantized linears fastaf has no rule of its own for (GPTQ, AWQ, HQQ, torchao): stand-ins with
the real layouts, each checked against an fp64 reference over the weight it dequantizes to.

A module with integer ``in_features`` / ``out_features`` whose own tensors are packed integers
gets its LoRA as a branch on its own output (``LinearSpec.branch``), exact for a linear map; a
float tensor-subclass weight (torchao) is a plain linear to fastaf, whose op computes with it; a
targeted module that is no linear layer is refused by name before anything runs.
"""
import dataclasses

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

import fastaf as fa
from tests._models import logits, tiny_llama, token_batch

NEW = dict(max_new_tokens=6, do_sample=False)


# ---- packing -------------------------------------------------------------------------------

_AWQ_ORDER = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])  # AutoAWQ's nibble order within an int32


def _pack_int4(q: torch.Tensor, dim: int, order: torch.Tensor | None = None) -> torch.Tensor:
    """Eight 4-bit values q (int64, [0, 16)) per int32 along ``dim``, the i-th in bits 4i..4i+3
    (``order``: which of the eight goes i-th, AWQ's interleave)."""
    q = q.movedim(dim, -1)
    q = q.reshape(*q.shape[:-1], q.shape[-1] // 8, 8)  # (..., n/8, 8)
    if order is not None:
        q = q[..., order]
    v = (q << (4 * torch.arange(8))).sum(-1)  # int64 in [0, 2**32)
    v = torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)  # the same bits as int32
    return v.movedim(-1, dim)


def _unpack_int4(p: torch.Tensor, dim: int, order: torch.Tensor | None = None) -> torch.Tensor:
    """``_pack_int4``'s inverse, as the layers' own forwards unpack (int32 shifts and a mask)."""
    p = p.movedim(dim, -1)
    q = (p.unsqueeze(-1) >> (4 * torch.arange(8, dtype=torch.int32))) & 0xF  # (..., n/8, 8)
    if order is not None:
        q = q[..., torch.argsort(order)]
    return q.reshape(*p.shape[:-1], p.shape[-1] * 8).movedim(-1, dim)


def _quantize(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit quantization of w (N, K) in groups of ``group`` along K:
    (q (N, K), zero (N, K/group), scale (N, K/group)), w ≈ (q - zero) · scale."""
    n, k = w.shape
    g = w.double().reshape(n, k // group, group)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-6)
    zero = (-lo / scale).round().clamp(0, 15)
    q = (g / scale[..., None] + zero[..., None]).round().clamp(0, 15)
    return q.reshape(n, k).long(), zero.long(), scale


# ---- stand-ins -------------------------------------------------------------------------------


class GPTQLinear(nn.Module):
    """auto-gptq's / AutoAWQ's QuantLinear layout, no nn.Linear: qweight int32 (K/8, N) packed along
    K (GPTQ) or (K, N/8) along N in AWQ's order, qzeros int32 (K/g, N/8), scales fp16 (K/g, N),
    bias fp16 (N,) or None. ``runs`` counts its forwards."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, group: int = 8,
                 layout: str = "gptq") -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.group_size, self.layout = group, layout
        q, zero, scale = _quantize(weight, group)  # (N, K), (N, K/g), (N, K/g)
        order = _AWQ_ORDER if layout == "awq" else None
        self.register_buffer("qweight", _pack_int4(q.T, 0) if layout == "gptq" else _pack_int4(q.T, 1, order))
        self.register_buffer("qzeros", _pack_int4(zero.T, 1, order))
        self.register_buffer("scales", scale.T.half())
        self.register_buffer("bias", None if bias is None else bias.detach().half())
        self.runs = 0

    def dequantized(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """The weight this layer computes with, (N, K) in ``dtype``."""
        order = _AWQ_ORDER if self.layout == "awq" else None
        q = _unpack_int4(self.qweight, 0) if self.layout == "gptq" else _unpack_int4(self.qweight, 1, order)  # (K, N)
        zero = _unpack_int4(self.qzeros, 1, order).repeat_interleave(self.group_size, 0)  # (K, N)
        scale = self.scales.repeat_interleave(self.group_size, 0)  # (K, N)
        return ((q - zero).to(dtype) * scale.to(dtype)).T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.runs += 1
        return F.linear(x, self.dequantized(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


class HQQLinear(nn.Module):
    """hqq's HQQLinear layout: W_q uint8 parameter (two 4-bit values a byte, (N·K/g/2, g)), a
    ``meta`` dict (scale, zero (N·K/g, 1), shape, group_size, nbits) and a float bias."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, group: int = 8) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        q, zero, scale = _quantize(weight, group)
        q = q.reshape(-1, group)  # (N·K/g, g)
        half = q.shape[0] // 2
        self.W_q = nn.Parameter((q[:half] << 4 | q[half:]).to(torch.uint8), requires_grad=False)
        self.meta = {"scale": scale.reshape(-1, 1).half(), "zero": zero.reshape(-1, 1).half(),
                     "shape": tuple(weight.shape), "group_size": group, "nbits": 4}
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.runs = 0

    def dequantized(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        q = torch.cat([self.W_q >> 4, self.W_q & 0xF]).to(dtype)  # (N·K/g, g)
        w = (q - self.meta["zero"].to(dtype)) * self.meta["scale"].to(dtype)
        return w.reshape(self.meta["shape"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.runs += 1
        return F.linear(x, self.dequantized(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


class Int4Weight(torch.Tensor):
    """torchao's AffineQuantizedTensor in small: a float-dtype wrapper subclass holding 4-bit codes
    (uint8), per-row scale and zero, dequantized on every use (``__torch_function__`` for F.linear,
    ``__torch_dispatch__`` for everything else)."""

    @staticmethod
    def __new__(cls, codes, scale, zero, dtype):
        return torch.Tensor._make_wrapper_subclass(cls, codes.shape, dtype=dtype, device=codes.device)

    def __init__(self, codes, scale, zero, dtype):
        self.codes, self.scale, self.zero = codes, scale, zero

    def __repr__(self):
        return f"Int4Weight({tuple(self.shape)}, {self.dtype})"

    def __tensor_flatten__(self):
        return ["codes", "scale", "zero"], self.dtype

    @classmethod
    def __tensor_unflatten__(cls, inner, dtype, outer_size, outer_stride):
        return cls(inner["codes"], inner["scale"], inner["zero"], dtype)

    def dequantize(self, dtype=None):
        return ((self.codes.to(torch.float64) - self.zero) * self.scale).to(dtype or self.dtype)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w, *b = args
            return F.linear(x, w.dequantize(x.dtype), *b, **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            w = args[0]
            return cls(w.codes, w.scale, w.zero, w.dtype)
        if func is torch.ops.aten._to_copy.default and set(kwargs) <= {"dtype"}:
            w = args[0]
            return cls(w.codes, w.scale, w.zero, kwargs.get("dtype", w.dtype))
        plain = pytree.tree_map(lambda t: t.dequantize() if isinstance(t, cls) else t, (args, kwargs))
        return func(*plain[0], **plain[1])


def ao_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An nn.Linear whose weight is an Int4Weight (per-row 4-bit), as torchao's quantize_ leaves it."""
    n, k = weight.shape
    q, zero, scale = _quantize(weight, k)  # one group a row
    lin = nn.Linear(k, n, bias=bias is not None, dtype=weight.dtype)
    lin.weight = nn.Parameter(Int4Weight(q.to(torch.uint8), scale, zero.double(), weight.dtype), requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
    return lin


def _dense(module: nn.Module) -> torch.Tensor:
    """The (N, K) fp64 weight a stand-in computes with."""
    if isinstance(module, nn.Linear):
        w = module.weight
        return w.dequantize(torch.float64) if isinstance(w, Int4Weight) else w.double()
    return module.dequantized()


KINDS = {
    "gptq": lambda w, b: GPTQLinear(w, b, layout="gptq"),
    "awq": lambda w, b: GPTQLinear(w, b, layout="awq"),
    "hqq": lambda w, b: HQQLinear(w, b),
    "torchao": ao_linear,
}


def _two_layers(kind: str, dtype: torch.dtype = torch.float64) -> nn.Sequential:
    """Linear(16, 16) -> a quantized 16 -> 24 with bias, frozen."""
    g = torch.Generator().manual_seed(3)
    quant = KINDS[kind](torch.randn(24, 16, generator=g) * 0.2, torch.randn(24, generator=g) * 0.1)
    return nn.Sequential(nn.Linear(16, 16), quant).to(dtype).requires_grad_(False)


def _lora(n: int, k: int, r: int = 2, seed: int = 1, dtype=torch.float64, stack: int | None = None) -> fa.LoRA:
    g = torch.Generator().manual_seed(seed)
    lead = () if stack is None else (stack,)
    A = (torch.randn(*lead, r, k, generator=g) * 0.3).to(dtype)
    B = (torch.randn(*lead, n, r, generator=g) * 0.3).to(dtype)
    return fa.LoRA(A, B, 2.0)


def _reference(model: nn.Sequential, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: float) -> torch.Tensor:
    """fp64: the quantized layer's dequantized linear map plus scale · h @ Aᵀ @ Bᵀ."""
    h = model[0](x).double()
    quant = model[1]
    bias = quant.bias.double() if quant.bias is not None else 0
    return h @ _dense(quant).T + bias + scale * h @ A.double().T @ B.double().T


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor a stand-in holds (packed codes, scales, zeros, bias), cloned."""
    out = {k: v.detach().clone() for k, v in module.state_dict().items() if not isinstance(v, Int4Weight)}
    if isinstance(getattr(module, "weight", None), Int4Weight):
        out.update(codes=module.weight.codes.clone(), scale=module.weight.scale.clone())
    for k, v in getattr(module, "meta", {}).items():
        if isinstance(v, torch.Tensor):
            out[f"meta.{k}"] = v.clone()
    return out


def _same(before: dict, after: dict) -> bool:
    return before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


# ---- functional_call: a branch on the layer's own output ----------------------------------------


@pytest.mark.parametrize("kind", ["gptq", "awq", "hqq", "torchao"])
def test_a_quantized_layer_takes_its_lora_exactly_with_gradients(kind):
    """functional_call's output and its gradients in A and B equal the fp64 formula over the
    dequantized weight; the packed tensors are untouched and no instance forward is left."""
    model = _two_layers(kind)
    packed = _tensors(model[1])
    lo = _lora(24, 16)
    A, B = lo.A.clone().requires_grad_(), lo.B.clone().requires_grad_()
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    got = fa.functional_call(model, fa.Adapter({"1": fa.LoRA(A, B, lo.scale)}), (x,))
    want_A, want_B = lo.A.clone().requires_grad_(), lo.B.clone().requires_grad_()
    want = _reference(model, x, want_A, want_B, lo.scale)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(got, _reference(model, x, lo.A, 0 * lo.B, lo.scale))  # the LoRA matters
    dy = torch.randn_like(want)
    for g, w in zip(torch.autograd.grad(got, (A, B), dy), torch.autograd.grad(want, (want_A, want_B), dy)):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    assert _same(packed, _tensors(model[1]))
    assert "forward" not in vars(model[1])
    if kind != "torchao":
        assert model[1].runs == 1
        assert fa._layouts.linear_spec(model[1]).branch


@pytest.mark.parametrize("kind", ["gptq", "hqq", "torchao"])
def test_a_quantized_layer_in_fp32_matches_the_fp64_reference(kind):
    """fp32 activations and adapter (GPTQ's scales stay fp16): the fp64 reference within fp32 error."""
    model = _two_layers(kind, torch.float32)
    lo = _lora(24, 16, dtype=torch.float32)
    x = torch.randn(4, 16)
    got = fa.functional_call(model, fa.Adapter({"1": lo}), (x,))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _reference(model, x, lo.A, lo.B, lo.scale), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["gptq", "hqq", "torchao"])
def test_torch_func_grad_through_a_quantized_layer(kind):
    """torch.func.grad over the adapter equals autograd on the fp64 reference."""
    model = _two_layers(kind)
    lo = _lora(24, 16)
    x = torch.randn(6, 16, dtype=torch.float64)
    dy = torch.randn(6, 24, dtype=torch.float64)
    grads = torch.func.grad(lambda ad: (fa.functional_call(model, ad, (x,)) * dy).sum())(fa.Adapter({"1": lo}))
    A, B = lo.A.clone().requires_grad_(), lo.B.clone().requires_grad_()
    want = torch.autograd.grad((_reference(model, x, A, B, lo.scale) * dy).sum(), (A, B))
    torch.testing.assert_close(grads["1"].A, want[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grads["1"].B, want[1], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ["gptq", "hqq", "torchao"])
def test_a_stack_with_adapter_ids_gives_each_row_its_slot(kind):
    """A stack of 3 with ids [2, -1, 0, 1, 0]: each row equals its slot's reference (-1 the base
    alone), and gradients reach each slot from its rows only."""
    model = _two_layers(kind)
    lo = _lora(24, 16, stack=3)
    A, B = lo.A.clone().requires_grad_(), lo.B.clone().requires_grad_()
    ids = torch.tensor([2, -1, 0, 1, 0])
    x = torch.randn(5, 7, 16, dtype=torch.float64)
    got = fa.functional_call(model, fa.Adapter({"1": fa.LoRA(A, B, lo.scale)}), (x,), adapter_ids=ids)
    want_A, want_B = lo.A.clone().requires_grad_(), lo.B.clone().requires_grad_()
    rows = [_reference(model, x[i:i + 1], want_A[s], want_B[s], lo.scale) if s >= 0 else
            _reference(model, x[i:i + 1], want_A[0], 0 * want_B[0], lo.scale) for i, s in enumerate(ids.tolist())]
    want = torch.cat(rows)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    dy = torch.randn_like(want)
    # a float weight (torchao) takes ops.lora_linear_multi, whose h and dA / dB sums are fp32 by
    # design (reference_bwd), also for fp64 factors: fp32's error there; the branch is fp64 throughout
    tol = dict(rtol=1e-5, atol=1e-5) if kind == "torchao" else dict(rtol=1e-10, atol=1e-12)
    for g, w in zip(torch.autograd.grad(got, (A, B), dy), torch.autograd.grad(want, (want_A, want_B), dy)):
        torch.testing.assert_close(g, w, **tol)


def test_vmap_over_a_stack_refuses_a_packed_layer_by_name():
    """Under torch.func.vmap over a stack a packed layer that is not bitsandbytes' 4-bit is refused
    (design.md, "Quantized bases"), naming its path and class, before its forward runs."""
    model = _two_layers("gptq")
    lo = _lora(24, 16, stack=2)
    x = torch.randn(3, 16, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match=r"^1 \(GPTQLinear\) is a quantized layer .*vmap"):
        torch.func.vmap(lambda l: fa.functional_call(model, fa.Adapter({"1": l}), (x,)))(lo)
    assert model[1].runs == 0 and "forward" not in vars(model[1])


# ---- init_adapter ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,targets", [("gptq", ["1"]), ("awq", "all-linear"), ("hqq", ["1"])])
def test_init_adapter_on_a_layer_without_a_weight(kind, targets):
    """init_adapter gives a packed layer the logical shapes, A (r, in) and B (out, r) zero, fp32
    on its device, as PEFT does; functional_call with it is the base."""
    model = _two_layers(kind, torch.float32)
    adapter = fa.init_adapter(model, fa.LoRAConfig(r=2, alpha=4, targets=targets), seed=0)
    assert adapter["1"].A.shape == (2, 16) and adapter["1"].B.shape == (24, 2)
    assert adapter["1"].A.dtype == torch.float32 and not adapter["1"].B.any()
    x = torch.randn(2, 16)
    torch.testing.assert_close(fa.functional_call(model, adapter, (x,)), model(x))


def test_the_stateful_layer_adds_a_config_on_a_layer_without_a_weight():
    model = _two_layers("gptq", torch.float32)
    x = torch.randn(2, 16)
    want = model(x)
    fa.init(model)
    model.add_new_adapter("a", fa.LoRAConfig(r=2, alpha=4, targets=["1"]), seed=0)
    model.set_active_adapter("a")
    torch.testing.assert_close(model(x), want)  # B = 0: the base


# ---- a model: generate, mixed layers, the stateful layer ----------------------------------------


def _quantized_llama(kind: str = "gptq", paths=("q_proj", "v_proj")) -> tuple[nn.Module, nn.Module]:
    """(tiny Llama with ``paths`` replaced by quantized stand-ins, the same with dense nn.Linear
    holding their dequantized weights in fp32): the reference."""
    quant, dense = tiny_llama(seed=0), tiny_llama(seed=0)
    for layer_q, layer_d in zip(quant.model.layers, dense.model.layers):
        for name in paths:
            lin = getattr(layer_q.self_attn, name)
            q = KINDS[kind](lin.weight.detach(), lin.bias)
            setattr(layer_q.self_attn, name, q)
            d = nn.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None)
            d.weight = nn.Parameter(_dense(q).float())
            setattr(layer_d.self_attn, name, d)
    return quant.requires_grad_(False), dense.requires_grad_(False)


def _adapter(model: nn.Module, targets, seed: int = 0, b: float = 0.5) -> fa.Adapter:
    """A non-zero adapter made on ``model`` (the dense reference), with the same paths as the
    quantized model's."""
    ad = fa.init_adapter(model, fa.LoRAConfig(r=4, alpha=8, targets=targets), seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    return ad.map(lambda p, l: dataclasses.replace(l, B=torch.randn(l.B.shape, generator=g) * b))


@pytest.mark.parametrize("kind", ["gptq", "hqq", "torchao"])
def test_generate_with_quantized_attention_projections(kind):
    """fa.generate on a Llama whose q_proj / v_proj are quantized gives the tokens the dense
    dequantized model gives with the same adapter; so does a stack with adapter_ids (-1: base)."""
    quant, dense = _quantized_llama(kind)
    ids = token_batch(3, 5)
    one, two = _adapter(dense, ["q_proj", "v_proj"]), _adapter(dense, ["q_proj", "v_proj"], seed=5)
    want = fa.generate(dense, one, ids, **NEW)
    assert not torch.equal(want, fa.generate(dense, None, ids, **NEW))  # the adapter changes tokens
    torch.testing.assert_close(fa.generate(quant, one, ids, **NEW), want, rtol=0, atol=0)
    rows = torch.tensor([1, -1, 0])
    stacked = fa.generate(quant, fa.stack([one, two]), ids, adapter_ids=rows, **NEW)
    for i, slot in enumerate(rows.tolist()):
        ref = fa.generate(dense, [one, two][slot] if slot >= 0 else None, ids[i:i + 1], **NEW)
        torch.testing.assert_close(stacked[i:i + 1], ref, rtol=0, atol=0)
    assert all("forward" not in vars(m) for m in quant.modules())


def test_quantized_and_dense_siblings_train_together():
    """q/v quantized (branches) beside k/o dense (the fused op, sharing h with siblings): logits
    and every gradient equal the dense dequantized model's."""
    quant, dense = _quantized_llama("gptq")
    adapter = _adapter(dense, ["q_proj", "k_proj", "v_proj", "o_proj"])
    leaves = [t.requires_grad_() for t in pytree.tree_leaves(adapter)]
    ids = token_batch(2, 9)
    got = logits(fa.functional_call(quant, adapter, (ids,)))
    want = logits(fa.functional_call(dense, adapter, (ids,)))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(got.square().mean(), leaves)
    for g, w in zip(grads, torch.autograd.grad(want.square().mean(), leaves)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", ["gptq", "hqq", "torchao"])
def test_the_stateful_layer_equals_functional_call(kind):
    """fa.init + add_new_adapter + set_active_adapter: the forward equals functional_call's and the
    dense reference's; the packed tensors are untouched."""
    quant, dense = _quantized_llama(kind)
    adapter = _adapter(dense, ["q_proj", "v_proj"])
    packed = _tensors(quant.model.layers[0].self_attn.q_proj)
    ids = token_batch(2, 7)
    want = logits(fa.functional_call(quant, adapter, (ids,)))
    torch.testing.assert_close(want, logits(fa.functional_call(dense, adapter, (ids,))), rtol=1e-5, atol=1e-5)
    fa.init(quant)
    quant.add_new_adapter("a", adapter)
    quant.set_active_adapter("a")
    torch.testing.assert_close(logits(quant(ids)), want, rtol=1e-6, atol=1e-6)
    assert _same(packed, _tensors(quant.model.layers[0].self_attn.q_proj))


# ---- what fastaf cannot adapt: refused by name, nothing run ------------------------------------


class PackedNoFeatures(nn.Module):
    """Packed int32 weights and its own forward, but no in_features / out_features."""

    def __init__(self, k: int = 16, n: int = 24) -> None:
        super().__init__()
        self.register_buffer("qweight", torch.arange(k * n // 8, dtype=torch.int32).reshape(k // 8, n))
        self.runs = 0

    def forward(self, x):
        self.runs += 1
        return x @ torch.ones(x.shape[-1], self.qweight.shape[1], dtype=x.dtype)


def test_a_targeted_module_that_is_no_linear_layer_is_refused_before_it_runs():
    """A hand-made adapter on it and init_adapter's targets each raise a ValueError naming the path
    and the class; the module never ran and the model is as it was."""
    model = nn.Sequential(nn.Linear(16, 16), PackedNoFeatures()).requires_grad_(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match=r"adapter path '1' is a PackedNoFeatures, not a linear layer"):
        fa.functional_call(model, fa.Adapter({"1": _lora(24, 16, dtype=torch.float32)}), (x,))
    llama = tiny_llama()
    llama.model.layers[0].self_attn.q_proj = odd = PackedNoFeatures(32, 32)
    path = "model.layers.0.self_attn.q_proj"
    with pytest.raises(ValueError, match=rf"adapter path '{path}' is a PackedNoFeatures, not a linear layer"):
        fa.generate(llama, fa.Adapter({path: _lora(32, 32, dtype=torch.float32)}), token_batch(1, 3), **NEW)
    assert odd.runs == 0
    with pytest.raises(ValueError, match=r"target matches '1', a PackedNoFeatures; LoRA applies to nn.Linear"):
        fa.init_adapter(model, fa.LoRAConfig(r=2, alpha=4, targets=["1"]))
    assert model[1].runs == 0
    assert _same(before, model.state_dict()) and all("forward" not in vars(m) for m in model)


class _ByKeyword(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x=x)


def test_a_quantized_layer_called_by_keyword_is_refused_before_its_forward_runs():
    inner = _two_layers("gptq", torch.float32)[1]
    with pytest.raises(ValueError, match=r"^inner \(GPTQLinear\) is a quantized linear layer.*first positional"):
        fa.functional_call(_ByKeyword(inner), fa.Adapter({"inner": _lora(24, 16, dtype=torch.float32)}),
                           (torch.randn(2, 16),))
    assert inner.runs == 0


def test_a_quantized_layer_called_by_keyword_is_refused_by_name():
    """The keyword call is refused (never a base-only output), naming the path and class, and
    leaves the layer as it was."""
    inner = _two_layers("hqq", torch.float32)[1]
    before = _tensors(inner)
    with pytest.raises(ValueError, match=r"^inner \(HQQLinear\) is a quantized linear layer.*first positional"):
        fa.functional_call(_ByKeyword(inner), fa.Adapter({"inner": _lora(24, 16, dtype=torch.float32)}),
                           (torch.randn(2, 16),))
    assert _same(before, _tensors(inner)) and "forward" not in vars(inner)
