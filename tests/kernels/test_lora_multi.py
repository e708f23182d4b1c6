"""fastaf.kernels.lora_multi (grouped LoRA over segments) against an fp64 per-row reference.

CPU (TRITON_INTERPRET=1): fp32 at odd shapes; segments of length 1 and longer than a block;
-1 (base-only) segments; slots shared by several segments (their gradients add up); bias.
GPU (marker `gpu`): bf16 at real sizes, decode-shaped and training-shaped.
"""
from __future__ import annotations

import os

import pytest
import torch

from fastaf.kernels import lora_multi
from tests._tolerances import assert_close

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
cpu_kernels = pytest.mark.skipif(not INTERPRET, reason="CPU kernels need TRITON_INTERPRET=1")


def per_row_reference(x, weight, bias, a, b, ids, scale, dy):
    """fp64, one row at a time through its segment's slot: (y, h, dx, dA, dB)."""
    x, weight, a, b, dy = (t.double() for t in (x, weight, a, b, dy))
    S = x.shape[0] // ids.shape[0]
    slot = ids.repeat_interleave(S)
    y = x @ weight.T + (0 if bias is None else bias.double())
    h = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float64)
    dx = dy @ weight
    da, db = torch.zeros_like(a), torch.zeros_like(b)
    for t, g in enumerate(slot.tolist()):
        if g < 0:
            continue
        h[t] = a[g] @ x[t]
        y[t] += scale * b[g] @ h[t]
        dh = scale * dy[t] @ b[g]  # (R,)
        dx[t] += dh @ a[g]
        da[g] += dh[:, None] * x[t][None, :]
        db[g] += scale * dy[t][:, None] * h[t][None, :]
    return y, h, dx, da, db


