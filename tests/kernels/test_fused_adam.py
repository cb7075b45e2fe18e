"""fused_adam_ against kernels/reference.py (one step) and against torch.optim (ten steps).

Runs on the torch fused CPU path here and on the Triton kernel in the interpreter run (see
[Note: two runs] in conftest). The full grid runs at small sizes; 4097 and 65537 (several
blocks, a ragged tail) take a slice, because the interpreter spends ~0.2 s per call at 65537.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch

from hf_zero import kernels
from hf_zero.kernels import reference
from tests.kernels.helpers import LR
from tests.kernels.helpers import OPTIM_TOL
from tests.kernels.helpers import STATE_TOL
from tests.kernels.helpers import AdamCase
from tests.kernels.helpers import adam_state
from tests.kernels.helpers import clone_state
from tests.kernels.helpers import run_adam

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
SCALINGS = [(1.0, 1.0), (1024.0, 0.5)]  # (grad_scale, clip_coef): plain, and unscale + clip

SMALL_GRID = [
    AdamCase(numel, grad_dtype, out_dtype, weight_decay, adamw, step, grad_scale, clip_coef)
    for numel, grad_dtype, out_dtype, weight_decay, adamw, step, (grad_scale, clip_coef) in itertools.product(
        (1, 7, 1023), (F32, BF16, F16), (None, BF16, F16), (0.0, 0.1), (True, False), (1, 10), SCALINGS
    )
]
LARGE_SLICE = [
    # 4097: every grad x out dtype pair, with decay, unscale and clip; adamw and step alternate.
    *(AdamCase(4097, g, o, 0.1, i % 2 == 0, 10 if i % 3 else 1, 1024.0, 0.5)
      for i, (g, o) in enumerate(itertools.product((F32, BF16, F16), (None, BF16, F16)))),
    AdamCase(65537, F32, None, 0.1, True, 10, 1024.0, 0.5),
    AdamCase(65537, BF16, BF16, 0.1, False, 10, 1024.0, 0.5),
    AdamCase(65537, F16, F16, 0.0, True, 1, 1024.0, 0.25),
    AdamCase(65537, F32, BF16, 0.1, False, 1),
]


def _case_id(case: AdamCase) -> str:
    out = str(case.out_dtype).removeprefix("torch.") if case.out_dtype else "none"
    return (f"n{case.numel}-g{str(case.grad_dtype).removeprefix('torch.')}-out_{out}-wd{case.weight_decay}"
            f"-{'adamw' if case.adamw else 'adam'}-s{case.step}-gs{case.grad_scale:g}-c{case.clip_coef:g}")


def _check_one_step(case: AdamCase) -> None:
    state = adam_state(case)
    expected = clone_state(state)
    grad_before = state["grad"].clone()
    run_adam(kernels.fused_adam_, state, case)
    run_adam(reference.fused_adam_, expected, case)
    for name in ("master", "exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(state[name], expected[name], **STATE_TOL, msg=lambda m: f"{name}: {m}")
    assert torch.equal(state["grad"], grad_before), "fused_adam_ must not modify grad"
    if case.out_dtype is not None:
        # The compute copy is the updated master rounded once, to nearest even, bit for bit.
        assert torch.equal(state["out"], state["master"].to(case.out_dtype)), "out != master.to(out.dtype)"


@pytest.mark.parametrize("case", SMALL_GRID, ids=_case_id)
def test_one_step_matches_reference_small(case: AdamCase) -> None:
    _check_one_step(case)


@pytest.mark.parametrize("case", LARGE_SLICE, ids=_case_id)
def test_one_step_matches_reference_large(case: AdamCase) -> None:
    _check_one_step(case)


@pytest.mark.parametrize("grad_dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
def test_ten_steps_match_torch_optim(adamw: bool, grad_dtype: torch.dtype) -> None:
    numel, grad_scale, clip_coef = 4097, 1024.0, 0.5
    master = torch.randn(numel)
    exp_avg, exp_avg_sq = torch.zeros(numel), torch.zeros(numel)
    param = torch.nn.Parameter(master.clone())
    optim_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    optim = optim_cls([param], lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, foreach=False)
    for step in range(1, 11):
        grad = (torch.randn(numel) * grad_scale).to(grad_dtype)
        kernels.fused_adam_(master, grad, exp_avg, exp_avg_sq, lr=LR, beta1=0.9, beta2=0.999, eps=1e-8,
                            weight_decay=0.1, step=step, adamw=adamw, grad_scale=grad_scale, clip_coef=clip_coef)
        param.grad = grad.float() / grad_scale * clip_coef
        optim.step()
    state = optim.state[param]
    torch.testing.assert_close(master, param.detach(), **OPTIM_TOL)
    torch.testing.assert_close(exp_avg, state["exp_avg"], **OPTIM_TOL)
    torch.testing.assert_close(exp_avg_sq, state["exp_avg_sq"], **OPTIM_TOL)


# [Note: step factors]: the scale and the coefficient as a device tensor give what the floats
# give, bit for bit, on every backend (the reference, and this run's: torch's fused CPU kernel or
# the Triton kernel in the interpreter run); a non-zero skip changes nothing at all.
FACTOR_CASES = [AdamCase(4097, BF16, BF16, 0.1, True, 3, 1024.0, 0.5), AdamCase(1023, F32, None, 0.1, False, 1, 1.0, 0.25),
                AdamCase(4097, F16, F16, 0.0, True, 7, 8.0, 1.0)]


@pytest.mark.parametrize("case", FACTOR_CASES, ids=_case_id)
@pytest.mark.parametrize("impl", [kernels.fused_adam_, reference.fused_adam_], ids=["dispatch", "reference"])
def test_device_factors_step_as_the_floats_do(case: AdamCase, impl: Callable[..., None]) -> None:
    state = adam_state(case)
    expected = clone_state(state)
    run_adam(impl, expected, case)
    factors = torch.tensor([case.grad_scale, case.clip_coef, 0.0])
    hparams = {**case.hparams(), "grad_scale": 1.0, "clip_coef": 1.0}
    impl(state["master"], state["grad"], state["exp_avg"], state["exp_avg_sq"], out=state["out"],
         factors=factors, **hparams)
    for name in ("master", "exp_avg", "exp_avg_sq", "out"):
        if state[name] is not None:
            assert torch.equal(state[name], expected[name]), f"{name} differs with device factors"


@pytest.mark.parametrize("case", FACTOR_CASES, ids=_case_id)
@pytest.mark.parametrize("impl", [kernels.fused_adam_, reference.fused_adam_], ids=["dispatch", "reference"])
def test_device_skip_flag_changes_nothing(case: AdamCase, impl: Callable[..., None]) -> None:
    state = adam_state(case)
    state["grad"][5] = float("inf")  # what a skipped step's gradients look like
    before = clone_state(state)
    factors = torch.tensor([case.grad_scale, 0.0, 1.0])
    hparams = {**case.hparams(), "grad_scale": 1.0, "clip_coef": 1.0}
    impl(state["master"], state["grad"], state["exp_avg"], state["exp_avg_sq"], out=state["out"],
         factors=factors, **hparams)
    for name, tensor in state.items():
        if tensor is not None:
            assert torch.equal(tensor, before[name]), f"a skipped step changed {name}"


def test_factors_and_floats_together_are_refused() -> None:
    tensors = _tensors()
    with pytest.raises(ValueError, match=r"either as floats or in factors, not both"):
        kernels.fused_adam_(*tensors, lr=LR, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1,
                            clip_coef=0.5, factors=torch.tensor([1.0, 1.0, 0.0]))
    with pytest.raises(ValueError, match=r"factors must be 3 contiguous fp32 elements"):
        kernels.fused_adam_(*tensors, lr=LR, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1,
                            factors=torch.tensor([1.0, 0.0]))


def test_empty_shard_is_a_no_op() -> None:
    case = AdamCase(0, BF16, BF16, 0.1, True, 3, 2.0, 0.5)
    state = adam_state(case)
    run_adam(kernels.fused_adam_, state, case)
    assert state["master"].numel() == 0


@pytest.mark.skipif(kernels.backend_for(torch.zeros(1)) != "torch-fused-cpu", reason="tests the CPU chunking")
def test_cpu_path_crosses_chunks() -> None:
    # Larger than two CPU chunks, with a ragged last chunk that uses a slice of the scratch.
    numel = 2 * kernels.cpu.CPU_CHUNK_NUMEL + 3
    for case in (AdamCase(numel, BF16, BF16, 0.1, True, 5, 1024.0, 0.5), AdamCase(numel, F32, F16, 0.1, False, 5)):
        _check_one_step(case)


def _tensors(numel: int = 4) -> list[torch.Tensor]:
    return [torch.zeros(numel) for _ in range(4)]


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (lambda t, h: t.__setitem__(0, t[0].half()), TypeError, r"master has dtype torch.float16, expected one of"),
        (lambda t, h: t.__setitem__(1, t[1].double()), TypeError, r"grad has dtype torch.float64"),
        (lambda t, h: t.__setitem__(2, torch.zeros(5)), ValueError, r"exp_avg has 5 elements, expected 4"),
        (lambda t, h: t.__setitem__(3, torch.zeros(8)[::2]), ValueError, r"exp_avg_sq must be contiguous"),
        (lambda t, h: h.update(step=0), ValueError, r"step must be a python int >= 1"),
        (lambda t, h: h.update(step=2.0), ValueError, r"step must be a python int >= 1"),
        (lambda t, h: h.update(grad_scale=0.0), ValueError, r"grad_scale must be a finite number > 0"),
        (lambda t, h: h.update(beta2=1.0), ValueError, r"beta2 must be in \[0, 1\)"),
    ],
    ids=["master-fp16", "grad-fp64", "numel", "strided", "step0", "float-step", "scale0", "beta2"],
)
def test_bad_arguments_say_what_was_expected(
    change: Callable[[list[torch.Tensor], dict[str, object]], None], error: type[Exception], message: str
) -> None:
    tensors = _tensors()
    hparams = dict(lr=LR, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
    change(tensors, hparams)
    with pytest.raises(error, match=message):
        kernels.fused_adam_(*tensors, **hparams)
