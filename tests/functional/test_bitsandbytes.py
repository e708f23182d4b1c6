"""Bases loaded through transformers' ``BitsAndBytesConfig`` (bitsandbytes runs NF4, FP4 and int8
on the CPU): every quantized linear keeps its packed weights and runs its own forward, its LoRA
added to the output (``ops.lora_branch``). Forward, gradients and generate against PEFT's QLoRA
with the same factors; torch.func against autograd; the stateful layer's training and files
against PEFT; training leaves the packed weights and their quantization state bit-identical."""
from __future__ import annotations

import copy
import warnings

import bitsandbytes as bnb
import peft
import pytest
import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

import fastaf as fa
from fastaf.intercept.scope import TRACED_FORWARDS
from tests._models import random_adapter, token_batch
from tests._peft import peft_grads, peft_model_with

TARGETS = ["q_proj", "v_proj", "down_proj"]
R, ALPHA = 4, 8.0
KINDS = {
    "nf4": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
    "nf4-double": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True),
    "fp4": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4"),
    "fp4-double": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=True),
    "int8": dict(load_in_8bit=True),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Llama on disk: hidden 64, so every in_features fills bitsandbytes' 64-value blocks."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    return path


@pytest.fixture(autouse=True)
def _dequant_by_bitsandbytes(set_flags):
    """The model-level tests dequantize with bitsandbytes' ops: fastaf's kernel, interpreted on the
    CPU, took most of this file's time (~80 of 125 s on 2 cores). The kernel has its own tests
    against bitsandbytes (tests/kernels, tests/ops), and one model-level test here runs it."""
    set_flags(dequant_kernel=False)


def _interpreted() -> bool:
    from fastaf.kernels.hardware import available

    return available(torch.empty(0))


