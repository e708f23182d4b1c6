"""End to end: one LoRA training step of a Llama-3.2-1B-shaped model, fastaf vs PEFT (BENCH.md).

    python bench/bench_e2e.py [--tiny] [--providers base,base-compiled,peft,fastaf-func,...] [--name e2e]
    python bench/bench_e2e.py --liger        # base-liger, peft-bf16-liger, fastaf-autograd-liger

Model: hidden 2048, 16 layers, 32 heads, 8 kv heads, MLP 8192, vocab 128256, random bf16
weights; batch 8 x 1024 tokens; LoRA r=16, alpha=32 on q,k,v,o,gate,up,down; AdamW on the adapter.
Providers, each a full step (forward, loss, backward, optimizer step):
- base: the frozen model's forward + backward to its input embeddings (the floor: LoRA training
  needs dX through every layer too); no optimizer.
- peft: PEFT's default (fp32 adapters); peft-bf16: PEFT with bf16 adapters.
- fastaf-func: ``torch.func.grad_and_value`` over ``fa.functional_call``, then ``torch.optim.AdamW``
  on the adapter pytree's leaves (fp32 master factors, bf16 activations).
- base-func: the frozen model's forward + backward through ``torch.func.grad`` (functorch's cost).
- fastaf-autograd: ``fa.functional_call`` with the adapter's leaves requiring grad, plain
  ``loss.backward()`` and ``torch.optim.AdamW``.
- fastaf-init: the stateful layer (``fa.init`` + ``add_new_adapter``), ``loss.backward()`` and
  ``torch.optim.AdamW`` (what HF Trainer does).
- base-compiled: ``torch.compile(model)``, forward + backward as ``base``.
- base-func / base-func-compiled: the frozen model's ``torch.func.grad_and_value`` over its input
  embeddings, eager / under ``torch.compile(fullgraph=True)``: the transform's own cost.
- fastaf-autograd-compiled: ``torch.compile(fullgraph=True)`` of the functional call's forward,
  ``loss.backward()`` (AOTAutograd's backward graph), AdamW as ``fastaf-autograd``.
- fastaf-func-compiled: ``torch.compile(torch.func.grad_and_value(loss), fullgraph=True)``, the
  JAX ``jit(grad(f))`` step, then AdamW as ``fastaf-func``.
- ``<fastaf provider>-alone`` / ``-shared``: the same with every adapted layer alone
  (``_mode.SHARE_INPUT = "never"``), or with q/k/v and gate/up taking their h from one pass over
  their shared input also eagerly ("always"; by default only compiled): both paths in one process.
- ``<fastaf provider>-perop``: eager ``torch.func`` with the model run at the grad level, each
  adapted layer its own node (``_below_grad.ENABLED = False``; by default the call runs below the
  level as plain autograd).
- ``<fastaf provider>-single``: every adapted layer its own op eagerly (``_group.GROUP = False``;
  by default siblings over one input, q/k/v and gate/up, run as one op at the first one's call).
- ``<fastaf provider>-triton`` / ``-addmm``: every adapted layer on the fused Triton path, or on
  cuBLAS, whatever the measured dispatch would choose (``_dispatch.OVERRIDE``).
- ``<fastaf provider>-mode``: an eager call enters a ``TorchFunctionMode`` over the whole call
  (``_call.CARRY = False``) instead of the targeted weights carrying the adapter (``_carrier``).
- ``--liger``: Liger-Kernel's RMSNorm, RoPE, SwiGLU and fused linear cross-entropy patched into
  the model first (eager: Liger breaks ``fullgraph``); providers base-liger, peft-bf16-liger,
  fastaf-autograd-liger, fastaf-init-liger and fastaf-func-liger (Liger's old-style Functions
  run under torch.func only below the grad level). Liger patches transformers' Llama module
  globally, so it runs in a process of its own.
The first step of every provider is checked: its loss equals the base model's (B starts at 0);
its loss after timing is recorded (``loss_last``) and a non-finite one fails the run, since its
timing measured a broken step. The first step's wall time is recorded too (``first_step_s``):
for a compiled provider, its compile time.
Writes bench/results/e2e-<gpu>.json with each provider's step time and its ratio to base.
"""
from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from pathlib import Path

