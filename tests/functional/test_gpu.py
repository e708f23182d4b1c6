"""The functional core on CUDA: impl="auto" (kernels or cuBLAS dispatch) against the torch reference."""
import pytest
import torch

import fastaf as fa
from tests._backends import fastaf_ops_backend
from tests._models import random_adapter, tiny_llama, token_batch
from tests._tolerances import REL_TOL, rel_err

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_functional_call_auto_matches_torch_reference(dtype):
    model = tiny_llama(dtype=dtype).cuda()
    ad = random_adapter(model, ["q_proj", "v_proj", "down_proj"])  # fp32 factors on the GPU
    ids = token_batch().cuda()
    loss = lambda a, impl: fa.functional_call(model, a, (ids,), {"labels": ids}, impl=impl).loss
    for impl in ("auto", "triton"):
        g, v = torch.func.grad_and_value(loss)(ad, impl)
        g_ref, v_ref = torch.func.grad_and_value(loss)(ad, "torch")
        assert abs(v.item() - v_ref.item()) < 1e-2 * abs(v_ref.item())
        for p in ad:
            assert rel_err(g[p].A, g_ref[p].A) < REL_TOL[dtype] * 2, (impl, p)
            assert rel_err(g[p].B, g_ref[p].B) < REL_TOL[dtype] * 2, (impl, p)


def test_lora_linear_real_size_bf16_matches_fp32_reference():
    g = torch.Generator(device="cuda").manual_seed(0)
    M, K, N, r = 4096, 4096, 4096, 16
    x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    w = (torch.randn(N, K, device="cuda", generator=g) / K**0.5).bfloat16()
    lora = fa.LoRA(
        (torch.randn(r, K, device="cuda", generator=g) / K**0.5).bfloat16(),
        (torch.randn(N, r, device="cuda", generator=g) / r**0.5).bfloat16(),
        2.0,
    )
    y = fa.functional.lora_linear(x, w, None, lora)
    ref = x.float() @ w.float().T + 2.0 * (x.float() @ lora.A.float().T) @ lora.B.float().T
    assert rel_err(y, ref) < REL_TOL[torch.bfloat16]


def test_vmap_over_stack_on_cuda():
    model = tiny_llama(dtype=torch.bfloat16).cuda()
    ads = [random_adapter(model, ["q_proj", "v_proj"], seed=s) for s in range(3)]
    ids = token_batch().cuda()
    got = torch.func.vmap(lambda a: fa.functional_call(model, a, (ids,)).logits)(fa.stack(ads))
    for i, ad in enumerate(ads):
        assert rel_err(got[i], fa.functional_call(model, ad, (ids,)).logits) < REL_TOL[torch.bfloat16]


@pytest.mark.parametrize("r", [16, 64, 256])
@pytest.mark.parametrize("x_batched", [True, False])
def test_vmap_over_a_stack_of_fp32_masters_real_size(r, x_batched):
    """bf16 x, a stack of G fp32 master adapters through the grouped kernels at a real size (up
    to the grouped kernels' top rank, where fp32 factor tiles are largest): values and the
    stack's fp32 gradients against fp64."""
    g = torch.Generator(device="cuda").manual_seed(r)
    G, M, K, N = 3, 1024, 2048, 1536
    x = torch.randn(G, M, K, device="cuda", generator=g).bfloat16()
    x = x if x_batched else x[0]
    w = (torch.randn(N, K, device="cuda", generator=g) / K**0.5).bfloat16()
    stack = fa.LoRA(torch.randn(G, r, K, device="cuda", generator=g) / K**0.5,
                    torch.randn(G, N, r, device="cuda", generator=g) / r**0.5, 2.0)
    dims = (0 if x_batched else None, 0)

    def value_and_grads(xx, ww, st):
        f = lambda xi, lo: fa.functional.lora_linear(xi, ww, None, lo)
        y = torch.func.vmap(f, dims)(xx, st)
        return y, torch.func.grad(lambda s: torch.func.vmap(f, dims)(xx, s).double().square().mean())(st)

    y, gr = value_and_grads(x, w, stack)
    y64, g64 = value_and_grads(x.double(), w.double(), fa.LoRA(stack.A.double(), stack.B.double(), 2.0))
    assert rel_err(y, y64) < REL_TOL[torch.bfloat16]
    assert gr.A.dtype == gr.B.dtype == torch.float32
    assert rel_err(gr.A, g64.A) < 2 * REL_TOL[torch.bfloat16] and rel_err(gr.B, g64.B) < 2 * REL_TOL[torch.bfloat16]


