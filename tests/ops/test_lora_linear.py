"""The op ``fastaf.functional.lora_linear``: reference maths, opcheck, gradcheck, transforms, errors.

The Triton kernels behind ``impl="triton"`` are tested in tests/kernels; here the torch path.
"""
import importlib
import os
import warnings

import pytest
import torch

import fastaf as fa
from fastaf.functional import lora_linear
from fastaf.ops.lora_linear import LoRALinearFn
from fastaf.kernels.dropout_hash import keep_mask
from tests._modes import needs_interpreter
from tests._tolerances import assert_close, varying

L = importlib.import_module("fastaf.ops.lora_linear")  # the module, not its public function


def make(M=7, K=6, N=5, r=3, dtype=torch.float32, bias=True, lead=(2,), seed=0, dropout=0.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, M, K, generator=g).to(dtype)
    w = torch.randn(N, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    lo = fa.LoRA(torch.randn(r, K, generator=g).to(dtype), torch.randn(N, r, generator=g).to(dtype), 0.7, dropout)
    return x, w, b, lo


def ref(x, w, b, lo):
    """fp64 formula from the spec: x @ W.T + b + s * (x @ A.T) @ B.T."""
    x, w, A, B = x.double(), w.double(), lo.A.double(), lo.B.double()
    y = x @ w.T + lo.scale * (x @ A.T) @ B.T
    return y if b is None else y + b.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
def test_forward_matches_formula(dtype, bias):
    x, w, b, lo = make(dtype=dtype, bias=bias, lead=(2, 3))
    y = lora_linear(x, w, b, lo)
    assert y.shape == (2, 3, 7, 5) and y.dtype == dtype
    assert_close(y, ref(x, w, b, lo), dtype)


def test_gradients_match_autograd_of_formula():
    x, w, b, lo = make(dtype=torch.float64)
    x.requires_grad_()
    A, B = lo.A.clone().requires_grad_(), lo.B.clone().requires_grad_()
    y = lora_linear(x, w, b, fa.LoRA(A, B, lo.scale))
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, A, B), dy)
    x2, A2, B2 = x.detach().requires_grad_(), lo.A.clone().requires_grad_(), lo.B.clone().requires_grad_()
    want = torch.autograd.grad(ref(x2, w, b, fa.LoRA(A2, B2, lo.scale)), (x2, A2, B2), dy)
    for g, wt, name in zip(got, want, ("dx", "dA", "dB")):
        assert_close(g, wt, torch.float64, name)


def test_frozen_weight_gets_no_grad_unless_it_asks():
    x, w, b, lo = make()
    A = lo.A.clone().requires_grad_()
    y = lora_linear(x, w, b, fa.LoRA(A, lo.B, lo.scale))
    y.sum().backward()
    assert w.grad is None and A.grad is not None
    w2, b2 = w.double().requires_grad_(), b.double().requires_grad_()
    y = lora_linear(x.double(), w2, b2, fa.LoRA(lo.A.double(), lo.B.double(), lo.scale))
    gw, gb = torch.autograd.grad(y.sum(), (w2, b2))
    assert_close(gw, x.double().reshape(-1, 6).sum(0).expand(5, 6), torch.float64, "dW")
    assert_close(gb, torch.full((5,), 14.0, dtype=torch.float64), torch.float64, "dbias")


def test_noncontiguous_and_tied_weight():
    x, w, b, lo = make()
    wt = w.T.contiguous().T  # same values, column-major strides
    assert not wt.is_contiguous()
    assert_close(lora_linear(x, wt, b, lo), ref(x, w, b, lo), torch.float32)
    # one tensor used as the weight of two calls (tied) accumulates both gradients
    w2 = w.clone().requires_grad_()
    (lora_linear(x, w2, b, lo).sum() + lora_linear(x, w2, b, lo).sum()).backward()
    assert_close(w2.grad, 2 * torch.ones(2 * 7, 5).T @ x.reshape(-1, 6), torch.float32, "tied dW")


def test_fp32_adapter_with_bf16_activations_gives_fp32_grads():
    x, w, b, lo = make(dtype=torch.bfloat16)
    A = lo.A.float().requires_grad_()
    y = lora_linear(x, w, b, fa.LoRA(A, lo.B.float(), lo.scale))
    assert y.dtype == torch.bfloat16
    (g,) = torch.autograd.grad(y.float().sum(), A)
    assert g.dtype == torch.float32


