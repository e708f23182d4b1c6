"""A decoding step's LoRA: what adding it to a linear layer of few rows costs, inside a CUDA graph.

    python bench/decode.py [--rows 1,32,64] [--sweep] [--name decode]

Shapes: the Llama-3.2-1B projections (K x N: q/o 2048 x 2048, k/v 2048 x 512, gate/up 2048 x
8192, down 8192 x 2048), r = 16, bf16, M rows (a decoding batch of M sequences). Each provider
is 16 layers' worth of calls of one shape (32 of the 2048-input ones: two projections a layer),
distinct weights per call so the base GEMM reads HBM as in a model, captured in one CUDA graph
and replayed: what a compiled decoding step (``reduce-overhead``) pays, host time excluded.
``us`` is per call, base GEMM included:
- base: ``F.linear`` alone (the floor);
- cublas: ``F.linear``, then ``mm`` for h and ``addmm_`` for the update (bf16 factors);
- compiled: ``F.linear(x, W) + s * F.linear(F.linear(x, A), B)`` through ``torch.compile``
  (Inductor), what a compiled decoding step ran before the decode kernels;
- kernel / kernel-fp32: ``F.linear``, then ``fastaf.kernels.lora_decode.add_lora`` (a shrink
  split over K and an expand), with bf16 or fp32 (master) factors.
Every provider's output is checked against an fp32 reference first. ``--sweep`` also times the
kernels' configs (``lora_decode.CUDA_CONFIG``'s keys) and prints the best at 32 rows over a
whole step. Rows go to bench/results/decode.csv (see bench/README.md).
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import _harness as H  # noqa: E402

from fastaf.kernels import lora_decode  # noqa: E402

SHAPES = [(2048, 2048, 2), (2048, 512, 2), (2048, 8192, 2), (8192, 2048, 1)]  # K, N, projections a layer
LAYERS, R, SCALE = 16, 16, 2.0
PROVIDERS = ("base", "cublas", "compiled", "kernel", "kernel-fp32")
CASE = ("K", "N", "rows", "r", "calls")
FIGURES = ("us", "max_rel_err")


def graph_us(fn, calls: int, reps: int = 20) -> float:
    """``fn`` (``calls`` linears) captured in one CUDA graph; the best of 5 timings of ``reps``
    replays, per call, in us."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(), fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / reps / calls)
    return best


def _compiled():
    return torch.compile(lambda x, w, a, b: F.linear(x, w) + SCALE * F.linear(F.linear(x, a), b), dynamic=False)


def one_call(provider: str, config: dict | None = None):
    """provider -> f(x, w, a32, b32, a16, b16) -> y (M, N)."""
    compiled = _compiled() if provider == "compiled" else None
    return {
        "base": lambda x, w, a32, b32, a16, b16: F.linear(x, w),
        "cublas": lambda x, w, a32, b32, a16, b16: F.linear(x, w).addmm_(x @ a16.T, b16.T, alpha=SCALE),
        "compiled": lambda x, w, a32, b32, a16, b16: compiled(x, w, a16, b16),
        "kernel": lambda x, w, a32, b32, a16, b16: lora_decode.add_lora(F.linear(x, w), x, a16, b16, SCALE,
                                                                        config=config),
        "kernel-fp32": lambda x, w, a32, b32, a16, b16: lora_decode.add_lora(F.linear(x, w), x, a32, b32, SCALE,
                                                                             config=config),
    }[provider]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,32,64", help="comma-separated M")
    ap.add_argument("--sweep", action="store_true", help="also time the kernels' configs")
    ap.add_argument("--name", default="decode", help="results file bench/results/<name>.csv")
    args = ap.parse_args()
    results = H.Results(args.name, CASE, FIGURES)
    torch._dynamo.config.recompile_limit = 64  # "compiled": one graph per shape and rows
    dev, bf = "cuda", torch.bfloat16
    torch.manual_seed(0)
    rows, sweep = [], {}
    for K, N, per_layer in SHAPES:
        calls = LAYERS * per_layer
        ws = [torch.randn(N, K, device=dev, dtype=bf) / K**0.5 for _ in range(calls)]
        a32 = [torch.randn(R, K, device=dev) / K**0.5 for _ in range(calls)]
        b32 = [torch.randn(N, R, device=dev) / R**0.5 for _ in range(calls)]
        a16, b16 = [a.to(bf) for a in a32], [b.to(bf) for b in b32]
        for M in (int(m) for m in args.rows.split(",")):
            x = torch.randn(M, K, device=dev, dtype=bf)
            want = F.linear(x.float(), ws[0].float()) + SCALE * (x.float() @ a32[0].T) @ b32[0].T
            case = {"K": K, "N": N, "rows": M, "r": R, "calls": calls}
            times = {}
            for provider in PROVIDERS:
                f = one_call(provider)
                err = 0.0 if provider == "base" else H.rel_err(f(x, ws[0], a32[0], b32[0], a16[0], b16[0]), want)
                if err > 2e-2:
                    raise SystemExit(f"{provider} at K={K} N={N} M={M}: {err:.3g} off the fp32 reference")
                times[provider] = graph_us(lambda: [f(x, ws[i], a32[i], b32[i], a16[i], b16[i]) for i in range(calls)],
                                           calls)
                rows.append({"provider": provider, **case, "us": round(times[provider], 3), "max_rel_err": round(err, 5)})
            extra = "  ".join(f"{p} +{times[p] - times['base']:.2f}" for p in PROVIDERS[1:])
            print(f"K={K:5d} N={N:5d} M={M:3d}: base {times['base']:.2f} us/call; over it: {extra}", flush=True)
            if args.sweep and M == 32:
                keys = ("BLOCK_K", "K_PER_SPLIT", "BLOCK_N", "num_warps", "num_stages")
                for values in itertools.product((128, 256), (256, 512, 1024), (32, 64, 128), (4,), (2, 3)):
                    conf = dict(zip(keys, values))
                    f = one_call("kernel", conf)
                    us = graph_us(lambda: [f(x, ws[i], a32[i], b32[i], a16[i], b16[i]) for i in range(calls)], calls)
                    sweep[values] = sweep.get(values, 0.0) + (us - times["base"]) * calls
    path = results.append(rows)
    print(f"appended {len(rows)} rows to {path} (run {results.meta['run']})")
    if sweep:
        best = min(sweep, key=sweep.get)
        print(f"best config at 32 rows over a step: {best}, {sweep[best]:.1f} us of LoRA a step "
              f"(the default {tuple(lora_decode.CUDA_CONFIG.values())}: {sweep.get(tuple(lora_decode.CUDA_CONFIG.values()), float('nan')):.1f})")


if __name__ == "__main__":
    main()
