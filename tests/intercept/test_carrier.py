"""Eager calls whose targeted weights carry the adapter (``_carrier``) against the mode over the
whole call (``CARRY = False``): the same outputs and gradients on every architecture, the model
left as it was, threads and nested calls apart, and the mode kept where only it is exact."""
from __future__ import annotations

import threading
import warnings

import pytest
import torch
import torch.utils._pytree as pytree

import fastaf as fa
from fastaf.intercept import carrier as _carrier, mode as _mode

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
def test_carried_call_matches_the_mode_on_every_architecture(name, monkeypatch, set_flags):
    make, targets, _ = _CASES[name]
    model = make(seed=0)
    adapter = random_adapter(model, targets)
    inputs = _inputs(name)
    params = {k: v for k, v in model.named_parameters()}
    set_flags(carry=False)
    want_out, want_grads = _loss_and_grads(model, adapter, inputs)
    set_flags(carry=True)
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


def test_an_eligible_eager_call_enters_no_mode_nor_does_a_stacked_one():
    lin = torch.nn.Linear(6, 5)
    model = _Probe(torch.nn.Sequential(lin), lin)
    lora = fa.LoRA(torch.randn(2, 6), torch.randn(5, 2), 0.5)
    x = torch.randn(3, 6)
    got = fa.functional_call(model, fa.Adapter({"inner.0": lora}), (x,))
    torch.testing.assert_close(got, lin(x) + 0.5 * (x @ lora.A.T) @ lora.B.T)
    assert model.seen[-1] == (0, _carrier.Carrier)
    assert type(lin.weight) is torch.nn.Parameter  # put back
    other = fa.LoRA(torch.randn(2, 6), torch.randn(5, 2), 0.5)
    stack = fa.stack([fa.Adapter({"inner.0": lora}), fa.Adapter({"inner.0": other})])
    got = fa.functional_call(model, stack, (x,), adapter_ids=torch.tensor([0, 1, -1]))
    assert model.seen[-1] == (0, _carrier.Carrier)  # adapter_ids too: the op reads them from the call's mode
    for i, lo in enumerate((lora, other, None)):  # row i with slot i, the last with none
        want = lin(x[i]) if lo is None else lin(x[i]) + 0.5 * (x[i] @ lo.A.T) @ lo.B.T
        torch.testing.assert_close(got[i], want)


def test_a_raising_carried_call_puts_every_weight_back():
    model = tiny_llama()
    adapter = random_adapter(model, ["q_proj", "v_proj"])
    before = dict(model.named_parameters())
    with pytest.raises(IndexError):
        fa.functional_call(model, adapter, (torch.full((1, 4), 10_000),))  # ids past the vocabulary
    assert all(v is before[k] and type(v) is torch.nn.Parameter for k, v in model.named_parameters())
    assert not any("forward" in m.__dict__ for m in model.modules())
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


def _tied_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, attn_implementation="eager", tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


@pytest.mark.parametrize("carry", [True, False], ids=["carried", "mode"])
def test_a_targeted_lm_head_tied_to_the_embedding_adapts_the_head_alone(carry, monkeypatch, set_flags):
    """As PEFT does: the embedding reads the tied weight unadapted, also where a use no rule
    fuses would fold W + ΔW (F.embedding), also under LoRA dropout; params= follows the tie."""
    set_flags(carry=carry)
    model = _tied_llama()
    ad = random_adapter(model, ["lm_head"])
    ids = token_batch()
    E = model.model.embed_tokens.weight
    with torch.no_grad():
        head = fa.merge_into({"lm_head.weight": E}, ad, model=model)["lm_head.weight"]
        want = torch.func.functional_call(model, {"model.embed_tokens.weight": E, "lm_head.weight": head}, (ids,),
                                          tie_weights=False).logits
        torch.testing.assert_close(fa.functional_call(model, ad, (ids,)).logits, want)
        new_e = torch.randn_like(E)
        got = fa.functional_call(model, ad, (ids,), params={"model.embed_tokens.weight": new_e}).logits
        new_head = fa.merge_into({"lm_head.weight": new_e}, ad, model=model)["lm_head.weight"]
        want = torch.func.functional_call(model, {"model.embed_tokens.weight": new_e, "lm_head.weight": new_head},
                                          (ids,), tie_weights=False).logits
        torch.testing.assert_close(got, want)
    model.train()
    fa.functional_call(model, random_adapter(model, ["lm_head"], dropout=0.1), (ids,))  # no fold, no error
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_an_interrupt_while_carriers_are_installed_leaves_the_model_plain(monkeypatch):
    model = tiny_llama()
    adapter = random_adapter(model, ["q_proj", "v_proj"])
    ids = token_batch()
    with torch.no_grad():
        plain = model(ids).logits
    real_of, count = _carrier.Carrier.of, {"n": 0}

    def interrupted_of(raw):
        count["n"] += 1
        if count["n"] == 3:  # mid-install: two weights already swapped
            raise KeyboardInterrupt
        return real_of(raw)

    monkeypatch.setattr(_carrier.Carrier, "of", staticmethod(interrupted_of))
    with pytest.raises(KeyboardInterrupt):
        fa.functional_call(model, adapter, (ids,))
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    assert not any("forward" in m.__dict__ for m in model.modules())  # no layer keeps a forward of ours
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain, rtol=0, atol=0)


