"""fastaf.generate and the stateful layer under transformers' compiled static-cache decoding: the
same tokens as the dynamic path and as PEFT, no graph break from fastaf, and no new graph when the
adapter's values, the active adapter or the ids change. CPU: the decode step compiles with the
eager backend (``CompileConfig._compile_all_devices``)."""
import contextlib
import copy
import gc
import inspect
import io
import logging
import re
import threading

import peft
import pytest
import torch
from torch._dynamo.utils import counters
from transformers import CompileConfig

import fastaf as fa
from tests._models import random_adapter, tiny_bart, tiny_gpt2, tiny_llama, token_batch
from tests._modes import needs_interpreter
from tests._peft import peft_model_with

ARCHS = {"llama": (tiny_llama, ["q_proj", "v_proj", "down_proj"]), "gpt2": (tiny_gpt2, ["c_attn", "c_proj"])}
NEW = dict(max_new_tokens=6, do_sample=False)


def _static() -> dict:
    config = CompileConfig(backend="eager")
    config._compile_all_devices = True  # transformers compiles the decode step on CUDA only otherwise
    return dict(cache_implementation="static", compile_config=config)


def _recording_static(graphs: list) -> dict:
    """``_static()``'s keywords with a backend that appends each compiled graph's example inputs
    to ``graphs`` (and runs the graph as it is)."""
    def backend(gm, example_inputs):
        graphs.append(list(example_inputs))
        return gm.forward

    config = CompileConfig(backend=backend, mode=None)  # (a mode is for inductor)
    config._compile_all_devices = True
    return dict(cache_implementation="static", compile_config=config)


def _graphs() -> int:
    return counters["stats"].get("unique_graphs", 0)


def _compiled() -> tuple[int, dict]:
    """What dynamo did since ``counters.clear()``: (graphs compiled, {graph-break reason: times})."""
    return _graphs(), dict(counters["graph_break"])


def _fresh(run):
    """``run()``'s result and ``_compiled()`` for it from a fresh dynamo. A compiled generate of
    fastaf's must give the base model's own (a break in fastaf's part of the step shows as one
    more reason and one more graph; dynamo's reasons name no file, so no filter on them can tell
    fastaf's breaks from transformers')."""
    torch._dynamo.reset()
    counters.clear()
    out = run()
    return out, _compiled()


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_one_adapter_compiled_decode_equals_the_dynamic_path_and_peft_and_compiles_once(arch):
    make, targets = ARCHS[arch]
    model = make().eval().requires_grad_(False)
    ids = token_batch(batch=2, seq=8)
    first, second = (random_adapter(model, targets, r=4, seed=s) for s in (1, 2))
    plain, base = _fresh(lambda: model.generate(ids, **NEW, **_static()))
    assert base[0] >= 1, "the base model's decoding step compiled nothing"
    got, compiled = _fresh(lambda: fa.generate(model, first, ids, **NEW, **_static()))
    assert compiled == base, f"(graphs, breaks), fastaf's against the base model's: {compiled}, {base}"
    assert torch.equal(got, fa.generate(model, first, ids, **NEW))
    want = fa.generate(model, second, ids, **NEW)
    got = fa.generate(model, second, ids, **NEW, **_static())
    assert torch.equal(got, want)
    assert _compiled() == compiled, "new adapter values compiled a new graph"
    assert "forward" not in model.__dict__  # left as it was
    stateful = fa.init(copy.deepcopy(model))
    stateful.add_new_adapter("a", second)
    stateful.set_active_adapter("a")
    tokens, compiled = _fresh(lambda: stateful.generate(ids, **NEW, **_static()))
    assert torch.equal(tokens, got)
    assert compiled == base, f"(graphs, breaks), the stateful layer's against the base model's: {compiled}, {base}"
    peft_model = peft_model_with(copy.deepcopy(model), {"default": second}, targets, {"default": (4, 8.0)}).eval()
    assert torch.equal(peft_model.generate(input_ids=ids, **NEW), got)
    assert not torch.equal(plain, got)  # the adapter changes the tokens


def test_the_compile_check_sees_a_graph_break_in_fastafs_part_of_the_step(monkeypatch):
    """``_fresh``'s comparison with the base model's compiled generate fails on a graph break put
    in fastaf's part of the traced step (the packed adapter's unpacking); the tokens stay the same."""
    from fastaf._packed import Packed

    model = tiny_llama(layers=1).eval().requires_grad_(False)
    ids = token_batch(batch=2, seq=8)
    adapter = random_adapter(model, ["q_proj", "v_proj"], r=4, seed=1)
    _, base = _fresh(lambda: model.generate(ids, **NEW, **_static()))
    traced = Packed.traced

    def breaking(self):
        torch._dynamo.graph_break()
        return traced(self)
    monkeypatch.setattr(Packed, "traced", breaking)
    got, compiled = _fresh(lambda: fa.generate(model, adapter, ids, **NEW, **_static()))
    assert torch.equal(got, fa.generate(model, adapter, ids, **NEW))
    assert compiled[0] > base[0] and sum(compiled[1].values()) > sum(base[1].values()), (compiled, base)


@pytest.mark.parametrize("via", ["fa.generate", "stateful"])
def test_a_compiled_generates_eager_prefill_carries_the_weights_as_functional_call_does(via, monkeypatch):
    # under the mode every torch call of the prefill reaches Python; carried weights see only
    # the adapted linears
    from fastaf.intercept.mode import LoRAMode

    model = tiny_llama().eval().requires_grad_(False)
    ids = token_batch(batch=2, seq=8)
    adapter = random_adapter(model, ["q_proj", "v_proj", "down_proj"], r=4, seed=1)
    want = fa.generate(model, adapter, ids, **NEW)
    runner = model
    if via == "stateful":
        runner = fa.init(copy.deepcopy(model))
        runner.add_new_adapter("a", adapter)
        runner.set_active_adapter("a")
    calls = {"eager": 0}
    inner = LoRAMode.__torch_function__

    def counted(self, func, types, args=(), kwargs=None):
        if not torch.compiler.is_compiling():
            calls["eager"] += 1
        return inner(self, func, types, args, kwargs)

    monkeypatch.setattr(LoRAMode, "__torch_function__", counted)
    static = _static()
    got = runner.generate(ids, **NEW, **static) if via == "stateful" else fa.generate(model, adapter, ids, **NEW, **static)
    assert torch.equal(got, want)
    assert calls["eager"] == 0, f"{calls['eager']} torch calls went through the mode eagerly"


