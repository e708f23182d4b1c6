"""``@triton.jit`` kernel of ``dequant_4bit``: a bitsandbytes NF4 / FP4 weight to floats in one launch."""
import triton
import triton.language as tl


@triton.jit
def _absmax(absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, block, mask, NESTED_BLOCKSIZE: tl.constexpr,
            NESTED: tl.constexpr):
    """The fp32 absmax of quantization blocks ``block``: stored, or under double quantization
    (``NESTED``) a uint8 index into ``code2`` times its own block's ``absmax2``, plus ``offset``."""
    # one return of one type: triton 3.6 types every return of a jit function, pruned branches too
    # (a uint8 absmax pointer's load would make the other branch's type disagree)
    if NESTED:
        index = tl.load(absmax_ptr + block, mask=mask, other=0).to(tl.int32)
        scale = tl.load(code2_ptr + index, mask=mask, other=0.0) * \
            tl.load(absmax2_ptr + block // NESTED_BLOCKSIZE, mask=mask, other=0.0) + tl.load(offset_ptr)
    else:
        scale = tl.load(absmax_ptr + block, mask=mask, other=0.0)
    return scale.to(tl.float32)


@triton.jit
def _dequant_4bit_kernel(
    packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, out_ptr,
    n_bytes,
    BLOCKSIZE: tl.constexpr, NESTED_BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr, BLOCK_BYTES: tl.constexpr,
):
    """out[2i], out[2i + 1] = code[packed[i] >> 4], code[packed[i] & 15], each times its block's
    absmax (block = value index // BLOCKSIZE). ``NESTED`` (double quantization): the absmax is
    itself a uint8 index into ``code2``, times its own block's ``absmax2``, plus ``offset``."""
    pid = tl.program_id(0)
    offs = pid * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)
    mask = offs < n_bytes
    byte = tl.load(packed_ptr + offs, mask=mask, other=0).to(tl.int32)
    block = (offs * 2) // BLOCKSIZE  # both values of a byte share a block (BLOCKSIZE is even)
    scale = _absmax(absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, block, mask, NESTED_BLOCKSIZE, NESTED)
    high = tl.load(code_ptr + (byte >> 4)) * scale
    low = tl.load(code_ptr + (byte & 15)) * scale
    values = tl.interleave(high, low)  # (2 * BLOCK_BYTES,): value 2i from the high nibble, as bitsandbytes
    out = pid * (2 * BLOCK_BYTES) + tl.arange(0, 2 * BLOCK_BYTES)
    tl.store(out_ptr + out, values.to(out_ptr.dtype.element_ty), mask=out < n_bytes * 2)


@triton.jit
def _dequant_4bit_blocks_kernel(
    packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, out_ptr,
    n_bytes, n_blocks,
    HALF_BLOCK: tl.constexpr, NESTED_BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr, BLOCKS: tl.constexpr,
):
    """``_dequant_4bit_kernel``'s values with the bytes laid out a quantization block to a row:
    a program takes BLOCKS whole blocks (BLOCKS, HALF_BLOCK bytes), and each block's scale is
    loaded once and broadcast along its row, where the byte-wise kernel gathers it (and, under
    double quantization, its code and second-level absmax) for every byte."""
    pid = tl.program_id(0)
    rows = pid * BLOCKS + tl.arange(0, BLOCKS)  # block indices
    in_rows = rows < n_blocks
    offs = rows[:, None] * HALF_BLOCK + tl.arange(0, HALF_BLOCK)[None, :]  # (BLOCKS, HALF_BLOCK) bytes
    byte = tl.load(packed_ptr + offs, mask=offs < n_bytes, other=0).to(tl.int32)
    scale = _absmax(absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, rows, in_rows, NESTED_BLOCKSIZE, NESTED)
    high = tl.load(code_ptr + (byte >> 4)) * scale[:, None]
    low = tl.load(code_ptr + (byte & 15)) * scale[:, None]
    values = tl.interleave(high, low)  # (BLOCKS, 2 * HALF_BLOCK): value 2i from the high nibble
    out = rows[:, None] * (2 * HALF_BLOCK) + tl.arange(0, 2 * HALF_BLOCK)[None, :]
    tl.store(out_ptr + out, values.to(out_ptr.dtype.element_ty), mask=out < n_bytes * 2)
