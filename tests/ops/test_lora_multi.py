"""Per-example adapters (``adapter_ids``) and ``fastaf.generate``, against one call per adapter."""
from __future__ import annotations

import copy

import pytest
import torch

import fastaf as fa
from tests._models import ARCHS, MODELS, random_adapter, tiny_bart, tiny_llama, token_batch
from tests._modes import deterministic
from tests._tolerances import rel_err, varying

IDS = torch.tensor([2, -1, 0, 1, 2])  # 5 examples over a stack of 3; -1 is the base model


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _stack(model, targets, n=3):
    ads = [random_adapter(model, targets, r=2 + i, alpha=4.0 + i, seed=i) for i in range(n)]  # ranks, scales differ
    return ads, fa.stack(ads)


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2", "falcon"])
def test_each_example_gets_its_own_adapter(name):
    make, targets = MODELS[name]
    model = make()
    ads, stack = _stack(model, targets)
    ids = token_batch(batch=len(IDS))
    with torch.no_grad():
        mixed = fa.functional_call(model, stack, (ids,), adapter_ids=IDS).logits
        for row, k in enumerate(IDS.tolist()):
            alone = fa.functional_call(model, ads[k] if k >= 0 else None, (ids[row:row + 1],)).logits
            assert rel_err(mixed[row:row + 1], alone) < 1e-5, f"row {row} (adapter {k})"


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_gradients_reach_each_adapter_from_its_own_examples_only(name):
    model = MODELS[name][0]()
    targets = ["q_proj", "v_proj", "down_proj"] if name == "llama" else ["q_proj", "k_proj", "v_proj", "o_proj"]
    ads, stack = _stack(model, targets)
    ids = token_batch(batch=len(IDS))

    def per_row_loss(logits):  # (rows, seq, vocab) -> (rows,): a sum of per-example losses
        return logits.float().square().mean(dim=(1, 2))

    grads = torch.func.grad(
        lambda st: per_row_loss(fa.functional_call(model, st, (ids,), adapter_ids=IDS).logits).sum())(stack)
    for k, ad in enumerate(ads):
        rows = (IDS == k).nonzero().flatten()
        want = torch.func.grad(lambda a: per_row_loss(fa.functional_call(model, a, (ids[rows],)).logits).sum())(ad)
        for path, lora in want.items():
            r = lora.A.shape[0]  # the stack zero-pads ranks: compare the slot's first r rows
            assert rel_err(grads[path].A[k, :r], lora.A) < 1e-4, (k, path)
            # the stack folds each slot's scale into its B: undo it for the comparison
            fold = ad[path].scale / stack[path].scale
            assert rel_err(grads[path].B[k, :, :r] * fold, lora.B) < 1e-4, (k, path)


def test_bad_ids_and_stacks_are_errors_before_anything_runs():
    model = tiny_llama()
    ads, stack = _stack(model, ["q_proj"])
    ids = token_batch(batch=2)
    cases = [
        (stack, torch.tensor([0, 3]), ValueError, r"in \[-1, 3\).*from 0 to 3"),
        (stack, torch.tensor([0, -2]), ValueError, r"in \[-1, 3\)"),
        (stack, torch.tensor([0, 1, 2]), ValueError, r"3 entries for a batch of 2 examples \(the leading size of "
                                                     r"positional input 0 \(2, 12\)\)"),
        (stack, torch.tensor([[0, 1]]), ValueError, "1-D int32/int64"),
        (stack, torch.tensor([0.0, 1.0]), ValueError, "1-D int32/int64"),
        (stack, [0, 1], TypeError, "must be a torch.Tensor"),
        (stack, torch.tensor([0, 1], device="meta"), ValueError, "adapter_ids is on meta"),
        (stack, None, ValueError, "stacked LoRA .* without adapter_ids"),
        (ads[0], torch.tensor([0, 1]), ValueError, "adapter_ids needs a stacked adapter"),
        (None, torch.tensor([0, 1]), ValueError, "adapter_ids was given without an adapter"),
    ]
    for adapter, adapter_ids, error, match in cases:
        with pytest.raises(error, match=match):
            fa.functional_call(model, adapter, (ids,), adapter_ids=adapter_ids)
    # vmap over the stack hands each call one slot: the message said a stack was needed
    with pytest.raises(NotImplementedError, match=r"adapter_ids does not run under torch.func.vmap \(A \(4, 32\)"):
        torch.func.vmap(lambda a: fa.functional_call(model, a, (ids,), adapter_ids=torch.tensor([0, 1])))(stack)
    q = "model.layers.0.self_attn.q_proj"  # a stack made for a model 48 wide
    other = fa.stack([fa.Adapter({q: fa.LoRA(torch.zeros(4, 48), torch.zeros(48, 4))})] * 2)
    with pytest.raises(ValueError, match=r"does not fit Linear\(32 -> 32\): expected A \(n, r, 32\) and "
                                         r"B \(n, 32, r\)"):
        fa.functional_call(model, other, (ids,), adapter_ids=torch.tensor([0, 1]))
    compiled = torch.compile(model, backend="eager")
    with pytest.raises(ValueError, match=r"OptimizedModule, torch.compile's wrapper: pass the model it wraps, "
                                         r"compiled._orig_mod"):
        fa.functional_call(compiled, stack, (ids,), adapter_ids=torch.tensor([0, 1]))


