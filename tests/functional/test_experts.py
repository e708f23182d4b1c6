"""Fused 3-D MoE expert parameters (transformers 5): one LoRA per expert, against PEFT's
``target_parameters`` (lora.ParamWrapper). The per-family forward / gradient / vmap / stateful /
files checks for Mixtral and Qwen3-MoE run in test_call.py's ARCHS tests."""
import copy
import dataclasses
import warnings

import peft
import pytest
import torch

import fastaf as fa
from fastaf._layouts import match_targets
from tests._models import random_adapter, tiny_llama, tiny_mixtral, tiny_qwen3_moe, token_batch
from tests._peft import peft_grads, peft_model_with
from tests._tolerances import rel_err

RTOL = 1e-5
EXPERT_KEY = "model.layers.0.mlp.experts.gate_up_proj"


def tiny_gpt_oss(seed: int = 0):
    """Experts stored transposed (E, in, out), with biases; the router has a bias too."""
    import transformers

    cfg = transformers.GptOssConfig(vocab_size=96, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                    num_experts_per_tok=2, attn_implementation="eager",
                                    experts_implementation="batched_mm", layer_types=["full_attention"] * 2)
    torch.manual_seed(seed)
    return transformers.GptOssForCausalLM(cfg).eval()


def _check_against_peft(base, ad, ids):
    """Logits and every gradient of ``ad`` on ``base`` against PEFT holding the same factors."""
    out = fa.functional_call(base, ad, (ids,), {"labels": ids})
    grads = torch.func.grad(lambda a: fa.functional_call(base, a, (ids,), {"labels": ids}).loss)(ad)
    pm = peft_model_with(base, {"default": ad}, None, {"default": (4, 8.0)})
    ref = pm(ids, labels=ids)
    ref.loss.backward()
    assert rel_err(out.logits, ref.logits) < RTOL
    for key, (dA, dB) in peft_grads(pm, ad).items():
        assert rel_err(grads[key].A, dA) < 1e-4, key
        assert rel_err(grads[key].B, dB) < 1e-4, key


@pytest.mark.parametrize("make", [tiny_mixtral, tiny_qwen3_moe, tiny_gpt_oss])
def test_all_linear_selects_what_peft_selects_and_does_not_warn(make):
    model = make()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        keys = match_targets(model, "all-linear")
        ad = fa.init_adapter(model, fa.LoRAConfig(r=2, alpha=4, targets="all-linear"), seed=0)
    assert list(ad) == keys
    assert "model.layers.1.mlp.experts.down_proj" in keys and "lm_head" not in keys
    if make is tiny_gpt_oss:  # PEFT's all-linear leaves GPT-OSS's experts alone (no v4 mapping)
        assert "model.layers.0.mlp.router.weight" in keys
        return
    pm = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=2, target_modules="all-linear"))
    tuner = pm.base_model
    assert sorted(keys) == sorted(tuner.targeted_module_names + tuner.targeted_parameter_names)
    lora = ad[EXPERT_KEY]
    E, out, k = model.get_parameter(EXPERT_KEY).shape
    assert lora.experts and lora.A.shape == (E, 2, k) and lora.B.shape == (E, out, 2)
    assert torch.count_nonzero(lora.B) == 0 and lora.A.abs().max() <= k ** -0.5


@pytest.mark.parametrize("experts", ["eager", "batched_mm", "grouped_mm"])
def test_every_experts_implementation_matches_peft(experts):
    base = tiny_mixtral(experts=experts)
    _check_against_peft(base, random_adapter(base, "all-linear", r=4, alpha=8.0), token_batch(2, 7))


def test_transposed_experts_match_peft():
    """GPT-OSS stores its experts (E, in, out) and says so with is_transposed, as PEFT reads it."""
    base = tiny_gpt_oss()
    ad = random_adapter(base, ["q_proj", "gate_up_proj", "down_proj", "router.weight"], r=4, alpha=8.0)
    assert ad[EXPERT_KEY].A.shape == (4, 4, 32) and ad[EXPERT_KEY].B.shape == (4, 48, 4)
    _check_against_peft(base, ad, token_batch(2, 7))


