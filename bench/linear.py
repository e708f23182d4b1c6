"""One LoRA linear against the frozen cuBLAS GEMM it adds to, forward and forward+backward.

    python bench/linear.py [--quick] [--providers base,addmm,fastaf] [--tokens 8192] [--no-check]

Shapes: tokens M in {2048, 8192, 16384}, (K, N) in {(4096, 4096), (4096, 14336), (14336, 4096)}
(Llama-3-8B attention and MLP), r in {16, 64}, bf16; ``--quick``: five of them.
Providers, every one but the fastaf-kernels / -triton pair through autograd:
- base: ``F.linear(x, W)`` (cuBLAS); its forward+backward is the forward plus the dX GEMM (W is
  frozen). No LoRA layer can beat it.
- eager: ``F.linear(x, W) + F.linear(F.linear(x, A), B) * s``; compile: ``torch.compile`` of it.
- addmm: cuBLAS base, then ``out.addmm_(x @ A.T, B.T, alpha=s)`` with a hand-written backward
  (the unsloth / axolotl path).
- peft: a PEFT LoRA ``Linear`` with bf16 adapters.
- fastaf: ``fastaf.functional.lora_linear`` (impl="auto": the measured dispatch picks Triton or
  cuBLAS per shape from the tuning cache; the log says whether this GPU's cache was tuned).
- fastaf-kernels / fastaf-triton: fastaf's registered ops (``torch.ops.fastaf.lora_linear_fwd`` /
  ``_bwd``) called directly, without autograd, impl="auto" / impl="triton": the fused kernels
  where the dispatch picks cuBLAS, and autograd's host cost by difference.
forward+backward computes dx, dA and dB. Each provider's outputs are checked against an fp32
reference before it is timed. All of a shape's providers are timed in ``--rounds`` interleaved
rounds (``_harness.time_interleaved``), on inputs rotated over sets larger than twice the L2.
Rows go to bench/results/linear.csv: see bench/README.md.
"""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import _harness as H  # noqa: E402

TOKENS = [2048, 8192, 16384]
KN = [(4096, 4096), (4096, 14336), (14336, 4096)]
RANKS = [16, 64]
QUICK = [(2048, 4096, 4096, 16), (8192, 4096, 4096, 16), (8192, 4096, 14336, 16), (8192, 14336, 4096, 16),
         (16384, 4096, 4096, 64)]
PROVIDERS = ["base", "eager", "addmm", "compile", "peft", "fastaf", "fastaf-kernels", "fastaf-triton"]
L2_BYTES = 60 * 2**20  # H200: 60 MB (H100: 50 MB); inputs rotate over sets totalling > 2x this
CASE = ("mode", "M", "K", "N", "r", "tuned", "rounds")
FIGURES = ("ms", "p20", "p80")


def tuned_here() -> bool:
    """Whether ``fastaf-tune`` has a cache for this GPU and triton version (``fastaf-tune --list``,
    printed); without one, impl="auto" reads the tuning fastaf ships for the GPU, else defaults."""
    import triton

    root = str(Path(__file__).resolve().parents[1])  # this tree's fastaf, as imported here
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-m", "fastaf.cli.tune", "--list"], capture_output=True, text=True, env=env)
    print(out.stdout.rstrip() or out.stderr.rstrip(), flush=True)
    mine = f"gpu={H.gpu_name()} triton={triton.__version__}"
    return any(line.strip().startswith(mine) for line in out.stdout.splitlines())


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


