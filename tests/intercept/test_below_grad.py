"""``functional_call`` under one eager ``torch.func.grad`` level runs the model below the level:
the same gradients as the per-op path and as plain autograd, plain tensors inside the model, no
graph held by what the level returns, and the per-op path wherever a second transform is active."""
import gc
import weakref

import pytest
import torch
import torch.utils._pytree as pytree
import transformers

import fastaf as fa
from fastaf import _config
from tests._models import VOCAB, random_adapter, tiny_bart, tiny_gpt2, tiny_llama, tiny_mixtral, token_batch
from tests._modes import needs_interpreter
from tests._tolerances import REL_TOL, rel_err

_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
LLAMA = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture
def per_op():
    """Run a function with the fast path off (the per-op path under the grad level)."""
    def run(fn):
        with _config.override(below_grad=False):
            return fn()
    return run


def autograd_grads(loss_fn, adapter):
    leaves, spec = pytree.tree_flatten(adapter)
    leaves = [t.detach().requires_grad_() if isinstance(t, torch.Tensor) else t for t in leaves]
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    grads = iter(torch.autograd.grad(loss_fn(pytree.tree_unflatten(leaves, spec)), tensors))
    return pytree.tree_unflatten([next(grads) if isinstance(t, torch.Tensor) else t for t in leaves], spec)


def assert_trees_close(a, b):
    la, lb = pytree.tree_leaves(a), pytree.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
        else:
            assert x == y


def watch_inputs(module):
    """Record whether each call of ``module`` received a functorch-wrapped input."""
    seen = []
    handle = module.register_forward_pre_hook(lambda m, args: seen.append(_wrapped(args[0])))
    return seen, handle