def test_a_left_padded_batch_decodes_compiled_at_the_positions_generate_gives_it():
    """generate prepares position_ids from the attention mask when the model's forward takes them
    (it reads the forward's signature): GPT-2's positions are absolute, so a left-padded row
    decoded at positions that count its pads gets other logits. The compiled step's forward
    (fa.generate's and the stateful layer's, set on the instance) shows the model's signature."""
    model = tiny_gpt2().eval().requires_grad_(False)
    adapter = random_adapter(model, ["c_attn", "c_fc"], r=4, seed=1)
    ids = token_batch(batch=2, seq=8)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # the first row left-padded by three
    kw = dict(attention_mask=mask, pad_token_id=0, return_dict_in_generate=True, output_logits=True, **NEW)
    want = fa.generate(model, adapter, ids, **kw)  # eager: the model's own forward
    stateful = copy.deepcopy(model)
    fa.init(stateful)
    stateful.add_new_adapter("a", adapter)
    stateful.set_active_adapter("a")
    torch._dynamo.reset()
    for got in (fa.generate(model, adapter, ids, **kw, **_static()), stateful.generate(ids, **kw, **_static())):
        assert torch.equal(got.sequences, want.sequences)
        for step, (a, b) in enumerate(zip(got.logits, want.logits)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"step {step}")


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_a_stack_with_ids_decodes_compiled_and_new_ids_compile_nothing(arch):
    make, targets = ARCHS[arch]
    model = make().eval().requires_grad_(False)
    ids = token_batch(batch=3, seq=8)
    stack = fa.stack([random_adapter(model, targets, r=r, seed=r) for r in (2, 4)])
    run = lambda row_ids, **kw: fa.generate(model, stack, ids, adapter_ids=torch.tensor(row_ids), **NEW, **kw)  # noqa: E731
    _, base = _fresh(lambda: model.generate(ids, **NEW, **_static()))
    mixed, compiled = _fresh(lambda: run([0, 1, -1], **_static()))
    assert compiled == base, f"(graphs, breaks), fastaf's against the base model's: {compiled}, {base}"
    assert torch.equal(mixed, run([0, 1, -1]))
    assert torch.equal(run([1, 1, 0], **_static()), run([1, 1, 0]))
    assert _compiled() == compiled, "new ids compiled a new graph"
    for i, alone in enumerate([*fa.unstack(stack), None]):  # each row as its adapter alone decodes it
        one = fa.generate(model, alone, ids[i:i + 1], **NEW) if alone is not None else model.generate(ids[i:i + 1], **NEW)
        assert torch.equal(mixed[i, :one.shape[1]], one[0])  # (a row that ended early is padded after)


def test_a_compiled_decode_reads_the_adapter_and_ids_from_static_tensors_kept_per_structure():
    """CUDA-graph replays copy every tensor input that is not static: the step reads static copies,
    refilled in place by the next call of the same structure (no new graph, no new recording)."""
    from fastaf import _generate

    model = tiny_llama().eval().requires_grad_(False)
    ids = token_batch(batch=2, seq=8)
    first, second = (random_adapter(model, ["q_proj", "v_proj"], r=4, seed=s) for s in (1, 2))
    stack = fa.stack([first, second])
    addresses = []
    for adapter, row_ids in ((first, None), (second, None), (stack, torch.tensor([1, -1])), (stack, torch.tensor([0, 1]))):
        want = fa.generate(model, adapter, ids, adapter_ids=row_ids, **NEW)
        assert torch.equal(fa.generate(model, adapter, ids, adapter_ids=row_ids, **NEW, **_static()), want)
        kept = _generate._STATIC[model]
        held = next(v for k, v in reversed(kept.items()) if k[0] == "adapter")
        assert len(held.buffers) == 1  # one dtype and device: one flat buffer, one graph input
        assert all(getattr(b, "_dynamo_static_input_type", None) is not None for b in held.buffers)
        for path, lora in adapter.items():  # the last call's values, in views of a buffer dynamo takes as static
            for mine, theirs in ((held.eager[path].A, lora.A), (held.eager[path].B, lora.B)):
                assert torch.equal(mine, theirs) and mine is not theirs and mine._base is held.buffers[0]
                assert (mine.data_ptr() - held.buffers[0].data_ptr()) % 128 == 0  # aligned as the buffer is
        addresses.append(held.eager["model.layers.0.self_attn.q_proj"].A.data_ptr())
        if row_ids is not None:
            static_ids = next(v for k, v in kept.items() if k[0] == "ids")
            assert torch.equal(static_ids, row_ids) and static_ids._dynamo_static_input_type is not None
    assert addresses[0] == addresses[1] and addresses[2] == addresses[3]  # refilled, not made anew
    assert len([k for k in _generate._STATIC[model] if k[0] == "adapter"]) == 2  # one per structure


def test_a_compiled_decode_keeps_static_shapes_when_the_adapter_structure_changes():
    """A step compiled for a second structure (a stack and ids after one adapter) must not fall to
    symbolic sizes (dynamo's automatic dynamic shapes): its pre-graph code would read every
    factor's sizes in Python at every decoding step."""
    model = tiny_llama().eval().requires_grad_(False)
    ids = token_batch(batch=2, seq=8)
    one = random_adapter(model, ["q_proj", "v_proj"], r=4, seed=1)
    stack = fa.stack([one, random_adapter(model, ["q_proj", "v_proj"], r=2, seed=2)])
    graphs: list = []
    static = _recording_static(graphs)
    torch._dynamo.reset()
    for adapter, row_ids in ((one, None), (stack, torch.tensor([1, 0])), (one, None)):
        want = fa.generate(model, adapter, ids, adapter_ids=row_ids, **NEW)
        assert torch.equal(fa.generate(model, adapter, ids, adapter_ids=row_ids, **NEW, **static), want)
    symbolic = [any(isinstance(i, torch.SymInt) for i in inputs) for inputs in graphs]
    assert symbolic and not any(symbolic), f"graphs with symbolic sizes: {symbolic}"


def test_a_compiled_decode_step_takes_the_adapter_as_one_input_per_buffer():
    """The step's graph reads the packed static copy (one flat buffer per dtype, the LoRAs views
    made inside the graph): it takes as many tensor inputs as the base model's step, plus at
    most that buffer, not two per adapted layer (each an input the host fetches and checks at
    every call)."""
    model = tiny_llama(layers=2).eval().requires_grad_(False)
    adapter = random_adapter(model, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                             r=4, seed=1)
    graphs: list = []
    static = _recording_static(graphs)
    ids = token_batch(batch=2, seq=8)
    torch._dynamo.reset()
    model.generate(ids, **NEW, **static)
    torch._dynamo.reset()
    want = fa.generate(model, adapter, ids, **NEW)
    assert torch.equal(fa.generate(model, adapter, ids, **NEW, **static), want)
    inputs = [len(g) for g in graphs]
    assert len(inputs) == 2 and inputs[1] <= inputs[0] + 1, f"graph inputs, base then adapted: {inputs}"


@contextlib.contextmanager
def _guard_log():
    """Yields a list that gets, after the block, dynamo's log of the guards of the graphs compiled
    in it (one line per guard; LAMBDA_GUARDs are the ones Python evaluates, the others run in C++)."""
    log, logger = io.StringIO(), logging.getLogger("torch._dynamo")
    handler = logging.StreamHandler(log)
    logger.addHandler(handler)
    torch._logging.set_logs(guards=True)
    logged: list = []
    try:
        yield logged
    finally:
        torch._logging.set_logs()
        logger.removeHandler(handler)
        logged.append(log.getvalue())


@contextlib.contextmanager
def _python_guards():
    """Yields a list that gets, after the block, how many guards of the graphs compiled in it
    Python evaluates at every call (dynamo's LAMBDA_GUARDs; the others run in C++)."""
    counted: list = []
    with _guard_log() as logged:
        yield counted
    counted.append(logged[0].count("LAMBDA_GUARD"))


def _guards(text: str) -> int:
    return len(re.findall(r"\+- [A-Z_]+[:(]", text))


