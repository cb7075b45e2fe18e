"""The engine's figures in the Trainer's logs, so TensorBoard / W&B / MLflow users see them.

:class:`HfZeroLoggingCallback` adds, to every log the Trainer writes while an hf_zero engine
wraps its model:

- ``hf_zero/memory/<category>_mb``: this rank's ``engine.memory_report()`` in MB (10^6 bytes),
  one key per device category and ``total``, plus the host categories, ``host_total`` and
  ``nvme`` when something is offloaded;
- ``hf_zero/grad_norm``: the global gradient norm before clipping of the last optimizer step;
- ``hf_zero/loss_scale`` (and ``hf_zero/skipped_steps`` under fp16);
- with ``"wall_clock_breakdown": true``, ``hf_zero/timers/<phase>_s``: seconds per optimizer step
  spent in forward, backward, reduce, step and gather, averaged over the steps since the
  previous log (see [Note: what each phase covers] in hf_zero.engine.schedule.timers).

[Note: where the callback sits]
``Trainer.log`` copies the logs into ``state.log_history`` and then calls each callback's
``on_log`` in list order, and the reporting callbacks (``report_to``) come before any callback
passed to ``Trainer(callbacks=...)``. So the callback writes its figures into both places: into
``logs``, which every callback after it sees, and into the ``log_history`` entry of this same log.
:func:`install_logging_callback` puts it first in the list, so the reporters see the figures
too; passed through ``callbacks=`` it still reaches ``log_history`` and the console.

Every figure is this rank's and is read locally: ``on_log`` runs no collective.
"""

from __future__ import annotations

from typing import Any

from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from hf_zero.engine.engine import ZeroEngine
from hf_zero.engine.memory import CATEGORIES, HOST_CATEGORIES
from hf_zero.integrations._weights import engine_of

__all__ = ["HfZeroLoggingCallback", "install_logging_callback", "log_values", "PREFIX"]

PREFIX = "hf_zero/"
_MB = 1e6


def _timer_values(engine: ZeroEngine, since: dict[str, float] | None) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds per optimizer step of each phase since the snapshot ``since``, and the new
    snapshot. Nothing when no optimizer step ran in between (an evaluation log, say)."""
    totals = engine.timers()
    snapshot = {name: t["total_seconds"] for name, t in totals.items()}
    snapshot["_steps"] = float(engine.global_steps)
    previous = since or {name: 0.0 for name in snapshot}
    steps = snapshot["_steps"] - previous["_steps"]
    if steps <= 0:
        return {}, previous
    values = {f"{PREFIX}timers/{name}_s": (snapshot[name] - previous[name]) / steps for name in totals}
    return values, snapshot


def log_values(engine: ZeroEngine, timer_snapshot: dict[str, float] | None = None,
               memory: bool = True, timers: bool = True) -> tuple[dict[str, float], dict[str, float] | None]:
    """The figures :class:`HfZeroLoggingCallback` logs, for any loop: returns ``(values,
    snapshot)``; pass the snapshot back next time so timers cover the steps in between."""
    values: dict[str, float] = {}
    if memory:
        report = engine.memory_report()
        categories = [*CATEGORIES, "total"]
        offload = [*HOST_CATEGORIES, "host_total", "nvme"]
        if any(report.get(k, 0) for k in offload):
            categories += offload
        for category in categories:
            values[f"{PREFIX}memory/{category}_mb"] = report[category] / _MB
    norm = engine.get_global_grad_norm()
    if norm is not None:
        values[f"{PREFIX}grad_norm"] = float(norm)
    values[f"{PREFIX}loss_scale"] = float(engine.loss_scale)
    if engine.config.fp16.enabled:
        values[f"{PREFIX}skipped_steps"] = float(engine.skipped_steps)
    if timers and engine.config.wall_clock_breakdown:
        timed, timer_snapshot = _timer_values(engine, timer_snapshot)
        values.update(timed)
    return values, timer_snapshot


class HfZeroLoggingCallback(TrainerCallback):
    """Adds the engine's memory, gradient norm, loss scale and timers to the Trainer's logs (see
    the module docstring). Inert when no hf_zero engine wraps the model, so it is safe on any
    Trainer. Add it with :func:`install_logging_callback` (see [Note: where the callback sits]).

    ``engine``: the engine to read; by default the one wrapping the Trainer's model.
    ``memory`` / ``timers``: turn those groups of figures off.
    """

    def __init__(self, engine: ZeroEngine | None = None, memory: bool = True, timers: bool = True) -> None:
        self.engine = engine
        self.memory = memory
        self.timers = timers
        self._timer_snapshot: dict[str, float] | None = None

    def _find_engine(self, model: Any, optimizer: Any) -> ZeroEngine | None:
        if self.engine is not None:
            return self.engine
        return engine_of(model) or getattr(optimizer, "engine", None)

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        engine = self._find_engine(kwargs.get("model"), kwargs.get("optimizer"))
        if engine is None or logs is None:
            return
        values, self._timer_snapshot = log_values(engine, self._timer_snapshot, self.memory, self.timers)
        last = state.log_history[-1] if state.log_history else None
        # The entry Trainer.log appended for these logs (it holds the same keys plus "step").
        is_this_log = last is not None and last.get("step") == state.global_step and all(k in last for k in logs)
        logs.update(values)
        if is_this_log:
            last.update(values)


def install_logging_callback(trainer: Trainer, **kwargs: Any) -> HfZeroLoggingCallback:
    """Put an :class:`HfZeroLoggingCallback` first among ``trainer``'s callbacks, ahead of the
    reporting ones, and return it. ``kwargs`` go to the callback."""
    callbacks = trainer.callback_handler.callbacks
    present = [c for c in callbacks if isinstance(c, HfZeroLoggingCallback)]
    for existing in present:  # one is enough: move it to the front instead of adding another
        callbacks.remove(existing)
    callback = present[0] if present and not kwargs else HfZeroLoggingCallback(**kwargs)
    callbacks.insert(0, callback)
    return callback
