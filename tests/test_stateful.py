"""The stateful layer (``fastaf.init`` and the ``model.add_new_adapter`` family) on tiny HF models."""
import copy
import functools
import inspect
import json
import re
import threading
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import Trainer, TrainingArguments

import fastaf as fa
import fastaf.io.hub
import fastaf._stateful
from fastaf.io import files as _io
from fastaf.intercept import groups as _group
from tests._models import ARCHS, VOCAB, random_adapter, tiny_bart, tiny_gpt2, tiny_llama, tiny_mixtral, token_batch
from tests._peft import peft_model_with
from tests._tolerances import rel_err
from tests._modes import needs_interpreter

TARGETS = {"llama": ["q_proj", "v_proj"], "gpt2": ["c_attn"]}
MAKERS = {"llama": tiny_llama, "gpt2": tiny_gpt2}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny matmuls on a busy 2-core box: 6 ms each with 2 OpenMP threads, 0.09 ms with one.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def inited(kind: str = "llama", active: str | None = "b"):
    """(base copy, inited model holding "a" (fresh, B = 0) and "b" (random B), ``active`` set)."""
    model = MAKERS[kind]()
    base = copy.deepcopy(model)
    fa.init(model)
    model.add_new_adapter("a", fa.LoRAConfig(r=4, alpha=8, targets=TARGETS[kind]), seed=0)
    model.add_new_adapter("b", random_adapter(base, TARGETS[kind], r=4, seed=1))
    model.set_active_adapter(active)
    return base, model


def assert_adapters_equal(x: fa.Adapter, y: fa.Adapter) -> None:
    assert list(x) == list(y)
    for path in x:
        assert torch.equal(x[path].A, y[path].A) and torch.equal(x[path].B, y[path].B), path
        assert (x[path].scale, x[path].dropout) == (y[path].scale, y[path].dropout), path