def _decoder_of(layers: int, via: str):
    """``generate(ids, **kw)`` of a tiny Llama with an adapter on seven projections, through ``via``:
    ``fa.generate`` or the stateful layer's ``model.generate``."""
    model = tiny_llama(layers=layers).eval().requires_grad_(False)
    adapter = random_adapter(model, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                             r=4, seed=1)
    if via == "fa.generate":
        return lambda ids, **kw: fa.generate(model, adapter, ids, **kw)
    fa.init(model)
    model.add_new_adapter("a", adapter)
    model.set_active_adapter("a")
    return model.generate


@pytest.mark.parametrize("via", ["fa.generate", "stateful"])
def test_a_compiled_decode_step_has_no_python_guard_per_adapted_layer(via):
    """Dynamo guards an object reached two ways in a trace with an identity check Python
    evaluates at every call of the graph: fastaf's part of the step must add none per layer.
    ``fa.generate`` added four per layer (type checks on each module and on each cache layer's
    device, from the routes' resolution and the mode's scan of each op's arguments); the stateful
    layer two per adapted module, its registry bound into each module's pre-hook and hook (now
    reached through a key, ``_stateful._REGISTRIES``)."""
    counts = []
    for layers in (1, 2):
        run = _decoder_of(layers, via)
        torch._dynamo.reset()
        with _python_guards() as counted:
            run(token_batch(batch=2, seq=8), max_new_tokens=3, do_sample=False, **_static())
        counts.append(counted[0])
    assert counts[0] > 0 and counts[1] - counts[0] <= 1, f"Python guards with 1 and 2 layers: {counts}"


@pytest.mark.parametrize("via", ["fa.generate", "stateful"])
def test_a_compiled_decode_steps_guards_grow_per_layer_at_most_twice_as_fast_as_the_base_steps(via):
    """The guards run at every decoding step, in the host time the GPU waits on: fastaf's part
    (the routes' walk over the modules, the packed adapter's layout) may add to the base step's
    guards per layer, but not tens per adapted linear. It added ~40 per adapted linear for the
    layout (each path, offset, size and scale), read now as constants, and a guard per module
    that called ``nn.Module.__getattr__`` (which raises) for a name the module lacks. The
    stateful layer's hooks and decode forwards added ~14 per adapted linear (each hook's
    ``functools.partial``, its arguments, its always-called flag): its generate lifts them."""
    counts = {"base": [], "fastaf": []}
    for layers in (1, 2):
        model = tiny_llama(layers=layers).eval().requires_grad_(False)
        ids = token_batch(batch=2, seq=8)
        adapted = _decoder_of(layers, via)
        for name, run in (("base", lambda: model.generate(ids, max_new_tokens=3, do_sample=False, **_static())),
                          ("fastaf", lambda: adapted(ids, max_new_tokens=3, do_sample=False, **_static()))):
            torch._dynamo.reset()
            with _guard_log() as logged:
                run()
            counts[name].append((_guards(logged[0]), logged[0].count("NO_HASATTR")))
    (base1, _), (base2, _) = counts["base"]
    (ours1, hasattr1), (ours2, hasattr2) = counts["fastaf"]
    assert hasattr2 == hasattr1, f"guards calling hasattr, with 1 and 2 layers: {hasattr1}, {hasattr2}"
    assert ours2 - ours1 <= 2 * (base2 - base1), f"guards with 1 and 2 layers: {counts}"


