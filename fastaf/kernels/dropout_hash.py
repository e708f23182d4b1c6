"""Counter-based dropout mask shared by the torch reference and the Triton kernels.

keep[m, k] = u(seed, m * K + k) >= p, with u a 24-bit uniform in [0, 1) from the lowbias32
integer hash. The mask is a pure function of (seed, element index), so the backward pass
recomputes it instead of saving an (M, K) mask, and the Triton kernels reproduce the torch
reference bit for bit (which is what lets the tests compare them with dropout on).

All arithmetic is modulo 2**32. Torch has no uint32 multiply, so the reference multiplies in
int64 on 16-bit halves of the constant; every partial product stays below 2**48.
"""
from __future__ import annotations

import torch

SEED_MULT = 0x9E3779B1  # golden-ratio constant: spreads consecutive seeds over 32 bits
HASH_MULT_1 = 0x7FEB352D  # lowbias32 constants (Chris Wellons' hash prospector)
HASH_MULT_2 = 0x846CA68B
_MASK32 = 0xFFFFFFFF


def _mul32(v: torch.Tensor, const: int) -> torch.Tensor:
    """(v * const) mod 2**32 for int64 v in [0, 2**32), without int64 overflow."""
    lo = v * (const & 0xFFFF)
    hi = ((v * (const >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _MASK32


def hash_uniform(seed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Uniform float32 in [0, 1) from lowbias32(index ^ seed * SEED_MULT).

    Args:
        seed: int64 tensor broadcastable against ``index`` (low 32 bits are used).
        index: int64 tensor of logical element indices (``m * K + k``), any shape.
    Returns:
        float32 tensor of ``index``'s shape, multiples of 2**-24.
    """
    v = (index & _MASK32) ^ _mul32(seed.to(torch.int64) & _MASK32, SEED_MULT)
    v = v ^ (v >> 16)
    v = _mul32(v, HASH_MULT_1)
    v = v ^ (v >> 15)
    v = _mul32(v, HASH_MULT_2)
    v = v ^ (v >> 16)
    return (v >> 8).to(torch.float32) * (1.0 / 16777216.0)


def element_index(M: int, K: int, device: torch.device) -> torch.Tensor:
    """int64 (M, K) logical element indices m * K + k, the counter the mask hashes."""
    return torch.arange(M, device=device, dtype=torch.int64)[:, None] * K + torch.arange(
        K, device=device, dtype=torch.int64
    )


def keep_mask(seed: torch.Tensor, M: int, K: int, p: float, device: torch.device) -> torch.Tensor:
    """Boolean keep mask of shape (M, K) for dropout probability ``p``.

    Args:
        seed: int64 tensor of shape (1,) or () (one seed per mask).
        M, K: mask shape; element (m, k) hashes index m * K + k.
        p: drop probability in [0, 1).
    """
    return hash_uniform(seed.reshape(()), element_index(M, K, device)) >= p
