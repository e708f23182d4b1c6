"""fastaf.kernels.lora_linear against an fp64 torch reference.

CPU (TRITON_INTERPRET=1): fp32 at odd shapes, both gemm variants (TMA descriptors and plain
pointers), every gradient, dropout, bias, transposed weights, needs_dx=False, bad inputs.
GPU (marker `gpu`): bf16 / fp16 at real sizes, the persistent TMA path and impl="auto".
"""
from __future__ import annotations

import os
from typing import Optional

import pytest
import torch

from fastaf.kernels import lora_linear as ll
from fastaf.kernels.lora_linear_configs import DEFAULTS, fit, fit_smaller, gemm_configs, smem_bytes
from fastaf.kernels.lora_linear_plan import padded_rank
from fastaf.kernels.dropout_hash import keep_mask
from tests._modes import deterministic
from tests._tolerances import assert_close

HAS_CUDA = torch.cuda.is_available()
CAN_TRITON = HAS_CUDA or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not CAN_TRITON, reason="Triton needs CUDA or TRITON_INTERPRET=1")


def reference(x, weight, bias, a, b, scale, p, seed, dy):
    """fp64 forward and backward: (y, h, dx, da, db)."""
    x, weight, a, b, dy = (t.double() for t in (x, weight, a, b, dy))
    M, K = x.shape
    mask = keep_mask(seed, M, K, p, x.device).double() / (1 - p) if p > 0 else torch.ones_like(x)
    h = (x * mask) @ a.T
    y = x @ weight.T + scale * h @ b.T
    if bias is not None:
        y = y + bias.double()
    dh = scale * dy @ b
    return y, h, dy @ weight + mask * (dh @ a), dh.T @ (x * mask), scale * dy.T @ h


