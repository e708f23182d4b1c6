"""``fastaf-tune``: tune fastaf's Triton kernels for a model's layer shapes on this GPU.

    fastaf-tune                                   # Llama-3-8B shapes, tokens 2048/8192/16384, r 16/64
    fastaf-tune --model-config config.json --tokens 8192 --ranks 16   # every adapted linear
    fastaf-tune --model-config config.json --targets q_proj,v_proj --print-shapes
    fastaf-tune --shapes 4096x4096,4096x14336 --kernels gemm,dispatch
    fastaf-tune --list | --clear

Results go to $FASTAF_CACHE_DIR (default ~/.cache/fastaf)/tune-<gpu>-triton<version>.json;
kernels read them at launch (nearest tuned shape, else a default), and impl="auto" reads the
recorded fused-vs-addmm winners.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Optional

from fastaf.kernels import cache, dispatch


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def parse_shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        k, n = item.lower().split("x")
        out.append((int(k), int(n)))
    return out


def model_shapes(path_or_json: str, targets: str | list[str] = "all-linear") -> list[tuple[int, int]]:
    """(K, N) of every linear layer ``targets`` adapts in the model a config describes.

    With a ``model_type`` (any HF config.json) the model is built on the meta device (no memory,
    no weights) and the targets are resolved as ``fastaf.init_adapter`` resolves them, so Falcon's
    fused query_key_value, GPT-2's Conv1D and a VLM's vision tower count. Fused 3-D MoE expert
    parameters take the materialised path, not these kernels, and are left out. A config without
    a model_type falls back to the Llama layout (q/k/v/o/gate/up/down from its sizes).
    """
    text = path_or_json if path_or_json.lstrip().startswith("{") else Path(path_or_json).read_text()
    cfg = json.loads(text)
    if "model_type" not in cfg:
        from fastaf.kernels.tuning import shapes_from_model_config

        cfg = cfg.get("text_config", cfg)  # multimodal HF configs nest the language model's
        return [(k, n) for _, k, n in shapes_from_model_config(cfg)]
    return [(k, n) for _, k, n in _adapted_linears(cfg, targets)]


def _adapted_linears(cfg: dict, targets: str | list[str]) -> list[tuple[str, int, int]]:
    """(first module path, K, N) per distinct adapted linear shape of the model built from ``cfg``."""
    import torch
    import transformers

    import fastaf as fa

    config = transformers.AutoConfig.for_model(**cfg)
    model = None
    with torch.device("meta"):
        for auto in (transformers.AutoModelForCausalLM, transformers.AutoModelForImageTextToText,
                     transformers.AutoModelForSeq2SeqLM, transformers.AutoModel):
            try:
                model = auto.from_config(config)
                break
            except ValueError:  # this auto class does not know the config
                continue
        if model is None:
            raise SystemExit(f"fastaf-tune: transformers cannot build a model of type {cfg['model_type']!r}")
        adapter = fa.init_adapter(model, fa.LoRAConfig(r=1, alpha=1.0, targets=targets))
    seen, out = set(), []
    for path, lora in adapter.items():
        if lora.experts:
            continue
        shape = (lora.A.shape[-1], lora.B.shape[-2])
        if shape not in seen:
            seen.add(shape)
            out.append((path, *shape))
    return out


_SHAPE_FIELDS = ("M", "K", "N", "R")  # printed first, in this order


def _list() -> int:
    files = sorted(cache.cache_dir().glob("tune-*.json"))
    if not files:
        print(f"no tuning caches under {cache.cache_dir()}")
    for f in files:
        data = cache.load(f) if f.is_file() else None  # warns and drops what is malformed
        if data is None:
            print(f"{f}: unreadable (ignored)")
            continue
        print(f"{f}\n  gpu={data['gpu']} triton={data['triton']} date={data.get('date')}")
        for sec in ("kernels", "dispatch"):
            for name, entries in sorted(data[sec].items()):
                print(f"  {name:24s} {len(entries)} shapes")
        for phase in ("fwd", "bwd"):
            for e in data["dispatch"].get(f"lora_linear.{phase}", []):
                key = e["key"]
                names = [k for k in _SHAPE_FIELDS if k in key] + sorted(set(key) - set(_SHAPE_FIELDS))
                print(f"    {phase} {' '.join(f'{k}={key[k]}' for k in names)}: {e.get('winner', 'timed')}{_times(e)}")
    return 0


def _times(entry: dict) -> str:
    """'  (triton 93.1 | 82.6 us, addmm 96.2 | 167.2 us: GPU | host)' from a dispatch entry's times."""
    ms, host = entry.get("ms"), entry.get("host_ms")
    if not dispatch.timed(ms):
        return ""
    if dispatch.timed(host):
        cells = ", ".join(f"{p} {ms[p] * 1e3:.1f} | {host[p] * 1e3:.1f} us" for p in dispatch.IMPLS)
        return f"  ({cells}: GPU | host)"
    return "  (" + ", ".join(f"{p} {ms[p] * 1e3:.1f} us" for p in dispatch.IMPLS) + ")"


