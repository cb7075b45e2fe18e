"""Fill "auto" exactly as transformers' HfTrainerDeepSpeedConfig does, and report mismatches.

The table is ``HfTrainerDeepSpeedConfig.trainer_config_process`` in
``transformers/integrations/deepspeed.py``. Which key is filled from which
``resolve(...)`` argument lives in the key table (``KeySpec.auto_from``); this module computes the
values. Two deliberate differences from transformers:

- ``amp.enabled: "auto"`` becomes false (transformers leaves it "auto" and Accelerate later raises).
- mismatches are reported by ``resolve(check_mismatches=True)``, i.e. when the Trainer integration
  builds its arguments, not at ``train()`` time.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from .batch import GAS, MICRO, TOTAL, Batch, derive_batch
from .errors import ConfigProblem, ProblemList
from .keys import DTYPE_SPELLINGS, KEY_TABLE, iter_specs
from .validate import AUTO, as_json, get_path, validate

__all__ = ["RESOLVE_ARGUMENTS", "MATCHED_KEYS", "resolve_dict", "auto_paths"]

# Every keyword resolve(...) takes besides world_size / hidden_size / check_mismatches.
RESOLVE_ARGUMENTS: tuple[str, ...] = (
    MICRO, GAS, TOTAL, "gradient_clipping", "lr", "betas", "eps", "weight_decay",
    "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps",
    "fp16", "bf16", "stage3_gather_16bit_weights_on_model_save",
)  # fmt: skip

# Keys transformers checks against TrainingArguments when they are not "auto" (fill_match with
# must_match=True). The others (warmup_min_lr, the hidden-size keys, ...) are fill-only.
MATCHED_KEYS: dict[str, str] = {
    MICRO: MICRO,
    GAS: GAS,
    TOTAL: TOTAL,
    "gradient_clipping": "gradient_clipping",
    "optimizer.params.lr": "lr",
    "optimizer.params.betas": "betas",
    "optimizer.params.eps": "eps",
    "optimizer.params.weight_decay": "weight_decay",
    "scheduler.params.warmup_max_lr": "warmup_max_lr",
    "scheduler.params.warmup_num_steps": "warmup_num_steps",
    "scheduler.params.total_num_steps": "total_num_steps",
    "fp16.enabled": "fp16",
    "bf16.enabled": "bf16",
}

_BATCH_KEYS = (MICRO, GAS, TOTAL)


def auto_paths(root: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted paths of every value that is still "auto"."""
    paths: list[str] = []
    for key, value in root.items():
        path = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict):
            paths += auto_paths(value, path)
        elif isinstance(value, str) and value == AUTO:
            paths.append(path)
    return paths


def _set_path(root: dict[str, Any], path: str, value: Any) -> None:
    *parents, name = path.split(".")
    node = root
    for part in parents:
        node = node[part]
    node[name] = value


def _same(config_value: Any, given: Any) -> bool:
    if isinstance(config_value, bool) or isinstance(given, bool):
        return config_value is given or config_value == given and type(config_value) is type(given)
    if isinstance(config_value, (list, tuple)) and isinstance(given, (list, tuple)):
        return len(config_value) == len(given) and all(_same(a, b) for a, b in zip(config_value, given))
    if isinstance(config_value, (int, float)) and isinstance(given, (int, float)):
        return math.isclose(config_value, given, rel_tol=1e-12, abs_tol=0.0)
    return bool(config_value == given)


def _mismatches(root: dict[str, Any], values: dict[str, Any]) -> ProblemList:
    problems = ProblemList()
    for path, argument in MATCHED_KEYS.items():
        given = values.get(argument)
        current = get_path(root, path, None)
        present = get_path(root, path, _MISSING_KEY) is not _MISSING_KEY
        if given is None or not present or current == AUTO or _same(current, given):
            continue
        problems.add(
            path,
            current,
            f"config {path}={current!r} vs given {argument}={given!r}",
            f'set {path} to "auto" (or to {as_json(given)}), or pass the config\'s value',
        )
    return problems


