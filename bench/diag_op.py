"""Where does the public op spend time beyond the kernel launchers? (diagnostic, not a benchmark)

    python bench/diag_op.py [M K N r]

Times, at one shape (bf16): the launchers' fwd+bwd, the registered ops called directly, the
autograd.Function, and the public ``lora_linear``; then prints a profiler table of the public
op's fwd+bwd (CUDA time and host time per op) and the host time per call of each layer.
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fastaf as fa  # noqa: E402
from fastaf.functional._lora_linear import _LoRALinearFn  # noqa: E402
from fastaf.kernels import lora_linear as ll  # noqa: E402


def main() -> None:
    M, K, N, r = (int(v) for v in sys.argv[1:5]) if len(sys.argv) > 4 else (8192, 4096, 4096, 16)
    dev, dt, s = "cuda", torch.bfloat16, 2.0
    x = torch.randn(M, K, device=dev, dtype=dt)
    W = torch.randn(N, K, device=dev, dtype=dt) / math.sqrt(K)
    A = (torch.randn(r, K, device=dev, dtype=dt) / math.sqrt(K)).requires_grad_()
    B = (torch.randn(N, r, device=dev, dtype=dt) / math.sqrt(r)).requires_grad_()
    dy = torch.randn(M, N, device=dev, dtype=dt)
    lora = fa.LoRA(A, B, s)

    def launchers():
        y, h = ll.lora_linear_fwd(x, W, None, A.detach(), B.detach(), s, 0.0, None)
        return ll.lora_linear_bwd(dy, x, W, A.detach(), B.detach(), h, s, 0.0, None, True)

    def ops():
        y, h = torch.ops.fastaf.lora_linear_fwd(x[None], W[None], None, A.detach()[None], B.detach()[None], s, 0.0, None, "auto")
        return torch.ops.fastaf.lora_linear_bwd(dy[None], x[None], W[None], A.detach()[None], B.detach()[None], h, s, 0.0, None, True, "auto")

    xg = x.detach().requires_grad_()

    def function():
        y, _ = _LoRALinearFn.apply(xg[None], W[None], None, A[None], B[None], s, 0.0, None, "auto")
        return torch.autograd.grad(y, (xg, A, B), dy[None])

    def public():
        return torch.autograd.grad(fa.functional.lora_linear(xg, W, None, lora), (xg, A, B), dy)

    from bench.bench_linear import _AddmmLoRA

    def addmm():  # the bench's unsloth-style provider: the host cost the public op must match
        return torch.autograd.grad(_AddmmLoRA.apply(xg, W, A, B, s), (xg, A, B), dy)

    def base():
        return torch.nn.functional.linear(x, W), torch.mm(dy, W)

    print(f"M={M} K={K} N={N} r={r} bf16 on {torch.cuda.get_device_name()}")
    for name, fn in (("base", base), ("launchers", launchers), ("ops", ops), ("function", function), ("addmm", addmm),
                     ("public", public)):
        ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        host = (time.perf_counter() - t0) / 200 * 1e3  # host time per call when not GPU-bound at first
        torch.cuda.synchronize()
        print(f"  {name:10s} {ms:7.3f} ms   host-issue {host:6.3f} ms/call")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            public()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18))




def host_profile(M: int = 2048, K: int = 4096, N: int = 4096, r: int = 16) -> None:
    """cProfile of the public op's fwd+bwd: where the host time goes (backward on this thread)."""
    import cProfile
    import pstats

    torch.autograd.set_multithreading_enabled(False)  # cProfile sees only the calling thread
    dev, dt = "cuda", torch.bfloat16
    xg = torch.randn(M, K, device=dev, dtype=dt, requires_grad=True)
    W = torch.randn(N, K, device=dev, dtype=dt) / math.sqrt(K)
    A = (torch.randn(r, K, device=dev, dtype=dt) / math.sqrt(K)).requires_grad_()
    B = (torch.randn(N, r, device=dev, dtype=dt) / math.sqrt(r)).requires_grad_()
    dy = torch.randn(M, N, device=dev, dtype=dt)
    lora = fa.LoRA(A, B, 2.0)
    step = lambda: torch.autograd.grad(fa.functional.lora_linear(xg, W, None, lora), (xg, A, B), dy)  # noqa: E731
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        step()
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    pstats.Stats(prof).sort_stats("cumtime").print_stats("fastaf", 25)


if __name__ == "__main__":
    host_profile() if "--host-profile" in sys.argv else main()
