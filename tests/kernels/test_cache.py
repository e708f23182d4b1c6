"""Tuning cache, dispatch table and fastaf-tune's offline commands, on CPU in a temp dir."""
from __future__ import annotations

import json
import re

import pytest

from fastaf.cli import tune as cli
from fastaf.kernels import cache, dispatch
from fastaf.kernels.tuning import shapes_from_model_config


@pytest.fixture(autouse=True)
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTAF_CACHE_DIR", str(tmp_path))
    cache.forget()
    yield tmp_path
    cache.forget()


def _data():
    data = cache.empty(cache.device_name(), cache.triton_version())
    gemm = data["kernels"].setdefault("lora_linear.gemm", [])
    for M, bm in ((2048, 64), (8192, 128), (16384, 256)):
        cache.upsert(gemm, {"key": {"M": M, "N": 4096, "K": 4096, "R": 16, "dtype": "bfloat16"},
                             "config": {"BLOCK_M": bm}})
    cache.upsert(data["dispatch"].setdefault("lora_linear.fwd", []),
                  {"key": {"M": 8192, "K": 4096, "N": 4096, "R": 16, "dtype": "bfloat16"}, "winner": "triton"})
    return data


def test_roundtrip_and_path(tmp_cache):
    path = cache.save(_data())
    assert path.parent == tmp_cache and path.name.startswith(f"tune-{cache.slug(cache.device_name())}-triton")
    cache.forget()
    assert cache.load(path) == json.loads(path.read_text())


def test_nearest_shape():
    cache.save(_data())
    key = {"M": 9000, "N": 4096, "K": 4096, "R": 16, "dtype": "bfloat16"}
    assert cache.lookup("kernels", "lora_linear.gemm", key)["config"]["BLOCK_M"] == 128
    assert cache.lookup("kernels", "lora_linear.gemm", {**key, "M": 100})["config"]["BLOCK_M"] == 64
    assert cache.lookup("kernels", "lora_linear.gemm", {**key, "M": 10**6})["config"]["BLOCK_M"] == 256
    assert cache.lookup("kernels", "lora_linear.gemm", {**key, "dtype": "float16"}) is None  # dtype must match
    assert cache.lookup("kernels", "lora_linear.fwd_h", key) is None


def test_upsert_replaces_same_key():
    entries = []
    cache.upsert(entries, {"key": {"M": 1}, "config": 1})
    cache.upsert(entries, {"key": {"M": 1}, "config": 2})
    cache.upsert(entries, {"key": {"M": 2}, "config": 3})
    assert [e["config"] for e in entries] == [2, 3]


@pytest.mark.parametrize("text", ["{not json", json.dumps({"version": 999}), json.dumps([1, 2])])
def test_corrupt_file_warns_and_is_ignored(tmp_cache, text):
    path = cache.cache_path()
    path.write_text(text)
    with pytest.warns(UserWarning, match="tuning cache"):
        assert cache.lookup("kernels", "lora_linear.gemm", {"M": 1, "dtype": "bfloat16"}) is None
    # the launcher's default then applies; the dispatch falls back too
    assert dispatch.choose("lora_linear", "fwd", {"M": 1, "K": 1, "N": 1, "R": 1, "dtype": "bfloat16"}, "x") == "addmm"


def test_malformed_entries_warn():
    data = _data()
    data["kernels"]["lora_linear.gemm"] = [{"key": {"M": "oops", "N": 3}}, {"key": {"M": 5, "N": [1]}}]
    cache.save(data)
    with pytest.warns(UserWarning, match="malformed"):
        assert cache.lookup("kernels", "lora_linear.gemm", {"M": 5, "N": 3}) is None


def test_dispatch_charges_triton_its_host_cost():
    key = {"M": 8192, "K": 4096, "N": 4096, "R": 16, "dtype": "bfloat16"}
    assert dispatch.choose("lora_linear", "fwd", key, "NVIDIA A100") == "addmm"  # no cache, none shipped
    data = _data()
    entry = data["dispatch"]["lora_linear.fwd"][0]
    entry["ms"] = {"triton": 0.30, "addmm": 0.45}  # wins by more than 2 launches' host time
    cache.save(data)
    assert dispatch.choose("lora_linear", "fwd", key, cache.device_name()) == "triton"
    assert dispatch.choose("lora_linear", "fwd", {**key, "M": 16384}, cache.device_name()) == "triton"  # nearest
    entry["ms"] = {"triton": 0.44, "addmm": 0.45}  # faster on the GPU, not by enough to pay its launches
    cache.save(data)
    assert dispatch.choose("lora_linear", "fwd", key, cache.device_name()) == "addmm"