def trainable(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


# ---- init and the registry ----------------------------------------------------------------------


def test_init_freezes_base_and_is_idempotent():
    model = tiny_llama()
    n_params = len(list(model.parameters()))
    assert fa.init(model) is model
    registry, forward = model.fastaf, model.forward
    assert trainable(model) == set() and model.active_adapter is None
    model.add_new_adapter("a", fa.LoRAConfig(r=2, alpha=4, targets=["q_proj"]))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fa.init(model)  # a no-op: same registry, forward, adapters and values
    assert model.fastaf is registry and model.forward == forward and list(registry.adapters) == ["a"]
    assert len(list(model.parameters())) == n_params + 2 * 2  # A and B on both layers' q_proj
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_active_adapter_alone_is_trainable_and_removal_deactivates():
    _, model = inited(active="a")
    assert trainable(model) == {n for n, _ in model.named_parameters() if n.startswith("fastaf.adapters.a.")}
    model.set_active_adapter("b")
    assert trainable(model) == {n for n, _ in model.named_parameters() if n.startswith("fastaf.adapters.b.")}
    assert all(n.endswith((".A", ".B")) for n in trainable(model))
    model.remove_adapter("b")
    assert model.active_adapter is None and trainable(model) == set()
    assert list(model.fastaf.adapters) == ["a"]
    assert not any(n.startswith("fastaf.adapters.b.") for n, _ in model.named_parameters())


def test_get_adapter_is_a_detached_copy():
    base, model = inited()
    ad = model.get_adapter("b")
    path = "model.layers.0.self_attn.q_proj"
    assert ad[path].A.shape == (4, 32) and ad[path].A.dtype == torch.float32 and ad[path].scale == 2.0
    assert not ad[path].A.requires_grad
    with torch.no_grad():
        model.fastaf.adapters["b"][path.replace(".", "__")].B.add_(1.0)
    assert not torch.equal(model.get_adapter("b")[path].B, ad[path].B)  # the value did not move
    fresh = fa.init_adapter(base, fa.LoRAConfig(r=4, alpha=8, targets=["q_proj", "v_proj"]), seed=0)
    assert_adapters_equal(model.get_adapter("a"), fresh)  # same init as init_adapter


# ---- forward and generate -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_forward_equals_functional_call_and_none_gives_base(kind):
    base, model = inited(kind)
    ids = token_batch()
    with torch.no_grad():
        adapted = model(ids).logits
        expected = fa.functional_call(base, model.get_adapter("b"), (ids,)).logits
        assert torch.equal(adapted, expected)
        assert not torch.allclose(adapted, base(ids).logits)
        model.set_active_adapter(None)
        assert torch.equal(model(ids).logits, base(ids).logits)
    assert torch._C._len_torch_function_stack() == 0


def test_generate_uses_the_active_adapter():
    base, model = inited()
    model.remove_adapter("b")
    model.add_new_adapter("b", 20.0 * random_adapter(base, TARGETS["llama"], seed=1))  # far from base
    model.set_active_adapter("b")
    ids = token_batch(batch=1, seq=6)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        adapted = model.generate(ids, **kw)
        # Greedy decoding by hand through functional_call: the same tokens.
        seq = ids
        for _ in range(8):
            logits = fa.functional_call(base, model.get_adapter("b"), (seq,)).logits
            seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        assert torch.equal(adapted, seq)
        assert not torch.equal(adapted, base.generate(ids, **kw))
        model.set_active_adapter(None)
        assert torch.equal(model.generate(ids, **kw), base.generate(ids, **kw))


def test_generate_adapts_the_encoder_of_an_encoder_decoder_like_peft():
    """generate runs BART's encoder outside model.forward; its LoRA must still apply."""
    import peft

    base = tiny_bart()
    targets = ["q_proj", "v_proj", "fc1"]
    adapter = 20.0 * random_adapter(base, targets, r=4, alpha=8.0, seed=3)
    encoder_paths = [p for p in adapter if p.startswith("model.encoder.")]
    assert encoder_paths
    model = fa.init(copy.deepcopy(base))
    model.add_new_adapter("a", adapter)
    model.set_active_adapter("a")
    pm = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=4, lora_alpha=8.0, target_modules=targets))
    for path, lora in adapter.items():
        layer = pm.base_model.model.get_submodule(path)
        with torch.no_grad():
            layer.lora_A["default"].weight.copy_(lora.A)
            layer.lora_B["default"].weight.copy_(lora.B * 20.0)  # the scale folded into B
    ids = token_batch(batch=2, seq=7)
    kw = dict(max_new_tokens=6, do_sample=False, num_beams=1, return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        ours, ref = model.generate(ids, **kw), pm.generate(input_ids=ids, **kw)
        enc = model.get_encoder()(ids).last_hidden_state  # the encoder called on its own
        enc_ref = pm.base_model.model.get_encoder()(ids).last_hidden_state
    assert torch.equal(ours.sequences, ref.sequences)
    for a, b in zip(ours.logits, ref.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(enc, enc_ref, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(enc, base.get_encoder()(ids).last_hidden_state)


@pytest.mark.parametrize("name", ["t5", "whisper", "llava", "mixtral", "qwen3_moe"])
def test_generate_logits_match_peft(name):
    """generate runs T5's and Whisper's encoders and LLaVA's vision tower and projector outside
    the decoding steps; the stateful layer (and fastaf.generate) must adapt them as PEFT does."""
    make, targets, inputs = ARCHS[name]
    base = make()
    adapter = random_adapter(base, targets, r=4, alpha=8.0)
    batch = {k: v for k, v in inputs().items() if k != "labels"}
    model = fa.init(copy.deepcopy(base))
    model.add_new_adapter("a", adapter)
    model.set_active_adapter("a")
    pm = peft_model_with(base, {"default": adapter}, targets, {"default": (4, 8.0)}).eval()
    kw = dict(max_new_tokens=4, do_sample=False, num_beams=1, return_dict_in_generate=True, output_logits=True,
              pad_token_id=0)
    with torch.no_grad():
        ours, ref, plain = model.generate(**batch, **kw), pm.generate(**batch, **kw), base.generate(**batch, **kw)
        functional = fa.generate(base, adapter, **batch, **kw)  # Whisper: input_features, no input_ids
    assert torch.equal(ours.sequences, ref.sequences) and torch.equal(functional.sequences, ref.sequences)
    for step, (a, f, b, p) in enumerate(zip(ours.logits, functional.logits, ref.logits, plain.logits)):
        assert rel_err(a, b) < 1e-5 and rel_err(f, b) < 1e-5, step
        assert rel_err(p, b) > 1e-2, step  # the adapter changes every step


def test_a_submodule_called_alone_uses_the_active_adapter():
    base, model = inited()
    path = "model.layers.1.self_attn.q_proj"
    lora = model.get_adapter("b")[path]
    x = torch.randn(3, 32)
    with torch.no_grad():
        got = model.get_submodule(path)(x)
        want = torch.nn.functional.linear(x, base.get_submodule(path).weight) + lora.scale * (x @ lora.A.T) @ lora.B.T
        torch.testing.assert_close(got, want)
        model.set_active_adapter(None)  # the hooks go with the adapter
        assert torch.equal(model.get_submodule(path)(x), base.get_submodule(path)(x))
    assert all(not m._forward_pre_hooks for m in model.modules())


def test_compiled_model_keeps_the_active_adapter():
    base, model = inited()
    ids = token_batch()
    compiled = torch.compile(model, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids).logits, model(ids).logits)
        assert not torch.allclose(compiled(ids).logits, base(ids).logits)


def test_forward_keeps_the_signature_and_a_raising_call_leaves_no_mode():
    import inspect

    base, model = inited()
    assert inspect.signature(model.forward) == inspect.signature(base.forward)
    with pytest.raises(IndexError):
        model(torch.full((1, 4), VOCAB + 5))  # out of range for the embedding
    assert torch._C._len_torch_function_stack() == 0
    ids = token_batch()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, fa.functional_call(base, model.get_adapter("b"), (ids,)).logits)


def test_functional_call_on_an_inited_model():
    base, model = inited()
    ids = token_batch()
    other = random_adapter(base, ["k_proj"], seed=5)
    with torch.no_grad():
        # An explicit adapter stands in for the active one, as params stand in for the model's own.
        assert torch.equal(
            fa.functional_call(model, other, (ids,)).logits, fa.functional_call(base, other, (ids,)).logits
        )
        assert torch.equal(fa.functional_call(model, None, (ids,)).logits, model(ids).logits)
        model.set_active_adapter(None)
        assert torch.equal(
            fa.functional_call(model, other, (ids,)).logits, fa.functional_call(base, other, (ids,)).logits
        )


def test_deepcopy_is_independent():
    _, model = inited()
    twin = copy.deepcopy(model)
    assert twin.forward.__self__ is twin and twin.get_adapter.__self__ is twin
    ids = token_batch()
    with torch.no_grad():  # the copy's placement checks hold (its modules, not the original's)
        assert torch.equal(twin(ids).logits, model(ids).logits)
        twin.model.layers[0].self_attn.v_proj = torch.nn.Linear(32, 32, bias=False)
        with pytest.raises(RuntimeError, match=r"model.layers.0.self_attn.v_proj is another Linear now"):
            twin(ids)
    twin = copy.deepcopy(model)
    twin.set_active_adapter(None)
    assert model.active_adapter == "b"
    with torch.no_grad():
        assert not torch.equal(twin(ids).logits, model(ids).logits)


def test_whole_model_saves_and_loads_with_torch_save(tmp_path):
    """torch.save of the model object itself: the loaded copy works (the bound methods must not
    pickle as getattr of private function names)."""
    _, model = inited()
    torch.save(model, tmp_path / "model.pt")
    twin = torch.load(tmp_path / "model.pt", weights_only=False)
    assert twin.get_adapter.__self__ is twin and twin.active_adapter == "b"
    assert list(inspect.signature(twin.add_new_adapter).parameters)[:2] == ["name", "config"]  # as bound
    ids = token_batch()
    with torch.no_grad():
        assert torch.equal(twin(ids).logits, model(ids).logits)
        twin.set_active_adapter(None)
        assert model.active_adapter == "b" and not torch.equal(twin(ids).logits, model(ids).logits)


def _hook_keys(model) -> set[str]:
    """The registry keys the model's module hooks hold (``_stateful._enter_module`` / ``_leave_module``)."""
    hooks = [h for m in model.modules() for d in (m._forward_pre_hooks, m._forward_hooks) for h in d.values()]
    return {h.args[0] for h in hooks if isinstance(h, functools.partial)
            and h.func in (fastaf._stateful._enter_module, fastaf._stateful._leave_module)}


def test_a_copys_hooks_reach_the_copys_registry(tmp_path):
    """Module hooks hold their registry's key, not the registry (traced, a registry bound into each
    hook was an identity check per hook evaluated in Python at every call): a deep copy, and a
    model torch.load-ed beside the one it was saved from, get keys of their own, in their hooks
    too, so the copy's factors changed in place change the copy's output alone."""
    _, model = inited()
    ids = token_batch()
    path = tmp_path / "model.pt"
    torch.save(model, path)
    for twin in (copy.deepcopy(model), torch.load(path, weights_only=False)):
        assert _hook_keys(twin) == {twin.fastaf.key} and _hook_keys(model) == {model.fastaf.key} != {twin.fastaf.key}
        with torch.no_grad():
            want = model(ids).logits
            for p in twin.fastaf.adapters["b"].parameters():
                p.mul_(3.0)
            assert torch.equal(model(ids).logits, want) and not torch.equal(twin(ids).logits, want)


def test_a_copy_whose_hooks_were_not_keyed_while_copied_is_keyed_at_its_first_call():
    """Where a copy's module was not complete when its registry was copied (a targeted model
    still being copied), its hooks keep the original's key until the copy's first call, whose
    first pre-hook keys them, before any entry hook reads one."""
    _, model = inited()
    twin = copy.deepcopy(model)
    registry = twin.fastaf
    for module, hook_id in registry.entered.values():  # as such a copy has them
        hook = module._forward_pre_hooks[hook_id]
        module._forward_pre_hooks[hook_id] = functools.partial(hook.func, model.fastaf.key, *hook.args[1:])
    registry.unkeyed = True
    ids = token_batch()
    with torch.no_grad():
        for p in registry.adapters["b"].parameters():
            p.mul_(3.0)
        got = twin(ids).logits
        assert not registry.unkeyed and _hook_keys(twin) == {registry.key}
        assert not torch.equal(got, model(ids).logits)
        assert torch.equal(got, fa.functional_call(model, twin.get_adapter("b"), (ids,)).logits)


# ---- training through HF Trainer ----------------------------------------------------------------


def test_trainer_trains_only_the_active_adapter(tmp_path):
    _, model = inited(active=None)  # "a" (B = 0) and "b" stay inactive
    model.add_new_adapter("t", fa.LoRAConfig(r=8, alpha=16, targets="all-linear"), seed=0)
    model.set_active_adapter("t")
    rows = token_batch(batch=2, seq=16, seed=3)
    data = [{"input_ids": rows[i % 2], "labels": rows[i % 2]} for i in range(32)]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=8, per_device_train_batch_size=4, learning_rate=1e-2,
        lr_scheduler_type="constant", report_to=[], use_cpu=True, save_strategy="no", logging_steps=1,
        seed=0, disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()

    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    # Measured: 4.571 -> 4.206, falling at every step.
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.2, losses
    optimized = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert optimized == {id(p) for p in model.fastaf.adapters["t"].parameters()}
    after = model.state_dict()
    assert after.keys() == before.keys()
    for k, v in before.items():
        if k.startswith("fastaf.adapters.t."):
            assert not torch.equal(after[k], v), f"{k} did not train"
        else:
            assert torch.equal(after[k], v), f"{k} changed"  # base, "a" and "b": bit-identical
    assert list(tmp_path.iterdir()) == []  # nothing saved


# ---- errors -------------------------------------------------------------------------------------


def test_unknown_names_are_clear_errors(tmp_path):
    _, model = inited()
    calls = [
        lambda: model.set_active_adapter("nope"),
        lambda: model.remove_adapter("nope"),
        lambda: model.get_adapter("nope"),
        lambda: fa.save_adapter_to_local_dir(model, path=tmp_path, name="nope"),
        lambda: fa.push_adapter_to_hub(model, name="nope", repo_id="user/x"),
    ]
    for call in calls:
        with pytest.raises(KeyError, match=r"'nope'.*\['a', 'b'\]"):
            call()
    assert model.active_adapter == "b" and list(tmp_path.iterdir()) == []


def test_not_inited_is_a_clear_error(tmp_path):
    with pytest.raises(RuntimeError, match=r"fastaf.init\(model\)"):
        fa.save_adapter_to_local_dir(tiny_llama(), path=tmp_path, name="a")


@pytest.mark.parametrize("name", ["a", "", "x.y", "update", 3])
def test_existing_or_invalid_names_are_refused(name):
    _, model = inited()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=repr(name)):
        model.add_new_adapter(name, fa.LoRAConfig(r=2, alpha=2, targets=["k_proj"]))
    assert list(model.fastaf.adapters) == ["a", "b"] and model.state_dict().keys() == state.keys()


