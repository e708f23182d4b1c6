"""Where the grouped op's time goes: CUDA kernel times of one call, per case (torch.profiler).

    python bench/diag_multi.py            # kernel times
    python bench/diag_multi.py --host     # host time per call, and a cProfile of the hot calls
    python bench/diag_multi.py --sweep    # the segment kernels' tiles, split fill and warps per case

Cases and providers as bench_multi (fwd and fwd_bwd of ``lora_linear_multi``, fused and not).
Prints, per case, each kernel's summed CUDA time over 20 calls divided by 20.
"""
from __future__ import annotations

import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.bench_multi import CASES, providers  # noqa: E402


def main() -> None:
    for n, t in CASES:
        for mode in ("fwd", "fwd_bwd"):
            fns = providers(n, t, mode)
            for name in ("base", "fastaf-fused", "fastaf-unfused"):
                fn = fns[name]
                for _ in range(5):
                    fn()
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(20):
                        fn()
                    torch.cuda.synchronize()
                rows = sorted(((e.key, e.device_time_total / 20) for e in prof.key_averages()), key=lambda r: -r[1])
                total = sum(us for _, us in rows)
                print(f"{n}x{t} {mode} {name}: {total:.1f} us/call")
                for key, us in rows[:8]:
                    print(f"    {us:8.1f} us  {key[:90]}")


def host() -> None:
    """Host microseconds per call (the GPU kept busy ahead, so this is the launch path's cost)."""
    for n, t, mode in ((64, 1, "fwd"), (64, 64, "fwd_bwd")):
        fns = providers(n, t, mode)
        for name in ("base", "fastaf", "fastaf-ref"):
            fn = fns[name]
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(50):
                fn()
            print(f"{n}x{t} {mode} {name}: host {(time.perf_counter() - t0) / 50 * 1e6:.1f} us/call", flush=True)
            torch.cuda.synchronize()
        torch.autograd.set_multithreading_enabled(False)  # cProfile sees only this thread
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(50):
            fns["fastaf"]()
        prof.disable()
        torch.cuda.synchronize()
        torch.autograd.set_multithreading_enabled(True)
        print(f"---- cProfile {n}x{t} {mode} fastaf x50")
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)


def sweep() -> None:
    """Time shrink (h) and expand_ alone, CUDA-graph replays, over the module's tunables."""
    import itertools

    import triton.testing

    from fastaf.kernels import lora_multi as LM

    saved = (dict(LM.CUDA_BLOCKS), LM.FILL, LM.WARPS)
    K = N = 4096
    for n, t in CASES:
        x = torch.randn(n * t, K, device="cuda", dtype=torch.bfloat16)
        A = torch.randn(n, 16, K, device="cuda", dtype=torch.bfloat16)
        Bt = torch.randn(n, N, 16, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        y = torch.randn(n * t, N, device="cuda", dtype=torch.bfloat16)
        ids = torch.arange(n, device="cuda")
        h = LM.shrink(x, A, ids)
        for bk, fill, warps in itertools.product((64, 128, 256), (1, 2, 4), (4, 8)):
            LM.CUDA_BLOCKS.update(BLOCK_K=bk, BLOCK_N=bk)
            LM.FILL, LM.WARPS = fill, warps
            LM._plans.clear()
            us = [1e3 * triton.testing.do_bench_cudagraph(f, rep=50)
                  for f in (lambda: LM.shrink(x, A, ids), lambda: LM.expand_(y, h, Bt, ids, 1.0))]
            print(f"{n}x{t} BLOCK_K=N={bk} fill={fill} warps={warps}: shrink {us[0]:6.1f} us  expand {us[1]:6.1f} us",
                  flush=True)
    LM.CUDA_BLOCKS.update(saved[0])
    LM.FILL, LM.WARPS = saved[1], saved[2]
    LM._plans.clear()


if __name__ == "__main__":
    sweep() if "--sweep" in sys.argv else host() if "--host" in sys.argv else main()