# per layer, the A's each shrink launch reads: Llama's q/k/v with o_proj (the structure's guess),
# o_proj alone, gate/up, down_proj alone; GPT-2's c_attn with attn.c_proj, that c_proj alone,
# mlp.c_fc and mlp.c_proj (Conv1D layers, each alone)
SHRINKS = {"llama": ([4, 1, 2, 1], ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
           "gpt2": ([2, 1, 1, 1], ["c_attn", "c_proj", "c_fc"])}


@needs_interpreter
@pytest.mark.parametrize("arch", sorted(SHRINKS))
def test_compiled_decoding_reads_siblings_h_in_one_shrink_launch(arch, monkeypatch):
    """On CUDA a compiled decoding step adds each LoRA with the decode kernels; q/k/v (with o_proj,
    the structure's guess) and gate/up take their h from one shrink launch over their shared input,
    then one expand each. Here the kernels run interpreted on CPU where CUDA would run them."""
    from fastaf.kernels import lora_decode as kernels
    from fastaf.ops import lora_decode

    monkeypatch.setattr(lora_decode, "_use_kernel", lambda x, lora, impl: impl != "addmm" and x.shape[0] <= 64
                        and kernels.supported(x, lora.A, lora.B) and kernels.wins(x))
    shrinks, expands = [], []
    shrink, expand = kernels.shrink, kernels.expand
    monkeypatch.setattr(kernels, "shrink", lambda x, factors, *a, **k: shrinks.append(len(factors)) or shrink(x, factors, *a, **k))
    monkeypatch.setattr(kernels, "expand", lambda *a, **k: expands.append(1) or expand(*a, **k))
    per_layer, targets = SHRINKS[arch]
    model = ARCHS[arch][0]().eval().requires_grad_(False)
    ids = token_batch(batch=2, seq=8)
    adapter = random_adapter(model, targets, r=4, seed=1)
    new = dict(max_new_tokens=3, do_sample=False)
    want = fa.generate(model, adapter, ids, **new)
    torch._dynamo.reset()
    got = fa.generate(model, adapter, ids, **new, **_static())
    assert torch.equal(got, want)
    steps, layers = 2, model.config.num_hidden_layers  # the decode steps after the (eager) prefill
    assert sorted(shrinks) == sorted(per_layer * layers * steps), shrinks
    assert len(expands) == len(adapter) * steps  # one expand per adapted layer


@needs_interpreter
@pytest.mark.parametrize("arch", sorted(SHRINKS))
def test_compiled_decoding_runs_each_adapted_linear_in_one_launch(arch, monkeypatch):
    """On CUDA a compiled decoding step (16-bit, at most 64 rows) runs each adapted linear, its base
    GEMM and its LoRA, as one launch (``fastaf::lora_decode_linear``), through fa.generate and the
    stateful layer alike; no shrink launch is left. Here the kernel runs interpreted on CPU (in
    fp32, where CUDA takes it for 16-bit inputs only) where CUDA would run it."""
    from fastaf import _config
    from fastaf.intercept import use
    from fastaf.kernels import lora_decode as kernels
    from fastaf.ops import lora_decode

    def linear_decodes(x, weight, lora, impl):  # lora_decode.linear_decodes, less its CUDA check
        return (impl != "addmm" and _config.flags().decode_linear and x.shape[0] <= lora_decode.DECODE_ROWS
                and not lora.stacked and kernels.linear_supported(x, weight, lora.A, lora.B))

    monkeypatch.setattr(lora_decode, "linear_decodes", linear_decodes)
    monkeypatch.setattr(use, "linear_decodes", linear_decodes)
    monkeypatch.setattr(kernels, "linear_supported", lambda x, w, a, b: x.dim() == 2 and w.dtype == x.dtype)
    launches, shrinks = [], []
    linear, shrink = kernels.linear, kernels.shrink
    monkeypatch.setattr(kernels, "linear", lambda *a, **k: launches.append(1) or linear(*a, **k))
    monkeypatch.setattr(kernels, "shrink", lambda *a, **k: shrinks.append(1) or shrink(*a, **k))
    targets = SHRINKS[arch][1]
    model = ARCHS[arch][0]().eval().requires_grad_(False)
    ids = token_batch(batch=2, seq=8)
    adapter = random_adapter(model, targets, r=4, seed=1)
    new = dict(max_new_tokens=3, do_sample=False)
    want = fa.generate(model, adapter, ids, **new)
    inited = fa.init(copy.deepcopy(model))
    inited.add_new_adapter("a", adapter)
    inited.set_active_adapter("a")
    torch._dynamo.reset()
    for run in (lambda: fa.generate(model, adapter, ids, **new, **_static()),
                lambda: inited.generate(ids, **new, **_static())):
        launches.clear()
        assert torch.equal(run(), want)
        assert len(launches) == len(adapter) * 2  # the two decode steps after the (eager) prefill
    assert not shrinks
    launches.clear()
    with _config.override(decode_linear=False):  # the switch: cuBLAS's GEMM, then the LoRA
        torch._dynamo.reset()
        assert torch.equal(fa.generate(model, adapter, ids, **new, **_static()), want) and not launches


@needs_interpreter
@pytest.mark.parametrize("mode", ["never", "eager", "always"])
def test_decoding_with_ids_runs_each_adapted_linear_through_the_decode_kernels(monkeypatch, mode):
    """A CUDA decoding step with a stack and ids (16-bit, at most 64 rows) runs each adapted linear
    as cuBLAS's GEMM plus the shrink grouped by slot and the expand (``kernels.lora_decode.
    multi_add_``), or where ``decode_multi_linear`` says so (eager calls, or always) the shrink
    and the GEMM with each row's LoRA in its epilogue (``multi_linear``), eager and compiled: the
    tokens are the op path's, and each row's are its adapter's alone. Here the kernels run
    interpreted on CPU (in fp32, where CUDA takes them for 16-bit inputs only)."""
    from fastaf import _config
    from fastaf.intercept import use
    from fastaf.kernels import lora_decode as kernels
    from fastaf.ops import lora_decode

    def multi_decodes(x, weight, lora, impl):  # lora_decode.multi_decodes, less its CUDA check
        return (impl == "auto" and x.shape[0] <= lora_decode.DECODE_ROWS and lora.stacked
                and kernels.multi_supported(x, weight, lora.A, lora.B))

    model = tiny_llama().eval().requires_grad_(False)
    ids = token_batch(batch=3, seq=8)
    targets = ["q_proj", "v_proj", "down_proj"]
    adapters = [random_adapter(model, targets, r=r, seed=r) for r in (2, 4)]
    stack, row_ids = fa.stack(adapters), torch.tensor([1, -1, 0])
    want = fa.generate(model, stack, ids, adapter_ids=row_ids, **NEW)  # the op path
    monkeypatch.setattr(lora_decode, "multi_decodes", multi_decodes)
    monkeypatch.setattr(kernels, "multi_supported", lambda x, w, a, b: x.dim() == 2 and w.dtype == x.dtype)
    monkeypatch.setattr(use, "multi_decoding", lambda x, lora, impl, training: not torch.is_grad_enabled()
                        and not torch.compiler.is_compiling())
    launches = []
    for name in ("multi_linear", "multi_add_"):
        kernel = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, name=name, kernel=kernel, **k:
                            launches.append((name, a[1 if name == "multi_add_" else 0].shape[0])) or kernel(*a, **k))
    shared = kernels.multi_shrink_shared  # the siblings' grouped shrink (one stack's goes through it too)
    monkeypatch.setattr(kernels, "multi_shrink_shared", lambda x, stacks, *a, **k: (
        len(stacks) > 1 and launches.append(("shared shrink", len(stacks)))) or shared(x, stacks, *a, **k))
    eager = "multi_linear" if mode in ("eager", "always") else "multi_add_"
    # compiled, q_proj and v_proj (siblings) take h from one grouped shrink, then an expand each,
    # unless the GEMM runs in the LoRA's launch (always); down_proj alone
    traced = [("multi_linear", 3)] * 2 if mode == "always" else [("shared shrink", 2)]
    torch._dynamo.reset()
    layers = len(model.model.layers)
    for run, step in ((lambda: fa.generate(model, stack, ids, adapter_ids=row_ids, **NEW), [(eager, 3)] * 2),
                      (lambda: fa.generate(model, stack, ids, adapter_ids=row_ids, **NEW, **_static()), traced)):
        launches.clear()
        with _config.override(decode_multi_linear=mode):
            assert torch.equal(run(), want)
        # the prefill's 24 rows (eager in both), then each decoding step's 3
        down = "multi_linear" if step is not traced or mode == "always" else "multi_add_"
        down = eager if step is not traced else down
        assert launches == [(eager, 24)] * 3 * layers + (step + [(down, 3)]) * layers * (NEW["max_new_tokens"] - 1)
    for i, alone in enumerate([adapters[1], None, adapters[0]]):
        one = fa.generate(model, alone, ids[i:i + 1], **NEW) if alone is not None else model.generate(ids[i:i + 1], **NEW)
        assert torch.equal(want[i, :one.shape[1]], one[0])


def _one_layer_stateful():
    """(a 1-layer tiny Llama, a batch of ids, an adapter on q/v, a stateful copy with it active)."""
    base = tiny_llama(layers=1).eval().requires_grad_(False)
    ids = token_batch(batch=2, seq=8)
    adapter = random_adapter(base, ["q_proj", "v_proj"], r=4, seed=1)
    model = fa.init(copy.deepcopy(base))
    model.add_new_adapter("a", adapter)
    model.set_active_adapter("a")
    return base, ids, adapter, model


def test_the_stateful_layer_decodes_compiled_and_an_adapter_coming_back_finds_its_graph():
    """One graph for the adapters of one structure: switching the active adapter (a to b, b back
    to a) compiles none, and the first compiles what the base model's step does."""
    base = tiny_llama(layers=1).eval().requires_grad_(False)
    ids = token_batch(batch=2, seq=8)
    adapters = {n: random_adapter(base, ["q_proj", "v_proj"], r=4, seed=s) for n, s in (("a", 1), ("b", 2))}
    model = copy.deepcopy(base)
    fa.init(model)
    for name, adapter in adapters.items():
        model.add_new_adapter(name, adapter)
    _, plain = _fresh(lambda: base.generate(ids, **NEW, **_static()))
    model.set_active_adapter("a")
    got, compiled = _fresh(lambda: model.generate(ids, **NEW, **_static()))
    assert compiled == plain, f"(graphs, breaks), the stateful layer's against the base model's: {compiled}, {plain}"
    assert torch.equal(got, fa.generate(base, adapters["a"], ids, **NEW))
    for name in ("b", "a"):
        model.set_active_adapter(name)
        got = model.generate(ids, **NEW, **_static())
        assert torch.equal(got, fa.generate(base, adapters[name], ids, **NEW))
        assert _compiled() == compiled, f"activating {name!r} compiled a new graph"