def test_vmap_of_grad_over_a_stack_equals_one_call_each():
    base = tiny_qwen3_moe()
    ads = [random_adapter(base, "all-linear", r=r, seed=s) for r, s in ((4, 1), (2, 2))]
    ids = token_batch(2, 7)
    loss = lambda a: fa.functional_call(base, a, (ids,), {"labels": ids}).loss  # noqa: E731
    stack = fa.stack(ads)  # scales differ (alpha / r): each slot's scale is folded into its B
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*performance drop.*")
        grads = torch.func.vmap(torch.func.grad(loss))(stack)
    assert grads[EXPERT_KEY].A.shape == (2, 4, 4, 32)
    for i, ad in enumerate(ads):
        want = torch.func.grad(loss)(ad)
        lora = ad[EXPERT_KEY]
        r, fold = lora.rank, lora.scale / stack[EXPERT_KEY].scale
        assert rel_err(grads[EXPERT_KEY].A[i, :, :r], want[EXPERT_KEY].A) < 1e-4
        assert rel_err(grads[EXPERT_KEY].B[i, ..., :r] * fold, want[EXPERT_KEY].B) < 1e-4


def test_arithmetic_stack_and_merges_are_exact_per_expert():
    base = tiny_mixtral()
    a1, a2 = (random_adapter(base, ["gate_up_proj", "down_proj", "gate.weight"], r=r, seed=s) for r, s in ((4, 1), (2, 2)))
    ids = token_batch(2, 7)
    call = lambda ad, **kw: fa.functional_call(base, ad, (ids,), **kw).logits  # noqa: E731
    with torch.no_grad():
        want = call([0.7 * a1, 0.3 * a2])
        assert rel_err(call(0.7 * a1 + 0.3 * a2), want) < RTOL
        assert rel_err(call(None, params=fa.merge_into(base, [0.7 * a1, 0.3 * a2])), want) < RTOL
        for method in ("linear", "cat", "svd"):
            merged = fa.merge([a1, a2], [0.7, 0.3], method=method)
            assert merged[EXPERT_KEY].experts and merged[EXPERT_KEY].A.shape == (4, 6, 32)
            assert rel_err(call(merged), want) < RTOL, method
        assert rel_err(call(fa.unstack(fa.stack([a1, a2]))[1]), call(a2)) < RTOL
    # a dense method merges expert by expert: expert 2 equals the merge of expert 2's own LoRAs
    ties = fa.merge([a1, a2], [0.7, 0.3], method="ties", r=3, density=0.5)[EXPERT_KEY]
    one = [fa.Adapter({"x": fa.LoRA(a[EXPERT_KEY].A[2], a[EXPERT_KEY].B[2], a[EXPERT_KEY].scale)}) for a in (a1, a2)]
    ref = fa.merge(one, [0.7, 0.3], method="ties", r=3, density=0.5)["x"]
    torch.testing.assert_close(ties.B[2] @ ties.A[2], ref.B @ ref.A)


def test_stateful_forward_and_generate_match_peft():
    base = tiny_mixtral()
    ad = random_adapter(base, "all-linear", r=4, alpha=8.0)
    ids = token_batch(2, 5)
    model = fa.init(copy.deepcopy(base))
    model.add_new_adapter("a", ad)
    model.set_active_adapter("a")
    pm = peft_model_with(base, {"default": ad}, None, {"default": (4, 8.0)}).eval()
    kw = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    with torch.no_grad():
        assert rel_err(model(ids).logits, pm(ids).logits) < RTOL
        ours, ref = model.generate(ids, **kw), pm.generate(input_ids=ids, **kw)
    assert torch.equal(ours.sequences, ref.sequences)
    for a, b in zip(ours.logits, ref.logits):
        assert rel_err(a, b) < RTOL
    out = model(ids, labels=ids)  # the expert factors are trainable parameters of the model
    out.loss.backward()
    slot = model.fastaf.adapters["a"]
    assert slot[EXPERT_KEY.replace(".", "__")].B.grad.shape == ad[EXPERT_KEY].B.shape


