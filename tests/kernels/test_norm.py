"""nonfinite_and_sqnorm: one inf or nan anywhere is found; the norm matches torch.linalg."""

from __future__ import annotations

import pytest
import torch

from hf_zero import kernels
from hf_zero.kernels import dispatch
from hf_zero.kernels import reference
from tests.kernels.helpers import NORM_TOL

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# (tensor index, element index) in a pair of tensors of 1023 and 4097 elements.
POSITIONS = {"first-start": (0, 0), "first-middle": (0, 511), "first-end": (0, 1022),
             "second-start": (1, 0), "second-middle": (1, 2048), "second-end": (1, 4096)}


def _ids(value: object) -> str:
    return str(value).removeprefix("torch.")


def _expected_sqnorm(tensors: list[torch.Tensor]) -> torch.Tensor:
    flat = torch.cat([t.float().reshape(-1) for t in tensors])
    return torch.linalg.vector_norm(flat, dtype=torch.float32).square()


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=_ids)
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")], ids=_ids)
@pytest.mark.parametrize("position", sorted(POSITIONS))
def test_finds_a_single_nonfinite_anywhere(dtype: torch.dtype, value: float, position: str) -> None:
    tensors = [torch.randn(1023).to(dtype), torch.randn(4097).to(dtype)]
    which, index = POSITIONS[position]
    tensors[which][index] = value
    found, sqnorm = kernels.nonfinite_and_sqnorm(tensors)
    assert found.item() is True, f"missed {value} at {position}"
    assert not torch.isfinite(sqnorm), "an inf or nan must also poison the norm"


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=_ids)
@pytest.mark.parametrize("numels", [[1], [7, 1023], [4097, 0, 65537], [2048, 16, 8]], ids=str)
def test_sqnorm_matches_torch_linalg(dtype: torch.dtype, numels: list[int]) -> None:
    tensors = [torch.randn(n).to(dtype) for n in numels]
    found, sqnorm = kernels.nonfinite_and_sqnorm(tensors)
    assert (found.dtype, found.shape, sqnorm.dtype, sqnorm.shape) == (torch.bool, (), F32, ())
    assert found.item() is False
    torch.testing.assert_close(sqnorm, _expected_sqnorm(tensors), **NORM_TOL)


def test_mixed_dtypes_are_summed_together() -> None:
    tensors = [torch.randn(300), torch.randn(5000).to(BF16), torch.randn(77).to(F16), torch.randn(9)]
    found, sqnorm = kernels.nonfinite_and_sqnorm(tensors)
    assert found.item() is False
    torch.testing.assert_close(sqnorm, _expected_sqnorm(tensors), **NORM_TOL)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy, in the interpreter
def test_large_finite_values_are_not_reported_as_nonfinite() -> None:
    # 1e20 squared overflows fp32: the norm is inf, but nothing in the tensors is.
    found, sqnorm = kernels.nonfinite_and_sqnorm([torch.full((16,), 1e20), torch.ones(3)])
    assert found.item() is False
    assert sqnorm.item() == float("inf")


def test_no_tensors_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one tensor"):
        kernels.nonfinite_and_sqnorm([])


@pytest.mark.skipif(dispatch.INTERPRET, reason="1e8 elements through Triton's interpreter take minutes")
def test_sqnorm_of_a_huge_shard_matches_fp64() -> None:
    # A flat fp32 shard of 1e8 gradients (a 100M-parameter model at world size 1), magnitudes
    # spread over orders like different layers' gradients: randn scaled per run of 1000 elements
    # by a log-normal factor. An fp32 running sum over it is ~2% low (see [Note: accurate norms]).
    numel, run = 100_000_000, 1000
    shard = torch.randn(numel)
    shard.view(-1, run).mul_(torch.randn(numel // run, 1).mul_(1.5).exp_().mul_(1e-3))
    expected = sum(torch.linalg.vector_norm(piece, dtype=torch.float64).square().item()
                   for piece in shard.split(1 << 22))
    for name, fn in (("dispatch", kernels.nonfinite_and_sqnorm), ("reference", reference.nonfinite_and_sqnorm)):
        found, sqnorm = fn([shard])
        assert found.item() is False and sqnorm.dtype == F32
        assert sqnorm.item() == pytest.approx(expected, rel=1e-6), name
    del shard
