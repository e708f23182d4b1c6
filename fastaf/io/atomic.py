"""Replace a set of files in one directory as a unit, and read them back as one snapshot.

A writer puts the new files into a staging folder ``.fastaf-tmp-<pid>-*`` beside them, fsyncs
it, and renames it to ``.fastaf-commit``: that rename is the commit point. It then moves the
files into place one by one and removes the empty commit folder. A reader takes each file from
``.fastaf-commit`` while it is there, else from the directory, and reads again if the directory
changed under it. So whenever a writer is killed, a reader sees the complete old set or the
complete new one:

- killed before the commit point: the old files are untouched; the staging folder is a leftover
  that the next write removes (its pid is gone) and readers never look at;
- killed after it: ``.fastaf-commit`` holds every new file not yet moved; readers use it, and the
  next write finishes the moves before it starts its own.

Other files in the directory are left alone. Readers never write, so read-only folders (a hub
cache) work. Tools that do not know the protocol (PEFT) see the old set or the new set, except
after a writer was killed past its commit point: then a mix, until the next fastaf save there.
"""
from __future__ import annotations

import errno
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NoReturn

COMMIT_DIR = ".fastaf-commit"
STAGING_PREFIX = ".fastaf-tmp-"
_READ_ATTEMPTS = 50  # a concurrent writer changes the folder for milliseconds; 50 x 10 ms is ample
_COMMIT_ATTEMPTS = 200  # 4 writers x 150 saves each: 11-23 failures per writer with one retry


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _stale_staging(entry: Path) -> bool:
    """A staging folder whose writer is gone (or an older fastaf's ``.fastaf-tmp-<random>``)."""
    pid = entry.name[len(STAGING_PREFIX):].split("-", 1)[0]
    return not pid.isdigit() or not _pid_alive(int(pid))


def finish_pending(directory: Path) -> None:
    """Complete a write that passed its commit point, then drop stale staging folders."""
    commit = directory / COMMIT_DIR
    try:
        pending = sorted(os.listdir(commit))
    except (FileNotFoundError, NotADirectoryError):  # none, or another writer just finished it
        pending = None
    if pending is not None:
        for name in pending:
            try:
                os.replace(commit / name, directory / name)
            except FileNotFoundError:  # a concurrent writer moved it first
                pass
        _fsync(directory)
        try:
            os.rmdir(commit)
        except OSError as err:
            if err.errno not in (errno.ENOENT, errno.ENOTEMPTY, errno.EEXIST):
                raise
    for entry in directory.glob(f"{STAGING_PREFIX}*"):
        if entry.is_dir() and _stale_staging(entry):
            shutil.rmtree(entry, ignore_errors=True)


def replace_files(directory: Path, writers: Mapping[str, Callable[[Path], None]]) -> None:
    """Replace the files ``writers`` names in ``directory`` (created if missing) as one unit.

    Args:
        directory: the folder that holds the set.
        writers: file name -> a function that writes that file's new content to the path given.
    Raises:
        Whatever a writer or the file system raises. Before the commit point nothing has changed
        and the staging folder is removed; after it, readers already see the new set.
    """
    directory.mkdir(parents=True, exist_ok=True)
    finish_pending(directory)
    try:
        staging = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-", dir=directory))
    except OSError as err:
        _raise_refused(err, directory)
    try:
        # mkdtemp makes it 0700; as the commit folder, readers of other users must see into it
        os.chmod(staging, 0o755)
        for name, write in writers.items():
            write(staging / name)
            _fsync(staging / name)
        _fsync(staging)
        _commit(staging, directory)
    except OSError as err:
        shutil.rmtree(staging, ignore_errors=True)
        _raise_refused(err, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finish_pending(directory)


def _raise_refused(err: OSError, directory: Path) -> NoReturn:
    """Raise ``err`` again, or, where it names the hidden staging or commit folder (the file system
    refused the write there), the same class and errno naming the folder the caller asked for."""
    where = str(err.filename or "")
    if where and STAGING_PREFIX not in where and COMMIT_DIR not in where:
        raise err  # names a path of the caller's already
    raise type(err)(err.errno, err.strerror or str(err), str(directory)) from err


def _commit(staging: Path, directory: Path) -> None:
    """Rename ``staging`` to the commit folder: the commit point. Another writer's commit folder
    in the way is finished first; a run of them (writers in a loop) is waited out, then an error."""
    for _ in range(_COMMIT_ATTEMPTS):
        try:
            os.replace(staging, directory / COMMIT_DIR)
            return
        except OSError as err:
            if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        finish_pending(directory)
        time.sleep(0.005)
    raise OSError(f"{directory}: other saves kept committing for {_COMMIT_ATTEMPTS} tries; this save was not applied")


def _state(directory: Path, names: Sequence[str]) -> tuple:
    """What changes whenever a writer renames anything the reader looks at."""
    paths = [directory / COMMIT_DIR]
    paths += [directory / n for n in names] + [directory / COMMIT_DIR / n for n in names]
    out = []
    for path in paths:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            out.append(None)
        else:
            out.append((st.st_ino, st.st_mtime_ns, st.st_size))
    return tuple(out)


def read_files(directory: Path, names: Sequence[str]) -> dict[str, bytes | None]:
    """The files ``names`` of ``directory`` as bytes from one consistent state (None: absent).

    Raises:
        OSError: the folder kept changing for the whole retry budget (a writer in a loop).
    """
    for _ in range(_READ_ATTEMPTS):
        before = _state(directory, names)
        try:
            out = {}
            for name in names:
                pending = directory / COMMIT_DIR / name
                path = pending if pending.is_file() else directory / name
                out[name] = path.read_bytes() if path.is_file() else None
        except FileNotFoundError:  # moved between the check and the read
            out = None
        if out is not None and _state(directory, names) == before:
            return out
        time.sleep(0.01)
    raise OSError(f"{directory} kept changing while {list(names)} were read; is a save running in a loop?")
