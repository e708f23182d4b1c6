"""The stateful layer never loses a LoRA silently, and keeps the habits PEFT users bring: HF's save
path writes adapters in PEFT's layout (Trainer, SFTTrainer, resume), ``active_adapter`` is the name,
``load_adapter`` takes the path positionally. Plus the functional call's own habits (a dict passed
as args, an unfrozen base)."""
import copy
import errno
import json
import logging
import warnings

import peft
import pytest
import torch
from torch import nn
from transformers import Trainer, TrainingArguments

import fastaf as fa
from fastaf.io import atomic
from tests._models import VOCAB, random_adapter, tiny_llama, token_batch

TARGETS = ["q_proj", "v_proj"]


class DataLinear(nn.Linear):
    """A linear whose forward reads ``weight.data``: no gradient could reach a LoRA on it."""

    def forward(self, x):
        return nn.functional.linear(x, self.weight.data, self.bias)


def _custom_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 6), DataLinear(6, 5))


# ---- a LoRA fastaf cannot apply is an error at every entry point ---------------------------------


def _entry_points():
    """name -> (make the model, run it with the adapter) for every way a call can apply a LoRA."""
    def functional(model, adapter, x):
        return fa.functional_call(model, adapter, (x,))

    def stateful(model, adapter, x):
        fa.init(model)
        model.add_new_adapter("a", adapter)
        model.set_active_adapter("a")
        return model(x)

    def stateful_training(model, adapter, x):
        out = stateful(model.train(), adapter, x)
        out.sum().backward()

    def stateful_compiled(model, adapter, x):
        fa.init(model)
        model.add_new_adapter("a", adapter)
        model.set_active_adapter("a")
        return torch.compile(model, backend="eager")(x)

    return {"functional_call": functional, "stateful forward": stateful, "stateful training": stateful_training,
            "stateful compiled": stateful_compiled}


@pytest.mark.parametrize("entry", sorted(_entry_points()))
def test_a_weight_used_in_a_way_fastaf_does_not_adapt_is_the_same_error_everywhere(entry):
    model = _custom_model()
    adapter = random_adapter(model, ["1"], r=2)
    x = torch.randn(3, 6)
    with pytest.raises(Exception) as caught:
        _entry_points()[entry](model, adapter, x)
    message = str(caught.value)
    assert "1 (DataLinear) ran" in message and "silently lost" in message and "merge_into" in message, message


def test_the_stateful_generate_refuses_a_lost_lora_too():
    model = tiny_llama(layers=1)

    class DataProj(nn.Linear):
        def forward(self, x):
            return nn.functional.linear(x, self.weight.data, self.bias)

    old = model.model.layers[0].self_attn.q_proj
    new = DataProj(old.in_features, old.out_features, bias=old.bias is not None)
    new.load_state_dict(old.state_dict())
    model.model.layers[0].self_attn.q_proj = new
    fa.init(model)
    model.add_new_adapter("a", random_adapter(model, ["q_proj"], r=2))
    model.set_active_adapter("a")
    with pytest.raises(ValueError, match=r"active adapter 'a'.*q_proj \(DataProj\) ran 1 time.*silently lost"):
        model.generate(token_batch(batch=1, seq=4), max_new_tokens=2, do_sample=False)
    with pytest.raises(ValueError, match=r"q_proj \(DataProj\) ran.*silently lost"):
        fa.generate(model, model.get_adapter("a"), token_batch(batch=1, seq=4), max_new_tokens=2, do_sample=False)


def test_adapted_modules_raise_nothing_and_a_raising_forward_is_not_masked():
    model = tiny_llama(layers=1)
    fa.init(model)
    model.add_new_adapter("a", random_adapter(model, TARGETS, r=2))
    model.set_active_adapter("a")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(token_batch())
    with pytest.raises(IndexError):  # token ids past the vocabulary: the model's own error comes through
        model(torch.full((1, 3), 10**6))
    model(token_batch())  # the hooks closed their modes on the raise


# ---- the functional call's habits ------------------------------------------------------------------


