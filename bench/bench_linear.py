"""LoRA linear vs the frozen cuBLAS base, forward and forward+backward, every BENCH.md shape.

    python bench/bench_linear.py [--quick] [--providers base,addmm,fastaf] [--no-check]

Providers (BENCH.md): base, eager, addmm (an autograd.Function with a hand-written backward, as
unsloth's; every provider but the fastaf-kernels/-triton diagnostics pays autograd's host cost),
compile, peft (bf16 adapters),
fastaf (public op ``fastaf.functional.lora_linear``, impl="auto"; falls back to the kernel
launchers when the package's top level does not import), plus fastaf-kernels (launchers,
impl="auto", no op boundary) and fastaf-triton (launchers forced to impl="triton"), so the
fused kernels are visible where the dispatch picks addmm. fwd_bwd computes dx, dA, dB (W frozen);
the base's fwd_bwd is its forward plus the dX GEMM. Each provider is checked against an fp32
reference before it is timed. All providers of a shape are timed in ``--rounds`` interleaved
rounds (``_harness.time_interleaved``), so clock drift spreads over every provider instead of
landing on one; each row keeps its per-round medians. Rows go to
bench/results/linear-<gpu>.json (and $OUT).
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import _harness as H  # noqa: E402
from fastaf.kernels import _cache  # noqa: E402
from fastaf.kernels import lora_linear as ll  # noqa: E402

TOKENS = [2048, 8192, 16384]
KN = [(4096, 4096), (4096, 14336), (14336, 4096)]
RANKS = [16, 64]
QUICK = [(2048, 4096, 4096, 16), (8192, 4096, 4096, 16), (8192, 4096, 14336, 16), (8192, 14336, 4096, 16),
         (16384, 4096, 4096, 64)]
PROVIDERS = ["base", "eager", "addmm", "compile", "peft", "fastaf", "fastaf-kernels", "fastaf-triton"]
L2_BYTES = 60 * 2**20  # H200: 60 MB (H100: 50 MB); inputs rotate over sets totalling > 2x this


def _public_op():
    try:
        from fastaf.functional import LoRA, lora_linear

        return LoRA, lora_linear
    except Exception as err:  # top-level deps (optree) missing on the device image
        print(f"fastaf public op unavailable ({type(err).__name__}: {err}); fastaf = launchers", flush=True)
        return None


class _AddmmLoRA(torch.autograd.Function):
    """The unsloth / axolotl path: cuBLAS base + ``addmm_`` of the LoRA term, hand-written backward."""

    @staticmethod
    def forward(ctx, x, W, A, B, s):
        h = x @ A.T  # (M, R)
        y = F.linear(x, W).addmm_(h, B.T, alpha=s)
        ctx.save_for_backward(x, W, A, B, h)
        ctx.s = s
        return y

    @staticmethod
    def backward(ctx, dy):
        x, W, A, B, h = ctx.saved_tensors
        dh = (dy @ B).mul_(ctx.s)  # (M, R)
        dB = (dy.T @ h).mul_(ctx.s)  # (N, R)
        dA = dh.T @ x  # (R, K)
        dx = (dy @ W).addmm_(dh, A)  # (M, K)
        return dx, None, dA, dB, None


def make_providers(W, A, B, s, K, N, r, names, public):
    """{name: (fwd(x, dy), fwd_bwd(x, dy))}; fwd returns y, fwd_bwd returns (dx, dA, dB)."""
    Ag, Bg = torch.nn.Parameter(A.clone()), torch.nn.Parameter(B.clone())  # Parameters: PEFT shares them

    def eager(x):
        return F.linear(x, W) + F.linear(F.linear(x, Ag), Bg) * s

    def autograd_pair(f):
        def fb(x, dy):
            xg = x.detach().requires_grad_(True)
            return torch.autograd.grad(f(xg), (xg, Ag, Bg), dy)

        return (lambda x, dy: f(x)), fb

    def kernels(impl):
        def fwd(x, dy):
            return ll.lora_linear_fwd(x, W, None, A, B, s, 0.0, None, impl=impl)[0]

        def fb(x, dy):
            _, h = ll.lora_linear_fwd(x, W, None, A, B, s, 0.0, None, impl=impl)
            return ll.lora_linear_bwd(dy, x, W, A, B, h, s, 0.0, None, True, impl=impl)

        return fwd, fb

    out = {}
    for name in names:
        if name == "base":
            out[name] = (lambda x, dy: F.linear(x, W), lambda x, dy: (F.linear(x, W), torch.mm(dy, W)))
        elif name == "eager":
            out[name] = autograd_pair(eager)
        elif name == "compile":
            out[name] = autograd_pair(torch.compile(eager, dynamic=False))
        elif name == "addmm":
            out[name] = autograd_pair(lambda x: _AddmmLoRA.apply(x, W, Ag, Bg, s))
        elif name == "fastaf-kernels":
            out[name] = kernels("auto")
        elif name == "fastaf-triton":
            out[name] = kernels("triton")
        elif name == "fastaf":
            if public is None:
                out[name] = kernels("auto")
            else:
                LoRA, op = public
                lora = LoRA(Ag, Bg, scale=s)
                out[name] = autograd_pair(lambda x: op(x, W, None, lora))
        elif name == "peft":
            try:
                from peft.tuners.lora import Linear as PeftLinear
            except ImportError:
                print("peft not installed; skipping provider peft", flush=True)
                continue
            base = torch.nn.Linear(K, N, bias=False, device=W.device, dtype=W.dtype)
            base.weight.data = W
            from peft import LoraConfig

            config = LoraConfig(r=r, lora_alpha=s * r, lora_dropout=0.0)
            layer = PeftLinear(base, "default", config=config, r=r, lora_alpha=s * r)
            layer = layer.to(W.dtype)  # bf16 adapters (PEFT's default would keep them fp32)
            layer.lora_A["default"].weight = Ag  # share the adapter tensors
            layer.lora_B["default"].weight = Bg
            layer.base_layer.weight.requires_grad_(False)
            out[name] = autograd_pair(layer)
    return out


def run_shape(M, K, N, r, names, public, check, rows, warmup, rep, rounds):
    dtype, dev, s = torch.bfloat16, "cuda", 2.0
    g = torch.Generator(device=dev).manual_seed(M + K + N + r)
    rnd = lambda *shape: torch.randn(*shape, device=dev, dtype=dtype, generator=g)  # noqa: E731
    W = rnd(N, K) / math.sqrt(K)
    A = rnd(r, K) / math.sqrt(K)
    B = rnd(N, r) / math.sqrt(r)
    set_bytes = (M * K + 2 * M * N) * 2
    n_sets = max(1, min(8, math.ceil(2 * L2_BYTES / set_bytes)))
    xs = [rnd(M, K) for _ in range(n_sets)]
    dys = [rnd(M, N) for _ in range(n_sets)]
    refs = None
    if check:
        x32, W32, A32, B32, dy32 = (t.float() for t in (xs[0], W, A, B, dys[0]))
        dh = s * dy32 @ B32
        refs = {"fwd": [x32 @ W32.T + s * (x32 @ A32.T) @ B32.T],
                "fwd_bwd": [dy32 @ W32 + dh @ A32, dh.T @ x32, s * dy32.T @ (x32 @ A32.T)]}
    provs = make_providers(W, A, B, s, K, N, r, names, public)
    timers = {}
    for name, (fwd, fb) in provs.items():
        for mode, fn in (("fwd", fwd), ("fwd_bwd", fb)):
            err = None
            if check:
                out = fn(xs[0], dys[0])
                outs = [out] if mode == "fwd" else list(out)
                if name == "base":
                    outs = []  # the base is not a LoRA layer
                err = max((H.rel_err(o, ref) for o, ref in zip(outs, refs[mode])), default=0.0)
                if not err < 2e-2:
                    print(f"!! {name} {mode} M={M} K={K} N={N} r={r}: rel err {err:.3g}", flush=True)
            i = [0]

            def step(fn=fn, i=i):
                i[0] = (i[0] + 1) % n_sets
                return fn(xs[i[0]], dys[i[0]])

            timers[(name, mode)] = (step, err)
    times = H.time_interleaved({k: v[0] for k, v in timers.items()}, rounds=rounds, warmup=warmup, rep=rep)
    for (name, mode), (_, err) in timers.items():
        rows.append({"bench": "linear", "M": M, "K": K, "N": N, "r": r, "dtype": "bfloat16", "mode": mode,
                     "provider": name, **times[(name, mode)], "rel_err": err})
    for name in provs:
        cells = []
        for mode in ("fwd", "fwd_bwd"):
            t = times[(name, mode)]
            spread = (max(t["rounds"]) - min(t["rounds"])) / t["ms"]  # the noise: rounds disagree by this
            cells.append(f"{mode} {t['ms']:.4f} ms (rounds ±{spread / 2:.1%})")
        print(f"  {name:15s} " + "  ".join(cells), flush=True)
    del xs, dys
    torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help=f"only {QUICK}")
    p.add_argument("--providers", default=",".join(PROVIDERS))
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)),
                   help="M values of the full run (a run split over device calls; merge the JSONs)")
    p.add_argument("--rep", type=int, default=200, help="ms of timing per provider and mode, over all rounds")
    p.add_argument("--rounds", type=int, default=4, help="interleaved timing rounds (see _harness.time_interleaved)")
    args = p.parse_args()
    names = [n for n in args.providers.split(",") if n]
    torch._dynamo.config.cache_size_limit = 64
    tokens = [int(m) for m in args.tokens.split(",") if m]
    shapes = QUICK if args.quick else [(M, K, N, r) for M in tokens for K, N in KN for r in RANKS]
    public = _public_op() if "fastaf" in names else None
    tuned = _cache.load() is not None  # this machine's own fastaf-tune run
    cache = str(_cache.cache_path()) if tuned else str(_cache.shipped_path() or "none (defaults)")
    print(f"{H.gpu_name()}  torch {torch.__version__}  tuned: {tuned}  cache: {cache}", flush=True)
    rows: list[dict] = []
    for M, K, N, r in shapes:
        print(f"M={M} K={K} N={N} r={r}", flush=True)
        run_shape(M, K, N, r, names, public, not args.no_check, rows, 25, args.rep, args.rounds)
        # rewritten after every shape so a run cut short keeps what it measured
        path = H.write_results("linear" + ("-quick" if args.quick else ""), rows,
                               {"tuned": tuned, "cache": cache, "fastaf_public_op": public is not None, "rep_ms": args.rep,
                                  "rounds": args.rounds})
    print(f"\nwrote {path}\ntime / base (fwd|fwd_bwd):")
    print(H.ratio_table(rows, ("M", "K", "N", "r"), [n for n in names if n != "base"]))


if __name__ == "__main__":
    main()
