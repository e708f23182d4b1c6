"""Adapter files in PEFT's layout (issue 4): placeholder until the I/O module lands."""
from __future__ import annotations


def save_adapter(adapter, directory, *, config=None):
    raise NotImplementedError("fastaf.save_adapter is not implemented yet")


def read_adapter(dir_or_repo_id):
    raise NotImplementedError("fastaf.read_adapter is not implemented yet")
