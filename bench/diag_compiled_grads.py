"""Do the compiled steps compute the gradients eager autograd computes, on the 1B shape?

    python bench/diag_compiled_grads.py [--batch 2]

BENCH.md's Llama-3.2-1B shape with random bf16 weights, an r=16 adapter on the 7 projections with
B random (so every dA is nonzero). Gradients of every adapter leaf from: eager autograd over
``fa.functional_call`` (bf16), ``torch.compile(torch.func.grad_and_value(loss), fullgraph=True)``
and ``torch.compile(loss, fullgraph=True)`` + autograd, each against an fp32 reference (the same
model and adapter in fp32, ``impl="torch"``). Prints each one's worst and median relative error
(Frobenius, over the 224 leaves), which leaves came out all zero or non-finite, and the launch
graphs so far, over three rounds: the compiled errors should sit where the eager bf16 step's do,
whichever step ran before.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch
import torch.utils._pytree as pytree

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import _harness as H  # noqa: E402
from bench import bench_e2e as E  # noqa: E402

import fastaf as fa  # noqa: E402
from fastaf.kernels import _graphs  # noqa: E402


def autograd_grads(loss_of, leaves: list) -> list:
    """Gradients of ``loss_of(leaves)`` with respect to fresh leaves holding ``leaves``' values."""
    leaves = [t.detach().requires_grad_() for t in leaves]
    return list(torch.autograd.grad(loss_of(leaves), leaves))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=2, help="sequences of 1024 tokens")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = E.make_model(False, "cuda")
    ids = torch.randint(0, model.config.vocab_size, (args.batch, 1024), device="cuda")
    batch = {"input_ids": ids, "labels": ids}
    ad = fa.init_adapter(model, fa.LoRAConfig(r=16, alpha=32, targets=E.TARGETS), seed=0)
    ad = ad.map(lambda p, l: fa.LoRA(l.A, torch.randn_like(l.B) * 0.01, l.scale))
    leaves, spec = pytree.tree_flatten(ad)

    def loss_of(m, impl="auto"):  # the adapter's leaves -> the loss
        return lambda ls: fa.functional_call(m, pytree.tree_unflatten(ls, spec), (), batch, impl=impl).loss

    model32 = copy.deepcopy(model).float()
    ref = autograd_grads(loss_of(model32, impl="torch"), [t.float() for t in leaves])
    del model32
    torch.cuda.empty_cache()
    func = torch.compile(torch.func.grad_and_value(lambda a: fa.functional_call(model, a, (), batch).loss),
                         fullgraph=True)
    auto = torch.compile(loss_of(model), fullgraph=True)
    runs = {"eager autograd (bf16)": lambda: autograd_grads(loss_of(model), leaves),
            "compiled grad_and_value": lambda: pytree.tree_leaves(func(pytree.tree_unflatten(leaves, spec))[0]),
            "compiled forward + autograd": lambda: autograd_grads(auto, leaves)}
    for step in range(3):  # later rounds run the compiled code without tracing, each after the others
        for name, run in runs.items():
            g = run()
            errs = [H.rel_err(t, r) for t, r in zip(g, ref)]
            zero = sum(int(t.abs().max() == 0) for t in g)
            bad = [i for i, t in enumerate(g) if not torch.isfinite(t).all()]
            finite = [e for i, e in enumerate(errs) if i not in bad]
            print(f"#{step} {name:28s} rel err vs fp32: worst {max(finite):.2e}, median {statistics.median(finite):.2e};"
                  f" all-zero leaves {zero}/{len(g)}, non-finite leaves {bad}; launch graphs captured"
                  f" {_graphs.GRAPHS.captures}, replays {_graphs.GRAPHS.replays}", flush=True)


if __name__ == "__main__":
    main()
