"""Hugging Face Hub transfers for adapter folders: upload a saved folder, download adapter files.

Both go through ``huggingface_hub``, so its settings apply: ``HF_ENDPOINT`` (read when
huggingface_hub is imported) picks the server, ``HF_TOKEN`` or a saved login the credentials,
``HF_HUB_CACHE`` where downloads are kept. ``endpoint`` overrides the server per call.
"""
from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit

from huggingface_hub import CommitOperationAdd, HfApi, constants, hf_hub_download
from huggingface_hub.errors import LocalEntryNotFoundError, RemoteEntryNotFoundError

# huggingface_hub retries an unreachable host with back-off (23 s offline here) before it falls
# back to its cache; one plain connect with this timeout tells the same in a moment.
PROBE_TIMEOUT_S = 3.0
_PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def _folder_files(folder: Path) -> list[Path]:
    """Regular files under ``folder``, hidden ones (``.fastaf-tmp-*``, ``.git``) left out."""
    files = []
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if path.is_file() and not any(part.startswith(".") for part in rel.parts):
            files.append(path)
    return files


def upload_folder_to_hub(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    token: str | bool | None = None,
    private: bool | None = None,
    revision: str | None = None,
    commit_message: str = "Upload adapter with fastaf",
    endpoint: str | None = None,
) -> str:
    """Create ``repo_id`` if needed and commit every file of ``folder`` to it in one commit.

    The files are listed explicitly (one ``CommitOperationAdd`` each, paths relative to
    ``folder``) and sent with ``HfApi.create_commit``, so exactly what is in the folder is
    uploaded; hidden files are skipped.

    Args:
        folder: a local directory, e.g. one written by ``fastaf.save_adapter``.
        repo_id: ``"user/name"``; a model repository.
        token: hub token; None uses the saved login / ``HF_TOKEN``.
        private: visibility of a repository that does not exist yet (None: the hub's default);
            an existing repository keeps its visibility.
        revision: branch to commit to (default ``main``); it must exist.
        commit_message: the commit's summary line.
        endpoint: hub URL; None uses ``HF_ENDPOINT`` or huggingface.co.
    Returns:
        The URL of the new commit.
    Raises:
        FileNotFoundError: ``folder`` is not a directory or holds no files.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"upload_folder_to_hub: {str(folder)!r} is not a directory")
    files = _folder_files(folder)
    if not files:
        raise FileNotFoundError(f"upload_folder_to_hub: {str(folder)!r} holds no files to upload")
    api = HfApi(endpoint=endpoint, token=token)
    api.create_repo(repo_id, private=private, repo_type="model", exist_ok=True)
    operations = [
        CommitOperationAdd(path_in_repo=p.relative_to(folder).as_posix(), path_or_fileobj=str(p)) for p in files
    ]
    info = api.create_commit(
        repo_id, operations, commit_message=commit_message, revision=revision, repo_type="model"
    )
    return str(info.commit_url)


def unreachable(endpoint: str) -> str | None:
    """Why ``endpoint`` cannot be connected to, or None when it can (or a proxy decides)."""
    if any(os.environ.get(v) for v in _PROXY_VARS):
        return None  # the proxy, not this machine, connects; let huggingface_hub go through it
    url = urlsplit(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=PROBE_TIMEOUT_S).close()
    except OSError as err:
        return f"{type(err).__name__}: {err}"
    return None


def download_files(
    repo_id: str,
    filenames: Sequence[str],
    *,
    revision: str | None = None,
    token: str | bool | None = None,
    endpoint: str | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> Path:
    """Download ``filenames`` of one model repository and return the local folder holding them.

    Files come into huggingface_hub's cache (``snapshots/<commit>/``), so a second call reads
    them from disk.

    Raises:
        FileNotFoundError: the repository has no file of that name at ``revision``.
        OSError: the hub cannot be reached (one connect attempt, ``PROBE_TIMEOUT_S``) and the
            file is not cached; huggingface_hub's RepositoryNotFoundError and other HTTP errors
            pass through.
        ValueError: the files came from different commits (the repository changed in between).
    """
    server = endpoint or constants.ENDPOINT
    why = None if constants.HF_HUB_OFFLINE else unreachable(server)
    folders = set()
    for name in filenames:
        try:
            path = hf_hub_download(
                repo_id, name, revision=revision, token=token, endpoint=endpoint, cache_dir=cache_dir,
                local_files_only=why is not None,
            )
        except RemoteEntryNotFoundError as err:
            raise FileNotFoundError(
                f"hub repository {repo_id!r} (revision {revision or 'main'}) has no {name}"
            ) from err
        except LocalEntryNotFoundError as err:  # a FileNotFoundError, but the cause is the connection
            cause = why or (
                "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else str(err.__cause__ or err)
            )
            raise OSError(
                f"cannot reach the hub at {server} for {repo_id!r} ({cause}), and {name} is not in the "
                "local cache"
            ) from err
        folders.add(Path(path).parent)
    if len(folders) != 1:
        raise ValueError(
            f"hub repository {repo_id!r}: {list(filenames)} came from different commits "
            f"({sorted(f.name for f in folders)}); pass a commit hash as revision"
        )
    return folders.pop()
