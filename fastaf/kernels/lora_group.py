"""Projections that read one input (q/k/v, gate/up) as one call (as Unsloth's LoRA_QKV / LoRA_MLP).

For siblings i = 1..n over one x (M, K), each with its own W_i (N_i, K), bias_i, A_i (r_i, K),
B_i (N_i, r_i) and scale s_i, with A = [A_1; ..; A_n] (R, K) and R = sum r_i:

    forward    h = x @ A.T                         one pass over x for every sibling   (fwd_h)
               y_i = x @ W_i.T + bias_i + s_i * h_i @ B_i.T                           (gemm, each)
    backward   dh_i = s_i * dy_i @ B_i,  dB_i = s_i * dy_i.T @ h_i                    (bwd_dy, each)
               dA = [dh_1 .. dh_n].T @ x           one pass over x for every sibling   (bwd_da)
               dx = sum_i dy_i @ W_i + dh @ A                 one gemm launch for up to three

Against n separate calls this reads x 2(n - 1) times less and sums dx inside its GEMMs, where
autograd would add the siblings' dx (n - 1 elementwise passes over an (M, K) tensor). An eager
call's launches replay from one CUDA graph each way (``launch_graphs``), every output allocated before.
A sibling whose output got no gradient contributes dh_i = 0 and gets dB_i = None.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from fastaf.kernels import launch_graphs
from fastaf.kernels.lora_linear import bwd_da, bwd_da_plan, bwd_dy, bwd_dy_plan, fwd_h, gemm, segments_fit
from fastaf.kernels.lora_linear_configs import MAX_RANK
from fastaf.kernels.lora_linear_plan import _tf32, choose_impl


def fits(x: torch.Tensor, weights: Sequence[torch.Tensor], ranks: Sequence[int], impl: str) -> bool:
    """Whether every sibling's forward and backward take the Triton kernels at x's (M, K), as each
    alone would (``impl`` "auto": the measured dispatch), so the group never runs a path the
    dispatch rejected. x (M, K). Never under torch's deterministic mode: the group's backward
    sums with fp32 atomics, and each sibling alone then alerts or takes cuBLAS as its dispatch says.
    Each sibling is asked at its own rank, not the group's sum (asked at the sum, q/k/v at r=16
    resolve to the dispatch's r=64 entries, where q's forward at M=4096 and k/v's at M=8192 take
    cuBLAS on the H100: no group at the 1B shapes); the sum must fit the kernels' padded rank, which the group's
    h and dx launches read."""
    if torch.are_deterministic_algorithms_enabled():  # no alert here: each sibling alone decides
        return False
    if sum(ranks) > MAX_RANK:
        return False
    M, K = x.shape
    return all(choose_impl(impl, phase, x, M, K, w.shape[0], r) == "triton"
               for w, r in zip(weights, ranks) for phase in ("fwd", "bwd"))


def group_fwd(x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[Optional[torch.Tensor]],
              a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], scales: Sequence[float], *,
              lead: tuple = (), graphed: bool = False) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(ys, h): y_i (M, N_i) or (*lead, N_i) in x's dtype, h (M, R) in x's dtype.

    x (M, K); weights[i] (N_i, K); biases[i] (N_i,) or None; a[i] (r_i, K), b[i] (N_i, r_i) in
    any float dtype (fp32 masters are read as they are). ``graphed``: the launches may replay
    from a CUDA graph (the eager op path, whose outputs nothing else writes).
    """
    M = x.shape[0]
    ranks = [t.shape[0] for t in a]
    h = torch.empty((M, sum(ranks)), device=x.device, dtype=x.dtype)
    ys = [torch.empty((*lead, w.shape[0]) if lead else (M, w.shape[0]), device=x.device, dtype=x.dtype)
          for w in weights]

    def launch() -> None:
        fwd_h(x, torch.cat(list(a)) if len(a) > 1 else a[0], 0.0, None, out=h)  # the stack: a temporary
        start = 0
        for w, bias, b_i, s, r, y in zip(weights, biases, b, scales, ranks, ys):
            gemm(x, w.T, h[:, start:start + r], b_i.T, bias, s, 0.0, None, x.dtype, out=y)
            start += r

    if graphed and launch_graphs.usable(x):
        key = launch_graphs.call_key((x, h, *weights, *biases, *a, *b, *ys), "group_fwd", *scales, _tf32(x.dtype))
        launch_graphs.GRAPHS.run(key, x.get_device(), launch)
    else:
        launch()
    return ys, h


