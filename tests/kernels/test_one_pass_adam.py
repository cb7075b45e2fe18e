"""The one-pass host Adam ([Note: one pass on the host] in hf_zero/kernels/cpu_one_pass.py)
against kernels/reference.py, through ``kernels.fused_adam_`` with ``HF_ZERO_HOST_ADAM=one_pass``.

Two cases, two compiles (10-30 s each on a cold cache): the offloaded step's usual one (a bf16
gradient, loss scale and clip, AdamW, the bf16 copy) and the other arithmetic (an fp32 gradient,
Adam's L2 decay, an fp16 copy). The compiled code contracts no multiply-add where torch's eager CPU
kernels use fused ones (lerp, addcmul), so a moment near zero after cancellation differs by one
rounding of its operands, not of itself: the bound is fp32's rounding (2^-23) of each state's
largest element, times two; a dropped factor or term moves elements by 1e-4 and more.
"""

from __future__ import annotations

import pytest
import torch

from hf_zero import kernels
from hf_zero.kernels import cpu_one_pass, reference
from tests.kernels.helpers import AdamCase, adam_state, clone_state, run_adam

pytestmark = pytest.mark.skipif(kernels.backend_for(torch.zeros(1), "fused_adam_") != "torch-fused-cpu",
                                reason="the CPU backend only (the interpreter run steps CPU tensors in Triton)")

CASES = [
    AdamCase(65537, torch.bfloat16, torch.bfloat16, 0.1, True, 10, 1024.0, 0.5),
    AdamCase(4097, torch.float32, torch.float16, 0.1, False, 3, 1.0, 0.5),
]


def _close(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    bound = 2 * 2.0**-23 * float(want.abs().max())
    worst = float((got - want).abs().max())
    assert worst <= bound, f"{name}: off by {worst:.3g}, more than fp32's rounding of its scale ({bound:.3g})"


@pytest.mark.parametrize("case", CASES, ids=["bf16-grad-bf16-copy-adamw-scaled", "fp32-grad-fp16-copy-adam-l2"])
def test_one_pass_steps_as_the_reference(case: AdamCase, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_one_pass.HOST_ADAM_ENV, "one_pass")
    ran = []
    monkeypatch.setattr(cpu_one_pass, "adam_one_pass_", _recording(cpu_one_pass.adam_one_pass_, ran))
    state = adam_state(case)
    expected = clone_state(state)
    grad_before, master_before = state["grad"].clone(), state["master"].clone()
    run_adam(kernels.fused_adam_, state, case)
    run_adam(reference.fused_adam_, expected, case)
    assert ran == [True], "the one-pass kernel did not run"
    for name in ("master", "exp_avg", "exp_avg_sq"):
        _close(state[name], expected[name], name)
    assert (state["master"] - master_before).abs().max() > 1e-4  # the step changed the master by more than the bound above
    assert torch.equal(state["out"], state["master"].to(case.out_dtype)), "the copy is the new master, cast"
    assert torch.equal(state["grad"], grad_before), "the gradient is read only"


def test_the_choice_is_checked_and_auto_compiles_nothing_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_one_pass.HOST_ADAM_ENV, "fast")
    with pytest.raises(ValueError, match="expected one of auto, one_pass, chunked"):
        cpu_one_pass.wants_one_pass(1 << 24)
    monkeypatch.setenv(cpu_one_pass.HOST_ADAM_ENV, "auto")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not cpu_one_pass.wants_one_pass(1 << 24)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_one_pass.wants_one_pass(1 << 24) and not cpu_one_pass.wants_one_pass(1 << 10)
    monkeypatch.setenv(cpu_one_pass.HOST_ADAM_ENV, "chunked")
    assert not cpu_one_pass.wants_one_pass(1 << 24)


def _recording(fn, ran: list):  # noqa: ANN001, ANN202
    def recorded(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        ran.append(fn(*args, **kwargs))
        return ran[-1]
    return recorded
