"""fp16 loss scaling: scale sequences hand-derived from DeepSpeed's DynamicLossScaler.update_scale.

Rule (deepspeed/runtime/fp16/loss_scaler.py): on overflow, halve if delayed_shift == 1 or
cur_hysteresis == 1 (raise if already at min), else spend one hysteresis; on a clean step grow when
stable = cur_iter - last_overflow_iter - 1 is > 0 and a multiple of scale_window.
"""

from __future__ import annotations

import json

import pytest
import torch

from hf_zero.engine.optim.loss_scaler import DynamicLossScaler, LossScaler, build_loss_scaler

O, C = True, False  # overflow, clean


def scales_after(scaler: DynamicLossScaler, pattern: list[bool]) -> list[float]:
    out = []
    for overflow in pattern:
        scaler.update_scale(overflow)
        out.append(scaler.loss_scale)
    return out


def test_window_growth_is_on_window_plus_one_clean_step() -> None:
    # From the start, last_overflow_iter = -1: stable at cur_iter i is i, so growth at i = 2, 4.
    scaler = DynamicLossScaler(init_scale=1024.0, scale_window=2, min_scale=1.0, delayed_shift=1)
    assert scales_after(scaler, [C, C, C, C, C]) == [1024, 1024, 2048, 2048, 4096]
    # Overflow at i = 5 halves; stable restarts, growth again at i = 8 (third clean step).
    assert scales_after(scaler, [O, C, C, C]) == [2048, 2048, 2048, 4096]
    assert scaler.skipped_steps == 1
    assert scaler.cur_iter == 9
    assert scaler.last_overflow_iter == 5


def test_default_window_first_growth_at_step_1001() -> None:
    scaler = DynamicLossScaler()  # DeepSpeed fp16 config defaults: 2**16, window 1000, hysteresis 2
    seq = scales_after(scaler, [C] * 1001)
    assert seq[999] == 2.0**16
    assert seq[1000] == 2.0**17


def test_hysteresis_delays_the_first_cut_and_is_not_refilled_by_clean_steps() -> None:
    scaler = DynamicLossScaler(init_scale=1024.0, scale_window=1000, min_scale=1.0, delayed_shift=2)
    # First overflow spends hysteresis (2 -> 1), then every overflow halves.
    assert scales_after(scaler, [O, O, O]) == [1024, 512, 256]
    assert scaler.cur_hysteresis == 1
    assert scaler.skipped_steps == 3

    scaler = DynamicLossScaler(init_scale=1024.0, scale_window=1000, min_scale=1.0, delayed_shift=2)
    # Clean steps between overflows do not refill it (consecutive_hysteresis=False).
    assert scales_after(scaler, [O, C, C, C, O]) == [1024, 1024, 1024, 1024, 512]


def test_hysteresis_is_refilled_when_the_scale_grows() -> None:
    scaler = DynamicLossScaler(init_scale=1024.0, scale_window=2, min_scale=1.0, delayed_shift=2)
    # O@0 (hyst 1), C@1, C@2, C@3 (stable 2 -> grow, hyst back to 2), O@4 spends hysteresis only.
    assert scales_after(scaler, [O, C, C, C, O]) == [1024, 1024, 1024, 2048, 2048]
    assert scaler.cur_hysteresis == 1


def test_consecutive_hysteresis_refills_on_every_clean_step() -> None:
    scaler = DynamicLossScaler(init_scale=1024.0, scale_window=1000, min_scale=1.0, delayed_shift=2,
                               consecutive_hysteresis=True)
    assert scales_after(scaler, [O, C, O, C, O]) == [1024] * 5
    assert scales_after(scaler, [O]) == [512]  # two overflows in a row still cut
    assert scaler.skipped_steps == 4


def test_scale_is_floored_at_min_then_raises() -> None:
    scaler = DynamicLossScaler(init_scale=3.0, scale_window=1000, min_scale=2.0, delayed_shift=1)
    assert scales_after(scaler, [O]) == [2.0]  # max(3 / 2, 2)
    with pytest.raises(RuntimeError) as info:
        scaler.update_scale(True)
    message = str(info.value)
    assert "stuck at the minimum" in message
    assert "optimizer step 2" in message and "2 of 2 steps skipped" in message
    assert "min_loss_scale=2" in message
    assert "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run." in message
    for advice in ("bf16", "learning rate", "gradient clipping", "NOT a fix", "inf/nan"):
        assert advice in message
    # The failing call leaves the state as it was.
    assert (scaler.cur_iter, scaler.skipped_steps, scaler.loss_scale) == (1, 1, 2.0)


def test_at_min_hysteresis_is_spent_before_raising() -> None:
    scaler = DynamicLossScaler(init_scale=1.0, scale_window=1000, min_scale=1.0, delayed_shift=2)
    assert scales_after(scaler, [O]) == [1.0]
    with pytest.raises(RuntimeError, match="stuck at the minimum"):
        scaler.update_scale(True)


def test_no_raise_at_min_when_disabled() -> None:
    scaler = DynamicLossScaler(init_scale=2.0, scale_window=2, min_scale=1.0, delayed_shift=1,
                               raise_error_at_min_scale=False)
    assert scales_after(scaler, [O, O, O, C, C, C]) == [1, 1, 1, 1, 1, 2]
    assert scaler.skipped_steps == 3


