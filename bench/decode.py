"""A decoding step's LoRA: what adding it to a linear layer of few rows costs, inside a CUDA graph.

    python bench/decode.py [--rows 1,32,64] [--sweep] [--eager] [--name decode]

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
- linear / linear-fp32: ``fastaf.kernels.lora_decode.linear``, the base GEMM and the LoRA in one
  Triton launch (what eager decoding runs), bf16 or fp32 factors.
- shared (the 2048-input shapes): three siblings on one x (q/k/v) as one ``lora_decode.shrink``
  of their three A's and an ``expand`` each, ``us`` per call as above.
Every provider's output is checked against an fp32 reference first. ``--sweep`` also times the
kernels' configs (``lora_decode.CUDA_CONFIG``'s keys) and prints the best at 32 rows over a
whole step; ``--sweep-linear`` the one-launch linear's (``linear_tiles``) at each of --rows, with
bf16 and with fp32 factors, with a ``linear-best`` / ``linear-best-fp32`` row per shape (configs
that do not fit are skipped). ``--eager`` times eager inference calls instead, host time included (the loop of
calls, no graph), in interleaved rounds, at the --rows given (default 32,512): eager-base
(``F.linear``), and ``ops.lora_linear_decode`` as eager-linear (``decode_linear`` on: one Triton
launch, base GEMM included), eager-kernel (off: cuBLAS's GEMM, then the LoRA in one Triton
launch) and eager-cublas (``eager_decode_kernel`` off too: ``mm`` + ``addmm_``). Rows go to
bench/results/decode.csv (see bench/README.md).
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
PROVIDERS = ("base", "cublas", "compiled", "kernel", "kernel-fp32", "linear", "linear-fp32")
EAGER = ("eager-base", "eager-linear", "eager-kernel", "eager-cublas")
# eager providers -> the flags ``ops.lora_linear_decode`` runs under
EAGER_FLAGS = {"eager-linear": dict(decode_linear=True, eager_decode_kernel=True),
               "eager-kernel": dict(decode_linear=False, eager_decode_kernel=True),
               "eager-cublas": dict(decode_linear=False, eager_decode_kernel=False)}
CASE = ("K", "N", "rows", "r", "calls")
FIGURES = ("us", "max_rel_err")


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
        "linear": lambda x, w, a32, b32, a16, b16: lora_decode.linear(x, w, None, a16, b16, SCALE),
        "linear-fp32": lambda x, w, a32, b32, a16, b16: lora_decode.linear(x, w, None, a32, b32, SCALE),
    }[provider]


def shared_us(x, ws, a16, b16, calls: int) -> tuple[float, float]:
    """Three siblings a layer on one x through one shrink and three expands, per call (us), and
    the rel. error of the first sibling's output."""
    def layer(i):
        part = lora_decode.shrink(x, [a16[i], a16[i + 1], a16[i + 2]])
        return [lora_decode.expand(F.linear(x, ws[i + j]), part[j], b16[i + j], SCALE) for j in range(3)]

    want = F.linear(x.float(), ws[0].float()) + SCALE * (x.float() @ a16[0].float().T) @ b16[0].float().T
    err = H.rel_err(layer(0)[0], want)
    trios = calls - calls % 3
    return H.graph_us(lambda: [layer(i) for i in range(0, trios, 3)], trios), err


