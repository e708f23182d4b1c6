"""fastaf.merge / merge_into / extract_adapter: every method against direct computation on the
deltas ΔW = scale·B@A, exactness where the math is exact, and parity with PEFT's
``add_weighted_adapter`` where PEFT computes the same thing (``cat``; ``svd`` at full rank)."""
from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

import fastaf as fa
from tests._models import MODELS, random_adapter, tiny_gpt2, tiny_llama, token_batch
from tests._tolerances import REL_TOL, assert_close, rel_err

LLAMA_TARGETS = MODELS["llama"][1]
DENSE = ["ties", "dare_linear", "dare_ties", "magnitude_prune"]


# ---- helpers ----------------------------------------------------------------------------------


def _double(ad: fa.Adapter) -> fa.Adapter:
    """fp64 factors, so that fastaf's SVDs can be checked at fp64 tolerance."""
    return ad.map(lambda p, l: fa.LoRA(l.A.double(), l.B.double(), l.scale, l.dropout))


def _three_adapters(dtype: torch.dtype = torch.float64) -> list[fa.Adapter]:
    """Different ranks, scales (one rsLoRA) and target sets, so paths are not all shared."""
    model = tiny_llama()
    ads = [
        random_adapter(model, ["q_proj", "v_proj", "up_proj"], r=4, alpha=8.0, seed=0),
        random_adapter(model, ["q_proj", "v_proj"], r=2, alpha=6.0, seed=1, rslora=True),
        random_adapter(model, ["q_proj", "o_proj"], r=3, alpha=3.0, seed=2),
    ]
    return [_double(a) for a in ads] if dtype == torch.float64 else ads


def _direct_sum(adapters, weights, path) -> torch.Tensor:
    """Σ w_i ΔW_i at ``path`` (adapters without the path add nothing)."""
    return sum(w * ad[path].delta() for ad, w in zip(adapters, weights) if path in ad)


def _best_rank(delta: torch.Tensor, r: int) -> torch.Tensor:
    """Eckart-Young: the best rank-r approximation of ``delta``."""
    U, S, Vh = torch.linalg.svd(delta, full_matrices=False)
    return U[:, :r] @ torch.diag(S[:r]) @ Vh[:r]


def _trim_ref(delta: torch.Tensor, density: float) -> torch.Tensor:
    """Keep the int(density·numel) largest-magnitude entries, by an explicit threshold."""
    k = int(density * delta.numel())
    if k >= delta.numel():
        return delta
    threshold = delta.abs().flatten().sort(descending=True).values[k - 1]
    return torch.where(delta.abs() >= threshold, delta, torch.zeros_like(delta))


