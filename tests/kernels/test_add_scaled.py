"""add_scaled_: a reduced gradient part into an fp32 gradient shard, ``dst += alpha * src``. On
the CPU a 16-bit part is converted a chunk at a time ([Note: landing 16-bit gradients on the
host] in hf_zero.kernels.cpu); the values are exactly those of torch's mixed-dtype add, over
sizes that end inside a chunk, and into a zeroed shard (``dst_is_zero``) those of adding into
zeros."""

from __future__ import annotations

import pytest
import torch

from hf_zero import kernels
from hf_zero.kernels.cpu import LAND_CHUNK_NUMEL

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
SIZES = (1, 1000, LAND_CHUNK_NUMEL, 2 * LAND_CHUNK_NUMEL + 17)


def _ids(value: object) -> str:
    return str(value).removeprefix("torch.")


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=_ids)
@pytest.mark.parametrize("alpha", [1.0, 0.125, 1 / 3])
@pytest.mark.parametrize("numel", SIZES)
def test_adds_as_torch_adds(dtype: torch.dtype, alpha: float, numel: int) -> None:
    generator = torch.Generator().manual_seed(numel)
    src = torch.randn(numel, generator=generator).to(dtype)
    start = torch.randn(numel, generator=generator)
    expected = start.clone().add_(src, alpha=alpha)
    dst = start.clone()
    kernels.add_scaled_(dst, src, alpha)
    assert torch.equal(dst, expected)


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=_ids)
@pytest.mark.parametrize("alpha", [1.0, 0.125, 1 / 3])
@pytest.mark.parametrize("numel", SIZES)
def test_into_zeros_it_gives_the_same_values(dtype: torch.dtype, alpha: float, numel: int) -> None:
    src = torch.randn(numel, generator=torch.Generator().manual_seed(numel)).to(dtype)
    expected = torch.zeros(numel).add_(src, alpha=alpha)
    # Large parts are copied and scaled over the zeros; parts below LAND_DIRECT_NUMEL are added.
    dst = torch.zeros(numel)
    kernels.add_scaled_(dst, src, alpha, dst_is_zero=True)
    assert torch.equal(dst, expected)


def test_a_shaped_part_lands_in_the_flat_shard() -> None:
    src = torch.randn(3, 5).to(BF16)
    dst = torch.ones(15)
    kernels.add_scaled_(dst, src, 0.5)
    assert torch.equal(dst, torch.ones(15).add_(src.reshape(-1), alpha=0.5))