def make(n_seg, S, K, N, R, n, *, device="cpu", dtype=torch.float32, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(device, dtype)
    ids = torch.randint(-1, n, (n_seg,), generator=g)
    ids[0] = 0  # at least one adapted segment
    return (rnd(n_seg * S, K), rnd(N, K) / K**0.5, rnd(N) if bias else None, rnd(n, R, K) / K**0.5,
            rnd(n, N, R), ids.to(device), rnd(n_seg * S, N))


@cpu_kernels
@pytest.mark.parametrize("n_seg,S,K,N,R,n", [
    (3, 5, 40, 24, 3, 4),  # odd sizes, rank under the 16-wide pad
    (6, 1, 33, 17, 5, 2),  # decode: one row per segment, slots shared
    (2, 37, 70, 50, 16, 3),  # segments longer than a block
    (5, 3, 16, 16, 20, 1),  # rank over 16: R_PAD 32; every segment on the one slot
])
def test_forward_and_backward_match_the_per_row_reference(n_seg, S, K, N, R, n):
    x, w, bias, a, b, ids, dy = make(n_seg, S, K, N, R, n)
    y, h = lora_multi.multi_fwd(x, w, bias, a, b, ids, 0.7)
    dx, da, db = lora_multi.multi_bwd(dy, x, w, a, b, h, ids, 0.7, True)
    ry, rh, rdx, rda, rdb = per_row_reference(x, w, bias, a, b, ids, 0.7, dy)
    for name, out, ref in [("y", y, ry), ("h", h, rh), ("dx", dx, rdx), ("dA", da, rda), ("dB", db, rdb)]:
        assert_close(out, ref, torch.float32, name)
    unused = [g for g in range(n) if g not in ids.tolist()]
    assert all(da[g].abs().max() == 0 and db[g].abs().max() == 0 for g in unused)


@cpu_kernels
@pytest.mark.parametrize("n_seg,S", [(3, 5), (6, 1), (2, 37)])
def test_fused_gemm_equals_cublas_plus_expand(n_seg, S):
    """The persistent TMA GEMM with the per-segment epilogue (tiles straddle segments here)."""
    x, w, bias, a, b, ids, dy = make(n_seg, S, 48, 32, 5, 3, seed=1)
    assert lora_multi.fused_ok(x, w.T) and lora_multi.fused_ok(dy, w)
    y, h = lora_multi.multi_fwd(x, w, bias, a, b, ids, 0.7, fused=True)
    dx, _, _ = lora_multi.multi_bwd(dy, x, w, a, b, h, ids, 0.7, True, fused=True)
    ry, _, rdx, _, _ = per_row_reference(x, w, bias, a, b, ids, 0.7, dy)
    assert_close(y, ry, torch.float32, "y")
    assert_close(dx, rdx, torch.float32, "dx")


@cpu_kernels
def test_fp16_with_fp32_factors_matches_the_reference():
    """Half activations with fp32 master factors (read as they are, no cast) and fp32 dA/dB."""
    x, w, bias, a, b, ids, dy = make(4, 9, 48, 32, 6, 3, seed=2)
    x16, w16, bias16, dy16 = (t.half() for t in (x, w, bias, dy))
    y, h = lora_multi.multi_fwd(x16, w16, bias16, a, b, ids, 0.7, fused=False)
    dx, da, db = lora_multi.multi_bwd(dy16, x16, w16, a, b, h, ids, 0.7, True, fused=False)
    assert (y.dtype, dx.dtype, da.dtype, db.dtype) == (torch.float16, torch.float16, torch.float32, torch.float32)
    ry, _, rdx, rda, rdb = per_row_reference(x16, w16, bias16, a, b, ids, 0.7, dy16)
    for name, out, ref in [("y", y, ry), ("dx", dx, rdx), ("dA", da, rda), ("dB", db, rdb)]:
        assert_close(out, ref, torch.float16, name)


@cpu_kernels
def test_base_only_segments_are_the_base_layer_exactly():
    x, w, bias, a, b, ids, dy = make(4, 3, 24, 16, 4, 2)
    ids = torch.tensor([-1, 1, -1, 0])
    y, h = lora_multi.multi_fwd(x, w, bias, a, b, ids, 2.0, fused=False)
    base = torch.nn.functional.linear(x, w, bias)
    rows = ids.repeat_interleave(3) < 0
    assert torch.equal(y[rows], base[rows]) and h[rows].abs().max() == 0
    dx, _, _ = lora_multi.multi_bwd(dy, x, w, a, b, h, ids, 2.0, needs_dx=False)
    assert dx is None


@pytest.mark.parametrize("r_pad,factor_elt,want", [(16, 2, (3, 128)), (256, 2, (2, 128)), (256, 4, (2, 64))])
def test_segment_tiles_fit_the_h100s_shared_memory(r_pad, factor_elt, want):
    """The h kernel's pipelined tiles per K column: 64 rows of bf16 x and R_PAD of the factor. At
    r=16 the shipped 3 stages x 128 stay; at R_PAD=256 Triton sized those at 245760 (bf16 A) and
    376832 bytes (fp32 A) on the H100, over its 232448."""
    per_col = 64 * 2 + r_pad * factor_elt
    stages, block = lora_multi.fit_tiles(lambda b: per_col * b, 3, 128, 232448)
    assert (stages, block) == want and stages * per_col * block <= 232448


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("n_seg,S", [(64, 64), (64, 1), (8, 1024), (5, 77)])
def test_bf16_real_sizes_match_fp32_reference(n_seg, S, fused):
    K = N = 1024
    x, w, bias, a, b, ids, dy = make(n_seg, S, K, N, 16, n_seg, device="cuda", dtype=torch.bfloat16, bias=False)
    y, h = lora_multi.multi_fwd(x, w, None, a, b, ids, 2.0, fused=fused)
    dx, da, db = lora_multi.multi_bwd(dy, x, w, a, b, h, ids, 2.0, True, fused=fused)
    f = lambda t: t.float().cpu()
    ry, rh, rdx, rda, rdb = per_row_reference(f(x), f(w), None, f(a), f(b), ids.cpu(), 2.0, f(dy))
    for name, out, ref in [("y", y, ry), ("dx", dx, rdx), ("dA", da, rda), ("dB", db, rdb)]:
        assert_close(f(out), ref, torch.bfloat16, name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_shared_x_bf16_matches_fp32_reference():
    """vmap over a stack with x unbatched: every adapter over one x (lora_multi.shared_fwd/bwd)."""
    G, M, K, N, R = 8, 256, 1024, 1024, 16
    x, w, _, a, b, _, _ = make(1, M, K, N, R, G, device="cuda", dtype=torch.bfloat16, bias=False)
    dy = torch.randn(G * M, N, device="cuda", dtype=torch.bfloat16)
    y, h = lora_multi.shared_fwd(x, w, None, a, b, 2.0)
    dx, da, db = lora_multi.shared_bwd(dy, x, w, a, b, h, 2.0, True)
    f = lambda t: t.float().cpu()
    ids = torch.arange(G)
    ry, _, rdx, rda, rdb = per_row_reference(f(x).repeat(G, 1), f(w), None, f(a), f(b), ids, 2.0, f(dy))
    for name, out, ref in [("y", y, ry), ("dx", dx, rdx), ("dA", da, rda), ("dB", db, rdb)]:
        assert_close(f(out), ref, torch.bfloat16, name)