def test_dropout_mask_scaling_and_eval():
    x, w, b, lo = make(M=64, K=32, dropout=0.25, lead=())
    torch.manual_seed(3)
    y = lora_linear(x, w, b, lo)
    torch.manual_seed(3)
    seed = torch.randint(0, 2**31 - 1, (1,))
    keep = keep_mask(seed, 64, 32, 0.25, x.device)
    assert 0.7 < keep.float().mean() < 0.8
    xd = x * keep / 0.75
    want = x.double() @ w.double().T + b.double() + lo.scale * (xd.double() @ lo.A.double().T) @ lo.B.double().T
    assert_close(y, want, torch.float32)
    assert_close(lora_linear(x, w, b, lo, training=False), ref(x, w, b, lo), torch.float32)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_gradcheck_fp64(dropout):
    x, w, b, lo = make(M=4, K=3, N=2, r=2, dtype=torch.float64, lead=())
    seed = torch.tensor([11]) if dropout else None
    args = [t.unsqueeze(0).requires_grad_() for t in (x, w, b, lo.A, lo.B)]
    fn = lambda *t: LoRALinearFn.apply(*t, 0.7, dropout, seed, "torch")[0]
    assert torch.autograd.gradcheck(fn, args)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_gradcheck_fp64_eager_path(dropout):
    """Plain eager calls take _LoRALinearDirect (no group axis): gradcheck it with leading dims."""
    x, w, b, lo = make(M=3, K=3, N=2, r=2, dtype=torch.float64, lead=(2,))
    args = [t.clone().requires_grad_() for t in (x, w, b, lo.A, lo.B)]

    def fn(x, w, b, A, B):
        torch.manual_seed(5)  # the same dropout seed on every evaluation
        return lora_linear(x, w, b, fa.LoRA(A, B, 0.7, dropout))

    assert "_LoRALinearDirect" in type(fn(*args).grad_fn).__name__
    assert torch.autograd.gradcheck(fn, args)


@pytest.mark.parametrize("op", ["fwd", "bwd"])
def test_opcheck(op):
    x, w, b, lo = make(lead=())
    x3, w3, b3, A3, B3 = x[None], w[None], b[None], lo.A[None], lo.B[None]
    seed = torch.tensor([5])
    if op == "fwd":
        torch.library.opcheck(torch.ops.fastaf.lora_linear_fwd, (x3, w3, b3, A3, B3, 0.7, 0.1, seed, "torch"))
        torch.library.opcheck(torch.ops.fastaf.lora_linear_fwd, (x3, w3, None, A3, B3, 0.7, 0.0, None, "auto"))
    else:
        _, h = torch.ops.fastaf.lora_linear_fwd(x3, w3, b3, A3, B3, 0.7, 0.1, seed, "torch")
        dy = torch.randn(1, 7, 5)
        for needs_dx in (True, False):
            torch.library.opcheck(
                torch.ops.fastaf.lora_linear_bwd, (dy, x3, w3, A3, B3, h, 0.7, 0.1, seed, needs_dx, "torch")
            )


def test_compile_fullgraph_matches_eager_without_graph_breaks():
    x, w, b, lo = make()

    def f(x, lo):
        return torch.nn.functional.gelu(lora_linear(x, w, b, lo)).sum(-1)

    explained = torch._dynamo.explain(f)(x, lo)
    assert explained.graph_break_count == 0, explained.break_reasons
    # the autograd.Function is one opaque call in dynamo's graph (no speculated forward/backward
    # subgraphs: the compile-time cost it replaced), which AOTAutograd traces
    calls = [str(n.target) for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert any("LoRALinearFn_apply" in c for c in calls) and not any("autograd_function_apply" in c for c in calls), calls
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, lo), f(x, lo))
    g = torch.compile(torch.func.grad(lambda lo: f(x, lo).sum()), fullgraph=True, backend="aot_eager")(lo)
    g_eager = torch.func.grad(lambda lo: f(x, lo).sum())(lo)
    torch.testing.assert_close(g.A, g_eager.A)


def test_vmap_over_stack_and_inputs_has_no_fallback():
    x, w, b, lo = make(lead=())
    los = [fa.LoRA(lo.A * (i + 1), lo.B, lo.scale) for i in range(3)]
    st = fa.stack([fa.Adapter({"l": l}) for l in los])["l"]
    xs = torch.randn(3, 7, 6)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*performance drop.*")
        y_ad = torch.func.vmap(lambda l: lora_linear(x, w, b, l))(st)
        y_both = torch.func.vmap(lambda xi, l: lora_linear(xi, w, b, l))(xs, st)
        g = torch.func.vmap(torch.func.grad(lambda l: lora_linear(x, w, b, l).square().sum()))(st)
    for i, l in enumerate(los):
        assert_close(y_ad[i], ref(x, w, b, l), torch.float32, f"adapter {i}")
        assert_close(y_both[i], ref(xs[i], w, b, l), torch.float32, f"x and adapter {i}")
        gi = torch.func.grad(lambda l: lora_linear(x, w, b, l).square().sum())(l)
        assert_close(g.A[i], gi.A, torch.float32, f"dA {i}")


