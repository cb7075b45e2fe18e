"""Blockwise int8 and int4 quantize / dequantize ([Note: blockwise int8], [Note: blockwise int4])
against the torch reference, bit for bit, and against the error bound the block size gives.

Rows are strided views of one wider buffer (how a gather's receive buffer holds every rank's
payload), lengths are odd so the last block is partial, and one block is all zeros.
"""

from __future__ import annotations

import math

import pytest
import torch

from hf_zero import kernels
from hf_zero.kernels import reference

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
SHAPES = [(1, 1), (1, 700), (3, 1029), (4, 2 * 512 + 37)]
BLOCKS = [64, 512]
BITS = [8, 4]
# bits: (quantize, dequantize, reference quantize, reference dequantize, largest code)
OPS = {
    8: (kernels.quantize_int8_blocks, kernels.dequantize_int8_blocks,
        reference.quantize_int8_blocks, reference.dequantize_int8_blocks, 127),
    4: (kernels.quantize_int4_blocks, kernels.dequantize_int4_blocks,
        reference.quantize_int4_blocks, reference.dequantize_int4_blocks, 7),
}


def _ids(value: object) -> str:
    return str(value).removeprefix("torch.")


def _values(rows: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Row-strided [rows, numel] values of mixed magnitudes, with the first block of row 0 zero."""
    wide = torch.randn(rows, numel + 13) * torch.logspace(-3, 2, rows).unsqueeze(1)
    values = wide.to(dtype)[:, 5:5 + numel]
    values[0, :64] = 0.0
    return values


def _outputs(rows: int, numel: int, block: int, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    width, dtype = (numel, torch.int8) if bits == 8 else (math.ceil(numel / 2), torch.uint8)
    codes = torch.full((rows, width + 3), 99, dtype=dtype)[:, :width]
    scales = torch.full((rows, math.ceil(numel / block) + 1), float("nan"))[:, 1:]
    return codes, scales


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=_ids)
def test_quantize_matches_reference_bit_for_bit(shape: tuple[int, int], block: int, dtype: torch.dtype,
                                                bits: int) -> None:
    quantize, _, quantize_reference, _, _ = OPS[bits]
    values = _values(*shape, dtype)
    codes, scales = _outputs(*shape, block, bits)
    quantize(values, codes, scales, block)
    want_codes, want_scales = _outputs(*shape, block, bits)
    quantize_reference(values, want_codes, want_scales, block)
    assert torch.equal(codes, want_codes), f"{(codes != want_codes).sum()} codes differ"
    assert torch.equal(scales, want_scales), f"max |scale diff| {(scales - want_scales).abs().max()}"


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=_ids)
def test_dequantize_matches_reference_and_the_bound(shape: tuple[int, int], block: int, dtype: torch.dtype,
                                                    bits: int) -> None:
    _, dequantize, quantize_reference, dequantize_reference, _ = OPS[bits]
    values = _values(*shape, F32)
    codes, scales = _outputs(*shape, block, bits)
    quantize_reference(values, codes, scales, block)
    out = torch.full((shape[0], shape[1] + 7), float("nan"), dtype=dtype)[:, 7:]
    dequantize(codes, scales, out, block)
    want = torch.empty(shape, dtype=dtype)
    dequantize_reference(codes, scales, want, block)
    assert torch.equal(out, want), f"max |diff| {(out.float() - want.float()).abs().max()}"
    # Half a step of the element's own block, plus the output dtype's own rounding.
    step = scales.repeat_interleave(block, dim=1)[:, :shape[1]]
    bound = step / 2 + values.abs() * torch.finfo(dtype).eps / 2
    error = (out.float() - values).abs()
    assert (error <= bound * (1 + 1e-6)).all(), f"worst error / bound {(error / bound.clamp_min(1e-30)).max()}"
    assert (out[values == 0] == 0).all(), "a zero must come back as zero"


def test_codes_use_the_whole_range_and_round_half_up() -> None:
    values = torch.tensor([[-127.0, -63.5, -0.5, 0.0, 0.5, 126.5, 127.0]])  # absmax 127: a step is 1
    codes, scales = _outputs(1, 7, 64)
    kernels.quantize_int8_blocks(values, codes, scales, 64)
    assert codes.tolist() == [[-127, -63, 0, 0, 1, 127, 127]], codes
    assert scales.item() == 1.0


def test_int4_codes_pack_two_a_byte_low_nibble_first() -> None:
    values = torch.tensor([[-7.0, -3.5, -0.5, 0.0, 0.5, 6.5, 7.0]])  # absmax 7: a step is 1
    packed, scales = _outputs(1, 7, 64, bits=4)
    kernels.quantize_int4_blocks(values, packed, scales, 64)
    nibbles = [[byte & 15, byte >> 4] for byte in packed[0].tolist()]
    assert [code - 8 for pair in nibbles for code in pair] == [-7, -3, 0, 0, 1, 7, 7, 0], packed
    assert scales.item() == 1.0


def test_bad_arguments_are_named() -> None:
    values = torch.randn(2, 10)
    codes, scales = _outputs(2, 10, 64)
    with pytest.raises(ValueError, match="power of two"):
        kernels.quantize_int8_blocks(values, codes, scales, 48)
    with pytest.raises(ValueError, match="one per block of 4"):
        kernels.quantize_int8_blocks(values, codes, scales, 4)
    with pytest.raises(TypeError, match="codes has dtype"):
        kernels.quantize_int8_blocks(values, codes.to(torch.int16), scales, 64)
    with pytest.raises(ValueError, match=r"expected \(2, 5\) \(4-bit codes"):
        kernels.quantize_int4_blocks(values, torch.zeros(2, 10, dtype=torch.uint8), scales, 64)