@pytest.mark.parametrize(
    "config, match",
    [
        (fa.LoRAConfig(r=2, alpha=2, targets=["q_proj", "nope_proj"]), "nope_proj"),
        (fa.LoRAConfig(r=2, alpha=2, targets=["mlp"]), "model.layers.0.mlp"),  # not a linear
    ],
)
def test_bad_config_adds_nothing(config, match):
    _, model = inited()
    keys = set(model.state_dict())
    with pytest.raises(ValueError, match=match):
        model.add_new_adapter("c", config)
    wrong = fa.Adapter({"model.layers.0.self_attn.q_proj": fa.LoRA(torch.randn(2, 7), torch.zeros(32, 2))})
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.q_proj.*A \(2, 7\)"):
        model.add_new_adapter("c", wrong)
    assert list(model.fastaf.adapters) == ["a", "b"] and set(model.state_dict()) == keys


def test_targets_never_match_the_registry():
    _, model = inited()
    # The registry's escaped keys end in "q_proj" too ("...self_attn__q_proj"); a regex must not see them.
    model.add_new_adapter("c", fa.LoRAConfig(r=2, alpha=2, targets=r".*q_proj"))
    model.add_new_adapter("d", fa.LoRAConfig(r=2, alpha=2, targets="all-linear"))
    assert list(model.get_adapter("c")) == ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]
    assert not any(p.startswith("fastaf") for p in model.get_adapter("d"))
    assert "fastaf" in dict(model.named_children())  # put back after matching


# ---- files and the hub --------------------------------------------------------------------------


def test_save_and_load_round_trip_keeps_the_name(tmp_path):
    base, model = inited()
    out = fa.save_adapter_to_local_dir(model, path=tmp_path / "checkpoints", name="b")
    assert out == tmp_path / "checkpoints"
    assert {p.name for p in out.iterdir()} == {"adapter_model.safetensors", "adapter_config.json"}

    fresh = copy.deepcopy(base)  # never inited: load_adapter inits it
    assert fa.load_adapter(fresh, path_or_repo_id=tmp_path / "checkpoints") == "b"  # the saved name
    assert fresh.active_adapter is None and trainable(fresh) == set()
    assert_adapters_equal(fresh.get_adapter("b"), model.get_adapter("b"))
    fresh.set_active_adapter("b")
    ids = token_batch()
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, model(ids).logits)

    assert fa.load_adapter(fresh, path_or_repo_id=str(tmp_path / "checkpoints"), name="again") == "again"
    with pytest.raises(ValueError, match="'b' already exists"):
        fa.load_adapter(fresh, path_or_repo_id=tmp_path / "checkpoints")


def test_the_original_readme_flow_round_trips_the_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base, model = inited()
    fa.save_adapter_to_local_dir(model, path="./checkpoints", name="b")
    fresh = copy.deepcopy(base)
    assert fa.load_adapter(fresh, path_or_repo_id="./checkpoints") == "b"
    fresh.set_active_adapter("b")


def test_files_without_a_name_are_named_after_the_path(tmp_path, monkeypatch):
    base, model = inited()
    fa.save_adapter(model.get_adapter("a"), tmp_path / "v1.2")  # no name recorded, as PEFT's files
    assert fa.load_adapter(model, path_or_repo_id=tmp_path / "v1.2") == "v1_2"
    monkeypatch.chdir(tmp_path / "v1.2")
    assert fa.load_adapter(model, path_or_repo_id=".") == "default"


@pytest.mark.parametrize("name", ["", "my.adapter", "keys"])
def test_names_load_adapter_refuses_are_refused_at_save(tmp_path, name):
    _, model = inited()
    with pytest.raises(ValueError, match=f"save_adapter: .*{re.escape(repr(name))}"):
        fa.save_adapter(model.get_adapter("a"), tmp_path, name=name)
    assert not any(tmp_path.iterdir())


