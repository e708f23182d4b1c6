"""FSDP2 on 1 GPU against FSDP2 on 2 GPUs in one launch, timed in interleaved rounds.

    torchrun --nproc-per-node 2 bench/bench_dist_scaling.py --model 1b|8b [--batch 8] [--rounds 5]

bench_dist.py times each GPU count in a launch of its own: on the H100 pair the same launch run
again moved by up to 25% at 4 sequences per GPU, and the 1B ratio came out 1.72x, 1.83x and 1.91x
in three pairings. Here both engines live in one launch and take turns, so drift lands on both:
- the 2-GPU engine: ``fully_shard`` over both ranks (bench_dist.py's fsdp2 engine);
- the 1-GPU engine: the same model on rank 0 alone, ``fully_shard`` over a one-rank mesh (a
  subgroup of rank 0), while rank 1 waits at a barrier.
Each round times ``--steps`` steps of one, then of the other (the first round's order alternates
with the next); tokens/s over the GPUs each engine uses, per round; the ratio of the medians.
Steps: ``torch.autograd.grad`` on the adapter's leaves over ``fa.functional_call``, the gradients
averaged over the engine's ranks, AdamW. Peak memory is not reported here (both engines' weights
are resident on rank 0): bench_dist.py's separate launches measure it.
Rows go to bench/results/dist-scaling-<gpu>.json (appended).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import _harness as H  # noqa: E402
from bench.bench_dist import SHAPES, TARGETS, batch, make_model, shard  # noqa: E402

import fastaf as fa  # noqa: E402


def engine(model_name: str, device: torch.device, mesh, group, cuda: bool):
    """(step, ranks): FSDP2 over ``mesh``; ``step(ids)`` trains an adapter on this rank's ids and
    averages its gradients over ``group``."""
    model = make_model(model_name, device, torch.bfloat16 if cuda else torch.float32)
    shard(model, mesh)
    adapter = fa.init_adapter(model, fa.LoRAConfig(r=16, alpha=32, targets=TARGETS), seed=0, device=device)
    leaves, spec = pytree.tree_flatten(adapter)
    opt = torch.optim.AdamW(leaves, lr=1e-4, fused=cuda)
    ranks = dist.get_world_size(group)

    def step(ids: torch.Tensor) -> None:
        flat = [t.detach().requires_grad_() for t in leaves]
        loss = fa.functional_call(model, pytree.tree_unflatten(flat, spec), (ids,), {"labels": ids}).loss
        grads = list(torch.autograd.grad(loss, flat))
        if ranks > 1:
            grads = fa.distributed.all_reduce_grads(grads, group=group)
        for p, g in zip(leaves, grads):
            p.grad = g
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, ranks


def timed_round(step, steps: int, per_gpu: int, seq: int, vocab: int, device: torch.device, cuda: bool,
                group, seed: int) -> float:
    """Seconds per step over ``steps`` steps (the engine's ranks synchronised at both ends)."""
    if cuda:
        torch.cuda.synchronize()
    dist.barrier(group=group)
    t0 = time.perf_counter()
    for i in range(steps):
        step(batch(seed + i, per_gpu, seq, vocab, device))
    if cuda:
        torch.cuda.synchronize()
    dist.barrier(group=group)
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=list(SHAPES), default="1b")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8, help="sequences per GPU")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per engine per round")
    ap.add_argument("--warmup", type=int, default=4)
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 2:
        raise SystemExit(f"bench_dist_scaling.py runs on 2 processes, got {world}")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    kind = "cuda" if cuda else "cpu"
    alone = dist.new_group([0])  # every rank makes it; only rank 0 uses it
    two, two_ranks = engine(args.model, device, init_device_mesh(kind, (world,)), None, cuda)
    one = engine(args.model, device, DeviceMesh.from_group(alone, kind), alone, cuda)[0] if rank == 0 else None
    vocab = SHAPES[args.model]["vocab_size"]

    def run_one(steps: int, seed: int) -> float | None:
        seconds = None
        if rank == 0:
            seconds = timed_round(one, steps, args.batch, args.seq, vocab, device, cuda, alone, seed)
        dist.barrier()  # rank 1 waits here while rank 0 runs alone
        return seconds

    def run_two(steps: int, seed: int) -> float:
        return timed_round(two, steps, args.batch, args.seq, vocab, device, cuda, None, seed)

    run_one(args.warmup, 10_000)
    run_two(args.warmup, 10_000)
    per_round = {1: [], 2: []}
    for r in range(args.rounds):
        order = (run_one, run_two) if r % 2 == 0 else (run_two, run_one)
        for fn in order:
            seconds = fn(args.steps, 20_000 + 100 * r)
            gpus = 1 if fn is run_one else two_ranks
            if rank == 0:
                per_round[gpus].append(gpus * args.batch * args.seq / seconds)
        if rank == 0:
            print(f"round {r}: 1 GPU {per_round[1][-1]:.0f} tok/s, 2 GPUs {per_round[2][-1]:.0f} tok/s, "
                  f"ratio {per_round[2][-1] / per_round[1][-1]:.3f}", flush=True)
    if rank == 0:
        med = {g: statistics.median(v) for g, v in per_round.items()}
        row = {"bench": "dist-scaling", "engine": "fsdp2", "model": args.model, "batch_per_gpu": args.batch,
               "seq": args.seq, "rounds": args.rounds, "steps_per_round": args.steps,
               "tokens_per_s_1gpu": round(med[1], 1), "tokens_per_s_2gpu": round(med[2], 1),
               "scaling": round(med[2] / med[1], 3),
               "per_round_1gpu": [round(v, 1) for v in per_round[1]],
               "per_round_2gpu": [round(v, 1) for v in per_round[2]]}
        print(json.dumps(row), flush=True)
        name = "dist-scaling" + ("-tiny" if args.model == "tiny" else "")
        old = H.RESULTS / f"{name}-{H.slug(H.gpu_name())}.json"
        previous = json.loads(old.read_text())["rows"] if old.exists() else []
        H.write_results(name, previous + [row], {})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
