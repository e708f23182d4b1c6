"""Would warp specialization of the *tile* loop bring the LoRA gemm to cuBLAS? (diagnostic)

    python bench/diag_gemm_ws.py [M K N r ...]         # GPU; DIAG_NAME names the result file
    TRITON_INTERPRET=1 python bench/diag_gemm_ws.py --check    # CPU, small shapes

The shipped gemm (``lora_linear_kernels._lora_linear_gemm_kernel``) is persistent and software-
pipelined: each tile's K loop drains before its epilogue (the LoRA dot, the store), and the next
tile's loads start only after it. cuBLAS overlaps the two. Triton 3.5+ warp-specializes a
persistent loop on Hopper (``tl.range(tiles, ..., warp_specialize=True)``: a producer warp runs
the TMA loads ahead, into the next tile, while the consumer warpgroups finish the epilogue).
stop 36 tried it on the K loop only, which cannot overlap the epilogue. This prototype puts it on
the tile loop, with every load (x, w, h, u) through TMA descriptors so the producer owns them.

Layouts as ``diag_gemm``: fwd y = x @ W.T + s * h @ B.T; dx dX = dy @ W + s * dh @ A. Each
variant is checked against the fp32 reference before it is timed, from CUDA-graph replays in
interleaved rounds, beside cuBLAS ``mm`` of the base alone and the shipped gemm (tuned config).
"""
from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fastaf.kernels._device import _ensure_allocator  # noqa: E402

ROUNDS = 5


