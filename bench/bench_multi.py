"""Many adapters in one batch: one linear layer, each row's tokens through its own adapter.

    python bench/bench_multi.py [--no-train-step] [--name multi]

K = N = 4096, r = 16, bf16. Cases (issue 11): 64 adapters x 64 tokens, 8 adapters x 1024 tokens,
and decode, 64 rows x 1 token with 64 adapters. Providers, timed interleaved in one process:
- base: ``F.linear`` on all the tokens (the floor);
- fastaf: ``lora_linear_multi`` with ``adapter_ids`` (what ``functional_call(..., adapter_ids=)``
  runs per layer): the grouped kernels on CUDA;
- fastaf-fused / fastaf-unfused: the same with the base GEMM and the LoRA expand fused in one
  persistent kernel, or cuBLAS then the expand kernel (the dispatch picks by rows);
- fastaf-ref: the same op on its batched torch reference (``impl="torch"``, the path before the
  grouped kernels), side by side;
- vmap: ``torch.func.vmap`` of ``lora_linear`` over the stack, x batched per adapter;
- loop: a Python loop of ``lora_linear``, one adapter's rows at a time;
- peft: PEFT's mixed-batch forward (``adapter_names=``, one name per row), forward only (PEFT
  refuses to train with it).
Modes ``fwd`` and ``fwd_bwd`` (backward to x and the stack), eager; ``fwd_graph`` and
``fwd_bwd_graph``: base and fastaf replayed from CUDA graphs, as a server or a compiled trainer
runs them (the grouped ops never sync on the ids), so host time drops out and the ratio is GPU
time. Eager rows at these sizes are host-bound for fastaf (~0.7 ms of launches and autograd per
fwd+bwd call against ~0.47 ms of GPU time at 64 x 64).
``train_step``: BENCH.md's Llama-3.2-1B shape, 8 x 1024 tokens, one AdamW step through
``functional_call`` with one adapter on every sequence vs 8 adapters (a stack, ``adapter_ids``
0..7), r=16 on q,k,v,o,gate,up,down. Writes bench/results/<name>-<gpu>.json.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import _harness as H  # noqa: E402

import fastaf as fa  # noqa: E402
from fastaf.functional._multi import lora_linear_multi  # noqa: E402

K = N = 4096
R = 16
CASES = [(64, 64), (8, 1024), (64, 1)]  # (adapters, tokens per adapter)


def peft_forward(x: torch.Tensor, w: torch.Tensor, A: torch.Tensor, B: torch.Tensor):
    """PEFT's mixed batch over one Linear holding n adapters (row i uses adapter i)."""
    import peft

    n = A.shape[0]
    lin = torch.nn.Sequential()
    lin.add_module("lin", torch.nn.Linear(K, N, bias=False, device=x.device, dtype=x.dtype))
    lin.lin.weight.data.copy_(w)
    cfg = lambda: peft.LoraConfig(r=R, lora_alpha=2 * R, target_modules=["lin"])  # noqa: E731
    pm = peft.get_peft_model(lin, cfg(), adapter_name="a0")
    for i in range(1, n):
        pm.add_adapter(f"a{i}", cfg())
    for i in range(n):
        pm.base_model.model.lin.lora_A[f"a{i}"].weight.data.copy_(A[i])
        pm.base_model.model.lin.lora_B[f"a{i}"].weight.data.copy_(B[i])
    pm.to(x.dtype).eval()  # PEFT refuses adapter_names in training mode
    names = [f"a{i}" for i in range(n)]
    return lambda: pm(x, adapter_names=names)


def _with(overrides: dict, fn):
    """Run ``fn`` with some of the grouped op's dispatch thresholds forced (variants side by side)."""
    from fastaf.kernels import lora_multi

    saved = {k: getattr(lora_multi, k) for k in overrides}
    for k, v in overrides.items():
        setattr(lora_multi, k, v)
    try:
        return fn()
    finally:
        for k, v in saved.items():
            setattr(lora_multi, k, v)


# forced variants, held over the whole provider call (forward and backward)
VARIANTS = {"fastaf-fused": {"FUSE_MIN_ROWS": 0, "FUSE_MIN_SEGMENT": 0},
            "fastaf-unfused": {"FUSE_MIN_ROWS": 1 << 62}}


