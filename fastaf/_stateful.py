"""The stateful convenience layer for HF Trainer / generate (issue 4): placeholder."""
from __future__ import annotations


def init(model):
    raise NotImplementedError("fastaf.init is not implemented yet")


def save_adapter_to_local_dir(model, *, path, name):
    raise NotImplementedError


def load_adapter(model, *, path_or_repo_id, name=None):
    raise NotImplementedError


def push_adapter_to_hub(model, *, name, repo_id, **kwargs):
    raise NotImplementedError
