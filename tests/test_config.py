"""fastaf._config: switches read from FASTAF_* variables, validated, overridden per block."""
import threading

import pytest

from fastaf import _config


def test_defaults_and_override_restores_also_on_error():
    assert _config.flags() == _config.Flags()
    with _config.override(carry=False, dispatch="addmm") as inside:
        assert inside is _config.flags() and not inside.carry and inside.dispatch == "addmm"
        with _config.override(carry=True):  # nested, same thread
            assert _config.flags().carry and _config.flags().dispatch == "addmm"
        assert not _config.flags().carry
    assert _config.flags() == _config.Flags()
    with pytest.raises(RuntimeError, match="boom"), _config.override(group=False):
        raise RuntimeError("boom")
    assert _config.flags().group


def test_bad_flags_name_what_was_wrong():
    with pytest.raises(TypeError, match=r"no flag\(s\) \['carri'\].*'carry'"):
        with _config.override(carri=False):
            pass
    with pytest.raises(ValueError, match="'dispatch' takes one of .*got 'cublas'"):
        with _config.override(dispatch="cublas"):
            pass
    with pytest.raises(TypeError, match="'group' takes True or False, got 'no'"):
        with _config.override(group="no"):
            pass
    assert _config.flags() == _config.Flags()


def test_environment_variables_are_read_and_validated():
    env = {"FASTAF_CARRY": "0", "FASTAF_SHARE_INPUT": "always", "FASTAF_LAUNCH_GRAPHS": "off", "OTHER": "x"}
    flags = _config._from_env(env)
    assert (flags.carry, flags.share_input, flags.launch_graphs, flags.group) == (False, "always", False, True)
    with pytest.raises(ValueError, match="FASTAF_GROUP='maybe'"):
        _config._from_env({"FASTAF_GROUP": "maybe"})
    with pytest.raises(ValueError, match="'stateful_impl' takes one of.*FASTAF_"):
        _config._from_env({"FASTAF_STATEFUL_IMPL": "cuda"})


def test_overrides_from_two_threads_never_undo_each_other():
    seen, start = [], threading.Barrier(2)

    def worker(value: str) -> None:
        start.wait()
        for _ in range(200):
            with _config.override(share_input=value):
                seen.append(_config.flags().share_input == value)

    threads = [threading.Thread(target=worker, args=(v,)) for v in ("always", "never")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(seen) and len(seen) == 400
    assert _config.flags().share_input == "compiled"


def test_multi_fuse_forces_either_path_and_launch_graphs_are_read_per_call(monkeypatch):
    """The bench's fused / unfused providers and its launch-graphs A/B set flags per block: the
    kernels read them at each call, not once at import."""
    import torch

    from fastaf.kernels import launch_graphs, lora_multi

    x, w_kn = torch.zeros(8, 16), torch.zeros(16, 16)
    ids, u = torch.zeros(2, dtype=torch.long), torch.zeros(2, 16, 16)
    monkeypatch.setattr(lora_multi, "fused_ok", lambda x, w: True)
    monkeypatch.setattr(lora_multi, "_epilogue_fits", lambda x, w, u: True)
    assert not lora_multi._fuse(x, w_kn, ids, u)  # 8 rows: below FUSE_MIN_ROWS
    with _config.override(multi_fuse="fused"):
        assert lora_multi._fuse(x, w_kn, ids, u)
    with _config.override(multi_fuse="unfused"):
        assert not lora_multi._fuse(torch.zeros(4096, 16), w_kn, ids, u)
    monkeypatch.setattr(launch_graphs, "_FAST_LAUNCH", True)
    cuda_like = type("T", (), {"is_cuda": True})()  # no device: the flag decides before one is asked
    with _config.override(launch_graphs=False):
        assert not launch_graphs.usable(cuda_like)
