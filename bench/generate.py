"""Inference: what decoding with an adapter costs over the frozen model's, fastaf beside PEFT.

    python bench/generate.py [--providers base,base-static,fastaf,...] [--tiny]

Model: the Llama-3.2-1B shape (``bench/configs/llama-3.2-1b-shape.json``) with random bf16 weights;
32 prompts x 128 tokens, 64 greedy new tokens (no early stop); LoRA r=16 on q,k,v,o,gate,up,down
with random factors. Each provider is the whole ``generate`` call, in seconds and tokens per
second: every provider is checked and warmed up (which compiles, for the ``-static`` ones), then
timed in ``--repeats`` rounds over all of them in a seeded random order, keeping its best; the
``-static`` providers, each a third of a second, get ``--static-repeats`` rounds (a ``-static``
provider's timed call after an untimed one of its own: compiled steps of several providers may
share a graph, whose CUDA graphs record again for the model that runs it next):
- base: ``model.generate`` with the dynamic cache; base-static: ``cache_implementation="static"``
  (transformers compiles the decode step with CUDA graphs, ``mode="reduce-overhead"``).
- peft / peft-static: a PEFT model with the same adapter.
- fastaf / fastaf-static: ``fa.generate(model, adapter, ...)``.
- fastaf-init / fastaf-init-static: the stateful layer (``fa.init``, ``set_active_adapter``,
  ``model.generate``).
- fastaf-mixed16 / fastaf-mixed16-static / peft-mixed16: 16 adapters, row i decoding with adapter
  i % 16 (``fa.stack`` + ``adapter_ids``; PEFT's ``adapter_names``).
- fwd-base, fwd-peft, fwd-fastaf, fwd-fastaf-init: one ``no_grad`` forward of 4 x 128 tokens, ms
  (do_bench's median, in five interleaved rounds over the forward providers): the host cost of an
  adapted layer, which eager decoding pays at every step.
- A/B providers, the same under a switch (``fastaf._config``): ``-split`` with ``decode_linear``
  off (a decoding step's adapted linear as cuBLAS's GEMM, then the LoRA: one Triton launch
  eagerly, shrink and expand compiled, instead of one launch for both), ``-cublas`` with
  ``eager_decode_kernel`` off too (the LoRA as cuBLAS's mm + addmm_), ``fastaf-static-unshared``
  and ``fastaf-mixed16-static-unshared`` with ``group`` off (each sibling its own shrink launch),
  ``fastaf-mixed16-multi`` / ``fastaf-mixed16-static-multi`` with ``decode_multi_linear`` ``always`` (two launches per adapted
  linear with ids, the base GEMM in the LoRA's, compiled too), ``fastaf-mixed16-nomulti`` /
  ``fastaf-mixed16-static-nomulti`` with it ``never`` (cuBLAS's GEMM, the shrink and the expand,
  eager too); ``fastaf-init-bf16`` / ``fastaf-init-bf16-static``: the stateful layer holding
  the adapter's factors in bf16 instead of fp32 masters.
Before timing, each generate provider's prefill logits and its first decoding step's are checked
against an fp32 reference (the adapters applied by ``fa.functional_call`` on an fp32 copy); greedy
tokens of a random-weight model diverge between correct bf16 paths, so tokens are not compared. Rows go to
bench/results/generate.csv (see bench/README.md).
"""
from __future__ import annotations

import argparse
import copy
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import _harness as H  # noqa: E402

import fastaf as fa  # noqa: E402

CONFIG = Path(__file__).resolve().parent / "configs" / "llama-3.2-1b-shape.json"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA, MIXED = 16, 32, 16
GENERATE = ["base", "base-static", "peft", "peft-static", "fastaf", "fastaf-static", "fastaf-init",
            "fastaf-init-static", "fastaf-mixed16", "fastaf-mixed16-static", "peft-mixed16"]