def test_transforms_route_to_the_direct_vjp_or_the_function():
    """One grad level innermost (vmap outside it allowed) takes _LoRALinearDirect; the rest
    (vmap innermost, grad of grad) functorch's handling of LoRALinearFn."""
    x, w, b, lo = make(lead=())
    seen = []

    def probe(l):
        seen.append(L._direct_level(x, w, b, l.A, l.B))
        return lora_linear(x, w, b, l).square().sum()

    st = fa.stack([fa.Adapter({"l": lo})] * 2)["l"]
    probe(lo)
    torch.func.grad(probe)(lo)
    torch.func.vmap(torch.func.grad(probe))(st)
    torch.func.vmap(probe)(st)
    torch.func.grad(lambda l: torch.func.vmap(probe)(l).sum())(st)
    torch.func.grad(lambda l: torch.func.grad(probe)(l).A.sum())(lo)
    assert seen[0] == 0 and seen[1] > 0 and seen[2] > 0 and seen[3:] == [-1, -1, -1]


def test_direct_vjp_under_grad_and_vmap_grad_equals_autograd(monkeypatch):
    x, w, b, lo = make(lead=(2,))
    los = [fa.LoRA(lo.A * (i + 1), lo.B - i, lo.scale) for i in range(3)]

    def refuse(*args):
        raise AssertionError("took functorch's path for LoRALinearFn")

    def autograd_grads(l):
        A, B = l.A.clone().requires_grad_(), l.B.clone().requires_grad_()
        lora_linear(x, w, b, fa.LoRA(A, B, l.scale)).square().sum().backward()
        return A.grad, B.grad

    want = [autograd_grads(l) for l in los]
    monkeypatch.setattr(L.LoRALinearFn, "apply", refuse)
    loss = lambda l: lora_linear(x, w, b, l).square().sum()
    for l, (dA, dB) in zip(los, want):
        g = torch.func.grad(loss)(l)
        assert_close(g.A, dA, torch.float32, "dA") and assert_close(g.B, dB, torch.float32, "dB")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*performance drop.*")
        g = torch.func.vmap(torch.func.grad(loss))(fa.stack([fa.Adapter({"l": l}) for l in los])["l"])
    for i, (dA, dB) in enumerate(want):
        assert_close(g.A[i], dA, torch.float32, f"dA {i}")
        assert_close(g.B[i], dB, torch.float32, f"dB {i}")


def test_vmap_dropout_needs_randomness_flag():
    x, w, b, lo = make(lead=(), dropout=0.2)
    st = fa.stack([fa.Adapter({"l": lo})] * 2)["l"]
    with pytest.raises(RuntimeError, match="randomness"):
        torch.func.vmap(lambda l: lora_linear(x, w, b, l))(st)
    y = torch.func.vmap(lambda l: lora_linear(x, w, b, l), randomness="different")(st)
    assert not torch.equal(y[0], y[1])
    y = torch.func.vmap(lambda l: lora_linear(x, w, b, l), randomness="same")(st)
    assert torch.equal(y[0], y[1])


def test_bad_inputs_are_named():
    x, w, b, lo = make()
    with pytest.raises(TypeError, match="int64"):
        lora_linear(x.long(), w, b, lo)
    with pytest.raises(TypeError, match=r"weight \(5, 6\) is torch.float64"):
        lora_linear(x, w.double(), b, lo)
    with pytest.raises(ValueError, match=r"expected A \(r, 6\)"):
        lora_linear(x, w, b, fa.LoRA(torch.randn(3, 4), torch.randn(5, 3)))
    with pytest.raises(ValueError, match="is on meta"):
        lora_linear(x, w, b, fa.LoRA(lo.A.to("meta"), lo.B.to("meta")))
    with pytest.raises(ValueError, match="impl"):
        lora_linear(x, w, b, lo, impl="cuda")
    with pytest.raises(ValueError, match="stacked"):
        lora_linear(x, w, b, fa.stack([fa.Adapter({"l": lo})])["l"])
    with pytest.raises(ValueError, match=r"input x must be a tensor of shape \(\.\.\., K\), got a 0-d tensor"):
        lora_linear(torch.tensor(1.0), w, b, lo)


def test_one_dimensional_input_works_like_f_linear():
    x, w, b, lo = make()
    assert_close(lora_linear(x[0, 0], w, b, lo), lora_linear(x, w, b, lo)[0, 0], x.dtype)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU needs TRITON_INTERPRET=1")
