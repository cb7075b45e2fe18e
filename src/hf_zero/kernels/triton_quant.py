"""Blockwise int8 and int4 quantize and dequantize ([Note: blockwise int8], [Note: blockwise
int4] in reference): one program per block of one row, the block held in registers, so each
element is read once and written once. The 4-bit kernels hold a block as its even and its odd
elements, the low and high nibbles of its bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_zero.kernels.triton_common import TL_DTYPES
from hf_zero.kernels.triton_common import cast_rtne

NUM_WARPS = 4


@triton.jit
def _quantize_kernel(values_ptr, codes_ptr, scales_ptr, numel, values_row_stride, codes_row_stride,
                     scales_row_stride, BLOCK: tl.constexpr):
    block = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    offsets = block * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    x = tl.load(values_ptr + row * values_row_stride + offsets, mask=mask, other=0.0).to(tl.float32)
    absmax = tl.max(tl.abs(x), axis=0)
    inverse = tl.where(absmax > 0.0, tl.div_rn(127.0, tl.maximum(absmax, 1e-30)), 0.0)
    code = tl.floor(x * inverse + 0.5)
    code = tl.minimum(tl.maximum(code, -127.0), 127.0)
    tl.store(codes_ptr + row * codes_row_stride + offsets, code.to(tl.int8), mask=mask)
    tl.store(scales_ptr + row * scales_row_stride + block, tl.div_rn(absmax, 127.0))


@triton.jit
def _dequantize_kernel(codes_ptr, scales_ptr, out_ptr, numel, codes_row_stride, scales_row_stride,
                       out_row_stride, OUT_DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    block = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    offsets = block * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    code = tl.load(codes_ptr + row * codes_row_stride + offsets, mask=mask, other=0).to(tl.float32)
    scale = tl.load(scales_ptr + row * scales_row_stride + block)
    tl.store(out_ptr + row * out_row_stride + offsets, cast_rtne(code * scale, OUT_DTYPE), mask=mask)


@triton.jit
def _quantize_int4_kernel(values_ptr, packed_ptr, scales_ptr, numel, values_row_stride, packed_row_stride,
                          scales_row_stride, BLOCK: tl.constexpr):
    block = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    pairs = block * (BLOCK // 2) + tl.arange(0, BLOCK // 2)
    even, odd = 2 * pairs, 2 * pairs + 1
    base = values_ptr + row * values_row_stride
    x0 = tl.load(base + even, mask=even < numel, other=0.0).to(tl.float32)
    x1 = tl.load(base + odd, mask=odd < numel, other=0.0).to(tl.float32)
    absmax = tl.maximum(tl.max(tl.abs(x0), axis=0), tl.max(tl.abs(x1), axis=0))
    inverse = tl.where(absmax > 0.0, tl.div_rn(7.0, tl.maximum(absmax, 1e-30)), 0.0)
    low = tl.minimum(tl.maximum(tl.floor(x0 * inverse + 0.5), -7.0), 7.0) + 8.0
    high = tl.minimum(tl.maximum(tl.floor(x1 * inverse + 0.5), -7.0), 7.0) + 8.0
    byte = low.to(tl.int32) | (high.to(tl.int32) << 4)
    tl.store(packed_ptr + row * packed_row_stride + pairs, byte.to(tl.uint8), mask=even < numel)
    tl.store(scales_ptr + row * scales_row_stride + block, tl.div_rn(absmax, 7.0))


@triton.jit
def _dequantize_int4_kernel(packed_ptr, scales_ptr, out_ptr, numel, packed_row_stride, scales_row_stride,
                            out_row_stride, OUT_DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    block = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    pairs = block * (BLOCK // 2) + tl.arange(0, BLOCK // 2)
    even, odd = 2 * pairs, 2 * pairs + 1
    byte = tl.load(packed_ptr + row * packed_row_stride + pairs, mask=even < numel, other=136).to(tl.int32)
    scale = tl.load(scales_ptr + row * scales_row_stride + block)
    base = out_ptr + row * out_row_stride
    tl.store(base + even, cast_rtne(((byte & 15) - 8).to(tl.float32) * scale, OUT_DTYPE), mask=even < numel)
    tl.store(base + odd, cast_rtne(((byte >> 4) - 8).to(tl.float32) * scale, OUT_DTYPE), mask=odd < numel)


def quantize_int8_blocks_triton(values: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                                block: int) -> None:
    """Launcher; same contract as ``reference.quantize_int8_blocks``, arguments validated."""
    rows, numel = values.shape
    if not rows or not numel:
        return
    _quantize_kernel[(scales.shape[1], rows)](
        values, codes, scales, numel, values.stride(0), codes.stride(0), scales.stride(0),
        BLOCK=block, num_warps=NUM_WARPS, enable_fp_fusion=False,
    )


def dequantize_int8_blocks_triton(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor,
                                  block: int) -> None:
    """Launcher; same contract as ``reference.dequantize_int8_blocks``, arguments validated."""
    rows, numel = out.shape
    if not rows or not numel:
        return
    _dequantize_kernel[(scales.shape[1], rows)](
        codes, scales, out, numel, codes.stride(0), scales.stride(0), out.stride(0),
        OUT_DTYPE=TL_DTYPES[out.dtype], BLOCK=block, num_warps=NUM_WARPS, enable_fp_fusion=False,
    )


def quantize_int4_blocks_triton(values: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                                block: int) -> None:
    """Launcher; same contract as ``reference.quantize_int4_blocks``, arguments validated."""
    rows, numel = values.shape
    if not rows or not numel:
        return
    _quantize_int4_kernel[(scales.shape[1], rows)](
        values, packed, scales, numel, values.stride(0), packed.stride(0), scales.stride(0),
        BLOCK=block, num_warps=NUM_WARPS, enable_fp_fusion=False,
    )


def dequantize_int4_blocks_triton(packed: torch.Tensor, scales: torch.Tensor, out: torch.Tensor,
                                  block: int) -> None:
    """Launcher; same contract as ``reference.dequantize_int4_blocks``, arguments validated."""
    rows, numel = out.shape
    if not rows or not numel:
        return
    _dequantize_int4_kernel[(scales.shape[1], rows)](
        packed, scales, out, numel, packed.stride(0), scales.stride(0), out.stride(0),
        OUT_DTYPE=TL_DTYPES[out.dtype], BLOCK=block, num_warps=NUM_WARPS, enable_fp_fusion=False,
    )
