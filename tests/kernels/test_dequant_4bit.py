"""``kernels.dequant_4bit``: a bitsandbytes 4-bit weight dequantized in one launch, against
bitsandbytes' own dequantization (interpreted on the CPU: ``TRITON_INTERPRET=1``)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from fastaf.kernels.hardware import available

bnb_functional = pytest.importorskip("bitsandbytes.functional")

TRITON = available(torch.empty(0))  # on the CPU: under TRITON_INTERPRET=1 (make test)
CASES = [("nf4", False), ("nf4", True), ("fp4", False), ("fp4", True)]


@pytest.mark.parametrize("kernel", ["bytes", "blocks"])
@pytest.mark.parametrize("quant_type,nested", CASES)
@pytest.mark.skipif(not TRITON, reason="no Triton interpreter (TRITON_INTERPRET=1)")
def test_the_kernel_equals_bitsandbytes_dequantization(quant_type, nested, kernel):
    """fastaf's one-launch kernel (interpreted here) against bitsandbytes' own ops, bit for bit in
    fp32, on a weight whose size is no multiple of the kernel's block (a tail program). Rows of
    whole 64-value blocks: bitsandbytes' CPU dequantization (0.50) misplaces the absmaxes of rows
    that are not (its values then differ from its CUDA kernel's, and from the weight)."""
    from fastaf.kernels import dequant_4bit

    w = torch.randn(41, 192, generator=torch.Generator().manual_seed(3)) / 8  # 123 blocks: a tail program for each kernel
    q, state = bnb_functional.quantize_4bit(w, quant_type=quant_type, compress_statistics=nested)
    want = bnb_functional.dequantize_4bit(q, state)
    extra = (state.state2.absmax, state.state2.code, state.offset) if nested else (None, None, None)
    out = torch.empty(41, 192)
    assert dequant_4bit.supported(q, state.blocksize, kernel)
    got = dequant_4bit.dequant_4bit(q, state.absmax, *extra, quant_type, state.blocksize,
                                    state.state2.blocksize if nested else 0, out, kernel=kernel)
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["bytes", "blocks"])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_the_kernel_equals_bitsandbytes_on_cuda_in_bf16(quant_type, kernel):
    """Bit for bit against bitsandbytes' CUDA kernels on a whole MLP weight, double-quantized: the
    kernel rounds code2 * absmax2 and + offset apart as bitsandbytes' two ops do (with FMA
    contraction allowed, a 14336 x 4096 weight differed on the H200; 4096 x 4096 and 1024 x 4096 did not)."""
    from fastaf.kernels import dequant_4bit

    w = torch.randn(14336, 4096, device="cuda", dtype=torch.bfloat16) / 64
    q, state = bnb_functional.quantize_4bit(w, quant_type=quant_type, compress_statistics=True)
    want = bnb_functional.dequantize_4bit(q, state)
    out = torch.empty_like(want)
    got = dequant_4bit.dequant_4bit(q, state.absmax, state.state2.absmax, state.state2.code, state.offset, quant_type,
                                    state.blocksize, state.state2.blocksize, out, kernel=kernel)
    assert torch.equal(got, want)


_COMPILE_FOR_HOPPER = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from fastaf.kernels import dequant_4bit_kernels

kernel, nested = sys.argv[1], sys.argv[2] == "1"
pointers = {"packed_ptr": "*u8", "absmax_ptr": "*u8" if nested else "*fp32", "absmax2_ptr": "*fp32",
            "code2_ptr": "*fp32", "offset_ptr": "*fp32", "code_ptr": "*fp32", "out_ptr": "*bf16", "n_bytes": "i32"}
if kernel == "blocks":
    fn, sizes = dequant_4bit_kernels._dequant_4bit_blocks_kernel, {"n_blocks": "i32"}
    constants = {"HALF_BLOCK": 32, "BLOCKS": 32}
else:
    fn, sizes, constants = dequant_4bit_kernels._dequant_4bit_kernel, {}, {"BLOCKSIZE": 64, "BLOCK_BYTES": 1024}
constants.update(NESTED_BLOCKSIZE=256, NESTED=nested)
signature = {**pointers, **sizes, **{name: "constexpr" for name in constants}}
source = triton.compiler.ASTSource(fn, signature, constexprs=constants)
compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False})
assert "ttgir" in compiled.asm
"""


@pytest.mark.parametrize("kernel", ["bytes", "blocks"])
@pytest.mark.parametrize("nested", [False, True])
def test_the_kernels_compile_for_hopper(kernel, nested):
    """Each kernel compiled for an sm_90 GPU, here without one, in a process of its own (under
    TRITON_INTERPRET=1 the kernels are interpreted functions, which do not compile): the
    interpreter does not type-check, and a jit helper whose two branches returned a uint8 and an
    fp32 ran under it yet failed to compile on the H200 (triton 3.6 types every return, pruned
    branches too)."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # (triton 3.9 warns when it is unset)
    done = subprocess.run([sys.executable, "-c", _COMPILE_FOR_HOPPER, kernel, str(int(nested))], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
