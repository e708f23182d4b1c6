"""Host cost of one Triton launch of the LoRA kernels, layer by layer of the launch path.

    python bench/diag_launch.py [--n 200]

At the 1B shape's q_proj (M=8192, K=N=2048, r=16, bf16 x, fp32 factors) each variant issues
``--n`` launches and reports CPU microseconds per launch (the GPU queue never fills at this n):
- ``launcher``: ``fwd_h`` / ``gemm`` as the op calls them (plan lookup, allocation, LaunchSite);
- ``site``: the ``LaunchSite`` call alone, with the launcher's arguments prebuilt;
- ``run``: Triton's compiled launcher (``CompiledKernel.run``) called directly, hooks None;
then a cProfile of the ``site`` loop, and the source of the launcher's Python ``__call__``.
"""
from __future__ import annotations

import argparse
import cProfile
import inspect
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fastaf.kernels import _launch  # noqa: E402
from fastaf.kernels import lora_linear as ll  # noqa: E402

_raw_stream = torch._C._cuda_getCurrentRawStream


def _per_call_us(fn, n: int) -> float:
    torch.cuda.synchronize()
    c0 = time.process_time()
    for _ in range(n):
        fn()
    c1 = time.process_time()
    torch.cuda.synchronize()
    return (c1 - c0) * 1e6 / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    args = ap.parse_args()
    M, K, N, R = 8192, 2048, 2048, 16
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
    a = torch.randn(R, K, device="cuda") / K**0.5
    b = torch.randn(N, R, device="cuda")
    calls = {}
    original = _launch.LaunchSite.__call__

    def record(site, grid, launch_args, meta, meta_key):
        calls[site] = (grid, launch_args, meta, meta_key)
        return original(site, grid, launch_args, meta, meta_key)

    _launch.LaunchSite.__call__ = record
    h = ll.fwd_h(x, a, 0.0, None)
    ll.gemm(x, w.T, h, b.T, None, 0.5, 0.0, None, x.dtype)
    _launch.LaunchSite.__call__ = original
    for _ in range(3):  # compiled and cached by every site
        h = ll.fwd_h(x, a, 0.0, None)
        ll.gemm(x, w.T, h, b.T, None, 0.5, 0.0, None, x.dtype)
    launchers = {"fwd_h": lambda: ll.fwd_h(x, a, 0.0, None),
                 "gemm": lambda: ll.gemm(x, w.T, h, b.T, None, 0.5, 0.0, None, x.dtype)}
    for (site, (grid, launch_args, meta, meta_key)), (name, launcher) in zip(calls.items(), launchers.items()):
        _, compiled, tail = next(iter(site.compiled.values()))
        dev = torch.cuda.current_device()
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1

        def run():
            compiled.run(grid[0], g1, g2, _raw_stream(dev), compiled.function, compiled.packed_metadata, None,
                         None, None, *launch_args, *tail)

        def site_call():
            site(grid, launch_args, meta, meta_key)

        times = {"launcher": _per_call_us(launcher, args.n), "site": _per_call_us(site_call, args.n),
                 "run": _per_call_us(run, args.n)}
        print(f"{name}: CPU us per launch " + ", ".join(f"{k} {v:.1f}" for k, v in times.items()), flush=True)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.n):
            site_call()
        prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    print(inspect.getsource(type(compiled.run).__call__))
    print("global_scratch_size", compiled.run.global_scratch_size, "profile", compiled.run.profile_scratch_size)


if __name__ == "__main__":
    main()
