"""Adapter files in PEFT's layout, both ways, and the hub transfers.

Round trips compare fp32 logits against PEFT itself (``PeftModel.from_pretrained`` on a copy of
the base model, or the ``get_peft_model`` model that wrote the files) within REL_TOL[float32].
The hub tests run huggingface_hub's real client against a stand-in of the hub's HTTP API on
127.0.0.1 (create repo, preupload, commit, resolve); see ``_FakeHub`` for what it covers.
"""
from __future__ import annotations

import base64
import copy
import hashlib
import json
import re
import threading
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file, save_file

import fastaf as fa
from fastaf.io import files as _io, hub as _hub
from tests._models import MODELS, random_adapter, tiny_gpt2, tiny_llama, tiny_mixtral, tiny_qwen2, token_batch
from tests._tolerances import assert_close

F32 = torch.float32


# ---- helpers ------------------------------------------------------------------------------------


def _fa_logits(model, adapter, ids):
    with torch.no_grad():
        return fa.functional_call(model, adapter, (ids,)).logits


def _peft_from_dir(base, folder, strict=True):
    """PEFT loads ``folder`` onto a copy of ``base``; with ``strict``, warnings about missing or
    unexpected keys fail the test."""
    with warnings.catch_warnings():
        if strict:
            warnings.filterwarnings("error", message=".*(missing|unexpected|[Ff]ound missing adapter keys).*")
        warnings.filterwarnings("ignore", message=".*fan_in_fan_out.*")
        return PeftModel.from_pretrained(copy.deepcopy(base), str(folder)).eval()


def _peft_logits(peft_model, ids):
    with torch.no_grad():
        return peft_model(ids).logits


def _peft_scalings(peft_model):
    return {
        name.removeprefix("base_model.model."): m.scaling["default"]
        for name, m in peft_model.named_modules()
        if isinstance(m, LoraLayer) and "default" in m.scaling
    }


def _randomise_peft_B(peft_model, seed=1):
    """A fresh PEFT adapter has lora_B = 0; give it values so B's path is checked."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def _rewrite(folder: Path, fn):
    """Replace the safetensors file of ``folder`` with ``fn(tensors)``."""
    file = folder / _io.WEIGHTS_NAME
    save_file(fn(load_file(str(file))), str(file))


def _edit_config(folder: Path, **changes):
    file = folder / _io.CONFIG_NAME
    cfg = json.loads(file.read_text())
    cfg.update(changes)
    file.write_text(json.dumps(cfg))


# ---- fastaf -> PEFT -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2"])
def test_saved_adapter_loads_in_peft_with_same_logits(tmp_path, name):
    make, targets = MODELS[name]
    model = make()
    adapter = random_adapter(model, targets, r=4, alpha=8.0)
    fa.save_adapter(adapter, tmp_path)
    peft_model = _peft_from_dir(model, tmp_path)
    ids = token_batch()
    assert_close(_peft_logits(peft_model, ids), _fa_logits(model, adapter, ids), F32, f"{name} logits")


def test_saved_config_is_a_peft_lora_config(tmp_path):
    model = tiny_llama()
    cfg = fa.LoRAConfig(r=4, alpha=8, targets=["q_proj", "v_proj"], dropout=0.05)
    fa.save_adapter(random_adapter(model, cfg.targets, r=4, alpha=8, dropout=0.05), tmp_path, config=cfg)
    written = json.loads((tmp_path / "adapter_config.json").read_text())
    peft_cfg = LoraConfig.from_pretrained(str(tmp_path))
    assert (peft_cfg.peft_type, peft_cfg.r, peft_cfg.lora_alpha) == ("LORA", 4, 8)
    assert set(peft_cfg.target_modules) == {"q_proj", "v_proj"} and peft_cfg.lora_dropout == 0.05
    assert written["rank_pattern"] == {} and written["alpha_pattern"] == {}
    assert written["bias"] == "none" and written["inference_mode"] is True
    keys = set(load_file(str(tmp_path / "adapter_model.safetensors")))
    assert "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight" in keys and len(keys) == 8


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen2])
@pytest.mark.parametrize("rslora", [False, True])
def test_mixed_ranks_and_scales_round_trip_through_peft(tmp_path, make, rslora):
    """Ranks and scales that differ per module go to rank_pattern / alpha_pattern."""
    model = make()
    cfg = fa.LoRAConfig(r=4, alpha=8, targets=["q_proj", "v_proj", "o_proj"], rslora=rslora)
    adapter = (
        random_adapter(model, ["q_proj", "o_proj"], r=4, alpha=8, rslora=rslora)
        + random_adapter(model, ["v_proj"], r=2, alpha=5, rslora=rslora, seed=3)
    )
    odd = "model.layers.1.self_attn.q_proj"
    adapter = adapter.map(lambda p, l: 0.37 * l if p == odd else l)  # a scale that is no alpha/r of small ints
    fa.save_adapter(adapter, tmp_path, config=cfg)
    written = json.loads((tmp_path / "adapter_config.json").read_text())
    assert written["use_rslora"] is rslora
    assert set(written["rank_pattern"]) == {f"model.layers.{i}.self_attn.v_proj" for i in (0, 1)}
    assert odd in written["alpha_pattern"]
    peft_model = _peft_from_dir(model, tmp_path)
    assert _peft_scalings(peft_model) == {p: l.scale for p, l in adapter.items()}  # exact, not close
    ids = token_batch()
    assert_close(_peft_logits(peft_model, ids), _fa_logits(model, adapter, ids), F32, "logits")
    back = fa.read_adapter(tmp_path)
    assert {p: (l.rank, l.scale) for p, l in back.items()} == {p: (l.rank, l.scale) for p, l in adapter.items()}


def test_without_config_global_rank_is_most_common_and_targets_are_exact_paths(tmp_path):
    model = tiny_llama()
    adapter = random_adapter(model, ["q_proj", "k_proj"], r=4) + random_adapter(model, ["model.layers.0.mlp.up_proj"], r=6)
    fa.save_adapter(adapter, tmp_path)
    written = json.loads((tmp_path / "adapter_config.json").read_text())
    assert written["r"] == 4 and written["rank_pattern"] == {"model.layers.0.mlp.up_proj": 6}
    # a regex of the full paths: PEFT adapts exactly these modules (a bare "up_proj" would also
    # select layer 1's up_proj, which the adapter does not hold)
    selected = {p for p, _ in model.named_modules() if p and re.fullmatch(written["target_modules"], p)}
    assert selected == set(adapter)
    ids = token_batch()
    peft_model = _peft_from_dir(model, tmp_path)  # strict: no "missing adapter keys"
    assert set(_peft_scalings(peft_model)) == set(adapter)
    assert_close(_peft_logits(peft_model, ids), _fa_logits(model, adapter, ids), F32)


def test_all_linear_config_saves_the_adapters_own_paths(tmp_path):
    """PEFT's "all-linear" selects no output layer: a file that said it dropped this lm_head."""
    model = tiny_llama()
    model.config.tie_word_embeddings = False
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    cfg = fa.LoRAConfig(r=4, alpha=8, targets="all-linear")
    adapter = random_adapter(model, "all-linear") + random_adapter(model, ["lm_head"], seed=2)
    fa.save_adapter(adapter, tmp_path, config=cfg)
    written = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (written["r"], written["lora_alpha"]) == (4, 8)
    selected = {p for p, _ in model.named_modules() if p and re.fullmatch(written["target_modules"], p)}
    assert selected == set(adapter) and "lm_head" in selected
    ids = token_batch()
    assert_close(_peft_logits(_peft_from_dir(model, tmp_path), ids), _fa_logits(model, adapter, ids), F32)


