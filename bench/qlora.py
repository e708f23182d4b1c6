"""QLoRA: what a LoRA training step costs over a 4-bit base, against the same step over bf16.

    python bench/qlora.py [--providers peft-bf16,peft-qlora,...] [--tiny]

Model: the Llama-3-8B shape (``bench/configs/llama-3-8b-shape.json``: hidden 4096, 32 layers, 32
heads, 8 kv heads, MLP 14336, vocab 128256) with random bf16 weights; 4 x 1024 tokens; LoRA r=16,
alpha=32 on q,k,v,o,gate,up,down; AdamW on the adapter. A ``-qlora`` provider's base has every
targeted linear replaced by bitsandbytes' ``Linear4bit`` (NF4 with double quantization, bf16
compute: what QLoRA recipes load through ``BitsAndBytesConfig``), quantized from the same weights.
Providers, each a full step (forward, loss, backward, optimizer step):
- peft-bf16 / peft-qlora: PEFT with bf16 adapters over the bf16 / the 4-bit base;
- fastaf-bf16 / fastaf-qlora: ``fa.functional_call`` with the adapter's leaves requiring grad,
  ``loss.backward()`` and AdamW;
- fastaf-bf16-compiled / fastaf-qlora-compiled: the loss over ``fa.functional_call`` under
  ``torch.compile(fullgraph=True)`` (``bench/e2e.py``'s ``fastaf-autograd-compiled``),
  ``loss.backward()`` and AdamW (before torch 2.13, a 4-bit base: the stateful layer under
  ``torch.compile(model)``);
- fastaf-qlora-branch / fastaf-qlora-compiled-branch (extra, for the A/B): as their names without
  ``-branch`` with ``FASTAF_DEQUANT=0``: each 4-bit layer runs bitsandbytes' forward and the LoRA
  is added as a branch, instead of the dequantization inside fastaf's op;
- ``-bf16adapter`` / ``-fp32adapter`` after ``{fastaf,peft}-{bf16,qlora}`` (extra, like for like):
  the adapter in that dtype for both libraries, where the providers above keep each one's own as
  measured (fastaf's fp32 masters, PEFT's bf16 adapters).
Each provider builds its own model and frees it after (``--one-model``: one model per base, shared),
so ``max_mem_gib`` is its own peak (CUDA memory allocated, model included); ``ms`` is
``do_bench``'s median over its steps. The first
step's loss is checked against the bf16 base's (every adapter starts with B = 0; a 4-bit base
differs by its quantization: 2% allowed). Rows go to bench/results/qlora.csv (bench/README.md).
"""
from __future__ import annotations

import argparse
import copy
import functools
import gc
import json
import sys
import time
from pathlib import Path

import torch
import torch.utils._pytree as pytree

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import _harness as H  # noqa: E402
from bench.e2e import _autograd_step, _wall_ms, fastaf_autograd_step  # noqa: E402

import fastaf as fa  # noqa: E402
from fastaf import _config  # noqa: E402

CONFIG = Path(__file__).resolve().parent / "configs" / "llama-3-8b-shape.json"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA = 16, 32
PROVIDERS = ["peft-bf16", "peft-qlora", "fastaf-bf16", "fastaf-qlora", "fastaf-bf16-compiled", "fastaf-qlora-compiled"]
# the 4-bit layers as their own forward plus the LoRA as a branch (FASTAF_DEQUANT=0): the path
# before fastaf dequantized inside its op, for the A/B
EXTRA = ["fastaf-qlora-branch", "fastaf-qlora-compiled-branch"]
# the adapter's own dtype, like for like (the providers above keep each library's as measured:
# fastaf's fp32 masters, PEFT's bf16 adapters): peak memory counts the factors, their grads and
# AdamW's two states, ~0.3 GiB apart at this shape
ADAPTER_DTYPES = {"-bf16adapter": torch.bfloat16, "-fp32adapter": torch.float32}
EXTRA += [f"{lib}-{base}{suffix}" for suffix in ADAPTER_DTYPES for lib in ("fastaf", "peft") for base in ("bf16", "qlora")]
CASE = ("model", "batch", "seq", "r", "quant")
FIGURES = ("ms", "p20", "p80", "max_mem_gib", "first_step_s", "loss0")


