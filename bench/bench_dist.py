"""FSDP2 and data-parallel LoRA training with the adapter outside the model (one run per launch).

    torchrun --nproc-per-node N bench/bench_dist.py --engine fsdp2|ddp|single --model 1b|8b [--tiny]

Model: BENCH.md's Llama-3.2-1B shape, or a Llama-3-8B shape (hidden 4096, 32 layers, MLP 14336,
8 kv heads), random bf16 weights; LoRA r=16 on q,k,v,o,gate,up,down, fp32 factors, AdamW.
Each step: ``torch.func.grad_and_value`` over ``fa.functional_call`` on the rank's local batch,
``fa.distributed.all_reduce_grads`` (no-op for one process), AdamW.
- single: the model unsharded on one GPU (no process group needed beyond the launcher's).
- fsdp2: ``fully_shard`` on every decoder layer and the model; the adapter replicated.
- ddp: the model replicated; only the adapter's gradients are all-reduced.
Parity: ``--parity-steps`` steps on a fixed global batch (``--global-batch`` sequences split over
the ranks) from seed 0; rank 0 saves the adapter to ``--parity-dir/<model>-<engine>-<gpus>.pt``
and reports ``parity_rel_diff`` (||delta|| / ||A|| over all factors) against the 1-GPU fsdp2
(else single) adapter of that model when it is there. ``--grad autograd`` differentiates with
``torch.autograd.grad`` on the adapter's leaves instead of ``torch.func``. Throughput: then ``--timed-steps`` steps at
``--batch`` sequences per GPU, tokens/s over all GPUs. Rows go to bench/results/dist-<gpu>.json
(appended: each launch adds its rows).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import _harness as H  # noqa: E402

import fastaf as fa  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
}


def make_model(name: str, device: torch.device, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # the same base on every rank
    cfg = LlamaConfig(**SHAPES[name], max_position_embeddings=4096, tie_word_embeddings=False)
    with torch.device(device):
        return LlamaForCausalLM(cfg).to(dtype).train().requires_grad_(False)


def batch(step: int, sequences: int, seq: int, vocab: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (sequences, seq), generator=g).to(device)


def rel_diff(a: fa.Adapter, b: fa.Adapter) -> float:
    num = sum(((x.float() - y.float()) ** 2).sum() for x, y in zip(pytree.tree_leaves(a), pytree.tree_leaves(b)))
    den = sum((y.float() ** 2).sum() for y in pytree.tree_leaves(b))
    return float((num / den).sqrt())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["single", "fsdp2", "ddp"], required=True)
    ap.add_argument("--model", choices=list(SHAPES), default="1b")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4, help="sequences per GPU in the timed steps")
    ap.add_argument("--global-batch", type=int, default=8, help="sequences per parity step, all GPUs")
    ap.add_argument("--parity-steps", type=int, default=20)
    ap.add_argument("--timed-steps", type=int, default=10)
    ap.add_argument("--parity-dir", default="/tmp/fastaf-parity")
    ap.add_argument("--grad", choices=["func", "autograd"], default="func",
                    help="torch.func.grad_and_value, or loss.backward() on the adapter's leaves")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    model = make_model(args.model, device, torch.bfloat16 if cuda else torch.float32)
    if args.engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    elif args.engine == "single" and world != 1:
        raise SystemExit("--engine single runs on one process")
    adapter = fa.distributed.broadcast_adapter(
        fa.init_adapter(model, fa.LoRAConfig(r=16, alpha=32, targets=TARGETS), seed=0, device=device))
    # B = 0 at init would make the first steps' A gradients zero: start from a B the seed fixes
    g = torch.Generator().manual_seed(1)
    adapter = adapter.map(lambda p, l: fa.LoRA(l.A, (torch.randn(l.B.shape, generator=g) * 1e-3).to(l.B), l.scale))
    leaves, spec = pytree.tree_flatten(adapter)
    opt = torch.optim.AdamW(leaves, lr=1e-4, fused=cuda)
    vocab = model.config.vocab_size
    loss_of = lambda ad, ids: fa.functional_call(model, ad, (ids,), {"labels": ids}).loss  # noqa: E731

    def autograd_step(ad: fa.Adapter, ids: torch.Tensor) -> tuple:
        flat = [t.detach().requires_grad_() for t in pytree.tree_leaves(ad)]
        loss = loss_of(pytree.tree_unflatten(flat, spec), ids)
        return pytree.tree_unflatten(list(torch.autograd.grad(loss, flat)), spec), loss.detach()

    step_fn = torch.func.grad_and_value(loss_of) if args.grad == "func" else autograd_step

    def train_step(ids: torch.Tensor) -> torch.Tensor:
        grads, loss = step_fn(pytree.tree_unflatten(leaves, spec), ids)
        grads = fa.distributed.all_reduce_grads(grads) if world > 1 else grads
        for p, gr in zip(leaves, pytree.tree_leaves(grads)):
            p.grad = gr
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} does not split over {world} ranks")
    for step in range(args.parity_steps):
        ids = batch(step, args.global_batch, args.seq, vocab, device)
        loss = train_step(ids[rank::world])
    final = pytree.tree_unflatten([t.detach().cpu() for t in leaves], spec)
    parity = None
    if rank == 0 and args.parity_steps:  # --parity-steps 0: throughput only
        Path(args.parity_dir).mkdir(parents=True, exist_ok=True)
        torch.save(final, Path(args.parity_dir) / f"{args.model}-{args.engine}-{world}.pt")
        # against the first 1-GPU adapter of this model (fsdp2, else single)
        refs = [Path(args.parity_dir) / f"{args.model}-{e}-1.pt" for e in ("fsdp2", "single")]
        ref = next((r for r in refs if r.exists()), None)
        if ref is not None:
            parity = rel_diff(final, torch.load(ref, weights_only=False))
        print(f"parity: {args.parity_steps} steps, last loss {float(loss):.4f}, rel diff {parity}", flush=True)

    if cuda:
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
    for step in range(2):  # warm-up at the timed batch shape
        train_step(batch(10_000 + step, args.batch, args.seq, vocab, device))
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for step in range(args.timed_steps):
        train_step(batch(20_000 + step, args.batch, args.seq, vocab, device))
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    seconds = (time.perf_counter() - t0) / args.timed_steps
    mem = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0
    mems = [None] * world
    dist.all_gather_object(mems, mem)
    if rank == 0:
        row = {"bench": "dist", "engine": args.engine, "gpus": world, "model": args.model, "grad": args.grad,
               "tokens_per_s": round(world * args.batch * args.seq / seconds, 1), "step_ms": round(seconds * 1e3, 2),
               "max_mem_gib": round(max(mems), 2), "parity_rel_diff": parity, "batch_per_gpu": args.batch,
               "seq": args.seq, "parity_steps": args.parity_steps, "global_batch": args.global_batch}
        print(json.dumps(row), flush=True)
        name = "dist" + ("-tiny" if args.model == "tiny" else "")
        old = H.RESULTS / f"{name}-{H.slug(H.gpu_name())}.json"
        rows = json.loads(old.read_text())["rows"] if old.exists() else []
        H.write_results(name, rows + [row], {})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
