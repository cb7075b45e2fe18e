"""The run-state values of a manifest, checked before anything is applied.

[Note: validated run state]
``read_manifest`` checks the manifest's structure (types, counts, slots inside their groups,
plain file names). The values a load then applies to the engine are checked here, all of them
before the first is applied, so that a manifest edited by hand or damaged is refused with one
:class:`CheckpointError` naming the file and each key, instead of loading and failing at the
next step with a ValueError from the optimizer:

- the step counters (``global_steps``, ``micro_steps``, ``global_samples``): integers >= 0;
- every optimizer param group: each value of the kind (number, flag, text, sequence, none) the
  engine's optimizer holds under that key (``None`` and a flag pass for each other, as torch's
  ``foreach``/``fused`` defaults do, except for the four below); ``lr`` and ``weight_decay``
  finite numbers >= 0, ``eps`` finite and >= 0 (a number, or a sequence whose items may be
  ``None``, as Adafactor's), ``betas`` two finite numbers in [0, 1); every other number finite;
- the optimizer's ``step`` of every group and parameter: a finite integer >= 0;
- element-wise optimizer state (rank-file tensors): float32, the dtype of the masters, which
  every optimizer the engine steps keeps its state in (torch's own ``load_state_dict`` would cast
  it there too);
- ``whole_param_state``: file indices that exist, float32 tensors, valid steps.

Decoding itself (``manifest.decode_state``) admits only data: dtypes from a closed list, no
name is looked up on a module.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from hf_zero.checkpoint.errors import CheckpointError, listed
from hf_zero.checkpoint.manifest import OPTIM_PREFIX, decode_state
from hf_zero.checkpoint.safetensors_io import DTYPE_TAGS

OPTIM_STATE_DTYPES = (DTYPE_TAGS[torch.float32],)  # see [Note: validated run state]
COUNTERS = ("global_steps", "micro_steps", "global_samples")
# Far beyond any run (2**40 steps at one a millisecond is 35 years), and below int64's limit,
# which the step's checks convert to: 2**64 + 1 would fail every later step and every reload.
MAX_COUNTER = 1 << 48
_NON_NEGATIVE = ("lr", "weight_decay")
_RANGED = ("lr", "eps", "weight_decay", "betas")  # a None here is never "unset"
_PLAIN_KINDS = ("none", "flag", "number", "text", "sequence")
# Not the optimizer's own: a scheduler's mark and the parameters. A missing flag is torch's to
# default (``Optimizer.__setstate__``); a missing number or sequence is an error.
_OPTIONAL_HYPER = frozenset({"params", "initial_lr", "param_names"})


def as_number(value: Any) -> float | None:
    """``value`` as a float when it is a number (a bool is not; a 0-d numeric tensor is)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dim() == 0 and value.dtype != torch.bool:
        return float(value.item())
    return None


