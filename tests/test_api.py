"""The public surface: fastaf.__all__ and fastaf.functional.__all__ are the contract, and every
entry point given something that is not an nn.Module names what it got."""
import pytest
import torch

import fastaf as fa
from tests._models import tiny_llama

PUBLIC = ["Adapter", "LoRA", "LoRAConfig", "distributed", "extract_adapter", "functional", "functional_call",
          "generate", "init", "init_adapter", "load_adapter", "merge", "merge_into", "push_adapter_to_hub",
          "read_adapter", "save_adapter", "save_adapter_to_local_dir", "stack", "unstack"]
FUNCTIONAL = ["Adapter", "LoRA", "LoRAConfig", "adapter_mode", "checkpoint_context", "extract_adapter",
              "functional_call", "init_adapter", "lora_linear", "merge", "merge_into", "stack", "unstack"]


def test_public_names_are_pinned():
    assert sorted(fa.__all__) == sorted(PUBLIC)
    assert sorted(fa.functional.__all__) == sorted(FUNCTIONAL)
    for name in PUBLIC:
        assert getattr(fa, name) is not None
    for name in FUNCTIONAL:
        assert getattr(fa.functional, name) is not None


CFG = fa.LoRAConfig(r=2, alpha=4, targets=["q_proj"])
NOT_A_MODULE = {"a": 1}
CALLS = {
    "fastaf.init_adapter": lambda m: fa.init_adapter(m, CFG),
    "fastaf.functional_call": lambda m: fa.functional_call(m, None, (torch.zeros(1, 2, dtype=torch.long),)),
    "fastaf.generate": lambda m: fa.generate(m, None, torch.zeros(1, 2, dtype=torch.long)),
    "fastaf.init": fa.init,
    "fastaf.load_adapter": lambda m: fa.load_adapter(m, path_or_repo_id="nowhere"),
    "fastaf.save_adapter_to_local_dir": lambda m: fa.save_adapter_to_local_dir(m, path="nowhere", name="a"),
    "fastaf.push_adapter_to_hub": lambda m: fa.push_adapter_to_hub(m, name="a", repo_id="user/a"),
    "fastaf.functional.adapter_mode": lambda m: fa.functional.adapter_mode(m, fa.Adapter({})),
}


@pytest.mark.parametrize("where", sorted(CALLS))
def test_an_entry_point_given_no_module_names_what_it_got(where, tmp_path):
    with pytest.raises(TypeError, match=rf"{where} needs an nn.Module as its model, got a dict: \{{'a': 1\}}"):
        CALLS[where](NOT_A_MODULE)
    assert not (tmp_path / "nowhere").exists()


def test_merging_entry_points_name_what_they_got():
    model = tiny_llama(layers=1)
    adapter = fa.init_adapter(model, CFG, seed=0)
    with pytest.raises(TypeError, match="str"):
        fa.merge_into("model", adapter)
    with pytest.raises(TypeError, match="str"):
        fa.extract_adapter("base", dict(model.named_parameters()), r=2)
