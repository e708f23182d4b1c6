"""End to end: what one LoRA training step costs over the frozen model's, fastaf beside PEFT.

    python bench/e2e.py [--providers base,base-compiled,peft,fastaf-func,...] [--interleave ROUNDS]
    python bench/e2e.py --liger                  # the -liger providers, in a process of their own
    python bench/e2e.py --tiny                   # a 2-layer model on any device: a smoke test

Model: a Llama-3.2-1B shape (``bench/configs/llama-3.2-1b-shape.json``: hidden 2048, 16 layers,
32 heads, 8 kv heads, MLP 8192, vocab 128256) with random bf16 weights; batch 8 x 1024 tokens;
LoRA r=16, alpha=32 on q,k,v,o,gate,up,down; AdamW on the adapter.
Providers, each a full step (forward, loss, backward, optimizer step):
- base: the frozen model's forward + backward to its input embeddings (the floor: LoRA training
  needs dX through every layer too); no optimizer.
- base-compiled: ``torch.compile(model)``, forward + backward as ``base``.
- base-func / base-func-compiled: the frozen model's ``torch.func.grad_and_value`` over its input
  embeddings, eager / under ``torch.compile(fullgraph=True)``: the transform's own cost.
- peft: PEFT's default (fp32 adapters); peft-bf16: PEFT with bf16 adapters; peft-bf16-compiled:
  the PEFT model under ``torch.compile``.
- fastaf-func: ``torch.func.grad_and_value`` over ``fa.functional_call``, then ``torch.optim.AdamW``
  on the adapter pytree's leaves (fp32 master factors, bf16 activations).
- fastaf-autograd: ``fa.functional_call`` with the adapter's leaves requiring grad, plain
  ``loss.backward()`` and AdamW.
- fastaf-init: the stateful layer (``fa.init`` + ``add_new_adapter``), ``loss.backward()`` and AdamW
  (what HF Trainer does).
- fastaf-autograd-compiled: ``torch.compile(fullgraph=True)`` of the functional call's loss,
  ``loss.backward()`` (AOTAutograd's backward graph), AdamW as ``fastaf-autograd``.
- fastaf-func-compiled: ``torch.compile(torch.func.grad_and_value(loss), fullgraph=True)``, the
  JAX ``jit(grad(f))`` step, then AdamW as ``fastaf-func``.
- ``--liger``: Liger-Kernel's RMSNorm, RoPE, SwiGLU and fused linear cross-entropy patched into
  the model first (eager: Liger breaks ``fullgraph``); providers base-liger, peft-bf16-liger,
  fastaf-autograd-liger, fastaf-init-liger and fastaf-func-liger. Liger patches transformers'
  Llama module globally, so it runs in a process of its own.
Many adapters trained at once: ``<provider>-x<G>`` (fastaf-autograd, fastaf-func and their
-compiled) trains a stack of G adapters, adapter i on its own batch / G sequences: through
``adapter_ids`` for fastaf-autograd, through ``torch.func.vmap`` of ``grad_and_value`` over the
stack for fastaf-func. Next to the same provider without the suffix (one adapter over all the
sequences), the ratio is what training G adapters costs over training one on the same tokens.
With a vmapped provider in the run, every provider runs SDPA with ``is_causal=True`` in place of
the mask transformers builds (``_causal_sdpa`` says why).
Switches, both paths in one process (``fastaf._config.override`` around each step of a fastaf
provider with the suffix): ``-alone`` / ``-shared`` (share_input "never" / "always": every adapted
layer alone, or q/k/v and gate/up taking h from one pass over their input also eagerly),
``-perop`` (below_grad off: eager ``torch.func`` runs each adapted layer as its own node at the
grad level), ``-single`` (group off: siblings over one input run as separate ops), ``-mode`` (carry
off: one ``TorchFunctionMode`` over the whole call instead of weights carrying their adapter),
``-triton`` / ``-addmm`` (dispatch: every adapted layer on the fused Triton path, or on cuBLAS).
The first step of every provider is checked: its loss equals the base model's (B starts at 0).
Its loss after timing must be finite, since a non-finite step times other work than training.
The first step's wall time is recorded (``first_step_s``): for a compiled provider, its compile.
Rows go to bench/results/<name>.csv (``--name``, default e2e): see bench/README.md.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import re
import sys
import time
from pathlib import Path

import torch
import torch.utils._pytree as pytree

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import _harness as H  # noqa: E402

import fastaf as fa  # noqa: E402
from fastaf import _config  # noqa: E402

CONFIG = Path(__file__).resolve().parent / "configs" / "llama-3.2-1b-shape.json"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA = 16, 32
LR = 1e-4  # AdamW's learning rate on the adapter (--lr; 0 keeps every step's data the first step's)
PROVIDERS = ["base", "base-compiled", "base-func", "peft", "peft-bf16", "fastaf-init", "fastaf-autograd",
             "fastaf-func", "fastaf-func-compiled", "fastaf-autograd-compiled"]
LIGER_PROVIDERS = ["base-liger", "peft-bf16-liger", "fastaf-autograd-liger", "fastaf-init-liger", "fastaf-func-liger"]
# provider suffix -> the fastaf._config flags set around each step: both paths in one process
SWITCHES = {"-alone": {"share_input": "never"}, "-shared": {"share_input": "always"},
            "-perop": {"below_grad": False}, "-mode": {"carry": False}, "-single": {"group": False},
            "-triton": {"dispatch": "triton"}, "-addmm": {"dispatch": "addmm"}}
MANY = re.compile(r"-x(\d+)$")  # fastaf-autograd-x8: a stack of 8 adapters
CASE = ("model", "batch", "seq", "r", "adapters", "rounds")
FIGURES = ("ms", "p20", "p80", "max_mem_gib", "first_step_s")


def make_model(tiny: bool, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    size = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True) if tiny else {
        k: v for k, v in json.loads(CONFIG.read_text()).items() if k != "model_type"}
    torch.manual_seed(0)
    cfg = LlamaConfig(**size, max_position_embeddings=2048)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    return model.train().requires_grad_(False)


def _causal_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention with ``is_causal=True`` in place of the causal mask it builds.

    Under ``torch.compile`` before torch 2.14 transformers always materialises the causal mask
    (it cannot prove it away while tracing), and on CUDA torch's vmap rule for the fused SDPA
    kernels does not broadcast that unbatched (B, 1, T, T) mask over the vmapped dim ("expanded
    size (8) must match (2)", torch 2.11, with or without fastaf). The bench's sequences have no
    padding, so the mask is exactly causal.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)


def use_causal_sdpa(model) -> None:
    from transformers import AttentionInterface

    AttentionInterface.register("fastaf_bench_causal_sdpa", _causal_sdpa)
    model.set_attn_implementation("fastaf_bench_causal_sdpa")


def _lora_config() -> fa.LoRAConfig:
    return fa.LoRAConfig(r=RANK, alpha=ALPHA, targets=TARGETS)


def _adapter(model, adapters: int) -> fa.Adapter:
    """One adapter, or a stack of ``adapters`` (B = 0 in each: the first loss is the base's)."""
    if adapters == 1:
        return fa.init_adapter(model, _lora_config(), seed=0)
    return fa.stack([fa.init_adapter(model, _lora_config(), seed=i) for i in range(adapters)])


def base_step(model, ids, compiled: bool = False):
    emb = model.get_input_embeddings()(ids).detach().requires_grad_()
    run = torch.compile(model) if compiled else model

    def step():
        loss = run(inputs_embeds=emb, labels=ids).loss
        loss.backward()
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


def peft_step(model, ids, bf16: bool, compiled: bool = False):
    import peft

    cfg = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0)
    pm = peft.get_peft_model(copy.deepcopy(model), cfg, autocast_adapter_dtype=not bf16)
    trainable = [p for p in pm.parameters() if p.requires_grad]
    run = torch.compile(pm) if compiled else pm
    return _autograd_step(lambda: run(input_ids=ids, labels=ids).loss, trainable, ids.is_cuda)


