"""The LoRA gemm's variants against cuBLAS at one or more shapes (diagnostic, not a benchmark).

    python bench/diag_gemm.py [M K N r ...]      (DIAG_NAME=diag-gemm-1b: the result file's name)

For the forward layout (y = x @ W.T + s * h @ B.T) and the dX layout (dX = dy @ W + dh @ A) it
times, from CUDA-graph replays in interleaved rounds: cuBLAS ``mm`` of the base alone; the
tuned gemm config (what ``impl="auto"`` runs); and the 128x256x64, 256x128x64 and 128x128x64
tiles (fitted to shared memory). Each variant is checked against the fp32 reference first.
Rows go to bench/results/diag-gemm-<gpu>.json. (The committed H100 file is from a run that also
timed two kernel flags since dropped: the LoRA loads ahead of the K loop, a split TMA store.)
"""
from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import _harness as H  # noqa: E402
from fastaf.kernels import lora_linear as ll  # noqa: E402
from fastaf.kernels._device import _smem_limit  # noqa: E402
from fastaf.kernels.lora_linear_configs import fit  # noqa: E402
from fastaf.kernels.lora_linear_plan import _config, _gemm_key, _r_pad  # noqa: E402

ROUNDS = 5


def variants(M: int, K: int, N: int, R: int, w_kn: torch.Tensor) -> dict[str, dict]:
    """name -> full gemm config (fitted to this GPU's shared memory); skipped where none fits."""
    dev = torch.device("cuda")
    key = _gemm_key(M, N, K, R, torch.bfloat16, w_kn)
    tuned = _config("gemm", dev, key)
    raw = {
        "tuned": tuned,
        "128x256x64 w8": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
        "256x128x64 w8": dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
        "128x128x64 w4": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    }
    out = {}
    for name, conf in raw.items():
        fitted = fit("gemm", conf, _r_pad(R), 2, _smem_limit(dev))
        if fitted is not None:
            out[f"{name} ({fitted['num_stages']}st)"] = fitted
    return out


def main() -> None:
    vals = [int(v) for v in sys.argv[1:]] or [8192, 4096, 4096, 16, 8192, 4096, 14336, 16, 8192, 14336, 4096, 16,
                                               8192, 4096, 4096, 64]
    rows = []
    print(f"{torch.cuda.get_device_name()}: GPU us from CUDA-graph replays, median of {ROUNDS} interleaved rounds")
    for M, K, N, R in zip(*[iter(vals)] * 4):
        g = torch.Generator(device="cuda").manual_seed(M + K + N + R)
        rnd = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
        w = rnd(N, K) / K**0.5
        layouts = {  # name: (lhs (M, Kd), w_kn (Kd, Nd), lora lhs (M, R), lora rhs (R, Nd))
            "fwd": (rnd(M, K), w.T, rnd(M, R), rnd(R, N) / R**0.5),
            "dx": (rnd(M, N), w, rnd(M, R), rnd(R, K) / R**0.5),
        }
        for layout, (lhs, w_kn, h, u) in layouts.items():
            ref = (lhs.float() @ w_kn.float() + 0.5 * h.float() @ u.float())
            fns = {"cublas": lambda lhs=lhs, w_kn=w_kn: torch.mm(lhs, w_kn)}
            confs = variants(M, w_kn.shape[0], w_kn.shape[1], R, w_kn)
            fns.update(H.checked({name: (lambda lhs=lhs, w_kn=w_kn, h=h, u=u, conf=conf:
                                         ll.gemm(lhs, w_kn, h, u, None, 0.5, 0.0, None, torch.bfloat16, config=conf))
                                  for name, conf in confs.items()}, ref, layout))
            times = H.graph_rounds(fns, ROUNDS, rep=60)
            base = statistics.median(times["cublas"])
            print(f"M={M} K={w_kn.shape[0]} N={w_kn.shape[1]} r={R} {layout}: cuBLAS {base:.1f} us")
            for name, t in times.items():
                us = statistics.median(t)
                print(f"  {name:34s} {us:8.1f} us  {us / base:6.3f}x  (rounds {min(t):.1f}-{max(t):.1f})")
                rows.append({"bench": "diag_gemm", "M": M, "K": w_kn.shape[0], "N": w_kn.shape[1], "r": R,
                             "layout": layout, "variant": name, "us": us, "rounds_us": t, "ratio_cublas": us / base,
                             "config": confs.get(name)})
    print("wrote", H.write_results(os.environ.get("DIAG_NAME", "diag-gemm"), rows, {"rounds": ROUNDS}))


if __name__ == "__main__":
    main()