def make_providers(W, A, B, s, K, N, r, names):
    """{name: (fwd(x, dy), fwd_bwd(x, dy))}; fwd returns y, fwd_bwd returns (dx, dA, dB)."""
    Ag, Bg = torch.nn.Parameter(A.clone()), torch.nn.Parameter(B.clone())  # Parameters: PEFT shares them

    def eager(x):
        return F.linear(x, W) + F.linear(F.linear(x, Ag), Bg) * s

    def autograd_pair(f):
        def fb(x, dy):
            xg = x.detach().requires_grad_(True)
            return torch.autograd.grad(f(xg), (xg, Ag, Bg), dy)

        return (lambda x, dy: f(x)), fb

    def ops(impl):
        """fastaf's registered ops, one group (the leading 1) of one adapter, no autograd."""
        fwd_op, bwd_op = torch.ops.fastaf.lora_linear_fwd, torch.ops.fastaf.lora_linear_bwd
        W1, A1, B1 = W[None], A[None], B[None]

        def fwd(x, dy):
            return fwd_op(x[None], W1, None, A1, B1, s, 0.0, None, impl)[0][0]

        def fb(x, dy):
            _, h = fwd_op(x[None], W1, None, A1, B1, s, 0.0, None, impl)
            dx, da, db = bwd_op(dy[None], x[None], W1, A1, B1, h, s, 0.0, None, True, impl)
            return dx[0], da[0], db[0]

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
        elif name == "fastaf":
            import fastaf as fa

            lora = fa.LoRA(Ag, Bg, scale=s)
            out[name] = autograd_pair(lambda x: fa.functional.lora_linear(x, W, None, lora))
        elif name in ("fastaf-kernels", "fastaf-triton"):
            import fastaf  # noqa: F401  (registers the fastaf:: ops)

            out[name] = ops("auto" if name == "fastaf-kernels" else "triton")
        elif name == "peft":
            try:
                from peft import LoraConfig
                from peft.tuners.lora import Linear as PeftLinear
            except ImportError:
                print("peft not installed; skipping provider peft", flush=True)
                continue
            base = torch.nn.Linear(K, N, bias=False, device=W.device, dtype=W.dtype)
            base.weight.data = W
            config = LoraConfig(r=r, lora_alpha=s * r, lora_dropout=0.0)
            layer = PeftLinear(base, "default", config=config, r=r, lora_alpha=s * r)
            layer = layer.to(W.dtype)  # bf16 adapters (PEFT's default would keep them fp32)
            layer.lora_A["default"].weight = Ag  # share the adapter tensors
            layer.lora_B["default"].weight = Bg
            layer.base_layer.weight.requires_grad_(False)
            out[name] = autograd_pair(layer)
        else:
            raise SystemExit(f"unknown provider {name!r}; providers: {PROVIDERS}")
    return out


def run_shape(M, K, N, r, names, check, warmup, rep, rounds) -> list[dict]:
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
    provs = make_providers(W, A, B, s, K, N, r, names)
    timers = {}
    for name, (fwd, fb) in provs.items():
        for mode, fn in (("fwd", fwd), ("fwd_bwd", fb)):
            if check and name != "base":  # the base is not a LoRA layer
                out = fn(xs[0], dys[0])
                outs = [out] if mode == "fwd" else list(out)
                err = max(H.rel_err(o, ref) for o, ref in zip(outs, refs[mode]))
                if not err < 2e-2:
                    print(f"!! {name} {mode} M={M} K={K} N={N} r={r}: rel err {err:.3g}", flush=True)
            i = [0]

            def step(fn=fn, i=i):
                i[0] = (i[0] + 1) % n_sets
                return fn(xs[i[0]], dys[i[0]])

            timers[(name, mode)] = step
    times = H.time_interleaved(timers, rounds=rounds, warmup=warmup, rep=rep)
    rows = []
    for name in provs:
        cells = []
        for mode in ("fwd", "fwd_bwd"):
            t = times[(name, mode)]
            spread = (max(t["rounds"]) - min(t["rounds"])) / t["ms"]  # the noise: rounds disagree by this
            cells.append(f"{mode} {t['ms']:.4f} ms (rounds ±{spread / 2:.1%})")
            rows.append({"provider": name, "mode": mode, "M": M, "K": K, "N": N, "r": r,
                         **{k: t[k] for k in FIGURES}})
        print(f"  {name:15s} " + "  ".join(cells), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"only {QUICK}")
    p.add_argument("--providers", default=",".join(PROVIDERS))
    p.add_argument("--no-check", action="store_true", help="skip the fp32 reference check")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="M values of the full run")
    p.add_argument("--rep", type=int, default=200, help="ms of timing per provider and mode, over all rounds")
    p.add_argument("--rounds", type=int, default=4, help="interleaved timing rounds (see _harness.time_interleaved)")
    p.add_argument("--name", default="linear", help="results file bench/results/<name>.csv")
    args = p.parse_args()
    names = [n for n in args.providers.split(",") if n]
    results = H.Results(args.name, CASE, FIGURES)
    torch._dynamo.config.cache_size_limit = 64  # one compiled eager per shape
    tokens = [int(m) for m in args.tokens.split(",") if m]
    shapes = QUICK if args.quick else [(M, K, N, r) for M in tokens for K, N in KN for r in RANKS]
    tuned = tuned_here()
    print(f"{H.gpu_name()}  torch {torch.__version__}  tuned for this GPU: {tuned}", flush=True)
    rows: list[dict] = []
    for M, K, N, r in shapes:
        print(f"M={M} K={K} N={N} r={r}", flush=True)
        shape_rows = run_shape(M, K, N, r, names, not args.no_check, 25, args.rep, args.rounds)
        for row in shape_rows:
            row.update(tuned=tuned, rounds=args.rounds)
        results.append(shape_rows)  # after every shape: a run cut short keeps what it measured
        rows += shape_rows
        torch.cuda.empty_cache()  # the shape's inputs, freed with its providers
    print(f"\nappended {len(rows)} rows to {results.paths[0]} (run {results.meta['run']}); time / base:")
    print(H.ratio_table(rows, ("mode", "M", "K", "N", "r")))


if __name__ == "__main__":
    main()