MODELS = {
    "llama": (tiny_llama, LLAMA, lambda ids: {"input_ids": ids, "labels": ids}),
    "gpt2": (tiny_gpt2, ["c_attn", "c_proj", "c_fc"], lambda ids: {"input_ids": ids, "labels": ids}),
    "bart": (tiny_bart, ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"],
             lambda ids: {"input_ids": ids, "labels": ids[:, :5].contiguous()}),
    "mixtral": (tiny_mixtral, ["q_proj", "v_proj", "gate_up_proj", "down_proj"],
                lambda ids: {"input_ids": ids, "labels": ids}),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_grads_equal_the_per_op_path_and_autograd_and_the_model_sees_plain_tensors(name, per_op):
    make, targets, batch = MODELS[name]
    base = make()  # eval: GPT-2's and BART's dropout would draw different masks on each path
    ad = random_adapter(base, targets)
    inputs = batch(token_batch())
    loss = lambda a: fa.functional_call(base, a, (), inputs).loss  # noqa: E731
    layer = next(m for p, m in base.named_modules() if p.endswith(("q_proj", "c_attn")))
    seen, handle = watch_inputs(layer)
    g, v = torch.func.grad_and_value(loss)(ad)
    below = list(seen)
    seen.clear()
    g0, v0 = per_op(lambda: torch.func.grad_and_value(loss)(ad))
    handle.remove()
    assert below and not any(below)  # below the level: plain tensors
    assert seen and all(seen)  # per op: the level's wrapped tensors
    torch.testing.assert_close(v, v0)
    assert_trees_close(g, g0)
    assert_trees_close(g, autograd_grads(loss, ad))


@pytest.mark.parametrize("made_inside", [False, True])
def test_grads_under_inference_mode_equal_the_grads_outside(made_inside):
    """torch.func.grad records under inference_mode; below the level the caller's mode came back
    and the call recorded nothing: every gradient was zero, silently. An adapter made inside
    inference_mode holds inference tensors, which cannot require grad outside it."""
    base = tiny_llama()
    ids = token_batch()
    loss = lambda a: fa.functional_call(base, a, (ids,), {"labels": ids}).loss  # noqa: E731
    ad = random_adapter(base, LLAMA)
    g, v = torch.func.grad_and_value(loss)(ad)
    with torch.inference_mode():
        inside = ad.map(lambda p, l: fa.LoRA(l.A.clone(), l.B.clone(), l.scale)) if made_inside else ad
        assert pytree.tree_leaves(inside)[0].is_inference() == made_inside
        g1, v1 = torch.func.grad_and_value(loss)(inside)
    torch.testing.assert_close(v1, v)
    assert_trees_close(g1, g)
    assert all(t.abs().sum() > 0 for t in pytree.tree_leaves(g1) if isinstance(t, torch.Tensor))


def test_value_and_aux_hold_no_graph_and_the_inner_graph_is_freed():
    base = tiny_llama()
    ad = random_adapter(base, LLAMA)
    ids = token_batch()
    refs = []
    handle = base.model.layers[0].register_forward_hook(lambda m, a, out: refs.append(weakref.ref(out[0] if isinstance(out, tuple) else out)))

    def loss(a):
        out = fa.functional_call(base, a, (ids,), {"labels": ids})
        return out.loss, out.logits

    g, (v, logits) = torch.func.grad_and_value(loss, has_aux=True)(ad)
    handle.remove()
    assert not v.requires_grad and v.grad_fn is None
    assert not logits.requires_grad and logits.grad_fn is None
    del g
    gc.collect()
    assert refs and refs[0]() is None  # the layer's activation went with the level's graph


def test_vjp_fn_called_twice_and_grad_wrt_inputs_embeds(per_op):
    base = tiny_llama()
    ad = random_adapter(base, ["q_proj", "v_proj"])
    ids = token_batch()
    emb = base.get_input_embeddings()(ids).detach()

    def f(a, e):
        return fa.functional_call(base, a, (), {"inputs_embeds": e, "labels": ids}).loss

    out, vjp_fn = torch.func.vjp(f, ad, emb)
    first, second = vjp_fn(torch.ones(())), vjp_fn(torch.full((), 2.0))
    assert_trees_close(pytree.tree_map(lambda t: 2 * t if isinstance(t, torch.Tensor) else t, first), second)
    want = per_op(lambda: torch.func.grad(f, argnums=(0, 1))(ad, emb))
    assert_trees_close(first, want)


def test_tensors_held_by_an_output_cache_are_differentiated(per_op):
    base = tiny_llama()
    ad = random_adapter(base, ["q_proj", "k_proj", "v_proj"])
    ids = token_batch()

    def f(a):  # a loss that reads the DynamicCache's keys, outside any pytree node
        out = fa.functional_call(base, a, (ids,), {"use_cache": True})
        return out.past_key_values.layers[1].keys.square().sum() + out.logits.sum()

    g, v = torch.func.grad_and_value(f)(ad)
    g0, v0 = per_op(lambda: torch.func.grad_and_value(f)(ad))
    torch.testing.assert_close(v, v0)
    assert_trees_close(g, g0)
    assert g["model.layers.1.self_attn.k_proj"].A.abs().sum() > 0


def test_a_model_with_an_old_style_function_now_differentiates(per_op):
    """BLOOM's GELU is an old-style autograd.Function, which functorch refuses."""
    torch.manual_seed(0)
    base = transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4))
    base.train()
    ad = random_adapter(base, ["query_key_value", "dense_h_to_4h"])
    ids = token_batch()
    loss = lambda a: fa.functional_call(base, a, (ids,), {"labels": ids}).loss  # noqa: E731
    assert_trees_close(torch.func.grad(loss)(ad), autograd_grads(loss, ad))
    with pytest.raises(RuntimeError, match="setup_context"):
        per_op(lambda: torch.func.grad(loss)(ad))