@pytest.mark.parametrize("make, targets", [(tiny_llama, ["q_proj", "down_proj"]), (tiny_mixtral, "all-linear")])
def test_read_with_the_model_keeps_the_models_key_order(tmp_path, make, targets):
    """An Adapter's pytree structure holds its key order: the re-read adapter maps together with
    the saved one (mlp.down_proj came back before self_attn.q_proj, and tree_map raised)."""
    model = make()
    adapter = random_adapter(model, targets)
    fa.save_adapter(adapter, tmp_path)
    back = fa.read_adapter(tmp_path, model=model)
    assert list(back) == list(adapter)
    summed = torch.utils._pytree.tree_map(torch.add, adapter, back)
    assert all(summed[key].A.equal(2 * lora.A) for key, lora in adapter.items())


class _Nested(nn.Module):
    """Paths ``a.proj`` and ``x.a.proj``: a plain pattern key "a.proj" would match both."""

    def __init__(self):
        super().__init__()
        self.a = nn.ModuleDict({"proj": nn.Linear(8, 8)})
        self.x = nn.ModuleDict({"a": nn.ModuleDict({"proj": nn.Linear(8, 8)})})

    def forward(self, h):
        return self.x["a"]["proj"](self.a["proj"](h))


def test_pattern_keys_select_exactly_one_module(tmp_path):
    model = _Nested()
    cfg = fa.LoRAConfig(r=4, alpha=4, targets=["proj"])
    full = random_adapter(model, ["proj"], r=4, alpha=4)
    low = random_adapter(model, ["a.proj"], r=2, alpha=6, seed=2)  # "a.proj" selects both paths
    adapter = fa.Adapter({"a.proj": low["a.proj"], "x.a.proj": full["x.a.proj"]})
    fa.save_adapter(adapter, tmp_path, config=cfg)
    written = json.loads((tmp_path / "adapter_config.json").read_text())
    assert written["rank_pattern"] == {r"^a\.proj": 2}
    assert fa.read_adapter(tmp_path)["x.a.proj"].rank == 4
    peft_model = _peft_from_dir(model, tmp_path)
    assert _peft_scalings(peft_model) == {p: l.scale for p, l in adapter.items()}
    h = torch.randn(3, 8)
    with torch.no_grad():
        assert_close(peft_model(h), fa.functional_call(model, adapter, (h,)), F32)


@pytest.mark.parametrize(
    "scale,r,rslora", [(1 / 3, 3, False), (0.1, 7, False), (2.718281828459045, 5, True), (-1e-3, 11, True), (0.0, 2, False)]
)
def test_scale_round_trips_exactly(tmp_path, scale, r, rslora):
    model = tiny_llama()
    ad = random_adapter(model, ["q_proj"], r=r).map(lambda p, l: fa.LoRA(l.A, l.B, scale))
    fa.save_adapter(ad, tmp_path, config=fa.LoRAConfig(r=r, alpha=1.0, targets=["q_proj"], rslora=rslora))
    assert {l.scale for l in fa.read_adapter(tmp_path).values()} == {scale}
    assert set(_peft_scalings(_peft_from_dir(model, tmp_path)).values()) == {scale}