def test_the_stateful_layers_compiled_decode_reads_the_factors_as_they_are_at_each_generate():
    """While the stateful layer's ``generate`` runs with a compiled decoding step, the step reads
    the active adapter packed (one flat buffer: the base step's graph inputs plus one); factors
    changed in place since (an optimizer step) are copied again at the next ``generate``, with no
    new graph; a compiled call outside ``generate`` reads the Parameters as they are."""
    base = tiny_llama(layers=1).eval().requires_grad_(False)
    ids = token_batch(batch=2, seq=8)
    model = fa.init(copy.deepcopy(base))
    assert inspect.signature(model.generate) == inspect.signature(base.generate)  # the class's, as callers read it
    model.add_new_adapter("a", random_adapter(base, ["q_proj", "v_proj", "down_proj"], r=4, seed=1))
    model.set_active_adapter("a")
    graphs: list = []
    static = _recording_static(graphs)
    torch._dynamo.reset()
    base.generate(ids, **NEW, **static)
    torch._dynamo.reset()
    for step in range(2):
        want = fa.generate(base, model.get_adapter("a"), ids, **NEW)
        assert torch.equal(model.generate(ids, **NEW, **static), want)
        with torch.no_grad():  # as an optimizer step would: in place
            for params in model.fastaf.adapters["a"].values():
                params.B.add_(0.05 * torch.randn_like(params.B))
    inputs = [len(g) for g in graphs]
    assert len(inputs) == 2 and inputs[1] <= inputs[0] + 1, f"graph inputs, base then stateful: {inputs}"
    with torch.no_grad():
        compiled = torch.compile(lambda x: model(x).logits, backend="eager")(ids)
        assert torch.allclose(compiled, fa.functional_call(base, model.get_adapter("a"), (ids,)).logits, atol=1e-5)


def _hook_dicts(model) -> dict:
    """Every module's hook dicts, as (path, dict name) -> [(hook id, hook)] in order."""
    return {(path, where): list(getattr(m, where).items()) for path, m in model.named_modules()
            for where in ("_forward_pre_hooks", "_forward_hooks", "_forward_hooks_always_called")
            if getattr(m, where)}


def test_the_stateful_generate_puts_every_hook_back_in_its_place_also_after_an_error():
    """A compiled decoding step runs with the stateful layer's hooks lifted (``hooks_lifted``):
    after the generate, and after one that raised, each hook is back in its place among the
    user's, so a user's hook registered after fastaf's still sees the adapted output, and the
    decode forwards are back on their layers."""
    base = tiny_llama(layers=1).eval().requires_grad_(False)
    ids = token_batch(batch=2, seq=8)
    adapter = random_adapter(base, ["q_proj", "v_proj"], r=4, seed=1)
    model = fa.init(copy.deepcopy(base))
    q_proj = model.model.layers[0].self_attn.q_proj
    seen = []
    q_proj.register_forward_pre_hook(lambda m, args: None)  # the user's, before fastaf's
    model.add_new_adapter("a", adapter)
    model.set_active_adapter("a")
    q_proj.register_forward_hook(lambda m, args, out: seen.append(out))  # after fastaf's
    before, forward = _hook_dicts(model), q_proj.__dict__.get("forward")
    assert forward is not None and sum(len(h) for h in before.values()) > 3
    want = fa.generate(base, adapter, ids, **NEW)
    torch._dynamo.reset()
    assert torch.equal(model.generate(ids, **NEW, **_static()), want)
    assert _hook_dicts(model) == before and q_proj.__dict__.get("forward") is forward

    def stop(*_):
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        model.generate(ids, **NEW, **_static(), stopping_criteria=[stop])
    assert _hook_dicts(model) == before and q_proj.__dict__.get("forward") is forward
    x = ids[:1, :4]
    seen.clear()
    want_seen = []
    hook = base.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, args, out: want_seen.append(out))
    with torch.no_grad():
        adapted = fa.functional_call(base, adapter, (x,)).logits
        assert torch.allclose(model(x).logits, adapted, atol=1e-5)
    hook.remove()
    assert torch.allclose(seen[0], want_seen[0], atol=1e-5)  # the user's hook sees the adapted output


def test_an_activation_during_a_stateful_compiled_generate_leaves_the_new_adapters_hooks_alone():
    """``set_active_adapter`` inside the generate (a logits processor): the generate goes on with
    the adapter it started with; after it, only the new adapter's hooks and forwards are on the
    model, and a call runs the new adapter."""
    base = tiny_llama(layers=1).eval().requires_grad_(False)
    ids = token_batch(batch=2, seq=8)
    a, b = random_adapter(base, ["q_proj", "v_proj"], r=4, seed=1), random_adapter(base, ["k_proj"], r=4, seed=2)
    model = fa.init(copy.deepcopy(base))
    model.add_new_adapter("a", a)
    model.add_new_adapter("b", b)
    model.set_active_adapter("a")

    def switch(input_ids, scores):
        if model.active_adapter == "a":
            model.set_active_adapter("b")
        return scores
    torch._dynamo.reset()
    model.generate(ids, **NEW, **_static(), logits_processor=[switch])
    attn = model.model.layers[0].self_attn
    assert not attn.q_proj._forward_pre_hooks and "forward" not in attn.q_proj.__dict__
    assert len(attn.k_proj._forward_pre_hooks) == 1 and len(model._forward_pre_hooks) == 1
    x = ids[:1, :4]
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, fa.functional_call(base, b, (x,)).logits)


def test_fa_generate_of_an_inited_model_without_an_adapter_applies_the_active_one_compiled():
    base, ids, adapter, model = _one_layer_stateful()
    want = fa.generate(base, adapter, ids, **NEW)
    torch._dynamo.reset()
    assert torch.equal(fa.generate(model, None, ids, **NEW), want)
    assert torch.equal(fa.generate(model, None, ids, **NEW, **_static()), want)


def test_a_model_with_gradient_checkpointing_on_decodes_compiled_in_eval_mode():
    """Checkpointing runs in training only: in eval a compiled decoding step adapts every layer
    (``fa.generate``'s decoded other tokens, silently)."""
    base = tiny_llama(layers=1).eval().requires_grad_(False)
    ids = token_batch(batch=2, seq=8)
    adapter = random_adapter(base, ["q_proj", "v_proj"], r=4, seed=1)
    want = fa.generate(base, adapter, ids, **NEW)
    checkpointed = copy.deepcopy(base)
    checkpointed.gradient_checkpointing_enable()
    checkpointed.eval()
    torch._dynamo.reset()
    assert torch.equal(fa.generate(checkpointed, adapter, ids, **NEW, **_static()), want)
    stateful = fa.init(copy.deepcopy(checkpointed))
    stateful.add_new_adapter("a", adapter)
    stateful.set_active_adapter("a")
    assert torch.equal(stateful.generate(ids, **NEW, **_static()), want)


def test_a_compiled_generate_of_a_model_checkpointing_in_training_is_refused_before_it_runs():
    """Checkpointing runs in training: a compiled decoding step would trace those layers apart
    from the adapter. Refused up front, the model left as it was, both entry points."""
    base, ids, adapter, model = _one_layer_stateful()
    plain = copy.deepcopy(base)
    for checkpointed, run in ((plain, lambda: fa.generate(plain, adapter, ids, **NEW, **_static())),
                              (model, lambda: model.generate(ids, **NEW, **_static()))):
        checkpointed.gradient_checkpointing_enable()
        checkpointed.train()
        with pytest.raises(NotImplementedError, match="gradient checkpointing on in training mode.*model.eval"):
            run()
        assert "forward" not in plain.__dict__ and model.fastaf.lifted is None
        checkpointed.eval()
        assert torch.equal(run(), fa.generate(base, adapter, ids, **NEW))