def value_kind(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "flag"
    if as_number(value) is not None:
        return "number"
    if isinstance(value, str):
        return "text"
    if isinstance(value, (list, tuple)):
        return "sequence"
    if isinstance(value, torch.dtype):
        return "dtype"
    return type(value).__name__


def _non_negative_problem(where: str, value: Any) -> str | None:
    number = as_number(value)
    if number is None or not math.isfinite(number) or number < 0:
        return f"{where} is {value!r:.60}: expected a finite number >= 0"
    return None


def _eps_problem(where: str, value: Any) -> str | None:
    items = value if isinstance(value, (list, tuple)) else [value]
    numbers = [as_number(v) for v in items if v is not None]
    if value is not None and not all(n is not None and math.isfinite(n) and n >= 0 for n in numbers):
        return f"{where} is {value!r:.60}: expected finite numbers >= 0"
    return None


def _betas_problem(where: str, value: Any) -> str | None:
    numbers = [as_number(v) for v in value] if isinstance(value, (list, tuple)) and len(value) == 2 else None
    if numbers is None or not all(n is not None and math.isfinite(n) and 0 <= n < 1 for n in numbers):
        return f"{where} is {value!r:.60}: expected two finite numbers in [0, 1)"
    return None


def _finite_problem(where: str, value: Any) -> str | None:
    items = value if isinstance(value, (list, tuple)) else [value]
    numbers = [n for n in (as_number(v) for v in items) if n is not None]
    if not all(math.isfinite(n) for n in numbers):
        return f"{where} is {value!r:.60}: expected finite numbers"
    return None


def _kind_problem(where: str, key: str, value: Any, current: Mapping[str, Any]) -> str | None:
    if key not in current:  # a key the optimizer does not use (a scheduler's initial_lr, ...)
        if value_kind(value) not in _PLAIN_KINDS:
            return f"{where} is a {value_kind(value)}, not a plain value an optimizer param group holds"
        return None
    saved_kind, current_kind = value_kind(value), value_kind(current[key])
    loose = key not in _RANGED and {saved_kind, current_kind} <= {"none", "flag"}
    if saved_kind != current_kind and not loose:
        return f"{where} is a {saved_kind} ({value!r:.60}), the optimizer holds a {current_kind} there"
    return None


def _hyper_value_problem(where: str, key: str, value: Any, current: Mapping[str, Any]) -> str | None:
    problem = _kind_problem(where, key, value, current)
    if problem is not None:
        return problem
    if key == "betas":
        return _betas_problem(where, value)
    if key == "eps":
        return _eps_problem(where, value)
    if key in _NON_NEGATIVE:
        return _non_negative_problem(where, value)
    return _finite_problem(where, value)


def _hyper_problems(saved_groups: Any, current_groups: list[Mapping[str, Any]]) -> list[str]:
    where = "optimizer.param_groups"
    hyper = decode_state(saved_groups, where)
    if not isinstance(hyper, list) or not all(isinstance(h, dict) for h in hyper):
        return [f"{where} is not a list of objects"]
    problems = []
    for index, (group, current) in enumerate(zip(hyper, current_groups)):
        for key, value in group.items():
            problem = _hyper_value_problem(f"{where}[{index}].{key}", key, value, current)
            if problem:
                problems.append(problem)
        problems += [f"{where}[{index}].{key} is missing (the optimizer holds {value!r:.40} there)"
                     for key, value in current.items() if key not in group and key not in _OPTIONAL_HYPER
                     and value_kind(value) in ("number", "sequence")]
    return problems


def step_problem(where: str, value: Any) -> str | None:
    """An optimizer step count: a finite integer >= 0 (an int, an integral float or a 0-d tensor)."""
    number = as_number(value)
    if number is None or not math.isfinite(number) or number < 0 or number != int(number):
        return f"{where} is {value!r:.60}: expected a finite integer >= 0"
    return None


def _scalars_problems(where: str, encoded: Any, slot_count: int | None = None) -> list[str]:
    scalars = decode_state(encoded or {}, where)
    if not isinstance(scalars, dict):
        return [f"{where} is not an object"]
    problem = step_problem(f"{where}.step", scalars["step"]) if "step" in scalars else None
    problems = [problem] if problem else []
    if "slot_steps" in scalars:  # one step count per parameter: [Note: parameters no rank used]
        counts = scalars["slot_steps"]
        if not isinstance(counts, list) or (slot_count is not None and len(counts) != slot_count):
            problems.append(f"{where}.slot_steps is {counts!r:.60}: expected a list of {slot_count} step counts, "
                            "one per parameter of the group")
        else:
            problems += [p for i, c in enumerate(counts) if (p := step_problem(f"{where}.slot_steps[{i}]", c))]
    return problems


def _group_state_problems(index: int, record: Mapping[str, Any]) -> list[str]:
    where = f"groups[{index}]"
    problems = [f"{where}.tensors.{key} is {dtype!r:.20}: optimizer state is {' or '.join(OPTIM_STATE_DTYPES)}"
                for key, dtype in record["tensors"].items()
                if key.startswith(OPTIM_PREFIX) and dtype not in OPTIM_STATE_DTYPES]
    return problems + _scalars_problems(f"{where}.optimizer_scalars", record.get("optimizer_scalars"),
                                        len(record["slots"]) if isinstance(record.get("slots"), list) else None)


def _whole_state_problems(saved: Any, file_count: int) -> list[str]:
    where = "whole_param_state"
    if saved is None:
        return []
    if not isinstance(saved, dict) or not all(isinstance(spec, dict) for spec in saved.values()):
        return [f"{where} is not an object of per-parameter objects"]
    problems = []
    for name, spec in saved.items():
        tensors, file_index = spec.get("tensors") or {}, spec.get("file")
        if not isinstance(tensors, dict) or not all(isinstance(t, dict) for t in tensors.values()):
            problems.append(f"{where}[{name!r}].tensors is not an object")
            continue
        if tensors and not (isinstance(file_index, int) and not isinstance(file_index, bool)
                            and 0 <= file_index < file_count):
            problems.append(f"{where}[{name!r}].file is {file_index!r:.20}: not one of the {file_count} rank files")
        problems += [f"{where}[{name!r}].tensors.{key}.dtype is {t.get('dtype')!r:.20}: optimizer state is "
                     f"{' or '.join(OPTIM_STATE_DTYPES)}" for key, t in tensors.items()
                     if t.get("dtype") not in OPTIM_STATE_DTYPES]
        problems += _scalars_problems(f"{where}[{name!r}].scalars", spec.get("scalars"))
    return problems


def _counter_problems(manifest: Mapping[str, Any]) -> list[str]:
    problems = []
    for key in COUNTERS:
        value = manifest.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_COUNTER:
            problems.append(f"{key} is {value!r:.40}: expected an integer from 0 to 2**48")
    return problems


def run_state_problems(manifest: Mapping[str, Any], counters: bool,
                       optimizer_groups: list[Mapping[str, Any]] | None) -> list[str]:
    """Every problem of the values a load will apply (see [Note: validated run state]):
    the counters when ``counters``, the optimizer state when ``optimizer_groups`` (the engine's
    current param groups) is given."""
    problems = _counter_problems(manifest) if counters else []
    saved = manifest.get("optimizer")
    if optimizer_groups is None or not isinstance(saved, dict):  # no optimizer state is loaded
        return problems
    problems += _hyper_problems(saved.get("param_groups"), optimizer_groups)
    for index, record in enumerate(manifest["groups"]):
        problems += _group_state_problems(index, record)
    return problems + _whole_state_problems(manifest.get("whole_param_state"), len(manifest["files"]))


def check_run_state(manifest: Mapping[str, Any], manifest_path: str, counters: bool,
                    optimizer_groups: list[Mapping[str, Any]] | None) -> None:
    """One :class:`CheckpointError` naming the manifest and every invalid key, or nothing."""
    problems = run_state_problems(manifest, counters, optimizer_groups)
    if problems:
        shown = listed(problems, 8)
        raise CheckpointError(
            f"{manifest_path}: invalid run state (edited by hand or damaged): {shown}. Load another checkpoint, "
            "or leave the damaged part out (load_optimizer_states=False, or load_module_only=True)"
        )
