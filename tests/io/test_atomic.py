"""Saves killed or failing at any point leave a folder that reads back as the old or the new adapter.

The two adapters differ in rank and alpha, so a mix of one's weights and the other's config fails
to read (rank mismatch) or reads with a wrong scale: either way ``_which`` names neither.
"""
from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch

import fastaf as fa
from fastaf.io import atomic as _atomic, files as _io
from tests._models import random_adapter, tiny_llama

CFG_OLD = fa.LoRAConfig(r=4, alpha=8, targets=["q_proj", "v_proj"])
CFG_NEW = fa.LoRAConfig(r=6, alpha=3, targets=["q_proj", "v_proj"])


@pytest.fixture(scope="module")
def pair():
    model = tiny_llama()
    old = random_adapter(model, CFG_OLD.targets, r=CFG_OLD.r, alpha=CFG_OLD.alpha, seed=1)
    new = random_adapter(model, CFG_NEW.targets, r=CFG_NEW.r, alpha=CFG_NEW.alpha, seed=2)
    return old, new


def _same(a: fa.Adapter, b: fa.Adapter) -> bool:
    return list(a) == list(b) and all(
        torch.equal(a[p].A, b[p].A) and torch.equal(a[p].B, b[p].B) and a[p].scale == b[p].scale for p in a
    )


def _which(folder, pair) -> str:
    """"old" or "new": what the folder reads back as (the test fails on anything else)."""
    adapter, name = _io.read_adapter_and_name(folder)
    old, new = pair
    if _same(adapter, old) and name == "old":
        return "old"
    if _same(adapter, new) and name == "new":
        return "new"
    raise AssertionError(f"{folder} read back as neither adapter: {adapter}, name {name!r}")


def _save(adapter, folder, which: str) -> None:
    fa.save_adapter(adapter, folder, config=CFG_OLD if which == "old" else CFG_NEW, name=which)


def _fork(child) -> int:
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest; a raise exits with 1
        code = 1
        try:
            child()
            code = 0
        except BaseException:
            import traceback

            traceback.print_exc()  # shown in the test's captured output
        finally:
            os._exit(code)
    return pid


def _reap(pid: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError("the saving child hung")


def _clean(folder) -> bool:
    return sorted(p.name for p in folder.iterdir()) == [_io.CONFIG_NAME, _io.WEIGHTS_NAME]


def test_saves_killed_at_random_moments_read_back_whole(tmp_path, pair):
    """60 kills, each after a random number of whole saves and a random part of the next one.

    The child reports each finished save on a pipe, so where the kill lands follows the child's own
    progress, not the wall clock: on a slow machine a fixed sleep could end before any save did.
    """
    folder = tmp_path / "ad"
    _save(pair[0], folder, "old")
    start = time.perf_counter()
    _save(pair[0], folder, "old")
    one_save = time.perf_counter() - start
    rng = random.Random(0)
    seen = set()

    for _ in range(60):  # the issue asks for at least 40 kills
        read_end, write_end = os.pipe()

        def save_forever():
            os.close(read_end)
            for i in range(10**6):
                which = ("new", "old")[i % 2]
                _save(pair[which == "new"], folder, which)
                os.write(write_end, b".")

        pid = _fork(save_forever)
        os.close(write_end)
        for _ in range(rng.randint(1, 2)):  # 1 save done: "new" is whole; 2: "old"
            assert os.read(read_end, 1) == b".", "the saving child died before a save finished"
        time.sleep(rng.uniform(0.0, 1.5 * one_save))  # then into the next save, or past it
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(read_end)
        seen.add(_which(folder, pair))
    assert seen == {"old", "new"}  # the kills landed in different saves
    _save(pair[1], folder, "new")  # the next save finishes or drops every leftover
    assert _which(folder, pair) == "new" and _clean(folder)


def _kill_at_call(n: int, pair, folder) -> None:
    """In a child: SIGKILL itself at the ``n``-th file-system step of a save (fsync, rename, rmdir)."""
    calls = [0]

    def stepping(real):
        def step(*args, **kwargs):
            calls[0] += 1
            if calls[0] == n:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)

        return step

    for name in ("fsync", "replace", "rmdir"):
        setattr(os, name, stepping(getattr(os, name)))
    _save(pair[1], folder, "new")
    os._exit(3)  # got through: n is past the last step