def test_a_second_threads_compiled_generate_on_the_same_stateful_model_is_refused():
    """Its compiled steps would trace the first one's adapted forward: refused, one at a time."""
    base, ids, adapter, model = _one_layer_stateful()
    errors = []

    def from_another_thread(input_ids, scores):
        if not errors:
            def second():
                try:
                    model.generate(ids, **NEW, **_static())
                except RuntimeError as error:
                    errors.append(error)
            thread = threading.Thread(target=second)
            thread.start()
            thread.join()
        return scores
    torch._dynamo.reset()
    got = model.generate(ids, **NEW, **_static(), logits_processor=[from_another_thread])
    assert errors and "another thread's generate with a compiled decoding step" in str(errors[0])
    assert torch.equal(got, fa.generate(base, adapter, ids, **NEW))


def test_a_stateful_model_refuses_a_copy_while_its_compiled_generate_runs():
    """Its hooks are lifted meanwhile: a copy would keep none. Refused, and the model runs on."""
    base, ids, adapter, model = _one_layer_stateful()
    caught = []

    def copy_it(input_ids, scores):
        if not caught:
            with pytest.raises(RuntimeError, match="cannot be copied or pickled while a generate") as error:
                copy.deepcopy(model)
            caught.append(error)
        return scores
    torch._dynamo.reset()
    got = model.generate(ids, **NEW, **_static(), logits_processor=[copy_it])
    assert caught and torch.equal(got, fa.generate(base, adapter, ids, **NEW))
    twin = copy.deepcopy(model)  # after it, as ever
    assert torch.equal(twin.generate(ids, **NEW), got)


def test_another_threads_call_of_the_model_during_a_stateful_compiled_generate_gets_the_adapter():
    """Meanwhile the hooks are lifted: another thread's call of the model applies the active
    adapter through the model's forward."""
    base, ids, adapter, model = _one_layer_stateful()
    x = ids[:1, :5]
    with torch.no_grad():
        want = fa.functional_call(base, adapter, (x,)).logits
    got = []

    def call_from_another_thread(input_ids, scores):
        if not got:
            assert model.fastaf.lifted is not None  # the generate runs with the hooks lifted
            thread = threading.Thread(target=lambda: got.append(model(x).logits))
            thread.start()
            thread.join()
        return scores
    torch._dynamo.reset()
    with torch.no_grad():
        model.generate(ids, **NEW, **_static(), logits_processor=[call_from_another_thread])
    assert len(got) == 1 and torch.allclose(got[0], want, atol=1e-5)


def test_a_stateful_model_that_decoded_compiled_copies_and_pickles(tmp_path):
    """A deep copy and a ``torch.load``-ed model of one that decoded compiled decode compiled
    after the original is gone, with the same tokens as before (their own hooks, their own
    static copy of the factors)."""
    base = tiny_llama(layers=1).eval().requires_grad_(False)
    ids = token_batch(batch=2, seq=8)
    model = fa.init(copy.deepcopy(base))
    model.add_new_adapter("a", random_adapter(base, ["q_proj", "v_proj"], r=4, seed=1))
    model.set_active_adapter("a")
    torch._dynamo.reset()
    want = model.generate(ids, **NEW, **_static())
    model.__dict__.pop("_compiled_call")  # transformers' compiled __call__ does not pickle (the base's neither)
    torch.save(model, tmp_path / "model.pt")
    twins = [copy.deepcopy(model), torch.load(tmp_path / "model.pt", weights_only=False)]
    del model
    gc.collect()
    for twin in twins:
        assert twin.fastaf.lifted is None
        assert torch.equal(twin.generate(ids, **NEW, **_static()), want)


def test_a_deep_copy_of_a_model_that_decoded_compiled_decodes_itself_compiled():
    """transformers keeps the compiled ``model.__call__`` on the instance, and a deep copy keeps the
    original's, bound to the original: the copy's compiled steps ran the original model (here the
    base, without the copy's adapter). ``fa.generate`` and the stateful layer drop it."""
    model = tiny_llama().eval().requires_grad_(False)
    ids = token_batch(batch=2, seq=8)
    adapter = random_adapter(model, ["q_proj", "v_proj", "down_proj"], r=4, seed=1)
    want = fa.generate(model, adapter, ids, **NEW)
    torch._dynamo.reset()
    plain = model.generate(ids, **NEW, **_static())  # leaves model._compiled_call
    assert not torch.equal(plain, want)
    assert torch.equal(fa.generate(copy.deepcopy(model), adapter, ids, **NEW, **_static()), want)
    stateful = fa.init(copy.deepcopy(model))
    stateful.add_new_adapter("a", adapter)
    stateful.set_active_adapter("a")
    assert torch.equal(stateful.generate(ids, **NEW, **_static()), want)