def group_bwd(dys: Sequence[Optional[torch.Tensor]], x: torch.Tensor, weights: Sequence[torch.Tensor],
              a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], h: torch.Tensor, scales: Sequence[float],
              needs_dx: bool, *, graphed: bool = False
              ) -> tuple[Optional[torch.Tensor], list[Optional[torch.Tensor]], list[Optional[torch.Tensor]]]:
    """(dx (M, K) in x's dtype or None, dA_i (r_i, K) in a[i]'s dtype and dB_i (N_i, r_i) in b[i]'s,
    both None where dys[i] is None). dys[i] (M, N_i) or None; h (M, R) the forward's.

    The dA_i are views of one fp32 (R, K) buffer (fp32 factors: returned as they are), as the
    single op's shared gradients are.
    """
    live = [i for i, dy in enumerate(dys) if dy is not None]
    if not live:
        return None, [None] * len(dys), [None] * len(dys)
    (M, K), R = x.shape, h.shape[1]
    dev = x.device
    ranks = [t.shape[0] for t in a]
    starts = [sum(ranks[:i]) for i in range(len(ranks))]
    dy_plans = {i: bwd_dy_plan(dys[i], b[i], h[:, starts[i]:starts[i] + ranks[i]], None) for i in live}
    da_plan = bwd_da_plan(x, R, False, None, None)
    da = torch.empty((R, K), device=dev, dtype=torch.float32)
    # db: summed from partials into b's dtype (allocated here), or atomically into a zeroed fp32 buffer
    db = {i: torch.empty((b[i].shape[0], ranks[i]), device=dev,
                         dtype=b[i].dtype if dy_plans[i][1] else torch.float32) for i in live}
    dx = torch.empty((M, K), device=dev, dtype=x.dtype) if needs_dx else None
    # H100, 1B q/k/v: 175 us in one launch against 199 for gemm + addmm_
    first, rest = live[0], live[1:]
    one_launch = segments_fit(dys[first], weights[first], [(dys[i], weights[i]) for i in rest])

    def launch() -> None:
        if da_plan[1] > 1:  # split over M: summed atomically
            da.zero_()
        dhs = []
        for i, (r, start) in enumerate(zip(ranks, starts)):
            if i not in live:
                dhs.append(torch.zeros((M, r), device=dev, dtype=torch.float32))
                continue
            plan = dy_plans[i]
            partials = plan[1]
            if not partials:
                db[i].zero_()
            dh_i = (torch.zeros if plan[2] > 1 else torch.empty)((M, r), device=dev, dtype=torch.float32)
            bwd_dy(dys[i], b[i], h[:, start:start + r], scales[i], dh=dh_i, db_sum=None if partials else db[i],
                   plan=plan, db_out=db[i] if partials else None, cast=False)
            dhs.append(dh_i)
        dh = torch.cat(dhs, dim=1) if len(dhs) > 1 else dhs[0]  # (M, R) fp32, a temporary
        bwd_da(dh, x, 0.0, None, da=da, plan=da_plan)
        if dx is not None:
            a_all = torch.cat(list(a)) if len(a) > 1 else a[0]
            if one_launch:  # every sibling's K loop into one tile: dx written once
                gemm(dys[first], weights[first], dh, a_all, None, 1.0, 0.0, None, x.dtype, out=dx,
                     extra=[(dys[i], weights[i]) for i in rest])
            else:
                gemm(dys[first], weights[first], dh, a_all, None, 1.0, 0.0, None, x.dtype, out=dx)
                for i in rest:
                    dx.addmm_(dys[i], weights[i])  # cuBLAS sums into dx: no separate add pass

    if graphed and launch_graphs.usable(x):
        key = launch_graphs.call_key((*dys, x, h, *weights, *a, *b, da, *db.values(), dx), "group_bwd", *scales,
                               _tf32(x.dtype))
        launch_graphs.GRAPHS.run(key, dev.index, launch)
    else:
        launch()
    das = [None if i not in live else da[start:start + r] if a[i].dtype == torch.float32
           else da[start:start + r].to(a[i].dtype) for i, (start, r) in enumerate(zip(starts, ranks))]
    dbs = [None if i not in live else db[i] if db[i].dtype == b[i].dtype else db[i].to(b[i].dtype)
           for i in range(len(dys))]
    return dx, das, dbs
