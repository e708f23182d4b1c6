"""Many adapters trained in one compiled step: ``torch.compile(vmap(grad_and_value))`` over a stack.

    python bench/bench_vmap_step.py [--adapters 4] [--name vmap-step] [--tiny --device cpu]

BENCH.md's Llama-3.2-1B shape, bf16, r=16 on q,k,v,o,gate,up,down, 8 x 1024 tokens per step in
every provider (timed interleaved in one process):
- one: ``torch.compile(grad_and_value(loss), fullgraph=True)``, one adapter over all 8 sequences,
  then AdamW (bench_e2e's ``fastaf-func-compiled``);
- vmap: ``torch.compile(vmap(grad_and_value(loss)), fullgraph=True)`` over a stack of G adapters,
  adapter i on its own 8 / G sequences, then AdamW on the stacked leaves;
- vmap-eager: the same ``vmap(grad_and_value)`` uncompiled.
Attention is SDPA with ``is_causal=True`` in every provider (``_causal_sdpa`` says why).
vmap / one is what training G adapters costs over training one on the same tokens. Each
provider's first call (compile included) is reported in seconds; before timing, vmap's losses and
gradients for adapter i are checked against an eager ``grad_and_value`` of adapter i on its
sequences, within twice what compiling costs one adapter without vmap (``check``).
Writes bench/results/<name>-<gpu>.json.
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
from bench.bench_e2e import LR, TARGETS, make_model  # noqa: E402

import fastaf as fa  # noqa: E402


def _optimized(grad_fn, adapter: fa.Adapter, cuda: bool):
    """A step: ``grad_fn(adapter value) -> (grads, loss)``, then fused AdamW on the fp32 leaves."""
    leaves, spec = pytree.tree_flatten(adapter)
    opt = torch.optim.AdamW(leaves, lr=LR, fused=cuda)

    def step():
        grads, loss = grad_fn(pytree.tree_unflatten(leaves, spec))
        for p, g in zip(leaves, pytree.tree_leaves(grads)):
            p.grad = g.to(p.dtype)  # a no-op where the op returns fp32 masters' grads in fp32
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def _causal_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention with ``is_causal=True`` in place of the causal mask it builds.

    Under ``torch.compile`` before torch 2.14 transformers always materialises the causal mask
    (it cannot prove it away while tracing), and on CUDA torch's vmap rule for the fused SDPA
    kernels does not broadcast that unbatched (B, 1, T, T) mask over the vmapped dim ("expanded
    size (8) must match (2)", torch 2.11, with or without fastaf). The bench's sequences have no
    padding, so the mask is exactly causal; every provider runs this same attention.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)


def causal_model(tiny: bool, device: str):
    """bench_e2e's model with ``_causal_sdpa`` as its attention."""
    from transformers import AttentionInterface

    AttentionInterface.register("fastaf_bench_causal_sdpa", _causal_sdpa)
    model = make_model(tiny=tiny, device=device)
    model.set_attn_implementation("fastaf_bench_causal_sdpa")
    return model


def _loss(model):
    return lambda ad, ids: fa.functional_call(model, ad, (), {"input_ids": ids, "labels": ids}).loss


def steps(model, ids: torch.Tensor, n: int) -> tuple[dict, fa.Adapter, dict]:
    """({provider: step} at ``ids`` (B, T) tokens in all, the stack the vmap providers train, and
    the compiled functions ``one`` and ``vmap`` run, for ``check``)."""
    cfg = fa.LoRAConfig(r=16, alpha=32, targets=TARGETS)
    loss = _loss(model)
    # B starts at zero (init_adapter): give it values so the check compares real gradients
    stack = fa.stack([fa.Adapter({p: fa.LoRA(l.A, torch.randn_like(l.B) * 1e-2, l.scale) for p, l in
                                  fa.init_adapter(model, cfg, seed=i).items()}) for i in range(n)])
    per = ids.reshape(n, -1, ids.shape[-1])
    vmapped = torch.func.vmap(torch.func.grad_and_value(loss))
    compiled = {"vmap": torch.compile(lambda st: vmapped(st, per), fullgraph=True),
                "one": torch.compile(torch.func.grad_and_value(lambda ad: loss(ad, ids)), fullgraph=True)}
    cuda = ids.is_cuda
    fns = {
        "one": _optimized(compiled["one"], pytree.tree_map(torch.clone, fa.unstack(stack)[0]), cuda),
        "vmap": _optimized(compiled["vmap"], stack, cuda),
        # its own copy: two optimizers must not step the same leaves between timed calls
        "vmap-eager": _optimized(lambda st: vmapped(st, per), pytree.tree_map(torch.clone, stack), cuda),
    }
    return fns, stack, compiled