FORWARD = ["fwd-base", "fwd-peft", "fwd-fastaf", "fwd-fastaf-init"]
# the same providers under a switch, for A/Bs in one process: provider suffix -> flags
SWITCHED = {"-split": dict(decode_linear=False), "-cublas": dict(decode_linear=False, eager_decode_kernel=False),
            "-unshared": dict(group=False), "-multi": dict(decode_multi_linear="always"),
            "-nomulti": dict(decode_multi_linear="never")}
AB = ["fwd-fastaf-split", "fwd-fastaf-init-split", "fastaf-split", "fastaf-init-split", "fastaf-static-split",
      "fastaf-init-static-split", "fwd-fastaf-cublas", "fwd-fastaf-init-cublas", "fastaf-cublas", "fastaf-init-cublas",
      "fastaf-static-unshared", "fastaf-mixed16-static-unshared", "fastaf-init-bf16", "fastaf-init-bf16-static",
      "fastaf-mixed16-multi", "fastaf-mixed16-static-multi", "fastaf-mixed16-nomulti", "fastaf-mixed16-static-nomulti"]
CASE = ("model", "prompts", "prompt_len", "new_tokens", "r", "adapters")
FIGURES = ("s", "tok_per_s", "ms", "max_rel_err")
BF16_TOL = 0.05  # max |Δlogit| / max |logit| of the prefill against fp32: bf16 paths measured ~1e-2


def make_model(tiny: bool, device: str):
    model = H.random_llama(None if tiny else CONFIG, device)
    model.generation_config.eos_token_id = None  # every provider decodes all its new tokens
    model.generation_config.pad_token_id = 0
    return model.eval().requires_grad_(False)


def random_adapter(model, seed: int) -> fa.Adapter:
    """PEFT's init for A, a random B (so the adapter changes the logits), fp32 factors."""
    adapter = fa.init_adapter(model, fa.LoRAConfig(r=RANK, alpha=ALPHA, targets=TARGETS), seed=seed)
    g = torch.Generator().manual_seed(10_000 + seed)
    return fa.Adapter({p: fa.LoRA(l.A, (torch.randn(l.B.shape, generator=g) * 0.02).to(l.B.device), l.scale)
                       for p, l in adapter.items()})


def peft_model(model, adapters: list[fa.Adapter]):
    """A PEFT model over a copy of ``model`` holding ``adapters`` ("a0", "a1", ...) with the same factors."""
    import peft

    cfg = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS)
    pm = None
    for i, adapter in enumerate(adapters):
        if pm is None:
            pm = peft.get_peft_model(copy.deepcopy(model), cfg, adapter_name=f"a{i}")
        else:
            pm.add_adapter(f"a{i}", cfg)
        modules = dict(pm.base_model.model.named_modules())
        with torch.no_grad():
            for path, lora in adapter.items():
                layer = modules[path]
                layer.lora_A[f"a{i}"].weight.copy_(lora.A)
                layer.lora_B[f"a{i}"].weight.copy_(lora.B)
    pm.set_adapter("a0")
    return pm.eval()


def stateful(model, adapter: fa.Adapter):
    inited = copy.deepcopy(model)
    fa.init(inited)
    inited.add_new_adapter("a", adapter)
    inited.set_active_adapter("a")
    return inited