def test_compiled_vmap_of_grad_over_a_stack_runs_the_op_on_cuda():
    """``torch.compile(vmap(grad_and_value))`` over a stack, each adapter on its own sequences:
    the graphs call fastaf's op (its grouped kernels on CUDA), and Inductor's step equals each
    adapter's eager ``grad_and_value``."""
    model = tiny_llama(layers=1, dtype=torch.bfloat16).cuda()
    ads = [random_adapter(model, ["q_proj", "k_proj", "v_proj", "down_proj"], seed=s) for s in range(3)]
    ids = torch.stack([token_batch(seed=s) for s in range(3)]).cuda()
    loss = lambda a, i: fa.functional_call(model, a, (i,), {"labels": i}).loss  # noqa: E731
    per = torch.func.vmap(torch.func.grad_and_value(loss))
    backend, ops = fastaf_ops_backend()
    torch.compile(per, fullgraph=True, backend=backend)(fa.stack(ads), ids)
    assert ops == {"lora_linear_fwd": 4, "lora_linear_bwd": 4}, ops
    grads, losses = torch.compile(per, fullgraph=True)(fa.stack(ads), ids)
    for i, ad in enumerate(ads):
        g, v = torch.func.grad_and_value(loss)(ad, ids[i])
        assert abs(losses[i].item() - v.item()) < 1e-2 * abs(v.item())
        for p in ad:
            assert rel_err(grads[p].A[i], g[p].A) < 2 * REL_TOL[torch.bfloat16], (i, p)
            assert rel_err(grads[p].B[i], g[p].B) < 2 * REL_TOL[torch.bfloat16], (i, p)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_plain_autograd_over_func_grad_on_cuda(compiled):
    """MAML's outer step with the inner one on the kernels (bf16 model, fp32 factors), eager and
    compiled, against the torch reference's torch.func.grad twice."""
    model = tiny_llama(dtype=torch.bfloat16).cuda()
    ad = random_adapter(model, ["q_proj", "k_proj", "v_proj", "down_proj"])
    ids = token_batch().cuda()
    q = "model.layers.0.self_attn.q_proj"

    def objective(a, inner):
        grads, loss = inner(a)
        return loss + 1e3 * grads[q].A.square().sum()

    def inner(impl):
        return torch.func.grad_and_value(lambda a: fa.functional_call(model, a, (ids,), {"labels": ids}, impl=impl).loss)

    want = torch.func.grad(lambda a: objective(a, inner("torch")))(ad)
    leaves = ad.map(lambda p, l: fa.LoRA(l.A.detach().requires_grad_(), l.B.detach().requires_grad_(), l.scale))
    step = torch.compile(inner("auto"), fullgraph=True) if compiled else inner("auto")
    got = torch.autograd.grad(objective(leaves, step), [leaves[p].A for p in ad] + [leaves[p].B for p in ad])
    for g, w in zip(got, [want[p].A for p in ad] + [want[p].B for p in ad]):
        assert rel_err(g, w) < REL_TOL[torch.bfloat16] * 4


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_grad_and_value_with_siblings_matches_eager(mode):
    """The README's headline step, ``torch.compile(grad_and_value(loss), fullgraph=True)``, with
    and without CUDA graphs (``reduce-overhead``), on two layers with every linear adapted: the
    siblings' summed dX (their tokens), replayed steps included, against the eager step."""
    model = tiny_llama(layers=2, dtype=torch.bfloat16).cuda().requires_grad_(False)
    ad = random_adapter(model, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    ids = token_batch().cuda()
    loss = lambda a: fa.functional_call(model, a, (ids,), {"labels": ids}).loss  # noqa: E731
    backend, ops = fastaf_ops_backend()
    torch.compile(torch.func.grad_and_value(loss), fullgraph=True, backend=backend)(ad)
    # layer 1's q/k/v and both layers' gate/up need dX; layer 0's q/k/v (over frozen embeddings) do not
    assert ops["lora_siblings_dx"] == 3, ops
    step = torch.compile(torch.func.grad_and_value(loss), fullgraph=True, mode=mode)
    want, v0 = torch.func.grad_and_value(loss)(ad)
    for _ in range(3):  # reduce-overhead records a CUDA graph on a later call, then replays it
        got, v = step(ad)
    assert abs(v.item() - v0.item()) < 1e-2 * abs(v0.item())
    for p in ad:
        assert rel_err(got[p].A, want[p].A) < 2 * REL_TOL[torch.bfloat16], p
        assert rel_err(got[p].B, want[p].B) < 2 * REL_TOL[torch.bfloat16], p