def _clear() -> int:
    files = sorted(cache.cache_dir().glob("tune-*.json"))
    failed = 0
    for f in files:
        try:
            if not f.is_file():
                raise IsADirectoryError("not a regular file")
            f.unlink()
        except OSError as err:
            failed += 1
            print(f"fastaf-tune: could not remove {f}: {err.strerror or err}", file=sys.stderr)
        else:
            print(f"removed {f}")
    cache.forget()
    if not files:
        print(f"nothing to clear under {cache.cache_dir()}")
    return 1 if failed else 0


def main(argv: Optional[list[str]] = None) -> int:
    from fastaf.kernels.tuning import BENCH_RANKS, BENCH_SHAPES, BENCH_TOKENS, KERNELS

    p = argparse.ArgumentParser(prog="fastaf-tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-config", help="HF config.json path, or its JSON text: tune every adapted linear")
    p.add_argument("--targets", default="all-linear",
                   help="with --model-config: comma-separated target names or 'all-linear' (default)")
    p.add_argument("--print-shapes", action="store_true", help="print the shapes that would be tuned and stop")
    p.add_argument("--shapes", type=parse_shapes, help="comma-separated KxN (in x out), e.g. 4096x14336")
    p.add_argument("--tokens", type=_ints, default=BENCH_TOKENS, help="M values (default %(default)s)")
    p.add_argument("--ranks", type=_ints, default=BENCH_RANKS, help="LoRA ranks (default %(default)s)")
    p.add_argument("--kernels", default=",".join(KERNELS), help="subset of %(default)s")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--rep-ms", type=int, default=20, help="do_bench rep per config (ms)")
    p.add_argument("--budget-s", type=float, default=280.0, help="stop starting new shapes after this")
    p.add_argument("--list", action="store_true", help="show the cache files and what they hold")
    p.add_argument("--clear", action="store_true", help="delete every cache file")
    args = p.parse_args(argv)

    if args.list:
        return _list()
    if args.clear:
        return _clear()
    kernels = [k for k in args.kernels.split(",") if k]
    unknown = sorted(set(kernels) - set(KERNELS))
    if unknown:
        p.error(f"unknown kernels {unknown}; choose from {list(KERNELS)}")

    import torch

    targets = args.targets if args.targets == "all-linear" else [t for t in args.targets.split(",") if t]
    shapes = args.shapes or (model_shapes(args.model_config, targets) if args.model_config else BENCH_SHAPES)
    if args.print_shapes:
        print("\n".join(f"{k}x{n}" for k, n in shapes))
        return 0
    if not torch.cuda.is_available():
        print("fastaf-tune: no CUDA GPU; nothing to tune (the CPU path runs the torch reference)", file=sys.stderr)
        return 1
    from fastaf.kernels.tuning import tune

    t0 = time.time()
    print(f"fastaf-tune: {torch.cuda.get_device_name()}  shapes {shapes}  tokens {args.tokens}  "
          f"ranks {args.ranks}  kernels {kernels}", flush=True)
    tune(shapes, args.tokens, args.ranks, dtype=getattr(torch, args.dtype), kernels=kernels,
         rep_ms=args.rep_ms, budget_s=args.budget_s, log=lambda s: print(s, flush=True))
    print(f"done in {time.time() - t0:.0f} s -> {cache.cache_path()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