def make_providers(names: list[str], model, adapters: list[fa.Adapter], ids: torch.Tensor):
    """provider -> (generate(**kw) -> output, the adapter per row for the reference or None)."""
    one, rows = adapters[0], ids.shape[0]
    per_row = [adapters[i % len(adapters)] for i in range(rows)]  # the mixed providers' (16 adapters made for them)
    row_ids = torch.arange(rows, device=ids.device) % MIXED
    stack = fa.stack(adapters) if any("mixed" in n for n in names) else None
    need_peft = [n for n in names if n.startswith(("peft", "fwd-peft"))]
    pm = peft_model(model, adapters if "peft-mixed16" in names else [one]) if need_peft else None
    inited = stateful(model, one) if any("fastaf-init" in n and "bf16" not in n for n in names) else None
    # the stateful layer holding bf16 factors (an adapter loaded for inference), beside its fp32 masters
    inited16 = stateful(model, fa.Adapter({p: fa.LoRA(l.A.to(model.dtype), l.B.to(model.dtype), l.scale)
                                           for p, l in one.items()})) if any("bf16" in n for n in names) else None
    static = dict(cache_implementation="static")
    table = {
        "base": (lambda **kw: model.generate(ids, **kw), None),
        "base-static": (lambda **kw: model.generate(ids, **static, **kw), None),
        "peft": (lambda **kw: pm.generate(input_ids=ids, **kw), [one] * rows),
        "peft-static": (lambda **kw: pm.generate(input_ids=ids, **static, **kw), [one] * rows),
        "fastaf": (lambda **kw: fa.generate(model, one, ids, **kw), [one] * rows),
        "fastaf-static": (lambda **kw: fa.generate(model, one, ids, **static, **kw), [one] * rows),
        "fastaf-init": (lambda **kw: inited.generate(ids, **kw), [one] * rows),
        "fastaf-init-static": (lambda **kw: inited.generate(ids, **static, **kw), [one] * rows),
        "fastaf-init-bf16": (lambda **kw: inited16.generate(ids, **kw), [one] * rows),
        "fastaf-init-bf16-static": (lambda **kw: inited16.generate(ids, **static, **kw), [one] * rows),
        "fastaf-mixed16": (lambda **kw: fa.generate(model, stack, ids, adapter_ids=row_ids, **kw), per_row),
        "fastaf-mixed16-static": (lambda **kw: fa.generate(model, stack, ids, adapter_ids=row_ids, **static, **kw),
                                  per_row),
        "peft-mixed16": (lambda **kw: pm.generate(input_ids=ids, adapter_names=[f"a{i % MIXED}" for i in range(rows)],
                                                  **kw), per_row),
    }
    forward = {
        "fwd-base": lambda x: model(x).logits,
        "fwd-peft": lambda x: pm(input_ids=x).logits,
        "fwd-fastaf": lambda x: fa.functional_call(model, one, (x,)).logits,
        "fwd-fastaf-init": lambda x: inited(x).logits,
    }
    for name in names:  # A/B providers: their provider under the suffix's flags
        for suffix, flags in SWITCHED.items():
            if name.endswith(suffix):
                for providers in (table, forward):
                    if name[:-len(suffix)] in providers:
                        providers[name] = _switched(providers[name[:-len(suffix)]], flags)
    return table, forward


def _switched(provider, flags: dict):
    """``provider`` (a generate entry or a forward) run under ``_config.override(**flags)``."""
    from fastaf import _config

    def under(fn):
        def run(*args, **kw):
            with _config.override(**flags):
                return fn(*args, **kw)
        return run
    return (under(provider[0]), provider[1]) if isinstance(provider, tuple) else under(provider)