def fastaf_func_step(model, ids, compiled: bool = False, adapters: int = 1):
    """``grad_and_value`` over the functional call, then AdamW; with a stack, ``vmap`` of it, adapter
    i on its own block of ``batch / adapters`` sequences."""
    leaves, spec = pytree.tree_flatten(_adapter(model, adapters))
    # The optimizer owns the fp32 master leaves; the adapter value is rebuilt from them each step.
    opt = torch.optim.AdamW(leaves, lr=LR, fused=ids.is_cuda)
    loss = lambda ad, i: fa.functional_call(model, ad, (), {"input_ids": i, "labels": i}).loss  # noqa: E731
    if adapters == 1:
        grad_fn = torch.func.grad_and_value(lambda ad: loss(ad, ids))
    else:
        per = ids.reshape(adapters, -1, ids.shape[-1])
        vmapped = torch.func.vmap(torch.func.grad_and_value(loss))
        grad_fn = lambda st: vmapped(st, per)  # noqa: E731
    grad_fn = torch.compile(grad_fn, fullgraph=True) if compiled else grad_fn

    def step():
        grads, value = grad_fn(pytree.tree_unflatten(leaves, spec))
        for p, g in zip(leaves, pytree.tree_leaves(grads)):
            p.grad = g.to(p.dtype)  # a no-op where the op returns fp32 masters' grads in fp32
        opt.step()
        opt.zero_grad(set_to_none=True)
        return value.mean()  # a stack's losses: each adapter's over its own sequences

    return step


