"""LoRAConfig validation, PEFT-style target matching and PEFT-identical initialisation."""
import math

import peft
import pytest
import torch

import fastaf as fa
from fastaf._layouts import match_targets
from tests._models import tiny_gpt2, tiny_llama


def test_suffix_regex_and_all_linear_match_like_peft():
    model = tiny_llama()
    got = match_targets(model, ["q_proj", "mlp.down_proj"])
    assert got == [
        "model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj",
        "model.layers.1.self_attn.q_proj", "model.layers.1.mlp.down_proj",
    ]
    assert match_targets(model, r".*\.1\.self_attn\.(k|v)_proj") == [
        "model.layers.1.self_attn.k_proj", "model.layers.1.self_attn.v_proj",
    ]
    all_linear = match_targets(model, "all-linear")
    assert len(all_linear) == 14 and "lm_head" not in all_linear
    # PEFT selects the same modules for the same target spec
    for targets in (["q_proj", "mlp.down_proj"], r".*\.1\.self_attn\.(k|v)_proj"):
        pm = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=2, target_modules=targets))
        peft_paths = [n.removeprefix("base_model.model.") for n, m in pm.named_modules() if hasattr(m, "lora_A") and not n.endswith("lora_A")]
        assert sorted(peft_paths) == sorted(match_targets(model, targets))


def test_init_matches_peft_initialisation():
    model = tiny_llama()
    torch.manual_seed(123)
    ad = fa.init_adapter(model, fa.LoRAConfig(r=4, alpha=8, targets=["q_proj"]))
    torch.manual_seed(123)
    A_ref = torch.empty(4, 32)
    torch.nn.init.kaiming_uniform_(A_ref, a=math.sqrt(5))  # PEFT's reset_lora_parameters
    first = ad["model.layers.0.self_attn.q_proj"]
    assert torch.equal(first.A, A_ref)
    assert torch.count_nonzero(first.B) == 0 and first.B.shape == (32, 4)
    assert first.A.abs().max() <= 1 / math.sqrt(32) and first.scale == 2.0
    assert first.A.dtype == torch.float32


def test_seed_is_private_and_reproducible():
    model = tiny_llama()
    cfg = fa.LoRAConfig(r=2, alpha=2, targets=["v_proj"])
    state = torch.random.get_rng_state()
    a, b = fa.init_adapter(model, cfg, seed=7), fa.init_adapter(model, cfg, seed=7)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(a[p].A, b[p].A) for p in a)
    assert not torch.equal(a["model.layers.0.self_attn.v_proj"].A, fa.init_adapter(model, cfg, seed=8)["model.layers.0.self_attn.v_proj"].A)


def test_rslora_scale_dtype_and_conv1d():
    cfg = fa.LoRAConfig(r=16, alpha=32, targets=["c_attn"], rslora=True, dropout=0.1)
    assert cfg.scale == 8.0
    ad = fa.init_adapter(tiny_gpt2(), cfg, seed=0, dtype=torch.bfloat16)
    lora = ad["transformer.h.0.attn.c_attn"]
    assert lora.A.shape == (16, 32) and lora.B.shape == (96, 16)  # Conv1D weight is (in, out)
    assert lora.A.dtype == torch.bfloat16 and lora.dropout == 0.1


_OK = {"r": 2, "alpha": 1, "targets": ["q_proj"]}


@pytest.mark.parametrize(
    "changes, error, match",
    [
        ({"r": 0}, ValueError, "r must be >= 1"),
        ({"r": "16"}, TypeError, "r must be an int"),
        ({"targets": []}, ValueError, "targets"),
        ({"targets": None}, TypeError, "targets must be a list of module names or a regex str, got None"),
        ({"targets": "q_proj("}, ValueError, r"'q_proj\(' is not a valid regex"),
        ({"dropout": 1.0}, ValueError, "dropout"),
        ({"dropout": "0.1"}, TypeError, "dropout must be a number, got '0.1'"),
        ({"alpha": float("nan")}, ValueError, "alpha must be finite, got nan"),
        ({"alpha": float("inf")}, ValueError, "alpha must be finite, got inf"),
        ({"alpha": "8"}, TypeError, "alpha must be a number"),
        ({"rslora": "no"}, TypeError, "rslora must be True or False, got 'no'"),
        ({"rslora": 1}, TypeError, "rslora must be True or False"),
    ],
)
def test_config_errors(changes, error, match):
    with pytest.raises(error, match=match):
        fa.LoRAConfig(**{**_OK, **changes})


def test_targets_that_match_nothing_or_non_linear_are_errors():
    model = tiny_llama()
    with pytest.raises(ValueError, match=r"\['qproj'\] match no module.*close names: \[.*'q_proj'"):
        fa.init_adapter(model, fa.LoRAConfig(r=2, alpha=2, targets=["q_proj", "qproj"]))
    with pytest.raises(TypeError, match="seed must be an int or None, got str 'x'"):
        fa.init_adapter(model, fa.LoRAConfig(r=2, alpha=2, targets=["q_proj"]), seed="x")
    with pytest.raises(ValueError, match="model.layers.0.mlp.*MLP"):
        fa.init_adapter(model, fa.LoRAConfig(r=2, alpha=2, targets=["mlp"]))
    with pytest.raises(ValueError, match="matches no module"):
        fa.init_adapter(model, fa.LoRAConfig(r=2, alpha=2, targets=r"nothing\..*"))
    # a bare name as a str is a regex over whole paths: the error says how to select by name
    with pytest.raises(ValueError, match=r"'q_proj' matches no module.*pass \['q_proj'\]"):
        fa.init_adapter(model, fa.LoRAConfig(r=2, alpha=2, targets="q_proj"))