def test_triton_path_under_func_grad_matches_reference():
    """torch.func.grad reaches the kernels with its grad level peeled off (first-order VJP)."""
    x, w, b, lo = make(M=9, K=12, N=10, r=3, lead=())
    grads = {
        impl: torch.func.grad(lambda l, xx: lora_linear(xx, w, b, l, impl=impl).square().sum(), argnums=(0, 1))(lo, x)
        for impl in ("torch", "triton")
    }
    (g_lo, g_x), (r_lo, r_x) = grads["triton"], grads["torch"]
    assert_close(g_lo.A, r_lo.A, torch.float32, "dA")
    assert_close(g_lo.B, r_lo.B, torch.float32, "dB")
    assert_close(g_x, r_x, torch.float32, "dx")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_triton_eager_path_matches_reference(dropout):
    """The eager fast path into the kernels: leading dims, bias, fp32 factors on fp32 x, all grads."""
    x, w, b, lo = make(M=5, K=12, N=10, r=3, lead=(2,), dropout=dropout)
    out = {}
    for impl in ("torch", "triton"):
        leaves = [t.clone().requires_grad_() for t in (x, w, b, lo.A, lo.B)]
        torch.manual_seed(1)
        y = lora_linear(*leaves[:3], fa.LoRA(*leaves[3:], lo.scale, dropout), impl=impl)
        out[impl] = (y, *torch.autograd.grad(y, leaves, torch.ones_like(y) + y.detach()))
    for got, want, name in zip(out["triton"], out["torch"], ("y", "dx", "dW", "dbias", "dA", "dB")):
        assert got.shape == want.shape, name
        assert_close(got, want, torch.float32, name)


def test_double_backward_in_plain_autograd_matches_the_formula():
    """A gradient penalty: the plain-autograd VJP stays differentiable on the torch path."""
    x, w, b, lo = make(dtype=torch.float64)
    A, B = lo.A.clone().requires_grad_(), lo.B.clone().requires_grad_()
    xg = x.clone().requires_grad_()

    def penalty(f):
        (gx,) = torch.autograd.grad(f(xg).square().sum(), xg, create_graph=True)
        return torch.autograd.grad(gx.square().sum(), (A, B))

    got = penalty(lambda xx: lora_linear(xx, w, b, fa.LoRA(A, B, lo.scale)))
    want = penalty(lambda xx: xx @ w.T + b + lo.scale * (xx @ A.T) @ B.T)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_create_graph_with_a_constant_cotangent_stays_differentiable(impl):
    """dA of y.sum() (a cotangent without history) still depends on B: with create_graph the VJP
    records it, so a penalty on dA has a gradient for B (it used to come back without a graph)."""
    if impl == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1")
    x, w, b, lo = make(lead=())
    A, B = lo.A.clone().requires_grad_(), lo.B.clone().requires_grad_()

    def penalty(f):
        (ga,) = torch.autograd.grad(f(x).sum(), A, create_graph=True)
        return torch.autograd.grad(ga.square().sum(), B)[0]

    got = penalty(lambda xx: lora_linear(xx, w, b, fa.LoRA(A, B, lo.scale), impl=impl))
    want = penalty(lambda xx: xx @ w.T + b + lo.scale * (xx @ A.T) @ B.T)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_grad_of_grad_through_the_op_equals_plain_torch(impl):
    """A Hessian-vector product through the op (torch.func.grad of grad, and autograd's double
    backward): the backward is differentiated, not taken as a constant (it once gave zeros)."""
    torch.manual_seed(0)
    K, N, r = 8, 6, 3
    w, A, B = torch.randn(N, K, dtype=torch.float64), torch.randn(r, K, dtype=torch.float64), torch.randn(N, r, dtype=torch.float64)
    x, v = torch.randn(4, K, dtype=torch.float64), torch.randn(4, K, dtype=torch.float64)

    def hvp(fn):
        f = lambda x: (fn(x) ** 3).sum()
        return torch.func.grad(lambda x: (torch.func.grad(f)(x) * v).sum())(x)

    want = hvp(lambda x: x @ w.T + 0.5 * (x @ A.T) @ B.T)
    if impl == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU kernels need TRITON_INTERPRET=1")
    if impl == "triton":  # the kernels take fp32 (not fp64): compare in fp32
        w, A, B, x, v = (t.float() for t in (w, A, B, x, v))
        want = want.float()
    got = hvp(lambda x: fa.functional.lora_linear(x, w, None, fa.LoRA(A, B, 0.5), impl=impl))
    tol = 1e-10 if impl == "torch" else 1e-4
    assert torch.allclose(got, want, rtol=tol, atol=tol)
    xg = x.clone().requires_grad_()
    (g,) = torch.autograd.grad((fa.functional.lora_linear(xg, w, None, fa.LoRA(A, B, 0.5), impl=impl) ** 3).sum(),
                               xg, create_graph=True)
    (hv,) = torch.autograd.grad((g * v).sum(), xg)
    assert torch.allclose(hv, want, rtol=tol, atol=tol)