def test_factor_dtype_is_kept(tmp_path):
    model = tiny_llama()
    ad = random_adapter(model, ["q_proj"]).map(lambda p, l: fa.LoRA(l.A.bfloat16(), l.B.bfloat16(), l.scale))
    fa.save_adapter(ad, tmp_path)
    back = fa.read_adapter(tmp_path)
    for p, l in ad.items():
        assert back[p].A.dtype == torch.bfloat16 and torch.equal(back[p].A, l.A) and torch.equal(back[p].B, l.B)


def test_unstacked_views_save(tmp_path):
    """fa.unstack returns views of one storage; safetensors needs separate, contiguous tensors."""
    model = tiny_llama()
    stacked = fa.stack([random_adapter(model, ["q_proj"], seed=s) for s in (0, 1)])
    with pytest.raises(ValueError, match="stacked LoRA"):
        fa.save_adapter(stacked, tmp_path / "stacked")
    first = fa.unstack(stacked)[0]
    fa.save_adapter(first, tmp_path / "first")
    back = fa.read_adapter(tmp_path / "first")
    assert all(torch.equal(back[p].B, l.B) for p, l in first.items())


def test_save_onto_a_file_is_a_named_error(tmp_path):
    (tmp_path / "out").write_text("not a folder")
    with pytest.raises(NotADirectoryError, match="out is a file"):
        fa.save_adapter(random_adapter(tiny_llama(), ["q_proj"]), tmp_path / "out")
    assert (tmp_path / "out").read_text() == "not a folder"


def test_save_rejects_what_peft_cannot_hold(tmp_path):
    model = tiny_llama()
    ad = random_adapter(model, ["q_proj", "v_proj"])
    with pytest.raises(ValueError, match="v_proj.*not selected by config.targets"):
        fa.save_adapter(ad, tmp_path, config=fa.LoRAConfig(r=4, alpha=8, targets=["q_proj"]))
    mixed = ad.map(lambda p, l: fa.LoRA(l.A, l.B, l.scale, 0.1 if "q_proj" in p else 0.0))
    with pytest.raises(ValueError, match="one lora_dropout"):
        fa.save_adapter(mixed, tmp_path)
    with pytest.raises(ValueError, match="empty"):
        fa.save_adapter(fa.Adapter({}), tmp_path)
    with torch.device("meta"):
        on_meta = fa.init_adapter(tiny_llama(), fa.LoRAConfig(r=4, alpha=8, targets=["q_proj"]))
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.q_proj: factor A \(4, 32\) is on the meta device"):
        fa.save_adapter(on_meta, tmp_path)  # was torch's "Cannot copy out of meta tensor", naming nothing
    assert not any(tmp_path.iterdir())


def test_numpy_numbers_save_as_json_numbers(tmp_path):
    """numpy scalars pass LoRA's and LoRAConfig's checks; json.dumps refused them at save."""
    model = tiny_llama()
    ad = random_adapter(model, ["q_proj"]).map(lambda p, l: fa.LoRA(l.A, l.B, np.float32(0.75), np.float64(0.1)))
    fa.save_adapter(ad, tmp_path / "scale")
    cfg = fa.LoRAConfig(r=4, alpha=np.float32(3.0), targets=["q_proj"], dropout=0.1)
    fa.save_adapter(ad, tmp_path / "config", config=cfg)
    for folder in ("scale", "config"):
        back = fa.read_adapter(tmp_path / folder)
        assert {l.scale for l in back.values()} == {0.75} and {l.dropout for l in back.values()} == {0.1}


# ---- PEFT -> fastaf -----------------------------------------------------------------------------

PEFT_CONFIGS = {
    "plain": dict(r=4, lora_alpha=8),
    "rslora": dict(r=4, lora_alpha=8, use_rslora=True),
    "patterns": dict(
        r=4, lora_alpha=8,
        rank_pattern={"v_proj": 2, "model.layers.1.self_attn.q_proj": 6},
        alpha_pattern={"layers.0.self_attn.q_proj": 3, "o_proj": 1.5},
    ),
    "patterns_rslora": dict(r=4, lora_alpha=16, use_rslora=True, rank_pattern={"o_proj": 8}, alpha_pattern={"v_proj": 2}),
    "layers": dict(r=4, lora_alpha=8, layers_to_transform=[1], layers_pattern="layers"),
}


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen2])
@pytest.mark.parametrize("kind", list(PEFT_CONFIGS))
def test_peft_saved_adapter_reads_with_same_logits(tmp_path, make, kind):
    base = make()
    peft_cfg = LoraConfig(target_modules=["q_proj", "v_proj", "o_proj"], **PEFT_CONFIGS[kind])
    peft_model = get_peft_model(copy.deepcopy(base), peft_cfg).eval()
    _randomise_peft_B(peft_model)
    peft_model.save_pretrained(str(tmp_path))
    adapter = fa.read_adapter(tmp_path, model=base)
    assert {p: l.scale for p, l in adapter.items()} == _peft_scalings(peft_model)
    ids = token_batch()
    assert_close(_fa_logits(base, adapter, ids), _peft_logits(peft_model, ids), F32, f"{kind} logits")


