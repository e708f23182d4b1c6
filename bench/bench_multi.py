"""Many adapters in one batch: one linear layer, each row's tokens through its own adapter.

    python bench/bench_multi.py

K = N = 4096, r = 16, bf16. Cases (issue 11): 64 adapters x 64 tokens, 8 adapters x 1024 tokens,
and decode, 64 rows x 1 token with 64 adapters. Providers, timed interleaved in one process:
- base: ``F.linear`` on all the tokens (the floor);
- fastaf: ``lora_linear_multi`` with ``adapter_ids`` (what ``functional_call(..., adapter_ids=)`` runs);
- vmap: ``torch.func.vmap`` of ``lora_linear`` over the stack, x batched per adapter;
- loop: a Python loop of ``lora_linear``, one adapter's rows at a time.
Modes ``fwd`` and ``fwd_bwd`` (backward to x and the stack). Writes bench/results/multi-<gpu>.json.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import _harness as H  # noqa: E402

import fastaf as fa  # noqa: E402
from fastaf.functional._multi import lora_linear_multi  # noqa: E402

K = N = 4096
R = 16
CASES = [(64, 64), (8, 1024), (64, 1)]  # (adapters, tokens per adapter)


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
        "vmap": lambda: torch.func.vmap(lambda xi, l: fa.functional.lora_linear(xi, w, None, l))(x, stack),
        "loop": lambda: torch.stack([fa.functional.lora_linear(x[i], w, None, fa.LoRA(A[i], B[i], 2.0))
                                     for i in range(n)]),
    }
    if mode == "fwd":
        return ops
    inputs = (x, A, B)
    return {k: (lambda f=f, k=k: torch.autograd.grad(f(), inputs if k != "base" else (x,), dy)) for k, f in ops.items()}


def main() -> None:
    rows = []
    for n, t in CASES:
        for mode in ("fwd", "fwd_bwd"):
            fns = providers(n, t, mode)
            ref = fns["base"]() if mode == "fwd" else None
            times = H.time_interleaved(fns, rounds=3, rep=150)
            for name, tm in times.items():
                row = {"bench": "multi", "mode": mode, "adapters": n, "tokens_each": t, "provider": name,
                       "K": K, "N": N, "r": R, "dtype": "bfloat16", **{k: tm[k] for k in ("ms", "p20", "p80")}}
                rows.append(row)
            base = times["base"]["ms"]
            print(f"{n:3d} x {t:5d} {mode:8s} base {base:.3f} ms | " +
                  "  ".join(f"{k} {v['ms'] / base:.2f}x" for k, v in times.items() if k != "base"), flush=True)
            del fns, ref
    path = H.write_results("multi", rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
