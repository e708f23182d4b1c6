"""Eager autograd over fa.functional_call, repeated on the 1B shape: are later calls' gradients
finite and equal to the first's? (launch graphs capture at a key's third sighting)."""
import sys
from pathlib import Path

import torch
import torch.utils._pytree as pytree

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import bench_e2e as E  # noqa: E402

import fastaf as fa  # noqa: E402
from fastaf.kernels import _graphs  # noqa: E402

torch.manual_seed(0)
model = E.make_model(False, "cuda")
ids = torch.randint(0, model.config.vocab_size, (2, 1024), device="cuda")
batch = {"input_ids": ids, "labels": ids}
ad = fa.init_adapter(model, fa.LoRAConfig(r=16, alpha=32, targets=E.TARGETS), seed=0)
ad = ad.map(lambda p, l: fa.LoRA(l.A, torch.randn_like(l.B) * 0.01, l.scale))
paths_leaves, spec = pytree.tree_flatten_with_path(ad)
names = [pytree.keystr(p) for p, _ in paths_leaves]
leaves = [t for _, t in paths_leaves]


def eager():
    ls = [t.detach().requires_grad_() for t in leaves]
    return list(torch.autograd.grad(fa.functional_call(model, pytree.tree_unflatten(ls, spec), (), batch).loss, ls))


func = torch.compile(torch.func.grad_and_value(lambda a: fa.functional_call(model, a, (), batch).loss), fullgraph=True)
first = eager()
for i in range(8):
    if i == 4:
        func(pytree.tree_unflatten(leaves, spec))
        print("  (a compiled grad_and_value call)")
    g = eager()
    bad = [n for n, t in zip(names, g) if not torch.isfinite(t).all()]
    diff = max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(g, first))
    print(f"eager #{i + 1}: non-finite leaves {len(bad)} {bad[:4]}, max rel diff to #0 {diff:.2e}, "
          f"graphs captured {_graphs.GRAPHS.captures} replays {_graphs.GRAPHS.replays}", flush=True)
