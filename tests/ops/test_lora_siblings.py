"""Siblings sharing one input (q/k/v, gate/up): ``shared_h`` + ``lora_linear_given_h`` against
``lora_linear`` per layer, and ``functional_call`` with sharing on against it off."""
import os

import pytest
import torch

import fastaf as fa
from fastaf.functional import lora_linear
from fastaf.intercept import use as _use
from fastaf.ops import lora_siblings as _siblings
from tests._models import random_adapter, tiny_bart, tiny_llama, tiny_qwen2, token_batch
from tests._tolerances import REL_TOL, assert_close, rel_err

IMPLS = ["torch"] + (["triton"] if os.environ.get("TRITON_INTERPRET") == "1" else [])
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def leaves(tree):
    return torch.utils._pytree.tree_leaves(tree)


def siblings(K=24, ns=(16, 8, 8), ranks=(4, 2, 5), factor_dtype=torch.float32, seed=0):
    """Weights, biases and LoRAs of len(ns) layers reading one (.., K) input; ranks differ."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    layers = []
    for n, rank in zip(ns, ranks):
        lora = fa.LoRA(r(rank, K).to(factor_dtype).requires_grad_(), r(n, rank).to(factor_dtype).requires_grad_(),
                       scale=0.5 + rank / 10)
        layers.append((r(n, K), r(n), lora))
    return layers


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_h_and_given_h_equal_lora_linear_per_layer(impl, dtype):
    if impl == "triton" and dtype == torch.bfloat16:
        pytest.skip("the CPU interpreter's bf16 tl.dot is wrong (triton 3.9); the GPU test covers bf16 kernels")
    layers = siblings(factor_dtype=torch.float32)  # fp32 master factors, also under bf16 x
    x = torch.randn(3, 7, 24).to(dtype).requires_grad_()
    dys = [torch.randn(3, 7, w.shape[0]).to(dtype) for w, _, _ in layers]

    def run(shared):
        hs = _siblings.shared_h(x, [l for _, _, l in layers], impl=impl) if shared else None
        ys = [_siblings.lora_linear_given_h(x, w.to(dtype), b.to(dtype), hs[i], l, impl=impl) if shared
              else lora_linear(x, w.to(dtype), b.to(dtype), l, impl=impl)
              for i, (w, b, l) in enumerate(layers)]
        inputs = [x] + [t for _, _, l in layers for t in (l.A, l.B)]
        return ys, torch.autograd.grad(ys, inputs, dys)

    (ys, grads), (ys0, grads0) = run(True), run(False)
    key = dtype if dtype != torch.float32 or impl == "torch" else "tf32"
    for y, y0 in zip(ys, ys0):
        assert y.dtype == dtype
        assert_close(y, y0, key, "y")
    names = ["dx"] + [f"d{f}{i}" for i in range(len(layers)) for f in "AB"]
    for name, g, g0 in zip(names, grads, grads0):
        assert g.dtype == g0.dtype, name  # gradients in each factor's own dtype
        assert_close(g, g0, key, name)


def test_a_sibling_whose_output_is_unused_contributes_no_gradient():
    layers = siblings()
    x = torch.randn(5, 24, requires_grad=True)
    hs = _siblings.shared_h(x, [l for _, _, l in layers])
    y = _siblings.lora_linear_given_h(x, *layers[0][:2], hs[0], layers[0][2])  # only the first used
    dx, da0, da1 = torch.autograd.grad(y.sum(), [x, layers[0][2].A, layers[1][2].A], allow_unused=True)
    ref = torch.autograd.grad(lora_linear(x, *layers[0]).sum(), [x, layers[0][2].A])
    assert_close(dx, ref[0], torch.float32, "dx")
    assert_close(da0, ref[1], torch.float32, "dA0")
    assert da1 is None or da1.abs().max() == 0


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("used", [(0, 1, 2), (0, 2)], ids=["all", "one-unused"])
def test_compiled_tokens_sum_dx_over_the_siblings_in_one_op(impl, used):
    """Compiled with the siblings' weights, x's gradient is one lora_siblings_dx over the siblings
    whose outputs got a gradient (given_h makes no dx of its own), equal to lora_linear per layer;
    a sibling on another weight than the token's (a pre-hook's) makes its own dx."""
    from tests._backends import fastaf_ops_backend

    layers = siblings()
    x = torch.randn(3, 7, 24, requires_grad=True)
    dys = [torch.randn(3, 7, w.shape[0]) for w, _, _ in layers]

    def f(x, loras, other_weight):
        hs, tokens = _siblings.shared_h_fanned(x, loras, [w for w, _, _ in layers], impl=impl)
        ws = [w for w, _, _ in layers]
        ws[1] = other_weight  # the middle sibling's call gets another weight: its token is not used
        return [_siblings.lora_linear_given_h(x, w, b, h, l, impl=impl, token=t if w is layers[i][0] else None)
                for i, ((_, b, _), w, h, l, t) in enumerate(zip(layers, ws, hs, loras, tokens))]

    backend, ops = fastaf_ops_backend()
    other = layers[1][0] * 1.5
    ys = torch.compile(f, fullgraph=True, backend=backend)(x, [l for _, _, l in layers], other)
    refs = [lora_linear(x, w if i != 1 else other, b, l, impl="torch") for i, (w, b, l) in enumerate(layers)]
    inputs = [x] + [t for _, _, l in layers for t in (l.A, l.B)]
    grads = torch.autograd.grad([ys[i] for i in used], inputs, [dys[i] for i in used], allow_unused=True)
    grads0 = torch.autograd.grad([refs[i] for i in used], inputs, [dys[i] for i in used], allow_unused=True)
    key = "tf32" if impl == "triton" else torch.float32
    for i in range(3):
        assert_close(ys[i], refs[i], key, f"y{i}")
    for name, g, g0 in zip(["dx"] + [f"d{f}{i}" for i in range(3) for f in "AB"], grads, grads0):
        if g0 is None:
            assert g is None or g.abs().max() == 0, name
        else:
            assert_close(g, g0, key, name)
    assert ops["lora_siblings_dx"] == 1 and ops["lora_given_h_bwd"] == 3, ops  # AOT traces every output's


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", ["three", "four", "strided"])
def test_siblings_dx_in_one_launch_or_summed_apart(impl, case):
    """lora_siblings_dx over up to three siblings (one launch on the kernels), four (beyond the
    gemm's segments: cuBLAS sums), or a dy without unit stride (likewise): sum_i dy_i @ W_i + dh @ A."""
    g = torch.Generator().manual_seed(0)
    ns = (16, 8, 8, 4) if case == "four" else (16, 8, 8)
    dys = [torch.randn(12, n, generator=g) for n in ns]
    if case == "strided":
        dys[1] = torch.randn(8, 12, generator=g).T  # (12, 8), stride (1, 12)
    ws = [torch.randn(n, 24, generator=g) for n in ns]
    dh, a = torch.randn(12, 10, generator=g), torch.randn(10, 24, generator=g)
    want = sum(d.double() @ w.double() for d, w in zip(dys, ws)) + dh.double() @ a.double()
    got = torch.ops.fastaf.lora_siblings_dx(dys, ws, dh, a, ns[0], 4, impl)
    assert_close(got, want, "tf32" if impl == "triton" else torch.float32, "dx")


@pytest.mark.parametrize("op", ["shared_h", "shared_da", "given_h_fwd", "given_h_bwd", "siblings_dx"])
def test_opcheck(op):
    x, a, w, bias = torch.randn(7, 6), torch.randn(5, 6), torch.randn(4, 6), torch.randn(4)
    h = torch.randn(7, 8)[:, 1:6]  # a sibling's column slice of the shared h: strided
    b, dy = torch.randn(4, 5), torch.randn(7, 4)
    args = {
        "shared_h": (x, a, 4, 2, "torch"),  # n, r: the first sibling's N and rank (of the stacked 5)
        "shared_da": (torch.randn(7, 5), x, 4, 2, "torch"),
        "given_h_fwd": (x, w, bias, h, b, 0.7, "torch"),
        "given_h_bwd": (dy, x, w, a, b, h, 0.7, True, "torch"),
        "siblings_dx": ([dy, torch.randn(7, 3)], [w, torch.randn(3, 6)], torch.randn(7, 5), a, 4, 2, "torch"),
    }[op]
    torch.library.opcheck(getattr(torch.ops.fastaf, f"lora_{op}"), args)
    if op == "given_h_bwd":
        torch.library.opcheck(torch.ops.fastaf.lora_given_h_bwd, args[:7] + (False, "torch"))


# ---- through functional_call: sharing on against off --------------------------------------------


@pytest.fixture
def count_shared(monkeypatch):
    """Counts shared_h calls (one per group of siblings sharing an input) made by functional_call."""
    calls = []
    real = _use.shared_h_fanned
    monkeypatch.setattr(_use, "shared_h_fanned",
                        lambda x, loras, weights, **kw: calls.append(len(loras)) or real(x, loras, weights, **kw))
    return calls


def both(f, set_flags):
    """f() with siblings sharing h (also eagerly), then with every layer alone."""
    set_flags(share_input="always")
    shared = f()
    set_flags(share_input="never")
    alone = f()
    set_flags(share_input="always")
    return shared, alone


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2-bias"])
def test_functional_call_grad_equal_with_and_without_sharing(make, impl, count_shared, monkeypatch, set_flags):
    base, ids = make(layers=1), token_batch()  # one layer: the interpreter runs each slowly on CI
    ad = random_adapter(base, ALL_LINEAR)
    loss = lambda a: fa.functional_call(base, a, (ids,), impl=impl).logits.pow(2).mean()  # noqa: E731
    (g, v), (g0, v0) = both(lambda: torch.func.grad_and_value(loss)(ad), set_flags)
    # per layer: q (with k, v, o as candidates), then gate (with up); k, v, up take their slices
    assert count_shared == [4, 2] * base.config.num_hidden_layers
    key = torch.float32 if impl == "torch" else "tf32"
    assert_close(v, v0, key, "loss")
    for a, b in zip(leaves(g), leaves(g0)):
        assert_close(a, b, key, "grad")


def test_cross_attention_keys_and_values_share_the_encoder_output(count_shared, monkeypatch, set_flags):
    """BART's decoder cross-attention: q reads the decoder, k and v the encoder output; so q's
    group is started again at k, whose slice v then takes."""
    base = tiny_bart()
    ad = random_adapter(base, ["q_proj", "k_proj", "v_proj"])
    ids = token_batch()
    loss = lambda a: fa.functional_call(base, a, (ids,), {"decoder_input_ids": ids[:, :5]}).logits.pow(2).mean()  # noqa: E731
    (g, v), (g0, v0) = both(lambda: torch.func.grad_and_value(loss)(ad), set_flags)
    # encoder layers: q, k, v; decoder layers: self-attention q, k, v, then cross-attention q
    # (its group of three) and k (k and v over the encoder output)
    assert count_shared == [3, 3] + [3, 3, 2] * 2
    assert_close(v, v0, torch.float32, "loss")
    for a, b in zip(leaves(g), leaves(g0)):
        assert_close(a, b, torch.float32, "grad")


def test_autograd_double_backward_and_compile_with_sharing(count_shared, monkeypatch, set_flags):
    base, ids = tiny_llama(layers=1), token_batch()  # one layer: dynamo traces each, slowly on CI
    ad = random_adapter(base, ALL_LINEAR)
    ad = ad.map(lambda p, l: fa.LoRA(l.A.detach().requires_grad_(), l.B.detach().requires_grad_(), l.scale))
    loss = lambda a: fa.functional_call(base, a, (ids,)).logits.pow(2).mean()  # noqa: E731

    def second_order():
        grads = torch.autograd.grad(loss(ad), leaves(ad), create_graph=True)
        return torch.autograd.grad(sum(g.pow(2).sum() for g in grads), leaves(ad))

    hvp, hvp0 = both(second_order, set_flags)
    assert count_shared
    for a, b in zip(hvp, hvp0):
        assert_close(a, b, torch.float32, "grad of grad")

    # by default siblings share only under torch.compile, where no host time is spent per op
    set_flags(share_input="compiled")
    count_shared.clear()
    f = torch.func.grad_and_value(loss)
    g0, v0 = f(ad)
    assert count_shared == []
    g, v = torch.compile(f, fullgraph=True, backend="aot_eager")(ad)  # fullgraph: no graph break
    assert count_shared == [4, 2] * base.config.num_hidden_layers  # traced once, sharing
    assert rel_err(v, v0) < REL_TOL[torch.float32]
    for a, b in zip(leaves(g), leaves(g0)):
        assert_close(a, b, torch.float32, "compiled grad")


def test_no_sharing_under_dropout_or_vmap(count_shared, monkeypatch, set_flags):
    set_flags(share_input="always")
    base, ids = tiny_llama(), token_batch()
    ad = random_adapter(base, ALL_LINEAR, dropout=0.1)
    base.train()
    fa.functional_call(base, ad, (ids,))
    assert count_shared == []  # a dropout mask per layer
    base.eval()
    fa.functional_call(base, ad, (ids,))
    assert count_shared  # dropout is off in eval
    count_shared.clear()
    stack = fa.stack([random_adapter(base, ALL_LINEAR, seed=s) for s in range(2)])
    out = torch.func.vmap(lambda a: fa.functional_call(base, a, (ids,)).logits)(stack)
    assert count_shared == [] and out.shape[0] == 2  # vmap over a stack takes the grouped kernels


def qkv_1b(ranks, tokens: int, device: str = "cuda"):
    """q/k/v of the Llama-3.2-1B shape (K=2048; N 2048, 512, 512) at ``ranks`` in bf16, with an
    input x of (2, tokens // 2, 2048) and an output gradient per layer: (layers, x, dys)."""
    torch.manual_seed(0)
    layers = [(w.to(device, torch.bfloat16), None, fa.LoRA(l.A.detach().to(device).requires_grad_(),
                                                            l.B.detach().to(device).requires_grad_(), l.scale))
              for w, _, l in siblings(K=2048, ns=(2048, 512, 512), ranks=ranks)]
    x = torch.randn(2, tokens // 2, 2048, device=device, dtype=torch.bfloat16, requires_grad=True)
    dys = [torch.randn(2, tokens // 2, w.shape[0], device=device, dtype=torch.bfloat16) for w, _, _ in layers]
    return layers, x, dys


def assert_per_layer(ys, layers, x, dys):
    """ys and their gradients (x, every A and B) equal lora_linear's per layer, in bf16's tolerance."""
    loras = [l for _, _, l in layers]
    ys0 = [lora_linear(x, w, b, l, impl="torch") for w, b, l in layers]
    inputs = [x] + [t for l in loras for t in (l.A, l.B)]
    grads, grads0 = torch.autograd.grad(ys, inputs, dys), torch.autograd.grad(ys0, inputs, dys)
    for y, y0 in zip(ys, ys0):
        assert_close(y, y0, torch.bfloat16, "y")
    for g, g0 in zip(grads, grads0):
        assert_close(g, g0, torch.bfloat16, "grad")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("impl", ["auto", "triton"])
def test_gpu_bf16_llama_1b_attention_shapes(impl):
    """q/k/v of the Llama-3.2-1B shape (K=2048; N 2048, 512, 512; r=16) at M=4096, bf16, kernels
    against lora_linear per layer."""
    layers, x, dys = qkv_1b((16, 16, 16), 4096)
    hs = _siblings.shared_h(x, [l for _, _, l in layers], impl=impl)
    assert_per_layer([_siblings.lora_linear_given_h(x, w, b, h, l, impl=impl) for (w, b, l), h in zip(layers, hs)],
                     layers, x, dys)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("impl", ["auto", "triton"])
@pytest.mark.parametrize("ranks", [(16, 8, 40), (128, 128, 16)], ids=["sum-64", "sum-272"])
def test_gpu_compiled_siblings_of_mixed_ranks(ranks, impl):
    """q/k/v of the 1B shape at mixed ranks under Inductor (the stacked h and dA ops asked at the
    first sibling's own rank): values and gradients against lora_linear per layer. Summed to 272,
    beyond the kernels' padding, the stacked passes take cuBLAS, even under impl='triton'."""
    layers, x, dys = qkv_1b(ranks, 2048)

    def f(x, loras):
        hs, tokens = _siblings.shared_h_fanned(x, loras, [w for w, _, _ in layers], impl=impl)
        return [_siblings.lora_linear_given_h(x, w, b, h, l, impl=impl, token=t)
                for (w, b, _), h, l, t in zip(layers, hs, loras, tokens)]

    assert_per_layer(torch.compile(f, fullgraph=True)(x, [l for _, _, l in layers]), layers, x, dys)


class _TwoHeads(torch.nn.Module):
    """q and k over one input; ``mutate`` doubles it in place between them."""

    def __init__(self, mutate: bool = False):
        super().__init__()
        self.q, self.k, self.mutate = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), mutate

    def forward(self, x):
        q = self.q(x)
        if self.mutate:
            x = x.clone()  # the caller's x stays as it was
            q = self.q(x)
            x.mul_(2.0)
        return q * self.k(x)


def _two_heads(mutate=False):
    torch.manual_seed(0)
    m = _TwoHeads(mutate)
    ad = fa.init_adapter(m, fa.LoRAConfig(r=2, alpha=4, targets=["q", "k"]), seed=0)
    return m, ad.map(lambda p, l: fa.LoRA(torch.randn_like(l.A), torch.randn_like(l.B), l.scale)), torch.randn(3, 8)


@pytest.mark.parametrize("share", ["always", "compiled"])
def test_a_layer_running_again_or_an_input_changed_in_place_recomputes_h(share, monkeypatch, set_flags):
    """The slot of shared h never outlives its pass: a mode held over two passes (the factors
    updated in between) and an input changed in place between siblings both recompute."""
    m, ad, x = _two_heads()
    set_flags(share_input=share)
    run = torch.compile(m.forward, backend="aot_eager") if share == "compiled" else m.forward
    with torch.no_grad(), fa.functional.adapter_mode(m, ad):
        run(x)
        for lora in ad.values():
            lora.A.add_(1.0)
        second = run(x)
    set_flags(share_input="never")
    with torch.no_grad():
        assert_close(second, fa.functional_call(m, ad, (x,)), torch.float32, "second pass")

    m, ad, x = _two_heads(mutate=True)
    with torch.no_grad():
        ref = fa.functional_call(m, ad, (x,))
        set_flags(share_input=share)
        f = lambda x: fa.functional_call(m, ad, (x,))  # noqa: E731
        out = torch.compile(f, backend="aot_eager")(x) if share == "compiled" else f(x)
    assert_close(out, ref, torch.float32, "input changed in place")


def test_double_backward_when_one_siblings_output_enters_the_loss_linearly():
    """dy_q is a constant (y_q enters linearly) while dy_k carries history: k's dA must stay
    differentiable although q's dh, first in the group, carries none. Against plain torch maths."""
    (wq, bq, lq), (wk, bk, lk) = siblings(ns=(6, 6), ranks=(3, 2))
    x = torch.randn(5, 24)

    def second_order(shared):
        if shared:
            hq, hk = _siblings.shared_h(x, [lq, lk])
            yq, yk = (_siblings.lora_linear_given_h(x, wq, bq, hq, lq),
                      _siblings.lora_linear_given_h(x, wk, bk, hk, lk))
        else:
            yq, yk = ((torch.nn.functional.linear(x, w, b) + l.scale * (x @ l.A.T) @ l.B.T)
                      for w, b, l in ((wq, bq, lq), (wk, bk, lk)))
        grads = torch.autograd.grad(yq.sum() + yk.pow(2).sum(), [lk.A, lk.B], create_graph=True)
        return torch.autograd.grad(sum(g.pow(2).sum() for g in grads), [lk.A, lk.B])

    for a, b in zip(second_order(True), second_order(False)):
        assert_close(a, b, torch.float32, "grad of grad")
