"""What the engine tells about itself on a real 2-process gloo group: wall_clock_breakdown's timers
on every rank, the steps_per_print line on rank 0 only, memory_table() gathered from every rank,
and a profiler trace in which every collective carries the label of the unit group it moves."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from typing import Any

import pytest

from tests.distributed import scenarios as S
from tests.distributed.launch import run_distributed

MIB = 2**20


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _trace_names(engine: Any, step: int, path: str) -> list[str]:
    """The hf_zero:: labels in a chrome trace of one optimizer step (2 micro-steps)."""
    from torch.profiler import ProfilerActivity, profile

    batch = S.learnable_batch(step, 8)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for k in range(2):
            ids = batch[(k * 2 + engine.rank) * 2:(k * 2 + engine.rank + 1) * 2]
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    return sorted({e["name"] for e in events if str(e.get("name", "")).startswith("hf_zero::")})


def _observe(stage: int, overlap: bool) -> dict[str, Any]:
    import hf_zero

    handler = _Lines()
    logger = logging.getLogger("hf_zero")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    sc = S.scenario("gpt2", stage, gas=2, zero={"overlap_comm": overlap})
    config = dict(S.make_config(sc), wall_clock_breakdown=True, steps_per_print=2)
    engine, _, _, _ = hf_zero.initialize(model=S.build_model(sc), config=config)
    for step in range(3):
        batch = S.learnable_batch(step, 8)
        for k in range(2):
            ids = batch[(k * 2 + engine.rank) * 2:(k * 2 + engine.rank + 1) * 2]
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
    timers = engine.timers()
    table = engine.memory_table()
    with tempfile.TemporaryDirectory() as tmp:
        names = _trace_names(engine, 3, os.path.join(tmp, f"rank{engine.rank}.json"))
    logger.removeHandler(handler)
    groups = [g for u in engine.units for g in u.groups]
    return {
        "timers": timers, "table": table, "report": engine.memory_report(), "trace": names,
        "progress": [line for line in handler.lines if " loss " in line and "grad_norm" in line],
        "sharded_units": sum(1 for u in engine.units if u.sharded_numel),
        "sharded_labels": [g.label for g in groups if g.storage.sharded_between_uses],
        "trainable_labels": [g.label for g in groups if g.kind.trainable],
        "replicated_labels": [g.label for g in groups if not g.storage.sharded_between_uses],
    }


def _observe_stages() -> list[dict[str, Any]]:
    return [_observe(3, overlap=False), _observe(2, overlap=True)]


@pytest.fixture(scope="module")
def observed() -> list[list[dict[str, Any]]]:
    """observed[rank][0]: stage 3; observed[rank][1]: stage 2 with overlap_comm."""
    return run_distributed(_observe_stages, 2)


@pytest.mark.parametrize("which", [0, 1], ids=["stage3", "stage2-overlap"])
def test_timers_count_every_phase_on_every_rank(observed: list, which: int) -> None:
    for rank in (0, 1):
        run = observed[rank][which]
        timers = run["timers"]
        # 3 optimizer steps of 2 micro-steps; the window restarted at step 2 (steps_per_print).
        assert timers["step"]["total_count"] == 3 and timers["step"]["count"] == 1
        assert timers["forward"]["total_count"] == 6 and timers["backward"]["total_count"] == 6
        assert timers["forward"]["count"] == 2 and timers["backward"]["count"] == 2
        expected_gathers = 2 * 6 * run["sharded_units"] if which == 0 else 0
        assert timers["gather"]["total_count"] == expected_gathers
        assert timers["reduce"]["total_count"] >= 6  # stages 2-3 reduce every micro-step
        assert timers["reduce"]["total_seconds"] > 0 and timers["step"]["total_seconds"] > 0
        inside = timers["gather"]["total_seconds"] + timers["reduce"]["total_seconds"]
        assert inside <= timers["forward"]["total_seconds"] + timers["backward"]["total_seconds"]


@pytest.mark.parametrize("which", [0, 1], ids=["stage3", "stage2-overlap"])
def test_progress_line_on_rank_zero_only_with_the_breakdown(observed: list, which: int) -> None:
    lines = observed[0][which]["progress"]  # steps_per_print=2 over 4 optimizer steps
    assert len(lines) == 2 and "step 2 " in lines[0] and "step 4 " in lines[1], lines
    breakdown = lines[0].split("per step:")[1]
    for phase in ("forward", "backward", "reduce", "step", "gather"):
        assert f" {phase} " in breakdown
    assert observed[1][which]["progress"] == []


@pytest.mark.parametrize("which", [0, 1], ids=["stage3", "stage2-overlap"])
def test_memory_table_gathers_every_rank(observed: list, which: int) -> None:
    tables = [observed[rank][which]["table"] for rank in (0, 1)]
    assert tables[0] == tables[1]  # every rank gets the same table
    rows = {line.split()[0]: line.split()[1:] for line in tables[0].splitlines()[3:]}
    reports = [observed[rank][which]["report"] for rank in (0, 1)]
    for category in ("compute_params", "gradients", "optimizer_state", "total"):
        expected = [f"{r[category] / MIB:,.2f}" for r in reports] + [f"{sum(r[category] for r in reports) / MIB:,.2f}"]
        assert rows[category] == expected, (category, tables[0])


def _named(names: set[str], kind: str, label: str, suffix: str) -> bool:
    """Whether a ``kind`` collective names ``label``: its own range, or a bucket listing it."""
    prefix = f"hf_zero::{kind}::"
    for name in names:
        if not (name.startswith(prefix) and name.endswith(suffix)):
            continue
        body = name[len(prefix):len(name) - len(suffix)]
        if body == label or (body.startswith("bucket[") and label in body[7:-1].split(",")):
            return True
    return False


@pytest.mark.parametrize("which", [0, 1], ids=["stage3", "stage2-overlap"])
def test_profiler_trace_names_each_collective_and_unit_group(observed: list, which: int) -> None:
    for rank in (0, 1):
        run = observed[rank][which]
        names = set(run["trace"])
        for label in run["trainable_labels"]:  # alone, or named in its bucket (see [Note: buckets])
            assert _named(names, "reduce_scatter", label, ""), (label, sorted(names))
        if which == 0:  # stage 3: every sharded group is gathered (forward and backward)
            for label in run["sharded_labels"]:
                assert f"hf_zero::all_gather::{label}" in names, (label, sorted(names))
        else:  # stage 2: the updated shards are gathered after the step
            for label in run["trainable_labels"]:
                assert _named(names, "all_gather", label, ".step"), (label, sorted(names))
        assert any(name.startswith("hf_zero::all_reduce::") for name in names)  # the global grad norm
        assert "hf_zero::phase::optimizer step" in names  # [Note: phases in step]
        kinds = {name.split("::")[1] for name in names}
        assert kinds <= {"all_gather", "reduce_scatter", "all_reduce", "phase"}, kinds
