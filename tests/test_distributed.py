"""Two processes on gloo: FSDP2 (autograd and eager torch.func, with eager or compiled blocks) and
data-parallel (torch.func) steps with the adapter outside the model match a single process
training on the global batch; a call traced whole over FSDP2 modules, and torch.func over them on
the per-op path, are clear errors; only rank 0 writes files, every rank reads them. The same
cases on NCCL, one GPU per rank (marker `gpu`, 2 GPUs).

One start runs every case. The ranks are forked from the test's process: a spawned one imports
torch, transformers and dynamo again, a minute on CI's 2 cores.
"""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.utils._pytree as pytree

import fastaf as fa
from fastaf import _config
from tests._models import random_adapter, tiny_llama, token_batch

TARGETS = ["q_proj", "v_proj", "down_proj"]
WORLD, STEPS = 2, 4
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built")


def _batches(device: torch.device | str = "cpu"):
    """The global batch of each step: 4 sequences, split by rank as ids[rank::WORLD]."""
    return [token_batch(4, 12, seed=s).to(device) for s in range(STEPS)]


def _model(device: torch.device | str) -> torch.nn.Module:
    """One decoder layer: FSDP2 shards it and the root; dynamo compiles each block, slowly on CI."""
    return tiny_llama(layers=1).to(device)


def _to(tree, device: torch.device | str):
    """An adapter (any pytree of tensors) with every tensor on ``device``."""
    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, tree)


def _loss(model, adapter, ids):
    return fa.functional_call(model, adapter, (ids,), {"labels": ids}).loss


def _train(model, adapter, batches, grad_of, reduce=lambda g: g):
    """AdamW over the adapter's leaves for each batch; returns the final adapter."""
    leaves, spec = pytree.tree_flatten(adapter)
    leaves = [t.detach().clone() for t in leaves]
    opt = torch.optim.AdamW(leaves, lr=1e-2)
    for ids in batches:
        grads = reduce(grad_of(model, pytree.tree_unflatten(leaves, spec), ids))
        for p, g in zip(leaves, pytree.tree_leaves(grads)):
            p.grad = g
        opt.step()
    return pytree.tree_unflatten(leaves, spec)


def _func_grad(model, adapter, ids):
    return torch.func.grad(lambda a: _loss(model, a, ids))(adapter)


def _autograd_grad(model, adapter, ids):
    leaves, spec = pytree.tree_flatten(adapter)
    leaves = [t.detach().requires_grad_() for t in leaves]
    grads = torch.autograd.grad(_loss(model, pytree.tree_unflatten(leaves, spec), ids), leaves)
    return pytree.tree_unflatten(list(grads), spec)


def _sharded(device: torch.device, compiled: bool = False) -> torch.nn.Module:
    """tiny_llama with each block and the whole model under FSDP2; ``compiled``: each block then
    compiled, as FSDP2 recipes do."""
    from torch.distributed.fsdp import fully_shard

    model = _model(device)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    if compiled:
        for layer in model.model.layers:
            layer.compile(backend="aot_eager")
    return model


def _worker(rank: int, port: int, folder: str, backend: str = "gloo") -> None:
    """Every case on this rank; ``backend`` "nccl": on GPU ``rank``, else gloo on the CPU."""
    torch.set_num_threads(1)  # before any op: a forked child must not enter the parent's OpenMP pool
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=WORLD, device_id=device if device.type == "cuda" else None)
    results = {}
    local = [ids[rank::WORLD] for ids in _batches(device)]
    # every rank starts from rank 0's adapter, whatever its own seed
    adapter = fa.distributed.broadcast_adapter(_to(random_adapter(_model("cpu"), TARGETS, seed=10 + rank), device))
    results["start"] = adapter
    reduce = fa.distributed.all_reduce_grads
    results["ddp-func"] = _train(_model(device), adapter, local, _func_grad, reduce)
    sharded = _sharded(device)
    results["fsdp2-autograd"] = _train(sharded, adapter, local, _autograd_grad, reduce)
    # one eager grad level: the sharded model runs below it, under plain autograd
    results["fsdp2-func"] = _train(sharded, adapter, local, _func_grad, reduce)
    try:  # per op, FSDP2's hooks are not functorch-compatible on CUDA: refused before anything runs
        with _config.override(below_grad=False):
            _func_grad(sharded, adapter, local[0])
    except NotImplementedError as err:
        results["fsdp2-func-error"] = str(err)
    # compiled as FSDP2 recipes compile: each block after fully_shard, the call itself eager
    # (aot_eager: Inductor's CPU codegen adds a minute on CI's 2 cores)
    torch._dynamo.utils.counters.clear()
    results["fsdp2-compiled-autograd"] = _train(_sharded(device, compiled=True), adapter, local, _autograd_grad, reduce)
    # the eager call's sibling grouping stays out of the compiled blocks (it broke each in 8 places)
    results["graph-breaks"] = dict(torch._dynamo.utils.counters["graph_break"])
    # torch.func's backward keeps the graph (a vjp_fn may run twice): AOTAutograd's donated buffers
    # refuse that, so blocks differentiated by torch.func are compiled without them
    with torch._functorch.config.patch(donated_buffer=False):
        results["fsdp2-compiled-func"] = _train(_sharded(device, compiled=True), adapter, local, _func_grad, reduce)
    try:  # traced whole, FSDP2's unsharding is out of sight: refused
        torch.compile(_loss, backend="aot_eager", fullgraph=True)(sharded, adapter, local[0])
    except Exception as err:
        results["fsdp2-traced-error"] = f"{type(err).__name__}: {err}"
    # the same LoRAs with rank 1's keys in another order: paired by position, its layers would swap
    keys = list(adapter) if rank == 0 else list(adapter)[::-1]
    try:
        fa.distributed.all_reduce_grads(fa.Adapter({k: adapter[k] for k in keys}))
    except ValueError as err:
        results["order-error"] = str(err)
    try:  # DDP averages only the parameters it was built with: an adapter added under it never would be
        fa.init(torch.nn.parallel.DistributedDataParallel(_model(device)))
    except TypeError as err:
        results["ddp-init-error"] = str(err)
    # every rank saves its own adapter to one folder: rank 0's must be what every rank reads
    fa.save_adapter(results["fsdp2-autograd"] if rank == 0 else results["start"], folder, name=f"rank{rank}")
    dist.barrier()
    results["read"] = fa.read_adapter(folder)
    results = _to(results, "cpu")
    torch.save(results, os.path.join(folder, f"results{rank}.pt"))
    dist.destroy_process_group()