def test_generate_decodes_each_row_with_its_adapter_and_leaves_the_model():
    model = tiny_llama()
    ads, stack = _stack(model, ["q_proj", "v_proj"])
    ads = [20.0 * a for a in ads]  # far from the base, so a wrong adapter changes the tokens
    stack = fa.stack(ads)
    prompts = token_batch(batch=len(IDS), seq=6)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(prompts))
    before = copy.deepcopy(model.state_dict())
    mixed = fa.generate(model, stack, prompts, adapter_ids=IDS, **kw)
    for row, k in enumerate(IDS.tolist()):
        one = dict(kw, attention_mask=kw["attention_mask"][row:row + 1])
        alone = fa.generate(model, ads[k] if k >= 0 else None, prompts[row:row + 1], **one)
        assert torch.equal(mixed[row:row + 1], alone), f"row {row} (adapter {k})"
    assert not torch.equal(mixed[0], mixed[1])
    assert all(torch.equal(v, before[n]) for n, v in model.state_dict().items())
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


@pytest.mark.parametrize("beams, returns, in_config", [(2, 1, False), (2, 1, True), (2, 2, False), (1, 2, True)])
def test_generate_repeats_ids_as_generate_expands_rows(beams, returns, in_config):
    """Beam search and several returned sequences: generate expands each row max(beams, returns)
    times, each expanded row with its row's adapter (the ids once repeated beams * returns times,
    and a generation_config keyword went unread)."""
    from transformers import GenerationConfig

    model = tiny_llama()
    ads, _ = _stack(model, ["q_proj", "v_proj"])
    stack = fa.stack([20.0 * a for a in ads])
    prompts = token_batch(batch=len(IDS), seq=5)
    opts = dict(num_beams=beams, num_return_sequences=returns, do_sample=returns > beams)
    kw = dict(max_new_tokens=3, pad_token_id=0)
    kw.update(generation_config=GenerationConfig(**opts, **kw) if in_config else None, **({} if in_config else opts))
    torch.manual_seed(0)
    mixed = fa.generate(model, stack, prompts, adapter_ids=IDS, **kw)
    assert mixed.shape[0] == len(IDS) * returns
    for row, k in enumerate(IDS.tolist()):
        torch.manual_seed(0)
        one = fa.generate(model, 20.0 * ads[k] if k >= 0 else None, prompts[row:row + 1], **kw)
        if returns <= beams:  # beam search: deterministic per row
            assert torch.equal(mixed[row * returns:(row + 1) * returns], one), f"row {row} (adapter {k})"


def _encoder_decoder(name):
    """(model, targets on both sides, inputs of 3 rows with their row slicer): generate runs
    BART's and T5's encoder and LLaVA's vision tower and projector on the rows as given."""
    if name == "bart":
        model, targets = tiny_bart(), ["q_proj", "v_proj", "out_proj", "fc1", "fc2"]
        inputs = {"input_ids": token_batch(batch=3, seq=7)}
    else:
        make, targets, inputs_of = ARCHS[name]
        model = make()
        targets = ["q", "v", "wi"] if name == "t5" else ["q_proj", "v_proj", "fc1", "linear_1"]
        inputs = {k: v for k, v in inputs_of().items() if k != "labels"}
        inputs = {k: torch.cat([v, v[:1]]) for k, v in inputs.items()}  # 3 rows (the first repeated)
    return model, targets, inputs


@pytest.mark.parametrize("name", ["bart", "t5", "llava"])
@pytest.mark.parametrize("opts", [dict(num_beams=2), dict(num_beams=2, num_return_sequences=2),
                                  dict(do_sample=True, top_k=1, num_return_sequences=2)])
def test_generate_with_beams_gives_the_encoder_the_ids_as_given(name, opts):
    """With beams or several returned sequences generate repeats each row for the decoding steps
    but runs the encoder (the vision tower) on the rows as given: each row must decode with its
    own adapter on both sides, as that adapter alone does (it raised "adapter_ids has 6 entries
    but the layer's input has 3 rows"). Sampling with top_k=1 runs the sampling path with one
    token to draw, so its tokens compare too; every step's logits compare as well."""
    model, targets, inputs = _encoder_decoder(name)
    ads = [20.0 * random_adapter(model, targets, r=2 + i, alpha=4.0 + i, seed=i) for i in range(2)]
    rows = torch.tensor([1, -1, 0])
    kw = dict(max_new_tokens=3, min_new_tokens=3, pad_token_id=0, return_dict_in_generate=True, output_logits=True,
              **opts)  # min_new_tokens: no row ends early, padded in the batch alone
    torch.manual_seed(0)
    mixed = fa.generate(model, fa.stack(ads), adapter_ids=rows, **inputs, **kw)
    n = opts.get("num_return_sequences", 1)
    assert mixed.sequences.shape[0] == 3 * n
    for row, k in enumerate(rows.tolist()):
        torch.manual_seed(0)
        alone = fa.generate(model, ads[k] if k >= 0 else None, **{a: v[row:row + 1] for a, v in inputs.items()}, **kw)
        span = slice(row * n, (row + 1) * n)
        assert torch.equal(mixed.sequences[span], alone.sequences), f"row {row} (adapter {k})"
        e = max(opts.get("num_beams", 1), n)  # each step's logits: (rows * e, vocab), e per row
        for step, (got, want) in enumerate(zip(mixed.logits, alone.logits)):
            assert rel_err(got[row * e:(row + 1) * e], want) < 1e-5, f"row {row} (adapter {k}), step {step}"
    assert not torch.equal(mixed.sequences[0], mixed.sequences[n])  # the adapters change the tokens


