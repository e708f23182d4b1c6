"""Train one LoRA adapter on several processes: FSDP2 shards the frozen base, the adapter is
replicated outside the model, and its gradients are averaged with ``fa.distributed``.

    torchrun --nproc-per-node 2 examples/train_fsdp.py               # CPU (gloo) or GPUs (NCCL)
    torchrun --nproc-per-node 2 examples/train_fsdp.py --no-shard    # plain data parallel
    torchrun --nproc-per-node 2 examples/train_fsdp.py --compile     # each block torch.compile'd

The model is a small random Llama so the example runs anywhere; swap in
``AutoModelForCausalLM.from_pretrained(...)``. The task is counting (each sequence is t, t+1, ...),
which an adapter learns in a few dozen steps. Rank 0 saves the adapter in PEFT's layout.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from transformers import LlamaConfig, LlamaForCausalLM

import fastaf as fa

VOCAB, SEQ = 128, 32


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-shard", action="store_true", help="data parallel: every rank holds the whole base")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile each decoder block (after fully_shard); functional_call stays eager")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", default="demo_out/fsdp-adapter")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)  # the same base on every rank
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg).to(device).requires_grad_(False)
    if not args.no_shard:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    model.config.use_cache = False  # training: a KV cache would make each block guard on its own cache layer
    if args.compile:  # per block, as FSDP2 recipes compile: FSDP2's hooks stay outside the graphs
        # under functional_call each block compiles its own graph (it reads its own layer's factors):
        # dynamo's recompile_limit must cover the layers, or those past it run eagerly
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, len(model.model.layers))
        for layer in model.model.layers:
            layer.compile()

    config = fa.LoRAConfig(r=8, alpha=16, targets=["q_proj", "k_proj", "v_proj", "o_proj"])
    adapter = fa.distributed.broadcast_adapter(fa.init_adapter(model, config, seed=rank))  # rank 0's
    leaves, spec = pytree.tree_flatten(adapter)
    leaves = [t.requires_grad_() for t in leaves]
    opt = torch.optim.AdamW(leaves, lr=1e-2)
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    for step in range(1, args.steps + 1):
        start = torch.randint(0, VOCAB, (8, 1), generator=gen)
        ids = ((start + torch.arange(SEQ)) % VOCAB).to(device)
        loss = fa.functional_call(model, pytree.tree_unflatten(leaves, spec), (ids,), {"labels": ids}).loss
        # autograd, not torch.func: FSDP2's hooks do not run under torch.func transforms on CUDA
        grads = fa.distributed.all_reduce_grads(torch.autograd.grad(loss, leaves))
        for p, g in zip(leaves, grads):
            p.grad = g
        opt.step()
        if rank == 0 and (step % 10 == 0 or step == 1):
            print(f"step {step:3d}  loss {loss.item():.3f}  ({world} ranks, {'data parallel' if args.no_shard else 'FSDP2'}"
                  f"{', compiled blocks' if args.compile else ''})",
                  flush=True)
    trained = pytree.tree_unflatten([t.detach() for t in leaves], spec)
    fa.save_adapter(trained, args.out, config=config)  # rank 0 writes
    dist.barrier()
    if rank == 0:
        print(f"saved {args.out}: PEFT's layout, {len(trained)} LoRAs")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
