"""The compiled Triton kernels on a real GPU against the reference (skipped loudly without CUDA
or compiled Triton, see tests/cuda_suite.py)."""

from __future__ import annotations

import pytest
import torch

from hf_zero import kernels
from hf_zero.kernels import dispatch
from hf_zero.kernels import reference
from tests.cuda_suite import require_cuda
from tests.cuda_suite import skip_loudly
from tests.kernels.helpers import STATE_TOL
from tests.kernels.helpers import AdamCase
from tests.kernels.helpers import adam_state
from tests.kernels.helpers import clone_state
from tests.kernels.helpers import run_adam

BF16 = torch.bfloat16
GIB = 1 << 30


@pytest.fixture(scope="module", autouse=True)
def _cuda_suite() -> None:
    require_cuda()
    if dispatch.INTERPRET:
        skip_loudly("TRITON_INTERPRET=1 is set, so CPU tensors go through the interpreter, not compiled kernels")
    if dispatch.TRITON_IMPORT_ERROR is not None:
        skip_loudly(f"compiled triton is not importable ({dispatch.TRITON_IMPORT_ERROR})")


def _cuda(state: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
    return {name: (t.cuda() if t is not None else None) for name, t in state.items()}


@pytest.mark.parametrize("numel", [1, 4097, 1 << 20])
@pytest.mark.parametrize("adamw", [True, False])
def test_adam_on_gpu_matches_reference(numel: int, adamw: bool) -> None:
    case = AdamCase(numel, BF16, BF16, 0.1, adamw, 10, 1024.0, 0.5)
    state = _cuda(adam_state(case))
    expected = clone_state(state)
    assert kernels.backend_for(state["master"]) == "triton"
    run_adam(kernels.fused_adam_, state, case)
    run_adam(reference.fused_adam_, expected, case)
    for name in ("master", "exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(state[name], expected[name], **STATE_TOL)
    assert torch.equal(state["out"], state["master"].to(BF16))


@pytest.mark.parametrize("chunks", [[5, 0, 12, 3], [16, 8, 4096]], ids=["uneven", "aligned"])
def test_pack_round_trip_on_gpu(chunks: list[int]) -> None:
    world_size = 4
    units = [torch.randn(c * world_size, device="cuda") for c in chunks]
    packed, expected = (torch.empty(sum(chunks) * world_size, device="cuda", dtype=BF16) for _ in range(2))
    kernels.pack_for_reduce_scatter(units, world_size, packed, scale=0.25)
    reference.pack_for_reduce_scatter(units, world_size, expected, scale=0.25)
    assert torch.equal(packed, expected)
    outs = [torch.empty(c * world_size, device="cuda", dtype=BF16) for c in chunks]
    kernels.unpack_after_all_gather(packed, world_size, outs)
    assert all(torch.equal(o, (u * 0.25).to(BF16)) for o, u in zip(outs, units))


def test_norm_on_gpu_matches_reference() -> None:
    tensors = [torch.randn(n, device="cuda").to(dtype) for n, dtype in [(1023, BF16), (1 << 20, torch.float32)]]
    found, sqnorm = kernels.nonfinite_and_sqnorm(tensors)
    expected_found, expected_sqnorm = reference.nonfinite_and_sqnorm(tensors)
    assert found.item() is expected_found.item() is False
    torch.testing.assert_close(sqnorm, expected_sqnorm, rtol=1e-5, atol=0.0)
    tensors[1][12345] = float("nan")
    assert kernels.nonfinite_and_sqnorm(tensors)[0].item() is True


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
def test_int8_blocks_on_gpu_match_reference_bit_for_bit(dtype: torch.dtype) -> None:
    values = torch.randn(4, (1 << 20) + 37, device="cuda").to(dtype)
    codes, expected_codes = (torch.empty(values.shape, dtype=torch.int8, device="cuda") for _ in range(2))
    scales, expected_scales = (torch.empty(4, (values.shape[1] + 511) // 512, device="cuda") for _ in range(2))
    kernels.quantize_int8_blocks(values, codes, scales, 512)
    reference.quantize_int8_blocks(values, expected_codes, expected_scales, 512)
    assert torch.equal(codes, expected_codes) and torch.equal(scales, expected_scales)
    out, expected = (torch.empty(values.shape, dtype=dtype, device="cuda") for _ in range(2))
    kernels.dequantize_int8_blocks(codes, scales, out, 512)
    reference.dequantize_int8_blocks(codes, scales, expected, 512)
    assert torch.equal(out, expected)


# Past 2**31 elements an int32 offset wraps: the elements after it would be read and written at
# the wrong place (or fault). Checked on windows at the start, across 2**31 and at the end, each
# against the reference run on a copy of the same window taken before the step.
HUGE_NUMEL = (1 << 31) + 4099
HUGE_WINDOWS = [(0, 4096), ((1 << 31) - 2048, (1 << 31) + 2048), (HUGE_NUMEL - 4096, HUGE_NUMEL)]
# fp32 master and moments, bf16 grad and out: 16 bytes an element, plus room for the fills.
HUGE_BYTES = HUGE_NUMEL * 16 + 2 * GIB


def test_adam_past_2_to_the_31_elements_matches_reference() -> None:
    free, total = torch.cuda.mem_get_info()
    if free < HUGE_BYTES:
        skip_loudly(f"the >2**31-element Adam needs {HUGE_BYTES / GIB:.0f} GiB of free GPU memory, "
                    f"{free / GIB:.0f} of {total / GIB:.0f} GiB are free")
    case = AdamCase(HUGE_NUMEL, BF16, BF16, 0.1, True, 10, 1024.0, 0.5)
    state = {"master": torch.randn(HUGE_NUMEL, device="cuda"),
             "grad": torch.randn(HUGE_NUMEL, device="cuda", dtype=BF16).mul_(case.grad_scale),
             "exp_avg": torch.randn(HUGE_NUMEL, device="cuda").mul_(0.1),
             "exp_avg_sq": torch.rand(HUGE_NUMEL, device="cuda").mul_(0.01),
             "out": torch.full((HUGE_NUMEL,), 7.0, device="cuda", dtype=BF16)}
    windows = [{name: t[lo:hi].clone() for name, t in state.items()} for lo, hi in HUGE_WINDOWS]
    assert kernels.backend_for(state["master"]) == "triton"
    run_adam(kernels.fused_adam_, state, case)
    torch.cuda.synchronize()
    for (lo, hi), expected in zip(HUGE_WINDOWS, windows, strict=True):
        run_adam(reference.fused_adam_, expected, case)
        for name in ("master", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state[name][lo:hi], expected[name], **STATE_TOL)
        assert torch.equal(state["out"][lo:hi], state["master"][lo:hi].to(BF16)), (lo, hi)
