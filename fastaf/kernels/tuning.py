"""Tuning of the kernel families for given layer shapes; ``fastaf-tune`` is its command line.

For each (M tokens, K in, N out, R rank) it times every pruned config of each kernel phase of
``lora_linear`` (gemm forward, gemm dx, fwd_h, bwd_dy, bwd_da) once with
``triton.testing.do_bench`` (median), re-times the three fastest in interleaved rounds and keeps
the best (``best_config``), then times the fused path against the cuBLAS+addmm path for the
forward and the backward, each on both sides: the GPU time of its launches alone (``_captured``)
and the host time of a call as the eager op makes it (``_host_ms``), which ``dispatch.decide``
weighs. Results go to the tuning cache (``cache``), keyed by GPU name and triton version.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch

from fastaf.kernels import cache, dispatch, launch_graphs
from fastaf.kernels import lora_linear as ll
from fastaf.kernels.hardware import _tma_ready, smem_limit
from fastaf.kernels.lora_linear_configs import bwd_da_configs, bwd_dy_configs, fwd_h_configs, gemm_configs, smem_bytes
from fastaf.kernels.lora_linear_plan import _key, clear_memos, gemm_key, padded_rank

# (K, N) of Llama-3-8B attention and MLP: fastaf-tune's default shapes.
BENCH_SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096)]
BENCH_TOKENS = [2048, 8192, 16384]
BENCH_RANKS = [16, 64]
KERNELS = ("gemm", "fwd_h", "bwd_dy", "bwd_da", "dispatch")


@dataclass(frozen=True)
class Shape:
    M: int
    K: int
    N: int
    R: int


def shapes_from_model_config(cfg: dict) -> list[tuple[str, int, int]]:
    """(name, K, N) of q/k/v/o/gate/up/down for an HF-style config dict, duplicates dropped."""
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    inter = int(cfg["intermediate_size"])
    layers = [("q_proj", hidden, heads * head_dim), ("k_proj", hidden, kv * head_dim),
              ("v_proj", hidden, kv * head_dim), ("o_proj", heads * head_dim, hidden),
              ("gate_proj", hidden, inter), ("up_proj", hidden, inter), ("down_proj", inter, hidden)]
    seen, out = set(), []
    for name, k, n in layers:
        if (k, n) not in seen:
            seen.add((k, n))
            out.append((name, k, n))
    return out


def median_ms(fn: Callable[[], object], rep_ms: int) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=max(2, rep_ms // 4), rep=rep_ms, return_mode="median")


def _bench_interleaved(fns: dict[str, Callable[[], object]], rep_ms: int, rounds: int = 3) -> dict[str, float]:
    """Median over ``rounds`` alternating timings of each function: the dispatch compares paths
    a few percent apart, and one block each would hand the GPU's clock drift to one of them."""
    import statistics

    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(median_ms(fn, rep_ms))
    return {name: statistics.median(t) for name, t in times.items()}


SLEEP_CYCLES = 200_000_000  # torch.cuda._sleep: ~0.1 s of GPU clock, longer than the calls queued behind it


def _captured(fn: Callable[[], object]) -> "torch.cuda.CUDAGraph":
    """``fn``'s launches captured into one CUDA graph (after a warm call on a side stream), so
    that timing its replays measures the GPU alone: a do_bench time of a call whose host side is
    slower than its kernels is the host's time."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compiles, plans, the allocator's blocks
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _host_ms(fn: Callable[[], object], calls: int = 20, rounds: int = 3) -> float:
    """Host time of one call of ``fn`` (ms): ``calls`` calls queued behind a GPU sleep, so none
    waits on the device; the least of ``rounds`` (the host's noise only adds)."""
    for _ in range(4):  # warm: a launch graph is captured at a call's third sighting (launch_graphs)
        fn()
    best = float("inf")
    for _ in range(rounds):
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) * 1e3 / calls)
        torch.cuda.synchronize()
    return best


