"""A long run stays healthy: memory flat over 300 functional steps, no recompiles after the first.

A step of the one-layer tiny Llama takes ~0.1 s on the 2-core CI machine with one thread (2,000
steps of the two-layer one took 7 minutes). The counts checked are exact: a tensor or a Python
object kept per step shows after the 200 steps past warm-up.
"""
from __future__ import annotations

import gc
import os

import pytest
import torch
import torch.utils._pytree as pytree
from torch._dynamo.testing import CompileCounterWithBackend

import fastaf as fa
from tests._models import tiny_llama, token_batch

TARGETS = ["q_proj", "v_proj", "gate_proj", "down_proj"]


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: 2 OpenMP threads on a 2-core box are 60x slower
    yield
    torch.set_num_threads(threads)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _live_tensors() -> int:
    return sum(isinstance(o, torch.Tensor) for o in gc.get_objects())


def _train_step(model):
    def loss(adapter, ids):
        return fa.functional_call(model, adapter, (ids,), {"labels": ids}).loss

    grad_and_value = torch.func.grad_and_value(loss)

    def step(adapter, ids):
        grads, value = grad_and_value(adapter, ids)
        return pytree.tree_map(lambda p, g: p - 1e-2 * g, adapter, grads), value

    return step


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads RSS from /proc")
def test_three_hundred_steps_keep_memory_flat():
    model = tiny_llama(layers=1)
    adapter = fa.init_adapter(model, fa.LoRAConfig(r=4, alpha=8, targets=TARGETS), seed=0)
    step = _train_step(model)
    marks = {}
    losses = []
    for i in range(300):
        adapter, loss = step(adapter, token_batch(2, 12, seed=i % 64))
        losses.append(float(loss))
        if i in (99, 299):  # past warm-up, and the end
            gc.collect()
            marks[i] = (_rss_mib(), len(gc.get_objects()), _live_tensors())
    (rss0, objects0, tensors0), (rss1, objects1, tensors1) = marks[99], marks[299]
    # only growth counts: other tests' garbage may be freed meanwhile
    assert tensors1 <= tensors0, f"{tensors1 - tensors0} tensors more after 200 steps"
    assert objects1 - objects0 <= 100, f"{objects1 - objects0} Python objects more after 200 steps"
    assert rss1 - rss0 < 32, f"RSS grew {rss1 - rss0:.1f} MiB after warm-up"  # allocator noise: ~3 MiB
    assert sum(losses[-64:]) < sum(losses[:64])  # and it trained (64 batches cycle)
    assert all(torch.isfinite(l.A).all() and torch.isfinite(l.B).all() for l in adapter.values())


def test_compiled_step_never_recompiles_as_batches_change():
    model = tiny_llama(layers=1)  # dynamo traces each layer, slowly on CI
    adapter = fa.init_adapter(model, fa.LoRAConfig(r=4, alpha=8, targets=TARGETS), seed=0)
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(_train_step(model), fullgraph=True, backend=counter)
    adapter, _ = step(adapter, token_batch(2, 12, seed=0))
    assert counter.frame_count == 1
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(1, 12):  # new contents, new adapter values, same shapes
            adapter, loss = step(adapter, token_batch(2, 12, seed=i))
    assert counter.frame_count == 1 and torch.isfinite(loss)