def make_model(tiny: bool, device: str, qlora: bool):
    """The bf16 model, or (``qlora``) the same weights with each targeted linear as an NF4
    double-quantized ``Linear4bit``, built one layer at a time so the bf16 copy never sits whole
    beside the 4-bit one."""
    model = H.random_llama(None if tiny else CONFIG, device)
    if qlora:
        for layer in model.model.layers:
            for parent in (layer.self_attn, layer.mlp):
                for name, child in list(parent.named_children()):
                    if name in TARGETS:
                        setattr(parent, name, _nf4(child, device))
    return model.train().requires_grad_(False)


def _nf4(linear: torch.nn.Linear, device: str) -> torch.nn.Module:
    import bitsandbytes as bnb

    q = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                          compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4", device="cpu")
    q.weight = bnb.nn.Params4bit(linear.weight.data.cpu(), requires_grad=False, compress_statistics=True,
                                 quant_type="nf4")
    return q.to(device)  # quantizes on the move (on the CPU for --tiny, bitsandbytes >= 0.49)


def peft_step(model, ids, adapter_dtype=None):
    """PEFT's step; its adapters in the base's bf16 (``autocast_adapter_dtype=False``), or with
    ``adapter_dtype`` fp32 PEFT's default (fp32 adapters, cast at each use)."""
    import peft

    cfg = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0)
    pm = peft.get_peft_model(model, cfg, autocast_adapter_dtype=adapter_dtype == torch.float32)
    trainable = [p for p in pm.parameters() if p.requires_grad]
    return _autograd_step(lambda: pm(input_ids=ids, labels=ids).loss, trainable, ids.is_cuda)


def fastaf_step(model, ids, adapter_dtype=None):
    """fastaf's step; its factors fp32 masters, or in ``adapter_dtype``."""
    config = fa.LoRAConfig(r=RANK, alpha=ALPHA, targets=TARGETS)
    leaves, spec = pytree.tree_flatten(fa.init_adapter(model, config, seed=0, dtype=adapter_dtype))
    leaves = [t.requires_grad_() for t in leaves]
    batch = {"input_ids": ids, "labels": ids}
    return _autograd_step(lambda: fa.functional_call(model, pytree.tree_unflatten(leaves, spec), (), batch).loss,
                          leaves, ids.is_cuda)


def fastaf_compiled_step(model, ids):
    """``bench/e2e.py``'s ``fastaf-autograd-compiled``: the loss over ``functional_call`` under
    ``torch.compile(fullgraph=True)``, its backward AOTAutograd's graph, then AdamW. Where torch
    refuses quantized layers there (before 2.13), the stateful layer under ``torch.compile(model)``."""
    from fastaf.intercept.scope import TRACED_FORWARDS

    if TRACED_FORWARDS or not any(type(m).__name__ == "Linear4bit" for m in model.modules()):
        return fastaf_autograd_step(model, ids, compiled=True)
    print(f"  torch {torch.__version__}: compiled over the stateful layer (fa.init), not functional_call", flush=True)
    fa.init(model)
    model.add_new_adapter("a", fa.LoRAConfig(r=RANK, alpha=ALPHA, targets=TARGETS), seed=0)
    model.set_active_adapter("a")
    trainable = [p for p in model.parameters() if p.requires_grad]
    run = torch.compile(model)
    return _autograd_step(lambda: run(input_ids=ids, labels=ids).loss, trainable, ids.is_cuda)