def fastaf_autograd_step(model, ids, compiled: bool = False, adapters: int = 1):
    """The functional call differentiated by plain autograd on the adapter's leaves (compiled: the
    loss under ``torch.compile(fullgraph=True)``, its backward AOTAutograd's graph); with a stack,
    ``adapter_ids`` give adapter i its own block of ``batch / adapters`` sequences."""
    leaves, spec = pytree.tree_flatten(_adapter(model, adapters))
    leaves = [t.requires_grad_() for t in leaves]
    kw = {} if adapters == 1 else {
        "adapter_ids": torch.arange(adapters, device=ids.device).repeat_interleave(ids.shape[0] // adapters)}
    batch = {"input_ids": ids, "labels": ids}
    loss = lambda ls: fa.functional_call(model, pytree.tree_unflatten(ls, spec), (), batch, **kw).loss  # noqa: E731
    loss = torch.compile(loss, fullgraph=True) if compiled else loss
    return _autograd_step(lambda: loss(leaves), leaves, ids.is_cuda)


def fastaf_init_step(model, ids):
    m = fa.init(copy.deepcopy(model))
    m.add_new_adapter("a", _lora_config(), seed=0)
    m.set_active_adapter("a")
    trainable = [p for p in m.parameters() if p.requires_grad]
    return _autograd_step(lambda: m(input_ids=ids, labels=ids).loss, trainable, ids.is_cuda)


MAKERS = {
    "base": base_step, "base-compiled": lambda m, i: base_step(m, i, compiled=True),
    "base-func": base_func_step, "base-func-compiled": lambda m, i: base_func_step(m, i, compiled=True),
    "peft": lambda m, i: peft_step(m, i, bf16=False), "peft-bf16": lambda m, i: peft_step(m, i, bf16=True),
    "peft-bf16-compiled": lambda m, i: peft_step(m, i, bf16=True, compiled=True),
    "fastaf-init": fastaf_init_step,
    "base-liger": base_step, "peft-bf16-liger": lambda m, i: peft_step(m, i, bf16=True),
    "fastaf-init-liger": fastaf_init_step,
}
# the makers that also take a stack (``-x<G>``): (model, ids, adapters) -> step
MANY_MAKERS = {
    "fastaf-func": lambda m, i, n: fastaf_func_step(m, i, False, n),
    "fastaf-func-compiled": lambda m, i, n: fastaf_func_step(m, i, True, n),
    "fastaf-autograd": lambda m, i, n: fastaf_autograd_step(m, i, False, n),
    "fastaf-autograd-compiled": lambda m, i, n: fastaf_autograd_step(m, i, True, n),
    "fastaf-autograd-liger": lambda m, i, n: fastaf_autograd_step(m, i, False, n),
    "fastaf-func-liger": lambda m, i, n: fastaf_func_step(m, i, False, n),
}


def parse(name: str) -> tuple[str, int, str]:
    """'fastaf-func-compiled-x8-single' -> ('fastaf-func-compiled', 8, '-single'): the maker, the
    adapters trained at once, the switch suffix ('' for none)."""
    suffix = next((s for s in SWITCHES if name.startswith("fastaf") and name.endswith(s)), "")
    rest = name.removesuffix(suffix) if suffix else name
    many = MANY.search(rest)
    adapters = int(many.group(1)) if many else 1
    rest = MANY.sub("", rest)
    if rest not in MAKERS and rest not in MANY_MAKERS:
        raise SystemExit(f"unknown provider {name!r}; providers: {sorted(MAKERS) + sorted(MANY_MAKERS)}, "
                         f"a fastaf one with a switch suffix {sorted(SWITCHES)}, or -x<G> on {sorted(MANY_MAKERS)}")
    if adapters != 1 and rest not in MANY_MAKERS:
        raise SystemExit(f"{name}: -x<G> (a stack of G adapters) is for {sorted(MANY_MAKERS)}")
    return rest, adapters, suffix


def make_step(name: str, model, ids):
    base, adapters, suffix = parse(name)
    if adapters != 1 and ids.shape[0] % adapters:
        raise SystemExit(f"{name}: {ids.shape[0]} sequences do not split over {adapters} adapters")
    step = MANY_MAKERS[base](model, ids, adapters) if base in MANY_MAKERS else MAKERS[base](model, ids)
    if not suffix:
        return step

    def switched():
        with _config.override(**SWITCHES[suffix]):  # read per call, also by a compiled step's guards
            return step()

    return switched


def _wall_ms(step, n: int = 5) -> dict:
    """CPU smoke-test timing (do_bench needs a GPU): median of n wall-clock steps."""
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


def _label(row: dict) -> str:
    return row["provider"] + (f" x{row['adapters']}" if row["adapters"] > 1 else "")


def main() -> None:
    global LR
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model on any device (a smoke test)")
    ap.add_argument("--liger", action="store_true", help="patch Liger-Kernel in; run the -liger providers")
    ap.add_argument("--providers", default=None, help="comma-separated (default: all of this mode's): "
                    + ",".join(PROVIDERS) + "; --liger: " + ",".join(LIGER_PROVIDERS)
                    + "; also base-func-compiled, peft-bf16-compiled, -x<G> and switch suffixes (see the module docstring)")
    ap.add_argument("--name", default=None,
                    help="results file bench/results/<name>.csv (default e2e; --tiny: e2e-tiny)")
    ap.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                    help="build every provider first, then time them in ROUNDS interleaved rounds")
    ap.add_argument("--batch", type=int, default=8, help="sequences of 1024 tokens per step (default 8)")
    ap.add_argument("--profile", default="", metavar="PROVIDERS",
                    help="after timing, profile these providers' host and device time over 3 steps")
    ap.add_argument("--lr", type=float, default=LR, help="AdamW's learning rate (0: the adapter, and so every "
                    "step's data and the GPU's power draw, stay as at the first step)")
    args = ap.parse_args()
    LR = args.lr  # read by the step makers
    names = [n for n in (args.providers or ",".join(LIGER_PROVIDERS if args.liger else PROVIDERS)).split(",") if n]
    parsed = {n: parse(n) for n in names}  # unknown names fail before the model is built
    name = args.name or ("e2e-tiny" if args.tiny else "e2e")
    results = H.Results(name, CASE, FIGURES)  # a file with other columns fails here, before timing
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = make_model(args.tiny, device)
    model = _liger(model) if args.liger else model
    if any(a != 1 and b.startswith("fastaf-func") for b, a, _ in parsed.values()):
        use_causal_sdpa(model)
        print("a vmapped provider: every provider runs SDPA with is_causal=True", flush=True)
    batch, seq = (2, 64) if args.tiny else (args.batch, 1024)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0)).to(device)
    case = {"model": "tiny" if args.tiny else "llama-3.2-1b-shape", "batch": batch, "seq": seq, "r": RANK,
            "rounds": args.interleave}
    rows, base_loss, steps, profiled, losses = [], None, {}, {}, {}
    for pname in names:
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()  # each provider's own peak
        step = make_step(pname, model, ids)
        t0 = time.perf_counter()
        first = step().item()  # B = 0: every LoRA provider's first loss is the base loss
        first_s = round(time.perf_counter() - t0, 2)  # a compiled provider's compile time
        base_loss = first if base_loss is None else base_loss
        if abs(first - base_loss) > 1e-2 * abs(base_loss):
            raise SystemExit(f"{pname}: first-step loss {first:.4f} != base {base_loss:.4f}")
        if args.interleave:  # its peak is its first steps' (each holds its own state meanwhile)
            step()
            t = {}
        else:
            t = H.time_fn(step, warmup=300, rep=2000) if device == "cuda" else _wall_ms(step)
            losses[pname] = step().item()
        mem = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
        base, adapters, suffix = parsed[pname]
        # the CSV's provider drops -x<G> (the adapters column holds G) and keeps a switch suffix
        rows.append({"provider": base + suffix, **case, "adapters": 0 if pname.startswith("base") else adapters, **t,
                     "max_mem_gib": None if mem is None else round(mem, 2), "first_step_s": first_s})
        if t:
            print(f"{pname:24s} {t['ms']:8.2f} ms  (p20 {t['p20']:.2f}, p80 {t['p80']:.2f})  loss0 {first:.4f}"
                  f"  first step {first_s:.1f} s", flush=True)
        if args.interleave:
            steps[pname] = step
        if args.interleave or pname in args.profile.split(","):
            profiled[pname] = step
        else:
            del step
            torch.cuda.empty_cache() if device == "cuda" else None
    if args.interleave:
        timed = H.time_interleaved(steps, rounds=args.interleave, warmup=300, rep=2000 * args.interleave)
        for pname, r in zip(names, rows):
            rounds = timed[pname].pop("rounds")
            r.update(timed[pname])
            losses[pname] = steps[pname]().item()
            print(f"{pname:24s} {r['ms']:8.2f} ms  rounds {rounds}", flush=True)
    if args.profile:
        _profile({k: v for k, v in profiled.items() if k in args.profile.split(",")})
    # A step that went non-finite timed other work than a training step (NaN data draws less
    # power: on the H100 the clocks rose and compute-bound kernels ran 5-8% faster).
    broken = [p for p, loss in losses.items() if not math.isfinite(loss)]
    if broken:
        raise SystemExit(f"non-finite loss after timing (timings invalid, nothing written): {', '.join(broken)}")
    print(f"appended {len(rows)} rows to {results.append(rows)} (run {results.meta['run']})")
    print(H.ratio_table(rows, ("model", "batch", "seq", "r"), base="base-liger" if args.liger else "base",
                        label=_label))


if __name__ == "__main__":
    main()
