"""Adapters on several processes: torch.distributed calls for values that live outside the model.

FSDP2 (``torch.distributed.fsdp.fully_shard``) shards the frozen base; the adapter is replicated
on every rank and passed to ``fastaf.functional_call`` as usual: the call reads each weight when
its module runs, so it meets FSDP2's unsharded weight. Differentiate with autograd
(``torch.autograd.grad`` on the adapter's leaves) or one eager ``torch.func.grad`` level, under
which ``functional_call`` runs the model below the level as plain autograd. FSDP2's own hooks do
not run *at* a functorch level on CUDA (its all-gather copies into captured tensors and its
post-backward hook is an old-style ``autograd.Function``; torch 2.11), so a second transform
(``vmap(grad)``, grad of grad) or ``torch.compile`` over a sharded model is refused by
``functional_call``. Without sharding (data parallel), every transform works. DDP's wrapper does not serve here (it
cannot run ``torch.autograd.grad``, and the adapter is not in the model), so the adapter's
gradients are averaged explicitly with ``all_reduce_grads``::

    adapter = fa.distributed.broadcast_adapter(fa.init_adapter(model, cfg, seed=0))
    grads, loss = torch.func.grad_and_value(loss_fn)(adapter, local_batch)   # data parallel
    grads = fa.distributed.all_reduce_grads(grads)     # the mean over ranks, every rank

The stateful layer (``fa.init(model)``) under HF ``Trainer`` or accelerate with FSDP2 needs none
of this: its adapters are Parameters of the root module, which FSDP2 shards, gathers and averages
itself (``examples/train_trainer_fsdp.py``).

Nothing here communicates on its own schedule: each function is one or a few collectives that
every rank of ``group`` must call, in the same order.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

T = TypeVar("T")


def _buckets(leaves: list[torch.Tensor]) -> dict[tuple[torch.dtype, torch.device], list[int]]:
    """Leaf indices grouped by (dtype, device): one flat buffer, one collective per group."""
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(leaves):
        groups.setdefault((t.dtype, t.device), []).append(i)
    return groups


def _flat_leaves(tree: Any, what: str) -> tuple[list[torch.Tensor], Any]:
    leaves, spec = pytree.tree_flatten(tree)
    for i, t in enumerate(leaves):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"fastaf.distributed.{what}: leaf {i} is a {type(t).__name__}, not a tensor")
    return leaves, spec


def _check_same_structure(leaves: list[torch.Tensor], spec: Any, what: str, group: dist.ProcessGroup | None) -> None:
    """Every rank holds the same tree: keys in the same order, shapes, dtypes. The collectives
    pair tensors by position, so an adapter whose keys another rank lists in another order would
    swap layers without a word (and a missing one would abort the job inside the backend). One
    small collective: each rank's fingerprint of its structure, its max and min over the group."""
    text = repr((str(spec), [(tuple(t.shape), str(t.dtype)) for t in leaves]))
    value = int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "big")  # fits an int64
    device = leaves[0].device if leaves else torch.device("cpu")
    both = torch.tensor([value, -value], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    if int(both[0]) != -int(both[1]):
        raise ValueError(
            f"fastaf.distributed.{what}: the ranks hold trees of different structure (keys, their order, shapes "
            f"or dtypes); the tensors are paired by position, so every rank must pass the same one. This rank "
            f"has {len(leaves)} tensors: {str(spec)[:300]}"
        )


def _check_group(what: str) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"fastaf.distributed.{what}: torch.distributed is not initialized "
                           "(call torch.distributed.init_process_group, or launch with torchrun)")


def _through_buckets(leaves: list[torch.Tensor], collective: Callable[[torch.Tensor], Any]) -> list[torch.Tensor]:
    """New tensors like ``leaves`` after ``collective`` ran in place on one flat copy per
    (dtype, device): one collective per bucket, not per tensor; the inputs are left unchanged."""
    out: list[torch.Tensor | None] = [None] * len(leaves)
    for indices in _buckets(leaves).values():
        flat = torch.cat([leaves[i].detach().reshape(-1) for i in indices])  # a copy
        collective(flat)
        for i, piece in zip(indices, flat.split([leaves[i].numel() for i in indices])):
            out[i] = piece.view_as(leaves[i])
    return out


def all_reduce_grads(grads: T, *, group: dist.ProcessGroup | None = None) -> T:
    """The mean of ``grads`` over the ranks of ``group``, as new tensors of the same structure.

    Args:
        grads: an ``Adapter`` of gradients (what ``torch.func.grad`` returns) or any pytree of
            tensors; the same structure (an Adapter's keys in the same order), shapes and dtypes
            on every rank, checked by one small collective before the reduction.
        group: the process group (default: the world).
    Returns:
        A tree like ``grads``; ``grads`` itself is left unchanged.
    """
    _check_group("all_reduce_grads")
    leaves, spec = _flat_leaves(grads, "all_reduce_grads")
    _check_same_structure(leaves, spec, "all_reduce_grads", group)
    world = dist.get_world_size(group)

    def mean(flat: torch.Tensor) -> None:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)  # gloo has no AVG
        flat /= world

    return pytree.tree_unflatten(_through_buckets(leaves, mean), spec)


def broadcast_adapter(adapter: T, *, src: int = 0, group: dist.ProcessGroup | None = None) -> T:
    """``adapter`` with every tensor replaced by rank ``src``'s values (new tensors), so training
    starts from one adapter on every rank whatever each rank's seed or initialisation."""
    _check_group("broadcast_adapter")
    leaves, spec = _flat_leaves(adapter, "broadcast_adapter")
    _check_same_structure(leaves, spec, "broadcast_adapter", group)
    return pytree.tree_unflatten(_through_buckets(leaves, lambda flat: dist.broadcast(flat, src=src, group=group)), spec)


def is_writer() -> bool:
    """True where files should be written: no process group, or rank 0 of the world."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