def test_a_recorded_name_that_cannot_register_says_where_it_came_from(tmp_path):
    """Files from before save_adapter checked names: the error names the file's name and name=."""
    from safetensors.torch import load_file, save_file

    base, model = inited()
    fa.save_adapter(model.get_adapter("a"), tmp_path)
    weights = tmp_path / "adapter_model.safetensors"
    save_file(load_file(str(weights)), str(weights), metadata={"format": "pt", _io.NAME_KEY: "my.adapter"})
    fresh = copy.deepcopy(base)
    with pytest.raises(ValueError, match=r"name recorded in its files cannot be used.*'my.adapter'.*pass name="):
        fa.load_adapter(fresh, path_or_repo_id=tmp_path)
    assert fa.load_adapter(fresh, path_or_repo_id=tmp_path, name="mine") == "mine"


def test_activating_an_adapter_the_model_outgrew_is_an_error():
    """resize_token_embeddings under an adapted lm_head: refused when activated, nothing changed."""
    _, model = inited()
    model.add_new_adapter("head", fa.LoRAConfig(r=2, alpha=2, targets=["lm_head"]))
    model.resize_token_embeddings(VOCAB + 8)
    with pytest.raises(ValueError, match=r"set_active_adapter\('head'\).*lm_head.*B \(96, 2\)"):
        model.set_active_adapter("head")
    assert model.active_adapter == "b"  # as inited() left it


def test_a_wrapper_of_an_inited_model_points_to_its_module(tmp_path):
    _, model = inited()

    class Wrapper(torch.nn.Module):  # as DDP and accelerate hold the model
        def __init__(self, module):
            super().__init__()
            self.module = module

    with pytest.raises(RuntimeError, match=r"Wrapper has no fastaf adapters \(it wraps one that has them: pass its .module\)"):
        fa.save_adapter_to_local_dir(Wrapper(model), path=tmp_path, name="a")


def _snapshot(model):
    """Everything a failed load must leave alone: state, modules, forward, requires_grad."""
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "modules": [(n, type(m), id(m)) for n, m in model.named_modules()],
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "dict": {k: v for k, v in vars(model).items() if k != "_modules"},
    }


def _assert_same(before, after):
    assert after["modules"] == before["modules"] and after["requires_grad"] == before["requires_grad"]
    assert after["dict"].keys() == before["dict"].keys() and all(
        after["dict"][k] is v or after["dict"][k] == v for k, v in before["dict"].items() if k != "_parameters"
    )
    assert after["state"].keys() == before["state"].keys()
    assert all(torch.equal(after["state"][k], v) for k, v in before["state"].items())


@pytest.mark.parametrize("inited_first", [False, True])
def test_a_failed_load_changes_nothing(tmp_path, inited_first):
    gpt2 = tiny_gpt2()
    fa.save_adapter(random_adapter(gpt2, ["c_attn"]), tmp_path / "gpt2", name="other")  # another architecture
    model = tiny_llama()
    if inited_first:
        fa.init(model)
    before = _snapshot(model)
    with pytest.raises(ValueError, match="does not fit LlamaForCausalLM"):
        fa.load_adapter(model, path_or_repo_id=tmp_path / "gpt2")
    with pytest.raises(FileNotFoundError, match="no directory"):
        fa.load_adapter(model, path_or_repo_id=tmp_path / "missing")
    with pytest.raises(ValueError, match="non-empty str"):
        fa.load_adapter(model, path_or_repo_id=tmp_path / "gpt2", name="a.b")
    _assert_same(before, _snapshot(model))
    assert hasattr(model, "fastaf") == inited_first  # no registry from a failed load


class _ParamAndChild(nn.Module):
    """A module whose own weight and whose child Linear are both adaptable: the stateful layer
    cannot nest a LoRA around each."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(1, 8, 8))
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(torch.einsum("bi,eoi->bo", x, self.w))


def test_a_load_the_registry_refuses_changes_nothing(tmp_path):
    """The nesting check ran after ``init``: the failed load left the model frozen, with a registry."""
    model = nn.Sequential(_ParamAndChild(), nn.Linear(8, 2))
    g = torch.Generator().manual_seed(0)
    ad = fa.Adapter({"0.w": fa.LoRA(torch.randn(1, 2, 8, generator=g), torch.randn(1, 8, 2, generator=g), 1.0,
                                    experts=True),
                     "0.lin": fa.LoRA(torch.randn(2, 8, generator=g), torch.randn(8, 2, generator=g), 1.0)})
    fa.save_adapter(ad, tmp_path, model=model)
    assert set(fa.read_adapter(tmp_path, model=model)) == {"0.w", "0.lin"}  # the file itself is fine
    before = _snapshot(model)
    with pytest.raises(ValueError, match="adapts weights of '0' and of its submodule '0.lin'.*functional_call"):
        fa.load_adapter(model, path_or_repo_id=tmp_path, name="x")
    _assert_same(before, _snapshot(model))
    assert not hasattr(model, "fastaf")


def test_save_records_the_config(tmp_path):
    _, model = inited()
    fa.save_adapter_to_local_dir(model, path=tmp_path, name="a")
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8 and set(cfg["target_modules"]) == {"q_proj", "v_proj"}


def test_push_adapter_to_hub_uploads_the_saved_folder(monkeypatch):
    _, model = inited()
    seen = {}

    def fake_upload(folder, repo_id, **kwargs):
        folder = Path(folder)
        seen.update(folder=folder, repo_id=repo_id, kwargs=kwargs)
        seen["files"] = sorted(p.name for p in folder.iterdir())
        seen["adapter"] = fa.read_adapter(folder)
        return "https://hub.example/commit/1"

    monkeypatch.setattr(fastaf.io.hub, "upload_folder_to_hub", fake_upload)
    url = fa.push_adapter_to_hub(model, name="b", repo_id="user/sql", token="tok", private=True)
    assert url == "https://hub.example/commit/1"
    assert seen["repo_id"] == "user/sql" and seen["files"] == ["adapter_config.json", "adapter_model.safetensors"]
    assert seen["kwargs"]["token"] == "tok" and seen["kwargs"]["private"] is True
    assert "'b'" in seen["kwargs"]["commit_message"]
    assert_adapters_equal(seen["adapter"], model.get_adapter("b"))
    assert not seen["folder"].exists()  # the temporary folder is gone


def test_replaced_parameters_are_what_the_forward_uses():
    base, model = inited()
    ids = token_batch()
    other = random_adapter(base, TARGETS["llama"], r=4, seed=7)
    state = {f"fastaf.adapters.b.{p.replace('.', '__')}.{f}": getattr(l, f).clone()
             for p, l in other.items() for f in ("A", "B")}
    model.load_state_dict(state, strict=False, assign=True)  # new Parameter objects
    with torch.no_grad():
        assert torch.equal(model(ids).logits, fa.functional_call(base, other, (ids,)).logits)


def test_an_interrupted_forward_leaves_no_mode_behind():
    base, model = inited()
    ids = token_batch()
    layer = model.model.layers[0].self_attn.q_proj

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # inside the forward: always-called hooks do not run for it

    layer.forward = interrupted
    with pytest.raises(KeyboardInterrupt):
        model(ids)
    del layer.forward
    assert torch._C._len_torch_function_stack() == 1  # the interrupt left q_proj's mode open
    with torch.no_grad():
        assert torch.equal(model(ids).logits, fa.functional_call(base, model.get_adapter("b"), (ids,)).logits)
    model(ids)
    model.set_active_adapter(None)  # an interrupt again, then no adapter: nothing may stay adapted
    layer.forward = interrupted
    with pytest.raises(KeyboardInterrupt):
        model(ids)
    del layer.forward
    model.set_active_adapter(None)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, base(ids).logits)
    assert torch._C._len_torch_function_stack() == 0


def test_push_on_a_rank_other_than_0_uploads_nothing(monkeypatch):
    _, model = inited()
    monkeypatch.setattr(fa.distributed, "is_writer", lambda: False)
    monkeypatch.setattr(fastaf.io.hub, "upload_folder_to_hub", lambda *a, **k: pytest.fail("uploaded"))
    assert fa.push_adapter_to_hub(model, name="b", repo_id="alice/x") is None


def test_init_on_a_sequential_keeps_its_forward():
    """nn.Sequential calls every child in order, the registry (added last) included."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    x = torch.randn(3, 4)
    base = model(x)
    fa.init(model)
    assert torch.equal(model(x), base)
    model.add_new_adapter("a", fa.LoRAConfig(r=2, alpha=4, targets=["0"]))
    lora = model.get_adapter("a")["0"]
    lora = fa.LoRA(lora.A, torch.randn_like(lora.B), lora.scale)
    model.remove_adapter("a")
    model.add_new_adapter("a", fa.Adapter({"0": lora}))
    model.set_active_adapter("a")
    first = torch.nn.functional.linear(x, model[0].weight, model[0].bias) + lora.scale * (x @ lora.A.T) @ lora.B.T
    want = model[2](model[1](first))  # neither is targeted
    torch.testing.assert_close(model(x), want)