def test_dispatch_weighs_each_path_by_its_slower_side():
    """With host times measured, each path costs max(GPU, host): a host-bound cuBLAS call (5-9
    launches) loses to a Triton call that is slower on the GPU but replays from one graph; where
    both are GPU-bound the GPU times decide, and a tie goes to cuBLAS."""
    key = {"M": 4096, "K": 2048, "N": 2048, "R": 16, "dtype": "bfloat16"}
    data = _data()
    data["dispatch"]["lora_linear.bwd"] = [{"key": key, "winner": "triton", "ms": {"triton": 0.10, "addmm": 0.09},
                                            "host_ms": {"triton": 0.03, "addmm": 0.14}}]
    cache.save(data)
    gpu = cache.device_name()
    assert dispatch.choose("lora_linear", "bwd", key, gpu) == "triton"  # 0.10 against the host's 0.14
    decide = dispatch.decide
    assert decide("bwd", {"triton": 0.50, "addmm": 0.45}, {"triton": 0.03, "addmm": 0.14}) == "addmm"
    assert decide("fwd", {"triton": 0.20, "addmm": 0.20}, {"triton": 0.02, "addmm": 0.05}) == "addmm"
    assert decide("fwd", {"triton": 0.02, "addmm": 0.03}, {"triton": 0.05, "addmm": 0.05}) == "addmm"  # host-bound both
    # the old rule for a cache without host times: do_bench times, Triton charged its launches
    assert decide("fwd", {"triton": 0.44, "addmm": 0.45}) == "addmm"
    data["dispatch"]["lora_linear.bwd"][0]["host_ms"] = {"triton": "?"}  # malformed: the old rule
    cache.save(data)
    assert dispatch.choose("lora_linear", "bwd", key, gpu) == "addmm"


def test_shipped_cache_is_the_fallback_and_user_cache_wins():
    key = {"M": 16384, "K": 4096, "N": 14336, "R": 16, "dtype": "bfloat16"}
    h200 = "NVIDIA H200"
    assert cache.shipped_path(h200) is not None
    shipped = cache.lookup("dispatch", "lora_linear.fwd", key, gpu=h200)
    assert shipped is not None and shipped["key"]["M"] == 16384
    assert dispatch.choose("lora_linear", "fwd", key, h200) == dispatch.decide("fwd", shipped["ms"],
                                                                                  shipped.get("host_ms"))
    data = cache.empty(h200, cache.triton_version())
    data["dispatch"]["lora_linear.fwd"] = [{"key": key, "winner": "addmm", "ms": {"triton": 9.0, "addmm": 1.0}}]
    cache.save(data)  # the user's own tuning for this GPU and triton replaces the shipped one
    assert dispatch.choose("lora_linear", "fwd", key, h200) == "addmm"


def test_model_config_shapes():
    cfg = {"hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32, "num_key_value_heads": 8}
    shapes = shapes_from_model_config(cfg)
    assert shapes == [("q_proj", 2048, 2048), ("k_proj", 2048, 512), ("gate_proj", 2048, 8192),
                      ("down_proj", 8192, 2048)]
    assert ("k_proj", 2048, 1024) in shapes_from_model_config({**cfg, "head_dim": 128, "num_attention_heads": 16})


def test_cli_list_and_clear(tmp_cache, capsys):
    data = _data()
    data["dispatch"]["lora_linear.bwd"] = [{"key": {"M": 4096, "K": 2048, "N": 2048, "R": 16, "dtype": "bfloat16"},
                                            "winner": "triton", "ms": {"triton": 0.0931, "addmm": 0.0962},
                                            "host_ms": {"triton": 0.0826, "addmm": 0.1672}}]
    cache.save(data)
    (tmp_cache / "tune-broken-triton0.json").write_text("{")
    with pytest.warns(UserWarning):
        assert cli.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "lora_linear.gemm" in out and "unreadable" in out and "fwd M=8192" in out
    assert "bwd M=4096 K=2048 N=2048 R=16 dtype=bfloat16: triton  (triton 93.1 | 82.6 us, addmm 96.2 | 167.2 us" in out
    assert cli.main(["--clear"]) == 0
    assert not list(tmp_cache.glob("tune-*.json"))


def test_cli_rejects_unknown_kernel():
    with pytest.raises(SystemExit):
        cli.main(["--kernels", "nope"])


def test_cli_shape_parsing(tmp_path):
    assert cli.parse_shapes("4096x14336,14336X4096") == [(4096, 14336), (14336, 4096)]
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}))
    assert cli.model_shapes(str(cfg)) == [(64, 64), (64, 128), (128, 64)]


