"""A 4-bit weight's dequantization alone: bitsandbytes' against fastaf's kernels, GPU time.

    python bench/dequant.py [--providers bnb-dequant,fastaf-bytes,fastaf-blocks] [--name dequant-4bit]

Weights of the Llama-3-8B shape's projections (N x K: 4096 x 4096, 1024 x 4096, 14336 x 4096,
4096 x 14336), random bf16, quantized by bitsandbytes to NF4 with double quantization (as QLoRA
recipes do); ``--calls`` distinct weights of a shape per graph, so the packed bytes come from HBM
as in a model's step. Each provider dequantizes into a given bf16 buffer, is checked equal to
bitsandbytes' own dequantization (bit for bit), then timed as CUDA-graph replays (GPU time, no
launch cost: a training step's launches run ahead of its GPU), ``ms`` per weight, beside the
4096-row bf16 GEMM of that weight (``gemm_ms``, the forward it feeds):
- bnb-dequant: bitsandbytes' ops, the absmaxes first (``dequantize_blockwise`` and the offset),
  then the weight: what fastaf runs with ``FASTAF_DEQUANT_KERNEL=0``;
- fastaf-bytes: ``kernels.dequant_4bit`` with ``kernel="bytes"``, one launch, a flat run of packed
  bytes per program;
- fastaf-blocks: the same values with whole quantization blocks per program, each block's scale
  loaded once (``kernel="blocks"``, the default: faster at every shape of run 8126).
Rows go to bench/results/dequant-4bit.csv (see bench/README.md).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import _harness as H  # noqa: E402

SHAPES = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)]
PROVIDERS = ["bnb-dequant", "fastaf-bytes", "fastaf-blocks"]
ROWS = 4096  # the GEMM's rows: 4 x 1024 tokens, bench/qlora.py's step
CASE = ("N", "K", "rows", "quant")
FIGURES = ("ms", "gemm_ms")


def quantized(n: int, k: int, calls: int) -> list:
    """``calls`` NF4 weights (N, K) with double quantization: (packed, state) pairs."""
    import bitsandbytes.functional as bnb_functional

    out = []
    for i in range(calls):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(i)) / 64
        out.append(bnb_functional.quantize_4bit(w, quant_type="nf4", compress_statistics=True))
    return out


def dequantizer(provider: str, packed: torch.Tensor, state, out: torch.Tensor):
    """A call that writes ``packed``'s weight into ``out`` the provider's way."""
    from fastaf.kernels import dequant_4bit

    nested = (state.absmax, state.state2.absmax, state.state2.code, state.offset)
    if provider == "bnb-dequant":
        shape = list(out.shape)

        def run():
            absmax = torch.ops.bitsandbytes.dequantize_blockwise(state.absmax, state.state2.absmax, state.state2.code,
                                                                 state.state2.blocksize, torch.float32) + state.offset
            torch.ops.bitsandbytes.dequantize_4bit.out(packed, absmax, state.blocksize, "nf4", shape, out.dtype,
                                                       out=out)
        return run
    kernel = provider.removeprefix("fastaf-")
    return lambda: dequant_4bit.dequant_4bit(packed, *nested, "nf4", state.blocksize, state.state2.blocksize, out,
                                             kernel=kernel)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--providers", default=",".join(PROVIDERS), help="comma-separated")
    ap.add_argument("--calls", type=int, default=8, help="distinct weights of a shape per graph (default 8)")
    ap.add_argument("--name", default="dequant-4bit", help="results file bench/results/<name>.csv")
    args = ap.parse_args()
    names = [n for n in args.providers.split(",") if n]
    unknown = sorted(set(names) - set(PROVIDERS))
    if unknown:
        raise SystemExit(f"unknown providers {unknown}; known: {PROVIDERS}")
    if not torch.cuda.is_available():
        raise SystemExit("bench/dequant.py times CUDA kernels: no CUDA device here")
    import bitsandbytes.functional as bnb_functional

    results = H.Results(args.name, CASE, FIGURES)
    rows = []
    for n, k in SHAPES:
        weights = quantized(n, k, args.calls)
        outs = [torch.empty(n, k, device="cuda", dtype=torch.bfloat16) for _ in weights]
        x = torch.randn(ROWS, k, device="cuda", dtype=torch.bfloat16)
        dense = [bnb_functional.dequantize_4bit(q, s) for q, s in weights]
        gemm_ms = H.graph_us(lambda: [F.linear(x, w) for w in dense], len(dense)) / 1e3
        for provider in names:
            calls = [dequantizer(provider, q, s, out) for (q, s), out in zip(weights, outs)]
            for call, want, out in zip(calls, dense, outs):
                out.zero_()
                call()
                if not torch.equal(out, want):
                    raise SystemExit(f"{provider} at {n} x {k}: the weight differs from bitsandbytes' dequantization")
            ms = H.graph_us(lambda: [call() for call in calls], len(calls)) / 1e3
            gb_s = (n * k * 2 + n * k // 2) / (ms * 1e-3) / 1e9  # bf16 written, packed bytes read
            rows.append({"provider": provider, "N": n, "K": k, "rows": ROWS, "quant": "nf4-double",
                         "ms": round(ms, 5), "gemm_ms": round(gemm_ms, 5)})
            print(f"{provider:14s} {n:6d} x {k:6d}  {ms * 1e3:8.1f} us  {gb_s:7.0f} GB/s  "
                  f"({ms / gemm_ms:5.3f} of the {ROWS}-row GEMM's {gemm_ms * 1e3:.1f} us)", flush=True)
        del weights, outs, dense
        torch.cuda.empty_cache()
    path = results.append(rows)
    print(f"appended {len(rows)} rows to {path} (run {results.meta['run']})")


if __name__ == "__main__":
    main()
