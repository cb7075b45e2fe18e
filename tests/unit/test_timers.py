"""wall_clock_breakdown's timers and the memory table, in one process (world size 1, no process
group): the arithmetic of PhaseTimers, what the engine times, that nothing is timed when the flag
is off, and format_memory_table against hand-computed figures."""

from __future__ import annotations

import time

import pytest
import torch

import hf_zero
from hf_zero.engine.memory import CATEGORIES, format_memory_table
from hf_zero.engine.schedule.timers import PHASES, PhaseTimers
from tests.tiny_models import batch_for_step, tiny_gpt2


# ---------------------------------------------------------------------------- PhaseTimers
def test_intervals_accumulate_and_reset_keeps_totals() -> None:
    timers = PhaseTimers("cpu")
    for _ in range(3):
        timers.start("forward")
        time.sleep(0.01)
        timers.stop("forward")
    figures = timers.as_dict()["forward"]
    assert figures["count"] == 3 and figures["total_count"] == 3
    assert 0.03 <= figures["seconds"] < 1.0 and figures["seconds"] == figures["total_seconds"]

    timers.reset()
    after = timers.as_dict()["forward"]
    assert after["seconds"] == 0.0 and after["count"] == 0
    assert after["total_seconds"] == figures["total_seconds"] and after["total_count"] == 3
    assert set(timers.as_dict()) == set(PHASES)


def test_nested_start_of_the_same_phase_counts_once() -> None:
    timers = PhaseTimers("cpu")
    timers.start("gather")
    timers.start("gather")
    time.sleep(0.005)
    timers.stop("gather")
    assert timers.as_dict()["gather"]["count"] == 0  # the outer interval is still open
    timers.stop("gather")
    assert timers.as_dict()["gather"]["count"] == 1


def test_stop_without_start_says_what_to_call() -> None:
    with pytest.raises(RuntimeError, match=r"start\('step'\)"):
        PhaseTimers("cpu").stop("step")


def test_format_divides_by_steps() -> None:
    timers = PhaseTimers("cpu")
    timers.totals["backward"].add(0.5)
    line = timers.format(per=4)
    assert "backward 125.0ms" in line and line.startswith("forward 0.0ms")


# ---------------------------------------------------------------------------- the engine
def _engine(stage: int, breakdown: bool, steps_per_print: int | None = None, gas: int = 2):
    config = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "wall_clock_breakdown": breakdown, "steps_per_print": steps_per_print,
    }
    engine, _, _, _ = hf_zero.initialize(model=tiny_gpt2(), config=config)
    return engine


def _train(engine, micro_steps: int) -> None:
    for step in range(micro_steps):
        ids = batch_for_step(step, 2)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_engine_times_every_phase(stage: int) -> None:
    engine = _engine(stage, breakdown=True)
    _train(engine, micro_steps=4)  # 2 optimizer steps
    timers = engine.timers()
    assert timers["forward"]["count"] == 4 and timers["backward"]["count"] == 4
    assert timers["step"]["count"] == 2
    sharded_units = sum(1 for u in engine.units if u.sharded_numel)
    # Stage 3: every sharded unit is gathered before its forward and again before its backward.
    assert timers["gather"]["count"] == (2 * 4 * sharded_units if stage == 3 else 0)
    # Stages 2-3 reduce every micro-step, stages 0-1 at the boundary only.
    assert timers["reduce"]["count"] >= (4 if stage >= 2 else 2)
    for phase in PHASES:
        assert timers[phase]["seconds"] >= 0.0
    # Collectives run inside forward and backward (see [Note: what each phase covers]).
    assert timers["gather"]["seconds"] + timers["reduce"]["seconds"] <= (
        timers["forward"]["seconds"] + timers["backward"]["seconds"])


def test_evaluation_forwards_are_not_timed() -> None:
    engine = _engine(3, breakdown=True)
    ids = batch_for_step(0, 2)
    with torch.no_grad():
        engine(input_ids=ids, labels=ids)
    assert engine.timers()["forward"]["count"] == 0


