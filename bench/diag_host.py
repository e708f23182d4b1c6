"""Host time of an eager LoRA training step, forward and backward apart (BENCH.md's 1B shape).

    python bench/diag_host.py [--liger] [--tokens 1x128] [--steps 20]

An eager step is host-bound when its Python issues kernels slower than the GPU runs them. At a
few tokens the GPU's work is tiny, so the wall time of each phase is the host's own time for
it; at the full shape (8 x 1024) the same split shows which phase waits on the host. Per
provider and per phase (forward to the loss, ``loss.backward()``, optimizer), the median of
``--steps`` steps after a synchronize, in ms. Providers: the frozen model (``base``: backward to
the input embeddings, no optimizer), ``fastaf.functional_call`` with plain autograd
(``fastaf-autograd``), and PEFT with bf16 adapters (``peft-bf16``); ``--liger`` patches
Liger-Kernel in first, as bench_e2e.py's ``--liger`` does.

Diagnostics of the interception's share: ``pass-mode`` runs the base under a
``TorchFunctionMode`` that only forwards every call (the tax a mode spanning the call puts on
each torch call of the model), and a ``-mode`` suffix runs a fastaf provider with its mode over
the whole call instead of the weights carrying the adapter (``_call.CARRY = False``); any other
suffix of bench_e2e's (``-shared``: q/k/v and gate/up take their h from one pass over x) likewise.
``-cublas`` / ``-cublasfwd`` dispatch every adapted layer to cuBLAS instead of Triton, in forward
and backward / in forward only (``diag-host-cublas-*``: both cost more host time, not less);
``-nographs`` makes every launch (``fastaf.kernels._graphs`` off for its steps).
(``weight-subclass`` in the diag-carry results was a first prototype of the carrier, since removed.)
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
import torch.utils._pytree as pytree

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.bench_e2e import SUFFIXES, TARGETS, _flagged, _liger, make_model  # noqa: E402

import fastaf as fa  # noqa: E402
from fastaf.kernels import _graphs  # noqa: E402


class _PassMode(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


# ``-cublas`` / ``-cublasfwd``: the same provider with every adapted layer's kernels dispatched to
# cuBLAS (``impl`` "addmm" of fastaf.kernels: aten ops, no Triton launch), in forward and
# backward / in forward only: whether fewer host µs per layer pay for more GPU passes.
_CUBLAS = {"-cublas": ("fwd", "bwd"), "-cublasfwd": ("fwd",)}
_forced: tuple = ()
# ``-nographs``: the provider with every launch made (fastaf.kernels._graphs off), step by step
_NOGRAPHS = "-nographs"


def _force_cublas() -> None:
    """Route fastaf.kernels.lora_linear's dispatch through ``_forced`` (empty: as shipped)."""
    from fastaf.kernels import lora_linear

    shipped = lora_linear._choose

    def choose(impl, phase, x, M, K, N, R):
        return "addmm" if phase in _forced and impl == "auto" else shipped(impl, phase, x, M, K, N, R)

    lora_linear._choose = choose


def _phases(model, ids, provider: str):
    """(forward -> loss, params the optimizer steps or [])."""
    suffix = next((s for s in (*_CUBLAS, _NOGRAPHS) if provider.endswith(s)), None)
    if suffix is not None:  # providers alternate step by step: the phases are set per step (measure)
        return _phases(model, ids, provider.removesuffix(suffix))
    suffix = next((s for s in SUFFIXES if provider.startswith("fastaf") and provider.endswith(s)), None)
    if suffix is not None:  # the same provider with a flag of bench_e2e's SUFFIXES set around its forward
        forward, params = _phases(model, ids, provider.removesuffix(suffix))
        return _flagged(forward, *SUFFIXES[suffix]), params
    if provider == "base":
        emb = model.get_input_embeddings()(ids).detach().requires_grad_()
        return (lambda: model(inputs_embeds=emb, labels=ids).loss), []
    if provider == "pass-mode":
        emb = model.get_input_embeddings()(ids).detach().requires_grad_()

        def forward():
            with _PassMode():
                return model(inputs_embeds=emb, labels=ids).loss

        return forward, []
    if provider == "peft-bf16":
        import peft

        cfg = peft.LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, lora_dropout=0.0)
        pm = peft.get_peft_model(copy.deepcopy(model), cfg, autocast_adapter_dtype=False)
        return (lambda: pm(input_ids=ids, labels=ids).loss), [p for p in pm.parameters() if p.requires_grad]
    if provider == "fastaf-init":
        m = fa.init(copy.deepcopy(model))
        m.add_new_adapter("a", fa.LoRAConfig(r=16, alpha=32, targets=TARGETS), seed=0)
        m.set_active_adapter("a")
        return (lambda: m(input_ids=ids, labels=ids).loss), [p for p in m.parameters() if p.requires_grad]
    adapter = fa.init_adapter(model, fa.LoRAConfig(r=16, alpha=32, targets=TARGETS), seed=0)
    leaves, spec = pytree.tree_flatten(adapter)
    leaves = [t.requires_grad_() for t in leaves]
    batch = {"input_ids": ids, "labels": ids}
    return (lambda: fa.functional_call(model, pytree.tree_unflatten(leaves, spec), (), batch).loss), leaves


