"""A model's routes for an adapter resolved again (``routes.resolve_routes``): the same adapter on
the same model reuses its last resolution, and any change of the model's modules or weights since
is seen as on a first call: outputs against a fresh resolution, errors naming the path."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fastaf as fa
from fastaf.intercept import routes as _routes

from .._models import random_adapter, tiny_llama, token_batch


def _fresh(model, adapter, x):
    """The call with nothing kept from before."""
    _routes._resolved.pop(model, None)
    return fa.functional_call(model, adapter, (x,)).logits


def test_the_same_adapter_again_reuses_its_resolution_and_gives_the_same_output(monkeypatch):
    model = tiny_llama().eval()
    adapter = random_adapter(model, ["q_proj", "v_proj", "down_proj"], r=4, seed=1)
    x = token_batch()
    with torch.no_grad():
        first = fa.functional_call(model, adapter, (x,)).logits
        resolved = []
        monkeypatch.setattr(_routes, "_resolve", lambda *a: resolved.append(a[1]) or (_ for _ in ()).throw(AssertionError))
        again = fa.functional_call(model, adapter, (x,)).logits  # no path resolved anew
        assert torch.equal(again, first) and not resolved
        other = random_adapter(model, ["q_proj", "v_proj", "down_proj"], r=4, seed=2)
        with pytest.raises(AssertionError):  # another adapter: resolved from scratch
            fa.functional_call(model, other, (x,))


def _fields(routes):
    """Each route's fields, siblings by path, in order."""
    return [(r.path, r.module, r.weight, r.lora, r.spec, r.name, r.branch, r.tied, r.hits, r.calls, r.gradless,
             r.merged, tuple(s.path for s in r.siblings)) for r in routes.values()]


def test_routes_made_again_equal_a_fresh_resolution_field_by_field():
    # the reused resolution copies each route's fields and links its siblings by place: the same
    # routes as from scratch, fresh ones (a call's counts never leak into the next), and a tied
    # embedding still marked
    model = tiny_llama().eval()
    model.lm_head.weight = model.model.embed_tokens.weight  # tied: the embedding's reads stay the base's
    adapter = random_adapter(model, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                                     "lm_head"], r=4, seed=1)
    _routes._resolved.pop(model, None)
    first = _routes.resolve_routes(model, adapter, {})
    for route in first.values():
        route.hits, route.calls = 3, 2  # a call's counts
    again = _routes.resolve_routes(model, adapter, {})
    _routes._resolved.pop(model, None)
    fresh = _routes.resolve_routes(model, adapter, {})
    assert _fields(again) == _fields(fresh)
    assert all(a is not b for a, b in zip(again.values(), first.values()))
    q = next(r for r in again.values() if r.path.endswith("0.self_attn.q_proj"))
    assert {s.path.rpartition(".")[2] for s in q.siblings} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert all(any(s is r for r in again.values()) and s.siblings is q.siblings for s in q.siblings)  # this call's
    assert [r.path for r in again.values() if r.tied] == ["lm_head"]


def test_a_module_or_weight_replaced_since_is_resolved_again():
    model = tiny_llama().eval()
    adapter = random_adapter(model, ["q_proj", "v_proj"], r=4, seed=1)
    x = token_batch()
    with torch.no_grad():
        fa.functional_call(model, adapter, (x,))
        attn = model.model.layers[0].self_attn
        old = attn.q_proj
        attn.q_proj = nn.Linear(old.in_features, old.out_features, bias=False)  # a new module at the path
        got = fa.functional_call(model, adapter, (x,)).logits
        assert torch.equal(got, _fresh(model, adapter, x))
        assert not torch.equal(got, fa.functional_call(model, None, (x,)).logits)  # adapted: its LoRA applies
        fa.functional_call(model, adapter, (x,))
        attn.v_proj.weight = nn.Parameter(attn.v_proj.weight * 2)  # a new weight on the same module
        got = fa.functional_call(model, adapter, (x,)).logits
        assert torch.equal(got, _fresh(model, adapter, x))
        fa.functional_call(model, adapter, (x,))
        attn.q_proj = nn.Linear(old.in_features + 1, old.out_features, bias=False)  # no longer fits
        with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj: LoRA A \(4, 32\)"):
            fa.functional_call(model, adapter, (x,))