class _StatThenEinsum(torch.nn.Linear):
    """Reads a statistic of its weight under no_grad, then computes through einsum."""

    def forward(self, x):
        with torch.no_grad():
            s = self.weight.abs().mean()
        return torch.einsum("...k,nk->...n", x, self.weight) / s + self.bias


class _InsideFunction(torch.nn.Linear):
    """Hands its weight to a custom Function (a kernel wrapper): no gradient leaves through it."""

    class _Matmul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            return x @ w.contiguous().T

        @staticmethod
        def backward(ctx, g):
            return None, None

    def forward(self, x):
        return self._Matmul.apply(x, self.weight)


@pytest.mark.parametrize("carry", [True, False], ids=["carried", "mode"])
def test_folds_without_grad_are_exact_and_a_fold_no_gradient_can_leave_is_an_error(carry, monkeypatch, set_flags):
    set_flags(carry=carry)
    x = torch.randn(3, 6)
    model = torch.nn.Sequential(_StatThenEinsum(6, 5))
    ad = random_adapter(model, ["0"])
    leaves, spec = pytree.tree_flatten(ad)
    leaves = [t.detach().requires_grad_() for t in leaves]
    ad = pytree.tree_unflatten(leaves, spec)
    got = fa.functional_call(model, ad, (x,))
    merged = fa.merge_into(model, ad)
    want = torch.func.functional_call(model, merged, (x,))
    torch.testing.assert_close(got, want)
    for g, w in zip(torch.autograd.grad(got.sum(), leaves), torch.autograd.grad(want.sum(), leaves)):
        torch.testing.assert_close(g, w)
    with torch.no_grad():  # the whole call without grad: the folds are the adapted outputs
        torch.testing.assert_close(fa.functional_call(model, ad, (x,)), want.detach())
    model = torch.nn.Sequential(_InsideFunction(6, 5))
    with pytest.raises(ValueError, match=r"0 \(_InsideFunction\) used its weight 1 time\(s\) only with grad disabled"):
        fa.functional_call(model, random_adapter(model, ["0"]).map(
            lambda p, l: fa.LoRA(l.A.requires_grad_(), l.B.requires_grad_(), l.scale)), (x,))


@pytest.mark.parametrize("carry", [True, False], ids=["carried", "mode"])
def test_value_free_and_identity_uses_neither_fold_nor_count(carry, monkeypatch, set_flags):
    """empty_like(W) reads no values (a module computing on W.detach() stays an error), and
    W.to(W.dtype) is W itself: the rule after it fuses, also under LoRA dropout."""
    set_flags(carry=carry)

    class Workspace(torch.nn.Linear):
        def forward(self, x):
            buf = torch.empty_like(self.weight)
            buf.copy_(self.weight.detach())
            return torch.nn.functional.linear(x, buf, self.bias)

    class Cast(torch.nn.Linear):
        def forward(self, x):
            return torch.nn.functional.linear(x, self.weight.to(x.dtype), self.bias)

    x = torch.randn(3, 6)
    ws = torch.nn.Sequential(Workspace(6, 5))
    with pytest.raises(ValueError, match="silently lost"):
        fa.functional_call(ws, random_adapter(ws, ["0"]), (x,))
    cast = torch.nn.Sequential(Cast(6, 5)).train().requires_grad_(False)
    lora = random_adapter(cast, ["0"], dropout=0.1)
    _mode._warned_folds.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fold warning, no dropout error: the fused op ran
        fa.functional_call(cast, lora, (x,))


class _Recorded(torch.nn.Module):
    """Records, while it runs, whether each given module has a forward of its own set."""

    def __init__(self, inner: torch.nn.Module, *watched: torch.nn.Module):
        super().__init__()
        self.inner, self.watched, self.seen = inner, watched, []

    def forward(self, x):
        self.seen.append(["forward" in m.__dict__ for m in self.watched])
        return self.inner(x)


