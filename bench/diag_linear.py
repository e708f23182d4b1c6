"""Where the fused backward's time goes: each kernel alone, the whole launcher, and the same
launcher replayed from a CUDA graph (the gap between the last two is host launch overhead).

    python bench/diag_linear.py [M K N r ...]
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fastaf.kernels import lora_linear as ll  # noqa: E402


def main() -> None:
    vals = [int(v) for v in sys.argv[1:]] or [2048, 4096, 4096, 16, 8192, 4096, 4096, 16]
    for M, K, N, r in zip(*[iter(vals)] * 4):
        dev, dt = "cuda", torch.bfloat16
        x, w = torch.randn(M, K, device=dev, dtype=dt), torch.randn(N, K, device=dev, dtype=dt) / K**0.5
        a, b = torch.randn(r, K, device=dev, dtype=dt) / K**0.5, torch.randn(N, r, device=dev, dtype=dt)
        dy = torch.randn(M, N, device=dev, dtype=dt)
        _, h = ll.lora_linear_fwd(x, w, None, a, b, 2.0, 0.0, None, impl="triton")
        dh, _ = ll.bwd_dy(dy, b, h, 2.0)
        parts = {
            "cublas fwd": lambda: torch.nn.functional.linear(x, w),
            "cublas dx": lambda: torch.mm(dy, w),
            "fwd_h": lambda: ll.fwd_h(x, a, 0.0, None),
            "gemm fwd": lambda: ll.gemm(x, w.T, h, b.T, None, 2.0, 0.0, None, dt),
            "bwd_dy": lambda: ll.bwd_dy(dy, b, h, 2.0),
            "bwd_da": lambda: ll.bwd_da(dh, x, 0.0, None),
            "gemm dx": lambda: ll.gemm(dy, w, dh, a, None, 1.0, 0.0, None, dt),
            "fwd triton": lambda: ll.lora_linear_fwd(x, w, None, a, b, 2.0, 0.0, None, impl="triton"),
            "bwd triton": lambda: ll.lora_linear_bwd(dy, x, w, a, b, h, 2.0, 0.0, None, True, impl="triton"),
            "bwd addmm": lambda: ll.lora_linear_bwd(dy, x, w, a, b, h, 2.0, 0.0, None, True, impl="addmm"),
        }
        print(f"M={M} K={K} N={N} r={r}")
        for name, fn in parts.items():
            ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
            line = f"  {name:12s} {ms * 1e3:8.1f} us"
            if name in ("fwd triton", "bwd triton", "bwd addmm"):
                try:
                    g = triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
                    line += f"   graph {g * 1e3:8.1f} us"
                except Exception as err:  # noqa: BLE001
                    line += f"   graph failed ({type(err).__name__})"
            print(line, flush=True)


if __name__ == "__main__":
    main()