def test_config_borrowed_from_another_rank_is_fitted_to_shared_memory(monkeypatch):
    """A fwd_h config tuned at r=16 overflowed shared memory at r=64 on the H100 (262144 > 232448
    bytes, Triton's OutOfResources); borrowed configs now lose pipeline stages until they fit."""
    import torch

    from fastaf.kernels import lora_linear_configs as configs
    from fastaf.kernels import lora_linear_plan as plan

    big = {"BLOCK_M": 64, "BLOCK_K": 256, "USE_TMA": 0, "num_warps": 4, "num_stages": 4}
    key16 = {"M": 2048, "K": 4096, "R": 16, "dtype": "bfloat16"}
    data = cache.empty(cache.device_name(), cache.triton_version())
    data["kernels"]["lora_linear.fwd_h"] = [{"key": key16, "config": big}]
    cache.save(data)
    plan.clear_memos()
    monkeypatch.setattr(plan, "smem_limit", lambda device: 232448)  # H100's opt-in limit, as launch_config sees it
    dev = torch.device("cuda", 0)  # only its type and index are read: no GPU needed
    try:
        assert configs.smem_bytes("fwd_h", big, 64, 2) == 262144  # the figure Triton reported
        assert plan.launch_config("fwd_h", dev, key16) == big  # measured at this very shape: trusted as is
        conf = plan.launch_config("fwd_h", dev, {**key16, "R": 64})
        assert conf["num_stages"] == 3 and configs.smem_bytes("fwd_h", conf, 64, 2) <= 232448
        assert {k: v for k, v in conf.items() if k != "num_stages"} == {k: v for k, v in big.items() if k != "num_stages"}
        assert configs.fit("fwd_h", {**big, "BLOCK_M": 4096}, 64, 2, 232448) is None  # cannot fit: the caller's default
    finally:
        plan.clear_memos()


def test_cached_config_keys_follow_this_versions_kernel():
    """A cache entry from another fastaf version: a meta-parameter it lacks comes from the
    default, and one this kernel does not take (a dropped flag) is left out, not passed to Triton."""
    import torch

    from fastaf.kernels import lora_linear_configs as configs
    from fastaf.kernels import lora_linear_plan as plan

    key = {"M": 8192, "K": 4096, "N": 4096, "R": 16, "dtype": "bfloat16", "layout": "nk"}
    old = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4, "SPLIT_STORE": 1}
    data = cache.empty(cache.device_name(), cache.triton_version())
    data["kernels"]["lora_linear.gemm"] = [{"key": key, "config": old}]
    cache.save(data)
    plan.clear_memos()
    try:
        conf = plan.launch_config("gemm", torch.device("cuda", 0), key)
        assert conf == {**configs.DEFAULTS["gemm"], **{k: v for k, v in old.items() if k != "SPLIT_STORE"}}
        assert conf["GROUP_M"] == configs.DEFAULTS["gemm"]["GROUP_M"]  # absent from the entry
    finally:
        plan.clear_memos()


@pytest.mark.parametrize(
    "break_it",
    [
        lambda d: d["kernels"].update({"lora_linear.gemm": ["not an object", 3]}),
        lambda d: d["kernels"].update({"lora_linear.gemm": {"key": 1}}),
        lambda d: d["dispatch"]["lora_linear.fwd"][0].pop("winner"),
        lambda d: d["dispatch"]["lora_linear.fwd"][0].pop("key"),
        lambda d: d["dispatch"]["lora_linear.fwd"][0]["key"].update(M=[8192]),
        lambda d: d["kernels"]["lora_linear.gemm"][0].pop("config"),
    ],
)
def test_malformed_entries_are_one_warning_and_ignored(tmp_cache, capsys, break_it):
    data = _data()
    break_it(data)
    cache.save(data)
    with pytest.warns(UserWarning, match=r"ignoring malformed entries of") as seen:
        assert cli.main(["--list"]) == 0  # no traceback
    assert len(seen) == 1 and "\n" not in str(seen[0].message)
    assert "gpu=" in capsys.readouterr().out
    key = {"M": 8192, "K": 4096, "N": 4096, "R": 16, "dtype": "bfloat16"}
    assert dispatch.choose("lora_linear", "fwd", key, cache.device_name()) in ("triton", "addmm")
    for entry in cache.load().get("kernels", {}).get("lora_linear.gemm", []):
        assert isinstance(entry["config"], dict)  # what survived is well-formed


