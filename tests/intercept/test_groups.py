"""Siblings run as one op at the first one's call (``_group``): learned from the calls, equal to
each layer alone (outputs, gradients, double backward), and given up where the guess fails (another
input, an input written in place, a layer between). Triton's interpreter on the CPU."""
from __future__ import annotations

import importlib
import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

import fastaf as fa
from fastaf import _config
from fastaf.intercept import groups as _group

from .._models import random_adapter, tiny_llama, token_batch
from .._modes import deterministic, needs_interpreter

_group_op = importlib.import_module("fastaf.ops.lora_group")  # the module, not its public function

DEVICES = [pytest.param("cpu", marks=needs_interpreter),
           pytest.param("cuda", marks=[pytest.mark.gpu,
                                       pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


def _alone(model, adapter, x: torch.Tensor) -> torch.Tensor:
    """The model's output under no_grad with every adapted layer its own op (the reference)."""
    with _config.override(group=False), torch.no_grad():
        return fa.functional_call(model, adapter, x, impl="triton")


def _steps(model, adapter, args: tuple, group: bool, steps: int = 3, create_graph: bool = False):
    """Per call: (output, gradients of the factors and of the float inputs)."""
    leaves, spec = pytree.tree_flatten(adapter)
    out = []
    with _config.override(group=group):
        for _ in range(steps):
            ls = [t.detach().clone().requires_grad_() for t in leaves]
            ins = [a.detach().clone().requires_grad_() if a.is_floating_point() else a for a in args]
            y = fa.functional_call(model, pytree.tree_unflatten(ls, spec), tuple(ins), impl="triton")
            y = y.logits if hasattr(y, "logits") else y
            wrt = ls + [a for a in ins if a.requires_grad]
            # allow_unused: a layer whose output is unused leaves its factors without a gradient
            grads = torch.autograd.grad(y.square().mean(), wrt, create_graph=create_graph, allow_unused=True)
            if create_graph:  # a second order: the gradient of the gradients' norm
                grads = torch.autograd.grad(sum(g.square().sum() for g in grads if g is not None), ls,
                                            allow_unused=True)
            out.append((y.detach(), [None if g is None else g.detach() for g in grads]))
    return out


def _assert_same(got, want, bf16: bool = False):
    tol = dict(rtol=2e-2, atol=2e-3) if bf16 else dict(rtol=1e-4, atol=1e-6)
    for (y, gs), (y_want, gs_want) in zip(got, want):
        torch.testing.assert_close(y, y_want, **tol)
        for g, w in zip(gs, gs_want):
            assert (g is None) == (w is None)
            if g is not None:
                torch.testing.assert_close(g, w, **tol)


@pytest.mark.parametrize("device", DEVICES)
def test_llama_groups_qkv_and_gate_up_and_equals_each_layer_alone(counted, device):
    """On the GPU in bf16 with launch graphs: the grouped steps replay like the single ones."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    # one layer on the CPU: the interpreter runs each slowly on CI
    model = tiny_llama(dtype=dtype, layers=1 if device == "cpu" else 2).to(device).requires_grad_(False)
    adapter = random_adapter(model, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    adapter = fa.Adapter({p: fa.LoRA(l.A.to(device), l.B.to(device), l.scale) for p, l in adapter.items()})
    ids = token_batch().to(device)
    want = _steps(model, adapter, (ids,), group=False)
    assert counted == {"fwd": 0, "bwd": 0} and not _group.learned()
    got = _steps(model, adapter, (ids,), group=True)
    _assert_same(got, want, bf16=device != "cpu")
    names = {m: n for n, m in model.named_modules()}
    learned = {names[k]: tuple(names[f] for f in v) for k, v in _group.learned().items()}
    layers = len(model.model.layers)
    assert learned == {**{f"model.layers.{i}.self_attn.q_proj": (f"model.layers.{i}.self_attn.k_proj",
                                                                 f"model.layers.{i}.self_attn.v_proj")
                          for i in range(layers)},
                       **{f"model.layers.{i}.mlp.gate_proj": (f"model.layers.{i}.mlp.up_proj",) for i in range(layers)}}
    # the first call learns; the next two run each layer's two groups as one op each way
    assert counted == {"fwd": 2 * 2 * layers, "bwd": 2 * 2 * layers}


class _Siblings(nn.Module):
    """q, k, v over one input; ``mode`` changes how k and v are called after the first calls."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v = nn.Linear(16, 24), nn.Linear(16, 8), nn.Linear(16, 8, bias=False)
        self.mode = "same"

    def forward(self, x):
        q = self.q(x)
        if self.mode == "other input":
            k = self.k(x * 2)
        elif self.mode == "written in place":
            x.mul_(2.0)  # a new version: the held k was made from the values before the write
            k = self.k(x)
        else:
            k = self.k(x)
        if self.mode == "v skipped":
            return torch.cat([q, k], -1)
        v = self.v(x)
        if self.mode == "v unused":
            return torch.cat([q, k], -1)
        return torch.cat([q, k, v], -1)


def _grouped_siblings(counted):
    """(model, adapter, x) after two grouped calls: q/k/v learned, then run as one op once."""
    model = _Siblings().requires_grad_(False)
    adapter = random_adapter(model, ["q", "k", "v"])
    x = torch.randn(2, 5, 16)
    _steps(model, adapter, (x,), group=True, steps=2)
    assert _group.learned() == {model.q: (model.k, model.v)} and counted["fwd"] == 1
    return model, adapter, x


@needs_interpreter
@pytest.mark.parametrize("mode", ["other input", "v skipped"])
def test_a_broken_group_computes_alone_and_its_leader_never_groups_again(counted, mode):
    """k on another input, or v never called: the next call groups once more (the guess), its
    members compute alone, and q leads no group again (no guess, fail, relearn cycle)."""
    model, adapter, x = _grouped_siblings(counted)
    model.mode = mode
    want = _steps(model, adapter, (x,), group=False, steps=1)
    _assert_same(_steps(model, adapter, (x,), group=True, steps=3), want * 3)
    assert counted["fwd"] == 2 and not _group.learned()


@needs_interpreter
def test_an_input_written_in_place_between_members_is_not_taken(counted):
    """Forward only: the model's write breaks its own backward (the input is saved) either way."""
    model, adapter, x = _grouped_siblings(counted)
    model.mode = "written in place"
    want = _alone(model, adapter, x.clone())
    with torch.no_grad():
        got = fa.functional_call(model, adapter, x.clone(), impl="triton")
    torch.testing.assert_close(got, want)
    # q's group is forgotten; k and v then ran one after the other on the written x: a group of theirs
    assert counted["fwd"] == 2 and _group.learned() == {model.k: (model.v,)}


@needs_interpreter
def test_an_unused_output_and_a_second_order(counted):
    model = _Siblings().requires_grad_(False)
    adapter = random_adapter(model, ["q", "k", "v"])
    x = torch.randn(2, 5, 16)
    model.mode = "v unused"
    got, want = _steps(model, adapter, (x,), group=True), _steps(model, adapter, (x,), group=False)
    _assert_same(got, want)
    assert got[-1][1][4] is None and got[-1][1][5] is None  # v's factors: no gradient, as alone
    assert counted["fwd"] == 2 and counted["bwd"] == 2  # v's output got no gradient: the group's backward ran
    model.mode = "same"
    want = _steps(model, adapter, (x,), group=False, create_graph=True)
    _assert_same(_steps(model, adapter, (x,), group=True, create_graph=True), want)


@needs_interpreter
def test_trainable_weights_and_dropout_run_each_layer_alone(counted):
    model = _Siblings()  # weights require grad: they get their own gradients from the single op
    adapter = random_adapter(model, ["q", "k", "v"])
    x = torch.randn(2, 5, 16)
    _steps(model, adapter, (x,), group=True)
    model.requires_grad_(False)
    dropped = fa.Adapter({p: fa.LoRA(l.A, l.B, l.scale, dropout=0.1) for p, l in adapter.items()})
    _steps(model, dropped, (x,), group=True)
    assert counted == {"fwd": 0, "bwd": 0}


@needs_interpreter
def test_gradient_checkpointing_recomputes_what_the_forward_ran(counted):
    """The first call learns the groups during its forward; its recompute (in its backward, after
    the call) must not group yet: a recompute that ran other ops raises a CheckpointError."""
    from fastaf.functional import checkpoint_context

    model = tiny_llama(layers=1).requires_grad_(False)
    adapter = random_adapter(model, ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"])
    want = _steps(model, adapter, (token_batch(),), group=False, steps=1)
    model.train()
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": checkpoint_context})
    try:
        got = _steps(model, adapter, (token_batch(),), group=True)
    finally:
        model.gradient_checkpointing_disable()
        model.eval()
    _assert_same(got, want * 3)
    layers = len(model.model.layers)
    assert counted["fwd"] == 2 * 2 * 2 * layers  # calls 2 and 3, their forward and recompute


@needs_interpreter
def test_a_follower_weight_written_between_the_calls_is_not_taken(counted):
    """A pre-hook writes k's weight (the same values each call, a new version): the output held since
    q's call was made before the write, so k computes alone, and the group's backward, which does
    not need k's weight then, does not raise for it."""
    model, adapter, x = _grouped_siblings(counted)
    doubled = model.k.weight.detach() * 2

    def write(module, args):
        module.weight.copy_(doubled)

    model.k.register_forward_pre_hook(write)
    want = _steps(model, adapter, (x,), group=False, steps=1)
    _assert_same(_steps(model, adapter, (x,), group=True, steps=2), want * 2)
    # q leads no group again; k (after its write) and v then ran one after the other: theirs,
    # grouped in the second call (k's write comes before k's own call: it leads)
    assert counted["fwd"] == 3 and _group.learned() == {model.k: (model.v,)}


@needs_interpreter
def test_inference_mode_runs_each_layer_alone(counted):
    """Inference tensors have no version counter: no group is taken or learned under inference_mode."""
    model, adapter, x = _grouped_siblings(counted)
    with torch.inference_mode():
        got = fa.functional_call(model, adapter, x.clone(), impl="triton")  # the layers' input: an inference tensor
    torch.testing.assert_close(got, _alone(model, adapter, x))
    assert counted["fwd"] == 1


@needs_interpreter
def test_learned_groups_do_not_keep_a_model_alive(counted):
    """A follower that refers to its model (a hook's closure) must not keep it alive through the
    learned groups."""
    import gc
    import weakref

    model, adapter, x = _grouped_siblings(counted)
    def refers_to_the_model(module, args, out):
        assert model.mode

    model.k.register_forward_hook(refers_to_the_model)
    _steps(model, adapter, (x,), group=True, steps=1)
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None and not _group.learned()


@needs_interpreter
def test_a_taken_follower_weight_written_before_backward_is_an_error_naming_it(counted):
    """As autograd does for a saved tensor: the group's backward needs k's weight as it was."""
    model, adapter, x = _grouped_siblings(counted)
    y = fa.functional_call(model, adapter, x.clone().requires_grad_(), impl="triton")
    with torch.no_grad():
        model.k.weight.mul_(1.0)
    with pytest.raises(RuntimeError, match=r"k: its frozen weight \(8, 16\) was modified by an inplace operation"):
        y.sum().backward()


@needs_interpreter
def test_deterministic_mode_never_groups_and_a_grouped_backward_turns_to_the_reference(counted):
    """The group's backward sums with fp32 atomics. Under torch's deterministic mode no group
    forms (the forward runs, each sibling alone, even with impl="triton" forced). A group formed
    before the mode was turned on alerts in its backward for the forced impl: strict, it raises;
    warn_only, it warns and computes the same gradients as each layer alone."""
    model = tiny_llama(layers=1).requires_grad_(False)
    adapter = random_adapter(model, ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"])
    ids = token_batch()
    want = _steps(model, adapter, (ids,), group=False, steps=1)
    _steps(model, adapter, (ids,), group=True, steps=1)  # learns the groups
    assert _group.learned()
    with deterministic(), torch.no_grad():  # grouping would probe the backward's dispatch: no alert
        fa.functional_call(model, adapter, ids, impl="triton")
    assert counted["fwd"] == 0
    leaves, spec = pytree.tree_flatten(adapter)
    ls = [t.detach().clone().requires_grad_() for t in leaves]
    with _config.override(group=True):
        y = fa.functional_call(model, pytree.tree_unflatten(ls, spec), ids, impl="triton").logits
    assert counted["fwd"] == 2 * len(model.model.layers)  # q/k/v and gate/up of each layer
    loss = y.square().mean()
    with deterministic(), pytest.raises(RuntimeError, match="grouped siblings' backward.*deterministic"):
        torch.autograd.grad(loss, ls, retain_graph=True)
    with deterministic(warn_only=True), pytest.warns(UserWarning, match="grouped siblings' backward"):
        grads = torch.autograd.grad(loss, ls)
    _assert_same([(y.detach(), list(grads))], want)


@needs_interpreter
def test_a_group_formed_under_auto_runs_its_backward_on_the_reference_in_deterministic_mode(counted, monkeypatch):
    """impl="auto" (grouped as on a GPU where the dispatch takes the Triton kernels: forced here on
    the CPU), deterministic mode turned on between the forward and the backward: no alert, the
    reference's ops instead of the group's kernels, the same gradients as each layer alone."""
    model = tiny_llama(layers=1).requires_grad_(False)
    adapter = random_adapter(model, ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"])
    ids = token_batch()
    want = _steps(model, adapter, (ids,), group=False, steps=1)
    monkeypatch.setattr(_group_op, "_use_triton", lambda impl, x: True)
    monkeypatch.setattr(_group_op._group_kernels(), "fits", lambda *args: True)
    leaves, spec = pytree.tree_flatten(adapter)
    for _ in range(2):  # the first call learns the groups, the second groups
        ls = [t.detach().clone().requires_grad_() for t in leaves]
        y = fa.functional_call(model, pytree.tree_unflatten(ls, spec), ids).logits
    assert counted["fwd"] == 2 * len(model.model.layers)
    loss = y.square().mean()
    with deterministic():
        grads = torch.autograd.grad(loss, ls)
    assert counted["bwd"] == 0  # the reference's ops, not the group's kernels
    _assert_same([(y.detach(), list(grads))], want)