def quantized(saved, kind: str):
    """The model loaded with ``kind`` and frozen, in train mode (no dropout anywhere): in eval mode
    bitsandbytes repacks a 4-bit weight in place for the CPU at its first gradless call, which
    would change the weight a pending backward dequantizes (bitsandbytes 0.50)."""
    config = BitsAndBytesConfig(**KINDS[kind], bnb_4bit_compute_dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # int8 on the CPU: "inputs will be cast to float16"
        model = AutoModelForCausalLM.from_pretrained(saved, quantization_config=config, dtype=torch.float32)
    return model.requires_grad_(False).train()


def _logits(fn, ids):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(ids).logits


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_functional_call_equals_peft_qlora_forward_and_gradients(saved, kind):
    model = quantized(saved, kind)
    layer = model.model.layers[0].self_attn.q_proj
    assert not layer.weight.is_floating_point()  # packed: the base stays quantized
    adapter = random_adapter(model, TARGETS, r=R, alpha=ALPHA, seed=1)
    assert adapter["model.layers.0.mlp.down_proj"].A.shape == (R, 128)  # the logical (out, in) shapes
    ids = token_batch()
    pm = peft_model_with(model, {"default": adapter}, TARGETS, {"default": (R, ALPHA)})
    leaves = adapter.map(lambda p, l: fa.LoRA(l.A.clone().requires_grad_(), l.B.clone().requires_grad_(), l.scale))
    got = _logits(lambda i: fa.functional_call(model, leaves, (i,)), ids)
    want = _logits(pm, ids)
    base = _logits(model, ids)
    assert (want - base).abs().max() > 1e-2  # the adapter changes the logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(got)
    (got * dy).sum().backward()
    (want * dy).sum().backward()
    for path, (da, db) in peft_grads(pm, adapter).items():
        # fp32 sums in another order (fastaf's op over the dequantized weight, PEFT's branch): the
        # absolute tolerance follows each gradient's size
        torch.testing.assert_close(leaves[path].A.grad, da, rtol=1e-4, atol=1e-4 * float(da.abs().max()),
                                   msg=lambda m: f"{path} dA: {m}")
        torch.testing.assert_close(leaves[path].B.grad, db, rtol=1e-4, atol=1e-4 * float(db.abs().max()),
                                   msg=lambda m: f"{path} dB: {m}")


@pytest.mark.parametrize("kind", ["nf4", "fp4"])
def test_torch_func_grad_equals_autograd_on_a_quantized_base(saved, kind):
    model = quantized(saved, kind)
    adapter = random_adapter(model, TARGETS, r=R, alpha=ALPHA, seed=2)
    ids = token_batch()

    def loss(ad):
        return fa.functional_call(model, ad, (ids,)).logits.square().mean()

    grads = torch.func.grad(loss)(adapter)
    leaves = adapter.map(lambda p, l: fa.LoRA(l.A.clone().requires_grad_(), l.B.clone().requires_grad_(), l.scale))
    loss(leaves).backward()
    for path, lora in leaves.items():
        torch.testing.assert_close(grads[path].A, lora.A.grad, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(grads[path].B, lora.B.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_generate_equals_peft_qlora_generate(saved, kind):
    model = quantized(saved, kind)
    adapter = random_adapter(model, TARGETS, r=R, alpha=ALPHA, seed=3)
    ids = token_batch(batch=2, seq=6)
    kw = dict(max_new_tokens=5, do_sample=False)
    pm = peft_model_with(model, {"default": adapter}, TARGETS, {"default": (R, ALPHA)})
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # int8 on the CPU: "inputs will be cast to float16"
        want = pm.generate(input_ids=ids, **kw)
        with pm.disable_adapter():
            assert not torch.equal(pm.generate(input_ids=ids, **kw), want)  # the adapter changes the tokens
        assert torch.equal(fa.generate(model, adapter, ids, **kw), want)
        inited = fa.init(copy.deepcopy(model))
        inited.add_new_adapter("a", adapter)
        inited.set_active_adapter("a")
        assert torch.equal(inited.generate(ids, **kw), want)


def test_the_stateful_layer_trains_a_quantized_base_and_writes_what_peft_reads(saved, tmp_path):
    """The active adapter's LoRA reaches a 4-bit layer's output (it was silently dropped): the
    gradients equal functional_call's, and the folder it saves loads in PEFT over the quantized
    base with the same logits; PEFT's own QLoRA folder loads in fastaf."""
    model = quantized(saved, "nf4")
    adapter = random_adapter(model, TARGETS, r=R, alpha=ALPHA, seed=4)
    ids = token_batch()
    leaves = adapter.map(lambda p, l: fa.LoRA(l.A.clone().requires_grad_(), l.B.clone().requires_grad_(), l.scale))
    _logits(lambda i: fa.functional_call(model, leaves, (i,)), ids).square().mean().backward()
    inited = fa.init(copy.deepcopy(model))
    inited.add_new_adapter("sql", adapter)
    inited.set_active_adapter("sql")
    inited.train()
    _logits(inited, ids).square().mean().backward()
    params = {name: p for name, p in inited.named_parameters() if p.requires_grad}
    assert len(params) == 2 * len(adapter)  # the adapter's factors alone train: the base stays frozen
    for path, lora in leaves.items():
        (name,) = [n for n in params if n.endswith(path.replace(".", "__") + ".A")]
        torch.testing.assert_close(params[name].grad, lora.A.grad, rtol=1e-5, atol=1e-7)
    inited.eval()
    inited.save_pretrained(tmp_path / "fastaf")
    with torch.no_grad():
        got = _logits(inited, ids)
        reloaded = peft.PeftModel.from_pretrained(copy.deepcopy(model), tmp_path / "fastaf")
        torch.testing.assert_close(_logits(reloaded, ids), got, rtol=1e-5, atol=1e-5)
    pm = peft_model_with(model, {"default": adapter}, TARGETS, {"default": (R, ALPHA)})
    pm.save_pretrained(tmp_path / "peft")
    loaded = fa.read_adapter(tmp_path / "peft", model=model)
    with torch.no_grad():
        torch.testing.assert_close(_logits(lambda i: fa.functional_call(model, loaded, (i,)), ids), _logits(pm, ids),
                                   rtol=1e-5, atol=1e-5)


def _quantized_state(model) -> dict[str, object]:
    """A copy of each quantized layer's packed weight and of its quantization state: a 4-bit
    weight's QuantState (absmax, code, offset; under double quantization the nested state's too),
    an int8 layer's CB and SCB (on the weight until its first forward, then on the layer's
    ``state``), with their plain fields (shape, blocksize, quant_type, threshold)."""
    state: dict[str, object] = {}

    def keep(name: str, value: object) -> None:
        if isinstance(value, torch.Tensor):
            state[name] = value.detach().clone()
        elif isinstance(value, bnb.functional.QuantState):
            for field, v in vars(value).items():
                keep(f"{name}.{field}", v)
        elif value is None or isinstance(value, (bool, int, float, str, torch.Size, torch.dtype)):
            state[name] = value

    for path, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and not weight.is_floating_point():
            keep(f"{path}.weight", weight)
            for field, value in vars(weight).items():
                keep(f"{path}.weight.{field}", value)
            if isinstance(module, bnb.nn.Linear8bitLt):
                for field, value in vars(module.state).items():  # a MatmulLtState
                    keep(f"{path}.state.{field}", value)
    return state


def _assert_same_state(got: dict[str, object], want: dict[str, object]) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == got[name].dtype and torch.equal(got[name], value), name
        else:
            assert got[name] == value, name


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_training_steps_leave_the_quantized_weights_and_their_state_bit_identical(saved, kind):
    """An optimizer step on the adapter, through functional_call and through the stateful layer,
    moves the factors alone: the packed weights and their quantization state keep every bit, and
    the base model's logits with no adapter stay what they were. (fastaf's dequantizing kernel:
    test_a_4bit_training_call_dequantizes_inside_fastafs_op.)"""
    model = quantized(saved, kind)
    ids = token_batch()
    with torch.no_grad():
        base = _logits(model, ids)  # bitsandbytes' first int8 forward moves CB and SCB to the layer's state
    before = _quantized_state(model)
    assert any(name.endswith("absmax" if kind != "int8" else "state.SCB") for name in before)
    adapter = random_adapter(model, TARGETS, r=R, alpha=ALPHA, seed=12)
    leaves = adapter.map(lambda p, l: fa.LoRA(l.A.clone().requires_grad_(), l.B.clone().requires_grad_(), l.scale))
    opt = torch.optim.SGD([t for l in leaves.values() for t in (l.A, l.B)], lr=1.0)
    _logits(lambda i: fa.functional_call(model, leaves, (i,)), ids).square().mean().backward()
    opt.step()
    assert all(not torch.equal(leaves[p].B, l.B) for p, l in adapter.items())  # the step moved the factors
    _assert_same_state(_quantized_state(model), before)
    inited = fa.init(model)
    inited.add_new_adapter("a", adapter)
    inited.set_active_adapter("a")
    inited.train()
    params = [p for p in inited.parameters() if p.requires_grad]
    assert len(params) == 2 * len(adapter)  # the adapter's factors alone
    opt = torch.optim.SGD(params, lr=1.0)
    _logits(inited, ids).square().mean().backward()
    opt.step()
    assert all(p.grad is not None and p.grad.abs().max() > 0 for p in params)
    _assert_same_state(_quantized_state(inited), before)
    inited.set_active_adapter(None)
    with torch.no_grad():
        assert torch.equal(_logits(inited, ids), base)


def _model_state(model) -> set[int]:
    """The storages a model holds: parameters, buffers and each 4-bit weight's quantization state
    (absmax, under double quantization its own absmax and code: not registered tensors)."""
    held = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        while state is not None:
            held += [t for t in vars(state).values() if isinstance(t, torch.Tensor)]
            state = getattr(state, "state2", None)
    return {t.untyped_storage().data_ptr() for t in held}


def _saved_bytes(run, held: set[int]) -> int:
    """Bytes of the storages autograd saves for backward during ``run()``, each counted once,
    less ``held`` (the model's and the adapter's own)."""
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen | held:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return total


def test_a_4bit_training_call_saves_no_more_for_backward_than_peft_qlora(saved):
    """fastaf's 4-bit op keeps the packed weight for dX and no dense one: what a training forward
    saves is no more than PEFT QLoRA's (its peak memory then differs by the adapters' own dtype
    alone: fastaf's fp32 masters, PEFT's bf16 with ``autocast_adapter_dtype=False``). Saving
    a dense 64 x 64 weight per 4-bit layer besides fails here."""
    ids = token_batch(batch=4, seq=16)
    model = quantized(saved, "nf4-double")
    adapter = random_adapter(model, TARGETS, r=R, alpha=ALPHA, seed=1)
    leaves = adapter.map(lambda p, l: fa.LoRA(l.A.clone().requires_grad_(), l.B.clone().requires_grad_(), l.scale))
    held = _model_state(model) | {t.untyped_storage().data_ptr() for l in leaves.values() for t in (l.A, l.B)}
    ours = _saved_bytes(lambda: fa.functional_call(model, leaves, (ids,), {"labels": ids}), held)
    pm = peft_model_with(quantized(saved, "nf4-double"), {"default": adapter}, TARGETS, {"default": (R, ALPHA)})
    theirs = _saved_bytes(lambda: pm(input_ids=ids, labels=ids), _model_state(pm))
    assert theirs > 0 and ours <= theirs, (ours, theirs)  # (equal with peft 0.21, bitsandbytes 0.50)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_stateful_layer_trains_4bit_layers_through_fastafs_dequantizing_op(saved, compiled, monkeypatch):
    """While an adapter is active, a training call of each 4-bit layer runs ``ops.lora_linear_4bit``
    (an instance forward set on the layer), eagerly and under torch.compile(model); gradients equal
    functional_call's; switching the adapter off removes the forwards, and the base runs as loaded."""
    from fastaf.intercept import use

    calls = []
    real = use.lora_linear_4bit
    monkeypatch.setattr(use, "lora_linear_4bit", lambda *a, **k: calls.append(k["where"]) or real(*a, **k))
    model = quantized(saved, "nf4-double")
    adapter = random_adapter(model, TARGETS, r=R, alpha=ALPHA, seed=8)
    ids = token_batch()
    leaves = adapter.map(lambda p, l: fa.LoRA(l.A.clone().requires_grad_(), l.B.clone().requires_grad_(), l.scale))
    _logits(lambda i: fa.functional_call(model, leaves, (i,)), ids).square().mean().backward()
    calls.clear()
    inited = fa.init(copy.deepcopy(model))
    inited.add_new_adapter("a", adapter)
    inited.set_active_adapter("a")
    torch._dynamo.reset()
    run = torch.compile(inited, backend="aot_eager") if compiled else inited
    _logits(run, ids).square().mean().backward()
    assert sorted(set(calls)) == sorted(adapter)  # every 4-bit layer, through fastaf's op
    params = {name: p for name, p in inited.named_parameters() if p.requires_grad}
    for path, lora in leaves.items():
        (name,) = [n for n in params if n.endswith(path.replace(".", "__") + ".A")]
        torch.testing.assert_close(params[name].grad, lora.A.grad, rtol=1e-5, atol=1e-7)
    clone = copy.deepcopy(inited)  # its layers' forwards are its own
    layer = clone.model.layers[0].self_attn.q_proj
    assert layer.__dict__["forward"].module is layer and layer.__dict__["forward"].registry is clone.fastaf
    inited.set_active_adapter(None)
    assert not any("forward" in m.__dict__ for n, m in inited.named_modules() if n)
    with torch.no_grad():
        torch.testing.assert_close(_logits(inited, ids), _logits(model, ids))


def test_a_compiled_stateful_model_adds_the_lora_of_its_quantized_layers(saved):
    """The stateful layer's hooks, which a compiled model keeps, add the branch inside the graph."""
    model = quantized(saved, "nf4")
    adapter = random_adapter(model, TARGETS, r=R, alpha=ALPHA, seed=5)
    ids = token_batch()
    with torch.no_grad():
        want = _logits(lambda i: fa.functional_call(model, adapter, (i,)), ids)
    inited = fa.init(model)
    inited.add_new_adapter("a", adapter)
    inited.set_active_adapter("a")
    torch._dynamo.reset()
    with torch.no_grad():
        torch.testing.assert_close(_logits(torch.compile(inited, backend="aot_eager"), ids), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["nf4", "fp4"])
def test_a_stack_with_adapter_ids_equals_peft_adapter_names_on_a_quantized_base(saved, kind):
    """Each example takes its slot's branch (none for -1): PEFT's mixed batch over the same 4-bit base."""
    model = quantized(saved, kind).eval()  # PEFT takes adapter_names in eval mode only; no backward here
    adapters = [random_adapter(model, TARGETS, r=R, alpha=ALPHA, seed=s) for s in (6, 7)]
    ids = token_batch(batch=3)
    pm = peft_model_with(model, {"a0": adapters[0], "a1": adapters[1]}, TARGETS, {"a0": (R, ALPHA), "a1": (R, ALPHA)})
    pm.eval()
    with torch.no_grad():
        got = _logits(lambda i: fa.functional_call(model, fa.stack(adapters), (i,), adapter_ids=torch.tensor([1, -1, 0])),
                      ids)
        want = _logits(lambda i: pm(input_ids=i, adapter_names=["a1", "__base__", "a0"]), ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dequant,kernel", [(True, True), (True, False), (False, False)],
                         ids=["dequant-op-kernel", "dequant-op", "branch"])
def test_a_4bit_training_call_dequantizes_inside_fastafs_op(saved, dequant, kernel, set_flags, monkeypatch):
    """With grad on, each 4-bit layer runs ``ops.lora_linear_4bit`` (FASTAF_DEQUANT, the default),
    not its own forward plus a branch; both equal PEFT's QLoRA, and the backward leaves the packed
    weights and their state bit-identical. Inference keeps bitsandbytes' forward."""
    from fastaf.intercept import use

    from fastaf.kernels import dequant_4bit

    set_flags(dequant=dequant, dequant_kernel=kernel)
    calls, launches = [], []
    real, launch = use.lora_linear_4bit, dequant_4bit.dequant_4bit
    monkeypatch.setattr(use, "lora_linear_4bit", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    monkeypatch.setattr(dequant_4bit, "dequant_4bit", lambda *a: launches.append(a[-1].shape) or launch(*a))
    model = quantized(saved, "nf4-double")
    adapter = random_adapter(model, TARGETS, r=R, alpha=ALPHA, seed=6)
    ids = token_batch()
    pm = peft_model_with(model, {"default": adapter}, TARGETS, {"default": (R, ALPHA)})
    leaves = adapter.map(lambda p, l: fa.LoRA(l.A.clone().requires_grad_(), l.B.clone().requires_grad_(), l.scale))
    before = _quantized_state(model)
    got = _logits(lambda i: fa.functional_call(model, leaves, (i,)), ids)
    assert len(calls) == (len(adapter) if dequant else 0)
    assert bool(launches) == (kernel and bool(torch.cuda.is_available() or _interpreted()))
    torch.testing.assert_close(got, _logits(pm, ids), rtol=1e-5, atol=1e-5)
    got.square().mean().backward()
    _assert_same_state(_quantized_state(model), before)
    calls.clear()
    with torch.no_grad():
        fa.functional_call(model, adapter, (ids,))
    assert calls == []


@pytest.mark.skipif(not TRACED_FORWARDS, reason="torch.compile over functional_call sets instance forwards from torch 2.13")
@pytest.mark.parametrize("kind", ["nf4-double", "int8"])
def test_compiled_functional_call_over_a_quantized_base_equals_eager(saved, kind):
    """torch.compile over functional_call (its quantized layers were refused): plain autograd, and
    torch.func.grad_and_value with fullgraph=True, equal the eager gradients; new adapter values
    compile no new graph."""
    model = quantized(saved, kind)
    adapter = random_adapter(model, TARGETS, r=R, alpha=ALPHA, seed=7)
    ids = token_batch()

    def loss(ad):
        return fa.functional_call(model, ad, (ids,)).logits.square().mean()

    leaves = adapter.map(lambda p, l: fa.LoRA(l.A.clone().requires_grad_(), l.B.clone().requires_grad_(), l.scale))
    want = _logits(lambda _: type("O", (), {"logits": loss(leaves)})(), None)
    want.backward()
    torch._dynamo.reset()
    compiled = adapter.map(lambda p, l: fa.LoRA(l.A.clone().requires_grad_(), l.B.clone().requires_grad_(), l.scale))
    got = torch.compile(loss, backend="aot_eager")(compiled)
    got.backward()
    torch.testing.assert_close(got, want)
    for path, lora in leaves.items():
        torch.testing.assert_close(compiled[path].A.grad, lora.A.grad, rtol=1e-5, atol=1e-7)
    torch._dynamo.reset()
    step = torch.compile(torch.func.grad_and_value(loss), backend="aot_eager", fullgraph=True)
    if kind == "int8":  # no op of fastaf's: bitsandbytes' own forward, which torch.func cannot trace
        with pytest.raises(Exception, match=r"q_proj \(Linear8bitLt\) is a quantized layer.*plain autograd"):
            step(adapter)
        return
    counters = torch._dynamo.utils.counters
    counters.clear()
    grads, value = step(adapter)
    torch.testing.assert_close(value, want)
    for path, lora in leaves.items():
        torch.testing.assert_close(grads[path].A, lora.A.grad, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(grads[path].B, lora.B.grad, rtol=1e-5, atol=1e-7)
    frames = counters["stats"]["unique_graphs"]
    step(adapter.map(lambda p, l: fa.LoRA(l.A * 1.5, l.B + 0.01, l.scale)))
    assert counters["stats"]["unique_graphs"] == frames  # no recompilation
    assert not any("forward" in m.__dict__ for m in model.modules())  # the instance forwards are gone


ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_vmap_over_a_stack_on_a_4bit_base_equals_one_call_per_adapter(saved):
    """Under vmap a 4-bit layer computes its forward from the dequantized weight (bitsandbytes'
    Functions have no vmap rule), plus each slot's branch: logits and vmap(grad) equal one call per
    adapter. Every quantized linear is targeted: an untargeted one runs bitsandbytes' forward, which
    vmap(grad) refuses inside bitsandbytes. An int8 layer under vmap is refused by name."""
    model = quantized(saved, "nf4-double")
    model.set_attn_implementation("eager")  # SDPA on the CPU has no vmap batching rule (tests/_models.py)
    adapters = [random_adapter(model, ALL_LINEAR, r=R, alpha=ALPHA, seed=s) for s in (9, 10)]
    ids = token_batch()

    def loss(ad):
        return fa.functional_call(model, ad, (ids,)).logits.square().mean()

    stack = fa.stack(adapters)
    with torch.no_grad():
        got = torch.func.vmap(lambda a: fa.functional_call(model, a, (ids,)).logits)(stack)
        for i, ad in enumerate(adapters):
            torch.testing.assert_close(got[i], fa.functional_call(model, ad, (ids,)).logits, rtol=1e-5, atol=1e-5)
    grads = torch.func.vmap(torch.func.grad(loss))(stack)
    for i, ad in enumerate(adapters):
        want = torch.func.grad(loss)(ad)
        for path in ad:
            torch.testing.assert_close(grads[path].A[i], want[path].A, rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(grads[path].B[i], want[path].B, rtol=1e-4, atol=1e-6)
    int8 = quantized(saved, "int8")
    int8.set_attn_implementation("eager")
    with pytest.raises(NotImplementedError, match=r"q_proj \(Linear8bitLt\) is a quantized layer.*vmap"):
        torch.func.vmap(lambda a: fa.functional_call(int8, a, (ids,)).logits)(
            fa.stack([random_adapter(int8, TARGETS, r=R, alpha=ALPHA, seed=s) for s in (1, 2)]))


def test_hf_trainer_trains_a_quantized_base_through_the_stateful_layer(saved, tmp_path):
    """transformers' Trainer refuses "purely quantized models" unless adapters are attached: an
    ``fa.init`` model says so as PEFT's integration does. It trains (B moves off zero, through
    fastaf's dequantizing op) and ``save_model`` writes a folder PEFT reads over the 4-bit base."""
    from transformers import Trainer, TrainingArguments

    base = quantized(saved, "nf4-double")
    model = fa.init(copy.deepcopy(base))
    model.add_new_adapter("sql", fa.LoRAConfig(r=R, alpha=ALPHA, targets=TARGETS), seed=0)
    model.set_active_adapter("sql")
    ids = token_batch(batch=8, seq=12)
    data = [{"input_ids": ids[i], "labels": ids[i]} for i in range(len(ids))]
    args = TrainingArguments(str(tmp_path / "run"), per_device_train_batch_size=4, max_steps=3, learning_rate=1e-2,
                             report_to=[], use_cpu=True, save_strategy="no", logging_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in trainer.state.log_history if "loss" in h)
    trained = model.get_adapter("sql")
    assert all(float(l.B.abs().max()) > 0 for l in trained.values())  # B starts at zero
    trainer.save_model(str(tmp_path / "final"))
    model.eval()
    with torch.no_grad():
        want = _logits(model, ids)
        reloaded = peft.PeftModel.from_pretrained(copy.deepcopy(base).eval(), tmp_path / "final")
        torch.testing.assert_close(_logits(reloaded, ids), want, rtol=1e-5, atol=1e-5)


def test_trl_sft_trainer_trains_a_quantized_base_through_the_stateful_layer(saved, tmp_path):
    """trl's SFTTrainer (CPU autocast in bf16 over an fp32-compute 4-bit base) trains the active
    adapter through fastaf's dequantizing op."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    from tests.test_stateful_hf import _tokenizer

    model = fa.init(quantized(saved, "nf4-double"))
    model.add_new_adapter("sql", fa.LoRAConfig(r=R, alpha=ALPHA, targets=TARGETS), seed=0)
    model.set_active_adapter("sql")
    rows = token_batch(batch=4, seq=16, seed=5).tolist()
    config = trl.SFTConfig(output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=4,
                           learning_rate=1e-2, report_to=[], use_cpu=True, save_strategy="no", seed=0,
                           disable_tqdm=True, dataset_kwargs={"skip_prepare_dataset": True}, remove_unused_columns=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trl.SFTTrainer(model=model, args=config, train_dataset=Dataset.from_list([{"input_ids": r} for r in rows]),
                                 processing_class=_tokenizer())
        trainer.train()
    assert all(float(l.B.abs().max()) > 0 for l in model.get_adapter("sql").values())


def _compiled_generate(model, adapter, ids, backend, **kw):
    """fa.generate with ``model.forward`` compiled in place by the user, from a fresh dynamo: the
    tokens, and the graphs and graph breaks dynamo made."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend(backend)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    model.forward = torch.compile(model.forward, backend=counter)
    with torch.no_grad():
        tokens = fa.generate(model, adapter, ids, **kw)
    return tokens, counter.graphs, dict(counters["graph_break"])


def test_generate_with_a_compiled_forward_on_a_quantized_base_equals_eager_and_peft_qlora(saved):
    """The user's compiled forward runs every step of fa.generate as a dynamo graph (no graph
    break) that holds each 4-bit layer's bitsandbytes op and its LoRA, with the eager fa.generate's
    tokens and PEFT QLoRA's (fp32 compute).

    transformers never compiles a bitsandbytes model's decode step itself: its quantizer is not
    compileable, and generate with a ``compile_config`` or a static cache logs "Compilation will be
    skipped" and runs the dynamic path (which test_generate_equals_peft_qlora_generate covers)."""
    model = quantized(saved, "nf4-double")
    assert not model.hf_quantizer.is_compileable  # once it is, transformers' compiled path wants a test here
    adapter = random_adapter(model, TARGETS, r=R, alpha=ALPHA, seed=11)
    ids = token_batch(batch=2, seq=6)
    kw = dict(max_new_tokens=3, do_sample=False)
    pm = peft_model_with(model, {"default": adapter}, TARGETS, {"default": (R, ALPHA)})
    with torch.no_grad():
        want = pm.generate(input_ids=ids, **kw)
        with pm.disable_adapter():
            assert not torch.equal(pm.generate(input_ids=ids, **kw), want)  # the adapter changes the tokens
        assert torch.equal(fa.generate(model, adapter, ids, **kw), want)
    layers = sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    got, graphs, breaks = _compiled_generate(model, adapter, ids, "aot_eager", **kw)
    assert torch.equal(got, want)
    assert graphs and breaks == {}  # the whole forward in each graph: the LoRA branches too
    for graph in graphs:
        gemms = [n for n in graph.graph.nodes if n.target is torch.ops.bitsandbytes.gemm_4bit.default]
        assert len(gemms) == layers


def test_a_compiled_forward_on_a_quantized_base_compiles_as_few_graphs_as_on_a_dense_base(saved):
    """A dense base's compiled forward under fa.generate compiles 3 graphs whatever the number of
    tokens (the prefill, the first step, the step with a dynamic cache length); so does a 4-bit one
    (the instance forward fastaf sets on a 4-bit layer counts its calls only outside the user's
    compiled block, where a count would be a guard and each step a recompile)."""
    dense = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).requires_grad_(False).train()
    adapter = random_adapter(dense, TARGETS, r=R, alpha=ALPHA, seed=11)
    ids = token_batch(batch=2, seq=6)
    kw = dict(max_new_tokens=4, do_sample=False)
    _, dense_graphs, _ = _compiled_generate(dense, adapter, ids, "eager", **kw)
    _, graphs, _ = _compiled_generate(quantized(saved, "nf4"), adapter, ids, "eager", **kw)
    assert len(graphs) <= len(dense_graphs)
