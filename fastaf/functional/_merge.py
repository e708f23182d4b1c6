"""Adapter merging (issue 4): placeholder until the merge module lands."""
from __future__ import annotations


def merge(adapters, weights=None, method="linear", r=None, density=None, seed=None):
    raise NotImplementedError("fastaf.merge is not implemented yet")


def merge_into(model_or_params, adapter):
    raise NotImplementedError("fastaf.merge_into is not implemented yet")


def extract_adapter(base_params, tuned_params, r):
    raise NotImplementedError("fastaf.extract_adapter is not implemented yet")