def start_ranks(worker, *args, fork: bool = True) -> None:
    """``worker(rank, *args)`` in WORLD processes, forked (CPU) or spawned (CUDA: a forked child
    cannot initialise CUDA); raises if any rank fails."""
    mp.start_processes(worker, args=args, nprocs=WORLD, start_method="fork" if fork else "spawn")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _assert_close(a: fa.Adapter, b: fa.Adapter, what: str) -> None:
    assert set(a) == set(b), what
    for path in a:  # by path: read_adapter orders paths naturally, not in model order
        torch.testing.assert_close(a[path].A, b[path].A, rtol=1e-5, atol=1e-6, msg=f"{what}: {path}")
        torch.testing.assert_close(a[path].B, b[path].B, rtol=1e-5, atol=1e-6, msg=f"{what}: {path}")
        assert a[path].scale == b[path].scale, what


def _check_ranks(folder, device: torch.device) -> None:
    """Every rank's cases against one process training on the global batch on ``device``."""
    ranks = [torch.load(folder / f"results{r}.pt", weights_only=False) for r in range(WORLD)]
    torch.set_num_threads(1)
    start = random_adapter(_model("cpu"), TARGETS, seed=10)
    _assert_close(ranks[1]["start"], start, "broadcast gives rank 0's adapter")
    reference = _to(_train(_model(device), _to(start, device), _batches(device), _func_grad), "cpu")  # global batch
    for case in ("ddp-func", "fsdp2-autograd", "fsdp2-func", "fsdp2-compiled-autograd", "fsdp2-compiled-func"):
        for r in range(WORLD):
            _assert_close(ranks[r][case], reference, f"{case} on rank {r}")
    for r in range(WORLD):
        assert ranks[r]["graph-breaks"] == {}, ranks[r]["graph-breaks"]
        assert "FSDP2" in ranks[r]["fsdp2-func-error"] and "autograd" in ranks[r]["fsdp2-func-error"]
        assert "model.layers.0.self_attn.q_proj" in ranks[r]["fsdp2-traced-error"]
        assert "compile each block" in ranks[r]["fsdp2-traced-error"]
        _assert_close(ranks[r]["read"], ranks[0]["fsdp2-autograd"], f"rank {r} read rank 0's file")  # rank 0 wrote
        assert "ranks hold trees of different structure" in ranks[r]["order-error"], r
        assert "got DistributedDataParallel wrapping a LlamaForCausalLM" in ranks[r]["ddp-init-error"], r
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith("results")) == [
        "adapter_config.json", "adapter_model.safetensors"]


def test_fsdp2_and_data_parallel_match_one_process(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # gloo on the CPU, also where GPUs are (fewer than ranks)
    start_ranks(_worker, _free_port(), str(tmp_path))
    _check_ranks(tmp_path, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} CUDA GPUs")
def test_gpu_nccl_ranks_match_one_process(tmp_path):
    """The same cases on NCCL, one GPU per rank, fp32 (tiny shapes: cuBLAS, no atomics)."""
    start_ranks(_worker, _free_port(), str(tmp_path), "nccl", fork=False)
    _check_ranks(tmp_path, torch.device("cuda", 0))


def test_helpers_refuse_without_a_process_group():
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        fa.distributed.all_reduce_grads([torch.ones(2)])
    assert fa.distributed.is_writer()
