"""Eager calls whose targeted weights carry the adapter (``_carrier``) against the mode over the
whole call (``CARRY = False``): the same outputs and gradients on every architecture, the model
left as it was, threads and nested calls apart, and the mode kept where only it is exact."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.utils._pytree as pytree

import fastaf as fa
from fastaf.functional import _call, _carrier

from .._models import ARCHS, MODELS, logits, random_adapter, tiny_gpt2, tiny_llama, token_batch

_CASES = {**{k: (f, t, None) for k, (f, t) in MODELS.items()}, **ARCHS}


def _inputs(name: str) -> dict:
    make = _CASES[name][2]
    return {"input_ids": token_batch()} if make is None else make()


def _loss_and_grads(model, adapter, inputs: dict):
    leaves, spec = pytree.tree_flatten(adapter)
    leaves = [t.detach().requires_grad_() for t in leaves]
    out = logits(fa.functional_call(model, pytree.tree_unflatten(leaves, spec), (), inputs))
    loss = out.float().square().mean()
    # allow_unused: LLaVA's last vision layer feeds no output (the features come from the one before)
    return out.detach(), torch.autograd.grad(loss, leaves, allow_unused=True)


@pytest.mark.parametrize("name", sorted(_CASES))
def test_carried_call_matches_the_mode_on_every_architecture(name, monkeypatch):
    make, targets, _ = _CASES[name]
    model = make(seed=0)
    adapter = random_adapter(model, targets)
    inputs = _inputs(name)
    params = {k: v for k, v in model.named_parameters()}
    monkeypatch.setattr(_call, "CARRY", False)
    want_out, want_grads = _loss_and_grads(model, adapter, inputs)
    monkeypatch.setattr(_call, "CARRY", True)
    got_out, got_grads = _loss_and_grads(model, adapter, inputs)
    torch.testing.assert_close(got_out, want_out)
    assert [g is None for g in got_grads] == [w is None for w in want_grads]
    for g, w in zip(got_grads, want_grads):
        if w is not None:
            torch.testing.assert_close(g, w)  # the same op calls (MoE routing sums in any order)
    assert all(v is params[k] for k, v in model.named_parameters())  # the same parameter objects


class _Probe(torch.nn.Module):
    """Records, while it runs, the mode stack's depth and the type of a weight it reads."""

    def __init__(self, inner: torch.nn.Module, weight_of: torch.nn.Module):
        super().__init__()
        self.inner, self.weight_of, self.seen = inner, weight_of, []

    def forward(self, x):
        self.seen.append((torch._C._len_torch_function_stack(), type(self.weight_of.weight)))
        return self.inner(x)


def test_an_eligible_eager_call_enters_no_mode_and_a_stacked_one_does():
    lin = torch.nn.Linear(6, 5)
    model = _Probe(torch.nn.Sequential(lin), lin)
    lora = fa.LoRA(torch.randn(2, 6), torch.randn(5, 2), 0.5)
    x = torch.randn(3, 6)
    got = fa.functional_call(model, fa.Adapter({"inner.0": lora}), (x,))
    torch.testing.assert_close(got, lin(x) + 0.5 * (x @ lora.A.T) @ lora.B.T)
    assert model.seen[-1] == (0, _carrier.Carrier)
    assert type(lin.weight) is torch.nn.Parameter  # put back
    stack = fa.stack([fa.Adapter({"inner.0": lora})] * 2)
    fa.functional_call(model, stack, (x,), adapter_ids=torch.tensor([0, 1, -1]))
    assert model.seen[-1] == (1, torch.nn.Parameter)  # adapter_ids: the mode's job


def test_a_raising_carried_call_puts_every_weight_back():
    model = tiny_llama()
    adapter = random_adapter(model, ["q_proj", "v_proj"])
    before = dict(model.named_parameters())
    with pytest.raises(IndexError):
        fa.functional_call(model, adapter, (torch.full((1, 4), 10_000),))  # ids past the vocabulary
    assert all(v is before[k] and type(v) is torch.nn.Parameter for k, v in model.named_parameters())
    with torch.no_grad():
        ids = token_batch()
        torch.testing.assert_close(fa.functional_call(model, None, (ids,)).logits, model(ids).logits)


def test_concurrent_carried_calls_in_two_threads_each_get_their_own_adapter():
    model = tiny_llama()
    adapters = [random_adapter(model, ["q_proj", "v_proj", "down_proj"], seed=s) for s in (0, 5)]
    ids = token_batch()
    with torch.no_grad():
        want = [fa.functional_call(model, a, (ids,)).logits for a in adapters]
    results: dict[int, list[bool]] = {0: [], 1: []}
    start = threading.Barrier(2)

    def calls(i: int) -> None:
        start.wait()
        with torch.no_grad():
            for _ in range(6):
                results[i].append(torch.equal(fa.functional_call(model, adapters[i], (ids,)).logits, want[i]))

    threads = [threading.Thread(target=calls, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results[0] and all(results[0]) and results[1] and all(results[1])
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())


class _Nested(torch.nn.Module):
    """Calls ``functional_call`` on its own child with another adapter, inside an outer call."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(6, 6)
        self.inner_adapter = None

    def forward(self, x):
        inner = fa.functional_call(self.proj, self.inner_adapter, (x,))
        return self.proj(inner)


def test_a_nested_call_adapts_with_its_own_adapter_then_the_outer_one_resumes():
    model = _Nested()
    outer, inner = (fa.LoRA(torch.randn(2, 6), torch.randn(6, 2), 0.5) for _ in range(2))
    model.inner_adapter = fa.Adapter({"": inner})
    x = torch.randn(3, 6)
    got = fa.functional_call(model, fa.Adapter({"proj": outer}), (x,))
    W, b = model.proj.weight, model.proj.bias

    def lin(v, lo):
        return v @ W.T + b + lo.scale * (v @ lo.A.T) @ lo.B.T

    torch.testing.assert_close(got, lin(lin(x, inner), outer))
    assert type(model.proj.weight) is torch.nn.Parameter


def test_gradient_checkpointing_recomputes_a_carried_call_with_its_adapter():
    from fastaf.functional import checkpoint_context

    model = tiny_llama()
    adapter = random_adapter(model, ["q_proj", "v_proj", "up_proj"])
    inputs = {"input_ids": token_batch()}
    model.train()
    want_out, want_grads = _loss_and_grads(model, adapter, inputs)
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": checkpoint_context})
    try:
        got_out, got_grads = _loss_and_grads(model, adapter, inputs)
    finally:
        model.gradient_checkpointing_disable()
    torch.testing.assert_close(got_out, want_out)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w)


def test_conv1d_weights_carry_their_adapter_through_addmm():
    model = tiny_gpt2()
    adapter = random_adapter(model, ["c_attn", "c_fc"])
    ids = token_batch()
    with torch.no_grad():
        got = fa.functional_call(model, adapter, (ids,)).logits
        merged = fa.functional_call(model, None, (ids,), params=fa.merge_into(model, adapter)).logits
    torch.testing.assert_close(got, merged, rtol=1e-5, atol=1e-5)