VJP_FN_TRANSFORMS = {  # name -> transform of f (A -> (M, N)), each built on torch.func.vjp's vjp_fn
    "vjp_fn": lambda f, A, v: torch.func.vjp(f, A)[1](torch.ones_like(f(A)))[0],
    "jacrev": lambda f, A, v: torch.func.jacrev(f)(A),
    "hessian": lambda f, A, v: torch.func.hessian(lambda a: f(a).tanh().sum())(A),
    "jvp of vjp_fn": lambda f, A, v: torch.func.jvp(
        lambda a: torch.func.vjp(lambda b: f(b).tanh().sum(), a)[1](torch.ones(()))[0], (A,), (v,))[1],
    "grad of vjp_fn": lambda f, A, v: torch.func.grad(
        lambda a: (torch.func.vjp(lambda b: f(b).tanh().sum(), a)[1](torch.ones(()))[0] * v).sum())(A),
    "grad of a vjp_fn made before": lambda f, A, v: (lambda vjp_fn: torch.func.grad(
        lambda c: (vjp_fn(c)[0] ** 2).sum())(f(A).detach()))(torch.func.vjp(f, A)[1]),
    # vmap inside vjp: functorch's generic Function path, whose level number the new grad reuses
    "grad of a vjp_fn over vmap made before": lambda f, A, v: (lambda vjp_fn: torch.func.grad(
        lambda c: (vjp_fn(c)[0] ** 2).sum())(torch.stack([f(A)] * 2).detach()))(
        torch.func.vjp(lambda a: torch.func.vmap(lambda _: f(a))(torch.zeros(2)), A)[1]),
}


