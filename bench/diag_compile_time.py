"""How long ``torch.compile`` takes to trace a training step, with and without fastaf.

    python bench/diag_compile_time.py [--tiny] [--backends eager,aot_eager] [--steps base,fastaf-autograd]
                                      [--name diag-compile-time]

With ``--backends inductor`` run twice over one ``TORCHINDUCTOR_CACHE_DIR``, the second run times
a warm start (a new process finding Inductor's and AOTAutograd's caches on disk).

Dynamo traces a TorchFunctionMode's Python for every op of the model (and, before each adapted
layer's autograd.Function became one opaque call to it, the Function's forward and backward), so
fastaf's compile costs more than the frozen model's. This times the first call of each step under
``backend="eager"`` (dynamo alone: since the Functions are opaque to dynamo, their tracing moved
to AOTAutograd, so compare builds across that change with ``aot_eager``) and ``"aot_eager"``
(dynamo and AOTAutograd; Inductor's codegen and its caches stay out of it) on
BENCH.md's Llama-3.2-1B shape, 16 layers, r=16 on all seven projections, one step of 2 x 1024:
- base: the frozen model's forward + backward (``torch.compile(model)``'s step);
- fastaf-func: ``torch.compile(torch.func.grad_and_value(loss), fullgraph=True)``;
- fastaf-autograd: ``torch.compile(loss, fullgraph=True)`` then autograd on the adapter's leaves.
Dynamo's own phase times (``torch._dynamo.utils.compile_times``) are recorded per run.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.utils._pytree as pytree

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import _harness as H  # noqa: E402
from bench.bench_e2e import TARGETS, make_model  # noqa: E402

import fastaf as fa  # noqa: E402


def steps(model, ids) -> dict:
    """name -> (function to compile, its arguments, what to differentiate after the call)."""
    emb = model.get_input_embeddings()(ids).detach().requires_grad_()
    adapter = fa.init_adapter(model, fa.LoRAConfig(r=16, alpha=32, targets=TARGETS), seed=0)
    batch = {"input_ids": ids, "labels": ids}
    loss = lambda ad: fa.functional_call(model, ad, (), batch).loss  # noqa: E731
    return {
        "base": (lambda e: model(inputs_embeds=e, labels=ids).loss, (emb,), True),
        "fastaf-func": (torch.func.grad_and_value(loss), (adapter,), False),
        "fastaf-autograd": (loss, (adapter,), True),
    }


def first_call_s(fn, args, backward: bool, backend: str) -> tuple[float, dict]:
    """Seconds of the first call of ``torch.compile(fn)`` (and its backward), dynamo's phases."""
    torch._dynamo.reset()
    torch._dynamo.utils.compilation_time_metrics.clear()
    if isinstance(args[0], fa.Adapter):  # fresh leaves: autograd's backward reaches them
        args = (pytree.tree_map(lambda t: t.detach().requires_grad_(), args[0]),)
    t0 = time.perf_counter()
    out = torch.compile(fn, fullgraph=True, backend=backend)(*args)
    if backward:
        out.backward()
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    seconds = time.perf_counter() - t0
    phases = {k: round(sum(v), 2) for k, v in torch._dynamo.utils.compilation_time_metrics.items()
              if k in ("bytecode_tracing", "OutputGraph.call_user_compiler", "create_aot_dispatcher_function")}
    return seconds, phases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a 2-layer toy model (CPU smoke run)")
    ap.add_argument("--name", default="diag-compile-time")
    ap.add_argument("--backends", default="eager,aot_eager", help="comma-separated torch.compile backends")
    ap.add_argument("--steps", default="base,fastaf-func,fastaf-autograd", help="comma-separated steps to time")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = make_model(args.tiny, device)
    ids = torch.randint(0, model.config.vocab_size, (2, 64 if args.tiny else 1024),
                        generator=torch.Generator().manual_seed(0)).to(device)
    rows = []
    for backend in args.backends.split(","):
        for name, (fn, fargs, backward) in steps(model, ids).items():
            if name not in args.steps.split(","):
                continue
            seconds, phases = first_call_s(fn, fargs, backward, backend)
            rows.append({"bench": "compile_time", "provider": name, "backend": backend,
                         "first_call_s": round(seconds, 2), **phases})
            print(f"{name:16s} {backend:9s} {seconds:7.1f} s  {phases}", flush=True)
    path = H.write_results(args.name, rows, {"layers": model.config.num_hidden_layers})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