def _ties_ref(tasks: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """TIES per entry, written as a loop: elect the sign of the sum, average the agreeing w_i·t_i."""
    out = torch.zeros_like(tasks[0])
    for idx in torch.cartesian_prod(*(torch.arange(s) for s in out.shape)).tolist():
        vals = [t[tuple(idx)].item() for t in tasks]
        sign = 1.0 if sum(vals) >= 0 else -1.0
        agreeing = [w * v for w, v in zip(weights, vals) if v != 0 and math.copysign(1.0, v) == sign]
        out[tuple(idx)] = sum(agreeing) / max(len(agreeing), 1)
    return out


# ---- merge: exact methods ---------------------------------------------------------------------


@pytest.mark.parametrize("method", ["cat", "linear"])
def test_cat_and_linear_equal_the_exact_weighted_sum(method):
    ads = _three_adapters()
    weights = [0.7, -0.4, 1.3]
    merged = fa.merge(ads, weights, method=method)
    assert set(merged) == {p for ad in ads for p in ad}
    for path, lora in merged.items():
        assert (lora.scale, lora.dropout) == (1.0, 0.0)
        assert lora.rank == sum(ad[path].rank for ad in ads if path in ad)  # rank concatenation
        assert_close(lora.delta(), _direct_sum(ads, weights, path), torch.float64, path)


def test_cat_logits_equal_running_the_weighted_adapters_together():
    model, ids = tiny_llama(), token_batch()
    ads = _three_adapters(torch.float32)
    weights = [0.5, 2.0, -1.0]
    merged = fa.merge(ads, weights, method="cat")
    ref = fa.functional_call(model, [w * a for w, a in zip(weights, ads)], (ids,)).logits
    assert_close(fa.functional_call(model, merged, (ids,)).logits, ref, torch.float32)


def test_weights_default_to_one():
    ads = _three_adapters()
    for method in ("cat", "svd"):
        plain, ones = fa.merge(ads, method=method), fa.merge(ads, [1.0, 1.0, 1.0], method=method)
        for path in plain:
            assert_close(plain[path].delta(), ones[path].delta(), torch.float64, path)


def test_svd_is_exact_when_r_covers_the_summed_rank():
    ads = _three_adapters()
    weights = [1.0, 0.5, -2.0]
    for r in (None, 9, 50):  # None: Σ r_i per path; 9 = the largest Σ r_i; 50 >= min(out, in)
        merged = fa.merge(ads, weights, method="svd", r=r)
        for path, lora in merged.items():
            assert (lora.scale, lora.dropout) == (1.0, 0.0)
            assert_close(lora.delta(), _direct_sum(ads, weights, path), torch.float64, f"{path} r={r}")


@pytest.mark.parametrize("method", ["svd", "linear"])
def test_truncated_svd_is_the_best_rank_r_approximation(method):
    ads = _three_adapters()
    weights = [1.0, 0.5, -2.0]
    merged = fa.merge(ads, weights, method=method, r=3)
    for path, lora in merged.items():
        assert lora.rank == 3
        assert_close(lora.delta(), _best_rank(_direct_sum(ads, weights, path), 3), torch.float64, path)


def test_svd_factors_split_the_singular_values_evenly():
    merged = fa.merge(_three_adapters(), method="svd", r=2)
    for path, lora in merged.items():
        # B = U·sqrt(S), A = sqrt(S)·Vᵀ: A Aᵀ = BᵀB = diag(S)
        AAt, BtB = lora.A @ lora.A.T, lora.B.T @ lora.B
        assert torch.allclose(AAt, BtB, atol=1e-10), path
        assert torch.allclose(AAt, torch.diag(torch.diagonal(AAt)), atol=1e-10), path


def test_merge_keeps_the_factor_dtype_and_leaves_inputs_alone():
    ads = _three_adapters(torch.float32)
    before = [{p: (l.A.clone(), l.B.clone(), l.scale) for p, l in ad.items()} for ad in ads]
    merged = fa.merge(ads, [0.3, 0.3, 0.4], method="ties", density=0.5, r=4)
    assert all(l.A.dtype == torch.float32 and l.B.dtype == torch.float32 for l in merged.values())
    for ad, snap in zip(ads, before):
        for p, (A, B, s) in snap.items():
            assert torch.equal(ad[p].A, A) and torch.equal(ad[p].B, B) and ad[p].scale == s


# ---- merge: methods that leave the low-rank family --------------------------------------------


@pytest.mark.parametrize("method", ["ties", "magnitude_prune"])
def test_trim_methods_match_direct_computation(method):
    ads = _three_adapters()
    weights = [0.9, 0.6, -0.5]  # a negative weight: signs are elected on the unweighted deltas
    density = 0.3
    merged = fa.merge(ads, weights, method=method, density=density, r=64)  # r >= min(out, in): exact
    for path in ("model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.v_proj"):
        present = [(w, ad[path]) for ad, w in zip(ads, weights) if path in ad]
        tasks = [_trim_ref(l.delta(), density) for _, l in present]
        if method == "ties":
            ref = _ties_ref(tasks, [w for w, _ in present])
        else:
            ref = sum(w * t for (w, _), t in zip(present, tasks))
        assert_close(merged[path].delta(), ref, torch.float64, path)


def test_ties_truncates_to_r_by_svd():
    ads = _three_adapters()
    full = fa.merge(ads, method="ties", density=0.5, r=64)
    low = fa.merge(ads, method="ties", density=0.5, r=3)
    for path in full:
        assert low[path].rank == 3
        assert_close(low[path].delta(), _best_rank(full[path].delta(), 3), torch.float64, path)


def test_dense_methods_default_r_is_the_summed_rank():
    ads = _three_adapters()
    merged = fa.merge(ads, method="magnitude_prune", density=0.5)
    for path, lora in merged.items():
        assert lora.rank == sum(ad[path].rank for ad in ads if path in ad)


def test_dare_keeps_a_density_fraction_and_rescales():
    (ad,) = _three_adapters()[:1]
    density = 0.3
    merged = fa.merge([ad], method="dare_linear", density=density, seed=7, r=64)
    kept = total = 0
    for path, lora in merged.items():
        delta, out = ad[path].delta(), lora.delta()
        is_kept = (out - delta / density).abs() < 1e-9
        is_dropped = out.abs() < 1e-9
        assert bool((is_kept | is_dropped).all()), f"{path}: entries other than 0 or ΔW/density"
        kept, total = kept + int(is_kept.sum()), total + out.numel()
    assert abs(kept / total - density) < 0.02, kept / total


def test_dare_is_seeded():
    ads = _three_adapters()
    for method in ("dare_linear", "dare_ties"):
        a = fa.merge(ads, method=method, density=0.5, seed=3, r=64)
        b = fa.merge(ads, method=method, density=0.5, seed=3, r=64)
        c = fa.merge(ads, method=method, density=0.5, seed=4, r=64)
        for path in a:
            assert torch.equal(a[path].A, b[path].A) and torch.equal(a[path].B, b[path].B), path
            assert rel_err(a[path].delta(), c[path].delta()) > 0.1, path


def test_dare_ties_on_one_adapter_drops_like_dare_linear():
    """One task agrees with its own sign everywhere it is non-zero: the disjoint mean is w·t."""
    ads = _three_adapters()[:1]
    lin = fa.merge(ads, [0.8], method="dare_linear", density=0.4, seed=1, r=64)
    ties = fa.merge(ads, [0.8], method="dare_ties", density=0.4, seed=1, r=64)
    for path in lin:
        assert_close(ties[path].delta(), lin[path].delta(), torch.float64, path)


@pytest.mark.parametrize(("method", "exact"), [("dare_linear", "svd"), ("dare_ties", "ties"),
                                               ("magnitude_prune", "svd")])
def test_density_one_drops_nothing(method, exact):
    ads = _three_adapters()
    weights = [0.5, 1.5, -1.0]
    got = fa.merge(ads, weights, method=method, density=1.0, seed=0 if "dare" in method else None, r=64)
    ref = fa.merge(ads, weights, method=exact, r=64, **({"density": 1.0} if exact == "ties" else {}))
    for path in got:
        assert_close(got[path].delta(), ref[path].delta(), torch.float64, path)


# ---- merge: errors and progress ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"method": "mean"}, "unknown method"),
        ({"method": "ties"}, "needs density"),
        ({"method": "ties", "density": 0.0}, r"density must be in \(0, 1\]"),
        ({"method": "dare_linear", "density": 1.5}, r"density must be in \(0, 1\]"),
        ({"method": "linear", "density": 0.5}, "takes no density"),
        ({"method": "cat", "r": 4}, "method='cat' is exact"),
        ({"method": "svd", "r": 0}, "r must be an int"),
        ({"method": "svd", "r": 2.0}, "r must be an int"),
        ({"method": "ties", "density": True}, r"density must be in \(0, 1\]"),
        ({"method": "svd", "seed": 1}, "seed only applies"),
        ({"weights": [1.0]}, "1 weights for 3 adapters"),
        ({"weights": [1.0, float("nan"), 1.0]}, "finite"),
    ],
)
def test_merge_rejects_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fa.merge(_three_adapters(torch.float32), **kwargs)


