"""Would a gated MLP fused with its LoRA terms pay? (a diagnostic prototype, not a fastaf path)

    python bench/diag_gated_mlp.py [--name diag-gated-mlp] [M H I r]      # GPU
    TRITON_INTERPRET=1 python bench/diag_gated_mlp.py --check             # CPU, small shapes

One Llama MLP layer, ``down(silu(gate(x)) * up(x))``, with a LoRA on all three projections,
forward and backward (the frozen weights get no gradient), timed from CUDA-graph replays:

- ``base``: the frozen layer, cuBLAS GEMMs and Liger's SwiGLU kernels (torch's where Liger is
  missing);
- ``fastaf``: today's ops: h for gate/up in one pass over x, the fused LoRA GEMMs, the same SwiGLU
  kernels, h for down in a pass over the activation; backward bwd_dy (dh, dB) per projection,
  bwd_da per input;
- ``fused``: gate and up on cuBLAS, then one kernel adds their LoRA terms, applies SwiGLU and makes
  down's h from the activation it writes (``_gated_fwd_kernel``); backward down's dx on cuBLAS,
  then one kernel adds down's LoRA term to it, applies SwiGLU's backward and makes gate's and
  up's dh and dB and down's dA (``_gated_bwd_kernel``). The passes over the (M, I) activations
  that ``fastaf`` adds to the base (h and dA of down, dh and dB of gate and up) fold into the
  passes the base makes anyway.

Both LoRA paths share the rest (down's GEMM and bwd_dy, the gate+up dx GEMMs, bwd_da over x).
Each is checked against an fp32 torch reference first. ``ADD_LORA`` off (``_fused_step``'s lean
variant, kept for ``--check``): gate, up and down's dx stay on fastaf's fused GEMMs and the
kernels skip the LoRA products; measured slower (s38b). Results and the decision: README,
"The SwiGLU neighbour, tried as a prototype".
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@triton.jit
def _row_h(h_ptr, offs_m, mask_m, stride_hm, RG, RU, RG_PAD: tl.constexpr, RU_PAD: tl.constexpr):
    """(h_g (BLOCK_M, RG_PAD), h_u (BLOCK_M, RU_PAD)) of a row block, from h = [h_g | h_u]."""
    rg, ru = tl.arange(0, RG_PAD), tl.arange(0, RU_PAD)
    rows = h_ptr + offs_m[:, None] * stride_hm
    hg = tl.load(rows + rg[None, :], mask=mask_m[:, None] & (rg[None, :] < RG), other=0.0)
    hu = tl.load(rows + RG + ru[None, :], mask=mask_m[:, None] & (ru[None, :] < RU), other=0.0)
    return hg, hu


@triton.jit
def _chunk(I, BLOCK_I: tl.constexpr, SPLIT_I: tl.constexpr):
    """(first column, end) of this program's share, the program_id(1)-th of SPLIT_I chunks of
    whole BLOCK_I blocks."""
    chunk = tl.cdiv(tl.cdiv(I, BLOCK_I), SPLIT_I) * BLOCK_I
    return tl.program_id(1) * chunk, tl.minimum((tl.program_id(1) + 1) * chunk, I)


@triton.jit
def _gate_up(g_ptr, u_ptr, bg_ptr, bu_ptr, hg, hu, rows, mask, offs_i, mask_i, RG, RU, s_g, s_u,
             RG_PAD: tl.constexpr, RU_PAD: tl.constexpr, ADD_LORA: tl.constexpr):
    """fp32 (g, u) = (g0 + s_g h_g B_g^T, u0 + s_u h_u B_u^T) over one tile, and the (R_PAD,
    BLOCK_I) tiles of B_g^T and B_u^T in h's dtype; ADD_LORA off: the GEMMs added the terms."""
    rg, ru = tl.arange(0, RG_PAD), tl.arange(0, RU_PAD)
    g = tl.load(g_ptr + rows, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rows, mask=mask, other=0.0).to(tl.float32)
    bg = tl.load(bg_ptr + offs_i[None, :] * RG + rg[:, None], mask=mask_i[None, :] & (rg[:, None] < RG),
                 other=0.0).to(hg.dtype)
    bu = tl.load(bu_ptr + offs_i[None, :] * RU + ru[:, None], mask=mask_i[None, :] & (ru[:, None] < RU),
                 other=0.0).to(hg.dtype)
    if ADD_LORA:
        g += s_g * tl.dot(hg, bg)
        u += s_u * tl.dot(hu, bu)
    return g, u, bg, bu