def eager_rows(rows_arg: str) -> list[dict]:
    """``--eager``: host time per eager inference call (the ``EAGER`` providers), interleaved rounds."""
    import random
    import time

    import fastaf as fa
    from fastaf import _config
    from fastaf.ops import lora_decode as ops

    dev, bf, out = "cuda", torch.bfloat16, []
    for K, N, _ in SHAPES:
        w = torch.randn(N, K, device=dev, dtype=bf) / K**0.5
        lo = fa.LoRA(torch.randn(R, K, device=dev, dtype=bf) / K**0.5, torch.randn(N, R, device=dev, dtype=bf) / R**0.5,
                     SCALE)
        for M in (int(m) for m in rows_arg.split(",")):
            x = torch.randn(M, K, device=dev, dtype=bf)
            want = F.linear(x.float(), w.float()) + SCALE * (x.float() @ lo.A.float().T) @ lo.B.float().T
            fns, errs = {"eager-base": lambda: F.linear(x, w)}, {"eager-base": 0.0}
            for name, flags in EAGER_FLAGS.items():
                def call(flags=flags):
                    with _config.override(**flags):
                        return ops.lora_linear_decode(x, w, None, lo, "bench")
                with torch.no_grad():
                    errs[name] = H.rel_err(call(), want)
                if errs[name] > 2e-2:
                    raise SystemExit(f"{name} at K={K} N={N} M={M}: {errs[name]:.3g} off the fp32 reference")
                fns[name] = call
            samples = {n: [] for n in fns}
            with torch.no_grad():
                for r in range(16):  # the first round warms up, untimed
                    for name in random.Random(r).sample(list(fns), len(fns)):
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        for _ in range(200):
                            fns[name]()
                        torch.cuda.synchronize()
                        if r:
                            samples[name].append((time.perf_counter() - t0) / 200 * 1e6)
            med = {n: sorted(v)[len(v) // 2] for n, v in samples.items()}
            out += [{"provider": n, "K": K, "N": N, "rows": M, "r": R, "calls": 200, "us": round(med[n], 3),
                     "max_rel_err": round(errs[n], 5)} for n in fns]
            print(f"K={K:5d} N={N:5d} M={M:4d}: " + "  ".join(f"{n} {med[n]:.1f} us" for n in fns), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,32,64", help="comma-separated M")
    ap.add_argument("--sweep", action="store_true", help="also time the kernels' configs")
    ap.add_argument("--sweep-linear", action="store_true", help="also time the one-launch linear's configs "
                    "(lora_decode.linear_tiles' keys) at each --rows, graph-replayed")
    ap.add_argument("--eager", action="store_true", help="time eager calls, host time included (default rows 32,512)")
    ap.add_argument("--name", default="decode", help="results file bench/results/<name>.csv")
    args = ap.parse_args()
    results = H.Results(args.name, CASE, FIGURES)
    if args.eager:
        rows = eager_rows("32,512" if args.rows == "1,32,64" else args.rows)
        print(f"appended {len(rows)} rows to {results.append(rows)} (run {results.meta['run']})")
        return
    torch._dynamo.config.recompile_limit = 64  # "compiled": one graph per shape and rows
    dev, bf = "cuda", torch.bfloat16
    torch.manual_seed(0)
    rows, sweep, linear_sweep = [], {}, {}
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
                times[provider] = H.graph_us(lambda: [f(x, ws[i], a32[i], b32[i], a16[i], b16[i]) for i in range(calls)],
                                           calls)
                rows.append({"provider": provider, **case, "us": round(times[provider], 3), "max_rel_err": round(err, 5)})
            if K == 2048:  # q/k/v-like siblings on one x
                times["shared"], err = shared_us(x, ws, a16, b16, calls)
                rows.append({"provider": "shared", **case, "us": round(times["shared"], 3), "max_rel_err": round(err, 5)})
            extra = "  ".join(f"{p} +{times[p] - times['base']:.2f}" for p in times if p != "base")
            print(f"K={K:5d} N={N:5d} M={M:3d}: base {times['base']:.2f} us/call; over it: {extra}", flush=True)
            if args.sweep and M == 32:
                keys = ("BLOCK_K", "K_PER_SPLIT", "BLOCK_N", "num_warps", "num_stages")
                for values in itertools.product((128, 256), (256, 512, 1024), (32, 64, 128), (4,), (2, 3)):
                    conf = dict(zip(keys, values))
                    f = one_call("kernel", conf)
                    us = H.graph_us(lambda: [f(x, ws[i], a32[i], b32[i], a16[i], b16[i]) for i in range(calls)], calls)
                    sweep[values] = sweep.get(values, 0.0) + (us - times["base"]) * calls
            if args.sweep_linear:
                keys = ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
                for factors, a_s, b_s in (("bf16", a16, b16), ("fp32", a32, b32)):
                    timed = {}
                    for values in itertools.product((16, 32, 64), (64, 128, 256), (2, 4), (3, 4, 5)):
                        conf = dict(zip(keys, values))
                        f = lambda x, w, a, b: lora_decode.linear(x, w, None, a, b, SCALE, config=conf)  # noqa: E731
                        try:
                            err = H.rel_err(f(x, ws[0], a_s[0], b_s[0]), want)
                        except Exception as e:  # noqa: BLE001 - a config that does not fit (shared memory)
                            print(f"  linear {conf} at K={K} N={N} M={M}: skipped ({type(e).__name__})")
                            continue
                        if err > 2e-2:
                            raise SystemExit(f"linear {conf} at K={K} N={N} M={M}: {err:.3g} off the fp32 reference")
                        timed[values] = H.graph_us(lambda: [f(x, ws[i], a_s[i], b_s[i]) for i in range(calls)], calls)
                        over = (timed[values] - times["base"]) * calls
                        linear_sweep[M, factors, values] = linear_sweep.get((M, factors, values), 0.0) + over
                    best = min(timed, key=timed.get)
                    default = times["linear" if factors == "bf16" else "linear-fp32"] - times["base"]
                    print(f"  linear ({factors} factors) at K={K} N={N} M={M}: best {dict(zip(keys, best))} "
                          f"+{timed[best] - times['base']:.2f} us over the base (default +{default:.2f})", flush=True)
                    rows.append({"provider": f"linear-best{'' if factors == 'bf16' else '-fp32'}", **case,
                                 "us": round(timed[best], 3), "max_rel_err": 0.0})
    path = results.append(rows)
    print(f"appended {len(rows)} rows to {path} (run {results.meta['run']})")
    for M, factors in sorted({(m, f) for m, f, _ in linear_sweep}):
        mine = {v: t for (m, f, v), t in linear_sweep.items() if (m, f) == (M, factors)}
        best = min(mine, key=mine.get)
        print(f"linear's best config at {M} rows ({factors} factors) over a step: {best}, {mine[best]:.1f} us "
              "over the base GEMMs")
    if sweep:
        best = min(sweep, key=sweep.get)
        print(f"best config at 32 rows over a step: {best}, {sweep[best]:.1f} us of LoRA a step "
              f"(the default {tuple(lora_decode.CUDA_CONFIG.values())}: {sweep.get(tuple(lora_decode.CUDA_CONFIG.values()), float('nan')):.1f})")


if __name__ == "__main__":
    main()