def reference_prefill(model32, ids: torch.Tensor, per_row: list[fa.Adapter] | None) -> torch.Tensor:
    """fp32 last-position logits of ``ids`` (the prompts, or the prompts and a first token), each
    row with its adapter (or none)."""
    with torch.no_grad():
        if per_row is None:
            return model32(ids).logits[:, -1].float()
        out = []
        for i, adapter in enumerate(per_row):
            a32 = fa.Adapter({p: fa.LoRA(l.A.float(), l.B.float(), l.scale) for p, l in adapter.items()})
            out.append(fa.functional_call(model32, a32, (ids[i:i + 1],)).logits[:, -1])
        return torch.cat(out).float()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    # the forwards first: eager forwards measured up to 1.5x slower after the -static providers compiled
    ap.add_argument("--providers", default=",".join(FORWARD + [n for n in AB if n.startswith("fwd-")] + GENERATE
                                                    + [n for n in AB if not n.startswith("fwd-")]),
                    help="comma-separated")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model, 4 prompts x 16, 8 new tokens (a smoke test)")
    ap.add_argument("--name", default=None, help="results file bench/results/<name>.csv (default generate)")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds after the warm-ups; each provider's best is kept")
    ap.add_argument("--static-repeats", type=int, default=8,
                    help="timed rounds of the -static providers (the extra ones among themselves)")
    ap.add_argument("--profile", action="store_true",
                    help="after timing, one generate per provider under torch.profiler (its kernels' GPU time per "
                         "step) and one under cProfile (its Python functions' own time per step)")
    args = ap.parse_args()
    names = [n for n in args.providers.split(",") if n]
    unknown = sorted(set(names) - set(GENERATE) - set(FORWARD) - set(AB))
    if unknown:
        raise SystemExit(f"unknown providers {unknown}; known: {GENERATE + FORWARD + AB}")
    torch._dynamo.config.recompile_limit = 64  # one model's call compiled for several providers
    results = H.Results(args.name or ("generate-tiny" if args.tiny else "generate"), CASE, FIGURES)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = make_model(args.tiny, device)
    prompts, prompt_len, new = (4, 16, 8) if args.tiny else (32, 128, 64)
    ids = torch.randint(0, model.config.vocab_size, (prompts, prompt_len),
                        generator=torch.Generator().manual_seed(0)).to(device)
    adapters = [random_adapter(model, seed=i) for i in range(MIXED if any("mixed" in n for n in names) else 1)]
    table, forward = make_providers(names, model, adapters, ids)
    model32 = copy.deepcopy(model).float()
    case = {"model": "tiny" if args.tiny else "llama-3.2-1b-shape", "prompts": prompts, "prompt_len": prompt_len,
            "new_tokens": new, "r": RANK}
    rows = []
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False)
    warmed = {}  # generate provider -> (run, prefill error, warm-up s)
    x = ids[:4, :128]
    fwd = {name: (lambda name=name: forward[name](x)) for name in names if name in forward}
    with torch.no_grad():
        # interleaved rounds: the host's speed drifts over a run (fwd-base measured 10.4 to 24.6 ms
        # in separate runs), and a provider timed in one block took that moment's
        timed = H.time_interleaved(fwd, rounds=5) if device == "cuda" and fwd else \
            {name: {"ms": _wall(fn) * 1e3, "rounds": []} for name, fn in fwd.items()}
    for name, t in timed.items():
        rows.append({"provider": name, **case, "prompts": 4, "new_tokens": 0, "adapters": int(name != "fwd-base"),
                     "ms": round(t["ms"], 4)})
        print(f"{name:24s} {t['ms']:8.3f} ms  (rounds {t['rounds']})", flush=True)
    if rows:  # written as they come: a run cut short keeps what it measured
        results.append(rows)
        rows = []
    for name in names:
        if name in forward:
            continue
        run, per_row = table[name]
        out = run(max_new_tokens=2, min_new_tokens=2, do_sample=False, return_dict_in_generate=True, output_logits=True)
        err = 0.0
        # the prefill's logits, then the first decoding step's (one row per prompt: the eager
        # one-launch linear, the compiled step's kernels) on the token the provider chose
        for step, seq in enumerate((ids, out.sequences[:, :prompt_len + 1])):
            got, want = out.logits[step].float(), reference_prefill(model32, seq, per_row)
            err = max(err, ((got - want).abs().max() / want.abs().max()).item())
        if err > BF16_TOL:
            raise SystemExit(f"{name}: prefill or first step's logits {err:.3g} off the fp32 reference "
                             f"(tolerance {BF16_TOL})")
        t0 = time.perf_counter()
        run(**kw)  # warm-up: compiles the -static providers' decode step
        warmed[name] = (run, err, time.perf_counter() - t0)
        print(f"  {name}: logits checked ({err:.2e}), warmed up in {warmed[name][2]:.1f} s", flush=True)
    # rounds over every warmed provider in a fresh seeded order: a drift of the GPU's clocks or of
    # the host's lands on all of them, not on the one timed last
    times = {name: [] for name in warmed}  # provider -> its rounds' seconds, printed: the host's drift shows
    order = random.Random(0)
    static = [name for name in warmed if name.endswith("-static")]
    # every provider's rounds, then the -static ones' extra rounds among themselves: a compiled
    # generate is a third of a second, and one provider's rounds spread by up to 25% (run 06b2)
    rounds = [list(warmed)] * args.repeats + [static] * max(0, args.static_repeats - args.repeats)
    for providers in rounds:
        for name in order.sample(providers, len(providers)):
            if name.endswith("-static"):
                # providers' compiled steps may share a graph (fa.generate's and the stateful layer's
                # run one frame): the CUDA graphs recorded for the model that ran it last are recorded
                # again for this one, once, in an untimed call
                warmed[name][0](**kw)
            times[name].append(_wall(lambda: warmed[name][0](**kw)))
    best = {name: min(t) for name, t in times.items()}
    for name, (_, err, warm) in warmed.items():
        n_adapters = MIXED if "mixed" in name else int(name.startswith(("peft", "fastaf")))
        rows.append({"provider": name, **case, "adapters": n_adapters, "s": round(best[name], 4),
                     "tok_per_s": round(prompts * new / best[name], 1), "max_rel_err": round(err, 5)})
        print(f"{name:24s} {best[name]:8.3f} s  {prompts * new / best[name]:9.1f} tok/s  prefill err {err:.2e}  "
              f"(warm-up {warm:.1f} s; rounds {[round(t, 3) for t in times[name]]})", flush=True)
    # the rows before the profiles: a run cut short while profiling keeps its timings
    path = results.append(rows)
    print(f"appended the rows to {path} (run {results.meta['run']})", flush=True)
    if args.profile and device == "cuda":
        for name, (run, _, _) in warmed.items():
            profile_kernels(name, lambda: run(**kw), new, best[name])
            profile_host(name, lambda: run(**kw), new)
    base = next((r["s"] for r in rows if r["provider"] == "base"), None)
    for r in rows:
        if r.get("s") and base:
            print(f"  {r['provider']:24s} {r['s'] / base:6.3f}x base")