class _Scaled(torch.nn.Linear):
    """A Linear subclass with a forward of its own: never given the carrier's forward."""

    def forward(self, x):
        return 2.0 * super().forward(x)


def _dispatches(monkeypatch) -> list:
    """Every torch function the carriers' ``__torch_function__`` is handed, from now on."""
    seen, shipped = [], _carrier._Carries.__torch_function__.__func__

    def counting(cls, func, types, args=(), kwargs=None):
        seen.append(func)
        return shipped(cls, func, types, args, kwargs)

    monkeypatch.setattr(_carrier._Carries, "__torch_function__", classmethod(counting))
    return seen


def test_a_carried_nn_linear_hands_its_input_to_the_op_without_the_carriers_dispatch(monkeypatch):
    lin, sub, own = torch.nn.Linear(6, 6), _Scaled(6, 6), torch.nn.Linear(6, 6)
    own_forward = own.forward  # an instance forward already set (as accelerate's hooks do)
    own.forward = lambda x: own_forward(x) + 1.0
    model = _Recorded(torch.nn.Sequential(lin, sub, own), lin, sub, own)
    loras = {p: fa.LoRA(torch.randn(2, 6), torch.randn(6, 2), 0.5) for p in ("inner.0", "inner.1", "inner.2")}
    x = torch.randn(3, 6)
    seen = _dispatches(monkeypatch)
    got = fa.functional_call(model, fa.Adapter(loras), (x,))

    def adapted(m, lo, v):
        return torch.nn.functional.linear(v, m.weight, m.bias) + lo.scale * (v @ lo.A.T) @ lo.B.T

    want = adapted(own, loras["inner.2"], 2.0 * adapted(sub, loras["inner.1"], adapted(lin, loras["inner.0"], x))) + 1.0
    torch.testing.assert_close(got, want)
    assert model.seen == [[True, False, True]]  # own: its own forward, kept
    # nn.Linear took no dispatch; the subclass and the instance forward went through the carrier
    assert seen.count(torch.nn.functional.linear) == 2
    assert "forward" not in lin.__dict__ and "forward" not in sub.__dict__ and own.forward(x) is not None
    assert own.__dict__["forward"] is not None and type(lin.weight) is torch.nn.Parameter


class _SeesLinear(torch.overrides.TorchFunctionMode):
    """A user's torch function mode: counts the F.linear calls on a carried weight it is shown."""

    def __init__(self) -> None:
        super().__init__()
        self.linears = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.linears += func is torch.nn.functional.linear and type(args[1]) is _carrier.Carrier
        return func(*args, **(kwargs or {}))


def test_a_torch_function_mode_inside_the_call_still_sees_every_adapted_linear():
    model = tiny_llama()
    adapter = random_adapter(model, ["q_proj", "v_proj", "down_proj"])
    ids = token_batch()
    with torch.no_grad():
        want = fa.functional_call(model, adapter, (ids,)).logits
        with _SeesLinear() as mode:
            got = fa.functional_call(model, adapter, (ids,)).logits
    torch.testing.assert_close(got, want)
    assert mode.linears == 3 * len(model.model.layers)  # each adapted layer's F.linear, shown to the user's mode


def test_carried_nn_linears_in_threads_and_nested_calls_keep_their_own_adapters():
    """The forward set on a shared layer serves each thread's innermost call, as the carrier does."""
    model = _Nested()
    outer, inner = (fa.LoRA(torch.randn(2, 6), torch.randn(6, 2), 0.5) for _ in range(2))
    model.inner_adapter = fa.Adapter({"": inner})
    x = torch.randn(3, 6)
    W, b = model.proj.weight, model.proj.bias
    plain = torch.nn.functional.linear(x, W, b)
    seen = []

    def other_thread():  # a plain call of the layer while another thread's call carries its weight
        seen.append(torch.equal(model.proj(x), plain))

    class _Spy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, v):
            t = threading.Thread(target=other_thread)
            t.start()
            t.join()
            return self.model(v)

    with torch.no_grad():
        got = fa.functional_call(_Spy(), fa.Adapter({"model.proj": outer}), (x,))

    def lin(v, lo):
        return v @ W.T + b + lo.scale * (v @ lo.A.T) @ lo.B.T

    torch.testing.assert_close(got, lin(lin(x, inner), outer))
    assert seen == [True] and "forward" not in model.proj.__dict__