_PHASES = ("forward", "backward", "optimizer", "gpu_tail", "step", "fwd_cpu")


def _timed_step(forward, opt) -> tuple[float, ...]:
    """One step from an idle GPU: seconds of each phase (``_PHASES``), and the forward's CPU time
    (``fwd_cpu``: the process's, which a busy host's scheduling does not inflate as it does wall
    time; the forward of a LoRA step is host-bound, so this is its host cost)."""
    torch.cuda.synchronize()
    t0, c0 = time.perf_counter(), time.process_time()
    loss = forward()
    t1, c1 = time.perf_counter(), time.process_time()
    loss.backward()
    t2 = time.perf_counter()
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)
    t3 = time.perf_counter()
    torch.cuda.synchronize()
    t4 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0, c1 - c0


def measure(model, ids, providers: list[str], steps: int) -> dict[str, dict]:
    """Median ms per phase over ``steps`` steps of each provider, each started on an idle GPU.

    The providers alternate step by step (after 3 warm-up steps each: Triton compiles, the
    allocator settles), so a slow stretch of the host falls on all of them alike: on the H100
    machine a provider's median moved by up to 15 ms between two blocks of steps.
    """
    built = {}
    for name in providers:
        forward, params = _phases(model, ids, name)
        built[name] = (forward, torch.optim.AdamW(params, lr=1e-4, fused=ids.is_cuda) if params else None)
    rows: dict[str, list] = {name: [] for name in providers}
    global _forced
    if any(name.endswith(s) for name in providers for s in _CUBLAS):
        _force_cublas()
    for i in range(steps + 3):
        for name, (forward, opt) in built.items():
            _forced = next((v for s, v in _CUBLAS.items() if name.endswith(s)), ())
            _graphs.GRAPHS.enabled = not name.endswith(_NOGRAPHS)
            try:
                times = _timed_step(forward, opt)
            finally:
                _forced, _graphs.GRAPHS.enabled = (), True
            if i >= 3:
                rows[name].append(times)
    return {name: dict(zip(_PHASES, (sorted(col)[len(col) // 2] * 1e3 for col in zip(*r))))
            for name, r in rows.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--liger", action="store_true")
    ap.add_argument("--tokens", default="1x128", help="batch x seq (default 1x128: host-bound)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--providers", default="base,fastaf-autograd,peft-bf16")
    ap.add_argument("--profile", default="", metavar="PROVIDER",
                    help="then cProfile this provider's forward and backward apart (by cumulative time)")
    ap.add_argument("--top", type=int, default=45, help="rows of each profile")
    args = ap.parse_args()
    batch, seq = (int(v) for v in args.tokens.split("x"))
    model = make_model(False, "cuda")
    model = _liger(model) if args.liger else model
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0)).cuda()
    print(f"{'liger ' if args.liger else ''}{batch}x{seq} tokens: ms per phase (median of {args.steps} steps, "
          "providers alternating step by step)")
    print(f"  {'provider':16s} {'forward':>8s} {'backward':>9s} {'optim':>7s} {'gpu tail':>9s} {'step':>8s} "
          f"{'fwd cpu':>8s}")
    for name, r in measure(model, ids, args.providers.split(","), args.steps).items():
        print(f"  {name:16s} {r['forward']:8.2f} {r['backward']:9.2f} {r['optimizer']:7.2f} {r['gpu_tail']:9.2f} "
              f"{r['step']:8.2f} {r['fwd_cpu']:8.2f}", flush=True)
    g = _graphs.GRAPHS
    print(f"  launch graphs: {len(g.graphs)} kept, {g.captures} captured, {g.replays} replays, "
          f"enabled {g.enabled}", flush=True)
    if args.profile:
        profile(model, ids, args.profile, args.top)


def profile(model, ids, provider: str, top: int, steps: int = 5) -> None:
    """cProfile of ``steps`` forwards, then of their backwards, each sorted by cumulative time:
    which Python a phase's host time goes to (cProfile roughly doubles the cost of small calls)."""
    import cProfile
    import pstats

    forward, _ = _phases(model, ids, provider)
    for _ in range(3):
        forward().backward()
    fwd, bwd = cProfile.Profile(), cProfile.Profile()
    for _ in range(steps):
        torch.cuda.synchronize()
        fwd.enable()
        loss = forward()
        fwd.disable()
        bwd.enable()
        loss.backward()
        bwd.disable()
    for phase, prof in (("forward", fwd), ("backward", bwd)):
        print(f"== {provider} {phase}: {steps} steps", flush=True)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(top)
        pstats.Stats(prof).sort_stats("tottime").print_stats(top // 2)


if __name__ == "__main__":
    main()
