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

    monkeypatch.setattr(tuning, "_bench", fake_bench)
    configs = [{"id": k} for k in screen]
    best, ms = tuning._best("gemm", configs, lambda conf: conf["id"], rep_ms=1)
    assert best == {"id": "a"} and ms == 1.00
    assert "d" not in seen[len(screen):]  # only the 3 finalists are re-timed
    assert seen[len(screen):len(screen) + 3] == ["b", "a", "c"]  # interleaved, fastest screen first


def test_best_skips_failing_configs_and_raises_when_none_runs(monkeypatch):
    monkeypatch.setattr(tuning, "_bench", lambda fn, rep_ms: fn())

    def run(conf):
        if conf["bad"]:
            raise RuntimeError("out of resources")
        return 2.0

    assert tuning._best("fwd_h", [{"bad": True}, {"bad": False}], run, rep_ms=1) == ({"bad": False}, 2.0)
    with pytest.raises(RuntimeError, match="no config of fwd_h ran"):
        tuning._best("fwd_h", [{"bad": True}], run, rep_ms=1)
