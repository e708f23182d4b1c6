"""The fused forward (FUSE_H: h made inside the gemm) against fwd_h + gemm, interleaved.

Per shape: the cuBLAS base, fwd_h + gemm with the cached (tuned) gemm config, and the fused
gemm with every gemm config that fits FUSE_H's shared memory, all timed in alternating rounds
(``_harness.time_interleaved``) after a check against an fp64 reference. Prints each as a ratio
to the base; writes ``$OUT/diag_fused.json`` when $OUT is set.

    python bench/diag_fused.py [M K N r ...]
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._harness import rel_err, time_interleaved  # noqa: E402
from fastaf.kernels import lora_linear as ll  # noqa: E402

SHAPES = [8192, 4096, 4096, 16, 8192, 4096, 4096, 64, 8192, 4096, 14336, 16, 8192, 14336, 4096, 64,
          2048, 4096, 4096, 16]


def main() -> None:
    vals = [int(v) for v in sys.argv[1:]] or SHAPES
    rows = []
    for M, K, N, R in zip(*[iter(vals)] * 4):
        g = torch.Generator(device="cuda").manual_seed(0)
        rnd = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
        x, w, a, b = rnd(M, K), rnd(N, K) / K**0.5, rnd(R, K) / K**0.5, rnd(N, R)
        want = x.double() @ w.double().T + 2.0 * (x.double() @ a.double().T) @ b.double().T
        limit = ll._smem_limit(x.device)
        fns = {"base": lambda: torch.nn.functional.linear(x, w),
               "fwd_h+gemm": lambda: ll.gemm(x, w.T, ll.fwd_h(x, a, 0.0, None), b.T, None, 2.0, 0.0, None,
                                             torch.bfloat16)}
        for conf in ll.gemm_configs():
            conf = ll.fit("gemm", {**conf, "FUSE_H": 1}, ll._r_pad(R), 2, limit)
            if conf is None:
                continue
            name = "fused {BLOCK_M}x{BLOCK_N}x{BLOCK_K} s{num_stages} w{num_warps}".format(**conf)
            fns[name] = lambda conf=conf: ll.fwd_fused(x, w, None, a, b, 2.0, config=conf)[0]
        for name, fn in fns.items():
            if name != "base":
                err = rel_err(fn(), want)
                assert err < 2e-2, f"{name}: rel err {err:.3g} at M={M} K={K} N={N} r={R}"
        times = time_interleaved(fns, rounds=5, rep=500)
        base = times["base"]["ms"]
        print(f"M={M} K={K} N={N} r={R}  base {base * 1e3:.1f} us", flush=True)
        for name, t in times.items():
            print(f"  {name:28s} {t['ms'] * 1e3:8.1f} us  {t['ms'] / base:6.3f}  rounds {t['rounds']}", flush=True)
            rows.append(dict(M=M, K=K, N=N, r=R, provider=name, ms=t["ms"], ratio=t["ms"] / base, rounds=t["rounds"]))
        torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "diag_fused.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