@pytest.mark.parametrize("tied", [True, False])
def test_peft_folder_with_a_targeted_lm_heads_base_weight_reads(tmp_path, tied):
    """PEFT saves a targeted embedding layer's base weight beside its LoRA (lm_head.base_layer.weight):
    equal to the model's it is checked and left, different it is an error, without a model a warning."""
    model = tiny_llama()
    if tied:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"]))
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model.save_pretrained(str(tmp_path))
    assert "base_model.model.lm_head.base_layer.weight" in load_file(str(tmp_path / "adapter_model.safetensors"))
    adapter = fa.read_adapter(tmp_path, model=model)
    assert sorted(adapter) == ["lm_head", "model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]
    ids = token_batch()
    assert_close(_fa_logits(model, adapter, ids), _peft_logits(peft_model.eval(), ids), F32)
    with pytest.warns(UserWarning, match=r"also holds the base parameter lm_head\.weight"):
        fa.read_adapter(tmp_path)
    _rewrite(tmp_path, lambda t: {k: (v + 1 if k.endswith("lm_head.base_layer.weight") else v) for k, v in t.items()})
    with pytest.raises(ValueError, match=r"base parameter lm_head\.weight .* differs from the model's"):
        fa.read_adapter(tmp_path, model=model)


def test_peft_gpt2_conv1d_reads_with_same_logits(tmp_path):
    base = tiny_gpt2()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's fan_in_fan_out notice for Conv1D
        peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"])).eval()
    _randomise_peft_B(peft_model)
    peft_model.save_pretrained(str(tmp_path))
    ids = token_batch()
    assert_close(_fa_logits(base, fa.read_adapter(tmp_path), ids), _peft_logits(peft_model, ids), F32)


# ---- fused expert parameters (PEFT's target_parameters) ----------------------------------------

EXPERTS = "model.layers.0.mlp.experts"


def test_expert_loras_are_written_in_peft_param_wrapper_layout(tmp_path):
    base = tiny_mixtral()
    ad = random_adapter(base, ["q_proj", "gate_up_proj", "down_proj", "gate.weight"], r=4, alpha=8)
    fa.save_adapter(ad, tmp_path, config=fa.LoRAConfig(r=4, alpha=8, targets=["q_proj", "gate_up_proj", "down_proj", "gate.weight"]),
                    model=base)
    cfg = json.loads((tmp_path / _io.CONFIG_NAME).read_text())
    assert cfg["target_modules"] == ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]
    assert cfg["target_parameters"][:3] == ["model.layers.0.mlp.gate.weight", f"{EXPERTS}.gate_up_proj", f"{EXPERTS}.down_proj"]
    sd = load_file(str(tmp_path / _io.WEIGHTS_NAME))
    gate_up, down = ad[f"{EXPERTS}.gate_up_proj"], ad[f"{EXPERTS}.down_proj"]
    # gate_up_proj, registered first, sits inside down_proj's wrapper; A (E·r, in), B (out, r·E)
    A, B = sd[f"base_model.model.{EXPERTS}.base_layer.lora_A.weight"], sd[f"base_model.model.{EXPERTS}.base_layer.lora_B.weight"]
    assert A.shape == (16, 32) and B.shape == (96, 16)
    assert torch.equal(A[1 * 4 + 2], gate_up.A[1, 2]) and torch.equal(B[:, 2 * 4 + 1], gate_up.B[1, :, 2])
    assert sd[f"base_model.model.{EXPERTS}.lora_A.weight"].shape == (16, 48)
    assert torch.equal(sd["base_model.model.model.layers.0.mlp.gate.lora_B.weight"], ad["model.layers.0.mlp.gate.weight"].B[0])
    peft_model = _peft_from_dir(base, tmp_path)  # strict: no missing or unexpected keys
    ids = token_batch()
    assert_close(_peft_logits(peft_model, ids), _fa_logits(base, ad, ids), F32)
    back = fa.read_adapter(tmp_path)  # the file says which nested LoRA is which parameter
    assert sorted(back) == sorted(ad) and back[f"{EXPERTS}.down_proj"].experts
    assert all(torch.equal(back[k].A, ad[k].A) and torch.equal(back[k].B, ad[k].B) and back[k].scale == 2.0 for k in ad)


def test_expert_loras_nest_in_the_models_parameter_order(tmp_path):
    """PEFT nests one module's parameter LoRAs by the module's parameter order. An adapter whose keys
    run otherwise (``a_down + a_gate_up``) was written the other way round: PEFT refused it on
    Mixtral, and put each LoRA on the other parameter where the shapes agree."""
    base = tiny_mixtral()
    ad = random_adapter(base, ["gate_up_proj", "down_proj"], r=4, alpha=8)
    downs = [k for k in ad if k.endswith("down_proj")]
    backwards = fa.Adapter({k: ad[k] for k in downs}) + fa.Adapter({k: ad[k] for k in ad if k not in downs})
    assert next(iter(backwards)).endswith("down_proj")
    fa.save_adapter(backwards, tmp_path / "with", model=base)
    ids = token_batch()
    assert_close(_peft_logits(_peft_from_dir(base, tmp_path / "with"), ids), _fa_logits(base, ad, ids), F32)
    with pytest.warns(UserWarning, match=rf"{EXPERTS} \(and 1 more modules\) has LoRAs on several of its "
                                         r"parameters \(down_proj, gate_up_proj\).*save_adapter\(\.\.\., model=model\)"):
        fa.save_adapter(backwards, tmp_path / "without")
    with pytest.raises(ValueError, match=rf"{EXPERTS}.down_proj names no parameter of {EXPERTS}"):
        fa.save_adapter(backwards, tmp_path / "wrong", model=_without_down_proj(base))
    assert not (tmp_path / "wrong").exists()  # checked before anything is written


