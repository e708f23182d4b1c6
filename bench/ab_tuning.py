"""Two tuning caches against each other: the fused forward and backward, each phase with the
configs either cache holds for the shape, timed in interleaved rounds (diagnostic).

    python bench/ab_tuning.py OLD.json [NEW.json] [M K N r ...]

NEW defaults to the tuning cache fastaf would use on this GPU. Prints, per shape, the fused
forward (fwd_h + gemm) over cuBLAS ``F.linear`` and the fused backward (bwd_dy + bwd_da + dX gemm)
over cuBLAS ``dy @ W``, for OLD and NEW, and which phases' configs differ. When no config
differs the two columns measure the noise of the comparison itself.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import _harness as H  # noqa: E402
from fastaf.kernels import _cache  # noqa: E402
from fastaf.kernels import lora_linear as ll  # noqa: E402

SHAPES = [8192, 4096, 4096, 16, 8192, 4096, 4096, 64, 8192, 4096, 14336, 16, 8192, 14336, 4096, 16,
          16384, 4096, 4096, 16, 16384, 4096, 14336, 16]
ROUNDS = 6


def phase_configs(kernels: dict, M: int, K: int, N: int, R: int) -> dict[str, dict]:
    """The configs a cache's ``kernels`` section holds for this shape (exact keys)."""
    dt = "bfloat16"

    def find(phase: str, key: dict) -> dict:
        for entry in kernels.get(f"lora_linear.{phase}", []):
            if entry["key"] == key:
                return entry["config"]
        raise KeyError(f"no {phase} entry for {key}")

    return {"fwd_h": find("fwd_h", dict(M=M, K=K, R=R, dtype=dt)),
            "gemm fwd": find("gemm", dict(M=M, K=K, N=N, R=R, dtype=dt, layout="nk")),
            "gemm dx": find("gemm", dict(M=M, K=N, N=K, R=R, dtype=dt, layout="kn")),
            "bwd_dy": find("bwd_dy", dict(M=M, N=N, R=R, dtype=dt)),
            "bwd_da": find("bwd_da", dict(M=M, K=K, R=R, dtype=dt))}


def main() -> None:
    args = sys.argv[1:]
    old_path = args.pop(0)
    new_path = args.pop(0) if args and not args[0].isdigit() else str(
        _cache.cache_path(_cache.device_name(), _cache.triton_version()))
    caches = {name: json.loads(Path(p).read_text())["kernels"] for name, p in (("old", old_path), ("new", new_path))}
    vals = [int(v) for v in args] or SHAPES
    print(f"{torch.cuda.get_device_name()}: old={old_path} new={new_path}; {ROUNDS} interleaved rounds")
    for M, K, N, R in zip(*[iter(vals)] * 4):
        g = torch.Generator(device="cuda").manual_seed(0)
        rnd = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
        x, w, a, b, dy = rnd(M, K), rnd(N, K) / K**0.5, rnd(R, K) / K**0.5, rnd(N, R) / R**0.5, rnd(M, N)
        h = ll.fwd_h(x, a, 0.0, None)
        confs = {name: phase_configs(k, M, K, N, R) for name, k in caches.items()}
        fns = {"cublas fwd": lambda: torch.nn.functional.linear(x, w), "cublas dx": lambda: torch.mm(dy, w)}
        for name, c in confs.items():
            fns[f"fwd {name}"] = lambda c=c: ll.gemm(x, w.T, ll.fwd_h(x, a, 0.0, None, config=c["fwd_h"]), b.T,
                                                     None, 2.0, 0.0, None, x.dtype, config=c["gemm fwd"])

            def bwd(c=c):
                dh, db = ll.bwd_dy(dy, b, h, 2.0, config=c["bwd_dy"])
                da = ll.bwd_da(dh, x, 0.0, None, config=c["bwd_da"])
                return ll.gemm(dy, w, dh, a, None, 1.0, 0.0, None, x.dtype, config=c["gemm dx"]), da, db

            fns[f"bwd {name}"] = bwd
        timed = H.time_interleaved(fns, rounds=ROUNDS, warmup=10, rep=40 * ROUNDS)
        ms = {k: v["ms"] for k, v in timed.items()}
        differ = [p for p in confs["old"] if confs["old"][p] != confs["new"][p]]
        print(f"M={M} K={K} N={N} r={R}: fwd old {ms['fwd old'] / ms['cublas fwd']:.3f} new "
              f"{ms['fwd new'] / ms['cublas fwd']:.3f} | bwd old {ms['bwd old'] / ms['cublas dx']:.3f} new "
              f"{ms['bwd new'] / ms['cublas dx']:.3f}  (x cuBLAS; configs differ in {differ or 'none'})", flush=True)


if __name__ == "__main__":
    main()