def test_state_dict_round_trip_resumes_the_same_sequence() -> None:
    kwargs = dict(init_scale=2.0**10, scale_window=3, min_scale=1.0, delayed_shift=2)
    pattern = [O, C, O, O, C, C, C, C, O, C, C, C, C, O, O, C]
    reference = scales_after(DynamicLossScaler(**kwargs), pattern + pattern)

    first = DynamicLossScaler(**kwargs)
    scales_after(first, pattern)
    saved = json.loads(json.dumps(first.state_dict()))
    assert saved == {"dynamic": True, "cur_scale": first.loss_scale, "cur_iter": 16,
                     "last_overflow_iter": first.last_overflow_iter, "cur_hysteresis": first.cur_hysteresis,
                     "skipped_steps": 6}
    resumed = DynamicLossScaler(**kwargs)
    resumed.load_state_dict(saved)
    assert scales_after(resumed, pattern) == reference[len(pattern):]
    assert resumed.skipped_steps == 12


def test_dynamic_load_rejects_static_state() -> None:
    with pytest.raises(ValueError, match="saved with a static fp16.loss_scale"):
        DynamicLossScaler().load_state_dict(LossScaler(128.0).state_dict())


def test_static_scaler() -> None:
    scaler = LossScaler(128.0)
    assert not scaler.dynamic
    assert scaler.scale_loss(torch.tensor(0.5)).item() == 64.0
    scaler.update_scale(True)
    scaler.update_scale(False)
    assert scaler.loss_scale == 128.0 and scaler.skipped_steps == 1
    restored = LossScaler(128.0)
    restored.load_state_dict(json.loads(json.dumps(scaler.state_dict())))
    assert restored.skipped_steps == 1


def test_build_loss_scaler() -> None:
    assert build_loss_scaler(False, 0, 16, 1000, 2, False, 1) is None
    static = build_loss_scaler(True, 256, 16, 1000, 2, False, 1)
    assert type(static) is LossScaler and static.loss_scale == 256.0
    dynamic = build_loss_scaler(True, 0, 16, 500, 3, True, 2)
    assert isinstance(dynamic, DynamicLossScaler)
    assert (dynamic.loss_scale, dynamic.scale_window, dynamic.delayed_shift, dynamic.cur_hysteresis,
            dynamic.consecutive_hysteresis, dynamic.min_scale, dynamic.scale_factor) == (
        65536.0, 500, 3, 3, True, 2.0, 2.0)


@pytest.mark.parametrize(
    "args, match",
    [
        ((True, -1, 16, 1000, 2, False, 1), "fp16.loss_scale must be 0"),
        ((True, 0, 16, 1000, 2, False, 0), r"min_scale \(fp16.min_loss_scale\) must be a finite number > 0"),
        ((True, 0, 16, 1000, 0, False, 1), r"delayed_shift \(fp16.hysteresis\) must be an integer >= 1"),
        ((True, 0, 16, 0, 2, False, 1), r"scale_window \(fp16.loss_scale_window\) must be an integer >= 1"),
        ((True, 0, 16.5, 1000, 2, False, 1), "fp16.initial_scale_power must be an integer"),
        ((True, 0, 5000, 1000, 2, False, 1), "outside float range"),
        ((True, 0, 0, 1000, 2, False, 4), r"init_scale \(1\) is below min_scale \(4\)"),
        ((True, 0, 16, 1000, 2, "yes", 1), "consecutive_hysteresis"),
    ],
)
def test_build_loss_scaler_validation(args, match) -> None:
    with pytest.raises(ValueError, match=match):
        build_loss_scaler(*args)


# [Note: the loss scale on the device]: the device tensors follow the host rule step for step,
# for every knob the rule has, over patterns that reach the minimum, spend and refill the
# hysteresis and grow.
DEVICE_CASES = [
    dict(init_scale=1024.0, scale_window=2, min_scale=1.0, delayed_shift=1, raise_error_at_min_scale=False),
    dict(init_scale=8.0, scale_window=3, min_scale=2.0, delayed_shift=2, raise_error_at_min_scale=False),
    dict(init_scale=64.0, scale_window=2, min_scale=1.0, delayed_shift=3, consecutive_hysteresis=True),
    dict(init_scale=16.0, scale_window=1, min_scale=4.0, delayed_shift=2, raise_error_at_min_scale=False),
]


@pytest.mark.parametrize("knobs", DEVICE_CASES, ids=lambda k: "-".join(f"{v}" for v in k.values()))
def test_device_scale_follows_the_host_rule(knobs: dict) -> None:
    generator = torch.Generator().manual_seed(0)
    pattern = (torch.rand(60, generator=generator) < 0.3).tolist() + [C] * 8 + [O] * 6
    scaler = DynamicLossScaler(**knobs)
    device = torch.device("cpu")
    for step, overflow in enumerate(pattern):
        scaler.update_on_device(torch.tensor(overflow), device)
        scaler.update_scale(overflow)
        state = scaler._device_state(device)
        got = (state["scale"].item(), state["hysteresis"].item(), state["last_overflow_iter"].item())
        assert got == (scaler.cur_scale, scaler.cur_hysteresis, scaler.last_overflow_iter), f"step {step}"


def test_device_scale_is_rebuilt_after_a_load() -> None:
    scaler = DynamicLossScaler(init_scale=1024.0, scale_window=2)
    assert scaler.device_scale(torch.device("cpu")).item() == 1024.0
    scaler.load_state_dict({"cur_scale": 32.0, "cur_iter": 5, "last_overflow_iter": 4, "cur_hysteresis": 1})
    assert scaler.device_scale(torch.device("cpu")).item() == 32.0
    static = LossScaler(128.0)
    static.update_on_device(torch.tensor(True), torch.device("cpu"))
    assert static.device_scale(torch.device("cpu")).item() == 128.0