@triton.jit
def _coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    num_in_group = GROUP_M * num_pid_n
    first_m = (tile_id // num_in_group) * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (tile_id % num_in_group) % group_m, (tile_id % num_in_group) // group_m


@triton.jit
def _lora_dot(acc, h_desc, u_desc, off_m, off_n, l_scale, U_R_CONTIG: tl.constexpr):
    """acc + (l_scale * h[off_m block]) @ u[:, off_n block], both tiles by TMA."""
    h = h_desc.load([off_m, 0])
    if U_R_CONTIG:
        u = u_desc.load([off_n, 0]).T
    else:
        u = u_desc.load([0, off_n])
    return tl.dot((h.to(tl.float32) * l_scale).to(h.dtype), u, acc)


@triton.jit
def _ws_gemm_kernel(x_ptr, w_ptr, h_ptr, u_ptr, y_ptr, M, N, K, R, stride_xm, stride_w, stride_hm, stride_u,
                    stride_ym, l_scale, NUM_PROGRAMS,
                    W_K_CONTIG: tl.constexpr, U_R_CONTIG: tl.constexpr, R_PAD: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                    WARP_SPEC: tl.constexpr, FLATTEN: tl.constexpr, SUBTILE: tl.constexpr, LORA_FIRST: tl.constexpr):
    """y = x @ w + (l_scale * h) @ u, persistent over (BLOCK_M, BLOCK_N) tiles, every load by TMA.

    x (M, K) unit K stride; w (N, K) rows (W_K_CONTIG) or (K, N) rows; h (M, R) unit R stride;
    u (N, R) rows (U_R_CONTIG: B of the forward) or (R, N) rows (A of dX); y (M, N).
    LORA_FIRST: the LoRA dot seeds the accumulator ahead of the K loop instead of after it.
    """
    dtype = y_ptr.dtype.element_ty
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1], block_shape=[BLOCK_M, BLOCK_K])
    if W_K_CONTIG:
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[stride_w, 1], block_shape=[BLOCK_N, BLOCK_K])
    else:
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[K, N], strides=[stride_w, 1], block_shape=[BLOCK_K, BLOCK_N])
    h_desc = tl.make_tensor_descriptor(h_ptr, shape=[M, R], strides=[stride_hm, 1], block_shape=[BLOCK_M, R_PAD])
    if U_R_CONTIG:
        u_desc = tl.make_tensor_descriptor(u_ptr, shape=[N, R], strides=[stride_u, 1], block_shape=[BLOCK_N, R_PAD])
    else:
        u_desc = tl.make_tensor_descriptor(u_ptr, shape=[R, N], strides=[stride_u, 1], block_shape=[R_PAD, BLOCK_N])
    if SUBTILE:
        y_desc = tl.make_tensor_descriptor(y_ptr, shape=[M, N], strides=[stride_ym, 1],
                                           block_shape=[BLOCK_M, BLOCK_N // 2])
    else:
        y_desc = tl.make_tensor_descriptor(y_ptr, shape=[M, N], strides=[stride_ym, 1],
                                           block_shape=[BLOCK_M, BLOCK_N])
    k_tiles = tl.cdiv(K, BLOCK_K)
    tile_c = tl.program_id(0) - NUM_PROGRAMS  # the epilogue's own counter (the tutorial's: no value
    # shared between a flattened loop's prologue and epilogue)
    for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS, flatten=FLATTEN, warp_specialize=WARP_SPEC):
        pid_m, pid_n = _coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if LORA_FIRST:
            acc = _lora_dot(acc, h_desc, u_desc, off_m, off_n, l_scale, U_R_CONTIG)
        for ki in range(k_tiles):
            xt = x_desc.load([off_m, ki * BLOCK_K])
            if W_K_CONTIG:
                wt = w_desc.load([off_n, ki * BLOCK_K]).T
            else:
                wt = w_desc.load([ki * BLOCK_K, off_n])
            acc = tl.dot(xt, wt, acc)
        tile_c += NUM_PROGRAMS
        pid_m, pid_n = _coords(tile_c, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        if not LORA_FIRST:
            acc = _lora_dot(acc, h_desc, u_desc, off_m, off_n, l_scale, U_R_CONTIG)
        if SUBTILE:
            acc0, acc1 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            y_desc.store([off_m, off_n], acc0.to(dtype))
            y_desc.store([off_m, off_n + BLOCK_N // 2], acc1.to(dtype))
        else:
            y_desc.store([off_m, off_n], acc.to(dtype))


def ws_gemm(x: torch.Tensor, w: torch.Tensor, w_k_contig: bool, h: torch.Tensor, u: torch.Tensor, u_r_contig: bool,
            l_scale: float, conf: dict) -> torch.Tensor:
    """The prototype's launch: x (M, K); w (N, K) if w_k_contig else (K, N); h (M, R); u (N, R) if
    u_r_contig else (R, N); all row-major. Returns y (M, N) in x's dtype."""
    M, K = x.shape
    N = w.shape[0] if w_k_contig else w.shape[1]
    R = h.shape[1]
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    conf = dict(conf)
    tiles = triton.cdiv(M, conf["BLOCK_M"]) * triton.cdiv(N, conf["BLOCK_N"])
    programs = min(tiles, torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 2)
    _ensure_allocator()
    _ws_gemm_kernel[(programs,)](x, w, h, u, y, M, N, K, R, x.stride(0), w.stride(0), h.stride(0), u.stride(0),
                                 y.stride(0), float(l_scale), programs, W_K_CONTIG=w_k_contig, U_R_CONTIG=u_r_contig,
                                 R_PAD=max(16, triton.next_power_of_2(R)), **conf)
    return y


def layouts(M: int, K: int, N: int, R: int, device: str, dtype: torch.dtype = torch.bfloat16) -> dict:
    """name -> (lhs, w, w_k_contig, h, u, u_r_contig, fp32 reference), as ``diag_gemm``'s fwd and dx."""
    g = torch.Generator(device=device).manual_seed(M + K + N + R)
    rnd = lambda *s: torch.randn(*s, device=device, generator=g).to(dtype)  # noqa: E731
    W = rnd(N, K) / K**0.5
    x, hx, B = rnd(M, K), rnd(M, R), rnd(N, R) / R**0.5
    dy, dh, A = rnd(M, N), rnd(M, R), rnd(R, K) / R**0.5
    return {
        "fwd": (x, W, True, hx, B, True, x.float() @ W.float().T + 0.5 * hx.float() @ B.float().T),
        "dx": (dy, W, False, dh, A, False, dy.float() @ W.float() + 0.5 * dh.float() @ A.float()),
    }


VARIANTS = {  # name -> the prototype's config
    "sw-pipe": dict(WARP_SPEC=False, FLATTEN=False, SUBTILE=False, LORA_FIRST=False, num_stages=3),
    "ws": dict(WARP_SPEC=True, FLATTEN=False, SUBTILE=False, LORA_FIRST=False, num_stages=3),
    "ws flat": dict(WARP_SPEC=True, FLATTEN=True, SUBTILE=False, LORA_FIRST=False, num_stages=3),
    "ws sub 4st": dict(WARP_SPEC=True, FLATTEN=False, SUBTILE=True, LORA_FIRST=False, num_stages=4),
    "ws flat sub 4st": dict(WARP_SPEC=True, FLATTEN=True, SUBTILE=True, LORA_FIRST=False, num_stages=4),
    "ws lora-first": dict(WARP_SPEC=True, FLATTEN=False, SUBTILE=False, LORA_FIRST=True, num_stages=3),
    "ws lora-first sub 4st": dict(WARP_SPEC=True, FLATTEN=False, SUBTILE=True, LORA_FIRST=True, num_stages=4),
}
TILE = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8)


def check() -> None:
    """CPU (interpreter): each variant's math against the fp32 reference at a small odd shape, in
    fp16 (triton 3.9's interpreter reads bf16 descriptor tiles into tl.dot as garbage)."""
    small = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=16, GROUP_M=2, num_warps=4)
    for layout, (lhs, w, wk, h, u, ur, ref) in layouts(80, 48, 96, 8, "cpu", torch.float16).items():
        for name, v in VARIANTS.items():
            y = ws_gemm(lhs, w, wk, h, u, ur, 0.5, {**small, **v, "num_stages": 1})
            err = ((y.float() - ref).norm() / ref.norm()).item()
            assert err < 1e-2, (layout, name, err)
    print("prototype matches the fp32 reference in every variant")


def main() -> None:
    if "--check" in sys.argv:
        return check()
    from bench import _harness as H
    from fastaf.kernels import lora_linear as ll
    vals = [int(v) for v in sys.argv[1:]] or [8192, 2048, 2048, 16, 8192, 2048, 8192, 16, 8192, 8192, 2048, 16,
                                               8192, 2048, 512, 16]
    rows = []
    print(f"{torch.cuda.get_device_name()}: GPU us from CUDA-graph replays, median of {ROUNDS} interleaved rounds")
    for M, K, N, R in zip(*[iter(vals)] * 4):
        for layout, (lhs, w, wk, h, u, ur, ref) in layouts(M, K, N, R, "cuda").items():
            w_kn = w.T if wk else w
            u_rn = u.T if ur else u
            fns = {"cublas": lambda lhs=lhs, w_kn=w_kn: torch.mm(lhs, w_kn),
                   "shipped": lambda lhs=lhs, w_kn=w_kn, h=h, u_rn=u_rn:
                   ll.gemm(lhs, w_kn, h, u_rn, None, 0.5, 0.0, None, torch.bfloat16)}
            fns.update(H.checked({name: (lambda lhs=lhs, w=w, wk=wk, h=h, u=u, ur=ur, v=v:
                                         ws_gemm(lhs, w, wk, h, u, ur, 0.5, {**TILE, **v}))
                                  for name, v in VARIANTS.items()}, ref, layout))
            times = H.graph_rounds(fns, ROUNDS, rep=40)
            base = statistics.median(times["cublas"])
            Kd, Nd = w_kn.shape
            print(f"M={M} K={Kd} N={Nd} r={R} {layout}: cuBLAS {base:.1f} us")
            for name, t in times.items():
                us = statistics.median(t)
                print(f"  {name:24s} {us:8.1f} us  {us / base:6.3f}x  (rounds {min(t):.1f}-{max(t):.1f})")
                rows.append({"bench": "diag_gemm_ws", "M": M, "K": Kd, "N": Nd, "r": R, "layout": layout,
                             "variant": name, "us": us, "rounds_us": t, "ratio_cublas": us / base})
    print("wrote", H.write_results(os.environ.get("DIAG_NAME", "diag-gemm-ws"), rows, {"rounds": ROUNDS}))


if __name__ == "__main__":
    main()
