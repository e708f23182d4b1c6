"""The stateful layer under HF ``Trainer`` with FSDP2, configured as users do (``fsdp="full_shard"``,
``fsdp_config={"fsdp_version": 2, ...}``), on two gloo processes: the adapter trained on two ranks
equals one process trained on the same global batch (fp32), and ``save_adapter_to_local_dir``,
called on every rank, writes one adapter in PEFT's layout from rank 0 that loads back as trained.
Adding an adapter after sharding and running a submodule alone are clear errors.

accelerate (1.15) runs FSDP only on accelerators: on CPU its state says MULTI_CPU, drops the FSDP
plugin, and ``Trainer`` silently trains with DDP. ``_fsdp_on_cpu`` gives the state a GPU run gets
(distributed type FSDP, the plugin kept); all the rest is accelerate's and torch's own code:
``fsdp2_prepare_model`` (``fully_shard`` per decoder layer, the embeddings, the tail, the root,
which holds the adapters), activation checkpointing, the optimizer over the sharded Parameters,
FSDP2's gradient reduce-scatter and clipping. ``examples/train_trainer_fsdp.py`` runs the same on
GPUs without it. One start runs every case (forked: ``tests.test_distributed.start_ranks``).
"""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
from transformers import Trainer, TrainingArguments

import fastaf as fa
from tests._models import tiny_llama, token_batch
from tests.test_distributed import _free_port, start_ranks

WORLD, STEPS, BATCH = 2, 4, 4  # BATCH: the global batch, split over the ranks
CONFIG = fa.LoRAConfig(r=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"])
FSDP = dict(fsdp="full_shard", fsdp_config={"fsdp_version": 2, "activation_checkpointing": True})
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built")


def _fsdp_on_cpu() -> None:
    """Keep accelerate's FSDP plugin on CPU: after its state's init, set what a GPU run sets."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    # a forked rank inherits the parent's singleton state (a Trainer may have run there): start afresh
    AcceleratorState._reset_state(reset_partial_state=True)
    init = AcceleratorState.__init__

    def fsdp_init(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type, self.fsdp_plugin = DistributedType.FSDP, fsdp_plugin

    AcceleratorState.__init__ = fsdp_init


def _train(folder: str, per_device: int, **fsdp) -> Trainer:
    """The stateful layer's adapter "sql" trained by Trainer for STEPS global batches."""
    model = fa.init(tiny_llama())
    model.add_new_adapter("sql", CONFIG, seed=0)
    model.set_active_adapter("sql")
    rows = torch.cat([token_batch(BATCH, 12, seed=s) for s in range(STEPS)])
    data = [{"input_ids": row, "labels": row} for row in rows]
    args = TrainingArguments(
        output_dir=folder, per_device_train_batch_size=per_device, max_steps=STEPS, learning_rate=1e-2,
        train_sampling_strategy="sequential",  # the same global batches in one process and on two
        use_cpu=True, report_to=[], save_strategy="no", logging_steps=1, seed=0, disable_tqdm=True, **fsdp,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    return trainer


def _losses(trainer: Trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _worker(rank: int, port: int, folder: str) -> None:
    torch.set_num_threads(1)  # before any op: a forked child must not enter the parent's OpenMP pool
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))
    _fsdp_on_cpu()
    from torch.distributed.fsdp import FSDPModule

    trainer = _train(os.path.join(folder, f"trainer{rank}"), BATCH // WORLD, **FSDP)
    model = trainer.model
    results = {
        "fsdp": isinstance(model, FSDPModule) and isinstance(model.model.layers[0], FSDPModule),
        "sharded": [type(p).__name__ for p in model.fastaf.parameters()],
        "losses": _losses(trainer),
    }
    fa.save_adapter_to_local_dir(model, path=os.path.join(folder, "adapter"), name="sql")  # every rank
    results["trained"] = model.get_adapter("sql")  # gathered from the shards
    dist.barrier()  # rank 0 has written
    results["read"] = fa.read_adapter(os.path.join(folder, "adapter"))
    try:
        model.add_new_adapter("late", fa.LoRAConfig(r=2, alpha=2, targets=["k_proj"]))
    except RuntimeError as err:
        results["late"] = str(err)
    try:
        model.model.layers[0].self_attn.q_proj(torch.randn(1, 3, 32))  # FSDP2 gathers neither
    except RuntimeError as err:
        results["alone"] = str(err)
    torch.save(results, os.path.join(folder, f"results{rank}.pt"))
    dist.destroy_process_group()


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_trainer_fsdp2_trains_like_one_process_and_rank_0_saves_one_adapter(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # gloo on the CPU, also where GPUs are (fewer than ranks)
    start_ranks(_worker, _free_port(), str(tmp_path))
    ranks = [torch.load(tmp_path / f"results{r}.pt", weights_only=False) for r in range(WORLD)]
    reference = _train(str(tmp_path / "reference"), BATCH)  # one process, the global batch
    expected = reference.model.get_adapter("sql")
    start = fa.init_adapter(tiny_llama(), CONFIG, seed=0)
    for r, got in enumerate(ranks):
        assert got["fsdp"] and set(got["sharded"]) == {"DTensor"}, (r, got["sharded"])  # FSDP2 ran
        torch.testing.assert_close(got["losses"], _losses(reference), rtol=1e-6, atol=0)  # the global batch's
        assert set(got["trained"]) == set(expected)
        for path, lora in expected.items():
            assert torch.count_nonzero(lora.B) > 0 and not torch.equal(lora.A, start[path].A)  # it trained
            for factor in ("A", "B"):
                # measured: <= 2.1e-6 (AdamW magnifies fp32 rounding where a gradient is near 0)
                diff = _rel_diff(getattr(got["trained"][path], factor), getattr(lora, factor))
                assert diff < 1e-5, (r, path, factor, diff)
        for path, lora in ranks[0]["trained"].items():  # the file holds what rank 0 trained, bit for bit
            assert torch.equal(got["read"][path].A, lora.A) and torch.equal(got["read"][path].B, lora.B)
            assert got["read"][path].scale == lora.scale
        assert "already sharded" in got["late"] and "before sharding" in got["late"]
        assert "FSDP2 shards" in got["alone"] and "model.layers.0.self_attn.q_proj" in got["alone"]
    folder = tmp_path / "adapter"
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    peft_config = json.loads((folder / "adapter_config.json").read_text())
    assert (peft_config["r"], peft_config["lora_alpha"]) == (4, 8)
    fresh = tiny_llama()
    assert fa.load_adapter(fresh, path_or_repo_id=folder) == "sql"  # the name it was saved under
    ids = token_batch(2, 12, seed=9)
    fresh.set_active_adapter("sql")
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids).logits, reference.model(ids).logits, rtol=1e-4, atol=1e-5)
