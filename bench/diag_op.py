"""Where does the public op spend time beyond the kernel launchers? (diagnostic, not a benchmark)

    python bench/diag_op.py [M K N r]
    python bench/diag_op.py --host-bisect [M K N r]   # host time of each layer, interleaved
    python bench/diag_op.py --host-profile            # cProfile of the public op's fwd+bwd

Times, at one shape (bf16): the launchers' fwd+bwd, the registered ops called directly, the
autograd.Function, and the public ``lora_linear``; then prints a profiler table of the public
op's fwd+bwd (CUDA time and host time per op) and the host time per call of each layer.
"""
from __future__ import annotations

import math
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fastaf as fa  # noqa: E402
from fastaf.functional._lora_linear import _LoRALinearFn  # noqa: E402
from fastaf.kernels import lora_linear as ll  # noqa: E402
from fastaf.kernels.lora_linear_plan import _choose  # noqa: E402


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


def host_bisect(M: int = 2048, K: int = 4096, N: int = 4096, r: int = 16) -> None:
    """Host time per call of each layer between the public op and the raw cuBLAS ops, fwd and fwd+bwd.

    Host time is measured on a nearly idle GPU: each variant's calls are issued back to back and
    timed before the synchronize, at a shape given on the command line. Then a cProfile of the
    public op's and the addmm Function's fwd+bwd with single-threaded autograd.
    """
    import cProfile
    import pstats

    from bench.bench_linear import _AddmmLoRA
    from fastaf.functional import _lora_linear as L

    dev, dt, s = "cuda", torch.bfloat16, 2.0
    xg = torch.randn(M, K, device=dev, dtype=dt, requires_grad=True)
    W = torch.randn(N, K, device=dev, dtype=dt) / math.sqrt(K)
    A = (torch.randn(r, K, device=dev, dtype=dt) / math.sqrt(K)).requires_grad_()
    B = (torch.randn(N, r, device=dev, dtype=dt) / math.sqrt(r)).requires_grad_()
    dy = torch.randn(M, N, device=dev, dtype=dt)
    lora = fa.LoRA(A, B, s)
    x, Ad, Bd = xg.detach(), A.detach(), B.detach()
    grads = (xg, A, B)
    print(f"host bisect M={M} K={K} N={N} r={r}: dispatch fwd={_choose('auto', 'fwd', x, M, K, N, r)} "
          f"bwd={_choose('auto', 'bwd', x, M, K, N, r)}")

    def raw_fwd():
        h = x @ Ad.T
        return torch.nn.functional.linear(x, W).addmm_(h, Bd.T, alpha=s), h

    def raw_bwd(h):
        dh = torch.mm(dy, Bd).mul_(s)
        db = torch.mm(dy.T, h).mul_(s)
        return torch.mm(dy, W).addmm_(dh, Ad), torch.mm(dh.T, x), db

    variants = {
        "raw ops": (lambda: raw_fwd(), lambda: raw_bwd(raw_fwd()[1])),
        "launchers": (lambda: ll.lora_linear_fwd_unchecked(x, W, None, Ad, Bd, s, 0.0, None, "auto"),
                      lambda: ll.lora_linear_bwd_unchecked(
                          dy, x, W, Ad, Bd, ll.lora_linear_fwd_unchecked(x, W, None, Ad, Bd, s, 0.0, None, "auto")[1],
                          s, 0.0, None, True, "auto")),
        "addmm Function": (lambda: _AddmmLoRA.apply(xg, W, A, B, s),
                           lambda: torch.autograd.grad(_AddmmLoRA.apply(xg, W, A, B, s), grads, dy)),
        "eager Function": (lambda: L._apply_direct(0, xg, W, None, A, B, s, 0.0, None, "auto"),
                           lambda: torch.autograd.grad(L._apply_direct(0, xg, W, None, A, B, s, 0.0, None, "auto"),
                                                       grads, dy)),
        "public": (lambda: fa.functional.lora_linear(xg, W, None, lora),
                   lambda: torch.autograd.grad(fa.functional.lora_linear(xg, W, None, lora), grads, dy)),
        # torch.func.grad's grad level around the same call: functorch's cost on top of "public"
        "public func.grad": (lambda: fa.functional.lora_linear(xg, W, None, lora),
                             lambda: torch.func.grad(lambda xx, lo: (fa.functional.lora_linear(xx, W, None, lo) * dy).sum(),
                                                     argnums=(0, 1))(x, fa.LoRA(Ad, Bd, s))),
    }
    # rounds interleave the variants, so a noisy stretch of the host spreads over all of them
    timings: dict[tuple[str, str, bool], list[float]] = {}
    for _ in range(8):
        for threads in (True, False):  # autograd's device thread runs the backward, or this thread
            torch.autograd.set_multithreading_enabled(threads)
            for name, fns in variants.items():
                for mode, fn in zip(("fwd", "fwd+bwd"), fns):
                    if mode == "fwd" and not threads:
                        continue
                    for _ in range(5):
                        fn()
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(40):
                        fn()
                    timings.setdefault((name, mode, threads), []).append((time.perf_counter() - t0) / 40 * 1e6)
    torch.autograd.set_multithreading_enabled(True)
    print("  host us per call: median (min) of 8 interleaved rounds of 40 calls")
    for name in variants:
        cells = [f"{mode}{'' if threads else ' 1-thread'} {statistics.median(v):6.1f} ({min(v):6.1f})"
                 for (n, mode, threads), v in timings.items() if n == name]
        print(f"  {name:16s} " + "   ".join(cells))
    # GPU-timed as bench_linear times it (do_bench clears L2 between calls): a host-bound variant
    # reads as host time, and a variant that waits on the GPU somewhere reads as host + GPU time
    for name, (fwd, fwd_bwd) in variants.items():
        ms = [triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") for fn in (fwd, fwd_bwd)]
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fwd_bwd()
        torch.cuda.set_sync_debug_mode("default")
        syncs = [str(w.message).splitlines()[0][:80] for w in caught if "synchroniz" in str(w.message)]
        print(f"  {name:16s} do_bench fwd {ms[0]:.4f} ms  fwd+bwd {ms[1]:.4f} ms   syncs: {syncs or 'none'}")
    torch.cuda.synchronize()
    torch.autograd.set_multithreading_enabled(False)  # cProfile sees only the calling thread
    for name in ("public", "addmm Function") if "--cprofile" in sys.argv else ():
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(100):
            variants[name][1]()
        prof.disable()
        torch.cuda.synchronize()
        print(f"---- cProfile: {name} fwd+bwd x100")
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    if "--host-profile" in sys.argv:
        host_profile()
    elif "--host-bisect" in sys.argv:
        host_bisect(*(int(v) for v in sys.argv[2:6] if v.isdigit()))
    else:
        main()