def _without_down_proj(base: nn.Module) -> nn.Module:
    """``base`` with its first experts module's down_proj removed: a model the adapter is not for."""
    other = copy.deepcopy(base)
    del other.get_submodule(EXPERTS)._parameters["down_proj"]
    return other


def test_peft_all_linear_on_mixtral_reads_with_the_model(tmp_path):
    """PEFT's "all-linear" gives gate_up_proj rank 2r (its v4 gate and up LoRAs side by side)."""
    base = tiny_mixtral()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT: its own rank_pattern "did not match any targeted module"
        peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(r=2, lora_alpha=4, target_modules="all-linear")).eval()
    _randomise_peft_B(peft_model)
    peft_model.save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match=rf"module '{EXPERTS}' holds 2 parameter LoRA.*pass model="):
        fa.read_adapter(tmp_path)
    ad = fa.read_adapter(tmp_path, model=base)
    assert ad[f"{EXPERTS}.gate_up_proj"].A.shape == (4, 4, 32) and ad[f"{EXPERTS}.down_proj"].A.shape == (4, 2, 48)
    assert sorted(ad) == sorted(fa.init_adapter(base, fa.LoRAConfig(r=2, alpha=4, targets="all-linear")))
    ids = token_batch()
    assert_close(_fa_logits(base, ad, ids), _peft_logits(peft_model, ids), F32)


def test_stateful_save_and_load_round_trip_expert_loras(tmp_path):
    base = tiny_mixtral()
    model = fa.init(copy.deepcopy(base))
    model.add_new_adapter("moe", random_adapter(base, "all-linear", r=2, alpha=4))
    fa.save_adapter_to_local_dir(model, path=tmp_path, name="moe")
    other = copy.deepcopy(base)
    assert fa.load_adapter(other, path_or_repo_id=tmp_path) == "moe"
    other.set_active_adapter("moe")
    model.set_active_adapter("moe")
    ids = token_batch()
    with torch.no_grad():
        assert_close(other(ids).logits, model(ids).logits, F32)


def test_bad_expert_files_are_named_errors(tmp_path):
    base = tiny_mixtral()
    fa.save_adapter(random_adapter(base, ["gate_up_proj"], r=4), tmp_path)
    _edit_config(tmp_path, r=3)
    with pytest.raises(ValueError, match=r"gate_up_proj: lora_A \(16, 32\) / lora_B \(96, 16\) do not have rank 3 per expert"):
        fa.read_adapter(tmp_path)
    _edit_config(tmp_path, r=4, lora_dropout=0.1)
    with pytest.raises(ValueError, match="gate_up_proj.*cannot have dropout"):
        fa.read_adapter(tmp_path)
    _edit_config(tmp_path, lora_dropout=0.0, target_parameters="gate_up_proj")
    with pytest.raises(ValueError, match="target_parameters must be a list"):
        fa.read_adapter(tmp_path)
    _edit_config(tmp_path, target_parameters=["gate_up_proj"])
    key = f"base_model.model.{EXPERTS}.lora_A.weight"
    nest = lambda sd: {k.replace("experts.", "experts.base_layer."): v.clone() for k, v in sd.items() if "layers.0" in k}  # noqa: E731
    _rewrite(tmp_path, lambda sd: {**sd, **nest(sd)})
    with pytest.raises(ValueError, match=rf"'{EXPERTS}' has parameter LoRAs at nesting depths \[0, 1\].*select 1"):
        fa.read_adapter(tmp_path, model=base)


# ---- errors -------------------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path):
    """A fastaf adapter for tiny Llama saved in tmp_path/ad."""
    model = tiny_llama()
    folder = tmp_path / "ad"
    fa.save_adapter(random_adapter(model, ["q_proj", "v_proj"]), folder)
    return model, folder


def test_dora_file_is_an_error(tmp_path):
    peft_model = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    peft_model.save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="use_dora=True.*DoRA.*not supported"):
        fa.read_adapter(tmp_path)
    _edit_config(tmp_path, use_dora=False)  # the magnitudes must still not be dropped silently
    with pytest.raises(ValueError, match=r"lora_magnitude_vector.*DoRA magnitudes"):
        fa.read_adapter(tmp_path)


def test_base_rewriting_init_is_an_error_until_converted(tmp_path):
    """PiSSA (like CorDA, OLoRA, LoftQ, LoRA-GA) trains on W - s·B0@A0, which PEFT rebuilds at every
    load: read as a plain LoRA on W its logits were wrong. PEFT's conversion makes a plain LoRA."""
    base = tiny_llama()
    ids = torch.randint(0, base.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                                                                init_lora_weights="pissa")).eval()
    initial, trained = tmp_path / "initial", tmp_path / "trained"
    peft_model.peft_config["default"].init_lora_weights = True  # PEFT's recipe for the initial save
    peft_model.save_pretrained(str(initial))
    peft_model.peft_config["default"].init_lora_weights = "pissa"
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
        want = peft_model(ids).logits
    peft_model.save_pretrained(str(trained))
    with pytest.raises(ValueError, match=r"init_lora_weights='pissa'.*rewrites at load.*"
                                         r"path_initial_model_for_weight_conversion"):
        fa.read_adapter(trained)
    for init in ("olora", "pissa_niter_4", "corda", "loftq", "lora_ga"):
        _edit_config(trained, init_lora_weights=init)
        fix = "no plain-LoRA form" if init == "loftq" else "path_initial_model_for_weight_conversion"
        with pytest.raises(ValueError, match=f"init_lora_weights='{init}'.*{fix}"):
            fa.read_adapter(trained)
    peft_model.save_pretrained(str(trained), path_initial_model_for_weight_conversion=str(initial))
    with torch.no_grad():
        got = fa.functional_call(base, fa.read_adapter(trained, model=base), (ids,)).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("init", [True, False, "gaussian", "eva", "orthogonal"])