@needs_interpreter
@pytest.mark.parametrize("flow", ["steps", "checkpointed", "two forwards, one backward", "backward in a thread"])
def test_siblings_group_across_the_modules_hooks_and_equal_each_layer_alone(counted, monkeypatch, flow, set_flags):
    """q/k/v and gate/up run as one op at the first one's call, as in an eager functional_call:
    the first call learns the groups, the next ones run each group as one op each way, with the
    same outputs and gradients as every layer alone. Inside a non-reentrant activation checkpoint
    each layer runs alone: its recompute, on another thread (CUDA's autograd device thread) or
    after later calls, must make the ops its forward made."""
    set_flags(stateful_impl="triton")  # the kernels: the interpreter on the CPU
    ids = [token_batch(seed=s) for s in range(3)]

    def run(group: bool) -> list:
        set_flags(group=group)
        model = fa.init(tiny_llama(layers=1))
        model.add_new_adapter("a", random_adapter(model, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                          "up_proj", "down_proj"]))
        model.set_active_adapter("a")
        if flow != "steps":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        if flow == "two forwards, one backward":
            losses = [model(i).logits.square().mean() for i in ids]
            return [(torch.stack(losses).detach(), torch.autograd.grad(sum(losses), params))]
        out = []
        for i in ids:
            logits = model(i).logits
            if flow == "backward in a thread":
                grads = []
                worker = threading.Thread(target=lambda: grads.append(
                    torch.autograd.grad(logits.square().mean(), params)))
                worker.start()
                worker.join()
                assert grads, "the backward raised in its thread"
                out.append((logits.detach(), grads[0]))
            else:
                out.append((logits.detach(), torch.autograd.grad(logits.square().mean(), params)))
        return out

    want = run(group=False)
    assert counted == {"fwd": 0, "bwd": 0}
    got = run(group=True)
    for (y, gs), (y_want, gs_want) in zip(got, want):
        torch.testing.assert_close(y, y_want, rtol=1e-4, atol=1e-6)
        for g, w in zip(gs, gs_want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    if flow == "steps":
        learned = sorted((type(k).__name__, len(v)) for k, v in _group.learned().items())
        assert learned == [("Linear", 1), ("Linear", 2)], learned
        assert counted == {"fwd": 4, "bwd": 4}, counted  # two later calls, two groups each
    else:
        assert counted == {"fwd": 0, "bwd": 0}, counted


def test_kept_routes_hold_no_tensor_of_a_call_after_it():
    """The routes the stateful layer keeps between calls (for grouping) hold no W + ΔW after a
    call: an expert's substituted weight is as large as the weight, and after a backward it held
    its graph (a deep copy of the model then failed)."""
    model = fa.init(tiny_mixtral(layers=1))
    model.add_new_adapter("a", random_adapter(model, ["gate_up_proj", "down_proj", "q_proj", "v_proj"]))
    model.set_active_adapter("a")
    routes = [r for rs in model.fastaf.grouping.routes.values() for r in rs.values()]
    with torch.no_grad():
        model(token_batch())
    assert all(r.merged is None for r in routes)
    model.train()
    model(token_batch()).logits.sum().backward()
    assert all(r.merged is None for r in routes)
    copy.deepcopy(model)


@needs_interpreter
def test_siblings_group_when_only_a_submodule_runs(counted, monkeypatch, set_flags):
    """Groups learned by a submodule's calls (the decoder stack without the head) serve its later
    calls, with the outputs of every layer alone."""
    set_flags(stateful_impl="triton")
    model = fa.init(tiny_llama(layers=1))
    model.add_new_adapter("a", random_adapter(model, ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]))
    model.set_active_adapter("a")
    with torch.no_grad():
        set_flags(group=False)
        want = model.model(token_batch()).last_hidden_state
        set_flags(group=True)
        got = [model.model(token_batch()).last_hidden_state for _ in range(3)]
    for y in got:
        torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-6)
    assert counted == {"fwd": 4, "bwd": 0}, counted  # learned in the first, two groups in each later call


@needs_interpreter
def test_a_raising_call_does_not_end_grouping_and_passed_weights_are_not_kept(counted, monkeypatch, set_flags):
    """A call that raised midway drops the outputs its group held (its members never ran) without
    giving the group up; weights passed for one call (torch.func.functional_call) run each layer
    alone and are not kept by the stateful layer's routes."""
    set_flags(stateful_impl="triton")
    model = fa.init(tiny_llama(layers=1))
    model.add_new_adapter("a", random_adapter(model, ["q_proj", "k_proj", "v_proj"]))
    model.set_active_adapter("a")
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        model(token_batch())  # learns q -> (k, v)
        handle = attn.k_proj.register_forward_pre_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("stop")))
        with pytest.raises(RuntimeError, match="stop"):
            model(token_batch())
        handle.remove()
        before = counted["fwd"]
        model(token_batch())
        assert counted["fwd"] == before + 1  # still grouped
        passed = {n: p.detach().clone() for n, p in model.named_parameters() if "fastaf" not in n}
        torch.func.functional_call(model, passed, (token_batch(),))
    routes = [r for rs in model.fastaf.grouping.routes.values() for r in rs.values()]
    assert all(isinstance(r.weight, torch.nn.Parameter) for r in routes)


# ---- compiled models follow activations; refused and silent misuses -----------------------------


