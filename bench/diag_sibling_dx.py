"""Siblings' dX (q/k/v, gate/up) as one GEMM launch against one launch per sibling (diagnostic).

    python bench/diag_sibling_dx.py            (DIAG_NAME=...: the result file's name)

Siblings over one x sum their input gradients: dX = sum_i (dy_i @ W_i + dh_i @ A_i). At the
Llama-3.2-1B shapes (M = 8192 tokens, K = 2048; q/k/v N = 2048, 512, 512; gate/up N = 8192 twice;
r = 16 each) it times, from CUDA-graph replays in interleaved rounds:

    cublas         torch.mm per sibling (the frozen base's GEMMs; its sum is a later pass)
    per-sibling    the fused LoRA gemm per sibling (today's compiled path; summed later)
    gemm+addmm     the fused gemm for the first, cuBLAS addmm_ into it for the rest (the eager group)
    one launch     ``gemm(..., extra=...)``: every sibling's K loop into one tile, dX written once

and one pass over an (M, K) bf16 tensor (a third of an out-of-place add), the price of each
dX beyond the first that a later kernel must read. Each variant is checked against fp32 first.
"""
from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import _harness as H  # noqa: E402
from fastaf.kernels import lora_linear as ll  # noqa: E402

ROUNDS = 5
SHAPES = {"qkv": (8192, 2048, [2048, 512, 512], 16), "gate_up": (8192, 2048, [8192, 8192], 16)}
CONFIGS = {  # the tuned cache's pick for the summed K, and two fixed tiles
    "tuned": None,
    "128x256x64 w8": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    "128x128x64 w4": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
}


def variants(dys, ws, dhs, a_s, dh, a_all):
    first = (dys[0], ws[0])
    rest = list(zip(dys[1:], ws[1:]))

    def per_sibling():
        return [ll.gemm(d, w, h, a, None, 1.0, 0.0, None, torch.bfloat16) for d, w, h, a in zip(dys, ws, dhs, a_s)]

    def gemm_addmm():
        dx = ll.gemm(*first, dh, a_all, None, 1.0, 0.0, None, torch.bfloat16)
        for d, w in rest:
            dx.addmm_(d, w)
        return dx

    fns = {"cublas": lambda: [torch.mm(d, w) for d, w in zip(dys, ws)],
           "per-sibling": per_sibling, "gemm+addmm": gemm_addmm}
    for name, conf in CONFIGS.items():
        fns[f"one launch {name}"] = (lambda conf=conf: ll.gemm(*first, dh, a_all, None, 1.0, 0.0, None,
                                                              torch.bfloat16, config=conf, extra=rest))
    return fns


def main() -> None:
    rows = []
    print(f"{torch.cuda.get_device_name()}: GPU us from CUDA-graph replays, median of {ROUNDS} interleaved rounds")
    for label, (M, K, Ns, r) in SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(M + K + sum(Ns))
        rnd = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
        dys = [rnd(M, n) for n in Ns]
        ws = [rnd(n, K) / n**0.5 for n in Ns]
        dhs = [rnd(M, r).float() for _ in Ns]
        a_s = [rnd(r, K) / r**0.5 for _ in Ns]
        dh, a_all = torch.cat(dhs, 1), torch.cat(a_s)
        ref = sum(d.float() @ w.float() for d, w in zip(dys, ws)) + dh @ a_all.float()
        fns = variants(dys, ws, dhs, a_s, dh, a_all)
        for name in list(fns):
            out = fns[name]()
            got = sum(o.float() for o in out) if isinstance(out, list) else out.float()
            if name == "cublas":
                got = got + dh @ a_all.float()
            err = H.rel_err(got, ref)
            if not err < 1e-2:
                print(f"  !! {label} {name}: rel err {err:.3g}: dropped")
                del fns[name]
        o, p, q = rnd(M, K), rnd(M, K), torch.empty(M, K, device="cuda", dtype=torch.bfloat16)
        fns["add (M,K): 3 passes"] = lambda: torch.add(o, p, out=q)
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(ROUNDS):
            for name, fn in fns.items():
                times[name].append(triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median") * 1e3)
        base = statistics.median(times["cublas"])
        one_pass = statistics.median(times["add (M,K): 3 passes"]) / 3
        extra_reads = (len(Ns) - 1) * one_pass
        print(f"{label}: M={M} K={K} N={Ns} r={r}; one (M, K) pass {one_pass:.1f} us; cuBLAS {base:.1f} us "
              f"(+ {extra_reads:.1f} us of later reads: {base + extra_reads:.1f})")
        for name, t in times.items():
            us = statistics.median(t)
            later = extra_reads if name in ("cublas", "per-sibling") else 0.0
            print(f"  {name:28s} {us:8.1f} us  with later reads {us + later:8.1f}  ÷ cuBLAS's {(us + later) / (base + extra_reads):6.3f}"
                  f"  (rounds {min(t):.1f}-{max(t):.1f})")
            rows.append({"bench": "diag_sibling_dx", "siblings": label, "M": M, "K": K, "N": Ns, "r": r,
                         "variant": name, "us": us, "rounds_us": t, "later_reads_us": later,
                         "ratio_cublas_with_reads": (us + later) / (base + extra_reads),
                         "config": CONFIGS.get(name.removeprefix("one launch "))})
    print("wrote", H.write_results(os.environ.get("DIAG_NAME", "diag-sibling-dx"), rows, {"rounds": ROUNDS}))


if __name__ == "__main__":
    main()
