"""One tolerance table for every numerical test: max relative error ||out - ref|| / ||ref||.

Keys are torch dtypes of the operands, plus "tf32" for float32 matmuls run on tensor cores.
Values follow METHOD.md's bands: fp32 arithmetic far under 1e-3, tf32 near 3e-4, bf16 operands
1e-3 to 1e-2 (a bf16 output rounding alone is 2**-9 ~ 2e-3 relative per element).
"""
from __future__ import annotations

import torch

REL_TOL = {
    torch.float64: 1e-12,
    torch.float32: 1e-5,
    "tf32": 2e-3,
    torch.float16: 5e-3,
    torch.bfloat16: 2e-2,
}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (NaN in out gives NaN, which fails every bound)."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_close(out: torch.Tensor, ref: torch.Tensor, key, name: str = "output") -> None:
    """Relative-norm check against REL_TOL[key], with NaN rejected."""
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    err = rel_err(out, ref)
    assert err <= REL_TOL[key], f"{name}: rel err {err:.3g} > {REL_TOL[key]:.1g} ({key})"


def varying(fn, primals: tuple, tangents: tuple, which: tuple) -> tuple:
    """(f, primals, tangents) for forward mode with only the arguments of ``fn(*primals)`` at
    positions ``which`` varying: f takes those, the rest stay as given."""
    def f(*given):
        args = list(primals)
        for i, t in zip(which, given):
            args[i] = t
        return fn(*args)

    return f, tuple(primals[i] for i in which), tuple(tangents[i] for i in which)