def test_a_batch_dict_passed_as_args_says_it_belongs_in_kwargs():
    model = tiny_llama(layers=1).requires_grad_(False)
    ids = token_batch()
    with pytest.raises(TypeError, match=r"args is a dict of keyword inputs \(input_ids, labels\); a dict belongs "
                                        r"in kwargs: functional_call\(model, adapter, \(\), batch\)"):
        fa.functional_call(model, None, {"input_ids": ids, "labels": ids})

    class TakesADict(nn.Module):  # a forward whose one argument is a dict keeps working
        def forward(self, batch):
            return batch["x"] * 2

    assert torch.equal(fa.functional_call(TakesADict(), None, {"x": torch.ones(2)}), torch.full((2,), 2.0))


def test_an_unfrozen_base_is_warned_once_and_a_frozen_one_not():
    model = tiny_llama(layers=1)
    adapter = random_adapter(model, TARGETS, r=2)
    ids = token_batch()
    with pytest.warns(UserWarning, match=r"base parameters \([0-9,]+ values\) require grad.*model.requires_grad_\(False\)"):
        fa.functional_call(model, adapter, (ids,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fa.functional_call(model, adapter, (ids,))  # once per model
        frozen = tiny_llama(layers=1).requires_grad_(False)
        fa.functional_call(frozen, adapter, (ids,))
        with torch.no_grad():
            fa.functional_call(tiny_llama(layers=1), adapter, (ids,))  # inference: no gradient to keep
        fa.init(frozen)  # the adapters' own factors are not the base
        frozen.add_new_adapter("a", adapter)
        frozen.set_active_adapter("a")
        fa.functional_call(copy.deepcopy(frozen), adapter, (ids,))


# ---- PEFT habits: active_adapter, load_adapter, save errors -------------------------------------------


def test_active_adapter_is_the_name_and_load_adapter_takes_the_path_positionally(tmp_path):
    model = tiny_llama(layers=1)
    fa.init(model)
    assert model.active_adapter is None
    model.add_new_adapter("sql", random_adapter(model, TARGETS, r=2))
    model.set_active_adapter("sql")
    assert model.active_adapter == "sql"
    fa.save_adapter_to_local_dir(model, path=tmp_path / "sql", name="sql")
    model.remove_adapter("sql")
    assert model.active_adapter is None
    assert fa.load_adapter(model, tmp_path / "sql", name="again") == "again"
    assert fa.load_adapter(model, path_or_repo_id=tmp_path / "sql", name="kw") == "kw"
    model.set_active_adapter("again")
    assert model.active_adapter == "again"


def test_a_save_the_file_system_refuses_names_the_folder_asked_for(tmp_path, monkeypatch):
    adapter = random_adapter(tiny_llama(layers=1), TARGETS, r=2)
    target = tmp_path / "out"

    def full(path):  # disk full while writing into the staging folder
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    with pytest.raises(OSError) as caught:
        atomic.replace_files(target, {"adapter_model.safetensors": full})
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(target)
    assert atomic.STAGING_PREFIX not in str(caught.value)
    assert not any(p.name.startswith(atomic.STAGING_PREFIX) for p in target.iterdir())
    real = atomic.tempfile.mkdtemp
    monkeypatch.setattr(atomic.tempfile, "mkdtemp", lambda prefix, dir: (_ for _ in ()).throw(
        PermissionError(errno.EACCES, "Permission denied", str(dir / (prefix + "x")))))
    with pytest.raises(PermissionError) as caught:
        fa.save_adapter(adapter, target)
    assert caught.value.filename == str(target) and atomic.STAGING_PREFIX not in str(caught.value)
    monkeypatch.setattr(atomic.tempfile, "mkdtemp", real)


# ---- HF's save path: PEFT's layout, Trainer, SFTTrainer, resume -------------------------------------


def _two_adapters():
    base = tiny_llama(layers=1)
    model = copy.deepcopy(base)
    fa.init(model)
    model.add_new_adapter("sql", random_adapter(base, TARGETS, r=2, seed=1))
    model.add_new_adapter("chat", random_adapter(base, ["q_proj", "o_proj"], r=4, seed=2))
    model.set_active_adapter("sql")
    return base, model


def test_save_pretrained_writes_the_adapters_as_peft_does_and_both_read_them(tmp_path):
    base, model = _two_adapters()
    ids = token_batch()
    model.save_pretrained(tmp_path)
    top = sorted(p.name for p in tmp_path.iterdir())
    assert top == ["adapter_config.json", "adapter_model.safetensors", "chat", "model.safetensors"], top
    assert sorted(p.name for p in (tmp_path / "chat").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert (tmp_path / "model.safetensors").stat().st_size < 100_000  # the factors, not the base
    for name, folder in (("sql", tmp_path), ("chat", tmp_path / "chat")):
        want = fa.functional_call(base, model.get_adapter(name), (ids,)).logits
        peft_model = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(folder)).eval()
        torch.testing.assert_close(peft_model(ids).logits, want, rtol=1e-5, atol=1e-5)
        fresh = copy.deepcopy(base)
        assert fa.load_adapter(fresh, folder) == name  # the name recorded in the files
        fresh.set_active_adapter(name)
        torch.testing.assert_close(fresh(ids).logits, want, rtol=1e-6, atol=1e-6)
    with pytest.raises(TypeError, match=r"takes no \['push_to_hub'\].*push_adapter_to_hub"):
        model.save_pretrained(tmp_path / "x", push_to_hub=True)
    assert not (tmp_path / "x").exists()


def test_load_state_dict_of_the_adapters_alone_restores_them_and_reports_no_base_key(tmp_path):
    _, model = _two_adapters()
    model.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "model.safetensors")
    assert saved and all(k.startswith("fastaf.adapters.") for k in saved)
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.fastaf.parameters():
            p.add_(1.0)
    result = model.load_state_dict(saved, False)
    assert result.missing_keys == [] and result.unexpected_keys == []
    for k, v in model.state_dict().items():
        assert torch.equal(v, trained[k]), k
    full = model.state_dict()  # a whole state dict still loads as nn.Module's does
    assert model.load_state_dict(full).missing_keys == []


def _data(n=32):
    rows = token_batch(batch=2, seq=16, seed=3)
    return [{"input_ids": rows[i % 2], "labels": rows[i % 2]} for i in range(n)]


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, learning_rate=1e-2, report_to=[],
                use_cpu=True, logging_steps=1, seed=0, disable_tqdm=True, lr_scheduler_type="constant")
    return TrainingArguments(**{**base, **kw})