import torch
import torch.utils._pytree as pytree

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import _harness as H  # noqa: E402

import fastaf as fa  # noqa: E402
from fastaf.functional import _below_grad, _call, _group, _mode  # noqa: E402
from fastaf.kernels import _dispatch, _graphs  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LR = 1e-4  # AdamW's learning rate on the adapter (--lr; 0 keeps every step's data the first step's)
PROVIDERS = ["base", "base-compiled", "base-func", "peft", "peft-bf16", "fastaf-init", "fastaf-autograd",
             "fastaf-func", "fastaf-func-compiled", "fastaf-autograd-compiled"]
LIGER_PROVIDERS = ["base-liger", "peft-bf16-liger", "fastaf-autograd-liger", "fastaf-init-liger", "fastaf-func-liger"]
# provider suffix -> (module, flag, value) set around each step: both paths in one process
SUFFIXES = {"-alone": (_mode, "SHARE_INPUT", "never"), "-shared": (_mode, "SHARE_INPUT", "always"),
            "-perop": (_below_grad, "ENABLED", False), "-mode": (_call, "CARRY", False),
            "-single": (_group, "GROUP", False), "-triton": (_dispatch, "OVERRIDE", "triton"),
            "-addmm": (_dispatch, "OVERRIDE", "addmm")}


def make_model(tiny: bool, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    size = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=512) if tiny else dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256)
    torch.manual_seed(0)
    cfg = LlamaConfig(**size, max_position_embeddings=2048, tie_word_embeddings=True)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    return model.train().requires_grad_(False)


def base_step(model, ids, compiled: bool = False):
    emb = model.get_input_embeddings()(ids).detach().requires_grad_()
    run = torch.compile(model) if compiled else model

    def step():
        loss = run(inputs_embeds=emb, labels=ids).loss
        loss.backward()
        return loss

    return step


def _autograd_step(loss_fn, params: list, cuda: bool):
    """A step of ``loss_fn()``: backward, then fused AdamW on ``params``."""
    opt = torch.optim.AdamW(params, lr=LR, fused=cuda)

    def step():
        loss = loss_fn()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def peft_step(model, ids, bf16: bool):
    import peft

    cfg = peft.LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, lora_dropout=0.0)
    pm = peft.get_peft_model(copy.deepcopy(model), cfg, autocast_adapter_dtype=not bf16)
    trainable = [p for p in pm.parameters() if p.requires_grad]
    return _autograd_step(lambda: pm(input_ids=ids, labels=ids).loss, trainable, ids.is_cuda)


def fastaf_func_step(model, ids, compiled: bool = False):
    adapter = fa.init_adapter(model, fa.LoRAConfig(r=16, alpha=32, targets=TARGETS), seed=0)
    leaves, spec = pytree.tree_flatten(adapter)
    # The optimizer owns the fp32 master leaves; the adapter value is rebuilt from them each step.
    opt = torch.optim.AdamW(leaves, lr=LR, fused=ids.is_cuda)
    batch = {"input_ids": ids, "labels": ids}
    grad_fn = torch.func.grad_and_value(lambda ad: fa.functional_call(model, ad, (), batch).loss)
    grad_fn = torch.compile(grad_fn, fullgraph=True) if compiled else grad_fn

    def step():
        grads, loss = grad_fn(pytree.tree_unflatten(leaves, spec))
        for p, g in zip(leaves, pytree.tree_leaves(grads)):
            p.grad = g
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def base_func_step(model, ids, compiled: bool = False):
    """The frozen model differentiated by torch.func.grad instead of autograd: functorch's own cost
    (compiled: what ``torch.compile`` of a ``grad_and_value`` costs without any adapter)."""
    emb = model.get_input_embeddings()(ids).detach()
    grad_fn = torch.func.grad_and_value(lambda e: model(inputs_embeds=e, labels=ids).loss)
    grad_fn = torch.compile(grad_fn, fullgraph=True) if compiled else grad_fn

    def step():
        return grad_fn(emb)[1]

    return step