_MISSING_KEY = object()


def _fill_value(path: str, source: str, hidden_size: int | None, values: dict[str, Any]) -> Any:
    """The value transformers would put in an "auto" at `path`; None when it cannot."""
    if source == "false":
        return False
    if source == "hidden_size":
        if hidden_size is None:
            return None
        if path.endswith("stage3_prefetch_bucket_size"):
            return int(0.9 * hidden_size * hidden_size)
        if path.endswith("stage3_param_persistence_threshold"):
            return 10 * hidden_size
        return hidden_size * hidden_size
    if source == "stage3_gather_16bit_weights_on_model_save":
        return bool(values.get(source) or False)  # transformers/Accelerate: given value, else false
    value = values.get(source)
    return list(value) if isinstance(value, tuple) else value


def _fill_autos(root: dict[str, Any], hidden_size: int | None, values: dict[str, Any]) -> dict[str, str]:
    """Fill every fillable "auto" except the batch triple; return {path: argument} filled."""
    filled: dict[str, str] = {}
    for path in auto_paths(root):
        spec = KEY_TABLE.get(path)
        if spec is None or spec.auto_from is None or path in _BATCH_KEYS:
            continue
        value = _fill_value(path, spec.auto_from, hidden_size, values)
        if value is not None:
            _set_path(root, path, value)
            filled[path] = spec.auto_from
    return filled


def _batch_input(root: dict[str, Any], key: str, values: dict[str, Any]) -> int | None:
    """A batch member as input to the derivation: the config's number, else the given value.

    Unlike the other keys, an absent member also takes the given value: "given anywhere" counts,
    so a config without batch keys gets the Trainer's batch sizes rather than the defaults.
    """
    current = root.get(key)
    if isinstance(current, int) and not isinstance(current, bool):
        return current
    if current is None or current == AUTO:
        given = values.get(key)
        return given if isinstance(given, int) and not isinstance(given, bool) else None
    return None  # a wrong type: validation reports it


def _resolve_batch(root: dict[str, Any], world_size: int | None, values: dict[str, Any]) -> Batch:
    inputs = [_batch_input(root, key, values) for key in _BATCH_KEYS]
    # A member that is "auto" with nothing to fill it (or of a wrong type) is unknown, not absent:
    # derive what the others allow, but invent no defaults; validation names what is missing.
    pending = any(root.get(k) is not None and v is None for k, v in zip(_BATCH_KEYS, inputs))
    batch = derive_batch(*inputs, world_size, pending=pending)
    for key, value in zip(_BATCH_KEYS, (batch.micro, batch.gas, batch.total)):
        if value is not None:
            root[key] = value
    return batch


def _shard_group_larger_than_world(root: dict[str, Any], world_size: int | None) -> ConfigProblem | None:
    """``mics_shard_size`` above the world size: groups that cannot be made (at world size 1 the
    engine would otherwise shard over the one rank there is, silently)."""
    zero = root.get("zero_optimization")
    size = zero.get("mics_shard_size", -1) if isinstance(zero, dict) else -1
    if world_size is None or not isinstance(size, int) or isinstance(size, bool) or size <= world_size:
        return None
    return ConfigProblem("zero_optimization.mics_shard_size", size, f"is larger than the world size {world_size}",
                         f"launch at least {size} processes (a multiple of it), or set mics_shard_size to a divisor "
                         f"of {world_size}, or remove it to shard over all ranks")


def _data_parallel_world(root: dict[str, Any], world_size: int | None) -> tuple[int | None, ConfigProblem | None]:
    """The world the batch sizes count: the data-parallel ranks, world / sequence_parallel_size
    ([Note: sequence-parallel layout]: the ranks of a group share their samples)."""
    size = root.get("sequence_parallel_size", 1)
    if world_size is None or not isinstance(size, int) or isinstance(size, bool) or size <= 1:
        return world_size, None
    if world_size % size:
        return world_size, ConfigProblem(
            "sequence_parallel_size", size, f"must divide the world size {world_size}",
            f"launch a multiple of {size} processes, or set sequence_parallel_size to a divisor of {world_size}")
    return world_size // size, None