def test_a_weight_moved_to_another_device_in_place_is_an_error_naming_the_path():
    model = tiny_llama().eval()
    adapter = random_adapter(model, ["q_proj"], r=4, seed=1)
    x = token_batch()
    with torch.no_grad():
        fa.functional_call(model, adapter, (x,))
        weight = model.model.layers[1].self_attn.q_proj.weight
        # what Module.to does: the same Parameter object, on another device
        torch.utils.swap_tensors(weight, nn.Parameter(torch.empty_like(weight, device="meta")))
        with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.q_proj: LoRA A .* is on cpu but the weight is on meta"):
            fa.functional_call(model, adapter, (x,))


def test_the_walk_skips_a_child_that_holds_no_targets_and_nothing_else():
    """``walked_modules`` is ``named_modules`` less the subtree of a child marked
    ``fastaf_holds_no_targets`` (the stateful registry: one module per adapted layer, each a
    guard set in a traced call's walk); a module reached both inside and outside it stays."""
    shared = nn.Linear(3, 3)
    registry = nn.Module()
    registry.fastaf_holds_no_targets = True
    registry.inner = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    model = nn.Sequential(shared, nn.ReLU())
    model.add_module("fastaf", registry)
    assert _routes.walked_modules(model) == {"": model, "0": shared, "1": model[1]}
    model.fastaf.fastaf_holds_no_targets = False
    assert _routes.walked_modules(model) == dict(model.named_modules())


def test_the_eager_walk_lists_what_named_modules_lists_in_its_order_and_so_does_the_traced_one():
    """The eager walk is a recursion of its own: the same paths in the same order as
    ``named_modules``, a module reachable twice (shared, a cycle back to the root, a registry
    child's member, one equal to another by its own ``__eq__``) under its first path only, None
    children skipped, a class's own ``named_modules`` followed; traced, the same dict."""
    shared = nn.Linear(3, 3)
    inner = nn.Sequential(nn.Linear(3, 3), shared)
    model = nn.Sequential(shared, inner, nn.ModuleDict({"a": nn.ReLU(), "b": inner}))
    model.add_module("empty", None)
    inner.add_module("back", model)  # a cycle: named_modules' memo holds the root already
    llama = tiny_llama(layers=2)

    class Hidden(nn.Sequential):  # a class that walks its children its own way: it hides them
        def named_modules(self, memo=None, prefix="", remove_duplicate=True):
            if memo is None or self not in memo:
                yield prefix, self

    class Same(nn.Linear):  # equal by value: named_modules' memo keeps one of two equal modules
        def __eq__(self, other):
            return isinstance(other, Same)

        __hash__ = lambda self: 0  # noqa: E731

    odd = nn.Sequential(Same(2, 2), Same(2, 2), nn.Sequential(Hidden(nn.ReLU())))
    for m in (model, llama, odd):
        walked = _routes.walked_modules(m)
        assert list(walked.items()) == list(m.named_modules()), m
    traced = torch.compile(lambda: list(_routes.walked_modules(llama)), backend="eager", fullgraph=True)()
    assert traced == list(dict(llama.named_modules()))


def test_a_stateful_models_registry_is_not_walked_and_its_adapter_resolves_as_the_plain_models():
    base = tiny_llama(layers=1).requires_grad_(False)
    adapter = random_adapter(base, ["q_proj", "v_proj"], r=2, seed=1)
    model = fa.init(copy.deepcopy(base))
    model.add_new_adapter("a", adapter)
    walked = _routes.walked_modules(model)
    assert not any(p == "fastaf" or p.startswith("fastaf.") for p in walked)
    assert walked.keys() == dict(base.named_modules()).keys()
    x = token_batch(batch=1, seq=4)
    with torch.no_grad():
        torch.testing.assert_close(fa.functional_call(model, adapter, (x,)).logits,
                                   fa.functional_call(base, adapter, (x,)).logits)
