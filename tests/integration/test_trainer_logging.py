"""The engine's figures reach the Trainer's logs (HfZeroLoggingCallback), in a real Trainer run:
single process, world size 1, no launcher, on CPU. Each run happens in a fresh spawned process so
that Accelerate's process-wide state and the live stage-3 config stay out of the test process."""

from __future__ import annotations

import json
import multiprocessing
import os
import tempfile
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import pytest

MEMORY_KEYS = [f"hf_zero/memory/{c}_mb" for c in
               ("compute_params", "gradients", "fp32_master", "optimizer_state", "buffers", "total")]
TIMER_KEYS = [f"hf_zero/timers/{p}_s" for p in ("forward", "backward", "reduce", "step", "gather")]
STEPS = 4


def _dataset(rows: int) -> Any:
    from torch.utils.data import Dataset

    from tests.tiny_models import batch_for_step

    class Tokens(Dataset):
        def __init__(self) -> None:
            self.ids = batch_for_step(0, rows)

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    return Tokens()


def _run(mode: str) -> dict[str, Any]:
    """One Trainer run; ``mode``: "installed" (install_logging_callback, ZeRO-3), "passed"
    (Trainer(callbacks=[...]), ZeRO-3) or "plain" (no zero_config, callback installed)."""
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from hf_zero.integrations.trainer_logging import HfZeroLoggingCallback, install_logging_callback
    from hf_zero.integrations.transformers import HfZeroTrainer, HfZeroTrainingArguments
    from tests.tiny_models import tiny_gpt2

    torch.set_num_threads(1)

    class Recorder(TrainerCallback):  # stands for a reporting integration placed after ours
        def __init__(self) -> None:
            self.logs: list[dict[str, float]] = []

        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
            self.logs.append(dict(logs or {}))

    tmp = tempfile.mkdtemp()
    common = dict(output_dir=tmp, use_cpu=True, max_steps=STEPS, logging_steps=1, per_device_train_batch_size=2,
                  gradient_accumulation_steps=2, report_to="none", save_strategy="no", disable_tqdm=True, seed=0)
    recorder = Recorder()
    if mode == "plain":
        trainer = Trainer(model=tiny_gpt2(), args=TrainingArguments(**common), train_dataset=_dataset(32))
    else:
        config = os.path.join(tmp, "zero3.json")
        with open(config, "w") as f:
            json.dump({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                       "wall_clock_breakdown": True,
                       "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}, f)
        args = HfZeroTrainingArguments(zero_config=config, **common)
        callbacks = [HfZeroLoggingCallback()] if mode == "passed" else None
        trainer = HfZeroTrainer(model=tiny_gpt2(), args=args, train_dataset=_dataset(32), callbacks=callbacks)
    if mode != "passed":
        install_logging_callback(trainer)
    trainer.add_callback(recorder)
    trainer.train()
    from hf_zero.integrations._weights import engine_of

    engine = engine_of(trainer.model)
    return {
        "history": trainer.state.log_history,
        "recorded": recorder.logs,
        "engine": None if engine is None else {
            "memory": engine.memory_report(), "timers": engine.timers(), "global_steps": engine.global_steps,
        },
        "first_callback": type(trainer.callback_handler.callbacks[0]).__name__,
    }


def _in_fresh_process(mode: str) -> dict[str, Any]:
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_run, mode).result(timeout=300)


@pytest.fixture(scope="module")
def installed() -> dict[str, Any]:
    return _in_fresh_process("installed")


def _training_logs(history: list[dict]) -> list[dict]:
    return [entry for entry in history if "loss" in entry]


def test_every_training_log_has_the_engine_figures(installed: dict[str, Any]) -> None:
    logs = _training_logs(installed["history"])
    assert len(logs) == STEPS and installed["first_callback"] == "HfZeroLoggingCallback"
    for entry in logs:
        for key in MEMORY_KEYS + TIMER_KEYS + ["hf_zero/grad_norm", "hf_zero/loss_scale"]:
            assert key in entry, (key, entry)
        assert entry["hf_zero/grad_norm"] == pytest.approx(entry["grad_norm"], rel=1e-6)
        assert entry["hf_zero/loss_scale"] == 1.0
        assert entry["hf_zero/memory/total_mb"] > 0 and entry["hf_zero/timers/backward_s"] > 0


def test_figures_agree_with_the_engine(installed: dict[str, Any]) -> None:
    engine = installed["engine"]
    last = _training_logs(installed["history"])[-1]
    for category, value in engine["memory"].items():
        key = f"hf_zero/memory/{category}_mb"
        if key in last or value:  # offload categories are logged when something is offloaded
            assert last[key] == pytest.approx(value / 1e6), key
    # logging_steps=1: each log covers one optimizer step, so the per-step figures add up to the
    # engine's totals.
    assert engine["global_steps"] == STEPS
    for phase, figures in engine["timers"].items():
        logged = sum(e[f"hf_zero/timers/{phase}_s"] for e in _training_logs(installed["history"]))
        assert logged == pytest.approx(figures["total_seconds"], rel=1e-6, abs=1e-9), phase


def test_callbacks_after_it_see_the_figures(installed: dict[str, Any]) -> None:
    recorded = [logs for logs in installed["recorded"] if "loss" in logs]
    assert len(recorded) == STEPS
    assert all("hf_zero/memory/total_mb" in logs and "hf_zero/timers/step_s" in logs for logs in recorded)


def test_passed_through_callbacks_still_reaches_log_history() -> None:
    result = _in_fresh_process("passed")
    logs = _training_logs(result["history"])
    assert len(logs) == STEPS
    assert all("hf_zero/memory/total_mb" in e and "hf_zero/grad_norm" in e for e in logs)


def test_inert_without_an_engine() -> None:
    result = _in_fresh_process("plain")
    assert result["engine"] is None
    assert _training_logs(result["history"])
    assert not any(k.startswith("hf_zero/") for e in result["history"] for k in e)


def test_log_values_in_a_custom_loop() -> None:
    """Without the Trainer: the same figures from hf_zero.initialize's engine, with the timer
    snapshot carried between calls."""
    import hf_zero
    from hf_zero.integrations.trainer_logging import log_values
    from tests.tiny_models import batch_for_step, tiny_gpt2

    config = {"train_micro_batch_size_per_gpu": 2, "wall_clock_breakdown": True,
              "zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, _, _, _ = hf_zero.initialize(model=tiny_gpt2(), config=config)
    snapshot = None
    per_log = []
    for step in range(3):
        ids = batch_for_step(step, 2)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        values, snapshot = log_values(engine, snapshot)
        per_log.append(values)
    again, _ = log_values(engine, snapshot)  # no step since: no timer figures, the rest as before
    assert not any(k.startswith("hf_zero/timers/") for k in again)
    assert again["hf_zero/memory/total_mb"] == per_log[-1]["hf_zero/memory/total_mb"]
    total = engine.timers()["step"]["total_seconds"]
    assert sum(v["hf_zero/timers/step_s"] for v in per_log) == pytest.approx(total, rel=1e-6)
    assert per_log[-1]["hf_zero/grad_norm"] == pytest.approx(engine.get_global_grad_norm())
