"""A bitsandbytes 4-bit weight (NF4 or FP4, double quantization or not) dequantized in one launch.

bitsandbytes dequantizes a double-quantized weight in two launches (the absmaxes, then the
weight), at 0.6-1.9 TB/s on the H200 (``bench/results/dequant-4bit.csv``). This kernel reads the
packed bytes and both levels of absmax and writes the weight at once: 0.028 against 0.047 ms for a
4096 x 4096 weight there, each behind fastaf's Python wrapper. The 16-value code table is read from bitsandbytes'
own dequantization of every code (``code_table``), so the two agree by construction; the tests
compare whole weights. Kernels: ``dequant_4bit_kernels``: ``blocks`` (run), whole quantization
blocks per program, each block's scale loaded once, and ``bytes``, a flat run of packed bytes per
program. CUDA-graph replayed on the H200 (``bench/dequant.py``, run 8126), NF4 with double
quantization: a 14336 x 4096 weight in 47.0 us (3.1 TB/s) with ``blocks``, 52.5 with ``bytes``,
74.5 with bitsandbytes' two launches; 4096 x 4096 in 15.1, 16.6 and 25.0.
"""
from __future__ import annotations

from typing import Optional

import torch

from .hardware import available

BLOCK_BYTES = 1024  # packed bytes per program: 2048 values
INTERPRET_BLOCK_BYTES = 64
KERNELS = ("bytes", "blocks")
KERNEL = "blocks"  # the kernel ``dequant_4bit`` runs by default: the faster at every shape measured
_codes: dict[tuple, torch.Tensor] = {}


def code_table(quant_type: str, device: torch.device) -> torch.Tensor:
    """The 16 fp32 values of ``quant_type``'s codes, from bitsandbytes' dequantization of a block
    whose bytes hold each code twice (absmax 1): what its kernels compute, whatever their form."""
    key = (quant_type, device)
    table = _codes.get(key)
    if table is None:
        codes = torch.arange(16, dtype=torch.int32)
        packed = (codes * 16 + codes).to(torch.uint8).repeat(2).to(device)  # 32 bytes: one block of 64
        one = torch.ones(1, dtype=torch.float32, device=device)
        dense = torch.ops.bitsandbytes.dequantize_4bit.default(packed, one, 64, quant_type, [64], torch.float32)
        table = _codes[key] = dense.reshape(-1)[0:32:2].contiguous()
    return table


def supported(packed: torch.Tensor, blocksize: int, kernel: str = KERNEL) -> bool:
    """``kernel`` can run: on CUDA (or interpreted), contiguous uint8 bytes, even block sizes (a
    power of two for ``blocks``, whose rows are whole blocks)."""
    return (available(packed) and packed.dtype == torch.uint8 and packed.is_contiguous() and blocksize % 2 == 0
            and (kernel == "bytes" or blocksize & (blocksize - 1) == 0))


def dequant_4bit(packed: torch.Tensor, absmax: torch.Tensor, absmax2: Optional[torch.Tensor],
                 code2: Optional[torch.Tensor], offset: Optional[torch.Tensor], quant_type: str, blocksize: int,
                 nested_blocksize: int, out: torch.Tensor, kernel: str = KERNEL) -> torch.Tensor:
    """Write the dense weight into ``out`` (N, K), contiguous, float: ``packed`` holds N * K / 2
    bytes, ``absmax`` one value per ``blocksize`` values (uint8 when ``nested_blocksize``, with
    ``absmax2`` one fp32 per ``nested_blocksize`` absmaxes, ``code2`` 256 fp32, ``offset`` 0-d).
    ``kernel``: one of ``KERNELS`` (benchmarks time them side by side)."""
    import triton

    from .dequant_4bit_kernels import _dequant_4bit_blocks_kernel, _dequant_4bit_kernel

    n_bytes = out.numel() // 2
    block = BLOCK_BYTES if packed.is_cuda else INTERPRET_BLOCK_BYTES
    nested = nested_blocksize > 0
    code = code_table(quant_type, packed.device)
    dummy = absmax  # unread pointers where not nested
    tensors = (packed, absmax, absmax2 if nested else dummy, code2 if nested else dummy,
               offset.reshape(1).to(torch.float32) if nested else dummy, code, out)
    # code2 * absmax2 + offset rounded twice, as bitsandbytes' two ops: no FMA contraction
    common = dict(NESTED_BLOCKSIZE=max(nested_blocksize, 1), NESTED=nested, num_warps=4, enable_fp_fusion=False)
    if kernel == "blocks":
        half = blocksize // 2
        blocks = max(1, block // half)  # whole quantization blocks per program, about ``block`` bytes
        n_blocks = -(-out.numel() // blocksize)
        _dequant_4bit_blocks_kernel[(triton.cdiv(n_blocks, blocks),)](
            *tensors, n_bytes, n_blocks, HALF_BLOCK=half, BLOCKS=blocks, **common)
    else:
        _dequant_4bit_kernel[(triton.cdiv(n_bytes, block),)](
            *tensors, n_bytes, BLOCKSIZE=blocksize, BLOCK_BYTES=block, **common)
    return out