def test_generate_with_beams_through_flattened_layers():
    """GPT-2's Conv1D flattens (batch, seq, K) before its addmm: among the ids as given and the
    ids repeated per beam, its rows (beams * batch * seq) take the repeated ones."""
    model, targets = MODELS["gpt2"]
    model = model()
    ads = [20.0 * random_adapter(model, targets, r=2 + i, alpha=4.0 + i, seed=i) for i in range(2)]
    rows, prompts = torch.tensor([1, -1, 0]), token_batch(batch=3, seq=5)
    kw = dict(max_new_tokens=3, min_new_tokens=3, pad_token_id=0, num_beams=2)
    mixed = fa.generate(model, fa.stack(ads), prompts, adapter_ids=rows, **kw)
    for row, k in enumerate(rows.tolist()):
        alone = fa.generate(model, ads[k] if k >= 0 else None, prompts[row:row + 1], **kw)
        assert torch.equal(mixed[row:row + 1], alone), f"row {row} (adapter {k})"


def test_generate_checks_the_ids_as_given_before_repeating_them():
    """A bad id tensor is named with the shape the caller passed, (2,), not generate's (4,)."""
    model = tiny_llama(layers=1)
    _, stack = _stack(model, ["q_proj"], n=2)
    prompts = token_batch(batch=2, seq=4)
    with pytest.raises(ValueError, match=r"1-D int32/int64 tensor, got \(2,\) torch.float32"):
        fa.generate(model, stack, prompts, adapter_ids=torch.tensor([0.0, 1.0]), num_beams=2, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"in \[-1, 2\) for a stack of 2 adapters, got values from 0 to 2"):
        fa.generate(model, stack, prompts, adapter_ids=torch.tensor([0, 2]), num_beams=2, max_new_tokens=2)


def test_the_batch_is_read_from_an_input_that_leads_with_it():
    """position_ids (1, T) before input_ids gave a batch of 1 and refused valid ids."""
    model = tiny_llama()
    _, stack = _stack(model, ["q_proj"])
    ids = token_batch(batch=len(IDS), seq=5)
    want = fa.functional_call(model, stack, (ids,), adapter_ids=IDS).logits
    for first in ({"position_ids": torch.arange(5)[None]}, {"cache_position": torch.arange(5)}):
        got = fa.functional_call(model, stack, (), {**first, "input_ids": ids}, adapter_ids=IDS).logits
        torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match=r"4 entries for a batch of 5 examples \(the leading size of input_ids"):
        fa.functional_call(model, stack, (), {"position_ids": torch.arange(5)[None], "input_ids": ids},
                           adapter_ids=IDS[:4])