def _check_arguments(world_size: int | None, hidden_size: int | None, values: dict[str, Any]) -> ProblemList:
    problems = ProblemList()
    for name, value in (("world_size", world_size), ("hidden_size", hidden_size)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            problems.add(name, value, "must be a positive integer", f"pass {name}=<int >= 1> to resolve(...)")
    for name in _BATCH_KEYS + ("warmup_num_steps", "total_num_steps"):
        value = values.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            problems.add(name, value, "must be an integer", f"pass {name}=<int> to resolve(...)")
    return problems


def _precision_as_autocast(root: dict[str, Any], values: dict[str, Any], problems: ProblemList) -> dict[str, Any]:
    """The precision a Trainer or Accelerate asks for, under torch_autocast: it is the autocast's
    dtype, so fp16/bf16 "auto" fill with false ([Note: torch_autocast] in hf_zero_config.py). A
    null ``torch_autocast.dtype`` takes the asked one (``root`` is the resolved copy, written
    here); one that names the other 16-bit dtype is an error."""
    asked = "fp16" if values.get("fp16") else "bf16" if values.get("bf16") else None
    dtype = get_path(root, "torch_autocast.dtype", None)
    written = DTYPE_SPELLINGS.get(dtype.lower()) if isinstance(dtype, str) else None
    if asked is not None and written is None:
        root["torch_autocast"]["dtype"] = {"fp16": "float16", "bf16": "bfloat16"}[asked]
    elif asked is not None and written != asked:
        flag = {"fp16": "--fp16, mixed_precision='fp16'", "bf16": "--bf16, mixed_precision='bf16'"}[asked]
        problems.add("torch_autocast.dtype", dtype, f"{asked} was asked for ({flag}) and the config autocasts to {written}",
                     f"write null to follow the command line, or train with --{written}")
    return {**values, **{name: False for name in ("fp16", "bf16") if name in values}}


def resolve_dict(
    root: dict[str, Any],
    *,
    world_size: int | None,
    hidden_size: int | None,
    check_mismatches: bool,
    values: dict[str, Any],
) -> tuple[dict[str, Any], ProblemList, str | None]:
    """Return (resolved copy, problems, batch note). `root` is left unchanged."""
    problems = _check_arguments(world_size, hidden_size, values)
    resolved = copy.deepcopy(root)
    if get_path(root, "torch_autocast.enabled", False) is True:
        values = _precision_as_autocast(resolved, values, problems)
    if problems:
        return root, problems, None
    if check_mismatches:
        problems += _mismatches(resolved, values)
    filled = _fill_autos(resolved, hidden_size, values)
    problem = _shard_group_larger_than_world(resolved, world_size)
    if problem is not None:
        problems.append(problem)
    world_size, problem = _data_parallel_world(resolved, world_size)
    if problem is not None:
        problems.append(problem)
    batch = _resolve_batch(resolved, world_size, values)
    problems += batch.problems
    for problem in validate(resolved, allow_auto=False, check_batch=False):
        problems.append(_credit_argument(problem, filled))
    return resolved, problems, batch.note


def _credit_argument(problem: ConfigProblem, filled: dict[str, str]) -> ConfigProblem:
    """A filled value that breaks a rule came from resolve(...): say which argument."""
    source = filled.get(problem.path)
    if source is None:
        return problem
    rule = f"{problem.rule} (filled from resolve({source}=...))"
    return ConfigProblem(problem.path, problem.value, rule, problem.fix)


def fillable_paths() -> dict[str, str]:
    """{path: resolve argument} for every key that accepts "auto" (for the docs)."""
    return {spec.path: spec.auto_from for spec in iter_specs() if spec.auto_from is not None}