def test_an_encoder_decoder_decodes_compiled_with_its_encoder_adapted():
    """generate runs BART's encoder outside the model's forward, then compiles the decoding step
    (``min_new_tokens``: a tiny BART's first token is its EOS, and a generate that stops at the
    prefill compiles nothing). Through fa.generate (one adapter, then a stack with ids) and the
    stateful layer: the tokens and logits are the dynamic path's and PEFT's, fastaf compiles what
    the base model's step does, and new values or ids compile nothing."""
    model = tiny_bart().eval().requires_grad_(False)
    ids = token_batch(batch=2, seq=8)
    targets = ["q_proj", "v_proj", "fc1"]
    first, second = (random_adapter(model, targets, r=4, seed=s) for s in (1, 2))
    kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, num_beams=1, return_dict_in_generate=True,
              output_logits=True)

    def same(got, want):
        assert torch.equal(got.sequences, want.sequences)
        for g, w in zip(got.logits, want.logits, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    plain, base = _fresh(lambda: model.generate(ids, **kw, **_static()))
    assert base[0] >= 1, "the base model's decoding step compiled nothing"
    want = fa.generate(model, first, ids, **kw)
    got, compiled = _fresh(lambda: fa.generate(model, first, ids, **kw, **_static()))
    assert compiled == base, f"(graphs, breaks), fastaf's against the base model's: {compiled}, {base}"
    same(got, want)
    for w, b in zip(want.logits, plain.logits):
        assert (w - b).abs().max() > 1e-3  # the adapter, encoder included, changes every step
    peft_model = peft_model_with(copy.deepcopy(model), {"default": first}, targets, {"default": (4, 8.0)}).eval()
    same(got, peft_model.generate(input_ids=ids, **kw))
    again = fa.generate(model, second, ids, **kw, **_static())
    same(again, fa.generate(model, second, ids, **kw))
    assert _compiled() == compiled, "new adapter values compiled a new graph"
    assert "forward" not in model.__dict__ and "forward" not in model.get_encoder().__dict__
    stack = fa.stack([first, second])
    mixed = fa.generate(model, stack, ids, adapter_ids=torch.tensor([1, -1]), **kw, **_static())
    same(mixed, fa.generate(model, stack, ids, adapter_ids=torch.tensor([1, -1]), **kw))
    # each row its adapter's alone (rows decode apart: no padding)
    assert torch.equal(mixed.sequences, torch.stack([again.sequences[0], plain.sequences[1]]))
    graphs, breaks = _compiled()
    assert breaks == base[1], breaks
    swapped = fa.generate(model, stack, ids, adapter_ids=torch.tensor([0, 1]), **kw, **_static())
    assert torch.equal(swapped.sequences, torch.stack([got.sequences[0], again.sequences[1]]))
    assert _compiled() == (graphs, breaks), "new ids compiled a new graph"
    stateful = fa.init(copy.deepcopy(model))  # the stateful layer's generate: its encoder adapted too
    stateful.add_new_adapter("a", first)
    stateful.set_active_adapter("a")
    out, compiled = _fresh(lambda: stateful.generate(ids, **kw, **_static()))
    assert compiled == base, f"(graphs, breaks), the stateful layer's against the base model's: {compiled}, {base}"
    same(out, want)


def test_a_vision_language_model_decodes_compiled_with_its_vision_tower_adapted():
    """transformers 5.24 runs LLaVA's vision tower and projector before the decoding loop, outside
    the model's forward (``get_image_features``): under a compiled decode step their LoRA was
    dropped without a word, every step the base model's."""
    from tests._models import ARCHS as MODEL_ARCHS

    make, targets, inputs = MODEL_ARCHS["llava"]
    model = make().eval().requires_grad_(False)
    adapter = random_adapter(model, targets, r=4, alpha=8.0)
    vision = fa.Adapter({p: l for p, l in adapter.items() if "language_model" not in p})
    batch = {k: v for k, v in inputs().items() if k != "labels"}
    kw = dict(max_new_tokens=3, do_sample=False, num_beams=1, return_dict_in_generate=True, output_logits=True,
              pad_token_id=0)
    base = model.generate(**batch, **kw)
    stateful = fa.init(copy.deepcopy(model))
    stateful.add_new_adapter("a", vision)
    stateful.set_active_adapter("a")
    for each in (vision, adapter):
        want = fa.generate(model, each, **batch, **kw)
        runs = [fa.generate(model, each, **batch, **kw, **_static())]
        if each is vision:
            runs.append(stateful.generate(**batch, **kw, **_static()))
        for got in runs:
            for w, g, b in zip(want.logits, got.logits, base.logits):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
                assert (w - b).abs().max() > 1e-3  # the vision tower's LoRA changes every step
    assert not any(name in model.model.__dict__ for name in ("get_image_features", "forward"))


def test_a_graph_compiled_for_another_instance_never_serves_an_adapted_model():
    """Dynamo does not guard module hooks: a decode step compiled for the plain model of the same
    class ran the stateful model without its adapter, silently. Both orders, both entry points."""
    base = tiny_llama().eval().requires_grad_(False)
    ids = token_batch(batch=2, seq=8)
    adapter = random_adapter(base, ["q_proj", "v_proj"], r=4, seed=1)
    want, plain = fa.generate(base, adapter, ids, **NEW), base.generate(ids, **NEW)
    inited = copy.deepcopy(base)
    fa.init(inited)
    inited.add_new_adapter("a", adapter)
    inited.set_active_adapter("a")
    torch._dynamo.reset()
    assert torch.equal(base.generate(ids, **NEW, **_static()), plain)  # the class compiled without hooks
    assert torch.equal(inited.generate(ids, **NEW, **_static()), want)
    assert torch.equal(fa.generate(base, adapter, ids, **NEW, **_static()), want)
    assert torch.equal(base.generate(ids, **NEW, **_static()), plain)
    inited.set_active_adapter(None)
    assert torch.equal(inited.generate(ids, **NEW, **_static()), plain)


def test_a_model_whose_forward_the_user_compiled_is_adapted_by_every_entry_point():
    """``model.forward = torch.compile(model.forward)``: the weights must not carry the adapter
    into the trace (dynamo failed on the tensor subclass); the mode is traced instead. aot_eager,
    as Inductor, runs the graph as aten ops, which no rule takes again at run time."""
    base = tiny_llama().eval().requires_grad_(False)
    ids = token_batch(batch=2, seq=8)
    adapter = random_adapter(base, ["q_proj", "v_proj"], r=4, seed=1)
    want_tokens = fa.generate(base, adapter, ids, **NEW)
    want_logits = fa.functional_call(base, adapter, (ids,)).logits
    torch._dynamo.reset()
    compiled = copy.deepcopy(base)
    compiled.forward = torch.compile(compiled.forward, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(fa.functional_call(compiled, adapter, (ids,)).logits, want_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(fa.generate(compiled, adapter, ids, **NEW), want_tokens)
    inited = copy.deepcopy(base)
    fa.init(inited)
    inited.add_new_adapter("a", adapter)
    inited.set_active_adapter("a")
    inited.forward = torch.compile(inited.forward, backend="aot_eager")
    assert torch.equal(inited.generate(ids, **NEW), want_tokens)
    # a compiled decoding step too: its eager prefill runs the user's compiled forward (dynamo
    # failed on weights that carried the adapter into it)
    assert torch.equal(fa.generate(compiled, adapter, ids, **NEW, **_static()), want_tokens)
    assert torch.equal(inited.generate(ids, **NEW, **_static()), want_tokens)


def test_a_compiled_generate_keeps_nothing_that_holds_the_model():
    import gc
    import weakref

    model = tiny_llama().eval().requires_grad_(False)
    ids = token_batch(batch=2, seq=8)
    fa.generate(model, random_adapter(model, ["q_proj", "v_proj"], r=4, seed=1), ids, max_new_tokens=2,
                do_sample=False, **_static())
    alive = weakref.ref(model)
    del model
    torch._dynamo.reset()
    gc.collect()
    assert alive() is None


def test_a_half_precision_model_decodes_with_its_fp32_factors_cast_once_and_the_same_tokens():
    """fp32 master factors over a bf16 model: the ops cast them to the input's dtype at each call;
    generate casts them once, to the same values, dynamic and compiled."""
    from fastaf import _generate

    model = tiny_llama().to(torch.bfloat16).eval().requires_grad_(False)
    ids = token_batch(batch=2, seq=8)
    adapter = random_adapter(model, ["q_proj", "v_proj", "down_proj"], r=4, seed=3)
    adapter = fa.Adapter({p: fa.LoRA(l.A.float(), l.B.float() + 0.05, l.scale) for p, l in adapter.items()})
    cast = _generate.in_compute_dtype(model, adapter)
    assert {l.A.dtype for l in cast.values()} == {l.B.dtype for l in cast.values()} == {torch.bfloat16}
    want = fa.functional_call(model, adapter, (ids,)).logits  # the ops' own casts, per call
    assert torch.equal(fa.functional_call(model, cast, (ids,)).logits, want)
    tokens = fa.generate(model, adapter, ids, **NEW)
    assert not torch.equal(tokens, model.generate(ids, **NEW))
    assert torch.equal(fa.generate(model, adapter, ids, **NEW, **_static()), tokens)
    held = next(v for k, v in _generate._STATIC[model].items() if k[0] == "adapter")
    assert held.eager["model.layers.0.self_attn.q_proj"].A.dtype == torch.bfloat16
    stateful = fa.init(copy.deepcopy(model))  # its fp32 masters, packed as bf16 for the compiled steps
    stateful.add_new_adapter("a", adapter)
    stateful.set_active_adapter("a")
    assert torch.equal(stateful.generate(ids, **NEW, **_static()), tokens)
    held = next(v for k, v in _generate._STATIC[stateful].items() if k[0] == "adapter")
    assert [b.dtype for b in held.buffers] == [torch.bfloat16]


def test_eager_decoding_steps_take_the_decode_path_with_the_same_tokens(monkeypatch):
    """The decode path is CUDA's (there it saves host time); here it runs on CPU to be checked:
    prefill (16 rows) and each step (2 rows) take it, the tokens are the op path's and PEFT's."""
    import importlib

    from fastaf.intercept import use

    D = importlib.import_module("fastaf.ops.lora_decode")
    model = tiny_llama().eval().requires_grad_(False)
    ids = token_batch(batch=2, seq=8)
    targets = ["q_proj", "v_proj", "down_proj"]
    adapter = random_adapter(model, targets, r=4, seed=5)
    want = fa.generate(model, adapter, ids, **NEW)
    taken = []

    def decode(x, weight, bias, lora, where):
        taken.append(x.numel() // x.shape[-1])
        return D.lora_linear_decode(x, weight, bias, lora, where)

    monkeypatch.setattr(use, "decoding", lambda x, lora, impl, training: not torch.is_grad_enabled())
    monkeypatch.setattr(use, "lora_linear_decode", decode)
    got = fa.generate(model, adapter, ids, **NEW)
    layers = model.config.num_hidden_layers * len(targets)
    assert sorted(set(taken)) == [2, 16] and len(taken) == layers * NEW["max_new_tokens"]
    assert torch.equal(got, want)
    peft_model = peft_model_with(copy.deepcopy(model), {"default": adapter}, targets, {"default": (4, 8.0)}).eval()
    assert torch.equal(peft_model.generate(input_ids=ids, **NEW), got)


@needs_interpreter
def test_eager_decoding_steps_with_ids_take_the_grouped_kernels_with_the_same_tokens(monkeypatch):
    """With a stack and adapter_ids a decoding step (CUDA's, here on CPU through the interpreter)
    runs cuBLAS's GEMM and the grouped kernels' shrink and expand alone: the tokens are the op
    path's, and each row's are its adapter's alone."""
    import importlib

    from fastaf.intercept import use

    D = importlib.import_module("fastaf.ops.lora_decode")
    model = tiny_llama().eval().requires_grad_(False)
    ids = token_batch(batch=3, seq=8)
    adapters = [random_adapter(model, ["q_proj", "v_proj", "down_proj"], r=r, seed=r) for r in (2, 4)]
    stack, row_ids = fa.stack(adapters), torch.tensor([1, -1, 0])
    want = fa.generate(model, stack, ids, adapter_ids=row_ids, **NEW)
    taken = []
    monkeypatch.setattr(use, "multi_decoding", lambda x, lora, impl, training: not torch.is_grad_enabled())
    monkeypatch.setattr(use, "lora_multi_decode", lambda x, *a: taken.append(x.numel() // x.shape[-1]) or
                        D.lora_multi_decode(x, *a))
    got = fa.generate(model, stack, ids, adapter_ids=row_ids, **NEW)
    assert sorted(set(taken)) == [3, 24] and torch.equal(got, want)
    for i, alone in enumerate([adapters[1], None, adapters[0]]):
        one = fa.generate(model, alone, ids[i:i + 1], **NEW) if alone is not None else model.generate(ids[i:i + 1], **NEW)
        assert torch.equal(got[i, :one.shape[1]], one[0])


@pytest.mark.gpu
def test_cuda_decoding_steps_take_the_decode_path_and_match_the_op_path(monkeypatch):
    """On CUDA every step after the prefill (2 rows) takes the decode path, functional and
    stateful; its logits match the op's path (fp32, cuBLAS without TF32 on both)."""
    import importlib

    from fastaf.intercept import use

    D = importlib.import_module("fastaf.ops.lora_decode")
    model = tiny_llama().cuda().eval().requires_grad_(False)
    ids = token_batch(batch=2, seq=520).cuda()  # a prefill of 1040 rows: above the lean path's 1024
    targets = ["q_proj", "v_proj", "down_proj"]
    adapter = fa.Adapter({p: fa.LoRA(l.A.cuda(), l.B.cuda(), l.scale)
                          for p, l in random_adapter(model, targets, r=4, seed=7).items()})
    kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True)
    rows = []
    monkeypatch.setattr(use, "lora_linear_decode", lambda x, *a: rows.append(x.numel() // x.shape[-1]) or
                        D.lora_linear_decode(x, *a))
    fast = fa.generate(model, adapter, ids, **kw)
    assert sorted(set(rows)) == [2] and len(rows) == 2 * len(targets) * 3
    monkeypatch.setattr(use, "decoding", lambda *a: False)
    slow = fa.generate(model, adapter, ids, **kw)
    assert torch.equal(fast.sequences, slow.sequences)
    for a, b in zip(fast.logits, slow.logits):
        assert (a - b).abs().max() <= 1e-4 * b.abs().max()
    inited = fa.init(copy.deepcopy(model))
    inited.add_new_adapter("a", adapter)
    inited.set_active_adapter("a")
    stateful = inited.generate(ids, **kw)
    assert torch.equal(stateful.sequences, slow.sequences)
    for a, b in zip(stateful.logits, slow.logits):
        assert (a - b).abs().max() <= 1e-4 * b.abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_half_precision_decoding_runs_one_launch_per_adapted_linear():
    """A bf16 model's decoding steps on CUDA run each adapted linear as one launch (the base GEMM and
    the LoRA), eagerly and compiled, through fa.generate and the stateful layer: each step's logits
    against the fp32 model's through functional_call, on the tokens chosen."""
    from fastaf.kernels import lora_decode as kernels

    model = tiny_llama().cuda().to(torch.bfloat16).eval().requires_grad_(False)
    model32 = copy.deepcopy(model).float()
    ids = token_batch(batch=2, seq=8).cuda()
    targets = ["q_proj", "v_proj", "down_proj"]
    adapter = fa.Adapter({p: fa.LoRA(l.A.cuda(), l.B.cuda() + 0.05, l.scale)
                          for p, l in random_adapter(model32, targets, r=4, seed=7).items()})
    inited = fa.init(copy.deepcopy(model))
    inited.add_new_adapter("a", adapter)
    inited.set_active_adapter("a")
    kw = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False, return_dict_in_generate=True, output_logits=True)
    for run in (lambda **k: fa.generate(model, adapter, ids, **kw, **k), lambda **k: inited.generate(ids, **kw, **k)):
        for static in ({}, {"cache_implementation": "static"}):
            launched = kernels.LINEAR.hits
            out = run(**static)
            for step in (1, 2):  # the decoding steps, after the prefill
                seq = out.sequences[:, :ids.shape[1] + step]
                with torch.no_grad():
                    want = fa.functional_call(model32, adapter, (seq,)).logits[:, -1]
                got = out.logits[step].float()
                assert (got - want).abs().max() <= 0.05 * want.abs().max()
            if not static:  # (compiled, the launches replay from a CUDA graph, past Python)
                assert kernels.LINEAR.hits > launched