def test_bad_expert_loras_are_named_errors():
    base = tiny_mixtral()
    ids = token_batch(2, 5)
    good = random_adapter(base, ["gate_up_proj"])[EXPERT_KEY]
    bad = dataclasses.replace(good, A=good.A[:, :, :16])
    with pytest.raises(ValueError, match=rf"{EXPERT_KEY}: expert LoRA A \(4, 4, 16\).*\(4, 96, 32\).*A \(4, r, 32\)"):
        fa.functional_call(base, fa.Adapter({EXPERT_KEY: bad}), (ids,))
    with pytest.raises(ValueError, match=rf"{EXPERT_KEY}.*is a parameter.*expert LoRA"):
        fa.functional_call(base, fa.Adapter({EXPERT_KEY: fa.LoRA(good.A[0], good.B[0])}), (ids,))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts'.*expert LoRA.*MixtralExperts module"):
        fa.functional_call(base, fa.Adapter({"model.layers.0.mlp.experts": good}), (ids,))
    with pytest.raises(ValueError, match=rf"{EXPERT_KEY}: adapter_ids cannot"):
        fa.functional_call(base, fa.stack([fa.Adapter({EXPERT_KEY: good})] * 2), (ids,), adapter_ids=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="dropout.*gate_up_proj.*PEFT"):
        fa.init_adapter(base, fa.LoRAConfig(r=2, alpha=2, targets="all-linear", dropout=0.1))
    with pytest.raises(ValueError, match=r"expert LoRA \(A \(4, 4, 32\)\) cannot have dropout"):
        fa.LoRA(good.A, good.B, 1.0, 0.1, experts=True)
    with pytest.raises(ValueError, match=r"cannot add.*an expert LoRA and a plain one"):
        fa.Adapter({"x": good}) + fa.Adapter({"x": fa.LoRA(good.A[0], good.B[0])})
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.gate'.*MixtralTopKRouter.*'model.layers.0.mlp.gate.weight'"):
        fa.init_adapter(base, fa.LoRAConfig(r=2, alpha=2, targets=["mlp.gate"]))


def test_a_plain_model_has_no_parameter_targets():
    assert all(not l.experts for l in fa.init_adapter(tiny_llama(), fa.LoRAConfig(r=2, alpha=2, targets="all-linear")).values())


def test_activation_checkpointing_recomputes_the_expert_weights():
    base = tiny_mixtral()
    ad = random_adapter(base, "all-linear")
    ids = token_batch(2, 7)
    want = torch.func.grad(lambda a: fa.functional_call(base, a, (ids,), {"labels": ids}).loss)(ad)
    ckpt = tiny_mixtral()
    ckpt.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": fa.functional.checkpoint_context}
    )
    ckpt.train()
    leaves = [t.clone().requires_grad_() for t in torch.utils._pytree.tree_leaves(ad)]
    ad2 = torch.utils._pytree.tree_unflatten(leaves, torch.utils._pytree.tree_structure(ad))
    fa.functional_call(ckpt, ad2, (ids,), {"labels": ids, "use_cache": False}).loss.backward()
    for (key, lora), A in zip(want.items(), leaves[::2]):
        assert rel_err(A.grad, lora.A) < 1e-4, key


def test_compile_fullgraph_has_no_graph_breaks():
    """``fullgraph=True`` raises at any graph break (one layer: dynamo traces each, slowly on CI)."""
    base = tiny_mixtral(layers=1)
    ad = random_adapter(base, ["gate_up_proj", "gate.weight"])
    ids = token_batch(2, 7)
    f = lambda a, ids: fa.functional_call(base, a, (ids,)).logits  # noqa: E731
    assert rel_err(torch.compile(f, fullgraph=True, backend="aot_eager")(ad, ids), f(ad, ids)) < RTOL
