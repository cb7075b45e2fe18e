"""pack_for_reduce_scatter / unpack_after_all_gather against a plain torch construction.

Units have deliberately uneven chunk lengths (and one empty unit); "aligned" lengths (multiples
of 8 elements) take the Triton kernels' ALIGNED variant, the others the general one.
"""

from __future__ import annotations

import pytest
import torch

from hf_zero import kernels
from hf_zero.kernels import dispatch
from hf_zero.kernels import reference
from tests.kernels.helpers import rank_major

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
WORLD_SIZES = [1, 2, 3, 8]
CHUNKS = {
    "uneven": [5, 1, 0, 12, 3],
    "aligned": [16, 8, 40],
    # One unit longer than a block per program, so the grid-stride loop turns several times.
    "long": [7, 3 * 2048 + 5],
}


def _units(chunks: list[int], world_size: int, dtypes: list[torch.dtype]) -> list[torch.Tensor]:
    return [torch.randn(chunk * world_size).to(dtypes[i % len(dtypes)]) for i, chunk in enumerate(chunks)]


def _ids(value: object) -> str:
    return str(value).removeprefix("torch.")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("layout", ["uneven", "aligned"])
@pytest.mark.parametrize(
    ("unit_dtypes", "out_dtype", "scale"),
    [([F32], F32, 1.0), ([F32], BF16, 1 / 3), ([BF16], BF16, 0.125), ([F32, BF16, F16], F32, 0.5), ([F16], F16, 1.0)],
    ids=["f32-f32", "f32-bf16-scaled", "bf16-bf16-scaled", "mixed-f32-scaled", "f16-f16"],
)
def test_pack_matches_plain_construction(
    world_size: int, layout: str, unit_dtypes: list[torch.dtype], out_dtype: torch.dtype, scale: float
) -> None:
    units = _units(CHUNKS[layout], world_size, unit_dtypes)
    out = torch.full((sum(u.numel() for u in units),), float("nan"), dtype=out_dtype)
    kernels.pack_for_reduce_scatter(units, world_size, out, scale=scale)
    # Scale in fp32, round once: what the kernels promise.
    expected = (rank_major(units, world_size) * scale).to(out_dtype)
    assert torch.equal(out, expected), f"max |diff| {(out.float() - expected.float()).abs().max()}"
    reference_out = torch.empty_like(out)
    reference.pack_for_reduce_scatter(units, world_size, reference_out, scale=scale)
    assert torch.equal(reference_out, expected), "the reference disagrees with the plain construction"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("layout", sorted(CHUNKS))
@pytest.mark.parametrize("dtype", [F32, BF16], ids=_ids)
def test_round_trip_is_exact(world_size: int, layout: str, dtype: torch.dtype) -> None:
    units = _units(CHUNKS[layout], world_size, [dtype])
    buffer = torch.empty(sum(u.numel() for u in units), dtype=dtype)
    kernels.pack_for_reduce_scatter(units, world_size, buffer)
    outs = [torch.full_like(u, float("nan")) for u in units]
    kernels.unpack_after_all_gather(buffer, world_size, outs)
    for index, (unit, out) in enumerate(zip(units, outs)):
        assert torch.equal(unit, out), f"unit {index} changed in the round trip"


@pytest.mark.parametrize("world_size", [2, 3])
def test_unpack_casts_into_each_unit_dtype(world_size: int) -> None:
    # An fp32 all-gather buffer unpacked into 16-bit compute copies of mixed dtypes.
    chunks = CHUNKS["uneven"]
    buffer = torch.randn(sum(chunks) * world_size)
    outs = [torch.empty(c * world_size, dtype=(BF16, F16)[i % 2]) for i, c in enumerate(chunks)]
    kernels.unpack_after_all_gather(buffer, world_size, outs)
    segments = buffer.view(world_size, -1).split(chunks, dim=1)
    for out, segment in zip(outs, segments):
        assert torch.equal(out, segment.reshape(-1).to(out.dtype))


def test_unit_not_divisible_by_world_size_is_refused() -> None:
    with pytest.raises(ValueError, match=r"grads\[1\] has 7 elements, not divisible by world_size=2"):
        kernels.pack_for_reduce_scatter([torch.zeros(4), torch.zeros(7)], 2, torch.zeros(11))


def test_buffer_of_the_wrong_length_is_refused() -> None:
    with pytest.raises(ValueError, match=r"buffer has 5 elements, expected 6"):
        kernels.unpack_after_all_gather(torch.zeros(5), 3, [torch.zeros(6)])


@pytest.mark.skipif(dispatch.TRITON_IMPORT_ERROR is not None, reason="triton is not importable")
def test_pointer_tables_are_kept_by_their_values() -> None:
    """[Note: pointer tables]: a table seen before is not copied to the device again; one with
    other values is a new table with those values."""
    from hf_zero.kernels.triton_common import pointer_table

    device = torch.device("cpu")
    first = pointer_table([[1, 2], [3, 4]], device)
    assert pointer_table([[1, 2], [3, 4]], device) is first
    other = pointer_table([[1, 2], [3, 5]], device)
    assert other is not first and other.tolist() == [[1, 2], [3, 5]] and first.tolist() == [[1, 2], [3, 4]]