@pytest.mark.parametrize("impl,dtype,device", [
    ("torch", torch.float64, "cpu"), ("torch", torch.float32, "cpu"),
    pytest.param("triton", torch.float32, "cpu", marks=needs_interpreter),
    pytest.param("triton", torch.float32, "cuda", marks=pytest.mark.gpu),
])
@pytest.mark.parametrize("transform", sorted(VJP_FN_TRANSFORMS))
def test_transforms_through_a_vjp_fn_equal_the_formulas(transform, impl, dtype, device):
    """vjp_fn runs the backward after vjp's level has left the stack. The second derivatives came out
    zero (taken as first order), a vjp_fn at top level asserted inside functorch, jacrev failed in
    functorch's plumbing (and on the kernels, fed vmap's batched cotangent), and a grad over a vjp_fn
    made before popped the grad's own level, or, on the generic path, read as first order (wrong)."""
    x, w, b, lo = make(M=3, K=6, N=5, r=2, lead=(), dtype=dtype)
    x, w, b, lo = x.to(device), w.to(device), b.to(device), fa.LoRA(lo.A.to(device), lo.B.to(device), lo.scale)
    v = torch.randn(lo.A.shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    op = lambda A: lora_linear(x, w, b, fa.LoRA(A, lo.B, lo.scale), impl=impl)  # noqa: E731
    formula = lambda A: x @ w.T + b + lo.scale * (x @ A.T) @ lo.B.T  # noqa: E731
    got, want = (VJP_FN_TRANSFORMS[transform](f, lo.A, v) for f in (op, formula))
    assert want.abs().sum() > 0
    tol = 1e-10 if dtype == torch.float64 else 1e-5 if impl == "torch" else 2e-4  # the kernels' dots: tf32
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU needs TRITON_INTERPRET=1")
def test_compiled_op_reads_fp32_factors_as_the_eager_path_does():
    """fp32 master factors beside fp16 x: compiled, the op takes them as they are, like the eager
    path, so the same kernels see the same operands and y and the fp32 factor gradients agree
    exactly. (Compiled calls used to cast A and B to fp16 first: rounded factors, and gradients
    rounded to fp16 before the cast back.)"""
    x, w, b, lo = make(M=24, K=32, N=16, r=4, lead=(2,))
    x, w, b = x.half(), w.half(), b.half()
    factors = [lo.A.clone().requires_grad_(), lo.B.clone().requires_grad_()]

    def loss(a, b_):
        return lora_linear(x, w, b, fa.LoRA(a, b_, lo.scale), impl="triton").float().square().sum()

    eager = torch.autograd.grad(loss(*factors), factors)
    compiled = torch.autograd.grad(torch.compile(loss, fullgraph=True, backend="aot_eager")(*factors), factors)
    for name, got, want in zip(("dA", "dB"), compiled, eager):
        assert got.dtype == torch.float32, name
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("factor_dtype", [torch.float32, torch.float64])
def test_kernel_ops_take_factors_in_another_dtype(factor_dtype):
    """The registered ops on the kernels with factors in another dtype than x: fp32 masters beside
    fp16 x (read as they are; dA starts its own storage, as the fake says: Inductor asserts its
    alignment) and float64 factors beside fp32 x (cast for the kernels, gradients back in float64),
    eagerly and compiled."""
    x, w, b, lo = make(M=5, K=32, N=24, r=3, lead=())
    x_dtype = torch.float16 if factor_dtype == torch.float32 else torch.float32
    x3, w3 = x.to(x_dtype)[None], w.to(x_dtype)[None]
    a3, b3 = lo.A.to(factor_dtype)[None], lo.B.to(factor_dtype)[None]
    y, h = torch.ops.fastaf.lora_linear_fwd(x3, w3, None, a3, b3, 0.5, 0.0, None, "triton")
    args = (torch.randn_like(y), x3, w3, a3, b3, h, 0.5, 0.0, None, True, "triton")
    torch.library.opcheck(torch.ops.fastaf.lora_linear_bwd.default, args, test_utils=("test_faketensor",))
    dx, da, db = torch.ops.fastaf.lora_linear_bwd(*args)
    assert da.storage_offset() == 0 and (da.dtype, db.dtype) == (factor_dtype, factor_dtype)
    factors = [lo.A.to(factor_dtype).requires_grad_(), lo.B.to(factor_dtype).requires_grad_()]

    def loss(a, b_):
        return lora_linear(x3[0], w3[0], None, fa.LoRA(a, b_, 0.5), impl="triton").float().sum()

    for run in (loss, torch.compile(loss, fullgraph=True, backend="aot_eager")):
        grads = torch.autograd.grad(run(*factors), factors)
        assert [g.dtype for g in grads] == [factor_dtype, factor_dtype]


def _no_replay(keys: list[list], held: list[int], captures: int) -> str:
    """What a training loop whose launches never replayed saw: per step its graphed calls, the MiB
    it held, and which parts of the first call's key moved (tensors: address deltas)."""
    from fastaf.intercept import groups as _group
    from fastaf.kernels import launch_graphs

    firsts = [(i, step[0]) for i, step in enumerate(keys) if step]
    moved = [(i1, [(j, a[0] - b[0] if isinstance(a, tuple) and isinstance(b, tuple) else (a, b))
                   for j, (a, b) in enumerate(zip(k0, k1)) if a != b])
             for (_, k0), (i1, k1) in zip(firsts, firsts[1:])]
    return (f"captures {launch_graphs.GRAPHS.captures - captures}, graphs held {len(launch_graphs.GRAPHS.graphs)}, "
            f"keys seen {len(launch_graphs.GRAPHS.seen)}, graphed calls per step {[len(k) for k in keys]}, "
            f"MiB held per step {held}, the first call's key moved at steps {moved}, "
            f"groups learned {len(_group.learned())}, "
            f"functorch levels {torch._C._functorch.get_interpreter_stack()}, autocast {torch.is_autocast_enabled()}, "
            f"deterministic {torch.are_deterministic_algorithms_enabled()}")


# A loop replays once the caching allocator hands each call the same blocks step after step. From
# an empty cache that takes a few steps; after other GPU work in the process it can take longer:
# seen on an H100 (2026-11-25/26) in the full GPU suite, where every call's key was new at each of
# 8 steps, with 64 MiB held after each (no leak), and neither gc.collect() nor GRAPHS.clear() first
# changed it. The loop with graphs runs until its calls have replayed for a few steps.
_MAX_STEPS, _STEPS_REPLAYING = 32, 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_training_steps_replaying_launch_graphs_equal_launching(monkeypatch):
    """A training loop over a model (eager functional_call + autograd + SGD) replays the adapted
    layers' launches from CUDA graphs: its losses and factors follow the loop that launches."""
    import torch.utils._pytree as pytree

    from fastaf.kernels import launch_graphs
    from tests._models import random_adapter, tiny_llama, token_batch

    model = tiny_llama(dtype=torch.bfloat16).cuda()
    ids = token_batch().cuda()
    start = random_adapter(model, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    keys: list[list] = []  # each step's graphed calls' keys, in call order (for the failure message)
    held: list[int] = []  # MiB allocated after each step: a leak moves every step's addresses
    run = launch_graphs.GRAPHS.run
    monkeypatch.setattr(launch_graphs.GRAPHS, "run", lambda key, device, launch: (keys[-1].append(key),
                                                                            run(key, device, launch))[1])
    monkeypatch.setattr(launch_graphs.GRAPHS, "enabled", launch_graphs.GRAPHS.enabled)  # restored after the test

    def train(graphs: bool, steps: int) -> tuple[list[float], list[torch.Tensor], int]:
        """(losses, factors, steps that replayed) after ``steps`` steps, or with graphs on, once
        ``_STEPS_REPLAYING`` steps have replayed."""
        launch_graphs.GRAPHS.enabled = graphs
        keys.clear()
        held.clear()
        torch.cuda.empty_cache()
        leaves, spec = pytree.tree_flatten(start)
        leaves = [t.detach().cuda().clone().requires_grad_() for t in leaves]
        opt = torch.optim.SGD(leaves, lr=0.5)
        losses, replaying = [], 0
        for _ in range(steps):
            keys.append([])
            before = launch_graphs.GRAPHS.replays - launch_graphs.GRAPHS.captures  # a capture's own replay not counted
            out = fa.functional_call(model, pytree.tree_unflatten(leaves, spec), (ids,), {"labels": ids},
                                     impl="triton")
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(out.loss.item())
            held.append(torch.cuda.memory_allocated() >> 20)
            replaying += launch_graphs.GRAPHS.replays - launch_graphs.GRAPHS.captures > before
            if graphs and replaying == _STEPS_REPLAYING:
                break
        return losses, leaves, replaying

    captures = launch_graphs.GRAPHS.captures
    got_losses, got, replaying = train(True, _MAX_STEPS)
    assert replaying, f"no layer replayed its graph in {_MAX_STEPS} steps ({_no_replay(keys, held, captures)})"
    want_losses, want, _ = train(False, len(got_losses))
    torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(want_losses), rtol=2e-2, atol=0)
    assert want_losses[-1] < want_losses[0]  # the loop trains: the factors move
    for g, w in zip(got, want):
        assert_close(g.detach(), w.detach().double(), torch.bfloat16, f"factor after {len(got_losses)} steps")


def test_aot_autograd_cache_serves_a_compiled_fastaf_step_again():
    """A compiled forward + backward through every traced Function (siblings' shared h and given
    h, a lone layer) compiled again after dynamo and the in-memory code caches are cleared, as in
    a new process: AOTAutograd's cache serves it (unmarked, it would bypass fastaf's opaque calls),
    with the same loss and gradients."""
    from torch._dynamo.utils import counters
    from torch._inductor import codecache, utils as inductor_utils

    from tests._models import random_adapter, tiny_llama, token_batch

    fresh_cache = getattr(inductor_utils, "fresh_cache", None) or inductor_utils.fresh_inductor_cache
    base = tiny_llama(layers=1)
    ad = random_adapter(base, ["q_proj", "k_proj", "v_proj", "down_proj"])
    leaves = [t.detach().requires_grad_() for t in torch.utils._pytree.tree_leaves(ad)]
    adapter = torch.utils._pytree.tree_unflatten(leaves, torch.utils._pytree.tree_structure(ad))
    ids = token_batch()
    runs = []
    with fresh_cache(), torch._functorch.config.patch(enable_autograd_cache=True):
        for _ in range(2):
            torch._dynamo.reset()
            codecache.PyCodeCache.cache_clear(purge=True)
            counters.clear()
            step = torch.compile(lambda i: fa.functional_call(base, adapter, (i,), {"labels": i}).loss, fullgraph=True)
            loss = step(ids)
            runs.append((dict(counters["aot_autograd"]), loss.detach(), torch.autograd.grad(loss, leaves)))
    torch._dynamo.reset()
    (first, loss0, grads0), (second, loss1, grads1) = runs
    assert first.get("autograd_cache_miss") == 1 and second.get("autograd_cache_hit") == 1, (first, second)
    assert torch.equal(loss0, loss1) and all(torch.equal(a, b) for a, b in zip(grads0, grads1))


@pytest.mark.parametrize("lead,factor_dtype", [((6,), torch.float32), ((2, 3), torch.float32), ((6,), torch.float64)],
                         ids=["2d", "3d", "fp64-factors"])
def test_double_backward_through_chained_layers_equals_torch(lead, factor_dtype):
    """Plain autograd's create_graph through two chained layers: d/d(A1, A2, B2) of |dL/dA2|^2;
    the A1 term runs through the second layer's input: a 3-D input keeps that term (the layer must not
    save its input reshaped where grad is off), and so do factors in another dtype than x (no
    saved cast)."""
    g = torch.Generator().manual_seed(0)
    K, r = 8, 2
    w1, w2 = torch.randn(K, K, generator=g), torch.randn(K, K, generator=g)
    factors = [torch.randn(r, K, generator=g, dtype=factor_dtype), torch.randn(K, r, generator=g, dtype=factor_dtype)] * 2
    x = torch.randn(*lead, K, generator=g)

    def second(layer):
        a1, b1, a2, b2 = (t.clone().requires_grad_() for t in factors)
        y = layer(torch.tanh(layer(x, w1, a1, b1)), w2, a2, b2)
        (da2,) = torch.autograd.grad(y.pow(3).sum(), a2, create_graph=True)
        return torch.cat([g.flatten() for g in torch.autograd.grad(da2.square().sum(), (a1, a2, b2))])

    got = second(lambda x, w, a, b: lora_linear(x, w, None, fa.LoRA(a, b, 1.5)))
    want = second(lambda x, w, a, b: x @ w.T + 1.5 * (x @ a.to(x.dtype).T) @ b.to(x.dtype).T)
    assert_close(got, want, torch.float32, "d/d(A1, A2, B2) of |dL/dA2|^2")


def test_public_op_is_exact_under_plain_autograd_over_func_grad():
    """lora_linear called directly, unfrozen weights, only the first layer's A a meta-parameter:
    the op's operands decide, as functional_call's inputs do (1.52 off before)."""
    g = torch.Generator().manual_seed(0)
    w1, w2 = (torch.randn(8, 8, generator=g).requires_grad_() for _ in range(2))
    a1, b1, a2, b2 = (torch.randn(*s, generator=g) for s in ((2, 8), (8, 2), (2, 8), (8, 2)))
    x = torch.randn(3, 5, 8, generator=g)

    def loss(rest, a1):
        first, second = fa.LoRA(a1, rest[0], 1.0), fa.LoRA(rest[1], rest[2], 1.0)
        return lora_linear(torch.tanh(lora_linear(x, w1, None, first)), w2, None, second).square().sum()

    def outer(a1):
        return sum(t.square().sum() for t in torch.func.grad(loss)((b1, a2, b2), a1))

    want = torch.func.grad(outer)(a1)
    tracked = a1.clone().requires_grad_()
    (got,) = torch.autograd.grad(outer(tracked), tracked)
    assert_close(got, want, torch.float32, "d outer / d A1")


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_jvp_rule_is_the_tangent_of_the_formula_and_runs_under_linearize(dropout):
    """The op's jvp rule, written out, against torch.func.jvp of the formula (fp64), with each
    operand varying alone and all together (the others' tangents None), over a group axis that
    broadcasts (x and the weight once, two adapters), with dropout's mask on the LoRA path only
    and fp32 factors beside fp64 x (cast as the reference casts them). torch.func.linearize of
    the op gives the same: it raised "Nested forward mode AD is not supported" before."""
    x, w, b, lo = make(M=4, K=5, N=3, r=2, dtype=torch.float64, lead=())
    g = torch.Generator().manual_seed(1)
    x, w, b = x[None], w[None], b[None]  # (1, M, K), (1, N, K), (1, N)
    A, B = torch.randn(2, 2, 5, generator=g), torch.randn(2, 3, 2, generator=g)  # fp32, G = 2
    seed = torch.tensor([11]) if dropout else None
    keep = 1.0 if not dropout else keep_mask(seed, 4, 5, dropout, x.device).double() / (1 - dropout)
    primals = (x, w, b, A, B)
    tangents = tuple(torch.randn(p.shape, generator=g, dtype=p.dtype) for p in primals)

    def op(x, w, b, A, B):
        return LoRALinearFn.apply(x, w, b, A, B, 0.7, dropout, seed, "torch")[0]

    def formula(x, w, b, A, B):
        A, B = A.double(), B.double()
        return x @ w.transpose(1, 2) + b[:, None, :] + 0.7 * ((x * keep) @ A.transpose(1, 2)) @ B.transpose(1, 2)

    for which in [(0,), (1,), (2,), (3,), (4,), (0, 1, 2, 3, 4)]:
        f, p, t = varying(op, primals, tangents, which)
        y, y_t = torch.func.jvp(f, p, t)
        y0, y0_t = torch.func.jvp(*varying(formula, primals, tangents, which))
        assert y_t.shape == (2, 4, 3) and y_t.dtype == torch.float64, which
        assert_close(y, y0, torch.float64, f"y, varying {which}")
        assert_close(y_t, y0_t, torch.float64, f"y_t, varying {which}")
        y_lin, jvp_fn = torch.func.linearize(f, *p)
        assert_close(jvp_fn(*t), y0_t, torch.float64, f"linearize, varying {which}")