MAKERS = {"peft": peft_step, "fastaf": fastaf_step, "fastaf-compiled": fastaf_compiled_step}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--providers", default=",".join(PROVIDERS), help="comma-separated")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model on any device (a smoke test)")
    ap.add_argument("--name", default=None, help="results file bench/results/<name>.csv (default qlora)")
    ap.add_argument("--batch", type=int, default=4, help="sequences of 1024 tokens per step (default 4)")
    ap.add_argument("--one-model", action="store_true",
                    help="build each base (bf16, 4-bit) once and share it, PEFT's providers last (it wraps the model "
                         "in place): a 8B base takes about a minute to build and quantize")
    args = ap.parse_args()
    names = [n for n in args.providers.split(",") if n]
    if args.one_model:
        names.sort(key=lambda n: n.startswith("peft-"))
    unknown = sorted(set(names) - set(PROVIDERS + EXTRA))
    if unknown:
        raise SystemExit(f"unknown providers {unknown}; known: {PROVIDERS + EXTRA}")
    results = H.Results(args.name or ("qlora-tiny" if args.tiny else "qlora"), CASE, FIGURES)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batch, seq = (2, 64) if args.tiny else (args.batch, 1024)
    vocab = (H.TINY_LLAMA if args.tiny else json.loads(CONFIG.read_text()))["vocab_size"]
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0)).to(device)
    case = {"model": "tiny" if args.tiny else "llama-3-8b-shape", "batch": batch, "seq": seq, "r": RANK}
    rows, base_loss, models = [], None, {}
    for name in names:
        qlora = "-qlora" in name
        suffix = next((sfx for sfx in ADAPTER_DTYPES if name.endswith(sfx)), "")
        maker = MAKERS[name[:len(name) - len(suffix)].replace("-qlora", "").replace("-bf16", "").replace("-branch", "")]
        if suffix:
            maker = functools.partial(maker, adapter_dtype=ADAPTER_DTYPES[suffix])
        flags = _config.override(dequant=not name.endswith("-branch"))
        flags.__enter__()
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        model = models.get(qlora) or make_model(args.tiny, device, qlora)
        if args.one_model:
            models[qlora] = model
        step = maker(model, ids)
        if args.one_model and isinstance(getattr(model, "fastaf", None), torch.nn.Module):
            # the stateful fallback inited it (hooks, an active adapter): later providers build their own
            models.pop(qlora, None)
        t0 = time.perf_counter()
        first = step().item()
        first_s = round(time.perf_counter() - t0, 2)
        base_loss = first if base_loss is None else base_loss
        if abs(first - base_loss) > 2e-2 * abs(base_loss):
            raise SystemExit(f"{name}: first-step loss {first:.4f} is not the base's {base_loss:.4f}")
        t = H.time_fn(step, warmup=1000, rep=3000) if device == "cuda" else _wall_ms(step, n=2)  # ~10 steps of ~0.3 s
        mem = round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None
        rows.append({"provider": name, **case, "quant": "nf4-double" if qlora else "bf16", **t, "max_mem_gib": mem,
                     "first_step_s": first_s, "loss0": round(first, 4)})
        print(f"{name:28s} {t['ms']:9.2f} ms  peak {mem} GiB  loss0 {first:.4f}  first step {first_s:.1f} s", flush=True)
        path = results.append(rows[-1:])  # row by row: a run cut short keeps what it measured
        del step, model
        flags.__exit__(None, None, None)
    print(f"appended {len(rows)} rows to {path} (run {results.meta['run']})")
    by = {r["provider"]: r["ms"] for r in rows}
    for a, b in (("fastaf-qlora", "fastaf-bf16"), ("fastaf-qlora-compiled", "fastaf-bf16-compiled"),
                 ("fastaf-qlora", "peft-qlora"), ("peft-qlora", "peft-bf16"), ("fastaf-qlora", "fastaf-qlora-branch"),
                 ("fastaf-qlora-compiled", "fastaf-qlora-compiled-branch")):
        if a in by and b in by:
            print(f"  {a} / {b}: {by[a] / by[b]:.3f}")


if __name__ == "__main__":
    main()