def test_clear_survives_a_directory_and_an_undeletable_file(tmp_cache, capsys, monkeypatch):
    cache.save(_data())
    (tmp_cache / "tune-dir-triton1.json").mkdir()
    locked = tmp_cache / "tune-locked-triton1.json"
    locked.write_text("{}")
    real_unlink = type(locked).unlink

    def unlink(self, *a, **k):
        if self.name == locked.name:
            raise PermissionError(13, "Permission denied")
        return real_unlink(self, *a, **k)

    monkeypatch.setattr(type(locked), "unlink", unlink)
    assert cli.main(["--clear"]) == 1  # failures reported in the exit status, not a traceback
    captured = capsys.readouterr()
    assert "could not remove" in captured.err and "tune-dir-triton1.json" in captured.err
    assert "Permission denied" in captured.err
    assert sorted(p.name for p in tmp_cache.glob("tune-*.json")) == ["tune-dir-triton1.json", "tune-locked-triton1.json"]


@pytest.mark.parametrize(
    "bad, problem",
    [({"BLOCK_M": 0}, "BLOCK_M=0 is not positive"), ({"num_warps": "eight"}, "num_warps='eight' is not an int"),
     ({"BLOCK_N": 96}, "BLOCK_N=96 is not a power of two"), ({"num_stages": 2.5}, "num_stages=2.5 is not an int"),
     ({"USE_TMA": 2}, "USE_TMA=2 is not 0 or 1"), ({"num_warps": True}, "num_warps=True is not an int")],
)
def test_nonsense_kernel_configs_are_not_launched(bad, problem, monkeypatch):
    import torch

    from fastaf.kernels import lora_linear_configs as configs
    from fastaf.kernels import lora_linear_plan as plan

    monkeypatch.setattr(plan, "smem_limit", lambda device: 232448)  # H100's opt-in limit, as launch_config sees it

    phase = "fwd_h" if "USE_TMA" in bad else "gemm"
    key = {"M": 8192, "K": 4096, "N": 4096, "R": 16, "dtype": "bfloat16", "layout": "nk"}
    data = cache.empty(cache.device_name(), cache.triton_version())
    data["kernels"][f"lora_linear.{phase}"] = [{"key": key, "config": {**configs.DEFAULTS[phase], **bad}}]
    cache.save(data)
    plan.clear_memos()
    try:
        with pytest.warns(UserWarning, match=re.escape(problem)):
            conf = plan.launch_config(phase, torch.device("cuda", 0), key)
        assert configs.config_problem(conf) is None and conf == configs.DEFAULTS[phase]
    finally:
        plan.clear_memos()


def test_a_failed_cache_write_leaves_no_temp_file(tmp_cache):
    with pytest.raises(TypeError):
        cache.save({**_data(), "bad": object()})  # not JSON-serializable
    assert not list(tmp_cache.glob(".tune-*"))


def test_cli_model_config_lists_every_adapted_linear_of_the_built_model(tmp_path, capsys):
    """With a model_type the model is built on the meta device: Falcon's fused query_key_value and
    GPT-2's Conv1D count, a target subset narrows the list, MoE experts (materialised) are left out."""
    import transformers

    falcon = transformers.FalconConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       new_decoder_architecture=False)
    gpt2 = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    mixtral = transformers.MixtralConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)
    cases = [(falcon, "all-linear", ["32x48", "32x32", "32x128", "128x32"]),
             (gpt2, "all-linear", ["32x96", "32x32", "32x128", "128x32"]),
             (gpt2, "c_attn", ["32x96"]),
             (mixtral, "all-linear", ["32x32", "32x16"])]
    for cfg, targets, want in cases:
        path = tmp_path / "config.json"
        path.write_text(json.dumps(cfg.to_dict()))
        assert cli.main(["--model-config", str(path), "--targets", targets, "--print-shapes"]) == 0
        assert capsys.readouterr().out.split() == want, (cfg.model_type, targets)