def fastaf_autograd_step(model, ids, compiled: bool = False):
    """The functional call differentiated by plain autograd on the adapter's leaves (compiled: the
    loss under ``torch.compile(fullgraph=True)``, its backward AOTAutograd's graph)."""
    adapter = fa.init_adapter(model, fa.LoRAConfig(r=16, alpha=32, targets=TARGETS), seed=0)
    leaves, spec = pytree.tree_flatten(adapter)
    leaves = [t.requires_grad_() for t in leaves]
    batch = {"input_ids": ids, "labels": ids}
    loss = lambda ls: fa.functional_call(model, pytree.tree_unflatten(ls, spec), (), batch).loss  # noqa: E731
    loss = torch.compile(loss, fullgraph=True) if compiled else loss
    return _autograd_step(lambda: loss(leaves), leaves, ids.is_cuda)


def fastaf_init_step(model, ids):
    m = fa.init(copy.deepcopy(model))
    m.add_new_adapter("a", fa.LoRAConfig(r=16, alpha=32, targets=TARGETS), seed=0)
    m.set_active_adapter("a")
    trainable = [p for p in m.parameters() if p.requires_grad]
    return _autograd_step(lambda: m(input_ids=ids, labels=ids).loss, trainable, ids.is_cuda)


def _flagged(step, module, flag: str, value):
    """``step`` with ``module.flag = value`` (read per call, also by a compiled step's guard)."""
    def run():
        before = getattr(module, flag)
        setattr(module, flag, value)
        try:
            return step()
        finally:
            setattr(module, flag, before)

    return run


def _counted(step, graphs: list):
    """``step`` adding the launch graphs it captures and replays to ``graphs`` ([captures, replays])."""
    def run():
        before = (_graphs.GRAPHS.captures, _graphs.GRAPHS.replays)
        try:
            return step()
        finally:
            graphs[0] += _graphs.GRAPHS.captures - before[0]
            graphs[1] += _graphs.GRAPHS.replays - before[1]

    return run