def test_a_save_killed_at_each_step_reads_back_whole(tmp_path, pair):
    outcomes = []
    for n in range(1, 30):
        folder = tmp_path / f"step{n}"
        _save(pair[0], folder, "old")
        pid = _fork(lambda: _kill_at_call(n, pair, folder))
        _, status = os.waitpid(pid, 0)
        if os.WIFEXITED(status):  # no step n: every step has been tried
            assert os.WEXITSTATUS(status) == 3 and _which(folder, pair) == "new"
            break
        outcomes.append(_which(folder, pair))
        _save(pair[0], folder, "old")  # recovery, then a whole save
        assert _which(folder, pair) == "old" and _clean(folder)
    else:
        raise AssertionError("a save took more than 29 file-system steps")
    # before the commit rename the old adapter, from it on the new one
    assert outcomes == sorted(outcomes, key=["old", "new"].index) and set(outcomes) == {"old", "new"}


@pytest.mark.parametrize("failing", [1, 2, 3])
def test_a_failing_rename_leaves_old_or_new(tmp_path, pair, monkeypatch, failing):
    folder = tmp_path / "ad"
    _save(pair[0], folder, "old")
    real, calls = os.replace, [0]

    def replace(src, dst):
        calls[0] += 1
        if calls[0] == failing:
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="No space left"):
        _save(pair[1], folder, "new")
    monkeypatch.setattr(os, "replace", real)
    # the first rename is the commit: failing it keeps the old adapter; later ones, the new
    assert _which(folder, pair) == ("old" if failing == 1 else "new")
    _save(pair[0], folder, "old")
    assert _which(folder, pair) == "old" and _clean(folder)


def test_a_reader_racing_a_writer_sees_whole_adapters(tmp_path, pair):
    folder = tmp_path / "ad"
    _save(pair[0], folder, "old")

    def save_many():
        for i in range(200):
            which = ("new", "old")[i % 2]
            _save(pair[which == "new"], folder, which)

    pid = _fork(save_many)
    reads = 0
    while not os.waitpid(pid, os.WNOHANG)[0]:
        _which(folder, pair)
        reads += 1
    assert reads > 0 and _clean(folder)


def test_leftover_staging_of_a_dead_writer_is_removed_and_a_live_ones_kept(tmp_path, pair):
    folder = tmp_path / "ad"
    _save(pair[0], folder, "old")
    dead = folder / f"{_atomic.STAGING_PREFIX}999999999-x"
    legacy = folder / f"{_atomic.STAGING_PREFIX}abc123"  # an older fastaf's temp dir
    live = folder / f"{_atomic.STAGING_PREFIX}{os.getppid()}-y"
    for d in (dead, legacy, live):
        d.mkdir()
        (d / _io.WEIGHTS_NAME).write_bytes(b"partial")
    assert _which(folder, pair) == "old"  # readers ignore staging folders
    _save(pair[1], folder, "new")
    assert not dead.exists() and not legacy.exists() and live.exists()


def test_four_writers_at_once_all_land_and_readers_see_whole_adapters(tmp_path, pair):
    folder = tmp_path / "ad"
    _save(pair[0], folder, "old")

    def save_many(which):
        def run():
            for _ in range(60):
                _save(pair[which == "new"], folder, which)
        return run

    pids = [_fork(save_many(("new", "old")[i % 2])) for i in range(4)]
    statuses = []
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        statuses.append(os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1)
    assert statuses == [0, 0, 0, 0]  # no writer raised (a raise in the child exits non-zero)
    assert _which(folder, pair) in ("old", "new") and _clean(folder)


def test_a_pending_commit_is_readable_by_other_users(tmp_path, pair, monkeypatch):
    folder = tmp_path / "ad"
    _save(pair[0], folder, "old")
    real, calls = os.replace, [0]

    def replace(src, dst):  # stop after the commit rename, as a kill there would
        calls[0] += 1
        if calls[0] == 2:
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError):
        _save(pair[1], folder, "new")
    assert (folder / _atomic.COMMIT_DIR).stat().st_mode & 0o055 == 0o055  # group/other may list and enter