def test_plain_inits_read_as_they_are(saved, init):
    """Inits that leave the base weight alone describe a plain LoRA once trained."""
    model, folder = saved
    _edit_config(folder, init_lora_weights=init)
    assert set(fa.read_adapter(folder, model=model)) == {p for p, _ in model.named_modules()
                                                       if p.endswith(("q_proj", "v_proj"))}


@pytest.mark.parametrize(
    "field,value", [("modules_to_save", ["lm_head"]), ("bias", "all"), ("peft_type", "IA3")]
)
def test_unsupported_config_fields_are_errors(saved, field, value):
    _, folder = saved
    _edit_config(folder, **{field: value})
    with pytest.raises(ValueError, match=re.escape(field) if field != "peft_type" else "LORA only"):
        fa.read_adapter(folder)


def test_truncated_safetensors_is_an_error(saved):
    _, folder = saved
    file = folder / "adapter_model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"adapter_model\.safetensors is not a readable safetensors file"):
        fa.read_adapter(folder)


def test_corrupted_safetensors_is_an_error(saved):
    _, folder = saved
    file = folder / "adapter_model.safetensors"
    data = bytearray(file.read_bytes())
    data[8:24] = b"\xff" * 16  # garbage in the JSON header
    file.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"adapter_model\.safetensors is not a readable safetensors file"):
        fa.read_adapter(folder)


def test_missing_files_are_errors(saved, tmp_path):
    _, folder = saved
    (folder / "adapter_config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"adapter_config\.json is missing"):
        fa.read_adapter(folder)
    with pytest.raises(FileNotFoundError, match="no directory"):
        fa.read_adapter(tmp_path / "nowhere" / "at_all")
    (tmp_path / "bad.json").write_text("{")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        fa.read_adapter(tmp_path / "bad")
    (tmp_path / "bad" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    with pytest.raises(FileNotFoundError, match=r"adapter_model\.safetensors is missing"):
        fa.read_adapter(tmp_path / "bad")


def test_a_trainer_checkpoint_is_named_as_such(tmp_path):
    """A Trainer checkpoint of a fa.init model is one model.safetensors: the error says so."""
    save_file({"w": torch.ones(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="adapter_config.json is missing.*Trainer checkpoint.*save_adapter_to_local_dir"):
        fa.read_adapter(tmp_path)


def test_keys_without_prefix_are_an_error(saved):
    _, folder = saved
    _rewrite(folder, lambda sd: {k.removeprefix("base_model.model."): v for k, v in sd.items()})
    with pytest.raises(ValueError, match=r"key 'model\.layers\.0\..*lacks the 'base_model\.model\.' prefix"):
        fa.read_adapter(folder)


@pytest.mark.parametrize(
    "extra,match",
    [
        ("base_model.model.model.embed_tokens.lora_embedding_A", "embedding"),
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias", "LoRA bias"),
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight", "not a LoRA factor"),
    ],
)
def test_unknown_keys_are_errors(saved, extra, match):
    _, folder = saved
    _rewrite(folder, lambda sd: {**sd, extra: torch.zeros(4, 4)})
    with pytest.raises(ValueError, match=re.escape(extra) + ".*" + match):
        fa.read_adapter(folder)


def test_incomplete_pair_and_rank_mismatch_are_errors(saved):
    _, folder = saved
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    _rewrite(folder, lambda sd: {k: v for k, v in sd.items() if k != key})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj has no lora_B\.weight"):
        fa.read_adapter(folder)
    fa.save_adapter(random_adapter(tiny_llama(), ["q_proj"], r=4), folder)
    _edit_config(folder, r=8)
    with pytest.raises(ValueError, match=r"q_proj: lora_A \(4, 32\) / lora_B \(32, 4\) do not have rank 8 \(r in"):
        fa.read_adapter(folder)


def test_paths_and_shapes_that_do_not_fit_the_model_are_errors(saved):
    model, folder = saved
    gpt2 = tiny_gpt2()
    adapter = fa.read_adapter(folder)  # without a model, reading succeeds ...
    with pytest.raises(ValueError, match=r"adapter path 'model\.layers\.0\.self_attn\.q_proj' is not a module"):
        fa.functional_call(gpt2, adapter, (token_batch(),))  # ... and using it on the wrong model fails
    with pytest.raises(ValueError, match=r"adapter_model\.safetensors does not fit GPT2LMHeadModel.*is not a module"):
        fa.read_adapter(folder, model=gpt2)
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"
    _rewrite(folder, lambda sd: {**sd, key: torch.zeros(4, 24)})
    with pytest.raises(ValueError, match=r"v_proj: LoRA A \(4, 24\) / B \(16, 4\) does not fit Linear\(32 -> 16\)"):
        fa.read_adapter(folder, model=model)


def test_read_places_factors(saved):
    model, folder = saved
    assert all(l.A.device.type == "cpu" for l in fa.read_adapter(folder, model=model).values())
    ad = fa.read_adapter(folder, device="meta")
    assert all(l.A.is_meta and l.B.is_meta for l in ad.values())


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"use_rslora": "false"}, "use_rslora must be true or false, got 'false'"),
        ({"lora_alpha": float("nan")}, "lora_alpha must be a finite number, got nan"),
        ({"lora_alpha": float("inf")}, "lora_alpha must be a finite number, got inf"),
        ({"r": 4.0}, "r must be an int, got 4.0"),
        ({"r": 0}, "r must be >= 1"),
        ({"lora_dropout": "0.1"}, "lora_dropout must be a finite number, got '0.1'"),
        ({"lora_dropout": 1.5}, r"lora_dropout must be in \[0, 1\)"),
        ({"rank_pattern": ["q_proj", 8]}, "rank_pattern must be a JSON object"),
        ({"rank_pattern": {"q_proj(": 8}}, r"rank_pattern key 'q_proj\(' is not a valid regex"),
        ({"rank_pattern": {"q_proj": "8"}}, r"q_proj must be an int, got '8'"),
        ({"alpha_pattern": {"v_proj": float("nan")}}, "v_proj must be a finite number, got nan"),
    ],
)
def test_bad_config_values_are_named_errors(saved, changes, match):
    _, folder = saved
    _edit_config(folder, **changes)  # json.dumps writes NaN / Infinity, which json.loads accepts
    with pytest.raises(ValueError, match=match):
        fa.read_adapter(folder)