def test_a_second_transform_takes_the_per_op_path():
    base = tiny_llama()
    ad = random_adapter(base, ["q_proj", "v_proj"])
    ids = token_batch()
    seen, handle = watch_inputs(base.model.layers[0].self_attn.q_proj)
    loss = lambda a: fa.functional_call(base, a, (ids,), {"labels": ids}).loss  # noqa: E731
    torch.func.vmap(torch.func.grad(loss))(fa.stack([ad, ad]))  # vmap outside grad
    torch.func.grad(lambda a: torch.func.grad(loss)(a)["model.layers.0.self_attn.q_proj"].A.sum())(ad)  # grad of grad
    handle.remove()
    assert seen and all(seen)


def test_base_weights_passed_as_params_are_differentiated_too(per_op):
    base = tiny_llama()
    ad = random_adapter(base, ["q_proj", "v_proj"])
    ids = token_batch()
    params = {k: v.detach() for k, v in base.named_parameters()}

    def loss(p, a):  # base weights and adapter both differentiated, through fastaf's own params=
        return fa.functional_call(base, a, (), {"input_ids": ids, "labels": ids}, params=p).loss

    g = torch.func.grad(loss, argnums=(0, 1))(params, ad)
    g0 = per_op(lambda: torch.func.grad(loss, argnums=(0, 1))(params, ad))
    assert_trees_close(g, g0)
    assert g[0]["model.layers.0.self_attn.q_proj.weight"].abs().sum() > 0


class _Wrap(torch.nn.Module):
    def __init__(self, model, adapter):
        super().__init__()
        self.model, self.adapter = model, adapter

    def forward(self, ids):
        return fa.functional_call(self.model, self.adapter, (ids,), {"labels": ids}).loss


def test_an_outer_functional_call_over_the_base_weights_takes_the_per_op_path(per_op):
    base = tiny_llama()
    ad = random_adapter(base, ["q_proj", "v_proj"])
    ids = token_batch()
    wrap = _Wrap(base, ad)
    params = {k: v.detach() for k, v in wrap.named_parameters()}
    seen, handle = watch_inputs(base.model.layers[0].self_attn.q_proj)
    g = torch.func.grad(lambda p: torch.func.functional_call(wrap, p, (ids,)))(params)
    handle.remove()
    assert seen and all(seen)
    g0 = per_op(lambda: torch.func.grad(lambda p: torch.func.functional_call(wrap, p, (ids,)))(params))
    assert_trees_close(g, g0)


def test_an_error_inside_leaves_the_transform_stack_as_it_was():
    base = tiny_llama()
    ad = random_adapter(base, ["q_proj"])
    ids = token_batch()
    handle = base.model.layers[1].register_forward_pre_hook(lambda m, a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        torch.func.grad(lambda a: fa.functional_call(base, a, (ids,), {"labels": ids}).loss)(ad)
    handle.remove()
    assert not torch._C._functorch.get_interpreter_stack()
    g = torch.func.grad(lambda a: fa.functional_call(base, a, (ids,), {"labels": ids}).loss)(ad)
    assert_trees_close(g, autograd_grads(lambda a: fa.functional_call(base, a, (ids,), {"labels": ids}).loss, ad))


def _two_layers(dtype: torch.dtype, device: str = "cpu"):
    """(Linear-tanh-Linear in ``dtype``, an adapter on both Linears, an input), on ``device``."""
    seq = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3)).to(device, dtype)
    ad = random_adapter(seq, ["0", "2"], r=2).map(
        lambda p, l: fa.LoRA(l.A.to(device, dtype), l.B.to(device, dtype), l.scale))
    return seq, ad, torch.randn(5, 8, generator=torch.Generator().manual_seed(0)).to(device, dtype)


