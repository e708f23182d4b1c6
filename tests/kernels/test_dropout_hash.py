"""The Triton dropout hash is bit-identical to the torch reference (runs under TRITON_INTERPRET=1)."""
import os

import pytest
import torch
import triton
import triton.language as tl

from fastaf.kernels.dropout_hash import hash_uniform as hash_uniform_torch
from fastaf.kernels.dropout_hash_triton import hash_uniform

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton needs CUDA or TRITON_INTERPRET=1",
)


@triton.jit
def _hash_kernel(seed_ptr, index_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    index = tl.load(index_ptr + offs, mask=offs < n, other=0)
    tl.store(out_ptr + offs, hash_uniform(tl.load(seed_ptr), index), mask=offs < n)


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**31 - 1, 2**32 + 7, 2**40 + 5])
def test_hash_bit_exact(seed):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(seed % 1000)
    index = torch.cat([
        torch.arange(0, 3000),  # consecutive (one row of a small matrix)
        torch.randint(0, 2**31, (3000,), generator=gen),
        torch.randint(2**31, 2**40, (2000,), generator=gen),  # past 2**32: only the low 32 bits count
    ]).to(device)
    seed_t = torch.tensor([seed], dtype=torch.int64, device=device)
    out = torch.empty(index.shape, dtype=torch.float32, device=device)
    _hash_kernel[(triton.cdiv(index.numel(), 1024),)](seed_t, index, out, index.numel(), BLOCK=1024)
    ref = hash_uniform_torch(seed_t.reshape(()), index)
    assert torch.equal(out, ref)
    assert 0.0 <= out.min() and out.max() < 1.0