@pytest.mark.parametrize("changes", [
    {"target_modules": ["v_proj"]},
    {"target_modules": r".*layers\.1\..*"},
    {"target_modules": ["q_proj", "v_proj"], "exclude_modules": ["model.layers.0.self_attn.q_proj"]},
])
def test_factors_the_config_does_not_select_are_an_error(saved, changes):
    """PEFT creates layers from the config and drops factors for others without a word: reading
    them anyway made fastaf and PEFT disagree on one file (0.021 logits off)."""
    _, folder = saved
    _edit_config(folder, **changes)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj has LoRA factors, but target_modules="):
        fa.read_adapter(folder)


def test_factors_outside_layers_to_transform_are_an_error(saved):
    _, folder = saved
    _edit_config(folder, target_modules=["q_proj", "v_proj"], layers_to_transform=[1])
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.q_proj has LoRA factors.*layers_to_transform=\[1\]"):
        fa.read_adapter(folder)
    _edit_config(folder, layers_to_transform=[0, 1], layers_pattern="layers")
    assert len(fa.read_adapter(folder)) == 4


def test_a_path_that_looks_local_never_goes_to_the_hub(tmp_path, monkeypatch):
    def no_hub(*args, **kwargs):
        raise AssertionError("the hub was asked")

    monkeypatch.setattr(_hub, "download_files", no_hub)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt").mkdir()
    for path in ("ckpt/sql", "./sql", "../sql", str(tmp_path / "sql"), "~/no-such-fastaf-dir", Path("user/sql")):
        with pytest.raises(FileNotFoundError, match="a local path, so the hub was not asked"):
            fa.read_adapter(path)


def test_an_unreachable_hub_fails_fast_and_says_what_it_tried(tmp_path):
    import time

    start = time.perf_counter()
    with pytest.raises(OSError, match=r"cannot reach the hub at http://127\.0\.0\.1:9 for 'alice/sql'.*not in the local cache"):
        _hub.download_files("alice/sql", [_io.CONFIG_NAME], endpoint="http://127.0.0.1:9", cache_dir=tmp_path)
    assert time.perf_counter() - start < _hub.PROBE_TIMEOUT_S + 2  # huggingface_hub alone: 23 s of retries


# ---- atomic writes ------------------------------------------------------------------------------