def test_ids_are_checked_under_compile_too():
    """Traced, the checks were skipped: ids of -2 ran the base model and a float stack of ids ran.
    Now the trace checks what it knows, and the values by an assert where the ids are."""
    model = tiny_llama(layers=1)
    _, stack = _stack(model, ["q_proj"], n=2)
    ids = token_batch(batch=3, seq=4)
    step = torch.compile(lambda st, a: fa.functional_call(model, st, (ids,), adapter_ids=a).logits,
                         fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(step(stack, torch.tensor([0, 1, -1])),
                               fa.functional_call(model, stack, (ids,), adapter_ids=torch.tensor([0, 1, -1])).logits)
    for bad in ([-2, 0, 1], [0, 2, 1]):
        with pytest.raises(RuntimeError, match=r"adapter_ids must lie in \[-1, 2\)"):
            step(stack, torch.tensor(bad))
    with pytest.raises(Exception, match="adapter_ids must be a 1-D int32/int64 tensor"):  # in dynamo's own error
        step(stack, torch.tensor([0.0, 1.0, 1.0]))


def test_forward_mode_over_per_example_adapters():
    """torch.func.jvp over a stack with adapter_ids: each row's tangent is its own adapter's, the
    base rows' zero (the grouped op's jvp rule; torch's "implement the jvp function" before)."""
    model = tiny_llama(layers=1)
    ads, stack = _stack(model, ["q_proj", "v_proj"], n=2)
    tans = [random_adapter(model, ["q_proj", "v_proj"], r=2 + i, alpha=4.0 + i, seed=10 + i) for i in range(2)]
    ids, rows = token_batch(batch=3, seq=5), torch.tensor([1, -1, 0])
    _, y_t = torch.func.jvp(lambda st: fa.functional_call(model, st, (ids,), adapter_ids=rows).logits,
                            (stack,), (fa.stack(tans),))
    for row, k in enumerate(rows.tolist()):
        if k < 0:
            assert not y_t[row].any()
            continue
        merged = lambda a: torch.func.functional_call(model, fa.merge_into(model, a), (ids[row:row + 1],)).logits  # noqa: E731
        assert rel_err(y_t[row:row + 1], torch.func.jvp(merged, (ads[k],), (tans[k],))[1]) < 1e-5


def test_linearize_over_per_example_adapters():
    """torch.func.linearize traces the call under a forward-AD level of its own: the grouped op's
    jvp rule nested another ("Nested forward mode AD is not supported"), and the ids' range check
    read a traced tensor. Each row's tangent is its own adapter's merged model's, the base rows'
    zero; ids out of range are still an error."""
    model = tiny_llama(layers=1)
    targets = ["q_proj", "v_proj", "down_proj"]
    ads, stack = _stack(model, targets, n=2)
    tans = [random_adapter(model, targets, r=2 + i, alpha=4.0 + i, seed=10 + i) for i in range(2)]
    ids, rows = token_batch(batch=3, seq=5), torch.tensor([1, -1, 0])
    y, jvp_fn = torch.func.linearize(lambda st: fa.functional_call(model, st, (ids,), adapter_ids=rows).logits, stack)
    y_t = jvp_fn(fa.stack(tans))
    assert rel_err(y, fa.functional_call(model, stack, (ids,), adapter_ids=rows).logits) < 1e-6
    for row, k in enumerate(rows.tolist()):
        if k < 0:
            assert not y_t[row].any()
            continue
        merged = lambda a: torch.func.functional_call(model, fa.merge_into(model, a), (ids[row:row + 1],)).logits  # noqa: E731
        assert rel_err(y_t[row:row + 1], torch.func.linearize(merged, ads[k])[1](tans[k])) < 1e-5, row
    with pytest.raises(ValueError, match=r"in \[-1, 2\)"):
        torch.func.linearize(
            lambda st: fa.functional_call(model, st, (ids,), adapter_ids=torch.tensor([1, 2, 0])).logits, stack)


def test_generate_takes_unset_config_fields_from_the_models_config():
    """A passed GenerationConfig leaves num_beams None; generate then reads the model's (BART's and
    T5's ship 4-5): the ids must be expanded by it too."""
    from transformers import GenerationConfig

    model = tiny_llama()
    model.generation_config.num_beams = 2
    ads, _ = _stack(model, ["q_proj", "v_proj"], n=2)
    stack, rows = fa.stack([20.0 * a for a in ads]), torch.tensor([1, 0])
    prompts = token_batch(batch=2, seq=5)
    config = GenerationConfig(max_new_tokens=3, pad_token_id=0, do_sample=False)
    mixed = fa.generate(model, stack, prompts, adapter_ids=rows, generation_config=config)
    for row, k in enumerate(rows.tolist()):
        one = fa.generate(model, 20.0 * ads[k], prompts[row:row + 1], generation_config=config)
        assert torch.equal(mixed[row:row + 1], one), row


def test_a_layer_whose_rows_are_not_the_batch_is_an_error():
    class TimeFirst(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(6, 6)

        def forward(self, x):  # x (batch, T, K) -> the linear sees (T, batch, K)
            return self.proj(x.transpose(0, 1)).transpose(0, 1)

    model = TimeFirst()
    stack = fa.stack([fa.Adapter({"proj": fa.LoRA(torch.randn(2, 6), torch.randn(6, 2))})] * 2)
    with pytest.raises(ValueError, match="2 entries but the layer's input has 4 rows"):
        fa.functional_call(model, stack, (torch.randn(2, 4, 6),), adapter_ids=torch.tensor([0, 1]))


def test_rows_take_the_candidate_ids_that_fit_them():
    """generate's ids as given and repeated per beam: each layer's rows pick one; flattened rows
    the longest that divides them; rows that fit neither are an error naming both."""
    from fastaf.ops import check_rows

    given = torch.tensor([1, -1, 0])
    both = (given, given.repeat_interleave(2))
    assert check_rows(both, 3, "enc") is both[0] and check_rows(both, 6, "dec") is both[1]
    assert check_rows(both, 6 * 5, "c_attn", flattened=True) is both[1]
    assert check_rows(both, 3 * 5, "c_attn", flattened=True) is both[0]
    with pytest.raises(ValueError, match=r"enc: adapter_ids has 3 or 6 entries .* the layer's input has 4 rows"):
        check_rows(both, 4, "enc")


# ---- the grouped op itself: the kernels (TRITON_INTERPRET=1 on CPU) against the reference -----

needs_triton = pytest.mark.skipif(  # CPU tensors: the kernels run only under the interpreter
    __import__("os").environ.get("TRITON_INTERPRET") != "1", reason="CPU kernels need TRITON_INTERPRET=1")


def _op_inputs(batch, seq, seed=0, K=24, N=20):
    g = torch.Generator().manual_seed(seed)
    ads = [fa.LoRA(torch.randn(r, K, generator=g), torch.randn(N, r, generator=g), 0.5 + i)
           for i, r in enumerate((2, 5, 3))]  # ranks and scales differ: the stack pads and folds
    stack = fa.stack([fa.Adapter({"l": lo}) for lo in ads])["l"]
    x = torch.randn(batch, seq, K, generator=g)
    return x, torch.randn(N, K, generator=g), torch.randn(N, generator=g), stack


@needs_triton
@pytest.mark.parametrize("batch,seq", [(5, 7), (5, 1), (3, 0)])
def test_grouped_kernels_equal_the_reference_values_and_gradients(batch, seq):
    from fastaf.ops import lora_linear_multi

    x, w, bias, stack = _op_inputs(batch, seq)
    ids = IDS[:batch]

    def run(impl, x, A, B):
        lo = fa.LoRA(A, B, stack.scale)
        return lora_linear_multi(x, w, bias, lo, ids, impl=impl)

    args = (x.requires_grad_(), stack.A.requires_grad_(), stack.B.requires_grad_())
    dy = torch.randn(batch, seq, w.shape[0])
    outs = {}
    for impl in ("triton", "torch"):
        y = run(impl, *args)
        outs[impl] = (y, *torch.autograd.grad(y, args, dy))
        # torch.func.grad over the stack reaches the same VJP
        fgrad = torch.func.grad(lambda A, B: (run(impl, x.detach(), A, B) * dy).sum(), argnums=(0, 1))
        outs[impl] += fgrad(stack.A.detach(), stack.B.detach())
    for name, got, want in zip(("y", "dx", "dA", "dB", "func dA", "func dB"), outs["triton"], outs["torch"]):
        assert got.shape == want.shape, name
        assert rel_err(got, want) < 1e-5 or want.abs().max() == 0 and got.abs().max() == 0, name
    # the unused slot 1 of IDS[:3] = [2, -1, 0] gets no gradient
    if batch == 3:
        assert outs["triton"][2][1].abs().max() == 0


@needs_triton
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_grad_off_calls_skip_the_function_and_equal_the_recorded_ones(impl, monkeypatch):
    """Eager inference with ids (a prefill's rows) runs the forward without the op's Function,
    with the values of a call that records."""
    from fastaf.ops import lora_linear_multi, lora_multi

    x, w, bias, stack = _op_inputs(5, 30)  # 150 rows: past the decoding steps' path
    tracked = fa.LoRA(stack.A.clone().requires_grad_(), stack.B.clone().requires_grad_(), stack.scale)
    want = lora_linear_multi(x, w, bias, tracked, IDS, impl=impl)
    assert want.grad_fn is not None  # recorded: through the Function

    def refused(*args):
        raise AssertionError("the Function ran for a call with grad off")

    monkeypatch.setattr(lora_multi, "_multi_direct_apply", refused)
    with torch.no_grad():
        got = lora_linear_multi(x, w, bias, stack, IDS, impl=impl)
    torch.testing.assert_close(got, want.detach(), rtol=0, atol=0)


@needs_triton
def test_vmap_over_a_stack_takes_the_grouped_kernels_and_equals_a_loop():
    x, w, bias, stack = _op_inputs(3, 6)
    f = lambda xi, lo: fa.functional.lora_linear(xi, w, bias, lo, impl="triton")
    got = torch.func.vmap(f)(x, stack)
    want = torch.stack([f(x[i], fa.LoRA(stack.A[i], stack.B[i], stack.scale)) for i in range(3)])
    assert rel_err(got, want) < 1e-5
    loss = lambda st: (torch.func.vmap(f)(x, st) ** 2).sum()
    g = torch.func.grad(loss)(stack)
    g_ref = torch.func.grad(lambda st: (torch.func.vmap(
        lambda xi, lo: fa.functional.lora_linear(xi, w, bias, lo, impl="torch"))(x, st) ** 2).sum())(stack)
    assert rel_err(g.A, g_ref.A) < 1e-5 and rel_err(g.B, g_ref.B) < 1e-5


def test_compiled_grad_over_a_mixed_batch_equals_eager():
    """torch.compile traces the grouped op's VJP (the stack, a graph input wrapped by
    torch.func.grad, once lost its gradient there: zeros instead of an error). One layer: dynamo
    traces each, slowly on CI."""
    model = tiny_llama(layers=1)
    ads, stack = _stack(model, ["q_proj", "down_proj"])
    ids = token_batch(batch=len(IDS))
    step = torch.func.grad_and_value(
        lambda st: fa.functional_call(model, st, (ids,), {"labels": ids}, adapter_ids=IDS).loss)
    g_eager, v_eager = step(stack)
    torch._dynamo.reset()
    g, v = torch.compile(step, fullgraph=True, backend="aot_eager")(stack)
    assert abs(v.item() - v_eager.item()) < 1e-6
    for path in stack:
        assert g_eager[path].A.abs().max() > 0
        assert rel_err(g[path].A, g_eager[path].A) < 1e-5 and rel_err(g[path].B, g_eager[path].B) < 1e-5, path


def test_grouped_op_compiles_without_graph_breaks():
    from fastaf.ops import lora_linear_multi

    x, w, bias, stack = _op_inputs(5, 4)
    fn = lambda x, A, B: lora_linear_multi(x, w, bias, fa.LoRA(A, B, stack.scale), IDS)
    explain = torch._dynamo.explain(fn)(x, stack.A, stack.B)
    assert explain.graph_break_count == 0, explain.break_reasons


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_mixed_batch_step_on_the_grouped_kernels_equals_eager():
    """torch.compile(fullgraph=True) over grad of a mixed-batch loss: the grouped ops' fakes trace,
    no graph break, and the values equal the eager kernels'."""
    model = tiny_llama(dtype=torch.bfloat16).cuda()
    ads, _ = _stack(model, ["q_proj", "v_proj", "down_proj"])
    stack = fa.stack(ads).map(lambda p, lo: fa.LoRA(lo.A.cuda(), lo.B.cuda(), lo.scale))
    ids, rows = token_batch(batch=len(IDS)).cuda(), IDS.cuda()
    loss = lambda st: fa.functional_call(model, st, (ids,), {"labels": ids}, adapter_ids=rows).loss
    step = torch.func.grad_and_value(loss)
    g_eager, v_eager = step(stack)
    torch._dynamo.reset()
    g, v = torch.compile(step, fullgraph=True)(stack)
    assert abs(v.item() - v_eager.item()) < 1e-2 * abs(v_eager.item())
    for path in stack:
        assert rel_err(g[path].A, g_eager[path].A) < 2e-2, path
        assert rel_err(g[path].B, g_eager[path].B) < 2e-2, path


@needs_triton
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_functional_call_on_the_grouped_kernels_equals_the_reference(name):
    """A whole model's mixed batch through the grouped kernels (impl="triton"; the interpreter on
    CPU): logits and every slot's gradient as on the torch reference. GPT-2's Conv1D flattens the
    batch: its rows are still one segment per example."""
    make, targets = MODELS[name]
    model = make(layers=1)  # one layer: the interpreter runs each slowly on CI
    ads, stack = _stack(model, targets[:3])
    ids = token_batch(batch=len(IDS), seq=5)
    loss = lambda st, impl: fa.functional_call(model, st, (ids,), {"labels": ids}, adapter_ids=IDS, impl=impl).loss
    (g, v), (g_ref, v_ref) = (torch.func.grad_and_value(loss)(stack, impl) for impl in ("triton", "torch"))
    assert abs(v.item() - v_ref.item()) < 1e-5
    for path in stack:
        assert rel_err(g[path].A, g_ref[path].A) < 1e-4 and rel_err(g[path].B, g_ref[path].B) < 1e-4, path



@needs_triton
@pytest.mark.parametrize("warn_only", [False, True], ids=["strict", "warn_only"])
def test_forced_grouped_kernels_alert_in_deterministic_mode(warn_only):
    """lora_multi's kernels sum with fp32 atomics: forced (impl="triton") under torch's
    deterministic mode, a mixed batch and a vmap over a stack raise, or warn and still compute
    the reference's values."""
    from fastaf.ops import lora_linear_multi

    x, w, bias, stack = _op_inputs(3, 6)
    ids = torch.tensor([2, 0, 1])
    f = lambda xi, lo: fa.functional.lora_linear(xi, w, bias, lo, impl="triton")  # noqa: E731
    want_multi = lora_linear_multi(x, w, bias, stack, ids, impl="torch")
    want_vmap = torch.stack([f(x[i], fa.LoRA(stack.A[i], stack.B[i], stack.scale)) for i in range(3)])
    with deterministic(warn_only):
        if not warn_only:
            with pytest.raises(RuntimeError, match="many adapters.*deterministic"):
                lora_linear_multi(x, w, bias, stack, ids, impl="triton")
            with pytest.raises(RuntimeError, match="stack's grouped forward.*deterministic"):
                torch.func.vmap(f)(x, stack)
            return
        with pytest.warns(UserWarning, match="many adapters"):
            assert rel_err(lora_linear_multi(x, w, bias, stack, ids, impl="triton"), want_multi) < 1e-5
        with pytest.warns(UserWarning, match="stack's grouped forward"):
            assert rel_err(torch.func.vmap(f)(x, stack), want_vmap) < 1e-5


@needs_triton
def test_ids_any_layout_int32_or_strided_give_the_same_result():
    from fastaf.ops import lora_linear_multi

    x, w, bias, stack = _op_inputs(4, 3)
    table = torch.tensor([[2, 9], [0, 9], [-1, 9], [1, 9]])
    want = lora_linear_multi(x, w, bias, stack, table[:, 0].contiguous(), impl="torch")
    for ids in (table[:, 0], table[:, 0].to(torch.int32)):  # stride 2; int32
        assert rel_err(lora_linear_multi(x, w, bias, stack, ids, impl="triton"), want) < 1e-5


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_ops_pass_opcheck_with_transposed_stacks(impl):
    """Fakes, strides and schema of fastaf::lora_multi_fwd/bwd (torch.library.opcheck)."""
    if impl == "triton" and __import__("os").environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU kernels need TRITON_INTERPRET=1")
    x, w, bias, stack = _op_inputs(3, 2)
    ids = torch.tensor([1, -1, 0])
    a = stack.A.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    b = stack.B.transpose(1, 2).contiguous().transpose(1, 2)
    x2 = x.reshape(-1, x.shape[-1])
    y, h = torch.ops.fastaf.lora_multi_fwd(x2, w, bias, a, b, ids, 0.5, impl)
    torch.library.opcheck(torch.ops.fastaf.lora_multi_fwd, (x2, w, bias, a, b, ids, 0.5, impl),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.fastaf.lora_multi_bwd, (torch.randn_like(y), x2, w, a, b, h, ids, 0.5, True, impl),
                          test_utils=("test_schema", "test_faketensor"))


def test_autocast_casts_the_mixed_batch_as_it_casts_f_linear():
    model = tiny_llama()
    ads, stack = _stack(model, ["q_proj", "down_proj"])
    ids = token_batch(batch=len(IDS))
    loss = lambda st: fa.functional_call(model, st, (ids,), {"labels": ids}, adapter_ids=IDS).loss
    with torch.autocast("cpu", dtype=torch.bfloat16):
        g, v = torch.func.grad_and_value(loss)(stack)
    g32, v32 = torch.func.grad_and_value(loss)(stack)
    assert abs(v.item() - v32.item()) < 2e-2 * abs(v32.item())
    for path in stack:
        assert g[path].A.dtype == torch.float32 and rel_err(g[path].A, g32[path].A) < 0.1, path


def test_adapter_ids_under_vmap_and_a_bad_impl_are_named_errors():
    from fastaf.ops import lora_linear_multi

    x, w, bias, stack = _op_inputs(3, 2)
    with pytest.raises(NotImplementedError, match="adapter_ids does not run under torch.func.vmap"):
        torch.func.vmap(lambda xi: lora_linear_multi(xi, w, bias, stack, IDS[:3]))(x[None].expand(2, -1, -1, -1))
    with pytest.raises(ValueError, match="impl must be one of"):
        lora_linear_multi(x, w, bias, stack, IDS[:3], impl="trition")



@needs_triton
def test_vmap_over_a_stack_with_x_unbatched_takes_the_shared_x_kernels(monkeypatch):
    """Every adapter over one x: h and dA are one GEMM each against the stacked factors, the rest the
    grouped kernels; values and gradients (stack and x) as on the reference."""
    from fastaf.kernels import lora_multi

    calls = []
    for name in ("shared_fwd", "shared_bwd"):
        fn = getattr(lora_multi, name)
        monkeypatch.setattr(lora_multi, name, lambda *a, _fn=fn, _n=name, **k: calls.append(_n) or _fn(*a, **k))
    x, w, bias, stack = _op_inputs(1, 5)
    x = x[0]
    out = {}
    for impl in ("triton", "torch"):
        run = lambda xx, st: torch.func.vmap(lambda lo: fa.functional.lora_linear(xx, w, bias, lo, impl=impl))(st)
        out[impl] = (run(x, stack), *torch.func.grad(lambda xx, st: (run(xx, st) ** 2).sum(), argnums=(0, 1))(x, stack))
    assert calls.count("shared_fwd") >= 2 and "shared_bwd" in calls
    (y, gx, gs), (y_ref, gx_ref, gs_ref) = out["triton"], out["torch"]
    assert rel_err(y, y_ref) < 1e-5 and rel_err(gx, gx_ref) < 1e-5
    assert rel_err(gs.A, gs_ref.A) < 1e-5 and rel_err(gs.B, gs_ref.B) < 1e-5


@needs_triton
@pytest.mark.parametrize("x_batched", [True, False])
def test_vmap_over_a_stack_keeps_fp32_master_gradients(x_batched, monkeypatch):
    """fp32 master factors beside half x through the grouped kernels: the stack's gradients come
    back in fp32 without a round trip through x's dtype, on both layouts (x batched: the segment
    kernels; x shared: dA one GEMM with an fp32 result), close to the fp64 reference."""
    from fastaf.kernels import lora_multi

    calls = []
    for name in ("multi_bwd", "shared_bwd"):
        fn = getattr(lora_multi, name)
        monkeypatch.setattr(lora_multi, name, lambda *a, _fn=fn, _n=name, **k: calls.append(_n) or _fn(*a, **k))
    x, w, bias, stack = _op_inputs(3, 16, K=32, N=24)
    x = x if x_batched else x[0]
    dims = (0 if x_batched else None, 0)

    def grads(impl, st, *tensors):
        xx, w, bias = tensors
        f = lambda xi, lo: fa.functional.lora_linear(xi, w, bias, lo, impl=impl)
        return torch.func.grad(lambda s: torch.func.vmap(f, dims)(xx, s).double().square().sum())(st)

    g = grads("triton", stack, *(t.half() for t in (x, w, bias)))
    assert calls == ["multi_bwd" if x_batched else "shared_bwd"]
    # the reference: the same half inputs, everything computed in fp64
    g64 = grads("torch", fa.LoRA(stack.A.double(), stack.B.double(), stack.scale),
                *(t.half().double() for t in (x, w, bias)))
    for name in ("A", "B"):
        got, want = getattr(g, name), getattr(g64, name)
        assert got.dtype == torch.float32, name
        assert (got.half().float() != got).any(), f"d{name} was rounded to x's dtype"
        assert rel_err(got, want.float()) < 5e-3, name


def test_grad_of_grad_through_the_grouped_op_equals_plain_torch():
    from fastaf.ops import lora_linear_multi

    torch.manual_seed(0)
    K, N = 8, 6
    w = torch.randn(N, K, dtype=torch.float64)
    A, B = torch.randn(2, 3, K, dtype=torch.float64), torch.randn(2, N, 3, dtype=torch.float64)
    ids = torch.tensor([1, 0, -1])
    x, v = torch.randn(3, 2, K, dtype=torch.float64), torch.randn(3, 2, K, dtype=torch.float64)

    def plain(x):
        gate, s = (ids >= 0).double()[:, None, None], ids.clamp(min=0)
        return x @ w.T + gate * ((x @ A[s].transpose(1, 2)) @ B[s].transpose(1, 2))

    def hvp(fn):
        f = lambda x: (fn(x) ** 3).sum()
        return torch.func.grad(lambda x: (torch.func.grad(f)(x) * v).sum())(x)

    got = hvp(lambda x: lora_linear_multi(x, w, None, fa.LoRA(A, B, 1.0), ids, impl="torch"))
    assert torch.allclose(got, hvp(plain), rtol=1e-10, atol=1e-10)


@needs_triton
def test_autograd_double_backward_through_the_grouped_kernels():
    """create_graph=True over the kernel path: the second derivative as on plain torch."""
    from fastaf.ops import lora_linear_multi

    x, w, bias, stack = _op_inputs(3, 2)
    ids, v = IDS[:3], torch.randn(3, 2, x.shape[-1])
    grads = {}
    for impl in ("triton", "torch"):
        xg = x.clone().requires_grad_()
        (g,) = torch.autograd.grad((lora_linear_multi(xg, w, bias, stack, ids, impl=impl) ** 3).sum(), xg,
                                   create_graph=True)
        grads[impl] = torch.autograd.grad((g * v).sum(), xg)[0]
    assert grads["torch"].abs().max() > 0 and rel_err(grads["triton"], grads["torch"]) < 1e-5


def test_grouped_jvp_rule_is_the_tangent_of_the_formula():
    """The grouped op's jvp rule, written out, against torch.func.jvp of plain torch (fp64), with
    each operand varying alone and all together (the others' tangents None), fp32 stacked factors
    beside fp64 x, a shared slot and a base row; torch.func.linearize gives the same."""
    from fastaf.ops import lora_linear_multi

    g = torch.Generator().manual_seed(0)
    K, N = 5, 4
    ids = torch.tensor([1, -1, 1, 0])
    f64 = dict(generator=g, dtype=torch.float64)
    primals = (torch.randn(4, 3, K, **f64), torch.randn(N, K, **f64), torch.randn(N, **f64),
               torch.randn(2, 3, K, generator=g), torch.randn(2, N, 3, generator=g))  # x, W, bias; fp32 A, B
    tangents = tuple(torch.randn(p.shape, generator=g, dtype=p.dtype) for p in primals)

    def op(x, w, bias, A, B):
        return lora_linear_multi(x, w, bias, fa.LoRA(A, B, 0.7), ids, impl="torch")

    def plain(x, w, bias, A, B):
        gate, s = (ids >= 0).double()[:, None, None], ids.clamp(min=0)
        lora = (x @ A[s].double().transpose(1, 2)) @ B[s].double().transpose(1, 2)
        return x @ w.T + bias + 0.7 * gate * lora

    for which in [(0,), (1,), (2,), (3,), (4,), (0, 1, 2, 3, 4)]:
        f, p, t = varying(op, primals, tangents, which)
        (y, y_t), (y0, y0_t) = torch.func.jvp(f, p, t), torch.func.jvp(*varying(plain, primals, tangents, which))
        assert rel_err(y, y0) < 1e-12 and rel_err(y_t, y0_t) < 1e-12, which
        assert y_t.shape == (4, 3, N) and y_t.dtype == torch.float64, which
        assert rel_err(torch.func.linearize(f, *p)[1](*t), y0_t) < 1e-12, which
