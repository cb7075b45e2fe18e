"""A plain ``accelerate.Accelerator(...)`` on hf_zero, for unmodified scripts under the runner.

    accelerate launch --multi_gpu --num_processes 2 -m hf_zero.run train.py --zero_config zero3.json ...
    hf-zero launch --config_file recipes/accelerate/zero3_2proc.yaml train.py ...

[Note: the runner's Accelerate door]
``hf_zero.run`` with a ZeRO config (``--zero_config``, or ``HF_ZERO_CONFIG`` / ``HF_ZERO_STAGE``
from ``hf-zero launch``) calls :func:`enable` before the script runs. It points the names
``accelerate.Accelerator`` and ``accelerate.accelerator.Accelerator`` at :class:`HfZeroAccelerator`,
so the script's own ``from accelerate import Accelerator`` builds an accelerator that reads the
config from the environment and prepares models into ZeRO engines, with the script's optimizer,
scheduler and dataloaders. Transformers' ``Trainer`` keeps its own route (it builds its
accelerator with the config it resolved; hf_zero.integrations.transformers).

A run with a ZeRO config must never train as plain DDP by accident, so two checks back the door:
- ``Accelerator.prepare_model`` of the original class refuses to wrap a model while a config is
  set: an accelerator built before the names were swapped (or a subclass of the original class)
  would otherwise wrap it in DDP;
- the runner counts the models hf_zero prepared (:func:`hf_zero_models_prepared`) and fails the
  run when a config was given and the script prepared none.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import accelerate
import accelerate.accelerator
from accelerate import Accelerator

from hf_zero.integrations._accelerator import HfZeroAccelerator, hf_zero_models_prepared

__all__ = ["config_requested", "disable", "enable", "hf_zero_models_prepared", "is_enabled"]

# Any of these switches hf_zero on for a plugin-less HfZeroAccelerator (HfZeroPlugin reads them).
CONFIG_VARIABLES = ("HF_ZERO_CONFIG", "HF_ZERO_CONFIG_FILE", "HF_ZERO_STAGE")

_STATE: dict[str, Any] = {"enabled": False, "originals": {}}


def config_requested() -> bool:
    """True when the environment asks for hf_zero (what a plugin-less HfZeroAccelerator reads)."""
    return any(os.environ.get(name) for name in CONFIG_VARIABLES)


def _guarded_prepare_model(original: Any) -> Any:
    @functools.wraps(original)
    def prepare_model(self: Accelerator, model: Any, *args: Any, **kwargs: Any) -> Any:
        if config_requested() and getattr(self, "hf_zero_config", None) is None:
            raise RuntimeError(
                f"a ZeRO config is set ({', '.join(n for n in CONFIG_VARIABLES if os.environ.get(n))}) but "
                f"{type(self).__name__}.prepare would wrap the model in plain "
                f"{self.distributed_type} without hf_zero: this accelerator was built from "
                "accelerate's original class (imported before hf_zero.run started, or subclassed). "
                "Build it with `from accelerate import Accelerator` in the script, or use "
                "hf_zero.integrations.accelerate.HfZeroAccelerator")
        return original(self, model, *args, **kwargs)

    return prepare_model


def enable() -> None:
    """Swap the ``Accelerator`` names for :class:`HfZeroAccelerator` and guard the original
    class (idempotent). Inert without a config in the environment: HfZeroAccelerator is then a
    plain Accelerator."""
    if _STATE["enabled"]:
        return
    originals = _STATE["originals"]
    originals[(accelerate, "Accelerator")] = accelerate.Accelerator
    originals[(accelerate.accelerator, "Accelerator")] = accelerate.accelerator.Accelerator
    originals[(Accelerator, "prepare_model")] = Accelerator.__dict__["prepare_model"]
    accelerate.Accelerator = HfZeroAccelerator
    accelerate.accelerator.Accelerator = HfZeroAccelerator
    Accelerator.prepare_model = _guarded_prepare_model(originals[(Accelerator, "prepare_model")])
    _STATE["enabled"] = True


def disable() -> None:
    """Undo :func:`enable`."""
    for (owner, name), original in _STATE["originals"].items():
        setattr(owner, name, original)
    _STATE["originals"] = {}
    _STATE["enabled"] = False


def is_enabled() -> bool:
    return bool(_STATE["enabled"])
