"""Blocks compiled inside an eager call, as FSDP2 recipes train: each decoder layer of the
Llama-3.2-1B-shaped model compiled (``layer.compile()``, Inductor), the model called eagerly.

    python bench/diag_compiled_blocks.py [--name diag-compiled-blocks] [--batch 8]

Providers: ``base-blocks`` (the frozen model, backward to its input embeddings) and
``fastaf-autograd-blocks`` (``fa.functional_call`` + autograd + AdamW, as bench_e2e's
``fastaf-autograd``); ``-limit``: dynamo's ``recompile_limit`` raised to the layer count (each
block compiles its own graph under ``functional_call``); ``-eager``: under
``torch.compiler.set_stance("force_eager")``, the same blocks run eagerly (the mode's eager path). Each row records dynamo's counters
while its blocks compiled (graph breaks, frames traced and their outcome), its first step's seconds
(compile time), one profiled step (``_profile_step``) and its step time (bench/_harness's ``time_fn``).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import _harness as H  # noqa: E402
from bench.bench_e2e import base_step, fastaf_autograd_step, make_model  # noqa: E402


def _profile_step(step) -> dict:
    """One ``step()`` under the profiler: the Inductor kernels it launches (named ``triton_``),
    device busy milliseconds (every kernel's time summed), and the ten CPU ops of most self time
    (where a host-bound step's milliseconds go: guards, the mode's Python, launches)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    top = sorted(prof.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)[:10]
    return {"inductor_kernels": sum(1 for e in kernels if e.name.startswith("triton_")),
            "device_busy_ms": sum(e.device_time for e in kernels) / 1e3,
            "top_cpu_ms": {a.key[:80]: round(a.self_cpu_time_total / 1e3, 2) for a in top}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--name", default="diag-compiled-blocks")
    ap.add_argument("--batch", type=int, default=8, help="sequences of 1024 tokens per step")
    args = ap.parse_args()
    model = make_model(False, "cuda")
    # No KV cache in a training step: with one, each layer's forward guards on its own cache
    # layer's state, and 16 layers of one code object exceed dynamo's recompile limit (8): the
    # rest then run eagerly, and every later provider too (the first s32 run measured that).
    model.config.use_cache = False
    for layer in model.model.layers:
        layer.compile()
    ids = torch.randint(0, model.config.vocab_size, (args.batch, 1024), device="cuda")
    rows = []
    layers = len(model.model.layers)
    # (provider, step, stance, dynamo's recompile_limit): under functional_call each block's
    # graph reads its own layer's factors, so the blocks compile one graph each, which the
    # default limit (8) cuts short at the 9th layer; "-limit" raises it to the layer count
    runs = [("base-blocks", base_step, "default", None), ("base-blocks-eager", base_step, "force_eager", None),
            ("fastaf-autograd-blocks", fastaf_autograd_step, "default", None),
            ("fastaf-autograd-blocks-limit", fastaf_autograd_step, "default", layers),
            ("fastaf-autograd-blocks-eager", fastaf_autograd_step, "force_eager", None)]
    for provider, make, stance, limit in runs:
        torch._dynamo.reset()  # each provider compiles its blocks afresh, as its own process would
        torch._dynamo.utils.counters.clear()
        patch = {} if limit is None else {"recompile_limit": limit}
        with torch.compiler.set_stance(stance), torch._dynamo.config.patch(**patch):
            step = make(model, ids)
            t0 = time.perf_counter()
            loss = step().item()
            first_s = time.perf_counter() - t0
            step()  # a second step: a graph made per call would show as more frames
            counters = {k: dict(v) for k, v in torch._dynamo.utils.counters.items() if v}
            breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
            prof = _profile_step(step)
            t = H.time_fn(step, warmup=200, rep=1500)
            last = step().item()
        rows.append({"bench": "diag_compiled_blocks", "provider": provider, "tokens": args.batch * 1024, **t,
                     "loss0": loss, "loss_last": last, "graph_breaks": breaks, "first_step_s": first_s,
                     "recompile_limit": limit, **prof, "dynamo_counters": counters})
        print(f"{provider:30s} {t['ms']:8.2f} ms  device busy {prof['device_busy_ms']:.1f} ms  graph breaks {breaks}  "
              f"first step {first_s:.1f} s  inductor kernels/step {prof['inductor_kernels']}  "
              f"frames {counters.get('frames')}\n    top CPU self ms {prof['top_cpu_ms']}", flush=True)
    base = rows[0]["ms"]
    for r in rows:
        r["ratio_to_base"] = r["ms"] / base
    print(f"wrote {H.write_results(args.name, rows)}")


if __name__ == "__main__":
    main()