def best_config(name: str, configs: list[dict], run: Callable[[dict], object], rep_ms: int,
          finalists: int = 3) -> tuple[dict, float]:
    """The fastest config: one quick timing each, then the ``finalists`` fastest re-timed in
    interleaved rounds (``_bench_interleaved``). One timing each is the screen only: on the H100
    a single timing picked a 128x128 5-stage dX gemm that re-measured 1.33x cuBLAS where a 128x256
    tile ran 1.04x, the GPU's clock drift between two configs' blocks being as large as their
    difference."""
    screened = []
    for i, conf in enumerate(configs):
        try:
            screened.append((median_ms(lambda: run(conf), rep_ms), i))
        except Exception as err:  # out of resources etc.: skip the config, never the shape
            print(f"    {name} {conf}: failed ({type(err).__name__})", flush=True)
    if not screened:
        raise RuntimeError(f"no config of {name} ran")
    top = [configs[i] for _, i in sorted(screened)[:finalists]]
    if len(top) == 1:
        return top[0], min(screened)[0]
    ms = _bench_interleaved({str(j): (lambda c=c: run(c)) for j, c in enumerate(top)}, rep_ms)
    j = min(ms, key=ms.get)
    return top[int(j)], ms[j]


def tune_shape(s: Shape, dtype: torch.dtype, kernels: Iterable[str], data: dict, rep_ms: int = 20,
               log: Callable[[str], None] = print) -> None:
    """Tune every requested phase at one shape and record the results in ``data`` (a cache dict)."""
    kernels = set(kernels)
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, device=dev, dtype=dtype, generator=g)  # noqa: E731
    x, w, a, b = rnd(s.M, s.K), rnd(s.N, s.K) / s.K**0.5, rnd(s.R, s.K) / s.K**0.5, rnd(s.N, s.R)
    dy = rnd(s.M, s.N)
    h = ll.fwd_h(x, a, 0.0, None)
    dh, _ = ll.bwd_dy(dy, b, h, 1.0)
    dt = _key(dtype=dtype)["dtype"]
    elt = x.element_size()

    limit = smem_limit(x.device)

    def fitting(phase: str, configs: list[dict]) -> list[dict]:
        """The configs whose tiles fit shared memory at this rank (a failed compile costs seconds)."""
        return [c for c in configs if smem_bytes(phase, c, padded_rank(s.R), elt) <= limit]

    def put(phase: str, key: dict, conf: dict, ms: float) -> None:
        cache.upsert(data["kernels"].setdefault(f"lora_linear.{phase}", []), {"key": key, "config": conf, "ms": ms})
        log(f"    {phase:7s} {ms * 1e3:8.1f} us  {conf}")

    if "gemm" in kernels:
        for wkn, lhs, low, up, label in ((w.T, x, h, b.T, "fwd"), (w, dy, dh, a, "dx")):
            M, K, N = lhs.shape[0], lhs.shape[1], wkn.shape[1]
            tma = _tma_ready((lhs, 1), (wkn, 0 if wkn.stride(0) == 1 else 1))
            phase = "gemm" if tma else "gemm_plain"
            key = gemm_key(M, N, K, s.R, dtype, wkn)
            conf, ms = best_config(phase, fitting(phase, gemm_configs(elt)),
                             lambda c: ll.gemm(lhs, wkn, low, up, None, 1.0, 0.0, None, dtype, config=c), rep_ms)
            put(phase, key, conf, ms)
    if "fwd_h" in kernels:
        conf, ms = best_config("fwd_h", fitting("fwd_h", fwd_h_configs()),
                         lambda c: ll.fwd_h(x, a, 0.0, None, config=c), rep_ms)
        put("fwd_h", _key(M=s.M, K=s.K, R=s.R, dtype=dt), conf, ms)
    if "bwd_dy" in kernels:
        conf, ms = best_config("bwd_dy", fitting("bwd_dy", bwd_dy_configs()),
                         lambda c: ll.bwd_dy(dy, b, h, 1.0, config=c), rep_ms)
        put("bwd_dy", _key(M=s.M, N=s.N, R=s.R, dtype=dt), conf, ms)
    if "bwd_da" in kernels:
        conf, ms = best_config("bwd_da", fitting("bwd_da", bwd_da_configs()),
                         lambda c: ll.bwd_da(dh, x, 0.0, None, config=c), rep_ms)
        put("bwd_da", _key(M=s.M, K=s.K, R=s.R, dtype=dt), conf, ms)
    if "dispatch" in kernels:
        cache.save(data)  # the fused path below reads the configs just tuned
        clear_memos()
        key = _key(M=s.M, K=s.K, N=s.N, R=s.R, dtype=dt)
        a32, b32 = a.float(), b.float()  # fp32 master factors, as a training step holds them

        def bwd(impl: str, graphed: bool) -> tuple:
            dx, da, db = ll.lora_linear_bwd_unchecked(dy, x, w, a32, b32, h, 2.0, 0.0, None, True, impl,
                                                      shared_grads=True, graphed=graphed)
            # the op hands the grads back in the factors' dtype: cuBLAS's bf16 dA, dB cost two casts
            return dx, da.to(a32.dtype), db.to(b32.dtype)

        for phase, fn in (
            ("fwd", lambda impl, graphed: ll.lora_linear_fwd_unchecked(x, w, None, a32, b32, 2.0, 0.0, None, impl,
                                                                       graphed=graphed)),
            ("bwd", bwd),
        ):
            captured = {impl: _captured(lambda impl=impl: fn(impl, False)) for impl in dispatch.IMPLS}
            ms = _bench_interleaved({impl: g.replay for impl, g in captured.items()}, rep_ms)
            del captured
            entry = {"key": key, "ms": ms}
            if hasattr(torch.cuda, "_sleep"):  # private: without it the single-time rule decides (ms alone)
                # the host side as the eager op path calls it: Triton's launches replay from a launch graph
                replays = launch_graphs.GRAPHS.replays
                entry["host_ms"] = {impl: _host_ms(lambda impl=impl: fn(impl, True)) for impl in dispatch.IMPLS}
                entry["graphed"] = launch_graphs.GRAPHS.replays > replays  # False: graphs off, host time ungraphed
            entry["winner"] = dispatch.decide(phase, ms, entry.get("host_ms"))
            cache.upsert(data["dispatch"].setdefault(f"lora_linear.{phase}", []), entry)
            host = {p: f"{t * 1e3:6.1f}" for p, t in entry.get("host_ms", {}).items()}
            log(f"    {phase:7s} triton {ms['triton'] * 1e3:8.1f} us (host {host.get('triton', '     -')})"
                f"  addmm {ms['addmm'] * 1e3:8.1f} us (host {host.get('addmm', '     -')})"
                f"  -> {entry['winner']}{'' if entry.get('graphed', True) else '  (launch graphs off)'}")
        clear_memos()  # the launch graphs and plans of the timed calls' tensors, freed now


