"""Triton twin of ``dropout_hash.hash_uniform``: the same counter-based dropout mask, in-kernel.

u(seed, i) = (lowbias32((i mod 2**32) ^ (seed * SEED_MULT mod 2**32)) >> 8) * 2**-24,
keep = u >= p. Bit-identical to the torch reference (tests/kernels/test_dropout_hash.py checks
every element of a sweep of indices and seeds), so kernels recompute the mask in backward
instead of saving it.

Kernels call ``dropout_keep(seed_ptr, index, p)`` with ``index`` the int64 logical element index
``m * K + k`` of the (M, K) input and ``seed_ptr`` pointing at an int64 tensor of shape (1,).
"""
from __future__ import annotations

import triton
import triton.language as tl

from fastaf.kernels import dropout_hash

# jit functions may only read globals that are tl.constexpr (the interpreter is laxer)
SEED_MULT = tl.constexpr(dropout_hash.SEED_MULT)
HASH_MULT_1 = tl.constexpr(dropout_hash.HASH_MULT_1)
HASH_MULT_2 = tl.constexpr(dropout_hash.HASH_MULT_2)


@triton.jit
def hash_uniform(seed, index):
    """Uniform float32 in [0, 1) for int64 ``seed`` (scalar) and int64 ``index`` (any block).

    uint32 arithmetic wraps modulo 2**32 exactly as the reference's masked int64 arithmetic.
    The multipliers are built as uint32 tensors: a literal above 2**31 would otherwise be
    typed int64 and promote the product out of 32 bits.
    """
    v = (index & 0xFFFFFFFF).to(tl.uint32)
    s = (seed & 0xFFFFFFFF).to(tl.uint32)
    v = v ^ (s * tl.full((), SEED_MULT, tl.uint32))
    v = v ^ (v >> 16)
    v = v * tl.full((), HASH_MULT_1, tl.uint32)
    v = v ^ (v >> 15)
    v = v * tl.full((), HASH_MULT_2, tl.uint32)
    v = v ^ (v >> 16)
    return (v >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def dropout_keep(seed_ptr, index, p):
    """Boolean keep mask (u >= p) of ``index``'s shape; ``seed_ptr`` -> int64 seed of shape (1,)."""
    seed = tl.load(seed_ptr)
    return hash_uniform(seed, index) >= p
