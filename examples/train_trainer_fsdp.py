"""The stateful layer under HF ``Trainer`` with FSDP2, configured as users already do, on GPUs.

    torchrun --nproc-per-node 2 examples/train_trainer_fsdp.py [--layers 4] [--steps 20] [--dtype bf16]
    accelerate launch --num_processes 2 examples/train_trainer_fsdp.py     # the same

``fa.init(model)`` + ``add_new_adapter`` + ``set_active_adapter``, then ``Trainer`` with
``fsdp="full_shard", fsdp_config={"fsdp_version": 2, ...}``: accelerate shards every decoder layer,
the embeddings and the root, which holds the adapters (FSDP2 gathers them for each step and averages
their gradients). After training every rank calls ``fa.save_adapter_to_local_dir`` (it gathers the
shards; rank 0 writes one adapter in PEFT's layout).

No network: the model is a random Llama-3.2-1B shape built from its config, with ``--layers``
decoder layers (16 in the real one). The data are counting sequences, so the loss falls. Then rank
0 trains the same adapter in one process on one GPU on the same global batches (a subprocess,
``--no-reference`` skips it) and compares. Prints one PASS/FAIL line per check and, where ``$OUT``
is set, writes ``$OUT/trainer_fsdp.json``. ``--tiny`` shrinks the model to run anywhere; accelerate
runs FSDP only on accelerators, so on CPU Trainer trains with DDP and the FSDP2 check fails.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import fastaf as fa

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Llama-3.2-1B's shape; --tiny: a few MB
SHAPES = {
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                         num_key_value_heads=8, rope_theta=500000.0, tie_word_embeddings=True),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2),
}
SPAN = 64  # sequences count through token ids 0..63 (t, t+1, ... mod 64): quick to learn
PARITY = {"bf16": 1e-2, "fp32": 5e-3}  # |Δ|/|A| over all factors, N ranks vs 1


def build(args) -> LlamaForCausalLM:
    torch.manual_seed(0)  # the same random base everywhere
    cfg = LlamaConfig(**SHAPES["tiny" if args.tiny else "llama-3.2-1b"], num_hidden_layers=args.layers)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    return LlamaForCausalLM(cfg).to(dtype)


def dataset(args) -> list[dict]:
    """``steps`` global batches of counting sequences, in order."""
    gen = torch.Generator().manual_seed(1)
    start = torch.randint(0, SPAN, (args.steps * args.global_batch, 1), generator=gen)
    rows = (start + torch.arange(args.seq)) % SPAN
    return [{"input_ids": row, "labels": row} for row in rows]


class InOrder(Trainer):
    """Batches in dataset order, so one process and N ranks see the same global batches."""

    def _get_train_sampler(self, *args, **kwargs):
        return torch.utils.data.SequentialSampler(self.train_dataset)


def train(args, world: int) -> tuple[Trainer, float]:
    model = fa.init(build(args))
    model.add_new_adapter("counting", fa.LoRAConfig(r=args.r, alpha=2 * args.r, targets=TARGETS), seed=0)
    model.set_active_adapter("counting")
    fsdp = {} if world == 1 else dict(
        fsdp="full_shard",
        fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
    )
    targs = TrainingArguments(
        output_dir=str(args.work / "trainer"), per_device_train_batch_size=args.global_batch // world,
        max_steps=args.steps, learning_rate=args.lr, bf16=args.dtype == "bf16", logging_steps=1,
        report_to=[], save_strategy="no", seed=0, disable_tqdm=True, use_cpu=not torch.cuda.is_available(),
        **fsdp,
    )
    trainer = InOrder(model=model, args=targs, train_dataset=dataset(args))
    start = time.perf_counter()
    trainer.train()
    return trainer, time.perf_counter() - start


def rel_diff(a: fa.Adapter, b: fa.Adapter) -> float:
    """||a - b|| / ||b|| over every factor."""
    num = sum(((a[p].A.float() - b[p].A.float()).norm() ** 2 + (a[p].B.float() - b[p].B.float()).norm() ** 2)
              for p in b)
    den = sum(b[p].A.float().norm() ** 2 + b[p].B.float().norm() ** 2 for p in b)
    return float((num / den) ** 0.5)


def reference(args) -> fa.Adapter:
    """The same run in one process on one device, in a subprocess without the launcher's env."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "GROUP_", "ROLE_", "MASTER_", "TORCHELASTIC",
                                "ACCELERATE_"))}
    if torch.cuda.is_available():  # this rank's GPU, now free
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
        index = torch.cuda.current_device()
        env["CUDA_VISIBLE_DEVICES"] = visible[index] if len(visible) > index and visible[index] else str(index)
    argv = [sys.executable, __file__, "--single", *sys.argv[1:]]
    subprocess.run(argv, env=env, check=True)
    return fa.read_adapter(args.work / "reference")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (Llama-3.2-1B has 16)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--global-batch", type=int, default=8, help="sequences per step over all ranks")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--lr", type=float, help="default 2e-4 (--tiny: 5e-3)")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (a CPU smoke run)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/fastaf-trainer-fsdp"))
    ap.add_argument("--no-reference", action="store_true", help="skip the one-process comparison")
    ap.add_argument("--single", action="store_true", help=argparse.SUPPRESS)  # the reference subprocess
    args = ap.parse_args()
    args.lr = args.lr or (5e-3 if args.tiny else 2e-4)

    if args.single:
        trainer, _ = train(args, world=1)
        fa.save_adapter_to_local_dir(trainer.model, path=args.work / "reference", name="counting")
        return

    world = int(os.environ.get("WORLD_SIZE", 1))
    trainer, seconds = train(args, world)  # TrainingArguments starts the process group
    model, rank = trainer.model, dist.get_rank() if dist.is_initialized() else 0
    checks, result = {}, {"world": world, "layers": args.layers, "dtype": args.dtype, "steps": args.steps,
                          "tiny": args.tiny, "torch": torch.__version__}
    from torch.distributed.fsdp import FSDPModule

    checks["fsdp2"] = isinstance(model, FSDPModule) and all(
        type(p).__name__ == "DTensor" for p in model.fastaf.parameters())  # the adapters are sharded too
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    result.update(losses=losses, tokens_per_s=args.steps * args.global_batch * args.seq / seconds)
    if torch.cuda.is_available():
        result["max_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    checks["loss fell"] = len(losses) == args.steps and sum(losses[-3:]) < sum(losses[:3]) - 0.3  # by 0.1 per step

    folder = args.work / "adapter"
    try:
        fa.save_adapter_to_local_dir(model, path=folder, name="counting")  # every rank; rank 0 writes
        trained = model.get_adapter("counting")  # gathered from the shards
        if dist.is_initialized():
            dist.barrier()
        read = fa.read_adapter(folder)
        files = sorted(p.name for p in folder.iterdir())
        checks["one adapter saved"] = files == ["adapter_config.json", "adapter_model.safetensors"]
        checks["file == trained"] = set(read) == set(trained) and all(
            torch.equal(read[p].A, trained[p].A.cpu()) and torch.equal(read[p].B, trained[p].B.cpu()) for p in read)
    except Exception as err:  # noqa: BLE001 - reported as a failed check
        checks["one adapter saved"] = False
        result["save_error"] = f"{type(err).__name__}: {err}"
    del trainer, model
    gc.collect()
    torch.cuda.empty_cache()

    if not args.no_reference and rank == 0 and "save_error" not in result:
        result["parity_rel_diff"] = rel_diff(read, reference(args))
        checks[f"2 ranks == 1 process (<= {PARITY[args.dtype]:g})"] = result["parity_rel_diff"] <= PARITY[args.dtype]
    if dist.is_initialized():
        dist.barrier()  # the others wait for rank 0's reference
    if rank == 0:
        result["checks"] = checks
        result["pass"] = all(checks.values())
        print(json.dumps({k: v for k, v in result.items() if k != "losses"}, indent=1))
        for name, ok in checks.items():
            print(f"{'PASS' if ok else 'FAIL'}  {name}")
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "trainer_fsdp.json").write_text(json.dumps(result, indent=1) + "\n")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