@pytest.mark.parametrize("impl,dtype,device", [
    ("torch", torch.float64, "cpu"),
    pytest.param("triton", torch.float32, "cpu", marks=needs_interpreter),
    pytest.param("triton", torch.float32, "cuda", marks=pytest.mark.gpu),
])
@pytest.mark.parametrize("transform", ["jacrev", "hessian", "grad of a vjp_fn made before"])
def test_transforms_through_a_vjp_fn_over_the_call_equal_the_merged_model(transform, impl, dtype, device):
    """torch.func.vjp's vjp_fn runs the node's backward after its level exited: under vmap (jacrev, a
    clear error before; then the kernels got vmap's batched cotangent), under the outer transforms
    (hessian: zeros before), or under a later grad level of the same number (its cotangent unwrapped
    and the wrong level popped: wrong before)."""
    seq, ad, x = _two_layers(dtype, device)
    A = ad["0"].A

    def fastaf_call(a):
        return fa.functional_call(seq, fa.Adapter({**ad, "0": fa.LoRA(a, ad["0"].B, ad["0"].scale)}), (x,),
                                  impl=impl)

    def merged(a):
        weights = {f"{p}.weight": seq.get_submodule(p).weight + l.scale * l.B @ (a if p == "0" else l.A)
                   for p, l in ad.items()}
        return torch.func.functional_call(seq, weights, (x,))

    def run(f):
        if transform == "jacrev":
            return torch.func.jacrev(f)(A)
        if transform == "hessian":
            return torch.func.hessian(lambda a: f(a).tanh().sum())(A)
        vjp_fn = torch.func.vjp(f, A)[1]
        return torch.func.grad(lambda c: (vjp_fn(c)[0] ** 2).sum())(f(A).detach())

    got, want = run(fastaf_call), run(merged)
    assert want.abs().sum() > 0
    tol = 1e-9 if dtype == torch.float64 else 2e-4
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_a_first_order_vjp_fn_at_top_level_stays_first_order():
    """Called after vjp returned, with nothing around to differentiate it, the inner backward ran with
    create_graph (every layer on the reference ops) and the gradients held that graph."""
    seq, ad, x = _two_layers(torch.float32)
    out, vjp_fn = torch.func.vjp(lambda a: fa.functional_call(seq, a, (x,)), ad)
    (grads,) = vjp_fn(torch.ones_like(out))
    assert not any(t.requires_grad for t in pytree.tree_leaves(grads))
    assert_trees_close(grads, autograd_grads(lambda a: fa.functional_call(seq, a, (x,)).sum(), ad))


@pytest.mark.gpu
def test_gpu_bf16_kernels_below_the_level_equal_the_per_op_path(per_op):
    base = tiny_llama(dtype=torch.bfloat16).cuda()
    ad = random_adapter(base, LLAMA)  # fp32 factors on the GPU
    ids = token_batch().cuda()
    loss = lambda a: fa.functional_call(base, a, (ids,), {"labels": ids}, impl="triton").loss  # noqa: E731
    g, v = torch.func.grad_and_value(loss)(ad)
    g0, v0 = per_op(lambda: torch.func.grad_and_value(loss)(ad))
    assert abs(v.item() - v0.item()) < 1e-2 * abs(v0.item())
    for path in ad:  # bf16 activations: the kernels' split reductions need not agree bit for bit
        assert rel_err(g[path].A, g0[path].A) < REL_TOL[torch.bfloat16], path
        assert rel_err(g[path].B, g0[path].B) < REL_TOL[torch.bfloat16], path


@pytest.mark.gpu
def test_gpu_fsdp2_one_rank_under_torch_func(per_op, tmp_path):
    """On CUDA FSDP2's hooks cannot run at a functorch level; below it they run as under autograd."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        sharded = tiny_llama().cuda()
        for layer in sharded.model.layers:
            fully_shard(layer)
        fully_shard(sharded)
        plain = tiny_llama().cuda()
        ad = random_adapter(plain, ["q_proj", "v_proj", "down_proj"])
        ids = token_batch().cuda()
        loss = lambda m: lambda a: fa.functional_call(m, a, (ids,), {"labels": ids}).loss  # noqa: E731
        assert_trees_close(torch.func.grad(loss(sharded))(ad), torch.func.grad(loss(plain))(ad))
        with pytest.raises(NotImplementedError, match="FSDP2"):
            per_op(lambda: torch.func.grad(loss(sharded))(ad))
    finally:
        dist.destroy_process_group()