def make(M, K, N, R, dtype, device, *, bias=True, p=0.0, weight_t=False, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    x = rnd(M, K)
    # weight_t: the (N, K) weight is a transposed view of a contiguous (K, N) tensor (GPT-2 Conv1D)
    weight = rnd(K, N).T if weight_t else rnd(N, K)
    weight = weight / K**0.5
    a = rnd(R, K) / K**0.5
    b = rnd(N, R)
    dy = rnd(M, N)
    seed_t = torch.tensor([1234 + seed], dtype=torch.int64, device=device) if p > 0 else None
    return x, weight, rnd(N) if bias else None, a, b, dy, seed_t


def check(M, K, N, R, *, dtype=torch.float32, device="cpu", bias=True, p=0.0, weight_t=False,
          needs_dx=True, impl="triton", use_tma: Optional[bool] = None, key=None, scale=0.5):
    key = dtype if key is None else key
    x, weight, bias_t, a, b, dy, seed = make(M, K, N, R, dtype, device, bias=bias, p=p, weight_t=weight_t)
    inputs = [t.clone() for t in (x, weight, a, b, dy)]
    if use_tma is None:
        y, h = ll.lora_linear_fwd(x, weight, bias_t, a, b, scale, p, seed, impl=impl)
        dx, da, db = ll.lora_linear_bwd(dy, x, weight, a, b, h, scale, p, seed, needs_dx, impl=impl)
    else:  # drive the kernels directly to pin the gemm variant
        h = ll.fwd_h(x, a, p, seed)
        y = ll.gemm(x, weight.T, h, b.T, bias_t, scale, 0.0, None, dtype, use_tma=use_tma)
        dh, db = ll.bwd_dy(dy, b, h, scale)
        da, db = ll.bwd_da(dh, x, p, seed).to(dtype), db.to(dtype)  # the kernels reduce in fp32
        dx = ll.gemm(dy, weight, dh, a, None, 1.0, p, seed, dtype, use_tma=use_tma) if needs_dx else None
    y_r, h_r, dx_r, da_r, db_r = reference(x, weight, bias_t, a, b, scale, p, seed, dy)
    assert y.dtype == h.dtype == da.dtype == db.dtype == dtype
    assert_close(y, y_r, key, "y")
    assert_close(h, h_r, key, "h")
    assert_close(da, da_r, key, "da")
    assert_close(db, db_r, key, "db")
    if needs_dx:
        assert dx.dtype == dtype
        assert_close(dx, dx_r, key, "dx")
    else:
        assert dx is None
    for before, after in zip(inputs, (x, weight, a, b, dy)):
        assert torch.equal(before, after), "a launcher wrote into its input"


# (M, K, N) odd everywhere for the plain-pointer variant; TMA needs 16-byte row strides
# (K, N multiples of 4 in fp32) but M and the block tails stay odd.
PLAIN = (37, 45, 29)
TMA = (37, 44, 28)

CASES = [  # (R, bias, dropout_p, weight_t, needs_dx)
    (1, True, 0.0, False, True),
    (3, False, 0.25, False, True),
    (16, True, 0.0, True, True),
    (3, True, 0.5, True, False),
    (16, False, 0.1, False, True),
]


@needs_triton
@pytest.mark.parametrize("R,bias,p,weight_t,needs_dx", CASES)
@pytest.mark.parametrize("use_tma", [False, True], ids=["plain", "tma"])
def test_triton_matches_reference(R, bias, p, weight_t, needs_dx, use_tma):
    device = "cuda" if HAS_CUDA else "cpu"
    key = "tf32" if HAS_CUDA and torch.backends.cuda.matmul.allow_tf32 else torch.float32
    check(*(TMA if use_tma else PLAIN), R, device=device, bias=bias, p=p, weight_t=weight_t,
          needs_dx=needs_dx, use_tma=use_tma, key=key)


@needs_triton
@pytest.mark.parametrize("R", [3, 16])
def test_launchers_triton(R):
    """The public launchers with impl='triton' (the variant they pick for these strides)."""
    device = "cuda" if HAS_CUDA else "cpu"
    check(*PLAIN, R, device=device, p=0.2, impl="triton")


def skinny(M, K, N, R, p, configs, *, dtype=torch.float32, device="cpu", key=None, seed=0):
    """fwd_h, bwd_dy, bwd_da with pinned configs against fp64 (h, dh, db, da)."""
    key = dtype if key is None else key
    x, weight, _, a, b, dy, seed_t = make(M, K, N, R, dtype, device, bias=False, p=p, seed=seed)
    scale = 0.5
    _, h_r, _, da_r, db_r = reference(x, weight, None, a, b, scale, p, seed_t, dy)
    h = ll.fwd_h(x, a, p, seed_t, config=configs.get("fwd_h"))
    assert_close(h, h_r, key, "h")
    dh, db = ll.bwd_dy(dy, b, h, scale, config=configs.get("bwd_dy"))
    assert db.dtype == dtype and dh.dtype == torch.float32
    assert_close(dh, scale * dy.double() @ b.double(), key, "dh")
    assert_close(db, scale * dy.double().T @ h.double(), key, "db")
    da = ll.bwd_da(dh, x, p, seed_t, config=configs.get("bwd_da"))
    assert_close(da, dh.double().T @ (x.double() * (keep_mask(seed_t, M, K, p, x.device).double() / (1 - p)
                                                   if p > 0 else 1.0)), key, "da")
    return h, dh, db, da


SKINNY = [  # every meta-parameter combination of the skinny kernels: TMA loads, db partials, splits
    dict(fwd_h=dict(BLOCK_M=16, BLOCK_K=32, USE_TMA=1, num_warps=4, num_stages=1),
         bwd_dy=dict(BLOCK_M=16, BLOCK_N=16, SPLIT_N=2, USE_TMA=1, DB_PARTIAL=1, num_warps=4, num_stages=1),
         bwd_da=dict(BLOCK_M=16, BLOCK_K=32, SPLIT_M=2, USE_TMA=1, num_warps=4, num_stages=1)),
    dict(fwd_h=dict(BLOCK_M=32, BLOCK_K=16, USE_TMA=0, num_warps=4, num_stages=1),
         bwd_dy=dict(BLOCK_M=16, BLOCK_N=16, SPLIT_N=1, USE_TMA=0, DB_PARTIAL=0, num_warps=4, num_stages=1),
         bwd_da=dict(BLOCK_M=16, BLOCK_K=16, SPLIT_M=1, USE_TMA=0, num_warps=4, num_stages=1)),
    dict(bwd_dy=dict(BLOCK_M=32, BLOCK_N=16, SPLIT_N=3, USE_TMA=1, DB_PARTIAL=0, num_warps=4, num_stages=1),
         bwd_da=dict(BLOCK_M=16, BLOCK_K=16, SPLIT_M=3, USE_TMA=1, num_warps=4, num_stages=1)),
    dict(bwd_dy=dict(BLOCK_M=16, BLOCK_N=32, SPLIT_N=1, USE_TMA=0, DB_PARTIAL=1, num_warps=4, num_stages=1)),
]


@needs_triton
@pytest.mark.parametrize("case", range(len(SKINNY)))
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_skinny_variants(case, p):
    """TMA and pointer loads, db partials and atomics, split and unsplit reductions, odd M and tails."""
    device = "cuda" if HAS_CUDA else "cpu"
    key = "tf32" if HAS_CUDA and torch.backends.cuda.matmul.allow_tf32 else torch.float32
    skinny(*TMA, 5, p, SKINNY[case], device=device, key=key)  # TMA shapes: 16-byte row strides


@needs_triton
@pytest.mark.parametrize("db_partial", [0, 1])
@pytest.mark.parametrize("split", [1, 2])
def test_shared_grads_buffer_matches_separate_buffers(monkeypatch, db_partial, split):
    """The eager path's one zero-filled buffer for dh, dA and dB (atomics) gives what separate
    buffers give, and dA, dB do not overlap (they are views of it as the gradients of A and B)."""
    from fastaf.kernels import lora_linear_configs, lora_linear_plan

    device = "cuda" if HAS_CUDA else "cpu"
    conf = dict(lora_linear_configs.INTERPRET["bwd_dy"], DB_PARTIAL=db_partial, SPLIT_N=split)
    monkeypatch.setitem(lora_linear_configs.INTERPRET, "bwd_dy", conf)
    lora_linear_plan.clear_memos()
    try:
        x, weight, _, a, b, dy, seed = make(*PLAIN, 5, torch.float32, device, bias=False)
        h = x @ a.T
        args = (dy, x, weight, a, b, h, 0.5, 0.0, None, True, "triton")
        dx, da, db = ll.lora_linear_bwd_unchecked(*args, shared_grads=True)
        want = ll.lora_linear_bwd_unchecked(*args)
        for got, ref, name in zip((dx, da, db), want, ("dx", "da", "db")):
            assert_close(got, ref, torch.float32, name)
        da.fill_(1.0)
        assert_close(db, want[2], torch.float32, "db after writing da")
        _, _, _, _, db_r = reference(x, weight, None, a, b, 0.5, 0.0, None, dy)
        assert_close(db, db_r, torch.float32, "db")
    finally:
        lora_linear_plan.clear_memos()


def _segments_check(M, K, Ns, R, dtype, device, use_tma=None):
    """gemm with extra (x_j, w_j) segments: siblings' dX = sum_j dy_j @ W_j + dh @ A in one launch,
    and the forward layout (w_j with unit stride on K), against fp64; nothing else is written."""
    g = torch.Generator(device=device).manual_seed(M + K)
    rnd = lambda *s: torch.randn(*s, device=device, dtype=dtype, generator=g)  # noqa: E731
    dys, ws = [rnd(M, n) for n in Ns], [rnd(n, K) / n**0.5 for n in Ns]
    dh, a = rnd(M, R).float(), rnd(R, K)
    for n_seg in range(1, len(Ns) + 1):
        want = sum(d.double() @ w.double() for d, w in zip(dys[:n_seg], ws[:n_seg])) + dh.double() @ a.double()
        got = ll.gemm(dys[0], ws[0], dh, a, None, 1.0, 0.0, None, dtype, use_tma=use_tma,
                      extra=list(zip(dys[1:n_seg], ws[1:n_seg])))
        assert_close(got, want, dtype)
    xs, ws_t = [rnd(M, n) for n in Ns], [rnd(K, n) / n**0.5 for n in Ns]  # forward: w_j = W_j.T views
    b, h = rnd(K, R), rnd(M, R)
    want = sum(x.double() @ w.double().T for x, w in zip(xs, ws_t)) + 0.5 * h.double() @ b.double().T
    got = ll.gemm(xs[0], ws_t[0].T, h, b.T, None, 0.5, 0.0, None, dtype, use_tma=use_tma,
                  extra=[(x, w.T) for x, w in zip(xs[1:], ws_t[1:])])
    assert_close(got, want, dtype)


@needs_triton
def test_gemm_sums_extra_segments():
    _segments_check(37, 24, [40, 16, 8], 6, torch.float32, "cpu")


def test_gemm_refuses_bad_segments():
    dy, w, dh, a = torch.randn(8, 6), torch.randn(6, 4), torch.randn(8, 2), torch.randn(2, 4)
    for extra in ([(dy, w)] * 3, [(dy.T.contiguous().T, w)], [(dy, w[:, :3])], [(dy, w.T.contiguous().T)],
                  [(dy.double(), w)], [(dy, w.half())]):
        with pytest.raises(ValueError, match="extra segments"):
            ll.gemm(dy, w, dh, a, None, 1.0, 0.0, None, torch.float32, extra=extra)


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_addmm_path_matches_reference(p):
    check(*PLAIN, 5, p=p, impl="addmm", weight_t=True)


def test_shared_passes_ask_the_dispatch_at_the_first_siblings_rank(monkeypatch):
    """The siblings' stacked h and dA passes follow the first sibling's own choice at (M, K, n, r),
    not the summed rank's; a sum beyond the kernels' padding takes cuBLAS."""
    from fastaf.kernels.lora_linear_configs import MAX_RANK

    asked = []
    monkeypatch.setattr(ll, "choose_impl",
                        lambda impl, phase, x, M, K, N, R: asked.append((phase, M, K, N, R)) or "addmm")
    x, a = torch.randn(6, 8, dtype=torch.float64), torch.randn(48, 8, dtype=torch.float64)
    torch.testing.assert_close(ll.shared_h(x, a, 32, 16, "auto"), x @ a.T)
    dh = torch.randn(6, 48, dtype=torch.float64)
    torch.testing.assert_close(ll.shared_da(dh, x, 32, 16, "auto"), dh.T @ x)
    assert asked == [("fwd", 6, 8, 32, 16), ("bwd", 6, 8, 32, 16)]
    asked.clear()
    wide = torch.randn(MAX_RANK + 16, 8, dtype=torch.float64)
    torch.testing.assert_close(ll.shared_h(x, wide, 32, 16, "triton"), x @ wide.T)
    torch.testing.assert_close(ll.shared_da(x @ wide.T, x, 32, 16, "triton"), (x @ wide.T).T @ x)
    assert not asked


def test_bwd_da_call_plans_differ_per_dh_dtype():
    """A bwd_da call plan keeps the kernel it launched, specialized on dh's dtype: a compiled
    graph's bf16 dh and an eager group's fp32 dh at one shape get plans of their own (one shared
    plan relaunched the other's kernel, reading dh in the wrong dtype)."""
    x = torch.randn(64, 32)
    fp32 = ll.bwd_da_plan(x, 8, False, None, None, torch.float32)
    assert ll.bwd_da_plan(x, 8, False, None, None, torch.bfloat16) is not fp32
    assert ll.bwd_da_plan(x, 8, False, None, None) is fp32  # the backward's own dh: fp32


def test_available():
    assert ll.available(torch.empty(1)) == (os.environ.get("TRITON_INTERPRET") == "1")


@pytest.mark.parametrize("bad", ["x_dtype", "x_int", "weight_dtype", "a_shape", "bias_shape", "seed"])
def test_bad_inputs(bad):
    x, weight, bias, a, b, dy, _ = make(8, 16, 12, 4, torch.float32, "cpu")
    seed, p = None, 0.0
    if bad == "x_dtype":
        x, weight, a, b, bias = (t.double() for t in (x, weight, a, b, bias))
    elif bad == "x_int":
        x = x.to(torch.int32)
    elif bad == "weight_dtype":
        weight = weight.half()
    elif bad == "a_shape":
        a = a[:, :-1]
    elif bad == "bias_shape":
        bias = bias[:-1]
    elif bad == "seed":
        p = 0.1
    with pytest.raises(ValueError) as err:
        ll.lora_linear_fwd(x, weight, bias, a, b, 1.0, p, seed, impl="addmm")
    if bad in ("x_dtype", "x_int", "weight_dtype"):
        msg = str(err.value)
        assert "dtype" in msg and ("x" in msg or "weight" in msg) and "(" in msg  # names tensor, shape, dtype


@needs_triton
@pytest.mark.parametrize("warn_only", [False, True], ids=["strict", "warn_only"])
def test_forced_triton_backward_alerts_in_deterministic_mode(warn_only):
    """The Triton backward sums with fp32 atomics: forced under torch's deterministic mode it
    raises, or warns and still computes the right gradients with warn_only=True; the forward
    (no atomics) runs either way."""
    x, weight, bias, a, b, dy, _ = make(40, 48, 24, 4, torch.float32, "cuda" if HAS_CUDA else "cpu")
    with deterministic(warn_only):
        y, h = ll.lora_linear_fwd(x, weight, bias, a, b, 0.5, 0.0, None, impl="triton")
        if not warn_only:
            with pytest.raises(RuntimeError, match="deterministic"):
                ll.lora_linear_bwd(dy, x, weight, a, b, h, 0.5, 0.0, None, True, impl="triton")
            return
        with pytest.warns(UserWarning, match="atomics"):
            dx, da, db = ll.lora_linear_bwd(dy, x, weight, a, b, h, 0.5, 0.0, None, True, impl="triton")
    _, _, ref_dx, ref_da, ref_db = reference(x, weight, bias, a, b, 0.5, 0.0, None, dy)
    for got, want in ((dx, ref_dx), (da, ref_da), (db, ref_db)):
        assert_close(got, want, torch.float32)


@pytest.mark.parametrize("R", [1, 3, 16, 64, 100])
def test_padded_rank(R):
    pad = padded_rank(R)
    assert pad >= max(R, 16) and pad & (pad - 1) == 0


# ---- GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("R", [16, 64])
@pytest.mark.parametrize("M", [4096, 4099])
def test_gpu_real_sizes(dtype, R, M):
    check(M, 4096, 4096, R, dtype=dtype, device="cuda", p=0.1 if R == 16 else 0.0, impl="triton")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("weight_t", [False, True])
def test_gpu_tma_persistent(weight_t):
    """Both TMA weight layouts of the persistent gemm, against the plain variant and fp64."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA descriptors need Hopper")
    check(2048 + 5, 1024, 3072, 16, dtype=torch.bfloat16, device="cuda", weight_t=weight_t, p=0.1, use_tma=True)
    check(2048 + 5, 1024, 3072, 16, dtype=torch.bfloat16, device="cuda", weight_t=weight_t, use_tma=False)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("use_tma", [True, False])
def test_gpu_gemm_sums_extra_segments(use_tma):
    if use_tma and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA descriptors need Hopper")
    _segments_check(2048 + 5, 1024, [1024, 512, 256], 16, torch.bfloat16, "cuda", use_tma=use_tma)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_auto_and_fp32():
    check(1000, 512, 768, 8, dtype=torch.bfloat16, device="cuda", impl="auto", p=0.1)
    check(1000, 512, 768, 8, dtype=torch.float32, device="cuda", impl="triton",
          key="tf32" if torch.backends.cuda.matmul.allow_tf32 else torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_auto_backward_is_repeatable_in_deterministic_mode(monkeypatch, set_flags):
    """impl="auto" under torch's deterministic mode: the backward takes cuBLAS even where the
    dispatch would take the Triton kernels (forced here by the benchmarks' override), gives the same
    bits every run, and matches fp64. warn_only=True: torch's own cuBLAS alert is not the subject."""
    from fastaf.kernels.lora_linear_plan import choose_impl

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    set_flags(dispatch="triton")
    x, weight, bias, a, b, dy, _ = make(8192, 2048, 2048, 16, torch.bfloat16, "cuda")
    with deterministic(warn_only=True):
        assert choose_impl("auto", "fwd", x, 8192, 2048, 2048, 16) == "triton"
        assert choose_impl("auto", "bwd", x, 8192, 2048, 2048, 16) == "addmm"
        y, h = ll.lora_linear_fwd(x, weight, bias, a, b, 0.5, 0.0, None, impl="auto")
        runs = [ll.lora_linear_bwd(dy, x, weight, a, b, h, 0.5, 0.0, None, True, impl="auto") for _ in range(3)]
    for run in runs[1:]:
        for got, first in zip(run, runs[0]):
            assert torch.equal(got, first)
    _, _, ref_dx, ref_da, ref_db = reference(x, weight, bias, a, b, 0.5, 0.0, None, dy)
    for got, want in zip(runs[0], (ref_dx, ref_da, ref_db)):
        assert_close(got, want, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_dispatch_override_forces_a_path(monkeypatch, set_flags):
    """bench/e2e.py's -triton / -addmm: the override replaces the measured choice at every shape
    (not the deterministic mode's cuBLAS backward), and each path stays right."""
    from fastaf.kernels.lora_linear_plan import choose_impl

    x = torch.empty(64, 32, device="cuda", dtype=torch.bfloat16)
    for path in ("triton", "addmm"):
        set_flags(dispatch=path)
        assert {choose_impl("auto", phase, x, 64, 32, 48, 4) for phase in ("fwd", "bwd")} == {path}
        check(100, 64, 96, 4, dtype=torch.bfloat16, device="cuda", impl="auto")
    set_flags(dispatch="triton")
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    with deterministic(warn_only=True):
        assert choose_impl("auto", "bwd", x, 64, 32, 48, 4) == "addmm"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_bwd_da_keeps_a_kernel_per_dh_dtype():
    """dA at one shape from a compiled graph's bf16 dh (``shared_da``), then from an eager group's
    fp32 dh (``bwd_da``): each launch reads dh in its own dtype. Before, the kernel kept for the
    first ran the second too, reading fp32 as bf16 (NaN gate/up dA after a compiled step)."""
    x = torch.randn(2048, 512, device="cuda", dtype=torch.bfloat16)
    wide = torch.randn(2048, 40, device="cuda", dtype=torch.bfloat16)
    for dh in (wide[:, :32], wide[:, :32].float(), wide[:, :32].contiguous(), wide[:, 8:40].float()):
        ref = dh.double().T @ x.double()
        if dh.dtype == torch.bfloat16:  # the compiled path's op, any strides
            got = ll.shared_da(dh, x, 8192, 16, "triton")
        else:
            got = ll.bwd_da(dh.contiguous(), x, 0.0, None)
        assert torch.isfinite(got).all()
        assert_close(got, ref, torch.bfloat16, f"dA from a {dh.dtype} dh")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_fast_launch_repeats():
    """Repeated launches take the cached-kernel path and stay right on fresh inputs, also when an
    argument's specialization changes (misaligned view, different dropout, fp16 vs bf16)."""
    from fastaf.kernels import launch_sites

    if not launch_sites.fast_launch_enabled():
        pytest.skip("fast launch disabled here")
    hits = {name: site.hits for name, site in ll.SITES.items()}
    for seed in range(3):
        for dtype in (torch.bfloat16, torch.float16):
            check(1024 + 3, 512, 768, 16, dtype=dtype, device="cuda", impl="triton", p=0.1 * (seed % 2))
        skinny(1024, 512, 768, 16, 0.0, {}, dtype=torch.bfloat16, device="cuda", seed=seed)
    for name in ("fwd_h", "gemm", "bwd_dy", "bwd_da"):
        assert ll.SITES[name].hits > hits[name], f"{name}: the fast path never ran"
        assert ll.SITES[name].fast, f"{name}: the fast path was disabled"
    # a view whose data_ptr is not 16-byte aligned must not reuse the aligned kernel
    x = torch.randn(1024, 514, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(16, 514, device="cuda", dtype=torch.bfloat16)
    for xs in (x[:, :512], x[:, 1:513], x[:, :512]):
        as_ = a[:, 1:513] if xs.data_ptr() % 16 else a[:, :512]
        assert_close(ll.fwd_h(xs, as_, 0.0, None), xs.double() @ as_.double().T, torch.bfloat16, "h")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("weight_t", [False, True])
def test_gpu_every_tuned_gemm_config(weight_t):
    """fastaf-tune picks gemm configs by speed alone: each one of the search (FLATTEN on and off,
    every block shape and stage count) must compute the same result (fwd layout and dx layout)."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the search is for Hopper")
    g = torch.Generator(device="cuda").manual_seed(0)
    M, K, N, R = 1000, 640, 768, 16
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) / K**0.5
    w_kn = w.T if not weight_t else w.T.contiguous()  # (K, N): forward's view, or K-major memory
    h = torch.randn(M, R, device="cuda", dtype=torch.bfloat16, generator=g)
    u = torch.randn(R, N, device="cuda", dtype=torch.bfloat16, generator=g) / R**0.5
    want = x.double() @ w_kn.double() + 0.5 * h.double() @ u.double()
    for conf in gemm_configs():
        y = ll.gemm(x, w_kn, h, u, None, 0.5, 0.0, None, torch.bfloat16, config=conf)
        assert_close(y, want, torch.bfloat16, f"gemm {conf}")


def test_gemm_smem_model_counts_the_out_tile_apart():
    """triton 3.6 on the H100 gave the default 128x256x64 3-stage gemm 213016 bytes: the stages
    plus a separate out tile (+24 for barriers). A model that let the out tile reuse the stages'
    buffers would pass configs that Triton then refuses."""
    conf = DEFAULTS["gemm"]
    assert smem_bytes("gemm", conf, 16, 2) == 3 * (128 * 64 + 64 * 256) * 2 + 128 * 256 * 2 == 213016 - 24


def test_smem_model_counts_fp32_factor_tiles():
    """An fp32 factor beside 16-bit x pipelines a tile twice as wide: fwd_h's a, bwd_dy's b. Fitted
    with the factor's width, a config loses stages; where even two overflow, fit says None and the
    launcher reads the factor in x's dtype (q/k/v's stacked fp32 A, r=48, overflowed on the H100:
    245760 bytes against 232448)."""
    conf = dict(BLOCK_M=64, BLOCK_K=256, num_stages=4)
    assert smem_bytes("fwd_h", conf, 64, 2) == 262144
    assert smem_bytes("fwd_h", conf, 64, 2, 4) == 4 * (64 * 256 * 2 + 64 * 256 * 4)
    assert fit("fwd_h", conf, 64, 2, 232448, 4)["num_stages"] == 2
    assert fit("fwd_h", conf, 256, 2, 232448, 4) is None
    dy_conf = dict(BLOCK_M=256, BLOCK_N=64, num_stages=3)
    assert smem_bytes("bwd_dy", dy_conf, 64, 2, 4) > smem_bytes("bwd_dy", dy_conf, 64, 2)
    assert smem_bytes("bwd_dy", dy_conf, 16, 2) == smem_bytes("bwd_dy", dy_conf, 16, 2, 2)


# bwd_dy's shared memory as Triton 3.6 allocated it on the H100 (a probe of compiled kernels):
# (BLOCK_M, BLOCK_N, num_stages, R_PAD, bytes per b element, bytes), bf16 dy, SPLIT_N=4
_BWD_DY_SMEM_H100 = [
    (256, 64, 2, 64, 2, 131072), (256, 64, 3, 64, 2, 172032), (128, 64, 2, 64, 2, 81920),
    (128, 64, 3, 64, 2, 106496), (64, 64, 2, 64, 2, 57344), (128, 32, 2, 64, 2, 36864),
    (256, 64, 2, 64, 4, 131072), (256, 64, 3, 64, 4, 180224), (128, 64, 2, 64, 4, 81920),
    (128, 64, 3, 64, 4, 114688), (64, 64, 2, 64, 4, 57344), (128, 32, 2, 64, 4, 36864),
    (256, 64, 2, 128, 2, 196608), (256, 64, 3, 128, 2, 245760), (128, 64, 2, 128, 2, 131072),
    (128, 64, 3, 128, 2, 163840), (64, 64, 2, 128, 2, 98304), (128, 32, 2, 128, 2, 65536),
    (256, 64, 2, 128, 4, 196608), (256, 64, 3, 128, 4, 262144), (128, 64, 2, 128, 4, 131072),
    (128, 64, 3, 128, 4, 180224), (64, 64, 2, 128, 4, 98304), (128, 32, 2, 128, 4, 65536),
    (256, 64, 2, 256, 2, 327680), (256, 64, 3, 256, 2, 393216), (128, 64, 2, 256, 2, 229376),
    (128, 64, 3, 256, 2, 278528), (64, 64, 2, 256, 2, 180224), (128, 32, 2, 256, 2, 122880),
    (256, 64, 2, 256, 4, 327680), (256, 64, 3, 256, 4, 425984), (128, 64, 2, 256, 4, 229376),
    (128, 64, 3, 256, 4, 311296), (64, 64, 2, 256, 4, 180224), (128, 32, 2, 256, 4, 122880),
]


def test_bwd_dy_smem_model_bounds_what_triton_allocated():
    """The model never under-counts a measured config (an under-count is a launch that fails:
    r=128 did, at 245760 bytes), and over-counts by at most 1.8x (configs it would wrongly drop)."""
    for bm, bn, st, r_pad, felt, allocated in _BWD_DY_SMEM_H100:
        model = smem_bytes("bwd_dy", dict(BLOCK_M=bm, BLOCK_N=bn, num_stages=st), r_pad, 2, felt)
        assert allocated <= model <= 1.8 * allocated, (bm, bn, st, r_pad, felt, allocated, model)


def test_default_configs_fit_at_the_largest_rank():
    """At R_PAD=256 bwd_dy's default 256-row tile overflows the H100's shared memory even at two
    stages (Triton: 327680 bytes); the plan's last resort halves BLOCK_M until it fits."""
    limit = 232448
    assert fit("bwd_dy", DEFAULTS["bwd_dy"], 256, 2, limit) is None
    for phase in ("fwd_h", "bwd_dy", "bwd_da"):
        conf = fit_smaller(phase, DEFAULTS[phase], 256, 2, limit)
        assert conf is not None and smem_bytes(phase, conf, 256, 2) <= limit, phase
    assert fit_smaller("bwd_dy", DEFAULTS["bwd_dy"], 256, 2, limit)["BLOCK_M"] == 64  # Triton: 180224 bytes


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("R", [16, 48, 128, 256])
def test_gpu_fp32_factors_at_every_rank(R):
    """fwd_h and bwd_dy read fp32 factors beside bf16 x at the 1B shape (K=2048, M=4096): the same
    h, dh and db as with the factors cast first, db in fp32. r=48 is q/k/v's stacked A (it
    overflowed shared memory before the fit counted the factor's width)."""
    g = torch.Generator(device="cuda").manual_seed(R)
    x = torch.randn(4096, 2048, device="cuda", generator=g).bfloat16()
    dy = torch.randn(4096, 512, device="cuda", generator=g).bfloat16()
    a = torch.randn(R, 2048, device="cuda", generator=g) * 0.02
    b = torch.randn(512, R, device="cuda", generator=g) * 0.02
    h, h0 = ll.fwd_h(x, a, 0.0, None), ll.fwd_h(x, a.bfloat16(), 0.0, None)
    assert_close(h, h0, torch.bfloat16, f"h r={R}")
    (dh, db), (dh0, db0) = ll.bwd_dy(dy, b, h0, 0.5), ll.bwd_dy(dy, b.bfloat16(), h0, 0.5)
    assert db.dtype == torch.float32 and db0.dtype == torch.bfloat16
    assert_close(dh, dh0, torch.bfloat16, f"dh r={R}")
    assert_close(db, db0.float(), torch.bfloat16, f"db r={R}")


@pytest.mark.parametrize("impl", (["triton"] if CAN_TRITON else []) + ["addmm"])
def test_fp32_master_factors_beside_16bit_x(impl):
    """fp32 A and B with fp16 x: the kernels cast them in registers, cuBLAS after a cast; either
    way the result is the one with the factors cast first, and da / db come back in fp32."""
    device = "cuda" if HAS_CUDA else "cpu"
    dtype = torch.float16
    g = torch.Generator().manual_seed(3)
    x, w = (torch.randn(37, 40, generator=g) * 0.5).to(device, dtype), torch.randn(24, 40, generator=g).to(device, dtype)
    a, b = torch.randn(8, 40, generator=g).to(device), torch.randn(24, 8, generator=g).to(device)
    dy = torch.randn(37, 24, generator=g).to(device, dtype)
    y, h = ll.lora_linear_fwd(x, w, None, a, b, 0.5, 0.0, None, impl=impl)
    y0, h0 = ll.lora_linear_fwd(x, w, None, a.to(dtype), b.to(dtype), 0.5, 0.0, None, impl=impl)
    assert y.dtype == dtype and h.dtype == dtype
    assert_close(y, y0, dtype, "y")
    dx, da, db = ll.lora_linear_bwd(dy, x, w, a, b, h, 0.5, 0.0, None, True, impl=impl)
    dx0, da0, db0 = ll.lora_linear_bwd(dy, x, w, a.to(dtype), b.to(dtype), h0, 0.5, 0.0, None, True, impl=impl)
    assert dx.dtype == dtype and (impl == "addmm" or (da.dtype, db.dtype) == (torch.float32, torch.float32))
    for name, t, t0 in (("dx", dx, dx0), ("da", da, da0), ("db", db, db0)):
        assert_close(t.float(), t0.float(), dtype, name)