def test_failed_save_leaves_old_files_and_no_partial_ones(saved, monkeypatch):
    _, folder = saved
    before = {p.name: p.read_bytes() for p in folder.iterdir()}

    def broken_save(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(_io, "save_file", broken_save)
    with pytest.raises(OSError, match="disk full"):
        fa.save_adapter(random_adapter(tiny_llama(), ["k_proj"], seed=5), folder)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before  # no temp dir, nothing replaced


def test_save_overwrites_and_keeps_other_files(saved):
    model, folder = saved
    (folder / "README.md").write_text("notes")
    new = random_adapter(model, ["k_proj"], seed=9)
    fa.save_adapter(new, folder)
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    assert set(fa.read_adapter(folder)) == set(new)


# ---- hub ----------------------------------------------------------------------------------------


class _FakeHub(BaseHTTPRequestHandler):
    """The few hub endpoints huggingface_hub's ``create_repo`` / ``create_commit`` /
    ``hf_hub_download`` call, kept in memory. Every file is answered as a "regular" (non-LFS,
    non-Xet) upload, so the LFS/Xet byte transfer the real hub uses for large files is not
    exercised; the request protocol (create, preupload, NDJSON commit, resolve with commit and
    ETag headers, 404 error codes) is."""

    repos: dict[str, dict[str, bytes]]
    log: list[tuple[str, str, dict]]

    def log_message(self, *args):  # keep pytest output clean
        pass

    def _reply(self, status, body=b"", headers=None, send_body=True):
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def _json(self, obj, status=200):
        self._reply(status, json.dumps(obj).encode(), {"Content-Type": "application/json"})

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.log.append(("POST", self.path, {k.lower(): v for k, v in self.headers.items()}))
        base = f"http://{self.server.server_address[0]}:{self.server.server_address[1]}"
        if self.path == "/api/repos/create":
            payload = json.loads(body)
            repo = f"{payload['organization']}/{payload['name']}"
            self.log[-1][2]["payload"] = payload
            if repo in self.repos:
                return self._json({"error": "You already created this model repo", "url": f"{base}/{repo}"}, 409)
            self.repos[repo] = {}
            return self._json({"url": f"{base}/{repo}", "name": repo})
        m = re.fullmatch(r"/api/models/(.+)/(preupload|commit)/([^/?]+)(\?.*)?", self.path)
        if not m or m.group(1) not in self.repos:
            return self._reply(404, b"not found", {"X-Error-Code": "RepoNotFound"})
        repo, op = m.group(1), m.group(2)
        if op == "preupload":
            files = json.loads(body)["files"]
            return self._json({"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]})
        for line in body.splitlines():
            item = json.loads(line)
            if item["key"] == "header":
                self.log[-1][2]["summary"] = item["value"]["summary"]
            elif item["key"] == "file":
                assert item["value"]["encoding"] == "base64"
                self.repos[repo][item["value"]["path"]] = base64.b64decode(item["value"]["content"])
            else:
                return self._reply(400, f"unexpected commit item {item['key']}".encode())
        oid = hashlib.sha1(repr(sorted(self.repos[repo].items())).encode()).hexdigest()
        return self._json({"commitUrl": f"{base}/{repo}/commit/{oid}", "commitOid": oid})

    def _resolve(self, send_body):
        self.log.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))
        m = re.fullmatch(r"/(.+)/resolve/([^/]+)/(.+)", self.path)
        files = self.repos.get(m.group(1)) if m else None
        if files is None:
            return self._reply(404, b"", {"X-Error-Code": "RepoNotFound"}, send_body)
        if m.group(3) not in files:
            return self._reply(404, b"", {"X-Error-Code": "EntryNotFound"}, send_body)
        data = files[m.group(3)]
        commit = hashlib.sha1(repr(sorted(files.items())).encode()).hexdigest()
        headers = {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}
        self._reply(200, data, headers, send_body)

    def do_HEAD(self):
        self._resolve(send_body=False)

    def do_GET(self):
        self._resolve(send_body=True)


@pytest.fixture
def fake_hub():
    handler = type("Hub", (_FakeHub,), {"repos": {}, "log": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.timeout = 5
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_upload_then_download_through_hub_protocol(saved, fake_hub, tmp_path):
    model, folder = saved
    url, hub = fake_hub
    (folder / ".fastaf-tmp-leftover").mkdir()  # hidden entries are not uploaded
    commit_url = _hub.upload_folder_to_hub(
        folder, "alice/sql-adapter", token="hf_fake", private=True, commit_message="add sql", endpoint=url
    )
    assert commit_url.startswith(f"{url}/alice/sql-adapter/commit/")
    create = next(entry for entry in hub.log if entry[1] == "/api/repos/create")
    assert create[2]["payload"]["visibility"] == "private" and create[2]["authorization"] == "Bearer hf_fake"
    commit = next(entry for entry in hub.log if "/commit/main" in entry[1])
    assert commit[2]["summary"] == "add sql"
    # exactly the saved folder went up, byte for byte
    assert hub.repos["alice/sql-adapter"] == {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    # a second push to the same repo is fine (create_repo with exist_ok)
    _hub.upload_folder_to_hub(folder, "alice/sql-adapter", token="hf_fake", endpoint=url)

    local = _hub.download_files(
        "alice/sql-adapter", [_io.CONFIG_NAME, _io.WEIGHTS_NAME], endpoint=url, cache_dir=tmp_path / "cache"
    )
    ids = token_batch()
    assert_close(_fa_logits(model, fa.read_adapter(local), ids), _fa_logits(model, fa.read_adapter(folder), ids), F32)


def test_read_adapter_repo_id_goes_through_the_hub(saved, fake_hub, tmp_path, monkeypatch):
    model, folder = saved
    url, hub = fake_hub
    _hub.upload_folder_to_hub(folder, "alice/sql-adapter", endpoint=url, token="hf_fake")
    real = _hub.download_files
    calls = []

    def via_fake_hub(repo_id, filenames, **kw):
        calls.append((repo_id, kw))
        return real(repo_id, filenames, endpoint=url, cache_dir=tmp_path / "cache", **kw)

    monkeypatch.setattr(_hub, "download_files", via_fake_hub)
    adapter = fa.read_adapter("alice/sql-adapter", model=model, token="hf_fake")
    assert calls == [("alice/sql-adapter", {"revision": None, "token": "hf_fake"})]
    assert set(adapter) == set(fa.read_adapter(folder))
    with pytest.raises(FileNotFoundError, match=r"'alice/empty'.*has no adapter_config\.json"):
        hub.repos["alice/empty"] = {"README.md": b"hi"}
        fa.read_adapter("alice/empty")
    with pytest.raises(OSError, match=r"'bob/missing' is not a local directory.*RepositoryNotFoundError"):
        fa.read_adapter("bob/missing")


def test_upload_refuses_missing_or_empty_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        _hub.upload_folder_to_hub(tmp_path / "nope", "alice/x", endpoint="http://127.0.0.1:9")
    with pytest.raises(FileNotFoundError, match="holds no files"):
        _hub.upload_folder_to_hub(tmp_path, "alice/x", endpoint="http://127.0.0.1:9")