def _wall_ms(step, n: int = 5) -> dict:
    """CPU smoke-test timing (do_bench needs a GPU): median of n wall-clock steps."""
    import time

    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return {"ms": times[n // 2], "p20": times[n // 5], "p80": times[(4 * n) // 5]}


def _profile(steps: dict) -> None:
    """Per provider, over 3 steps: the top host-time Python functions (cProfile, by own time), and
    on CUDA the device's busy time and top kernels (torch.profiler): whether an eager step is
    host-bound, and where the host or the device spends its time."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    for name, step in steps.items():
        step()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(3):
            step()
        if cuda:
            torch.cuda.synchronize()
        prof.disable()
        print(f"== {name}: host time of 3 steps", flush=True)
        stats = pstats.Stats(prof).sort_stats("tottime")
        stats.print_stats(30)
        # who calls the hot built-ins (casts, fills, allocations): where a step's launches come from
        stats.print_callers(r"method 'to' of|built-in method torch.zeros|built-in method torch.empty")
        if not cuda:
            continue
        with profile(activities=[ProfilerActivity.CUDA]) as kprof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        events = kprof.key_averages()
        busy = sum(e.self_device_time_total for e in events) / 3e3
        print(f"== {name}: device busy {busy:.2f} ms per step; by kind (ms per step, launches per step)")
        for kind, (ms, n) in _by_kind(events).items():
            print(f"   {kind:28s} {ms:8.2f} ms  {n:6.0f}")
        print(f"== {name}: top kernels (3 steps)")
        print(events.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=90))


# Kernel name -> kind, first match wins: where a step's device time goes, provider beside provider.
# Inductor first: it names a fused kernel after the ops it fused, fastaf's included
# ("triton_poi_fused_..._lora_given_h_bwd_..." is Inductor's code around fastaf's op, not fastaf's).
_KINDS = [("inductor triton", ("triton_",)),
          ("fastaf GEMM (fused LoRA)", ("_lora_linear_gemm", "_multi_gemm")),
          ("fastaf skinny passes", ("_lora_", "_multi_")),
          ("cuBLAS GEMM", ("nvjet", "gemm", "sm90_xmma", "cutlass", "cublas")),
          ("attention", ("sdpa", "flash", "fmha", "attention")),
          ("optimizer", ("adam", "multi_tensor")),
          ("softmax / cross-entropy", ("softmax", "nll", "cross_entropy", "logsumexp")),
          ("copies / casts", ("copy", "clone", "cat", "fill", "memset", "memcpy")),
          ("aten elementwise / reduce", ("elementwise", "reduce", "at::native"))]


def _by_kind(events) -> dict:
    """{kind: (device ms per step, launches per step)} over a profile of 3 steps."""
    kinds: dict = {}
    for e in events:
        if e.self_device_time_total <= 0:
            continue
        low = e.key.lower()
        kind = next((k for k, marks in _KINDS if any(m in low for m in marks)), "other")
        ms, n = kinds.get(kind, (0.0, 0))
        kinds[kind] = (ms + e.self_device_time_total / 3e3, n + e.count / 3)
    return dict(sorted(kinds.items(), key=lambda kv: -kv[1][0]))


def _liger(model):
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True, model=model)
    return model


def main() -> None:
    global LR
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model on any device (a smoke test)")
    ap.add_argument("--liger", action="store_true", help="patch Liger-Kernel in; run the -liger providers")
    ap.add_argument("--providers", default=None, help="default: all of this mode's")
    ap.add_argument("--name", default=None, help="result file name (default e2e, e2e-liger)")
    ap.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                    help="build every provider first, then time them in ROUNDS interleaved rounds")
    ap.add_argument("--batch", type=int, default=8, help="sequences of 1024 tokens per step (BENCH.md: 8)")
    ap.add_argument("--profile", default="", metavar="PROVIDERS",
                    help="after timing, profile these providers' host and device time over 3 steps")
    ap.add_argument("--lr", type=float, default=LR, help="AdamW's learning rate (0: the adapter, and so every "
                    "step's data and the GPU's power draw, stay as at the first step)")
    args = ap.parse_args()
    LR = args.lr  # read by the step makers below
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = make_model(args.tiny, device)
    model = _liger(model) if args.liger else model
    providers = args.providers or ",".join(LIGER_PROVIDERS if args.liger else PROVIDERS)
    batch, seq = (2, 64) if args.tiny else (args.batch, 1024)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0)).to(device)
    makers = {"base": base_step, "base-compiled": lambda m, i: base_step(m, i, compiled=True),
              "peft": lambda m, i: peft_step(m, i, bf16=False),
              "peft-bf16": lambda m, i: peft_step(m, i, bf16=True), "fastaf-func": fastaf_func_step,
              "fastaf-func-compiled": lambda m, i: fastaf_func_step(m, i, compiled=True),
              "base-func": base_func_step, "base-func-compiled": lambda m, i: base_func_step(m, i, compiled=True),
              "fastaf-autograd": fastaf_autograd_step,
              "fastaf-autograd-compiled": lambda m, i: fastaf_autograd_step(m, i, compiled=True),
              "fastaf-init": fastaf_init_step, "base-liger": base_step,
              "peft-bf16-liger": lambda m, i: peft_step(m, i, bf16=True), "fastaf-autograd-liger": fastaf_autograd_step,
              "fastaf-init-liger": fastaf_init_step, "fastaf-func-liger": fastaf_func_step}
    rows, base_loss, steps, profiled = [], None, {}, {}
    for name in providers.split(","):
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()  # each provider's own peak
        suffix = next((s for s in SUFFIXES if name.startswith("fastaf") and name.endswith(s)), "")
        step = makers[name.removesuffix(suffix) if suffix else name](model, ids)
        step = _flagged(step, *SUFFIXES[suffix]) if suffix else step
        graphs0 = (_graphs.GRAPHS.captures, _graphs.GRAPHS.replays)
        t0 = time.perf_counter()
        first = step().item()  # B = 0: every LoRA provider's first loss is the base loss
        first_s = round(time.perf_counter() - t0, 2)  # a compiled provider's compile time
        base_loss = first if base_loss is None else base_loss
        if abs(first - base_loss) > 1e-2 * abs(base_loss):
            raise SystemExit(f"{name}: first-step loss {first:.4f} != base {base_loss:.4f}")
        if args.interleave:  # its peak is its first steps' (each holds its own state meanwhile)
            step()
            t = {}
        else:
            t = H.time_fn(step, warmup=300, rep=2000) if device == "cuda" else _wall_ms(step)
            t["loss_last"] = step().item()
        mem = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0
        # the eager launches' CUDA graphs over this provider's steps: captures, replays (_graphs)
        graphs = [_graphs.GRAPHS.captures - graphs0[0], _graphs.GRAPHS.replays - graphs0[1]]
        rows.append({"bench": "e2e", "model": "llama-3.2-1b-shape" if not args.tiny else "tiny", "tokens": batch * seq,
                     "r": 16, "dtype": "bfloat16", "mode": "train_step", "provider": name, **t, "loss0": first,
                     "max_mem_gib": round(mem, 2), "graphs": graphs, "first_step_s": first_s})
        if t:
            print(f"{name:12s} {t['ms']:8.2f} ms  (p20 {t['p20']:.2f}, p80 {t['p80']:.2f})  loss0 {first:.4f}"
                  f"  graphs: {graphs[0]} captured, {graphs[1]} replays  first step {first_s:.1f} s", flush=True)
        if args.interleave:  # its graphs are counted over the timed steps too (not over --profile's)
            steps[name] = _counted(step, graphs)
        if args.interleave or name in args.profile.split(","):
            profiled[name] = step
        else:
            del step
            torch.cuda.empty_cache() if device == "cuda" else None
    if args.interleave:
        timed = H.time_interleaved(steps, rounds=args.interleave, warmup=300, rep=2000 * args.interleave)
        for r in rows:
            r.update(timed[r["provider"]], loss_last=steps[r["provider"]]().item())
            print(f"{r['provider']:12s} {r['ms']:8.2f} ms  rounds {r['rounds']}  graphs: {r['graphs'][0]} captured, "
                  f"{r['graphs'][1]} replays", flush=True)
    if args.profile:
        _profile({k: v for k, v in profiled.items() if k in args.profile.split(",")})
    base = next((r["ms"] for r in rows if r["provider"] in ("base", "base-liger")), None)
    for r in rows:
        r["ratio_to_base"] = r["ms"] / base if base else None
    name = args.name or ("e2e-liger" if args.liger else "e2e") + ("-tiny" if args.tiny else "")
    path = H.write_results(name, rows, {"batch": batch, "seq": seq, "lr": args.lr})
    print(f"wrote {path}")
    for r in rows:
        print(f"  {r['provider']:12s} {r['ms']:8.2f} ms  {r['ratio_to_base']:.2f}x base" if base else r)
    # A step that went non-finite timed other work than a training step (NaN data draws less
    # power: the H100's clocks rose and compute-bound kernels ran 5-8% faster, e2e-s30-*).
    broken = [r["provider"] for r in rows if not math.isfinite(r["loss_last"])]
    if broken:
        raise SystemExit(f"non-finite loss after timing (timings invalid): {', '.join(broken)}")


if __name__ == "__main__":
    main()
