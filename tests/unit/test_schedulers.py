"""DeepSpeed warmup schedulers: values hand-computed from deepspeed/runtime/lr_schedules.py.

Notation as in the module docstring: t = last_batch_iteration, W = max(2, warmup_num_steps),
T = total_num_steps. Expected numbers are written out as decimals so a change of formula shows
up as a changed number, not as a changed reference implementation.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from hf_zero.engine.optim.schedulers import (
    SUPPORTED_SCHEDULERS,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)

REL = 1e-12
LOG10_2 = 0.30102999566398120  # ln 2 / ln 10
LOG10_5 = 0.69897000433601886  # ln 5 / ln 10


def make_optimizer(*lrs: float) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(3))], "lr": lr} for lr in lrs]
    return torch.optim.SGD(groups, lr=lrs[0])


def lr_at(scheduler, t: int) -> list[float]:
    scheduler.step(t)
    return [group["lr"] for group in scheduler.optimizer.param_groups]


def lr_sequence(scheduler, num_steps: int) -> list[list[float]]:
    out = []
    for _ in range(num_steps):
        scheduler.step()
        out.append(scheduler.get_last_lr())
    return out


# ----------------------------------------------------------------------------- WarmupLR


def test_warmup_lr_log_values() -> None:
    # log warmup: lr(t) = min + (max - min) * ln(t + 1) / ln(W), W = 10.
    opt = make_optimizer(0.5)
    sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=0.1, warmup_num_steps=10)
    assert opt.param_groups[0]["lr"] == 0.0  # written at construction: lr(-1) = min_lr
    assert sched.get_last_lr() == [0.0]
    assert lr_at(sched, 0)[0] == 0.0  # ln(1) = 0: the second optimizer step also runs at min_lr
    assert lr_at(sched, 1)[0] == pytest.approx(0.1 * LOG10_2, rel=REL)
    assert lr_at(sched, 4)[0] == pytest.approx(0.1 * LOG10_5, rel=REL)
    assert lr_at(sched, 9)[0] == pytest.approx(0.1, rel=REL)  # log reaches max at t = W - 1
    assert lr_at(sched, 10)[0] == 0.1
    assert lr_at(sched, 10_000)[0] == 0.1


def test_warmup_lr_linear_values_with_nonzero_min() -> None:
    # linear: lr(t) = 0.01 + 0.09 * t / 10
    opt = make_optimizer(0.5)
    sched = WarmupLR(opt, warmup_min_lr=0.01, warmup_max_lr=0.1, warmup_num_steps=10, warmup_type="linear")
    assert opt.param_groups[0]["lr"] == 0.01
    assert lr_at(sched, 0)[0] == pytest.approx(0.01, rel=REL)
    assert lr_at(sched, 1)[0] == pytest.approx(0.019, rel=REL)
    assert lr_at(sched, 5)[0] == pytest.approx(0.055, rel=REL)
    assert lr_at(sched, 9)[0] == pytest.approx(0.091, rel=REL)  # linear is still below max at W - 1
    assert lr_at(sched, 10)[0] == pytest.approx(0.1, rel=REL)


def test_step_without_argument_counts_from_minus_one() -> None:
    opt = make_optimizer(0.5)
    sched = WarmupLR(opt, warmup_max_lr=0.1, warmup_num_steps=10, warmup_type="linear")
    seq = lr_sequence(sched, 4)
    assert [lrs[0] for lrs in seq] == pytest.approx([0.0, 0.01, 0.02, 0.03], rel=REL)
    assert sched.last_batch_iteration == 3
    assert sched.state_dict() == {"last_batch_iteration": 3}


def test_warmup_num_steps_one_is_treated_as_two() -> None:
    # DeepSpeed: W = max(2, warmup_num_steps).
    sched = WarmupLR(make_optimizer(0.5), warmup_max_lr=0.1, warmup_num_steps=1, warmup_type="linear")
    assert sched.warmup_num_steps == 2
    assert lr_at(sched, 1)[0] == pytest.approx(0.05, rel=REL)
    assert lr_at(sched, 2)[0] == pytest.approx(0.1, rel=REL)
    log_sched = WarmupLR(make_optimizer(0.5), warmup_max_lr=0.1, warmup_num_steps=1)
    assert lr_at(log_sched, 0)[0] == 0.0
    assert lr_at(log_sched, 1)[0] == pytest.approx(0.1, rel=REL)  # ln 2 / ln 2


def test_warmup_lr_max_defaults_to_each_group_lr() -> None:
    opt = make_optimizer(0.1, 0.2)
    sched = WarmupLR(opt, warmup_num_steps=10, warmup_type="linear")
    assert sched.max_lrs == [0.1, 0.2]
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.0]
    assert lr_at(sched, 5) == pytest.approx([0.05, 0.1], rel=REL)
    assert lr_at(sched, 10) == pytest.approx([0.1, 0.2], rel=REL)


def test_warmup_lr_per_group_lists() -> None:
    opt = make_optimizer(1.0, 1.0)
    sched = WarmupLR(opt, warmup_min_lr=[0.0, 0.01], warmup_max_lr=(0.1, 0.02), warmup_num_steps=10,
                     warmup_type="linear")
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.01]
    assert lr_at(sched, 5) == pytest.approx([0.05, 0.015], rel=REL)
    with pytest.raises(ValueError, match="warmup_max_lr has 3 values but the optimizer has 2 param groups"):
        WarmupLR(make_optimizer(1.0, 1.0), warmup_max_lr=[0.1, 0.2, 0.3])


def test_tensor_lr_stays_a_tensor() -> None:
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([param], lr=torch.tensor(0.5))
    sched = WarmupLR(opt, warmup_max_lr=0.1, warmup_num_steps=10, warmup_type="linear")
    sched.step(5)
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    assert opt.param_groups[0]["lr"].item() == pytest.approx(0.05)
    assert sched.get_last_lr() == pytest.approx([0.05], rel=REL)


# ----------------------------------------------------------------------------- WarmupDecayLR


def test_warmup_decay_lr_linear_decay_to_min() -> None:
    # t >= W: lr = min + (max - min) * max(0, (T - t) / (T - W)); T = 20, W = 10.
    opt = make_optimizer(0.5)
    sched = WarmupDecayLR(opt, total_num_steps=20, warmup_min_lr=0.01, warmup_max_lr=0.1, warmup_num_steps=10,
                          warmup_type="linear")
    assert opt.param_groups[0]["lr"] == 0.01
    assert lr_at(sched, 5)[0] == pytest.approx(0.055, rel=REL)
    assert lr_at(sched, 10)[0] == pytest.approx(0.1, rel=REL)  # peak exactly at t = W
    assert lr_at(sched, 15)[0] == pytest.approx(0.055, rel=REL)
    assert lr_at(sched, 18)[0] == pytest.approx(0.028, rel=REL)
    assert lr_at(sched, 20)[0] == pytest.approx(0.01, rel=REL)  # decay ends at min_lr
    assert lr_at(sched, 30)[0] == pytest.approx(0.01, rel=REL)  # and stays there


def test_warmup_decay_lr_log_warmup_and_default_max() -> None:
    # warmup_max_lr defaults to 1e-3 for WarmupDecayLR (not to the optimizer's lr).
    sched = WarmupDecayLR(make_optimizer(0.5), total_num_steps=110, warmup_num_steps=10)
    assert sched.max_lrs == [0.001]
    assert lr_at(sched, 1)[0] == pytest.approx(0.001 * LOG10_2, rel=REL)
    assert lr_at(sched, 60)[0] == pytest.approx(0.0005, rel=REL)  # (110 - 60) / 100


def test_warmup_decay_total_below_warmup_warns_and_floors() -> None:
    with pytest.warns(UserWarning, match=r"total_num_steps \(5\) is less than warmup_num_steps \(10"):
        sched = WarmupDecayLR(make_optimizer(0.5), total_num_steps=5, warmup_max_lr=0.1, warmup_num_steps=10,
                              warmup_type="linear")
    assert lr_at(sched, 9)[0] == pytest.approx(0.09, rel=REL)
    assert lr_at(sched, 10)[0] == 0.0  # max(0, (5 - 10) / max(1, 5 - 10))



def test_warning_names_the_raised_warmup_of_one() -> None:
    # A one-step run with warmup_num_steps 1: the warmup is 2 steps (DeepSpeed's minimum), and the
    # warning says so instead of "1 is less than 1".
    with pytest.warns(UserWarning, match=r"total_num_steps \(1\) is less than the warmup's 2 steps "
                                         r"\(warmup_num_steps 1, raised to DeepSpeed's minimum of 2\)"):
        WarmupCosineLR(make_optimizer(0.5), total_num_steps=1, warmup_num_steps=1, warmup_type="linear")

# ----------------------------------------------------------------------------- WarmupCosineLR


def test_warmup_cosine_values() -> None:
    # base lr 0.1, T = 20, W = 10, linear, warmup_min_ratio 0.1, cos_min_ratio 0.01.
    opt = make_optimizer(0.1)
    sched = WarmupCosineLR(opt, total_num_steps=20, warmup_min_ratio=0.1, warmup_num_steps=10,
                           cos_min_ratio=0.01, warmup_type="linear")
    assert opt.param_groups[0]["lr"] == 0.0  # lr(-1) is 0 whatever warmup_min_ratio is
    assert lr_at(sched, 0)[0] == pytest.approx(0.01, rel=REL)  # 0.1 * 0.1
    assert lr_at(sched, 5)[0] == pytest.approx(0.055, rel=REL)  # 0.1 * (0.1 + 0.5 * 0.9)
    assert lr_at(sched, 9)[0] == pytest.approx(0.091, rel=REL)  # never exactly 0.1 under linear
    # t = 10: p = (10 - 10 + 1) / 10 = 0.1, (1 + cos(0.1 pi)) / 2 = 0.97552825814757682
    assert lr_at(sched, 10)[0] == pytest.approx(0.1 * (0.01 + 0.99 * 0.97552825814757682), rel=REL)
    assert lr_at(sched, 14)[0] == pytest.approx(0.0505, rel=REL)  # p = 0.5: 0.01 + 0.99 * 0.5
    assert lr_at(sched, 19)[0] == pytest.approx(0.001, rel=REL)  # p = 1: cos_min_ratio
    assert lr_at(sched, 25)[0] == pytest.approx(0.001, rel=REL)  # clamped, does not climb back


def test_warmup_cosine_log_warmup_and_groups() -> None:
    opt = make_optimizer(0.1, 0.3)
    sched = WarmupCosineLR(opt, total_num_steps=100, warmup_num_steps=10)
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.0]
    assert sched.org_lrs == [0.1, 0.3]
    assert lr_at(sched, 0) == [0.0, 0.0]
    assert lr_at(sched, 1) == pytest.approx([0.1 * LOG10_2, 0.3 * LOG10_2], rel=REL)


def test_warmup_cosine_total_equal_warmup_does_not_divide_by_zero() -> None:
    sched = WarmupCosineLR(make_optimizer(0.1), total_num_steps=10, warmup_num_steps=10, cos_min_ratio=0.1)
    assert lr_at(sched, 10)[0] == pytest.approx(0.01, rel=REL)


# ----------------------------------------------------------------------------- state and resume


@pytest.mark.parametrize(
    "factory",
    [
        lambda opt: WarmupLR(opt, warmup_max_lr=0.1, warmup_num_steps=5),
        lambda opt: WarmupDecayLR(opt, total_num_steps=12, warmup_max_lr=0.1, warmup_num_steps=4,
                                  warmup_type="linear"),
        lambda opt: WarmupCosineLR(opt, total_num_steps=12, warmup_min_ratio=0.05, warmup_num_steps=4),
    ],
    ids=["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"],
)
def test_state_dict_round_trip_resumes_sequence(factory) -> None:
    reference = factory(make_optimizer(0.1, 0.2))
    full = lr_sequence(reference, 14)

    first = factory(make_optimizer(0.1, 0.2))
    lr_sequence(first, 6)
    saved = json.loads(json.dumps(first.state_dict()))  # plain numbers only
    assert saved == {"last_batch_iteration": 5}

    fresh_opt = make_optimizer(0.1, 0.2)
    resumed = factory(fresh_opt)
    resumed.load_state_dict(saved)
    # The optimizer holds the lr it held at save time, whatever the load order.
    assert [g["lr"] for g in fresh_opt.param_groups] == full[5]
    assert lr_sequence(resumed, 8) == full[6:]


def test_resume_via_constructor_argument() -> None:
    opt = make_optimizer(0.5)
    sched = WarmupLR(opt, warmup_max_lr=0.1, warmup_num_steps=10, warmup_type="linear", last_batch_iteration=4)
    assert opt.param_groups[0]["lr"] == 0.5  # DeepSpeed leaves the optimizer alone when resuming
    with pytest.raises(RuntimeError, match="Call step"):
        sched.get_last_lr()
    sched.step()
    assert sched.get_last_lr() == pytest.approx([0.05], rel=REL)


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, None, "auto"])
@pytest.mark.parametrize("cls", [WarmupLR, WarmupDecayLR, WarmupCosineLR])
def test_warmup_num_steps_must_be_positive_int(cls, bad) -> None:
    kwargs = {} if cls is WarmupLR else {"total_num_steps": 100}
    with pytest.raises(ValueError, match="warmup_num_steps must be a positive integer"):
        cls(make_optimizer(0.1), warmup_num_steps=bad, **kwargs)


def test_unknown_warmup_type_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"warmup_type must be one of \['log', 'linear'\], got 'cosine'"):
        WarmupLR(make_optimizer(0.1), warmup_type="cosine")


@pytest.mark.parametrize("bad", [None, "auto", 0, 1.5])
def test_total_num_steps_must_be_positive_int(bad) -> None:
    with pytest.raises(ValueError, match="total_num_steps must be a positive integer"):
        WarmupDecayLR(make_optimizer(0.1), total_num_steps=bad)
    with pytest.raises(ValueError, match="total_num_steps must be a positive integer"):
        WarmupCosineLR(make_optimizer(0.1), total_num_steps=bad)


def test_lr_values_are_checked() -> None:
    with pytest.raises(ValueError, match="warmup_max_lr must be a finite number >= 0, got 'auto'"):
        WarmupLR(make_optimizer(0.1), warmup_max_lr="auto")
    with pytest.raises(ValueError, match=r"warmup_min_lr\[1\] must be a finite number >= 0"):
        WarmupLR(make_optimizer(0.1, 0.1), warmup_min_lr=[0.0, math.nan])
    with pytest.raises(ValueError, match="cos_min_ratio"):
        WarmupCosineLR(make_optimizer(0.1), total_num_steps=10, cos_min_ratio=-0.1)


def test_load_state_dict_rejects_bad_state() -> None:
    sched = WarmupLR(make_optimizer(0.1))
    with pytest.raises(ValueError, match="needs the key 'last_batch_iteration'"):
        sched.load_state_dict({"step": 3})
    with pytest.raises(ValueError, match="last_batch_iteration must be an integer >= -1"):
        sched.load_state_dict({"last_batch_iteration": -2})


# ----------------------------------------------------------------------------- build_scheduler


def test_build_scheduler_from_config_section() -> None:
    opt = make_optimizer(0.1)
    sched = build_scheduler("WarmupDecayLR", opt, {"total_num_steps": 20, "warmup_max_lr": 0.1,
                                                     "warmup_num_steps": 10, "warmup_type": "linear"})
    assert isinstance(sched, WarmupDecayLR)
    assert lr_at(sched, 15)[0] == pytest.approx(0.05, rel=REL)
    assert set(SUPPORTED_SCHEDULERS) == {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR"}
    assert isinstance(build_scheduler("WarmupLR", make_optimizer(0.1), {}), WarmupLR)


def test_build_scheduler_errors() -> None:
    opt = make_optimizer(0.1)
    supported = r"\['WarmupCosineLR', 'WarmupDecayLR', 'WarmupLR'\]"
    with pytest.raises(ValueError, match=r"'Cosine' is not supported. Use one of " + supported):
        build_scheduler("Cosine", opt, {})
    with pytest.raises(NotImplementedError, match="OneCycle"):
        build_scheduler("OneCycle", opt, {"cycle_min_lr": 0.0, "cycle_max_lr": 0.1})
    with pytest.raises(ValueError, match=r"missing required key\(s\) \['total_num_steps'\]"):
        build_scheduler("WarmupCosineLR", opt, {"warmup_num_steps": 10})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['warmup_steps'\]"):
        build_scheduler("WarmupLR", opt, {"warmup_steps": 10})
