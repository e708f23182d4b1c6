"""fastaf.kernels.lora_group: siblings over one input as one call, against each sibling's fp64
reference (``test_lora_linear.reference``), in Triton's interpreter on the CPU and on the GPU."""
from __future__ import annotations

import os

import pytest
import torch

from fastaf.kernels import lora_group as lg
from fastaf.kernels.lora_linear_plan import clear_memos
from tests._tolerances import assert_close
from tests.kernels.test_lora_linear import HAS_CUDA, make, reference

DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                                        reason="the CPU checks run in Triton's interpreter")),
           pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")])]


@pytest.fixture(autouse=True)
def fresh_plans():
    clear_memos()
    yield
    clear_memos()


def _siblings(device: str, factor_dtype: torch.dtype, bias: bool):
    """x (M, K) and three siblings of widths 48, 16, 16 with ranks 4, 4, 8 (q, k, v-like)."""
    M, K = (64, 32) if device == "cpu" else (512, 256)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    x, sib = None, []
    for i, (N, R) in enumerate(((48, 4), (16, 4), (16, 8)) if device == "cpu" else ((256, 16), (64, 16), (64, 8))):
        xi, w, b_, a, b, dy, _ = make(M, K, N, R, dtype, device, bias=bias, seed=i)
        x = xi if x is None else x
        sib.append((w, b_, a.to(factor_dtype), b.to(factor_dtype), dy, 0.5 + i))
    return x, sib


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("factor_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_group_equals_each_sibling_alone(device, factor_dtype, bias):
    x, sib = _siblings(device, factor_dtype, bias)
    w, bs, a, b, dys, scales = (list(t) for t in zip(*sib))
    ys, h = lg.group_fwd(x, w, bs, a, b, scales, graphed=True)
    dx, das, dbs = lg.group_bwd(dys, x, w, a, b, h, scales, True, graphed=True)
    tol = x.dtype
    want_dx = 0
    start = 0
    for i, (wi, bi, ai, b_i, dy, s) in enumerate(sib):
        y_ref, h_ref, dx_ref, da_ref, db_ref = reference(x, wi, bi, ai.float(), b_i.float(), s, 0.0, None, dy)
        r = ai.shape[0]
        assert_close(ys[i], y_ref, tol, f"y{i}")
        assert_close(h[:, start:start + r], h_ref, tol, f"h{i}")
        assert das[i].dtype == factor_dtype and dbs[i].dtype == factor_dtype
        assert_close(das[i], da_ref, factor_dtype if factor_dtype != torch.float32 else tol, f"dA{i}")
        assert_close(dbs[i], db_ref, factor_dtype if factor_dtype != torch.float32 else tol, f"dB{i}")
        want_dx = want_dx + dx_ref
        start += r
    assert_close(dx, want_dx, tol, "dx: every sibling's summed")


@pytest.mark.parametrize("device", DEVICES)
def test_an_output_without_gradient_and_no_dx(device):
    """A sibling whose output got no gradient: no dA, no dB, the others' exact; needs_dx False."""
    x, sib = _siblings(device, torch.float32, True)
    w, bs, a, b, dys, scales = (list(t) for t in zip(*sib))
    _, h = lg.group_fwd(x, w, bs, a, b, scales)
    dys[1] = None
    dx, das, dbs = lg.group_bwd(dys, x, w, a, b, h, scales, False)
    assert dx is None and das[1] is None and dbs[1] is None
    for i in (0, 2):
        wi, bi, ai, b_i, dy, s = sib[i]
        _, _, _, da_ref, db_ref = reference(x, wi, bi, ai, b_i, s, 0.0, None, dy)
        assert_close(das[i], da_ref, x.dtype, f"dA{i}")
        assert_close(dbs[i], db_ref, x.dtype, f"dB{i}")


@pytest.mark.parametrize("device", DEVICES)
def test_fits_follows_the_dispatch(device):
    x, sib = _siblings(device, torch.float32, False)
    weights = [s[0] for s in sib]
    assert lg.fits(x, weights, [4, 4, 8], "triton")
    assert not lg.fits(x, weights, [4, 4, 8], "addmm")  # the dispatch's other path: no group


def test_fits_asks_the_dispatch_at_each_siblings_own_rank(monkeypatch):
    """q/k/v at r=16 are asked at r=16, not at their sum 48 (whose nearest dispatch entries are
    r=64's); a group whose summed rank the kernels cannot pad is refused without asking."""
    x, sib = _siblings("cpu", torch.float32, False)
    weights = [s[0] for s in sib]
    asked = []

    def choose(impl, phase, x_, M, K, N, R):
        asked.append((phase, M, K, N, R))
        return "triton" if R <= 16 else "addmm"  # a dispatch table whose r=64 entries take cuBLAS

    monkeypatch.setattr(lg, "choose_impl", choose)
    assert lg.fits(x, weights, [16, 16, 16], "auto")
    M, K = x.shape
    assert sorted(asked) == sorted((p, M, K, w.shape[0], 16) for w in weights for p in ("fwd", "bwd"))
    assert not lg.fits(x, weights, [16, 16, 64], "auto")  # one sibling alone takes cuBLAS
    asked.clear()
    assert not lg.fits(x, weights, [128, 64, 128], "auto") and not asked  # sum 320 > MAX_RANK
