"""Several GPUs: LoRA training under FSDP2 and data parallel, with the adapter outside the model.

    torchrun --nproc-per-node N bench/dist.py --engine fsdp2|ddp|single --model 1b|8b [--batch 4 8]
    torchrun --nproc-per-node 2 bench/dist.py --engine fsdp2 --scaling 5 --batch 8 --parity-steps 0

Model: a Llama-3.2-1B shape, or a Llama-3-8B shape (hidden 4096, 32 layers, MLP 14336, 8 kv
heads), random bf16 weights; LoRA r=16 on q,k,v,o,gate,up,down, fp32 factors, AdamW.
Each step: ``torch.func.grad_and_value`` over ``fa.functional_call`` on the rank's local batch
(``--grad autograd``: ``torch.autograd.grad`` on the adapter's leaves), then
``fa.distributed.all_reduce_grads`` (no-op for one process) and AdamW. Engines (the ``provider``):
- single: the model unsharded on one GPU.
- fsdp2: ``fully_shard`` on every decoder layer and the model; the adapter replicated.
- ddp: the model replicated; only the adapter's gradients are all-reduced.
Parity: ``--parity-steps`` steps on a fixed global batch (``--global-batch`` sequences split over
the ranks as ids[rank::gpus]) from seed 0, once per name in ``--parity`` (each from the same start):
- ``exact``: torch's deterministic mode (fastaf's backward on cuBLAS, no atomics) and each rank's
  share run as micro-batches of ``--micro-batch`` sequences, their gradients summed and averaged.
  On one GPU with micro-batches of global/2 this computes, bit for bit where every kernel is
  deterministic, what two ranks compute: the comparison isolates the engine from bf16 rounding
  that differs with a GEMM's M.
- ``fast``: the default mode (atomics), each rank's share in one forward: what users run; its
  1-GPU vs 2-GPU difference includes that rounding, and run-to-run noise. Named twice
  (``fast,fast``), the second run is also compared with the first: that noise alone.
Rank 0 saves each adapter to ``--parity-dir/<model>-<engine>-<gpus>-<name>.pt`` and reports
``||delta|| / ||A||`` over all factors against the 1-GPU fsdp2 (else single) adapter of that model
and name when it is there (``parity_exact``, ``parity_fast``, ``parity_fast_repeat``).
Throughput: then ``--timed-steps`` steps at each ``--batch`` (sequences per GPU) after 4 warm-up
steps, default mode, tokens/s over all GPUs; with fsdp2 ``--prefetch`` also times explicit
prefetching (the next block's all-gather issued one block ahead, forward and backward), and
``--launch-graphs on,off`` times with fastaf's launch graphs on and off (``fastaf._config``).
Separate launches per GPU count drift apart: on a pair of H100s the same launch run again moved
by up to 25% at 4 sequences per GPU. ``--scaling ROUNDS`` (2 processes, fsdp2) therefore times
both in one launch, in ROUNDS interleaved rounds of ``--timed-steps`` steps each: FSDP2 over both
ranks, and the same model on rank 0 alone (``fully_shard`` over a one-rank mesh) while rank 1
waits; the first of each round alternates. Peak memory is not reported there (both engines'
weights are resident on rank 0). Rows go to bench/results/dist.csv: see bench/README.md.
"""
from __future__ import annotations

import argparse
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

import fastaf as fa  # noqa: E402
from fastaf import _config  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
}
WARMUP = 4  # steps at the timed batch shape before timing (launch graphs are captured on repeats)
CASE = ("model", "gpus", "batch_per_gpu", "seq", "grad", "prefetch", "launch_graphs", "rounds")
FIGURES = ("ms", "p20", "p80", "max_mem_gib", "tokens_per_s", "oom", "parity_exact", "parity_fast",
           "parity_fast_repeat")