def test_steps_per_print_line_adds_the_breakdown_and_starts_a_new_window(caplog: pytest.LogCaptureFixture) -> None:
    engine = _engine(2, breakdown=True, steps_per_print=2, gas=1)
    with caplog.at_level("INFO", logger="hf_zero"):
        _train(engine, micro_steps=3)
    lines = [r.getMessage() for r in caplog.records if "step 2 loss" in r.getMessage()]
    assert len(lines) == 1
    for phase in PHASES:
        assert f" {phase} " in lines[0].split("per step:")[1]
    timers = engine.timers()
    assert timers["step"]["count"] == 1 and timers["step"]["total_count"] == 3  # reset at step 2


def test_flag_off_makes_no_timer_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: PhaseTimers, name: str) -> None:
        raise AssertionError(f"timer {name!r} started with wall_clock_breakdown off")

    monkeypatch.setattr(PhaseTimers, "start", refuse)
    engine = _engine(3, breakdown=False, steps_per_print=1)
    _train(engine, micro_steps=2)
    assert engine._timers is None and engine.protocol.timers is None
    with pytest.raises(RuntimeError, match="wall_clock_breakdown"):
        engine.timers()


# ---------------------------------------------------------------------------- memory table
def _report(scale: int) -> dict[str, int]:
    report = {name: (i + 1) * scale for i, name in enumerate(CATEGORIES)}
    report["total"] = sum(report.values())
    return report


def test_memory_table_per_rank_and_totals() -> None:
    reports = [_report(2**20), _report(2 * 2**20)]  # rank 0: 1..5 MiB, rank 1: 2..10 MiB
    table = format_memory_table(reports)
    lines = table.splitlines()
    assert lines[0] == "memory by category (MiB), 2 ranks"
    assert lines[1].split() == ["category", "rank", "0", "rank", "1", "all", "ranks"]
    assert lines[4].split() == ["gradients", "2.00", "4.00", "6.00"]
    assert lines[-1].split() == ["total", "15.00", "30.00", "45.00"]


def test_memory_table_units_markdown_and_many_ranks() -> None:
    big = [_report(2**30)]
    assert "(GiB)" in format_memory_table(big)  # auto: 15 GiB
    assert "| total | 15,000.00 | 15,000.00 |" in format_memory_table(
        [_report(10**9)], unit="MB", markdown=True)
    many = format_memory_table([_report(2**20)] * 3 + [_report(2 * 2**20)], max_rank_columns=2)
    assert many.splitlines()[1].split() == ["category", "min", "max", "mean", "all", "ranks"]
    assert many.splitlines()[-1].split() == ["total", "15.00", "30.00", "18.75", "75.00"]


def test_memory_table_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="unit="):
        format_memory_table([_report(1)], unit="MiBs")
    with pytest.raises(ValueError, match="at least one report"):
        format_memory_table([])


def test_engine_memory_table_matches_memory_report() -> None:
    engine = _engine(3, breakdown=False)
    _train(engine, micro_steps=2)
    report = engine.memory_report()
    assert report["compute_params"] > 0 and report["gradients"] > 0 and report["optimizer_state"] > 0
    lines = engine.memory_table(unit="B").splitlines()
    assert lines[0] == "memory by category (B), 1 rank"
    rows = {line.split()[0]: line.split()[1:] for line in lines[3:]}
    # One rank: its column and "all ranks" both hold the report's byte count, written by hand here.
    expected = {name: [f"{report[name]:,.2f}"] * 2 for name in (*CATEGORIES, "total")}
    assert rows == expected


def test_offloaded_bytes_get_their_rows() -> None:
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False}}}
    engine, _, _, _ = hf_zero.initialize(model=tiny_gpt2(), config=config)
    _train(engine, micro_steps=1)
    report = engine.memory_report()
    assert report["host_optimizer_state"] > 0
    rows = {line.split()[0]: line.split()[1:] for line in engine.memory_table(unit="B").splitlines()[3:]}
    assert rows["host_optimizer_state"][0] == f"{report['host_optimizer_state']:,.2f}"
    assert "host_total" in rows and "nvme" in rows
    assert "host_total" not in _engine(2, breakdown=False).memory_table()  # nothing offloaded
