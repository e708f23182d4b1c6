"""The tuner's config choice: a screen, then the finalists re-timed in interleaved rounds."""
from __future__ import annotations

import itertools

import pytest

from fastaf.kernels import tuning


def test_best_re_times_the_finalists(monkeypatch):
    """A config that looked fastest in its one screening block (clock drift) loses the
    interleaved re-timing to the one that is fastest every time it is measured again."""
    screen = {"a": 1.00, "b": 0.90, "c": 1.02, "d": 1.50}  # b got lucky once
    again = {"a": itertools.repeat(1.00), "b": itertools.repeat(1.05), "c": itertools.repeat(1.02)}
    seen: list[str] = []

    def fake_bench(fn, rep_ms):
        name = fn()
        seen.append(name)
        return screen[name] if seen.count(name) == 1 else next(again[name])

    monkeypatch.setattr(tuning, "median_ms", fake_bench)
    configs = [{"id": k} for k in screen]
    best, ms = tuning.best_config("gemm", configs, lambda conf: conf["id"], rep_ms=1)
    assert best == {"id": "a"} and ms == 1.00
    assert "d" not in seen[len(screen):]  # only the 3 finalists are re-timed
    assert seen[len(screen):len(screen) + 3] == ["b", "a", "c"]  # interleaved, fastest screen first


def test_best_skips_failing_configs_and_raises_when_none_runs(monkeypatch):
    monkeypatch.setattr(tuning, "median_ms", lambda fn, rep_ms: fn())

    def run(conf):
        if conf["bad"]:
            raise RuntimeError("out of resources")
        return 2.0

    assert tuning.best_config("fwd_h", [{"bad": True}, {"bad": False}], run, rep_ms=1) == ({"bad": False}, 2.0)
    with pytest.raises(RuntimeError, match="no config of fwd_h ran"):
        tuning.best_config("fwd_h", [{"bad": True}], run, rep_ms=1)


@pytest.mark.gpu
def test_gpu_dispatch_timing_measures_both_sides(tmp_path, monkeypatch):
    """fastaf-tune's dispatch entry holds each path's GPU time (its launches alone, from one CUDA
    graph) and its host time (calls queued behind a GPU sleep). At a small shape cuBLAS's call
    (casts, 3 GEMMs, the fp32 grads) costs the host more than its kernels take, and the graphed
    Triton call costs the host less than cuBLAS's."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from fastaf.kernels import cache, launch_graphs

    monkeypatch.setenv("FASTAF_CACHE_DIR", str(tmp_path))
    cache.forget()
    data = cache.empty(cache.device_name(), cache.triton_version())
    graphs = len(launch_graphs.GRAPHS.graphs)
    try:
        tuning.tune_shape(tuning.Shape(M=256, K=256, N=256, R=16), torch.bfloat16, ["dispatch"], data, rep_ms=5,
                          log=lambda line: None)
    finally:
        cache.forget()
    for phase in ("fwd", "bwd"):
        entry = data["dispatch"][f"lora_linear.{phase}"][0]
        ms, host = entry["ms"], entry["host_ms"]
        assert entry["graphed"], entry  # the Triton host time is a launch graph's replay, as eagerly
        assert all(0 < ms[p] < 1 and 0 < host[p] < 5 for p in ("triton", "addmm")), entry
        assert host["addmm"] > ms["addmm"], entry  # tiny GEMMs: the host is the slower side
        assert host["triton"] < host["addmm"], entry  # one launch-graph replay against 7-9 launches
        # each path costs its slower side: here cuBLAS's host, so the Triton path wins
        assert entry["winner"] == ("triton" if max(ms["triton"], host["triton"]) < host["addmm"] else "addmm")
    assert len(launch_graphs.GRAPHS.graphs) <= graphs  # the tuner's launch graphs went with its tensors
