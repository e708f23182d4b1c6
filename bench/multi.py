"""Many adapters in one batch: one linear layer, each example's tokens through its own adapter.

    python bench/multi.py [--cases 64x64,8x1024,64x1] [--name multi]

K = N = 4096, r = 16, bf16. Cases (adapters x tokens each): 64 x 64, 8 x 1024, and decode,
64 rows x 1 token with 64 adapters. Providers, timed interleaved in one process:
- base: ``F.linear`` on all the tokens (the floor);
- fastaf: ``lora_linear_multi`` with ``adapter_ids``, what ``functional_call(..., adapter_ids=)``
  runs per layer: the grouped kernels on CUDA;
- fastaf-fused / fastaf-unfused: the same with the base GEMM and the LoRA expand fused in one
  persistent kernel, or cuBLAS then the expand kernel (the dispatch picks by rows; forced by the
  ``multi_fuse`` switch of ``fastaf._config``, skipped where fastaf has no such switch);
- fastaf-ref: the same op on its batched torch reference (``impl="torch"``);
- vmap: ``torch.func.vmap`` of ``fastaf.functional.lora_linear`` over the stack, x batched per adapter;
- loop: a Python loop of ``lora_linear``, one adapter's rows at a time;
- peft: PEFT's mixed-batch forward (``adapter_names=``, one name per row), forward only (PEFT
  refuses to train with it).
Modes ``fwd`` and ``fwd_bwd`` (backward to x and the stack), eager; ``fwd_graph`` and
``fwd_bwd_graph``: base and fastaf replayed from CUDA graphs, as a server or a compiled trainer
runs them (the grouped ops never sync on the ids), so host time drops out and the ratio is GPU
time. Eager rows at these sizes are host-bound for fastaf (~0.7 ms of launches and autograd per
fwd+bwd call against ~0.47 ms of GPU time at 64 x 64 on the H100). Before timing, every forward
provider is checked against the torch reference. Training many adapters in a whole model is
``bench/e2e.py``'s ``-x<G>`` providers. Rows go to bench/results/multi.csv: see bench/README.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import _harness as H  # noqa: E402

import fastaf as fa  # noqa: E402
from fastaf import _config  # noqa: E402

K = N = 4096
R = 16
CASES = [(64, 64), (8, 1024), (64, 1)]  # (adapters, tokens per adapter)
MODES = ("fwd", "fwd_bwd", "fwd_graph", "fwd_bwd_graph")
# forced paths, held over the whole provider call (forward and backward)
FORCED = {"fastaf-fused": {"multi_fuse": "fused"}, "fastaf-unfused": {"multi_fuse": "unfused"}}
CASE = ("mode", "adapters", "tokens_each", "K", "N", "r")
FIGURES = ("ms", "p20", "p80")


def _multi_op():
    """The grouped op ``functional_call(..., adapter_ids=)`` runs per layer. It is not in
    ``fastaf.__all__``; the ops package's surface exports it."""
    from fastaf.ops import lora_linear_multi

    return lora_linear_multi


def _forceable() -> dict:
    """The FORCED providers this fastaf can force, each with its flags."""
    flags = {f.name for f in dataclasses.fields(_config.Flags)}
    out = {k: v for k, v in FORCED.items() if set(v) <= flags}
    for k in sorted(set(FORCED) - set(out)):
        print(f"  {k}: skipped (fastaf._config has no flag {sorted(FORCED[k])})", flush=True)
    return out


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


def _held(flags: dict, fn):
    """``fn`` with fastaf's ``flags`` set for the whole call (a forward and its backward)."""
    def run():
        with _config.override(**flags):
            return fn()

    return run


def providers(n: int, t: int, mode: str, forced: dict) -> dict:
    multi = _multi_op()
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
        "fastaf": lambda: multi(x, w, None, stack, ids),
        **{k: (lambda: multi(x, w, None, stack, ids)) for k in forced},
        "fastaf-ref": lambda: multi(x, w, None, stack, ids, impl="torch"),
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
    held = lambda calls: {k: _held(forced[k], f) if k in forced else f for k, f in calls.items()}  # noqa: E731
    if mode == "fwd":
        ops = held(ops)
        ops["peft"] = peft_forward(x.reshape(n, t, K), w, A.detach(), B.detach())
        with torch.no_grad():  # every provider against the reference path
            ref = ops["fastaf-ref"]()
            for k in ops:
                if k not in ("base", "fastaf-ref"):
                    err = H.rel_err(ops[k]().reshape(ref.shape), ref)
                    print(f"  check {k}: rel err {err:.2e}", flush=True)
                    if not err < 2e-2:
                        raise SystemExit(f"{k} at {n} x {t}: rel err {err:.3g} against the torch reference")
        return ops
    inputs = (x, A, B)
    return held({k: (lambda f=f, k=k: torch.autograd.grad(f(), inputs if k != "base" else (x,), dy))
                 for k, f in ops.items()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--name", default="multi", help="results file bench/results/<name>.csv")
    ap.add_argument("--cases", default=",".join(f"{n}x{t}" for n, t in CASES), help="subset, e.g. 64x1")
    args = ap.parse_args()
    results = H.Results(args.name, CASE, FIGURES)
    forced = _forceable()
    rows = []
    for n, t in (tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")):
        for mode in MODES:
            fns = providers(n, t, mode, forced)
            times = H.time_interleaved(fns, rounds=3, rep=150)
            case_rows = [{"provider": name, "mode": mode, "adapters": n, "tokens_each": t, "K": K, "N": N, "r": R,
                          **{k: tm[k] for k in FIGURES}} for name, tm in times.items()]
            results.append(case_rows)
            rows += case_rows
            base = times["base"]["ms"]
            print(f"{n:3d} x {t:5d} {mode:13s} base {base:.4f} ms | " +
                  "  ".join(f"{k} {v['ms'] / base:.2f}x" for k, v in times.items() if k != "base"), flush=True)
            del fns
    print(f"appended {len(rows)} rows to {results.paths[0]} (run {results.meta['run']})")


if __name__ == "__main__":
    main()
