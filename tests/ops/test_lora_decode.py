"""A decoding step's LoRA (``fastaf.ops.lora_decode``, ``fastaf.kernels.lora_decode``) against the
fp64 formula: the one-launch kernel under the interpreter, the op and its fake under
``torch.compile``, the cuBLAS form, and which calls take the path."""
from __future__ import annotations

import importlib

import pytest
import torch

import fastaf as fa
from fastaf import _config
from tests._modes import needs_interpreter
from tests._tolerances import assert_close

D = importlib.import_module("fastaf.ops.lora_decode")


def make(M, K=40, N=24, r=5, dtype=torch.float32, factor_dtype=None, bias=True, lead=(1,), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, M, K, generator=g).to(dtype)
    w = torch.randn(N, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    fd = factor_dtype or dtype
    lo = fa.LoRA(torch.randn(r, K, generator=g).to(fd), torch.randn(N, r, generator=g).to(fd), 0.7)
    return x, w, b, lo


def ref(x, w, b, lo):
    """fp64 formula: x @ W.T + b + s * (x @ A.T) @ B.T."""
    x, w, A, B = x.double(), w.double(), lo.A.double(), lo.B.double()
    y = x @ w.T + lo.scale * (x @ A.T) @ B.T
    return y if b is None else y + b.double()


@needs_interpreter
@pytest.mark.parametrize("M", [1, 3, 64])
@pytest.mark.parametrize("dtype,factor_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                                (torch.float16, torch.float32)])
def test_the_kernel_adds_the_lora_in_place_or_into_out(M, dtype, factor_dtype):
    # K, N and r off the interpreter's tiles (32, 16) and tl.dot's 16: every tail is masked
    from fastaf.kernels import lora_decode

    x, w, b, lo = make(M, K=72, N=40, r=5, dtype=dtype, factor_dtype=factor_dtype, lead=())
    y = torch.nn.functional.linear(x, w, b)
    want = ref(x, w, b, lo)
    out = lora_decode.add_lora(y, x, lo.A, lo.B, lo.scale, out=torch.empty_like(y))
    assert_close(out, want, dtype)
    assert not torch.equal(out, y)  # y itself is left alone when out is given
    assert lora_decode.add_lora(y, x, lo.A.T.contiguous().T, lo.B, lo.scale) is y  # in place, any strides
    assert_close(y, want, dtype)


@needs_interpreter
@pytest.mark.parametrize("M", [1, 3, 64, 130])
@pytest.mark.parametrize("dtype,factor_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float32)])
def test_the_one_launch_kernel_adds_the_lora_in_place(M, dtype, factor_dtype):
    # eager inference's kernel: K and N off the interpreter's tiles, rank 17 past tl.dot's 16,
    # 130 rows in three row blocks
    from fastaf.kernels import lora_decode

    x, w, b, lo = make(M, K=72, N=40, r=17, dtype=dtype, factor_dtype=factor_dtype, lead=())
    y = torch.nn.functional.linear(x, w, b)
    assert lora_decode.add_lora_fused(y, x, lo.A.T.contiguous().T, lo.B, lo.scale) is y
    assert_close(y, ref(x, w, b, lo), dtype)


@needs_interpreter
@pytest.mark.parametrize("M", [1, 3, 64, 130])
@pytest.mark.parametrize("factor_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("bias", [True, False])
def test_the_one_launch_linear_computes_the_base_gemm_and_the_lora(M, factor_dtype, bias):
    # eager decoding's kernel: the base GEMM and the LoRA in one launch; K and N off the
    # interpreter's tiles, rank 17 past tl.dot's 16, a transposed view as W, 130 rows in three
    # row blocks
    from fastaf.kernels import lora_decode

    x, w, b, lo = make(M, K=72, N=40, r=17, dtype=torch.float16, factor_dtype=factor_dtype, bias=bias, lead=())
    assert lora_decode.linear_supported(x, w, lo.A, lo.B)
    y = lora_decode.linear(x, w.T.contiguous().T, b, lo.A, lo.B, lo.scale)
    assert y.shape == (M, 40) and y.dtype == torch.float16
    assert_close(y, ref(x, w, b, lo), torch.float16)


def multi_ref(x, w, b, A, B, scale, ids):
    """fp64 formula per segment: x @ W.T + b + s * (x @ A[g].T) @ B[g].T, g = ids[row // S], the
    base alone where g is -1."""
    S = x.shape[0] // ids.shape[0]
    y = x.double() @ w.double().T + (0 if b is None else b.double())
    for m in range(x.shape[0]):
        g = int(ids[m // S])
        if g >= 0:
            y[m] += scale * (x[m].double() @ A[g].double().T) @ B[g].double().T
    return y


@needs_interpreter
@pytest.mark.parametrize("M,S", [(1, 1), (3, 1), (64, 1), (6, 2)])
@pytest.mark.parametrize("factor_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("fused", [True, False])
def test_the_decode_kernels_give_each_segment_its_slot_of_the_stack(M, S, factor_dtype, bias, fused):
    # multi_linear (the GEMM with each row's LoRA in its epilogue) and multi_add_ on cuBLAS's
    # GEMM (the partials of the grouped shrink summed by the expand; nothing zeroed, the -1 rows'
    # partials never written); ids with -1 (the base alone) and repeats, a slot no row takes; K and
    # N off the interpreter's tiles, rank 17 past tl.dot's 16, transposed views as W and A
    import torch.nn.functional as F

    from fastaf.kernels import lora_decode

    g = torch.Generator().manual_seed(1)
    K, N, R, n = 72, 40, 17, 4
    x = torch.randn(M, K, generator=g).half()
    w = torch.randn(N, K, generator=g).half()
    b = torch.randn(N, generator=g).half() if bias else None
    A = torch.randn(n, R, K, generator=g).to(factor_dtype)
    B = (torch.randn(n, N, R, generator=g) * 0.5).to(factor_dtype)
    ids = torch.tensor([2, -1, 0, 2, 1, 0] * 11)[:M // S].int()  # slot 3 unused
    assert lora_decode.multi_supported(x, w, A, B)
    w, A = w.T.contiguous().T, A.transpose(1, 2).contiguous().transpose(1, 2)
    if fused:
        y = lora_decode.multi_linear(x, w, b, A, B, ids, 0.7)
    else:
        y = F.linear(x, w, b)
        assert lora_decode.multi_add_(y, x, A, B, ids, 0.7) is y
    assert y.shape == (M, N) and y.dtype == torch.float16
    assert_close(y, multi_ref(x, w, b, A, B, 0.7, ids), torch.float16)


@needs_interpreter
def test_the_one_launch_linear_takes_16_bit_inputs_only():
    from fastaf.kernels import lora_decode

    x, w, _, lo = make(3, lead=())  # fp32: cuBLAS's GEMM, as the base model's
    assert not lora_decode.linear_supported(x, w, lo.A, lo.B)
    assert not lora_decode.linear_supported(x.half(), w, lo.A, lo.B)  # a weight in another dtype
    assert not lora_decode.linear_supported(torch.zeros(lora_decode.LINEAR_MAX_ROWS + 1, 40).half(), w.half(),
                                            lo.A, lo.B)


@needs_interpreter
def test_the_kernel_takes_rank_above_sixteen_and_strided_rows():
    from fastaf.kernels import lora_decode

    x, w, b, lo = make(24, K=48, N=20, r=33, lead=())
    xs = torch.cat([x, x], 1)[:, :48]  # rows strided by 96
    y = torch.nn.functional.linear(xs, w, b)
    assert_close(lora_decode.add_lora(y, xs, lo.A, lo.B, lo.scale), ref(x, w, b, lo), torch.float32)


@needs_interpreter
def test_the_op_traces_with_its_fake_and_runs_the_kernel_compiled():
    x, w, b, lo = make(3, factor_dtype=torch.float32, lead=())
    y = torch.nn.functional.linear(x, w, b)
    step = torch.compile(lambda y, x: D.lora_decode_add(y, x, lo.A, lo.B, lo.scale), backend="aot_eager",
                         fullgraph=True)
    out = step(y, x)
    assert out is not y and out.shape == y.shape
    assert_close(out, ref(x, w, b, lo), torch.float32)


@needs_interpreter
@pytest.mark.parametrize("M", [1, 3, 64])
@pytest.mark.parametrize("factor_dtype", [torch.float16, torch.float32])
def test_one_shrink_launch_serves_siblings_of_different_ranks_and_widths(M, factor_dtype):
    # q/k/v-like siblings on one x: ranks 5, 3 and 17 (past tl.dot's 16), widths 40, 24, 24
    from fastaf.kernels import lora_decode

    g = torch.Generator().manual_seed(3)
    x = torch.randn(M, 72, generator=g).half()
    sibs = [(torch.randn(n, 72, generator=g).half(), fa.LoRA(torch.randn(r, 72, generator=g).to(factor_dtype),
                                                            torch.randn(n, r, generator=g).to(factor_dtype), 0.5 + r))
            for n, r in ((40, 5), (24, 3), (24, 17))]
    assert lora_decode.shares(sibs[0][1].A, [lo.A for _, lo in sibs[1:]])
    part = lora_decode.shrink(x, [lo.A for _, lo in sibs])
    assert part.shape == lora_decode.part_shape(x, 17, 3) and part.shape[:1] == (3,) and part.shape[1] > 1
    for i, (w, lo) in enumerate(sibs):
        y = torch.nn.functional.linear(x, w)
        assert_close(lora_decode.expand(y, part[i], lo.B, lo.scale, out=torch.empty_like(y)),
                     ref(x, w, None, lo), torch.float16)
    assert not lora_decode.shares(sibs[0][1].A, [sibs[1][1].A.T.contiguous().T])  # other strides: alone
    assert not lora_decode.shares(sibs[0][1].A, [sibs[1][1].A.double()])


@needs_interpreter
@pytest.mark.parametrize("M,S", [(1, 1), (3, 1), (64, 1), (6, 2)])
@pytest.mark.parametrize("factor_dtype", [torch.float16, torch.float32])
def test_one_grouped_shrink_launch_serves_the_siblings_of_a_stack_with_ids(M, S, factor_dtype):
    # q/k/v-like siblings' stacks (n, R, K) on one x, widths 40, 24, 24, rank 17 (past tl.dot's
    # 16): each sibling's partials, summed by the grouped expand, give its formula per segment;
    # ids with -1 (the base alone), repeats and a slot no row takes
    from fastaf.kernels import lora_decode, lora_multi

    g = torch.Generator().manual_seed(4)
    K, R, n = 72, 17, 4
    x = torch.randn(M, K, generator=g).half()
    ids = torch.tensor([2, -1, 0, 2, 1, 0] * 11)[:M // S].int()
    sibs = [(torch.randn(N, K, generator=g).half(), torch.randn(n, R, K, generator=g).to(factor_dtype),
             (torch.randn(n, N, R, generator=g) * 0.5).to(factor_dtype)) for N in (40, 24, 24)]
    stacks = [A for _, A, _ in sibs]
    assert lora_decode.multi_shares(stacks)
    part = lora_decode.multi_shrink_shared(x, stacks, ids)
    assert part.shape[0] == 3 and part.shape[2:] == (M, 32)
    for i, (w, A, B) in enumerate(sibs):
        y = torch.nn.functional.linear(x, w)
        lora_multi.expand_(y, part[i], B.transpose(1, 2), ids, 0.7)
        assert_close(y, multi_ref(x, w, None, A, B, 0.7, ids), torch.float16)
    assert not lora_decode.multi_shares([stacks[0], stacks[1][:, :5].contiguous()])  # another rank's strides
    assert not lora_decode.multi_shares([stacks[0], stacks[1].double()])
    assert not lora_decode.multi_shares(stacks * 2)  # past MAX_SIBLINGS


@pytest.mark.parametrize("interpreted", [True, False])
def test_the_shrink_and_expand_ops_trace_with_their_fakes(interpreted, monkeypatch):
    # the partials' shape is the kernels' (several splits of K) where they run, else one split
    if interpreted and not importlib.util.find_spec("triton"):
        pytest.skip("needs triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1" if interpreted else "0")
    torch._dynamo.reset()  # the graph of the other case holds its shapes
    x, w, b, lo = make(3, K=72, N=24, r=5, lead=())
    _, w2, _, lo2 = make(3, K=72, N=16, r=4, lead=(), seed=1)

    def both(x):
        part = D.lora_decode_shrink(x, [lo.A, lo2.A])
        return (D.lora_decode_expand(torch.nn.functional.linear(x, w, b), part, 0, lo.B, lo.scale),
                D.lora_decode_expand(torch.nn.functional.linear(x, w2), part, 1, lo2.B, lo2.scale), part.shape[1])

    y, y2, splits = torch.compile(both, backend="aot_eager", fullgraph=True)(x)
    assert (splits > 1) == interpreted
    assert_close(y, ref(x, w, b, lo), torch.float32)
    assert_close(y2, ref(x, w2, None, lo2), torch.float32)


@pytest.mark.parametrize("interpreted", [True, False])
def test_the_grouped_shrink_and_expanded_ops_trace_with_their_fakes(interpreted, monkeypatch):
    # siblings with a stack and ids (-1 and repeats, segments of 2 rows): the kernels where they run
    # (several splits of K), else torch ops (one split), under torch.compile with the fakes
    if interpreted and not importlib.util.find_spec("triton"):
        pytest.skip("needs triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1" if interpreted else "0")
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(5)
    K, R, n = 72, 6, 3
    x = torch.randn(6, K, generator=g).half()
    ids = torch.tensor([2, -1, 0])
    sibs = [(torch.randn(N, K, generator=g).half(), torch.randn(N, generator=g).half() if N == 24 else None,
             torch.randn(n, R, K, generator=g).half(), (torch.randn(n, N, R, generator=g) * 0.5).half())
            for N in (24, 16)]

    def both(x, ids):
        part = D.lora_multi_decode_shrink(x, [A for _, _, A, _ in sibs], ids)
        return [D.lora_multi_decode_expanded(x, w, b, part, i, B, ids, 0.7) for i, (w, b, _, B) in enumerate(sibs)] \
            + [part.shape[1]]

    *ys, splits = torch.compile(both, backend="aot_eager", fullgraph=True)(x, ids)
    assert (splits > 1) == interpreted
    for y, (w, b, A, B) in zip(ys, sibs):
        assert_close(y, multi_ref(x, w, b, A, B, 0.7, ids), torch.float16)


@needs_interpreter
def test_the_shrink_ops_trace_with_a_dynamic_batch():
    # a second batch size makes the rows a symbol: the fakes size the partials without a plan
    # (whose memo key cannot hold one); one adapter's siblings and a stack's with ids
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(6)
    K, R, n = 72, 6, 3
    a1, a2 = torch.randn(R, K, generator=g).half(), torch.randn(R, K, generator=g).half()
    stack = torch.randn(n, R, K, generator=g).half()

    def shrinks(x, ids):
        return D.lora_decode_shrink(x, [a1, a2]).sum(), D.lora_multi_decode_shrink(x, [stack, stack], ids).shape

    compiled = torch.compile(shrinks, backend="aot_eager", fullgraph=True, dynamic=True)
    for rows in (3, 5):
        x, ids = torch.randn(rows, K, generator=g).half(), torch.zeros(rows, dtype=torch.long)
        total, shape = compiled(x, ids)
        assert shape[0] == 2 and shape[2] == rows and torch.isfinite(total)


@pytest.mark.parametrize("kernel", [True, False])
def test_the_reference_and_the_cublas_form_match_the_formula(kernel):
    # on CPU added_lora takes plain ops (and the op its reference), add_lora_rows mm + addmm_
    x, w, b, lo = make(3, factor_dtype=torch.float32, lead=())
    with _config.override(decode_kernel=kernel):
        assert_close(D.added_lora(torch.nn.functional.linear(x, w, b), x, lo), ref(x, w, b, lo), torch.float32)
    y = torch.nn.functional.linear(x, w, b)
    assert D.add_lora_rows(y, x, lo) is y
    assert_close(y, ref(x, w, b, lo), torch.float32)
    assert_close(D.reference_add(torch.nn.functional.linear(x, w, b), x, lo.A, lo.B, lo.scale), ref(x, w, b, lo),
                 torch.float32)


@pytest.mark.parametrize("M", [1, 3, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_the_decode_path_matches_the_formula_with_master_factors_cast(M, dtype, bias):
    x, w, b, lo = make(M=M, K=16, N=24, r=4, dtype=dtype, factor_dtype=torch.float32, bias=bias)
    y = D.lora_linear_decode(x, w, b, lo, "q_proj")
    assert y.shape == (1, M, 24) and y.dtype == dtype
    assert_close(y, ref(x, w, b, lo), dtype)
    with pytest.raises(ValueError, match="q_proj: LoRA A"):
        D.lora_linear_decode(x, w, b, fa.LoRA(lo.A[:, :8], lo.B, lo.scale), "q_proj")


def test_only_few_row_inference_on_cuda_takes_the_decode_path():
    x, w, b, lo = make(M=4, K=16, N=8, r=2)
    dropped = fa.LoRA(lo.A, lo.B, lo.scale, 0.1)
    with torch.no_grad():
        assert not D.decoding(x, lo, "auto", False)  # a CPU tensor: the reference is as lean
        if torch.cuda.is_available():
            xc = x.cuda()
            assert D.decoding(xc, lo, "auto", False) and D.decoding(xc, lo, "addmm", False)
            assert D.decoding(xc, dropped, "auto", False)  # eval: no dropout drawn
            assert not D.decoding(xc, dropped, "auto", True)
            assert not D.decoding(xc, lo, "triton", False)  # a forced impl is honoured
            assert D.decoding(torch.zeros(D.EAGER_ROWS, 16, device="cuda"), lo, "auto", False)
            assert not D.decoding(torch.zeros(D.EAGER_ROWS + 1, 16, device="cuda"), lo, "auto", False)
            assert not torch.func.vmap(lambda t: torch.tensor(D.decoding(t, lo, "auto", False)))(
                xc[None].expand(2, -1, -1, -1)).any()
    if torch.cuda.is_available():
        assert not D.decoding(x.cuda(), lo, "auto", False)  # grad on: the Function records the VJP


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("M", [1, 32, 64])
def test_the_kernel_matches_cublas_on_cuda_in_bf16(M):
    x, w, b, lo = make(M, K=2048, N=512, r=16, dtype=torch.bfloat16, factor_dtype=torch.float32, lead=())
    x, w, b, lo = x.cuda(), w.cuda(), b.cuda(), fa.LoRA(lo.A.cuda(), lo.B.cuda(), lo.scale)
    with torch.no_grad():
        kernels = D.added_lora(torch.nn.functional.linear(x, w, b), x, lo)  # the decode kernels, eagerly
        cublas = D.lora_linear_decode(x, w, b, lo, "q_proj")
        compiled = torch.compile(lambda x: D.traced_decode(x, w, b, lo, "auto"), fullgraph=True)(x)
    want = ref(x, w, b, lo)
    for y in (kernels, cublas, compiled):
        assert_close(y, want, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("M", [32, 512])
@pytest.mark.parametrize("linear,kernel", [(True, True), (False, True), (False, False)])
def test_eager_decoding_runs_one_launch_or_cublas_then_the_lora_on_cuda(M, linear, kernel):
    from fastaf.kernels import lora_decode

    x, w, b, lo = make(M, K=2048, N=512, r=16, dtype=torch.bfloat16, factor_dtype=torch.float32, lead=())
    x, w, b, lo = x.cuda(), w.cuda(), b.cuda(), fa.LoRA(lo.A.cuda(), lo.B.cuda(), lo.scale)
    ran = lora_decode.LINEAR.hits
    with torch.no_grad(), _config.override(decode_linear=linear, eager_decode_kernel=kernel):
        for _ in range(2):  # the second call takes the launch site's cached kernel
            assert_close(D.lora_linear_decode(x, w, b, lo, "q_proj"), ref(x, w, b, lo), torch.bfloat16)
    took = linear and M <= lora_decode.LINEAR_MAX_ROWS
    assert (lora_decode.LINEAR.hits > ran) == took


def _stack(n, K, N, r, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return fa.LoRA(torch.randn(n, r, K, generator=g).to(dtype), torch.randn(n, N, r, generator=g).to(dtype), 0.7)


@needs_interpreter
@pytest.mark.parametrize("M", [1, 3, 64])
@pytest.mark.parametrize("factor_dtype", [torch.float32, torch.float16])
def test_a_stack_with_one_id_per_row_decodes_through_the_grouped_kernels(M, factor_dtype):
    x, w, b, _ = make(M, K=40, N=24, dtype=torch.float16, lead=())
    stack = _stack(4, 40, 24, 5, factor_dtype)
    ids = torch.tensor([-1, 2, 2, 0, 3, 1] * 11)[:M]  # -1 (the base) and repeats
    got = D.lora_multi_decode(x, w, b, stack, ids)
    for i in range(M):
        want = ref(x[i:i + 1], w, b, fa.LoRA(stack.A[ids[i]], stack.B[ids[i]], stack.scale) if ids[i] >= 0
                   else fa.LoRA(stack.A[0] * 0, stack.B[0], stack.scale))
        assert_close(got[i:i + 1], want, torch.float16)


@needs_interpreter
def test_a_stack_decodes_examples_of_several_rows_with_one_id_each():
    x, w, b, _ = make(3, K=40, N=24, lead=(2,))  # 2 examples x 3 rows
    stack = _stack(3, 40, 24, 4, torch.float32)
    got = D.lora_multi_decode(x, w, b, stack, torch.tensor([2, 0]))
    assert got.shape == (2, 3, 24)
    for i, slot in enumerate((2, 0)):
        assert_close(got[i], ref(x[i], w, b, fa.LoRA(stack.A[slot], stack.B[slot], stack.scale)), torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("M", [1, 32, 64])
@pytest.mark.parametrize("factor_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", ["never", "always"])
def test_the_decode_kernels_of_a_stack_match_the_formula_on_cuda_in_bf16(M, factor_dtype, mode):
    # eager (lora_multi_decode) and compiled (the registered op), 16 slots, rows cycling through
    # them with a -1 among them, at the 1B model's widths
    from fastaf.ops import lora_multi

    g = torch.Generator().manual_seed(2)
    K, N, R, n = 2048, 512, 16, 16
    x = torch.randn(M, K, generator=g).bfloat16().cuda()
    w = (torch.randn(N, K, generator=g) * 0.02).bfloat16().cuda()
    A = (torch.randn(n, R, K, generator=g) * 0.02).to(factor_dtype).cuda()
    B = (torch.randn(n, N, R, generator=g) * 0.02).to(factor_dtype).cuda()
    ids = (torch.arange(M) % n).cuda()
    ids[M // 2] = -1
    lo = fa.LoRA(A, B, 0.7)
    with torch.no_grad(), _config.override(decode_multi_linear=mode):  # cuBLAS's GEMM or the one in the LoRA's launch
        assert D.multi_decodes(x, w, lo, "auto")
        eager = D.lora_multi_decode(x, w, None, lo, ids)
        compiled = torch.compile(lambda x, ids: lora_multi.lora_linear_multi(x, w, None, lo, ids),
                                 fullgraph=True)(x, ids)
    want = multi_ref(x.cpu(), w.cpu(), None, A.cpu(), B.cpu(), 0.7, ids.cpu())
    for y in (eager, compiled):
        assert_close(y.cpu(), want, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_decoding_step_with_ids_on_the_device_never_waits_on_the_host():
    # ids stay on the device: the eager decode kernels and the compiled op replayed from a CUDA
    # graph (mode="reduce-overhead") read them there, so new ids of the same shape run with no
    # host sync (torch's sync debug mode raises on one) and each row takes its new slot
    from fastaf.ops import lora_multi

    g = torch.Generator().manual_seed(5)
    M, K, N, R, n = 32, 2048, 512, 16, 16
    x = torch.randn(M, K, generator=g).bfloat16().cuda()
    w = (torch.randn(N, K, generator=g) * 0.02).bfloat16().cuda()
    lo = fa.LoRA((torch.randn(n, R, K, generator=g) * 0.02).bfloat16().cuda(),
                 (torch.randn(n, N, R, generator=g) * 0.02).bfloat16().cuda(), 0.7)
    first = (torch.arange(M) % n).cuda()
    then = ((torch.arange(M) * 7 + 3) % (n + 1) - 1).cuda()  # other slots, -1 among them
    step = torch.compile(lambda x, ids: lora_multi.lora_linear_multi(x, w, None, lo, ids), mode="reduce-overhead")
    with torch.no_grad():
        for _ in range(3):  # compile, warm up and record the graph
            step(x, first), D.lora_multi_decode(x, w, None, lo, first)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            eager = D.lora_multi_decode(x, w, None, lo, then)
            compiled = step(x, then).clone()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    want = multi_ref(x.cpu(), w.cpu(), None, lo.A.cpu(), lo.B.cpu(), 0.7, then.cpu())
    for y in (eager, compiled):
        assert_close(y.cpu(), want, torch.bfloat16)