def profile_kernels(name: str, fn, steps: int, wall: float, top: int = 12) -> None:
    """Print the GPU time per decoding step of ``fn``'s kernels (CUDA-graph replays included),
    the busiest first, beside the unprofiled wall time per step: where a provider's GPU time
    and its wall time part, the host is what it waits on."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = sorted(((e.key, e.self_device_time_total, e.count) for e in prof.key_averages()
                      if e.self_device_time_total > 0), key=lambda k: -k[1])
    busy = sum(k[1] for k in kernels) / steps
    print(f"-- {name}: GPU {busy:8.1f} us per step over {len(kernels)} kernels; wall {wall / steps * 1e6:8.1f} us "
          f"per step (the prefill spread over the steps)", flush=True)
    for key, us, count in kernels[:top]:
        print(f"   {us / steps:8.1f} us {count / steps:7.1f}x  {key[:90]}", flush=True)


def profile_host(name: str, fn, steps: int, top: int = 25) -> None:
    """Print the Python functions ``fn`` spends its own time in per decoding step (cProfile), the
    busiest first: what a step's host time beyond the GPU's goes to (guards and graph inputs run in
    a compiled step's own frame, CUDA-graph trees' checks in theirs). A host sync is the own time
    of the function that waits for the GPU (transformers' stopping check reads a flag off the GPU
    at each step, in the versions that do not defer it). Functions are named with their file's
    folder: several ``utils.py`` take part."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    fn()
    torch.cuda.synchronize()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, line, function) -> (calls, primitive, own s, cumulative s, callers)
    busiest = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    print(f"-- {name}: host, own time per step", flush=True)
    for (file, line, function), (calls, _, own, cumulative, _) in busiest:
        print(f"   {own / steps * 1e6:8.1f} us own {cumulative / steps * 1e6:8.1f} cum {calls / steps:7.1f}x  "
              f"{function} ({'/'.join(Path(file).parts[-2:])}:{line})", flush=True)


def _wall(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
