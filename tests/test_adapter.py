"""LoRA / Adapter pytrees: registration, immutability, validation, exact arithmetic, stacking."""
import dataclasses

import numpy as np
import optree
import pytest
import torch
import torch.utils._pytree as torch_pytree

import fastaf as fa


def lora(r=3, k=5, n=4, scale=2.0, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return fa.LoRA(torch.randn(r, k, generator=g, dtype=dtype), torch.randn(n, r, generator=g, dtype=dtype), scale)


def adapter(seed=0, r=3, scale=2.0):
    return fa.Adapter({"l0": lora(r=r, scale=scale, seed=seed), "l1": lora(r=r, k=4, n=6, scale=scale, seed=seed + 7)})


def test_torch_pytree_roundtrip_keeps_structure_and_static_scale():
    ad = adapter()
    leaves, spec = torch_pytree.tree_flatten(ad)
    assert len(leaves) == 4 and all(isinstance(t, torch.Tensor) for t in leaves)
    back = torch_pytree.tree_unflatten([t * 2 for t in leaves], spec)
    assert isinstance(back, fa.Adapter) and list(back) == ["l0", "l1"]
    assert back["l0"].scale == 2.0
    torch.testing.assert_close(back["l1"].B, ad["l1"].B * 2)


def test_optree_namespace_tree_map():
    ad = adapter()
    shapes = optree.tree_map(lambda t: tuple(t.shape), ad, namespace="fastaf")
    assert isinstance(shapes, fa.Adapter)
    assert shapes["l1"].A == (3, 4) and shapes["l1"].B == (6, 3)
    assert optree.tree_leaves(ad, namespace="fastaf")[0] is ad["l0"].A


def test_grad_over_adapter_returns_adapter():
    ad = adapter()
    g = torch.func.grad(lambda a: sum((l.B @ l.A).square().sum() for l in a.values()))(ad)
    assert isinstance(g, fa.Adapter) and isinstance(g["l0"], fa.LoRA)
    A, B = ad["l0"].A, ad["l0"].B
    torch.testing.assert_close(g["l0"].A, 2 * B.T @ (B @ A))


def test_pickle_torch_save_and_deepcopy_round_trip(tmp_path):
    import copy
    import pickle

    ad = adapter(0)
    torch.save(ad, tmp_path / "ad.pt")
    for back in (pickle.loads(pickle.dumps(ad)), copy.deepcopy(ad), torch.load(tmp_path / "ad.pt", weights_only=False)):
        assert isinstance(back, fa.Adapter) and list(back) == list(ad)
        for p in ad:
            assert torch.equal(back[p].A, ad[p].A) and back[p].scale == ad[p].scale
            assert back[p].A is not ad[p].A


def test_immutable():
    ad = adapter()
    with pytest.raises(AttributeError):
        ad.x = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        ad["l0"].scale = 3.0
    with pytest.raises(TypeError):
        ad["l0"] = lora()  # Mapping, not MutableMapping


@pytest.mark.parametrize(
    "A_shape, B_shape, match",
    [((3, 5), (4, 2), "rank mismatch"), ((0, 5), (4, 0), "rank 0"), ((3, 5), (4, 3, 1), "2-D")],
)
def test_bad_shapes_are_named(A_shape, B_shape, match):
    with pytest.raises(ValueError, match=match):
        fa.LoRA(torch.randn(A_shape), torch.randn(B_shape))
    # A LoRA rebuilt by a tree map is not validated; the Adapter holding it is, by path.
    unchecked = torch_pytree.tree_unflatten([torch.randn(A_shape), torch.randn(B_shape)], torch_pytree.tree_flatten(lora())[1])
    with pytest.raises(ValueError, match="layers.3.q_proj"):
        fa.Adapter({"layers.3.q_proj": unchecked})


def test_bad_dtype_and_device():
    with pytest.raises(TypeError, match="int64"):
        fa.LoRA(torch.ones(2, 3, dtype=torch.int64), torch.ones(4, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="meta"):
        fa.LoRA(torch.ones(2, 3), torch.ones(4, 2, device="meta"))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_scales_are_refused(bad):
    with pytest.raises(ValueError, match=f"scale must be finite, got {bad}"):
        fa.LoRA(torch.ones(2, 3), torch.ones(4, 2), scale=bad)
    ad = adapter(0)
    for scaled in (lambda: bad * ad, lambda: ad * bad, lambda: bad * ad["l0"], lambda: ad * torch.tensor(bad)):
        with pytest.raises(ValueError, match=f"scaled by a finite number, got {bad}"):
            scaled()


def test_dropout_must_be_a_number():
    with pytest.raises(TypeError, match="dropout must be a number, got '0.1'"):
        fa.LoRA(torch.ones(2, 3), torch.ones(4, 2), dropout="0.1")


def test_numpy_scalars_scale_from_either_side():
    ad = adapter(0)
    for c in (np.float64(0.5), np.float32(0.5), np.int64(2)):
        for scaled in (c * ad, ad * c):
            assert isinstance(scaled, fa.Adapter)
            torch.testing.assert_close(scaled["l0"].delta(), float(c) * ad["l0"].delta())
        assert isinstance(c * ad["l0"], fa.LoRA)


def test_adding_loras_on_different_devices_names_the_path():
    a = fa.Adapter({"layers.1.q_proj": lora(seed=1)})
    meta = a.map(lambda p, l: fa.LoRA(l.A.to("meta"), l.B.to("meta"), l.scale))
    with pytest.raises(ValueError, match=r"layers\.1\.q_proj: cannot add a LoRA on cpu and one on meta"):
        a + meta


def test_arithmetic_is_exact_in_delta_space():
    a, b = adapter(0), adapter(1, r=2, scale=0.5)
    s = a + b
    for p in a:
        torch.testing.assert_close(s[p].delta(), a[p].delta() + b[p].delta())
        assert s[p].rank == 5
        torch.testing.assert_close((0.3 * a)[p].delta(), 0.3 * a[p].delta())
        torch.testing.assert_close((-a)[p].delta(), -a[p].delta())
        torch.testing.assert_close((a - b)[p].delta(), a[p].delta() - b[p].delta())
    assert a["l0"].rank == 3  # operands untouched


def test_adding_fp16_loras_folds_the_smaller_scale_whatever_the_order():
    # the sum keeps the larger |scale|: folding 1 / 1e-6 into fp16 factors made B inf, the delta NaN
    torch.manual_seed(0)
    big = fa.LoRA(torch.randn(2, 5, dtype=torch.float16), torch.randn(6, 2, dtype=torch.float16), 2.0)
    small = fa.LoRA(torch.randn(3, 5, dtype=torch.float16), torch.randn(6, 3, dtype=torch.float16), 2e-6)
    want = big.delta().double() + small.delta().double()
    for s in (small + big, big + small):
        assert s.scale == 2.0 and s.rank == 5
        assert torch.isfinite(s.B).all()
        torch.testing.assert_close(s.delta().double(), want, atol=1e-2, rtol=1e-3)
    assert (small + big).A[:3].equal(small.A)  # ranks still concatenate in the operands' order
    st = fa.stack([fa.Adapter({"l": small}), fa.Adapter({"l": big})])["l"]
    assert st.scale == 2.0 and torch.isfinite(st.B).all()
    torch.testing.assert_close(st.delta()[0].double(), small.delta().double(), atol=1e-6, rtol=1e-2)


def test_a_path_given_twice_is_an_error():
    l1, l2 = lora(seed=1), lora(seed=2)
    with pytest.raises(ValueError, match="path 'x' is given more than once"):
        fa.Adapter([("x", l1), ("y", l2), ("x", l2)])
    assert fa.Adapter([("x", l1), ("y", l2)])["y"] is l2


def test_adding_stacks_of_other_sizes_says_so():
    two, three = fa.stack([adapter(0)] * 2), fa.stack([adapter(1)] * 3)
    with pytest.raises(ValueError, match=r"l0: cannot add .*: stack sizes 2 and 3$"):
        two + three
    with pytest.raises(ValueError, match="a stacked LoRA and an unstacked one"):
        two + adapter(2)


def test_add_keeps_paths_of_either_side():
    a = fa.Adapter({"x": lora(seed=1)})
    b = fa.Adapter({"y": lora(seed=2)})
    assert set(a + b) == {"x", "y"}


def test_stack_unstack_exact_with_different_ranks_and_scales():
    a, b, c = adapter(0, r=3, scale=2.0), adapter(1, r=1, scale=0.25), fa.Adapter({"l0": lora(r=2, seed=5)})
    st = fa.stack([a, b, c])
    assert st.stacked and st["l0"].A.shape == (3, 3, 5) and st["l1"].B.shape == (3, 6, 3)
    for i, ad in enumerate([a, b, c]):
        for p in st:
            want = ad[p].delta() if p in ad else torch.zeros(st[p].out_features, st[p].in_features, dtype=torch.float64)
            torch.testing.assert_close(st[p].delta()[i], want)
    for i, ad in enumerate(fa.unstack(st)):
        torch.testing.assert_close(ad["l0"].delta(), [a, b, c][i]["l0"].delta())


def test_a_stack_of_different_scales_scales_its_b_gradients_by_the_ratio():
    """As stack's docstring says: slot i's B is stored times s_i / s_max, so the stack's own B
    gradient is 1/ρ its adapter's (a helper measured a stack's SGD steps 9x off training alone)."""
    a, b = adapter(0, r=2, scale=2.0), adapter(1, r=2, scale=0.5)
    st = fa.stack([a, b]).map(lambda p, l: fa.LoRA(l.A.requires_grad_(), l.B.requires_grad_(), l.scale))
    g_stack = torch.autograd.grad(st["l0"].delta()[1].sum(), [st["l0"].B])[0][1]
    B = b["l0"].B.clone().requires_grad_()
    g_alone = torch.autograd.grad((b["l0"].scale * B @ b["l0"].A).sum(), [B])[0]
    torch.testing.assert_close(g_stack, g_alone / 0.25)  # ρ = 0.5 / 2.0


def test_stack_errors():
    with pytest.raises(ValueError, match="l0"):
        fa.stack([adapter(), fa.Adapter({"l0": lora(k=7)})])
    with pytest.raises(ValueError, match="already stacked"):
        fa.stack([fa.stack([adapter()])])
    # list() walked an Adapter's (or a dict's) keys: "item 0 is str, not fastaf.Adapter"
    with pytest.raises(TypeError, match=r"got Adapter \(wrap a single adapter in a list\)"):
        fa.stack(adapter())
    with pytest.raises(TypeError, match=r"got dict \(pass its adapters as a list, list\(adapters.values\(\)\)"):
        fa.stack({"sql": adapter(), "chat": adapter()})