def tune(shapes: list[tuple[int, int]], tokens: list[int], ranks: list[int], *, dtype: torch.dtype = torch.bfloat16,
         kernels: Iterable[str] = KERNELS, rep_ms: int = 20, log: Callable[[str], None] = print,
         budget_s: Optional[float] = None) -> dict:
    """Tune ``lora_linear`` for every (M, K, N, R) of ``tokens x shapes x ranks``; returns the saved cache."""
    gpu, triton_version = cache.device_name(), cache.triton_version()
    path = cache.cache_path(gpu, triton_version)
    data = cache.load(path) or cache.empty(gpu, triton_version)
    todo = [Shape(M, K, N, R) for M in tokens for K, N in shapes for R in ranks]
    t0 = time.time()
    for i, s in enumerate(todo):
        if budget_s is not None and time.time() - t0 > budget_s:
            log(f"time budget of {budget_s:.0f} s spent; {len(todo) - i} shapes left untuned")
            break
        log(f"[{i + 1}/{len(todo)}] M={s.M} K={s.K} N={s.N} r={s.R} {dtype}  ({time.time() - t0:.0f} s)")
        tune_shape(s, dtype, kernels, data, rep_ms=rep_ms, log=log)
        cache.save(data, path)
        torch.cuda.empty_cache()
    clear_memos()
    return data