def test_merge_options_take_numpy_and_tensor_numbers():
    """As the weights do: density=np.float32(0.5) was refused as out of range, r=np.int64 too."""
    import numpy as np

    ads = _three_adapters(torch.float32)
    want = fa.merge(ads, method="dare_ties", r=3, density=0.5, seed=7)
    for r, density, seed in ((np.int64(3), np.float32(0.5), np.int32(7)), (torch.tensor(3), torch.tensor(0.5), 7)):
        got = fa.merge(ads, method="dare_ties", r=r, density=density, seed=seed)
        for path in want:
            torch.testing.assert_close(got[path].delta(), want[path].delta())


def test_merge_rejects_bad_adapters():
    model = tiny_llama()
    ad = random_adapter(model, ["q_proj"], r=2)
    with pytest.raises(TypeError, match="wrap a single adapter in a list"):
        fa.merge(ad)
    with pytest.raises(ValueError, match="at least one adapter"):
        fa.merge([])
    with pytest.raises(ValueError, match="is stacked"):
        fa.merge([fa.stack([ad, ad])])
    path = "model.layers.0.self_attn.q_proj"
    wrong = fa.Adapter({path: fa.LoRA(torch.zeros(2, 16), torch.zeros(32, 2))})
    with pytest.raises(ValueError, match=f"{path}: cannot merge.*feature sizes differ"):
        fa.merge([ad, wrong])