def graphed(fn):
    """``fn`` captured once in a CUDA graph; the returned callable replays it."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def providers(n: int, t: int, mode: str) -> dict:
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(n, t, K, device=dev, dtype=dt, requires_grad=mode == "fwd_bwd")
    w = torch.randn(N, K, device=dev, dtype=dt) / K**0.5
    A = (torch.randn(n, R, K, device=dev, dtype=dt) / K**0.5).requires_grad_(mode == "fwd_bwd")
    B = (torch.randn(n, N, R, device=dev, dtype=dt) / R**0.5).requires_grad_(mode == "fwd_bwd")
    stack = fa.LoRA(A, B, 2.0)
    ids = torch.arange(n, device=dev)
    dy = torch.randn(n, t, N, device=dev, dtype=dt)
    ops = {
        "base": lambda: F.linear(x, w),
        "fastaf": lambda: lora_linear_multi(x, w, None, stack, ids),
        "fastaf-fused": lambda: lora_linear_multi(x, w, None, stack, ids),
        "fastaf-unfused": lambda: lora_linear_multi(x, w, None, stack, ids),
        "fastaf-ref": lambda: lora_linear_multi(x, w, None, stack, ids, impl="torch"),
        "vmap": lambda: torch.func.vmap(lambda xi, lo: fa.functional.lora_linear(xi, w, None, lo))(x, stack),
        "loop": lambda: torch.stack([fa.functional.lora_linear(x[i], w, None, fa.LoRA(A[i], B[i], 2.0))
                                     for i in range(n)]),
    }
    if mode == "fwd_graph":
        return {k: graphed(ops[k]) for k in ("base", "fastaf")}
    if mode == "fwd_bwd_graph":  # the backward captured too: GPU time, as a compiled or graphed trainer sees it
        grads = {k: torch.empty_like(t) for k, t in (("x", x), ("A", A), ("B", B))}
        x.requires_grad_(), A.requires_grad_(), B.requires_grad_()

        def fwd_bwd(k):
            def run():
                outs = torch.autograd.grad(ops[k](), (x, A, B) if k != "base" else (x,), dy)
                for out, buf in zip(outs, grads.values()):
                    buf.copy_(out)
            return run

        return {k: graphed(fwd_bwd(k)) for k in ("base", "fastaf")}
    if mode == "fwd":
        ops = _forced(ops)
        ops["peft"] = peft_forward(x.reshape(n, t, K), w, A.detach(), B.detach())
        with torch.no_grad():  # every provider against the reference path
            ref = ops["fastaf-ref"]()
            for k in ("fastaf", "fastaf-fused", "fastaf-unfused", "vmap", "loop", "peft"):
                err = H.rel_err(ops[k]().reshape(ref.shape), ref)
                print(f"  check {k}: rel err {err:.2e}", flush=True)
                assert err < 2e-2, (k, err)
        return ops
    inputs = (x, A, B)
    ops = {k: (lambda f=f, k=k: torch.autograd.grad(f(), inputs if k != "base" else (x,), dy)) for k, f in ops.items()}
    return _forced(ops)


def _forced(ops: dict) -> dict:
    return {k: (lambda f=f, k=k: _with(VARIANTS[k], f)) if k in VARIANTS else f for k, f in ops.items()}


def train_steps(n_adapters: int) -> dict:
    """One functional_call + autograd + AdamW step of the 1B model, 1 adapter vs a stack of n."""
    from bench.bench_e2e import TARGETS, make_model

    model = make_model(tiny=False, device="cuda")
    ids = torch.randint(0, model.config.vocab_size, (8, 1024), device="cuda")
    batch = {"input_ids": ids, "labels": ids}
    cfg = fa.LoRAConfig(r=16, alpha=32, targets=TARGETS)

    def step_of(adapter, adapter_ids):
        leaves, spec = pytree.tree_flatten(adapter)
        leaves = [t.requires_grad_() for t in leaves]
        opt = torch.optim.AdamW(leaves, lr=1e-4, fused=True)
        kw = {} if adapter_ids is None else {"adapter_ids": adapter_ids}

        def step():
            loss = fa.functional_call(model, pytree.tree_unflatten(leaves, spec), (), batch, **kw).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        return step

    one = fa.init_adapter(model, cfg, seed=0)
    stack = fa.stack([fa.init_adapter(model, cfg, seed=i) for i in range(n_adapters)])
    fns = {1: step_of(one, None), n_adapters: step_of(stack, torch.arange(n_adapters, device="cuda"))}
    losses = {k: f().item() for k, f in fns.items()}  # B = 0: both equal the base model's loss
    print(f"  train_step first losses {losses}", flush=True)
    assert abs(losses[1] - losses[n_adapters]) < 1e-2 * abs(losses[1])
    return fns


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-train-step", action="store_true")
    ap.add_argument("--name", default="multi")
    ap.add_argument("--cases", default=",".join(f"{n}x{t}" for n, t in CASES), help="subset, e.g. 64x1")
    args = ap.parse_args()
    rows = []

    def record(mode, n, t, times):
        for name, tm in times.items():
            rows.append({"bench": "multi", "mode": mode, "adapters": n, "tokens_each": t, "provider": name,
                         "K": K, "N": N, "r": R, "dtype": "bfloat16",
                         **{k: tm[k] for k in ("ms", "p20", "p80", "rounds")}})

    for n, t in (tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")):
        for mode in ("fwd", "fwd_bwd", "fwd_graph", "fwd_bwd_graph"):
            fns = providers(n, t, mode)
            times = H.time_interleaved(fns, rounds=3, rep=150)
            record(mode, n, t, times)
            base = times["base"]["ms"]
            print(f"{n:3d} x {t:5d} {mode:9s} base {base:.4f} ms | " +
                  "  ".join(f"{k} {v['ms'] / base:.2f}x" for k, v in times.items() if k != "base"), flush=True)
            del fns
    if not args.no_train_step:
        fns = train_steps(8)
        times = H.time_interleaved({str(k): f for k, f in fns.items()}, rounds=3, warmup=3, rep=2000)
        for k, tm in times.items():
            rows.append({"bench": "multi", "mode": "train_step", "adapters": int(k), "tokens_each": 1024,
                         "provider": "fastaf", "model": "llama-3.2-1b-shape", "r": 16, "dtype": "bfloat16",
                         **{q: tm[q] for q in ("ms", "p20", "p80", "rounds")}})
        print(f"train_step 8 adapters {times['8']['ms']:.1f} ms vs 1 adapter {times['1']['ms']:.1f} ms: "
              f"{times['8']['ms'] / times['1']['ms']:.2f}x", flush=True)
    path = H.write_results(args.name, rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