def _rel_err(got: tuple, want: tuple) -> tuple[float, float]:
    """(relative error of the loss or of all gradients together, whichever is larger: the norm of
    the difference over the norm, over every leaf; the worst single leaf's) of (grads, loss)."""
    (g, v), (w, u) = got, want
    pairs = [(g[p].A, w[p].A) for p in w] + [(g[p].B, w[p].B) for p in w]
    diff = sum((a.float() - b.float()).square().sum() for a, b in pairs).sqrt()
    ref = sum(b.float().square().sum() for _, b in pairs).sqrt()
    return max(abs(v.item() - u.item()) / abs(u.item()), (diff / ref).item()), max(H.rel_err(a, b) for a, b in pairs)


def check(model, compiled: dict, ids: torch.Tensor, stack: fa.Adapter, n: int) -> dict:
    """Compiled against eager ``grad_and_value``, before any step: ``vmap`` per adapter on its own
    sequences (the worst adapter), and the floor, ``one`` on adapter 0 over all the sequences
    (compiled against eager without any vmap: bf16 through 16 layers, where Inductor's fusions
    round differently). Each error is ``_rel_err``'s pair; also each compile's seconds."""
    loss = _loss(model)
    per = ids.reshape(n, -1, ids.shape[-1])
    out = {}
    t0 = time.perf_counter()
    grads, losses = compiled["vmap"](stack)
    out["vmap_first_call_s"] = time.perf_counter() - t0
    errs = [_rel_err((pytree.tree_map(lambda t: t[i], grads), losses[i]),
                     torch.func.grad_and_value(loss)(fa.unstack(stack)[i], per[i])) for i in range(n)]
    out["vmap"] = max(errs)
    t0 = time.perf_counter()
    got = compiled["one"](fa.unstack(stack)[0])
    out["one_first_call_s"] = time.perf_counter() - t0
    out["one"] = _rel_err(got, torch.func.grad_and_value(loss)(fa.unstack(stack)[0], ids))
    return out


def _wall_ms(fn) -> float:
    """Best of three wall-clock milliseconds (CPU smoke runs; CUDA is timed by ``H.time_interleaved``)."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--name", default="vmap-step")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seq", type=int, default=0, help="tokens per sequence (default 1024; --tiny 64)")
    ap.add_argument("--rep", type=int, default=3000, help="ms of timing per provider")
    args = ap.parse_args()
    n = args.adapters
    model = causal_model(tiny=args.tiny, device=args.device)
    tokens = (8, args.seq or (64 if args.tiny else 1024))
    ids = torch.randint(0, model.config.vocab_size, tokens, device=args.device)
    fns, stack, compiled = steps(model, ids, n)
    checked = check(model, compiled, ids, stack, n)
    (err, leaf), (floor, floor_leaf) = checked["vmap"], checked["one"]
    print(f"compiled vs eager grad_and_value, loss and gradients: vmap per adapter rel err {err:.2e} "
          f"(worst leaf {leaf:.2e}); one adapter, no vmap {floor:.2e} (worst leaf {floor_leaf:.2e})", flush=True)
    assert err < max(2 * floor, 1e-2) and leaf < max(2 * floor_leaf, 1e-2), (err, floor, leaf, floor_leaf)
    first = {"vmap": checked["vmap_first_call_s"], "one": checked["one_first_call_s"]}
    for name, fn in fns.items():
        if name not in first:
            t0 = time.perf_counter()
            fn()
            first[name] = time.perf_counter() - t0
        print(f"  {name}: first call {first[name]:.1f} s", flush=True)
    if ids.is_cuda:
        times = H.time_interleaved(fns, rounds=3, warmup=3, rep=args.rep)
    else:
        times = {k: {"ms": _wall_ms(fn), "rounds": []} for k, fn in fns.items()}  # a smoke run
    one = times["one"]["ms"]
    rows = []
    for name, tm in times.items():
        print(f"  {name:11s} {tm['ms']:9.2f} ms  {tm['ms'] / one:5.2f}x one  rounds {tm['rounds']}", flush=True)
        rows.append({"bench": "vmap_step", "provider": name, "adapters": 1 if name == "one" else n,
                     "tokens": list(tokens), "r": 16, "dtype": "bfloat16", "first_call_s": first[name],
                     "vs_one": tm["ms"] / one, **tm})
    print("wrote", H.write_results(args.name, rows, {"check": checked, "tiny": args.tiny}))


if __name__ == "__main__":
    main()