def make_model(name: str, device: torch.device, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # the same base on every rank
    cfg = LlamaConfig(**SHAPES[name], max_position_embeddings=4096, tie_word_embeddings=False)
    with torch.device(device):
        return LlamaForCausalLM(cfg).to(dtype).train().requires_grad_(False)


def shard(model, mesh=None) -> None:
    """FSDP2 as its recipes apply it: each decoder layer, then the model (``mesh``: default the world)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def batch(step: int, sequences: int, seq: int, vocab: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (sequences, seq), generator=g).to(device)


def rel_diff(a: fa.Adapter, b: fa.Adapter) -> float:
    num = sum(((x.float() - y.float()) ** 2).sum() for x, y in zip(pytree.tree_leaves(a), pytree.tree_leaves(b)))
    den = sum((y.float() ** 2).sum() for y in pytree.tree_leaves(b))
    return float((num / den).sqrt())


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=["single", "fsdp2", "ddp"], required=True)
    ap.add_argument("--model", choices=list(SHAPES), default="1b")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, nargs="+", default=[4], help="sequences per GPU in the timed steps")
    ap.add_argument("--global-batch", type=int, default=8, help="sequences per parity step, all GPUs")
    ap.add_argument("--parity-steps", type=int, default=20, help="0: throughput only")
    ap.add_argument("--parity", default="exact,fast", help="parity runs, comma-separated: exact, fast")
    ap.add_argument("--micro-batch", type=int, default=4, help="sequences per forward in exact parity runs")
    ap.add_argument("--prefetch", action="store_true", help="fsdp2: also time with explicit prefetching")
    ap.add_argument("--launch-graphs", default="on", help="timed with fastaf's launch graphs: on, off or on,off")
    ap.add_argument("--timed-steps", type=int, default=10, help="timed steps (per engine and round with --scaling)")
    ap.add_argument("--scaling", type=int, default=0, metavar="ROUNDS",
                    help="2 processes, fsdp2: time 1 GPU against 2 in this launch, in ROUNDS interleaved rounds")
    ap.add_argument("--parity-dir", default="/tmp/fastaf-parity")
    ap.add_argument("--grad", choices=["func", "autograd"], default="func",
                    help="torch.func.grad_and_value, or torch.autograd.grad on the adapter's leaves")
    ap.add_argument("--name", default=None, help="results file bench/results/<name>.csv (default dist; tiny: dist-tiny)")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    runs = [n for n in args.parity.split(",") if n] if args.parity_steps else []
    if any(n not in ("exact", "fast") for n in runs):
        raise SystemExit(f"--parity {args.parity!r}: runs are exact, fast")
    if args.scaling and args.engine != "fsdp2":
        raise SystemExit("--scaling times FSDP2 on 1 GPU against 2: --engine fsdp2")

    cuda = torch.cuda.is_available()
    if cuda and "exact" in runs:  # read by cuBLAS when it starts: before any CUDA work
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    name = args.name or ("dist-tiny" if args.model == "tiny" else "dist")
    results = H.Results(name, CASE, FIGURES) if rank == 0 else None  # other columns fail before the run
    common = {"model": args.model, "seq": args.seq}
    if args.scaling:
        rows = scaling(args, rank, world, device, cuda)
    else:
        rows = separate(args, runs, rank, world, device, cuda)
    if rank == 0:
        rows = [{**common, **r} for r in rows]
        print(f"appended {len(rows)} rows to {results.append(rows)} (run {results.meta['run']})", flush=True)
    dist.destroy_process_group()


def separate(args, runs: list[str], rank: int, world: int, device: torch.device, cuda: bool) -> list[dict]:
    """The parity runs, then the throughput of this launch's engine at each ``--batch``."""
    model = make_model(args.model, device, torch.bfloat16 if cuda else torch.float32)
    if args.engine == "fsdp2":
        shard(model)
    elif args.engine == "single" and world != 1:
        raise SystemExit("--engine single runs on one process")
    adapter = fa.distributed.broadcast_adapter(
        fa.init_adapter(model, fa.LoRAConfig(r=16, alpha=32, targets=TARGETS), seed=0, device=device))
    # B = 0 at init would make the first steps' A gradients zero: start from a B the seed fixes
    g = torch.Generator().manual_seed(1)
    start = adapter.map(lambda p, l: fa.LoRA(l.A, (torch.randn(l.B.shape, generator=g) * 1e-3).to(l.B), l.scale))
    start_leaves, spec = pytree.tree_flatten(start)
    vocab = model.config.vocab_size
    loss_of = lambda ad, ids: fa.functional_call(model, ad, (ids,), {"labels": ids}).loss  # noqa: E731

    def autograd_step(ad: fa.Adapter, ids: torch.Tensor) -> tuple:
        flat = [t.detach().requires_grad_() for t in pytree.tree_leaves(ad)]
        loss = loss_of(pytree.tree_unflatten(flat, spec), ids)
        return pytree.tree_unflatten(list(torch.autograd.grad(loss, flat)), spec), loss.detach()

    step_fn = torch.func.grad_and_value(loss_of) if args.grad == "func" else autograd_step

    def trainer(micro: int | None):
        """(leaves, step): fresh leaves from ``start`` and AdamW over them; ``step(ids)`` trains
        on this rank's ``ids`` in forwards of ``micro`` sequences (None: all at once)."""
        leaves = [t.detach().clone() for t in start_leaves]
        opt = torch.optim.AdamW(leaves, lr=1e-4, fused=cuda)

        def step(ids: torch.Tensor) -> torch.Tensor:
            # strided as ranks split the global batch (ids[rank::gpus]): on one GPU, micro-batches
            # of global/2 are the two ranks' shares
            n = len(ids) // micro if micro else 1
            parts = [ids[j::n] for j in range(n)]
            total, loss = None, None
            for part in parts:  # summed, then averaged: what all_reduce_grads does over ranks
                grads, loss = step_fn(pytree.tree_unflatten(leaves, spec), part)
                flat = pytree.tree_leaves(grads)
                total = flat if total is None else [t + g for t, g in zip(total, flat)]
            grads = pytree.tree_unflatten([t / len(parts) for t in total] if len(parts) > 1 else total, spec)
            grads = fa.distributed.all_reduce_grads(grads) if world > 1 else grads
            for p, gr in zip(leaves, pytree.tree_leaves(grads)):
                p.grad = gr
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
        return leaves, step

    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} does not split over {world} ranks")
    if "exact" in runs and (args.global_batch // world) % args.micro_batch:
        raise SystemExit(f"--micro-batch {args.micro_batch} does not split a rank's "
                         f"{args.global_batch // world} sequences")
    parity: dict[str, float | None] = {}
    seen: dict[str, fa.Adapter] = {}
    for name in runs:
        exact = name == "exact"
        # strict: with warn_only=True torch keeps cuDNN attention's nondeterministic backward
        # (it warns); strict, SDPA skips cuDNN for kernels that are deterministic
        torch.use_deterministic_algorithms(exact)
        leaves, step = trainer(args.micro_batch if exact else None)
        t0 = time.perf_counter()
        for i in range(args.parity_steps):
            loss = step(batch(i, args.global_batch, args.seq, vocab, device)[rank::world])
        torch.use_deterministic_algorithms(False)
        final = pytree.tree_unflatten([t.detach().cpu() for t in leaves], spec)
        del leaves, step
        if cuda:  # the next run at another batch shape: no fragments of this one's
            torch.cuda.empty_cache()
        if rank == 0:
            diff = None
            if name in seen:  # a repeated run: run-to-run noise alone
                parity[f"{name}_repeat"] = diff = rel_diff(final, seen[name])
            else:
                seen[name] = final
                Path(args.parity_dir).mkdir(parents=True, exist_ok=True)
                torch.save(final, Path(args.parity_dir) / f"{args.model}-{args.engine}-{world}-{name}.pt")
                # against the first 1-GPU adapter of this model and run (fsdp2, else single)
                refs = [Path(args.parity_dir) / f"{args.model}-{e}-1-{name}.pt" for e in ("fsdp2", "single")]
                ref = next((r for r in refs if r.exists()), None)
                if ref is not None:
                    parity[name] = diff = rel_diff(final, torch.load(ref, weights_only=False))
            print(f"parity {name}: {args.parity_steps} steps in {time.perf_counter() - t0:.1f} s, "
                  f"last loss {float(loss):.4f}, rel diff {diff}", flush=True)

    leaves, step = trainer(None)
    settings = [("implicit", None)]
    if args.prefetch and args.engine == "fsdp2":
        settings.append(("explicit", 1))
    rows = []
    for (prefetch, ahead), graphs in [(p, g) for p in settings for g in args.launch_graphs.split(",")]:
        if ahead:
            _prefetch(model, ahead)
        for per_gpu in args.batch:
            with _config.override(launch_graphs=graphs == "on"):
                row = timed(step, per_gpu, args, vocab, device, cuda, world)
            row.update(provider=args.engine, gpus=world, grad=args.grad, prefetch=prefetch, launch_graphs=graphs,
                       rounds=0, parity_exact=parity.get("exact"), parity_fast=parity.get("fast"),
                       parity_fast_repeat=parity.get("fast_repeat"))
            if rank == 0:
                print(row, flush=True)
            rows.append(row)
    return rows


def _prefetch(model: torch.nn.Module, ahead: int) -> None:
    """FSDP2: each block's forward issues the all-gather of the ``ahead`` blocks after it, and its
    backward those of the ``ahead`` blocks before it (FSDP2's default prefetches one, implicitly)."""
    layers = list(model.model.layers)
    for i, layer in enumerate(layers):
        layer.set_modules_to_forward_prefetch(layers[i + 1:i + 1 + ahead])
        layer.set_modules_to_backward_prefetch(layers[max(0, i - ahead):i][::-1])


def timed(step, per_gpu: int, args, vocab: int, device: torch.device, cuda: bool, world: int) -> dict:
    """tokens/s, step time and peak memory over ``--timed-steps`` steps of ``per_gpu`` sequences
    per GPU (after WARMUP steps). On one process an out-of-memory batch gives a row saying so;
    on several it ends the launch (a rank that stopped would leave the others in a collective)."""
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
    try:
        for i in range(WARMUP):
            step(batch(10_000 + i, per_gpu, args.seq, vocab, device))
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for i in range(args.timed_steps):
            step(batch(20_000 + i, per_gpu, args.seq, vocab, device))
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        seconds = (time.perf_counter() - t0) / args.timed_steps
        oom = False
    except torch.OutOfMemoryError:
        if world > 1:
            raise
        seconds, oom = float("nan"), True
    mem = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    mems = [None] * world
    dist.all_gather_object(mems, (mem, oom))
    if any(o for _, o in mems):
        return {"batch_per_gpu": per_gpu, "oom": True}
    peak = max((m for m, _ in mems if m is not None), default=None)
    return {"batch_per_gpu": per_gpu, "tokens_per_s": round(world * per_gpu * args.seq / seconds, 1),
            "ms": round(seconds * 1e3, 2), "max_mem_gib": None if peak is None else round(peak, 2), "oom": False}


def _engine(model_name: str, device: torch.device, mesh, group, cuda: bool):
    """(step, ranks): FSDP2 over ``mesh``; ``step(ids)`` trains an adapter on this rank's ids with
    ``torch.autograd.grad`` and averages its gradients over ``group``."""
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


def _round(step, steps: int, per_gpu: int, seq: int, vocab: int, device: torch.device, cuda: bool, group,
           seed: int) -> float:
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


def scaling(args, rank: int, world: int, device: torch.device, cuda: bool) -> list[dict]:
    """FSDP2 over both ranks against FSDP2 on rank 0 alone, in interleaved rounds at each ``--batch``."""
    if world != 2:
        raise SystemExit(f"--scaling runs on 2 processes, got {world}")
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    kind = "cuda" if cuda else "cpu"
    alone = dist.new_group([0])  # every rank makes it; only rank 0 uses it
    two, two_ranks = _engine(args.model, device, init_device_mesh(kind, (world,)), None, cuda)
    one = _engine(args.model, device, DeviceMesh.from_group(alone, kind), alone, cuda)[0] if rank == 0 else None
    vocab = SHAPES[args.model]["vocab_size"]
    rows = []
    for per_gpu in args.batch:
        def run_one(steps: int, seed: int) -> float | None:
            seconds = None
            if rank == 0:
                seconds = _round(one, steps, per_gpu, args.seq, vocab, device, cuda, alone, seed)
            dist.barrier()  # rank 1 waits here while rank 0 runs alone
            return seconds

        def run_two(steps: int, seed: int) -> float:
            return _round(two, steps, per_gpu, args.seq, vocab, device, cuda, None, seed)

        run_one(WARMUP, 10_000)
        run_two(WARMUP, 10_000)
        seconds: dict[int, list[float]] = {1: [], 2: []}
        for r in range(args.scaling):
            order = (run_one, run_two) if r % 2 == 0 else (run_two, run_one)
            for fn in order:
                s = fn(args.timed_steps, 20_000 + 100 * r)
                if rank == 0:
                    seconds[1 if fn is run_one else two_ranks].append(s)
            if rank == 0:
                tok = {g: g * per_gpu * args.seq / v[-1] for g, v in seconds.items()}
                print(f"batch {per_gpu} round {r}: 1 GPU {tok[1]:.0f} tok/s, 2 GPUs {tok[2]:.0f} tok/s, "
                      f"ratio {tok[2] / tok[1]:.3f}", flush=True)
        for gpus, per_round in seconds.items():
            if not per_round:
                continue
            ms = [1e3 * s for s in per_round]
            q = statistics.quantiles(ms, n=10, method="inclusive") if len(ms) > 1 else ms * 9
            med = statistics.median(ms)
            rows.append({"provider": "fsdp2", "gpus": gpus, "batch_per_gpu": per_gpu, "grad": "autograd",
                         "prefetch": "implicit", "launch_graphs": "on", "rounds": args.scaling, "ms": round(med, 2),
                         "p20": round(q[1], 2), "p80": round(q[7], 2),
                         "tokens_per_s": round(gpus * per_gpu * args.seq / (med / 1e3), 1), "oom": False})
    return rows


if __name__ == "__main__":
    main()
