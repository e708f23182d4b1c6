"""Host time of one adapted layer's eager forward and backward, stage by stage (diagnostic).

    python bench/diag_layer_host.py [M K N r] [--layers 16] [--rounds 40]

A stack of ``--layers`` bias-free (N, K) linears (N == K) runs on x (M, K) bf16 that requires
grad, with a LoRA (fp32 master factors) on every layer. Each timed call starts from an idle GPU
(synchronize, then the host clock around the call: the launches are asynchronous, so that is
the call's host time). Rows, per layer, median of ``--rounds`` interleaved rounds:

- ``base``: the stack's own forward / ``backward(dy)``;
- ``functional_call``: ``fa.functional_call`` of the stack (carried weights), divided by layers;
- ``lora_linear``: the public op on one layer's tensors;
- ``_apply_direct``: the autograd Function, below the public op's checks;
- ``fwd_unchecked`` / ``bwd_unchecked``: the kernels' entry with graphs, no autograd;
- ``graphed``: ``_graphed_fwd`` / ``_graphed_bwd`` (allocations, key, replay);
- ``replay``: a captured graph's ``replay()`` alone.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.utils._pytree as pytree
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fastaf as fa  # noqa: E402
from fastaf.functional import _lora_linear as fl  # noqa: E402
from fastaf.kernels import _graphs  # noqa: E402
from fastaf.kernels import lora_linear as ll  # noqa: E402


def _host_us(fn, before=None) -> float:
    """Host microseconds of ``fn()`` from an idle GPU (``before()`` runs first, untimed)."""
    arg = before() if before is not None else None
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn() if arg is None else fn(arg)
    t1 = time.perf_counter()
    return (t1 - t0) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", nargs="*", type=int, default=[8192, 2048, 2048, 16])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--profile", action="store_true", help="then cProfile functional_call's fwd+bwd")
    args = ap.parse_args()
    M, K, N, R = args.shape
    assert N == K, "the stack chains its layers: N == K"
    dev, dt, L = "cuda", torch.bfloat16, args.layers
    torch.manual_seed(0)
    stack = nn.Sequential(*[nn.Linear(K, N, bias=False) for _ in range(L)]).to(dev, dt).requires_grad_(False)
    cfg = fa.LoRAConfig(r=R, alpha=2 * R, targets=["0"] if L == 1 else [str(i) for i in range(L)])
    adapter = fa.init_adapter(stack, cfg, seed=0)
    leaves, spec = pytree.tree_flatten(adapter)
    leaves = [(t + 0.01 * torch.randn_like(t)).requires_grad_() for t in leaves]  # B != 0
    adapter = pytree.tree_unflatten(leaves, spec)
    x = torch.randn(M, K, device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn(M, N, device=dev, dtype=dt)
    W = stack[0].weight
    lora = adapter["0"] if "0" in adapter else next(iter(adapter.values()))
    A, B, s = lora.A, lora.B, float(lora.scale)
    a_k, b_k = A.detach(), B.detach()

    def call():
        return fa.functional_call(stack, adapter, (x,))

    def one():
        return fa.functional.lora_linear(x, W, None, lora)

    def direct():
        return fl._apply_direct(0, x, W, None, A, B, s, 0.0, None, "auto")

    xd = x.detach()

    def unchecked():
        return ll.lora_linear_fwd_unchecked(xd, W, None, a_k, b_k, s, 0.0, None, "auto", graphed=True)

    def graphed():
        return ll._graphed_fwd(xd, W, None, a_k, b_k, s, 0.0, None, ())

    y0, h0 = unchecked()
    dy_plan, da_plan = ll._bwd_dy_plan(dy, b_k, h0, None), ll._bwd_da_plan(xd, R, False, None, None)

    def bwd_unchecked():
        return ll.lora_linear_bwd_unchecked(dy, xd, W, a_k, b_k, h0, s, 0.0, None, True, "auto",
                                            shared_grads=True, graphed=True)

    def bwd_graphed():
        return ll._graphed_bwd(dy, xd, W, a_k, b_k, h0, s, 0.0, None, True, dy_plan, da_plan)

    fwd_rows = {"base": (lambda: stack(x), L), "functional_call": (call, L), "lora_linear": (one, 1),
                "_apply_direct": (direct, 1), "fwd_unchecked": (unchecked, 1), "graphed": (graphed, 1)}
    bwd_rows = {"base": (lambda: stack(x), L), "functional_call": (call, L), "lora_linear": (one, 1),
                "_apply_direct": (direct, 1), "bwd_unchecked": (None, 1), "graphed": (None, 1)}
    for _ in range(4):  # graphs captured (third sighting) and warm
        for fn, _n in fwd_rows.values():
            y = fn()
            if y.requires_grad if isinstance(y, torch.Tensor) else False:
                y.backward(dy)
        bwd_unchecked(), bwd_graphed()
        for t in leaves:
            t.grad = None
        x.grad = None
    times = {f"fwd {k}": [] for k in fwd_rows} | {f"bwd {k}": [] for k in bwd_rows}
    graph = next(iter(_graphs.GRAPHS.graphs.values()))
    times["replay"] = []
    for _ in range(args.rounds):
        for name, (fn, n) in fwd_rows.items():
            times[f"fwd {name}"].append(_host_us(fn) / n)
        for name, (fn, n) in bwd_rows.items():
            if name == "bwd_unchecked":
                times[f"bwd {name}"].append(_host_us(bwd_unchecked))
            elif name == "graphed":
                times[f"bwd {name}"].append(_host_us(bwd_graphed))
            else:
                times[f"bwd {name}"].append(_host_us(lambda y: y.backward(dy), before=fn) / n)
            for t in leaves:
                t.grad = None
            x.grad = None
        times["replay"].append(_host_us(graph.replay))
    print(f"{torch.cuda.get_device_name()}: host us per layer, M={M} K={K} N={N} r={R}, {L} layers, "
          f"median (min) of {args.rounds} rounds; graphs: {len(_graphs.GRAPHS.graphs)} kept, "
          f"{_graphs.GRAPHS.replays} replays")
    for name, v in times.items():
        print(f"  {name:22s} {statistics.median(v):8.1f} ({min(v):7.1f})")
    if args.profile:
        import cProfile
        import pstats

        def steps():
            for _ in range(30):
                call().backward(dy)
                for t in leaves:
                    t.grad = None
                x.grad = None

        prof = cProfile.Profile()
        prof.runcall(steps)
        pstats.Stats(prof).sort_stats("tottime").print_stats(45)


if __name__ == "__main__":
    main()