def _stateful_model(base):
    model = copy.deepcopy(base)
    fa.init(model)
    model.add_new_adapter("t", fa.LoRAConfig(r=4, alpha=8, targets=TARGETS), seed=0)
    model.set_active_adapter("t")
    return model


def test_trainer_saves_adapter_only_folders_that_peft_and_fastaf_read_and_resumes_exactly(tmp_path, caplog):
    base = tiny_llama(layers=1)
    ids = token_batch()
    whole = _stateful_model(base)
    trainer = Trainer(model=whole, args=_args(tmp_path / "run", max_steps=6, save_strategy="steps", save_steps=3),
                      train_dataset=_data())
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    final = tmp_path / "final"
    assert not (final / "config.json").exists() and (final / "adapter_model.safetensors").exists()
    assert sum(p.stat().st_size for p in final.glob("*.safetensors")) < 200_000  # no base weights
    want = whole(ids).logits
    peft_model = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(final)).eval()
    torch.testing.assert_close(peft_model(ids).logits, want, rtol=1e-5, atol=1e-5)
    fresh = copy.deepcopy(base)  # a plain model: load_adapter inits it
    name = fa.load_adapter(fresh, final)
    fresh.set_active_adapter(name)
    torch.testing.assert_close(fresh(ids).logits, want, rtol=1e-6, atol=1e-6)

    resumed = _stateful_model(base)
    again = Trainer(model=resumed, args=_args(tmp_path / "run", max_steps=6, save_strategy="steps", save_steps=3),
                    train_dataset=_data())
    with caplog.at_level(logging.WARNING):
        again.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-3"))
    assert "missing keys" not in caplog.text and "unexpected keys" not in caplog.text, caplog.text
    for (k, v), (k2, v2) in zip(whole.fastaf.state_dict().items(), resumed.fastaf.state_dict().items()):
        assert k == k2 and torch.equal(v, v2), k  # bit for bit: the same steps 4-6