def test_progress_lines_go_to_stderr(capsys):
    ads = [random_adapter(tiny_llama(), LLAMA_TARGETS, r=2, seed=s) for s in (0, 1)]
    fa.merge(ads, method="svd", r=2, verbose=True)
    assert "fastaf.merge: 14/14 modules" in capsys.readouterr().err
    fa.merge(ads, method="svd", r=2)  # 14 paths: below the automatic threshold
    assert capsys.readouterr().err == ""


@pytest.mark.gpu
def test_merge_on_cuda_stays_there_and_matches_cpu():
    ads = _three_adapters(torch.float32)
    cuda = [ad.map(lambda p, l: fa.LoRA(l.A.cuda(), l.B.cuda(), l.scale)) for ad in ads]
    for kwargs in ({"method": "svd", "r": 4}, {"method": "ties", "density": 0.5, "r": 64}):
        got, ref = fa.merge(cuda, **kwargs), fa.merge(ads, **kwargs)
        for path in ref:
            assert got[path].A.is_cuda
            assert_close(got[path].delta().cpu(), ref[path].delta(), "tf32", path)


# ---- merge_into -------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", list(MODELS))
def test_merge_into_equals_running_the_adapter(arch):
    make, targets = MODELS[arch]
    model, ids = make(), token_batch()
    ad = random_adapter(model, targets, r=4, seed=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    merged = fa.merge_into(model, ad)
    ref = fa.functional_call(model, ad, (ids,)).logits
    assert_close(fa.functional_call(model, None, (ids,), params=merged).logits, ref, torch.float32)
    for name, param in model.named_parameters():  # untouched model; unadapted entries shared
        assert torch.equal(param, before[name]), name
        assert (merged[name] is param) == (name[: -len(".weight")] not in ad), name


def test_merge_into_a_tied_lm_head_equals_running_the_adapter():
    """A tied lm_head is adapted alone, as PEFT does: merge_into found no 'lm_head.weight' (tied
    names are dropped from named_parameters), and functional_call refused the untied mapping."""
    model, ids = tiny_llama(), token_batch()
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    ad = random_adapter(model, ["q_proj", "lm_head"], r=4, seed=3)
    merged = fa.merge_into(model, ad)
    assert merged["model.embed_tokens.weight"] is model.model.embed_tokens.weight
    assert_close(merged["lm_head.weight"] - model.lm_head.weight, ad["lm_head"].delta(), torch.float32)
    ref = fa.functional_call(model, ad, (ids,)).logits
    assert_close(fa.functional_call(model, None, (ids,), params=merged).logits, ref, torch.float32)
    # one name of a tie still stands for both: no adapter, the embedding's weight swapped for both uses
    scaled = {"model.embed_tokens.weight": 2 * model.model.embed_tokens.weight}
    want = torch.func.functional_call(model, scaled, (ids,)).logits
    assert_close(fa.functional_call(model, None, (ids,), params=scaled).logits, want, torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied


def test_merge_into_keeps_an_unadapted_tie_and_its_gradient():
    """Only an adapted tied lm_head gets a name of its own: listing the unadapted alias split the
    tied embedding's gradient between the two names under torch.func (5.7e-3 off)."""
    model, ids = tiny_gpt2(layers=1), token_batch()
    ad = random_adapter(model, ["c_attn"], r=4, seed=1)
    merged = {k: v.detach() for k, v in fa.merge_into(model, ad).items()}
    assert "lm_head.weight" not in merged and set(merged) == set(dict(model.named_parameters()))

    def loss(params):
        return fa.functional_call(model, None, (ids,), params=params).logits.square().mean()

    def loss_torch(params):
        return torch.func.functional_call(model, params, (ids,)).logits.square().mean()

    got, want = torch.func.grad(loss)(merged), torch.func.grad(loss_torch)(merged)
    assert_close(got["transformer.wte.weight"], want["transformer.wte.weight"], torch.float32)


def test_untying_one_name_keeps_the_other_names_of_its_tie():
    """BART ties four names to one embedding: given the shared weight and lm_head apart, the
    encoder's and decoder's embeddings follow the given shared weight, not the module's own."""
    from tests._models import tiny_bart

    model = tiny_bart().eval()
    names = [n for n, p in model.named_parameters(remove_duplicate=False) if p is model.model.shared.weight]
    assert len(names) == 4 and names[-1] == "lm_head.weight"
    x = token_batch(batch=1, seq=5)
    params = {**dict(model.named_parameters()), names[0]: torch.zeros_like(model.model.shared.weight),
              "lm_head.weight": model.lm_head.weight + 1.0}
    want = torch.func.functional_call(model, {**params, **{n: params[names[0]] for n in names[1:-1]}}, (x,),
                                      {"decoder_input_ids": x}, tie_weights=False).logits
    got = fa.functional_call(model, None, (x,), {"decoder_input_ids": x}, params=params).logits
    assert_close(got, want, torch.float32)


def test_merge_into_a_mapping_compiles_with_fullgraph():
    """The square-weight warning is not raised while tracing (dynamo cannot trace a warning)."""
    model, ids = tiny_llama(layers=1), token_batch(batch=2, seq=5)
    ad, params = random_adapter(model, ["q_proj"], seed=1), dict(model.named_parameters())
    step = torch.compile(lambda a: fa.functional_call(model, None, (ids,), params=fa.merge_into(params, a)).logits,
                         fullgraph=True, backend="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = fa.functional_call(model, ad, (ids,)).logits
    assert_close(step(ad), want, torch.float32)


def test_merge_into_a_mapping_uses_model_for_conv1d_layout():
    model, ids = tiny_gpt2(), token_batch()
    ad = random_adapter(model, ["c_attn", "c_proj"], r=4, seed=1)
    state = dict(model.named_parameters())
    merged = fa.merge_into(state, ad, model=model)
    assert state == dict(model.named_parameters())  # the input mapping is not changed
    ref = fa.functional_call(model, ad, (ids,)).logits
    assert_close(fa.functional_call(model, None, (ids,), params=merged).logits, ref, torch.float32)
    path = "transformer.h.0.attn.c_attn"
    assert_close(merged[f"{path}.weight"] - state[f"{path}.weight"], ad[path].delta().T, torch.float32)
    with pytest.raises(ValueError, match=r"c_attn.weight is \(32, 96\).*pass model="):
        fa.merge_into(state, ad)
    # a square Conv1D weight fits either layout: without model= it is taken as (out, in), and said so
    square = random_adapter(model, ["attn.c_proj"], r=4, seed=2)
    with pytest.warns(UserWarning, match=r"2 square weight\(s\).*transformer.h.0.attn.c_proj.*Pass model="):
        fa.merge_into(state, square)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fa.merge_into(state, square, model=model)


def test_merge_into_keeps_dtype_and_adds_in_fp32():
    model = tiny_llama(dtype=torch.bfloat16)
    ad = random_adapter(model, ["q_proj"], r=4, seed=2)
    merged = fa.merge_into(model, ad)
    path = "model.layers.0.self_attn.q_proj"
    w = model.get_submodule(path).weight
    assert merged[f"{path}.weight"].dtype == torch.bfloat16
    assert torch.equal(merged[f"{path}.weight"], (w.float() + ad[path].delta().float()).bfloat16())


def test_merge_into_a_list_sums_the_adapters():
    model, ids = tiny_llama(), token_batch()
    a, b = random_adapter(model, ["q_proj"], r=2, seed=0), random_adapter(model, ["q_proj", "v_proj"], r=3, seed=1)
    merged = fa.merge_into(model, [a, -b])
    ref = fa.functional_call(model, [a, -b], (ids,)).logits
    assert_close(fa.functional_call(model, None, (ids,), params=merged).logits, ref, torch.float32)


def test_merge_into_is_differentiable_in_the_adapter():
    model, ids = tiny_llama(), token_batch()
    ad = random_adapter(model, ["q_proj", "v_proj"], r=2, seed=0)

    def via_merge(a):
        return fa.functional_call(model, None, (ids,), {"labels": ids}, params=fa.merge_into(model, a)).loss

    def via_call(a):
        return fa.functional_call(model, a, (ids,), {"labels": ids}).loss

    got, ref = torch.func.grad(via_merge)(ad), torch.func.grad(via_call)(ad)
    for path in ad:
        assert_close(got[path].A, ref[path].A, "tf32", f"{path} dA")
        assert_close(got[path].B, ref[path].B, "tf32", f"{path} dB")


def test_merge_into_a_meta_adapter_is_a_named_error():
    model = tiny_llama()
    meta = random_adapter(model, ["q_proj"]).map(lambda p, l: fa.LoRA(l.A.to("meta"), l.B.to("meta"), l.scale))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj: LoRA A \(4, 32\) is on meta"):
        fa.merge_into(model, meta)


def test_merge_into_errors_name_the_path_and_shapes():
    model = tiny_llama()
    path = "model.layers.0.self_attn.q_proj"
    bad_shape = fa.Adapter({path: fa.LoRA(torch.zeros(2, 32), torch.zeros(48, 2))})
    with pytest.raises(ValueError, match=rf"{path}.weight is \(32, 32\).*needs \(48, 32\)"):
        fa.merge_into(model, bad_shape)
    missing = fa.Adapter({"model.layers.7.self_attn.q_proj": fa.LoRA(torch.zeros(2, 32), torch.zeros(32, 2))})
    with pytest.raises(ValueError, match=r"no parameter 'model.layers.7.self_attn.q_proj.weight'"):
        fa.merge_into(model, missing)
    not_linear = fa.Adapter({"model.embed_tokens": fa.LoRA(torch.zeros(2, 32), torch.zeros(96, 2))})
    with pytest.raises(ValueError, match="not a linear layer"):
        fa.merge_into(model, not_linear)
    with pytest.raises(ValueError, match="is stacked"):
        fa.merge_into(model, fa.stack([bad_shape, bad_shape]))


# ---- extract_adapter --------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_extract_recovers_a_merged_adapter(arch):
    make, targets = MODELS[arch]
    model = make()
    ad = random_adapter(model, targets, r=4, seed=5)
    tuned = fa.merge_into(model, ad)
    ex = fa.extract_adapter(model, tuned, r=4)  # the model gives the Conv1D layout
    assert set(ex) == set(ad)
    for path, lora in ex.items():
        assert (lora.rank, lora.scale, lora.A.dtype) == (4, 1.0, torch.float32)
        assert_close(lora.delta(), ad[path].delta(), "tf32", path)  # fp32 W + ΔW - W cancellation


def test_extract_from_mappings_with_names_and_truncation():
    model = tiny_gpt2()
    ad = random_adapter(model, ["c_attn", "c_fc"], r=4, seed=6)
    base = {k: v.detach().clone() for k, v in model.named_parameters()}
    tuned = {k: v.detach() for k, v in fa.merge_into(model, ad).items()}
    ex = fa.extract_adapter(base, tuned, 2, model=model, names=["c_attn"])
    assert set(ex) == {p for p in ad if p.endswith("c_attn")}
    for path, lora in ex.items():
        assert lora.rank == 2
        assert_close(lora.delta(), _best_rank(tuned[f"{path}.weight"].T - base[f"{path}.weight"].T, 2), "tf32", path)


def test_extract_takes_a_changed_tied_lm_head_from_a_module_as_from_a_mapping():
    """A tuned module listed a tied weight once, under the embedding's name: its changed lm_head
    was dropped, where the same weights as a mapping (every name) extracted it."""
    base = tiny_gpt2()
    assert base.lm_head.weight is base.transformer.wte.weight
    tuned = copy.deepcopy(base)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        tuned.lm_head.weight.add_(0.05 * torch.randn(base.lm_head.out_features, 2, generator=g)
                                  @ torch.randn(2, base.lm_head.in_features, generator=g))
    from_module = fa.extract_adapter(base, tuned, r=2)
    from_mapping = fa.extract_adapter(base, dict(tuned.named_parameters(remove_duplicate=False)), r=2, model=base)
    assert set(from_module) == set(from_mapping) == {"lm_head"}
    assert_close(from_module["lm_head"].delta(), tuned.lm_head.weight - base.lm_head.weight, "tf32")


def test_extract_skips_unchanged_weights_and_checks_inputs():
    model = tiny_llama()
    assert len(fa.extract_adapter(model, model, r=4)) == 0
    base = dict(model.named_parameters())
    tuned = dict(base)
    tuned["model.layers.0.mlp.up_proj.weight"] = torch.zeros(32, 32)
    with pytest.raises(ValueError, match=r"up_proj.weight is \(64, 32\).*in base_params but \(32, 32\)"):
        fa.extract_adapter(base, tuned, r=4)
    with pytest.raises(ValueError, match=r"names \['k_norm'\] match no"):
        fa.extract_adapter(base, base, r=4, names=["k_norm"])
    with pytest.raises(ValueError, match="not a linear layer"):
        fa.extract_adapter(model, base, r=4, names=["embed_tokens"])
    with pytest.raises(ValueError, match="r must be an int"):
        fa.extract_adapter(model, model, r=0)


# ---- parity with PEFT's add_weighted_adapter --------------------------------------------------

PEFT_TARGETS = ["q_proj", "v_proj", "down_proj"]


def _peft_pair(configs, ads):
    """A PEFT LoRA model on tiny_llama with adapters "a0", "a1", ... holding ``ads``' factors."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_llama(), configs[0], adapter_name="a0")
    for i, cfg in enumerate(configs[1:], start=1):
        model.add_adapter(f"a{i}", cfg)
    with torch.no_grad():
        for name, module in model.base_model.model.named_modules():
            for i, ad in enumerate(ads):
                if name in ad and f"a{i}" in getattr(module, "lora_A", {}):
                    module.lora_A[f"a{i}"].weight.copy_(ad[name].A)
                    module.lora_B[f"a{i}"].weight.copy_(ad[name].B)
                    assert module.scaling[f"a{i}"] == pytest.approx(ad[name].scale)
    return model


def _peft_deltas(model, adapter_name: str) -> dict[str, torch.Tensor]:
    return {
        name: module.get_delta_weight(adapter_name)
        for name, module in model.base_model.model.named_modules()
        if adapter_name in getattr(module, "lora_A", {})
    }


def _lora_config(r: int, alpha: float, **kw):
    peft = pytest.importorskip("peft")
    return peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=PEFT_TARGETS, lora_dropout=0.0, **kw)


@pytest.mark.parametrize("combination", ["cat", "svd"])
def test_peft_parity_cat_and_full_rank_svd(combination):
    base, ids = tiny_llama(), token_batch()
    ads = [random_adapter(base, PEFT_TARGETS, r=4, alpha=8.0, seed=0),
           random_adapter(base, PEFT_TARGETS, r=2, alpha=2.0, seed=1)]
    weights = [0.7, -0.4]
    peft_model = _peft_pair([_lora_config(4, 8.0), _lora_config(2, 2.0)], ads)
    extra = {"svd_rank": 6} if combination == "svd" else {}
    peft_model.add_weighted_adapter(["a0", "a1"], weights, "m", combination_type=combination, **extra)
    merged = fa.merge(ads, weights, method=combination, **({"r": 6} if combination == "svd" else {}))
    peft_deltas = _peft_deltas(peft_model, "m")
    assert set(peft_deltas) == set(merged)
    for path, delta in peft_deltas.items():
        assert_close(merged[path].delta(), delta, "tf32", path)
    peft_model.set_adapter("m")
    with torch.no_grad():
        ref = peft_model(ids).logits
    assert_close(fa.functional_call(base, merged, (ids,)).logits, ref, "tf32")


def test_peft_ties_svd_at_full_rank_matches_fastaf_ties():
    """PEFT's ties_svd runs TIES on the deltas too; at full rank it is fastaf's ties."""
    base = tiny_llama()
    ads = [random_adapter(base, PEFT_TARGETS, r=4, alpha=8.0, seed=s) for s in (0, 1)]
    weights = [0.6, 0.9]
    peft_model = _peft_pair([_lora_config(4, 8.0)] * 2, ads)
    peft_model.add_weighted_adapter(["a0", "a1"], weights, "m", combination_type="ties_svd",
                                    svd_rank=32, svd_full_matrices=False, density=0.4)
    merged = fa.merge(ads, weights, method="ties", density=0.4, r=64)
    for path, delta in _peft_deltas(peft_model, "m").items():
        assert_close(merged[path].delta(), delta, "tf32", path)


def test_peft_linear_is_not_the_delta_space_sum():
    """PEFT's linear sums A's and B's separately: (Σ√(w s) B_i)(Σ√(w s) A_i) has cross terms."""
    base = tiny_llama()
    ads = [random_adapter(base, PEFT_TARGETS, r=4, alpha=8.0, seed=s) for s in (0, 1)]
    weights = [0.5, 0.5]
    peft_model = _peft_pair([_lora_config(4, 8.0)] * 2, ads)
    peft_model.add_weighted_adapter(["a0", "a1"], weights, "m", combination_type="linear")
    merged = fa.merge(ads, weights, method="linear")
    for path, peft_delta in _peft_deltas(peft_model, "m").items():
        exact = _direct_sum(ads, weights, path)
        assert_close(merged[path].delta(), exact, torch.float32, path)
        assert rel_err(peft_delta, exact) > 0.3, f"{path}: PEFT's linear unexpectedly exact"


def test_peft_rslora_merge_scale_differs_fastaf_stays_exact():
    """peft#3761: the merged adapter keeps use_rslora, so its scale is sqrt(new_r), not 1."""
    base = tiny_llama()
    ads = [random_adapter(base, PEFT_TARGETS, r=4, alpha=8.0, seed=0, rslora=True),
           random_adapter(base, PEFT_TARGETS, r=2, alpha=2.0, seed=1, rslora=True)]
    peft_model = _peft_pair([_lora_config(4, 8.0, use_rslora=True), _lora_config(2, 2.0, use_rslora=True)], ads)
    peft_model.add_weighted_adapter(["a0", "a1"], [1.0, 1.0], "m", combination_type="cat")
    merged = fa.merge(ads, method="cat")
    for path, peft_delta in _peft_deltas(peft_model, "m").items():
        exact = _direct_sum(ads, [1.0, 1.0], path)
        assert_close(merged[path].delta(), exact, torch.float32, path)
        # PEFT 0.21's scale is sqrt(6) too large; once peft#3761 is fixed PEFT matches the exact
        # sum, and this test keeps passing on fastaf's exactness alone.
        if rel_err(peft_delta, exact) > REL_TOL["tf32"]:
            assert_close(peft_delta, math.sqrt(6) * exact, "tf32", path)