def _compiled_adapters(how: str, backend: str):
    """(base copy, inited 1-layer llama with "a" (q_proj) and "b" (v_proj, gate_proj), what to call:
    the model compiled whole or each decoder layer compiled (``layer.compile()``))."""
    torch._dynamo.reset()  # a fresh cache: no graph of an earlier test may answer (nor the recompile limit)
    model = tiny_llama(layers=1)
    base = copy.deepcopy(model)
    fa.init(model)
    model.add_new_adapter("a", random_adapter(base, ["q_proj"], seed=1))
    model.add_new_adapter("b", random_adapter(base, ["v_proj", "gate_proj"], seed=2))
    if how == "whole":
        return base, model, torch.compile(model, backend=backend)
    for layer in model.model.layers:
        layer.compile(backend=backend)
    return base, model, model


@pytest.mark.parametrize("how", ["whole", "per block"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("order", [[None, "a"], ["a", None, "a"], ["a", "b", None, "a", "b"]], ids=str)
def test_a_compiled_model_follows_every_activation(how, backend, order):
    """A graph compiled with no adapter active read nothing that activation changes (dynamo does not
    guard on hooks, skip_nnmodule_hook_guards): it kept running the base model (0.004 off)."""
    base, model, compiled = _compiled_adapters(how, backend)
    ids = token_batch()
    with torch.no_grad():
        for name in order:
            model.set_active_adapter(name)
            got = compiled(ids).logits
            adapter = None if name is None else model.get_adapter(name)
            want = base(ids).logits if adapter is None else fa.functional_call(base, adapter, (ids,)).logits
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{order}, at {name}: {m}")


def test_a_compiled_step_traced_before_any_adapter_follows_them():
    """A compiled function that calls the model inlines the model's own hooks, and guards on the
    active adapter its always-called hook reads: adapters added after its first call apply."""
    torch._dynamo.reset()
    model = tiny_llama(layers=1)
    base = copy.deepcopy(model)
    fa.init(model)
    step = torch.compile(lambda ids: model(ids).logits, backend="eager")
    ids = token_batch()
    with torch.no_grad():
        torch.testing.assert_close(step(ids), base(ids).logits)
        model.add_new_adapter("a", random_adapter(base, ["q_proj"], seed=1))
        model.set_active_adapter("a")
        want = fa.functional_call(base, model.get_adapter("a"), (ids,)).logits
        torch.testing.assert_close(step(ids), want, rtol=1e-5, atol=1e-6)


def test_hooks_sit_on_the_modules_some_adapter_targets_and_go_with_the_adapters():
    _, model = inited(active=None)  # "a" and "b": q_proj, v_proj
    watched = {n for n, m in model.named_modules() if m._forward_hooks and n}
    assert watched == {f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("q_proj", "v_proj")}
    assert all(not m._forward_pre_hooks for m in model.modules())  # nothing enters a mode with none active
    model.remove_adapter("a")
    model.remove_adapter("b")
    assert all(not m._forward_hooks for n, m in model.named_modules() if n)
    assert list(model._forward_hooks.values()) == [model.fastaf.end_call]  # the model's own, for good


def _state(model):
    return {k: (v.clone(), v.requires_grad) for k, v in model.state_dict(keep_vars=True).items()}


def test_init_refuses_a_data_parallel_wrapper_and_changes_nothing():
    """DDP's reducer keeps the parameters it was built with: adapters added under it were never
    averaged, and the ranks' gradients differed silently (a helper's gloo run). DataParallel, which
    builds on CPU without a process group, stands in for it here; tests/test_distributed.py wraps in DDP."""
    model = tiny_llama(layers=1)
    wrapped = nn.DataParallel(model)
    before = _state(model)
    with pytest.raises(TypeError, match=r"fastaf.init: got DataParallel wrapping a LlamaForCausalLM.*before "
                                        r"wrapping the model"):
        fa.init(wrapped)
    with pytest.raises(TypeError, match=r"load_adapter: got DataParallel"):
        fa.load_adapter(wrapped, path_or_repo_id="user/never-read")
    after = _state(model)
    assert "fastaf" not in model._modules and not hasattr(wrapped, "add_new_adapter")
    assert all(after[k][1] == rg and torch.equal(after[k][0], v) for k, (v, rg) in before.items())


def test_init_refuses_a_compiled_wrapper_and_changes_nothing():
    """fastaf.init(torch.compile(model)) put the registry on the wrapper and the methods on the
    model: both unusable, and a second init refused."""
    torch._dynamo.reset()  # no graph an earlier test traced for another LlamaForCausalLM
    model = tiny_llama(layers=1)
    compiled = torch.compile(model, backend="eager")
    before, attrs = _state(model), set(vars(model)) | set(vars(compiled))
    with pytest.raises(TypeError, match=r"fastaf.init: got torch.compile's wrapper \(OptimizedModule\) of a "
                                        r"LlamaForCausalLM.*before torch.compile\(model\).*compiled._orig_mod"):
        fa.init(compiled)
    with pytest.raises(TypeError, match=r"load_adapter: got torch.compile's wrapper"):
        fa.load_adapter(compiled, path_or_repo_id="user/never-read")
    assert set(vars(model)) | set(vars(compiled)) == attrs and "fastaf" not in model._modules
    assert not hasattr(compiled, "fastaf") and not hasattr(model, "add_new_adapter")
    after = _state(model)
    assert all(after[k][1] == rg and torch.equal(after[k][0], v) for k, (v, rg) in before.items())
    assert all(p.requires_grad for p in model.parameters())  # still the user's to train
    # the way the message points to works, and the wrapper then follows the model's adapters
    base = copy.deepcopy(model)
    fa.init(compiled._orig_mod)
    assert fa.init(compiled) is compiled  # a wrapper of an inited model: already done
    compiled.add_new_adapter("a", random_adapter(base, ["q_proj"], seed=1))
    compiled.set_active_adapter("a")
    ids = token_batch()
    with torch.no_grad():
        want = fa.functional_call(base, model.get_adapter("a"), (ids,)).logits
        torch.testing.assert_close(compiled(ids).logits, want, rtol=1e-5, atol=1e-6)


def test_a_module_replaced_after_activation_is_an_error_at_the_forward():
    """resize_token_embeddings under an active lm_head adapter (a new nn.Linear at lm_head), or a
    new q_proj assigned: the new module has no hook, and the forward ran it without its LoRA."""
    base, model = inited()  # "b" active: q_proj, v_proj
    model.add_new_adapter("head", random_adapter(base, ["lm_head"], r=2))
    model.set_active_adapter("head")
    ids = token_batch()
    with torch.no_grad():  # applied before the resize
        assert torch.equal(model(ids).logits, fa.functional_call(base, model.get_adapter("head"), (ids,)).logits)
    model.resize_token_embeddings(VOCAB + 8)
    with pytest.raises(RuntimeError, match=r"adapter 'head' is active on lm_head, but LlamaForCausalLM.lm_head is "
                                           r"another Linear now.*without its LoRA.*set_active_adapter\('head'\) again"):
        model(ids)
    assert torch._C._len_torch_function_stack() == 0

    base, model = inited()
    attn = model.model.layers[1].self_attn
    new_q = torch.nn.Linear(32, 32, bias=False)
    attn.q_proj = new_q
    with pytest.raises(RuntimeError, match=r"'b' is active on model.layers.1.self_attn.q_proj, but "
                                           r"LlamaForCausalLM.model.layers.1.self_attn.q_proj is another Linear now"):
        model(ids)
    del attn.q_proj
    with pytest.raises(RuntimeError, match=r"model.layers.1.self_attn.q_proj is gone"):
        model(ids)
    attn.q_proj = new_q
    model.set_active_adapter("b")  # checked against the model as it is now, and applied there
    base.model.layers[1].self_attn.q_proj = copy.deepcopy(new_q)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, fa.functional_call(base, model.get_adapter("b"), (ids,)).logits)


def test_a_module_replaced_in_a_compiled_model_is_an_error_too():
    base, model, compiled = _compiled_adapters("whole", "eager")
    model.set_active_adapter("a")
    ids = token_batch()
    with torch.no_grad():
        want = fa.functional_call(base, model.get_adapter("a"), (ids,)).logits
        torch.testing.assert_close(compiled(ids).logits, want, rtol=1e-5, atol=1e-6)
        model.model.layers[0].self_attn.q_proj = torch.nn.Linear(32, 32, bias=False)
        with pytest.raises(RuntimeError, match=r"'a' is active on model.layers.0.self_attn.q_proj, but"):
            compiled(ids)


def test_training_with_adapters_but_none_active_warns_once_naming_the_cure():
    """Adapters added, none activated: the backward failed with torch's bare "element 0 of tensors
    does not require grad"."""
    import warnings

    base, model = inited(active=None)
    model.train()
    ids = token_batch()
    with pytest.warns(UserWarning) as record:
        for _ in range(3):
            loss = model(ids, labels=ids).loss
            assert torch.equal(loss, base.train()(ids, labels=ids).loss)  # the base model, as asked
            with pytest.raises(RuntimeError, match="does not require grad"):
                loss.backward()
    ours = [w for w in record if "fastaf" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in record]
    assert re.search(r"training mode with grad enabled, but no adapter is active \(it has \['a', 'b'\]\).*"
                     r"model.set_active_adapter\('a'\)", str(ours[0].message))
    assert ours[0].filename == __file__  # points at the model(...) call
    model.set_active_adapter("a")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model(ids, labels=ids).loss.backward()  # trains, unsaid
        model.set_active_adapter(None)
        model.eval()
        model(ids)  # not training: no warning
        model.train()
        with torch.no_grad():
            model(ids)  # no grad: no warning


def test_a_name_that_is_not_a_str_is_a_type_error():
    _, model = inited()
    with pytest.raises(TypeError, match=r"set_active_adapter takes one adapter's name \(a str\) or None, got "
                                        r"list \['a'\]; this model has \['a', 'b'\]"):
        model.set_active_adapter(["a"])
    for call in (model.get_adapter, model.remove_adapter):
        with pytest.raises(TypeError, match=r"an adapter name is a str, got list \['a'\]"):
            call(["a"])
    assert model.active_adapter == "b" and list(model.fastaf.adapters) == ["a", "b"]


def test_seed_with_an_adapter_is_an_error():
    base, model = inited()
    ad = random_adapter(base, ["k_proj"], seed=4)
    with pytest.raises(TypeError, match=r"add_new_adapter\('c', \.\.\., seed=123\): seed .*LoRAConfig.* drop seed="):
        model.add_new_adapter("c", ad, seed=123)
    assert list(model.fastaf.adapters) == ["a", "b"]
    model.add_new_adapter("c", ad)
    assert_adapters_equal(model.get_adapter("c"), ad)


def test_a_stack_is_refused_by_name_and_its_slots_are_added_one_by_one():
    base, model = inited()
    slots = [random_adapter(base, ["k_proj"], seed=s) for s in (4, 5)]
    with pytest.raises(ValueError, match=r"add_new_adapter\('s', \.\.\.\): model\.layers\.0\.self_attn\.k_proj holds a "
                                         r"stacked LoRA, A \(2, \d+, \d+\) .*fastaf\.unstack\(adapter\)"):
        model.add_new_adapter("s", fa.stack(slots))
    assert list(model.fastaf.adapters) == ["a", "b"]  # nothing added
    for i, slot in enumerate(fa.unstack(fa.stack(slots))):
        model.add_new_adapter(f"s{i}", slot)
        assert_adapters_equal(model.get_adapter(f"s{i}"), slots[i])


def test_mixed_dropouts_at_save_name_their_modules(tmp_path):
    import dataclasses

    base, model = inited()
    ad = random_adapter(base, ["q_proj", "v_proj"], seed=4)
    ad = ad.map(lambda p, l: dataclasses.replace(l, dropout=0.2) if p.endswith("v_proj") else l)
    model.add_new_adapter("c", ad)
    with pytest.raises(ValueError, match=re.escape(
            "PEFT stores one lora_dropout per adapter, got [0.0, 0.2]: 0.0 at model.layers.0.self_attn.q_proj, "
            "model.layers.1.self_attn.q_proj; 0.2 at model.layers.0.self_attn.v_proj, "
            "model.layers.1.self_attn.v_proj")):
        fa.save_adapter_to_local_dir(model, path=tmp_path, name="c")
    assert list(tmp_path.iterdir()) == []


def test_a_targeted_module_compiled_in_place_keeps_its_lora():
    """``model.lm_head = torch.compile(model.lm_head)`` wraps the hooked module, which still runs:
    no refusal (the placement check looks through the wrapper)."""
    base, ids = tiny_llama(layers=1), token_batch()
    model = copy.deepcopy(base)
    fa.init(model)
    ad = random_adapter(base, ["q_proj", "lm_head"], seed=1)
    model.add_new_adapter("a", ad)
    model.set_active_adapter("a")
    model.lm_head = torch.compile(model.lm_head, backend="eager")
    with torch.no_grad():
        assert rel_err(model(ids).logits, fa.functional_call(base, ad, (ids,)).logits) < 1e-6


def test_an_ancestor_replaced_after_activation_is_an_error_at_the_forward():
    """A fresh attention block in place of the one whose q_proj / v_proj were hooked: their LoRA
    would be dropped silently; the forward names the path."""
    from transformers.models.llama.modeling_llama import LlamaAttention

    base, ids = tiny_llama(layers=2), token_batch()
    model = copy.deepcopy(base)
    fa.init(model)
    model.add_new_adapter("a", random_adapter(base, ["q_proj", "v_proj"], seed=1))
    model.set_active_adapter("a")
    fresh = LlamaAttention(model.config, layer_idx=1)
    fresh.load_state_dict(model.model.layers[1].self_attn.state_dict())
    model.model.layers[1].self_attn = fresh
    with pytest.raises(RuntimeError, match=r"active on model\.layers\.1\.self_attn\.q_proj.* or a module above it"):
        model(ids)
    model.set_active_adapter("a")  # applied to the modules there now
    with torch.no_grad():
        base.model.layers[1].self_attn.load_state_dict(fresh.state_dict())
        want = fa.functional_call(base, model.get_adapter("a"), (ids,)).logits
        assert rel_err(model(ids).logits, want) < 1e-6


def test_an_adapter_added_inside_a_block_compiled_before_warns():
    """A block compiled in place and run before its modules had any adapter: its graph never runs
    their hooks (it keeps serving the base model), so adding the adapter warns."""
    model = tiny_llama(layers=1)
    fa.init(model)
    for layer in model.model.layers:
        layer.compile(backend="eager")
    with pytest.warns(UserWarning, match=r"model\.layers\.0\.self_attn\.q_proj .* sits in model\.layers\.0, compiled"):
        model.add_new_adapter("a", random_adapter(model, ["q_proj"], seed=1))


def test_decoding_steps_add_the_lora_to_nn_linear_outputs_and_recast_updated_factors(monkeypatch):
    """A decoding step of a plain nn.Linear (CUDA's, run here on CPU to be checked) runs no mode:
    the LoRA is added to the layer's own output, with its fp32 factors cast once to the model's
    half dtype and again after they change in place. Same tokens as fa.generate and PEFT."""
    added = []

    def decoding(x, lora, impl, training):
        added.append(x.shape)
        return not torch.is_grad_enabled()

    base = tiny_llama().to(torch.bfloat16).eval().requires_grad_(False)
    ids = token_batch(batch=2, seq=8)
    targets = ["q_proj", "v_proj", "down_proj"]
    adapter = random_adapter(base, targets, r=4, seed=6)
    adapter = fa.Adapter({p: fa.LoRA(l.A.float(), l.B.float() + 0.05, l.scale) for p, l in adapter.items()})
    kw = dict(max_new_tokens=5, do_sample=False)
    peft_model = peft_model_with(copy.deepcopy(base), {"default": adapter}, targets, {"default": (4, 8.0)}).eval()
    assert torch.equal(peft_model.generate(input_ids=ids, **kw), fa.generate(base, adapter, ids, **kw))
    model = fa.init(copy.deepcopy(base))
    model.add_new_adapter("a", adapter)
    model.set_active_adapter("a")
    import fastaf.intercept.use
    monkeypatch.setattr(fastaf.intercept.use, "decoding", lambda x, lora, impl, training: not torch.is_grad_enabled())
    want = fa.generate(base, adapter, ids, **kw)  # fa.generate's decode path: the same launches, in bf16
    monkeypatch.setattr(fastaf._stateful, "decoding", decoding)
    assert torch.equal(model.generate(ids, **kw), want)
    steps = len(added) // 6  # each adapted layer's (2 layers x 3) each forward, prefill included
    assert len(added) == 6 * steps and steps >= 2 and added[0][:2] == ids.shape
    registry = model.fastaf
    held = registry.cast_loras["model.layers.0.self_attn.q_proj"][4]
    assert held.A.dtype == torch.bfloat16 and registry.active_lora("model.layers.0.self_attn.q_proj").A.dtype == torch.float32
    with torch.no_grad():  # an optimizer's step: in place
        for p in model.fastaf.adapters["a"].parameters():
            p.mul_(1.5)
    again = model.generate(ids, **kw)
    assert registry.cast_loras["model.layers.0.self_attn.q_proj"][4] is not held  # cast anew
    scaled = fa.Adapter({p: fa.LoRA(l.A * 1.5, l.B * 1.5, l.scale) for p, l in adapter.items()})
    assert torch.equal(again, fa.generate(base, scaled, ids, **kw))
    with torch.no_grad():
        x = torch.randn(2, 3, 32).to(torch.bfloat16)
        layer = model.model.layers[0].self_attn.q_proj
        calls = len(added)
        by_keyword = layer(input=x)  # a keyword input takes the mode (the op's reference on CPU)
        assert len(added) == calls and rel_err(layer(x), by_keyword) < 1e-2 and len(added) == calls + 1
        assert rel_err(by_keyword, layer.forward(x)) > 1e-2  # the LoRA is there


def test_a_compiled_inference_call_runs_each_linear_with_its_lora_without_a_mode(monkeypatch):
    """Traced with grad off, a plain nn.Linear's forward set by the stateful layer computes the layer
    and its LoRA (``traced_decode``): no mode, whose counters and state dynamo would write back
    after every call. Grad on, the mode's op path runs as before. Both equal functional_call."""
    import fastaf._stateful as stateful_module

    torch._dynamo.reset()
    model = tiny_llama(layers=2)
    base = copy.deepcopy(model)
    fa.init(model)
    adapter = random_adapter(base, ["q_proj", "v_proj", "down_proj"], seed=3)
    model.add_new_adapter("a", adapter)
    model.set_active_adapter("a")
    added = []
    real = stateful_module.traced_decode
    monkeypatch.setattr(stateful_module, "traced_decode", lambda *a, **k: added.append(1) or real(*a, **k))
    step = torch.compile(lambda ids: model(ids).logits, backend="eager")
    ids = token_batch()
    want = fa.functional_call(base, adapter, (ids,)).logits
    with torch.no_grad():
        torch.testing.assert_close(step(ids), want, rtol=1e-5, atol=1e-6)
    assert len(added) == 2 * 3  # traced once: one per adapted linear
    added.clear()
    torch.testing.assert_close(step(ids), want, rtol=1e-5, atol=1e-6)  # grad on: a new graph, the op path
    assert not added


def test_lifted_hooks_go_back_after_the_hook_that_preceded_them_and_others_keep_their_places():
    """``_put_back``: the hooks a compiled generate lifted return each right after its old
    predecessor still there (or first); hooks added meanwhile, prepended or appended, and hooks
    removed meanwhile, stay as they are."""
    from fastaf._stateful import _put_back

    before = [(1, "user-a"), (2, "fastaf-1"), (3, "user-b"), (4, "fastaf-2")]
    hooks = {1: "user-a", 3: "user-b"}  # fastaf's lifted
    hooks = {0: "prepended", **hooks, 5: "appended"}
    del hooks[1]  # the user removed one meanwhile
    _put_back(hooks, before, {2: "fastaf-1", 4: "fastaf-2"})
    assert list(hooks.items()) == [(0, "prepended"), (2, "fastaf-1"), (3, "user-b"), (4, "fastaf-2"),
                                   (5, "appended")]


def test_lifted_hooks_go_back_in_their_order_when_nothing_changed_meanwhile():
    from fastaf._stateful import _put_back

    before = [(1, "fastaf-1"), (2, "user-a"), (3, "fastaf-2"), (4, "user-b")]
    hooks = {2: "user-a", 4: "user-b"}
    _put_back(hooks, before, {1: "fastaf-1", 3: "fastaf-2"})
    assert list(hooks.items()) == before
    hooks = {2: "user-a", 4: "user-b"}  # an activation meanwhile removed fastaf-2: it stays out
    _put_back(hooks, before, {1: "fastaf-1"})
    assert list(hooks.items()) == [(1, "fastaf-1"), (2, "user-a"), (4, "user-b")]