def _tokenizer():
    """A word-level tokenizer over the tiny model's vocabulary (ids as words): SFTTrainer pads with it."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({str(i): i for i in range(VOCAB)}, unk_token="0"))
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="0", eos_token="1")


def test_sft_trainer_saves_an_adapter_folder_peft_reads(tmp_path):
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    base = tiny_llama(layers=1)
    model = _stateful_model(base)
    rows = token_batch(batch=4, seq=16, seed=5).tolist()
    data = Dataset.from_list([{"input_ids": r} for r in rows * 4])
    config = trl.SFTConfig(output_dir=str(tmp_path / "run"), max_steps=3, per_device_train_batch_size=4,
                           learning_rate=1e-2, report_to=[], use_cpu=True, save_strategy="no", seed=0,
                           disable_tqdm=True, dataset_kwargs={"skip_prepare_dataset": True}, remove_unused_columns=False)
    trainer = trl.SFTTrainer(model=model, args=config, train_dataset=data, processing_class=_tokenizer())
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    ids = token_batch()
    # the trained adapter on the base as it was (SFTTrainer changes the model it trains beyond its
    # parameters: pad and eos ids, use_cache, rotary buffers)
    trained = model.get_adapter("t")
    want = fa.functional_call(base, trained, (ids,)).logits
    fresh = copy.deepcopy(base)
    assert fa.load_adapter(fresh, tmp_path / "final") == "t"
    fresh.set_active_adapter("t")
    torch.testing.assert_close(fresh(ids).logits, want, rtol=1e-6, atol=1e-6)
    config_json = json.loads((tmp_path / "final" / "adapter_config.json").read_text())
    assert config_json["peft_type"] == "LORA" and sorted(config_json["target_modules"]) == sorted(TARGETS)
    peft_model = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "final")).eval()
    torch.testing.assert_close(peft_model(ids).logits, want, rtol=1e-5, atol=1e-5)


def test_accelerate_rebinding_the_forward_and_compiling_before_init_keep_working():
    import types

    model = tiny_llama(layers=1).requires_grad_(False)
    adapter = random_adapter(model, TARGETS, r=2)
    ids = token_batch()
    want = fa.functional_call(copy.deepcopy(model), adapter, (ids,)).logits
    fa.init(model)
    model.add_new_adapter("a", adapter)
    model.set_active_adapter("a")
    rebound = types.MethodType(model.forward.__func__, model)  # as accelerate unwraps a forward
    torch.testing.assert_close(rebound(ids).logits, want, rtol=1e-6, atol=1e-6)
    compiled = tiny_llama(layers=1).requires_grad_(False)
    compiled.forward = torch.compile(compiled.forward, backend="aot_eager")
    fa.init(compiled)  # the compiled forward is kept below the instance forward: still a compiled model
    with torch.no_grad():
        torch.testing.assert_close(fa.functional_call(compiled, adapter, (ids,)).logits, want, rtol=1e-5, atol=1e-5)


def test_save_pretrained_reads_a_wrappers_state_dict_and_keeps_to_the_selected_adapters(tmp_path):
    base, model = _two_adapters()
    wrapped = {f"_orig_mod.{k}": v for k, v in model.state_dict().items()}  # torch.compile's wrapper's keys
    model.save_pretrained(tmp_path, state_dict=wrapped, selected_adapters=["chat"])
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "model.safetensors")
    assert saved and all(k.startswith("fastaf.adapters.chat.") for k in saved)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                          "model.safetensors"]


def test_concurrent_stateful_forwards_raise_no_false_lost_lora():
    import threading

    model = tiny_llama(layers=1).requires_grad_(False)
    fa.init(model)
    model.add_new_adapter("a", random_adapter(model, TARGETS, r=2))
    model.set_active_adapter("a")
    errors = []

    def run():
        try:
            with torch.no_grad():
                for _ in range(20):
                    model(token_batch())
        except Exception as err:  # noqa: BLE001 - any error is the failure
            errors.append(err)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
