"""Blocks compiled inside an eager call, as FSDP2 recipes train: each decoder layer of the
Llama-3.2-1B-shaped model compiled (``layer.compile()``, Inductor), the model called eagerly.

    python bench/diag_compiled_blocks.py [--name diag-compiled-blocks] [--batch 8]

Providers: ``base-blocks`` (the frozen model, backward to its input embeddings) and
``fastaf-autograd-blocks`` (``fa.functional_call`` + autograd + AdamW, as bench_e2e's
``fastaf-autograd``). Each row records the graph breaks dynamo counted while its blocks compiled
and its first step's seconds (compile time), then its step time (bench/_harness's ``time_fn``).
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--name", default="diag-compiled-blocks")
    ap.add_argument("--batch", type=int, default=8, help="sequences of 1024 tokens per step")
    args = ap.parse_args()
    model = make_model(False, "cuda")
    for layer in model.model.layers:
        layer.compile()
    ids = torch.randint(0, model.config.vocab_size, (args.batch, 1024), device="cuda")
    rows = []
    for name, make in (("base-blocks", base_step), ("fastaf-autograd-blocks", fastaf_autograd_step)):
        torch._dynamo.utils.counters.clear()
        step = make(model, ids)
        t0 = time.perf_counter()
        loss = step().item()
        first_s = time.perf_counter() - t0
        breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
        t = H.time_fn(step, warmup=200, rep=1500)
        rows.append({"bench": "diag_compiled_blocks", "provider": name, "tokens": args.batch * 1024, **t,
                     "loss0": loss, "loss_last": step().item(), "graph_breaks": breaks, "first_step_s": first_s})
        print(f"{name:24s} {t['ms']:8.2f} ms  graph breaks {breaks}  first step {first_s:.1f} s", flush=True)
    base = rows[0]["ms"]
    for r in rows:
        r["ratio_to_base"] = r["ms"] / base
    print(f"wrote {H.write_results(args.name, rows)}")


if __name__ == "__main__":
    main()
