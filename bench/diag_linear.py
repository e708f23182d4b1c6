"""Where the fused LoRA linear's time goes: each kernel alone (GPU time from CUDA-graph replays,
against its memory floor), each launcher's host time per call, and the whole fwd / bwd launchers
timed plainly and from a CUDA graph (the gap between the two is host launch overhead).

    python bench/diag_linear.py [M K N r ...]

Floors: bytes each kernel must move (its big operand read once) over the measured device-copy
bandwidth (BENCH.md: ~4.2 TB/s on H200, re-measured here).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fastaf.kernels import lora_linear as ll  # noqa: E402


def _copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    src = torch.empty(512 * 2**20, device="cuda", dtype=torch.uint8)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench_cudagraph(lambda: dst.copy_(src), rep=50, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3)


def _host_us(fn, n: int = 200) -> float:
    """Host time per call while the GPU keeps up (calls are issued back to back, one sync)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return us


def main() -> None:
    vals = [int(v) for v in sys.argv[1:]] or [8192, 4096, 4096, 16, 8192, 4096, 4096, 64]
    bw = _copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: device copy {bw / 1e12:.2f} TB/s")
    for M, K, N, r in zip(*[iter(vals)] * 4):
        dev, dt = "cuda", torch.bfloat16
        x, w = torch.randn(M, K, device=dev, dtype=dt), torch.randn(N, K, device=dev, dtype=dt) / K**0.5
        a, b = torch.randn(r, K, device=dev, dtype=dt) / K**0.5, torch.randn(N, r, device=dev, dtype=dt)
        dy = torch.randn(M, N, device=dev, dtype=dt)
        _, h = ll.lora_linear_fwd(x, w, None, a, b, 2.0, 0.0, None, impl="triton")
        dh, _ = ll.bwd_dy(dy, b, h, 2.0)
        elt = x.element_size()
        parts = {  # name: (fn, floor bytes or None)
            "cublas fwd": (lambda: torch.nn.functional.linear(x, w), None),
            "cublas dx": (lambda: torch.mm(dy, w), None),
            "fwd_h": (lambda: ll.fwd_h(x, a, 0.0, None), M * K * elt),
            "gemm fwd": (lambda: ll.gemm(x, w.T, h, b.T, None, 2.0, 0.0, None, dt), None),
            "bwd_dy": (lambda: ll.bwd_dy(dy, b, h, 2.0), M * N * elt),
            "bwd_da": (lambda: ll.bwd_da(dh, x, 0.0, None), M * K * elt),
            "gemm dx": (lambda: ll.gemm(dy, w, dh, a, None, 1.0, 0.0, None, dt), None),
            "fwd triton": (lambda: ll.lora_linear_fwd(x, w, None, a, b, 2.0, 0.0, None, impl="triton"), None),
            "bwd triton": (lambda: ll.lora_linear_bwd(dy, x, w, a, b, h, 2.0, 0.0, None, True, impl="triton"), None),
            "bwd addmm": (lambda: ll.lora_linear_bwd(dy, x, w, a, b, h, 2.0, 0.0, None, True, impl="addmm"), None),
        }
        print(f"M={M} K={K} N={N} r={r}   (us; graph = GPU time from CUDA-graph replays)")
        print(f"  {'':12s} {'do_bench':>9s} {'graph':>9s} {'host':>8s} {'floor':>7s} {'x floor':>8s}")
        for name, (fn, floor_bytes) in parts.items():
            ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
            try:
                g = triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3
            except Exception:  # noqa: BLE001
                g = float("nan")
            host = _host_us(fn)
            line = f"  {name:12s} {ms * 1e3:9.1f} {g:9.1f} {host:8.1f}"
            if floor_bytes:
                floor = floor_bytes / bw * 1e6
                line += f" {floor:7.1f} {g / floor:8.2f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