@triton.jit
def _gated_fwd_kernel(
    g_ptr, u_ptr, h_ptr, bg_ptr, bu_ptr, ad_ptr, act_ptr, hd_ptr,
    M, I, RG, RU, RD, stride_hm, s_g, s_u,
    RG_PAD: tl.constexpr, RU_PAD: tl.constexpr, RD_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, SPLIT_I: tl.constexpr,
    ADD_LORA: tl.constexpr,
):
    """act = silu(g0 + s_g h_g B_g^T) * (u0 + s_u h_u B_u^T) and h_d = act @ A_d^T, one row block.

    g0, u0, act (M, I); h = [h_g | h_u] (M, RG + RU), row stride ``stride_hm``; h_d (M, RD);
    B_g (I, RG), B_u (I, RU), A_d (RD, I); all else contiguous. Program (m-block, s) covers the
    s-th of SPLIT_I column chunks; h_d is fp32, atomically summed over them when SPLIT_I > 1."""
    pid = tl.program_id(0)
    offs_m = (pid * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    mask_m = offs_m < M
    rd = tl.arange(0, RD_PAD)
    hg, hu = _row_h(h_ptr, offs_m, mask_m, stride_hm, RG, RU, RG_PAD, RU_PAD)
    acc = tl.zeros((BLOCK_M, RD_PAD), dtype=tl.float32)
    i_start, i_end = _chunk(I, BLOCK_I, SPLIT_I)
    for i0 in range(i_start, i_end, BLOCK_I):
        offs_i = i0 + tl.arange(0, BLOCK_I)
        mask_i = offs_i < i_end
        mask = mask_m[:, None] & mask_i[None, :]
        rows = offs_m[:, None] * I + offs_i[None, :]
        g, u, _, _ = _gate_up(g_ptr, u_ptr, bg_ptr, bu_ptr, hg, hu, rows, mask, offs_i, mask_i, RG, RU, s_g, s_u,
                              RG_PAD, RU_PAD, ADD_LORA)
        act = (g * tl.sigmoid(g) * u).to(hg.dtype)
        tl.store(act_ptr + rows, act, mask=mask)
        ad = tl.load(ad_ptr + rd[None, :] * I + offs_i[:, None], mask=mask_i[:, None] & (rd[None, :] < RD),
                     other=0.0).to(hg.dtype)  # (BLOCK_I, RD_PAD)
        acc = tl.dot(act, ad, acc)
    hd_ptrs = hd_ptr + offs_m[:, None] * RD + rd[None, :]
    if SPLIT_I == 1:
        tl.store(hd_ptrs, acc, mask=mask_m[:, None] & (rd[None, :] < RD))
    else:
        tl.atomic_add(hd_ptrs, acc, mask=mask_m[:, None] & (rd[None, :] < RD), sem="relaxed")


@triton.jit
def _gated_bwd_kernel(
    d_ptr, g_ptr, u_ptr, h_ptr, bg_ptr, bu_ptr, dhd_ptr, ad_ptr,
    dg_ptr, du_ptr, dh_ptr, dbg_ptr, dbu_ptr, dad_ptr,
    M, I, RG, RU, RD, stride_hm, s_g, s_u,
    RG_PAD: tl.constexpr, RU_PAD: tl.constexpr, RD_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, SPLIT_I: tl.constexpr,
    ADD_LORA: tl.constexpr, SKIP_SUMS: tl.constexpr = False,
):
    """The gated MLP's backward over one row block, from d0 = dy_d @ W_d (down's base dx):

    d_act = d0 + dh_d @ A_d; g, u, act recomputed from g0, u0 and the LoRA terms; dg, du stored;
    dh = [s_g dg @ B_g | s_u du @ B_u] stored, (M, RG + RU) fp32 contiguous; dB_g += s_g dg^T h_g, dB_u += s_u du^T h_u,
    dA_d += dh_d^T act added atomically (fp32). dh_d (M, RD) fp32 carries down's scale already.
    Program (m-block, s) covers the s-th of SPLIT_I column chunks; dh is summed atomically over
    them when SPLIT_I > 1. SKIP_SUMS (timing only, wrong dB and dA): no atomic adds of dB and dA."""
    pid = tl.program_id(0)
    offs_m = (pid * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    mask_m = offs_m < M
    rg, ru, rd = tl.arange(0, RG_PAD), tl.arange(0, RU_PAD), tl.arange(0, RD_PAD)
    hg, hu = _row_h(h_ptr, offs_m, mask_m, stride_hm, RG, RU, RG_PAD, RU_PAD)
    dhd = tl.load(dhd_ptr + offs_m[:, None] * RD + rd[None, :], mask=mask_m[:, None] & (rd[None, :] < RD),
                  other=0.0).to(hg.dtype)  # (BLOCK_M, RD_PAD)
    acc_g = tl.zeros((BLOCK_M, RG_PAD), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, RU_PAD), dtype=tl.float32)
    i_start, i_end = _chunk(I, BLOCK_I, SPLIT_I)
    for i0 in range(i_start, i_end, BLOCK_I):
        offs_i = i0 + tl.arange(0, BLOCK_I)
        mask_i = offs_i < i_end
        mask = mask_m[:, None] & mask_i[None, :]
        rows = offs_m[:, None] * I + offs_i[None, :]
        g, u, bg, bu = _gate_up(g_ptr, u_ptr, bg_ptr, bu_ptr, hg, hu, rows, mask, offs_i, mask_i, RG, RU, s_g, s_u,
                                RG_PAD, RU_PAD, ADD_LORA)
        dact = tl.load(d_ptr + rows, mask=mask, other=0.0).to(tl.float32)
        if ADD_LORA:  # else down's dx GEMM added dh_d @ A_d
            ad = tl.load(ad_ptr + rd[:, None] * I + offs_i[None, :], mask=mask_i[None, :] & (rd[:, None] < RD),
                         other=0.0).to(hg.dtype)  # (RD_PAD, BLOCK_I)
            dact += tl.dot(dhd, ad)
        sig = tl.sigmoid(g)
        silu = g * sig
        act = (silu * u).to(hg.dtype)
        du = (dact * silu).to(hg.dtype)
        dg = (dact * u * sig * (1.0 + g * (1.0 - sig))).to(hg.dtype)
        tl.store(dg_ptr + rows, dg, mask=mask)
        tl.store(du_ptr + rows, du, mask=mask)
        acc_g = tl.dot(dg, tl.trans(bg), acc_g)
        acc_u = tl.dot(du, tl.trans(bu), acc_u)
        if not SKIP_SUMS:
            dbg = tl.dot(tl.trans(dg), hg)  # (BLOCK_I, RG_PAD)
            tl.atomic_add(dbg_ptr + offs_i[:, None] * RG + rg[None, :], dbg * s_g,
                          mask=mask_i[:, None] & (rg[None, :] < RG), sem="relaxed")
            dbu = tl.dot(tl.trans(du), hu)
            tl.atomic_add(dbu_ptr + offs_i[:, None] * RU + ru[None, :], dbu * s_u,
                          mask=mask_i[:, None] & (ru[None, :] < RU), sem="relaxed")
            dad = tl.dot(tl.trans(dhd), act)  # (RD_PAD, BLOCK_I)
            tl.atomic_add(dad_ptr + rd[:, None] * I + offs_i[None, :], dad,
                          mask=(rd[:, None] < RD) & mask_i[None, :], sem="relaxed")
    dh_ptrs = dh_ptr + offs_m[:, None] * (RG + RU)
    if SPLIT_I == 1:
        tl.store(dh_ptrs + rg[None, :], acc_g * s_g, mask=mask_m[:, None] & (rg[None, :] < RG))
        tl.store(dh_ptrs + RG + ru[None, :], acc_u * s_u, mask=mask_m[:, None] & (ru[None, :] < RU))
    else:
        tl.atomic_add(dh_ptrs + rg[None, :], acc_g * s_g, mask=mask_m[:, None] & (rg[None, :] < RG), sem="relaxed")
        tl.atomic_add(dh_ptrs + RG + ru[None, :], acc_u * s_u, mask=mask_m[:, None] & (ru[None, :] < RU),
                      sem="relaxed")


def _pad(r: int) -> int:
    return max(16, triton.next_power_of_2(r))


def gated_fwd(g0, u0, h, b_g, b_u, s_g, s_u, a_d, conf):
    """(act (M, I), h_d (M, RD)) in g0's dtype. h = [h_g | h_u] (M, RG + RU), unit column stride."""
    M, I = g0.shape
    RG, RU, RD = b_g.shape[1], b_u.shape[1], a_d.shape[0]
    act = torch.empty_like(g0)
    h_d = (torch.empty if conf["SPLIT_I"] == 1 else torch.zeros)((M, RD), device=g0.device, dtype=torch.float32)
    _gated_fwd_kernel[(triton.cdiv(M, conf["BLOCK_M"]), conf["SPLIT_I"])](
        g0, u0, h, b_g, b_u, a_d, act, h_d, M, I, RG, RU, RD, h.stride(0),
        float(s_g), float(s_u), RG_PAD=_pad(RG), RU_PAD=_pad(RU), RD_PAD=_pad(RD),
        BLOCK_M=conf["BLOCK_M"], BLOCK_I=conf["BLOCK_I"], SPLIT_I=conf["SPLIT_I"], ADD_LORA=conf.get("ADD_LORA", True), num_warps=conf["num_warps"], num_stages=conf["num_stages"])
    return act, h_d.to(g0.dtype)  # summed in fp32; bwd_dy takes h in dy's dtype


def gated_bwd(d0, g0, u0, h, b_g, b_u, s_g, s_u, dh_d, a_d, conf):
    """(dg, du, dh = [dh_g | dh_u], db_g, db_u, da_d): dg, du in d0's dtype, the rest fp32."""
    M, I = g0.shape
    RG, RU, RD = b_g.shape[1], b_u.shape[1], a_d.shape[0]
    f32 = dict(device=g0.device, dtype=torch.float32)
    dg, du = torch.empty_like(g0), torch.empty_like(u0)
    dh = (torch.empty if conf["SPLIT_I"] == 1 else torch.zeros)((M, RG + RU), **f32)
    sums = torch.zeros(I * (RG + RU) + RD * I, **f32)  # one memset for the three atomic sums
    db_g, db_u = sums[:I * RG].view(I, RG), sums[I * RG:I * (RG + RU)].view(I, RU)
    da_d = sums[I * (RG + RU):].view(RD, I)
    _gated_bwd_kernel[(triton.cdiv(M, conf["BLOCK_M"]), conf["SPLIT_I"])](
        d0, g0, u0, h, b_g, b_u, dh_d, a_d, dg, du, dh, db_g, db_u, da_d,
        M, I, RG, RU, RD, h.stride(0), float(s_g), float(s_u),
        RG_PAD=_pad(RG), RU_PAD=_pad(RU), RD_PAD=_pad(RD),
        BLOCK_M=conf["BLOCK_M"], BLOCK_I=conf["BLOCK_I"], SPLIT_I=conf["SPLIT_I"], ADD_LORA=conf.get("ADD_LORA", True),
        SKIP_SUMS=conf.get("SKIP_SUMS", False), num_warps=conf["num_warps"], num_stages=conf["num_stages"])
    return dg, du, dh, db_g, db_u, da_d


def _reference(x, w, loras, dy):
    """fp32 torch: y and the grads of x and every factor. ``w``: (Wg, Wu, Wd); ``loras``:
    ((A, B, s) for gate, up, down)."""
    x = x.float().requires_grad_()
    leaves = [t.float().requires_grad_() for a, b, _ in loras for t in (a, b)]
    ag, bg, au, bu, ad, bd = leaves
    (_, _, sg), (_, _, su), (_, _, sd) = loras
    g = x @ w[0].float().T + sg * (x @ ag.T) @ bg.T
    u = x @ w[1].float().T + su * (x @ au.T) @ bu.T
    act = torch.nn.functional.silu(g) * u
    y = act @ w[2].float().T + sd * (act @ ad.T) @ bd.T
    grads = torch.autograd.grad(y, [x, *leaves], dy.float())
    return y.detach(), grads


def _fused_step(x, w, loras, dy, confs, down_gemm, down_bwd_dy, dx_gemm, da_x, h_gu, ll=None):
    """The fused path's forward and backward: (y, dx, dA_g, dB_g, dA_u, dB_u, dA_d, dB_d).

    ``confs[phase]["ADD_LORA"]`` False (both phases alike): gate, up and down's dx stay on fastaf's
    fused GEMMs (``ll``), which add the LoRA terms, and the kernels make only what they must."""
    (ag, bg, sg), (au, bu, su), (ad, bd, sd) = loras
    rg = ag.shape[0]
    lean = not confs["fwd"].get("ADD_LORA", True)
    h = h_gu(x)
    if lean:
        g0 = ll.gemm(x, w[0].T, h[:, :rg], bg.T, None, sg, 0.0, None, x.dtype)
        u0 = ll.gemm(x, w[1].T, h[:, rg:], bu.T, None, su, 0.0, None, x.dtype)
    else:
        g0, u0 = x @ w[0].T, x @ w[1].T  # cuBLAS, as the frozen layer
    act, h_d = gated_fwd(g0, u0, h, bg, bu, sg, su, ad, confs["fwd"])
    y = down_gemm(act, h_d)
    dh_d, db_d = down_bwd_dy(dy, h_d)
    d0 = ll.gemm(dy, w[2], dh_d, ad, None, 1.0, 0.0, None, dy.dtype) if lean else dy @ w[2]  # down's dx
    dg, du, dh, db_g, db_u, da_d = gated_bwd(d0, g0, u0, h, bg, bu, sg, su, dh_d, ad, confs["bwd"])
    dx = dx_gemm(dg, du, dh[:, :rg], dh[:, rg:])
    da = da_x(dh, x)
    return y, dx, da[:rg], db_g, da[rg:], db_u, da_d, db_d


def _fastaf_step(x, w, loras, dy, silu_mul, down_gemm, down_bwd_dy, dx_gemm, da_x, h_gu, ll):
    """Today's ops, as fastaf runs the layer (siblings share h and dA over x)."""
    (ag, bg, sg), (au, bu, su), (ad, bd, sd) = loras
    rg = ag.shape[0]
    h = h_gu(x)
    g = ll.gemm(x, w[0].T, h[:, :rg], bg.T, None, sg, 0.0, None, x.dtype)
    u = ll.gemm(x, w[1].T, h[:, rg:], bu.T, None, su, 0.0, None, x.dtype)
    act = silu_mul[0](g, u)
    h_d = ll.fwd_h(act, ad, 0.0, None)
    y = down_gemm(act, h_d)
    dh_d, db_d = down_bwd_dy(dy, h_d)
    dact = ll.gemm(dy, w[2], dh_d, ad, None, 1.0, 0.0, None, x.dtype)
    da_d = ll.bwd_da(dh_d, act, 0.0, None)
    dg, du = silu_mul[1](g, u, dact)
    dh_g, db_g = ll.bwd_dy(dg, bg, h[:, :rg], sg)
    dh_u, db_u = ll.bwd_dy(du, bu, h[:, rg:], su)
    dx = dx_gemm(dg, du, dh_g, dh_u)
    da = da_x(torch.cat([dh_g, dh_u], 1), x)
    return y, dx, da[:rg], db_g, da[rg:], db_u, da_d, db_d


def _base_step(x, w, dy, silu_mul):
    g, u = x @ w[0].T, x @ w[1].T
    act = silu_mul[0](g, u)
    y = act @ w[2].T
    dg, du = silu_mul[1](g, u, dy @ w[2])
    return y, torch.addmm(dg @ w[0], du, w[1])


def _silu_mul():
    """(forward(g, u) -> act, backward(g, u, dact) -> (dg, du)): Liger's kernels where installed
    (its backward writes dg, du over g, u), torch's ops otherwise."""
    try:
        from liger_kernel.ops.swiglu import swiglu_backward, swiglu_forward
        return (lambda g, u: swiglu_forward(g, u)[2], lambda g, u, d: swiglu_backward(g, u, d)), "liger"
    except Exception:  # noqa: BLE001 - any import failure means: no Liger here
        def bwd(g, u, d):
            s = torch.sigmoid(g.float())
            return ((d * u).float() * s * (1 + g.float() * (1 - s))).to(g.dtype), (d.float() * g.float() * s).to(g.dtype)
        return (lambda g, u: torch.nn.functional.silu(g) * u, bwd), "torch"


def _setup(M, H, I, r, dev, dt):
    torch.manual_seed(0)
    x = torch.randn(M, H, device=dev, dtype=dt)
    w = (torch.randn(I, H, device=dev, dtype=dt) / H**0.5, torch.randn(I, H, device=dev, dtype=dt) / H**0.5,
         torch.randn(H, I, device=dev, dtype=dt) / I**0.5)
    loras = []
    for n_in, n_out in ((H, I), (H, I), (I, H)):
        loras.append((torch.randn(r, n_in, device=dev, dtype=dt) / n_in**0.5,
                      torch.randn(n_out, r, device=dev, dtype=dt) * 0.5, 2.0))
    dy = torch.randn(M, H, device=dev, dtype=dt) / H**0.5
    return x, w, tuple(loras), dy


def _shared(w, loras, ll):
    """The pieces both LoRA paths share, as closures."""
    (ag, bg, sg), (au, bu, su), (ad, bd, sd) = loras
    a_gu = torch.cat([ag, au])
    return dict(
        h_gu=lambda x: ll.fwd_h(x, a_gu, 0.0, None),
        down_gemm=lambda act, h_d: ll.gemm(act, w[2].T, h_d, bd.T, None, sd, 0.0, None, act.dtype),
        down_bwd_dy=lambda dy, h_d: ll.bwd_dy(dy, bd, h_d, sd),
        dx_gemm=lambda dg, du, dh_g, dh_u: (ll.gemm(dg, w[0], dh_g, ag, None, 1.0, 0.0, None, dg.dtype)
                                            + ll.gemm(du, w[1], dh_u, au, None, 1.0, 0.0, None, du.dtype)),
        da_x=lambda dh, x: ll.bwd_da(dh, x, 0.0, None),
    )


def _errors(got, ref) -> list:
    """max |got - ref| / max |ref| per output."""
    return [float((g.float() - r.float()).abs().max() / r.float().abs().max().clamp_min(1e-12)) for g, r in zip(got, ref)]


def check() -> None:
    """Small shapes (CPU under TRITON_INTERPRET=1, or CUDA): the fused kernels against fp32 torch."""
    from fastaf.kernels import lora_linear as ll
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    M, H, I, r = 48, 32, 96, 8
    x, w, loras, dy = _setup(M, H, I, r, dev, dt)
    y_ref, g_ref = _reference(x, w, loras, dy)
    ref = [y_ref, g_ref[0], *g_ref[1:]]
    names = ["y", "dx", "dA_g", "dB_g", "dA_u", "dB_u", "dA_d", "dB_d"]
    for split, add in ((1, True), (2, True), (2, False)):
        conf = dict(BLOCK_M=16, BLOCK_I=32, num_warps=4, num_stages=1, SPLIT_I=split, ADD_LORA=add)
        errs = _errors(_fused_step(x, w, loras, dy, {"fwd": conf, "bwd": conf}, ll=ll, **_shared(w, loras, ll)), ref)
        print(f"SPLIT_I={split} ADD_LORA={add}:", " ".join(f"{n}={e:.1e}" for n, e in zip(names, errs)))
        tol = 2e-2 if dt == torch.bfloat16 else 1e-4
        bad = [n for n, e in zip(names, errs) if e > tol]
        assert not bad, f"fused path off the reference at SPLIT_I={split}: {bad}"
    print("check ok")


# H100, Llama-3.2-1B's MLP at 8 x 1024 tokens, r=16 (Liger's SwiGLU: fwd 134 us, bwd 225 us):
# - s38's first run, SPLIT_I = 1: best fwd and bwd 64x64, 4 warps, 3 stages: 199 and 414 us;
#   128-row and 256-column blocks 1.3-3.8x slower;
# - s38b: SPLIT_I 4-8 at 64x64x4x3 best, fwd 159 us, bwd 320 us (1.5x the layer's saved passes);
#   32-row blocks, 8 warps, 2 stages slower; the lean kernels (ADD_LORA off) no faster (bwd 789 us).
_CONFS = {
    "fwd": [dict(BLOCK_M=m, BLOCK_I=i, num_warps=nw, num_stages=st, SPLIT_I=sp)
            for m, i, nw, st, sp in ((64, 64, 4, 3, 8), (64, 64, 4, 3, 4), (128, 64, 8, 3, 8), (64, 64, 8, 3, 8),
                                     (128, 32, 4, 3, 8), (64, 64, 4, 4, 16))],
    "bwd": [dict(BLOCK_M=m, BLOCK_I=i, num_warps=nw, num_stages=st, SPLIT_I=sp)
            for m, i, nw, st, sp in ((64, 64, 4, 3, 4), (64, 64, 4, 3, 8), (128, 32, 4, 3, 8), (128, 64, 8, 3, 4),
                                     (128, 32, 8, 3, 8), (64, 64, 4, 4, 4))],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--name", default="diag-gated-mlp")
    ap.add_argument("shape", nargs="*", type=int, help="M H I r (default 8192 2048 8192 16)")
    args = ap.parse_args()
    if args.check:
        return check()
    from fastaf.kernels import lora_linear as ll
    from triton.testing import do_bench_cudagraph
    M, H, I, r = args.shape or (8192, 2048, 8192, 16)
    x, w, loras, dy = _setup(M, H, I, r, "cuda", torch.bfloat16)
    (ag, bg, sg), (au, bu, su), (ad, bd, sd) = loras
    shared = _shared(w, loras, ll)
    silu_mul, neighbour = _silu_mul()
    bench = lambda fn: do_bench_cudagraph(fn, rep=100, return_mode="median")  # noqa: E731
    # the kernels alone, each config, on the fused path's own inputs
    h = shared["h_gu"](x)
    g0, u0 = x @ w[0].T, x @ w[1].T
    _, h_d = gated_fwd(g0, u0, h, bg, bu, sg, su, ad, _CONFS["fwd"][0])
    dh_d, _ = shared["down_bwd_dy"](dy, h_d)
    d0 = dy @ w[2]
    kernel_us = {}

    def sweep(phase: str, confs: list) -> None:
        for conf in confs:
            fn = ((lambda c=conf: gated_fwd(g0, u0, h, bg, bu, sg, su, ad, c)) if phase == "fwd" else
                  (lambda c=conf: gated_bwd(d0, g0, u0, h, bg, bu, sg, su, dh_d, ad, c)))
            try:
                kernel_us[(phase, json.dumps(conf))] = bench(fn) * 1e3
            except Exception as e:  # noqa: BLE001 - a config that does not compile or fit is skipped
                print(f"{phase} {conf}: {type(e).__name__}: {str(e)[:120]}")

    for phase in ("fwd", "bwd"):
        sweep(phase, _CONFS[phase])
        top = sorted((k for k in kernel_us if k[0] == phase), key=kernel_us.get)[:3]
        if phase == "bwd":  # what the atomic dB / dA sums cost: the best config without them
            sweep(phase, [{**json.loads(top[0][1]), "SKIP_SUMS": True}])
    best = {p: json.loads(min((k for k in kernel_us if k[0] == p and "SKIP_SUMS" not in k[1]), key=kernel_us.get)[1])
            for p in ("fwd", "bwd")}
    bytes_fwd, bytes_bwd = 3 * M * I * 2, 5 * M * I * 2  # g0, u0 -> act; d0, g0, u0 -> dg, du
    src = torch.empty(1 << 29, device="cuda", dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy_tbs = 2 * src.numel() / (bench(lambda: dst.copy_(src)) * 1e-3) / 1e12
    del src, dst
    g1, u1 = g0.clone(), u0.clone()  # Liger's backward writes over its inputs: replays on copies
    neighbour_us = (bench(lambda: silu_mul[0](g0, u0)) * 1e3, bench(lambda: silu_mul[1](g1, u1, d0)) * 1e3)
    del g1, u1
    # correctness of both LoRA paths against fp32 torch, then the whole layer's fwd+bwd
    y_ref, g_ref = _reference(x, w, loras, dy)
    ref = [y_ref, *g_ref]
    fused = lambda: _fused_step(x, w, loras, dy, best, **shared)  # noqa: E731
    today = lambda: _fastaf_step(x, w, loras, dy, silu_mul, ll=ll, **shared)  # noqa: E731
    names = ["y", "dx", "dA_g", "dB_g", "dA_u", "dB_u", "dA_d", "dB_d"]
    err = {name: dict(zip(names, _errors(fn(), ref))) for name, fn in (("fused", fused), ("fastaf", today))}
    del y_ref, g_ref, ref
    rows = {}
    base = lambda: _base_step(x, w, dy, silu_mul)  # noqa: E731
    for name, fn in 2 * (("base", base), ("fastaf", today), ("fused", fused)):
        rows.setdefault(name, []).append(bench(fn) * 1e3)  # two interleaved rounds
    us = {k: min(v) for k, v in rows.items()}
    out = {"meta": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                    "shape": dict(M=M, H=H, I=I, r=r), "silu_mul": neighbour, "copy_tb_s": copy_tbs},
           "kernels_us": {f"{p} {c}": v for (p, c), v in kernel_us.items()}, "best": best,
           "floor_us": {"fwd": bytes_fwd / copy_tbs / 1e6, "bwd": bytes_bwd / copy_tbs / 1e6},
           "neighbour_us": {"fwd": neighbour_us[0], "bwd": neighbour_us[1]},
           "layer_us": us, "rounds_us": rows, "rel_err_vs_fp32": err}
    print(json.dumps(out, indent=1))
    print(f"layer fwd+bwd: base {us['base']:.1f} us, fastaf {us['fastaf']:.1f} (+{us['fastaf'] - us['base']:.1f}), "
          f"fused {us['fused']:.1f} (+{us['fused'] - us['base']:.1f})")
    path = Path(__file__).parent / "results" / f"{args.name}-{torch.cuda.get_device_name().lower().replace(' ', '-')}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
