"""Check a config dict against the key table and collect every problem (never stop at the first).

Order: normalise DeepSpeed's alternative spellings, walk the tree (unknown keys, types, ranges,
"auto" placement, features turned on that hf_zero does not implement), then the rules that tie
keys together (offload needs a stage, fp16 xor bf16, batch arithmetic, ...). The walk also writes
normalised values back (``5e8`` -> ``500000000``, tuples -> lists), which is why it takes the
private copy made by loading.py.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

from .batch import GAS, MICRO, TOTAL, derive_batch
from .errors import MISSING, ProblemList, echo
from .keys import (
    DEEPSPEED_OPTIMIZERS,
    DEEPSPEED_SCHEDULERS,
    DTYPE_SPELLINGS,
    IMPLEMENTED_OPTIMIZERS,
    IMPLEMENTED_SCHEDULERS,
    REJECTED_KEYS,
    KeySpec,
    Status,
    children_of,
    iter_specs,
)
from .kinds import BadValue, Opaque, Section, closest

__all__ = ["AUTO", "STILL_AUTO_RULE", "as_json", "config_warnings", "validate", "get_path", "present_specs", "canonical_optimizer", "NOT_IMPLEMENTED_RULE"]

AUTO = "auto"
STILL_AUTO_RULE = "is still 'auto' after resolve()"
NOT_IMPLEMENTED_RULE = "accepted by DeepSpeed, not implemented in hf_zero yet"
_ABSENT = object()


def validate(root: dict[str, Any], *, allow_auto: bool, check_batch: bool = True) -> ProblemList:
    """Validate `root` in place; return all problems.

    allow_auto: "auto" is accepted where transformers fills it (before resolve); after resolve
        any "auto" left is a problem.
    check_batch: run the world-size-free batch checks (resolve runs its own, with the world size).
    """
    problems = ProblemList()
    _normalise_aliases(root, "", problems)
    _walk(root, "", root, problems, allow_auto)
    _check_precision(root, problems)
    _check_offload(root, problems)
    _check_shard_groups(root, problems)
    _check_null_sections(root, problems)
    _check_optimizer(root, problems)
    _check_scheduler(root, problems)
    _check_grad_accum_dtype(root, problems)
    if check_batch:
        _check_batch(root, problems)
    return problems


# ---- helpers --------------------------------------------------------------------------------


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def as_json(value: Any) -> str:
    """A value as it is written in the config file (true, null, [0.9, 0.999])."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def get_path(root: dict[str, Any], path: str, default: Any = _ABSENT) -> Any:
    """The value at a dotted path; `default` (or the key table's default) when absent."""
    node: Any = root
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            if default is not _ABSENT:
                return default
            spec = children_of(path.rsplit(".", 1)[0] if "." in path else "").get(path.rsplit(".", 1)[-1])
            return None if spec is None or spec.default is MISSING else spec.default
        node = node[part]
    return node


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == AUTO


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def canonical_optimizer(name: Any) -> str | None:
    """DeepSpeed lower-cases optimizer types; map any casing to its canonical spelling."""
    if not isinstance(name, str):
        return None
    return {n.lower(): n for n in DEEPSPEED_OPTIMIZERS + IMPLEMENTED_OPTIMIZERS}.get(name.lower())


# ---- aliases --------------------------------------------------------------------------------


def _normalise_aliases(section: dict[str, Any], path: str, problems: ProblemList) -> None:
    """Rename DeepSpeed's alternative spellings to the canonical key, keeping key order."""
    children = children_of(path)
    alias_to_name = {alias: spec.name for spec in children.values() for alias in spec.aliases}
    renamed: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for key, value in section.items():
        name = alias_to_name.get(key, key)
        if name in renamed:
            problems.add(
                _join(path, key),
                value,
                f"is the same setting as '{spelled[name]}', given twice",
                f"keep only '{name}'",
            )
            continue
        renamed[name], spelled[name] = value, key
    section.clear()
    section.update(renamed)
    for key, value in section.items():
        spec = children.get(key)
        if spec is not None and isinstance(spec.kind, Section) and isinstance(value, dict):
            _normalise_aliases(value, spec.path, problems)


# ---- the walk -------------------------------------------------------------------------------


def _known_children(section_path: str, root: dict[str, Any]) -> dict[str, KeySpec] | None:
    """Keys allowed in a section; None when the section is passed through unread."""
    children = children_of(section_path)
    if section_path == "optimizer.params":
        kind = canonical_optimizer(get_path(root, "optimizer.type", None))
        if kind not in IMPLEMENTED_OPTIMIZERS:
            return None  # another optimizer type: already an error on optimizer.type
        return {n: s for n, s in children.items() if kind in s.optimizer_types}
    if section_path == "scheduler.params":
        kind = get_path(root, "scheduler.type", None)
        if kind not in DEEPSPEED_SCHEDULERS:
            return None  # a torch scheduler or a typo: reported on scheduler.type
        return {n: s for n, s in children.items() if kind in s.scheduler_types}
    return children


def _walk(section: dict[str, Any], path: str, root: dict[str, Any], problems: ProblemList, allow_auto: bool) -> None:
    known = _known_children(path, root)
    if known is None:
        return
    for key in list(section):
        spec = known.get(key)
        if spec is None:
            _unknown(_join(path, key), key, section[key], path, known, problems)
            continue
        ok, value = _check_value(spec, section[key], root, problems, allow_auto)
        if not ok:
            continue
        section[key] = value
        if isinstance(spec.kind, Section) and isinstance(value, dict):
            _walk(value, spec.path, root, problems, allow_auto)


def _unknown(path: str, key: str, value: Any, section: str, known: dict[str, KeySpec], problems: ProblemList) -> None:
    if path in REJECTED_KEYS:
        problems.add(path, value, *REJECTED_KEYS[path])
        return
    names = list(known) + [alias for spec in known.values() for alias in spec.aliases]
    guess = closest(key, names)
    home = _home_of(key, section)
    if guess is not None:
        fix = f"did you mean '{guess}'?"
    elif home is not None:
        fix = f"did you mean '{home}'? ('{key}' belongs under '{home.rsplit('.', 1)[0]}')"
    elif len(names) <= 12:
        fix = f"remove it; the keys allowed here are {sorted(names)}"
    else:
        fix = f"remove it; see the Config reference for the keys allowed under '{section or 'the top level'}'"
    where = "top-level key (DeepSpeed would ignore it silently)" if not section else f"key in '{section}'"
    problems.add(path, value, f"unknown {where}", fix)


def _home_of(key: str, section: str) -> str | None:
    """Where a key of this name is valid, if it is valid somewhere else."""
    for spec in iter_specs():
        if key in (spec.name, *spec.aliases) and spec.parent != section:
            return spec.path
    return None


def _check_value(
    spec: KeySpec, value: Any, root: dict[str, Any], problems: ProblemList, allow_auto: bool
) -> tuple[bool, Any]:
    if _is_auto(value):
        _check_auto(spec, problems, allow_auto)
        return False, value
    if value is None:
        if not spec.nullable:
            default = "required" if spec.default is MISSING else f"the default is {as_json(spec.default)}"
            fix = f"write a {spec.kind.label}, or remove the key ({default})"
            problems.add(spec.path, None, "must not be null", fix)
        return spec.nullable, value
    try:
        value = spec.kind.coerce(value)
    except BadValue as bad:
        problems.add(spec.path, value, bad.rule, bad.fix)
        return False, value
    broken = spec.check(value) if spec.check is not None else None
    if broken is not None:
        problems.add(spec.path, value, *broken)
        return False, value
    if spec.status is Status.NOT_IMPLEMENTED and not spec.is_off(value) and _gate_on(spec, root):
        problems.add(spec.path, value, f"{NOT_IMPLEMENTED_RULE} ({spec.reason})", _off_fix(spec))
        return False, value
    return True, value


def _check_auto(spec: KeySpec, problems: ProblemList, allow_auto: bool) -> None:
    if spec.auto_from is None:
        default = "" if spec.default is MISSING else f" (DeepSpeed's default is {as_json(spec.default)})"
        problems.add(
            spec.path,
            AUTO,
            "'auto' is only accepted for the keys transformers fills (see the Config reference)",
            f"write a value{default}",
        )
    elif not allow_auto:
        problems.add(spec.path, AUTO, STILL_AUTO_RULE, auto_fix(spec))


def auto_fix(spec: KeySpec) -> str:
    """How to fill an "auto" that resolve(...) could not fill."""
    source = spec.auto_from
    if spec.path in (MICRO, GAS, TOTAL):
        return (
            f"pass {spec.path}=... (or world_size=... with two of the three batch sizes) to resolve(...), "
            "or write a number"
        )
    if source == "hidden_size":
        return "pass hidden_size=... (the model's config.hidden_size) to resolve(...), or write a number"
    if source in ("fp16", "bf16", "stage3_gather_16bit_weights_on_model_save"):
        return f"pass {source}=True/False to resolve(...), or write true/false"
    return f"pass {source}=... to resolve(...), or write a value"


def _gate_on(spec: KeySpec, root: dict[str, Any]) -> bool:
    # A gate still "auto" defers the check to resolve(), which re-validates with the value filled.
    return spec.gate is None or get_path(root, spec.gate, False) is True


def _off_fix(spec: KeySpec) -> str:
    if isinstance(spec.kind, Opaque) and not isinstance(spec.kind, Section):
        return f"remove the '{spec.name}' section"
    return f"remove it or set it to its default ({as_json(spec.default)})"


def present_specs(root: dict[str, Any]) -> Iterator[tuple[str, KeySpec, Any]]:
    """(path, spec, value) for every known key present in a validated dict."""
    yield from _present(root, "", root)


def _present(section: dict[str, Any], path: str, root: dict[str, Any]) -> Iterator[tuple[str, KeySpec, Any]]:
    known = _known_children(path, root) or {}
    for key, value in section.items():
        spec = known.get(key)
        if spec is None:
            continue
        yield spec.path, spec, value
        if isinstance(spec.kind, Section) and isinstance(value, dict):
            yield from _present(value, spec.path, root)


# ---- rules across keys ----------------------------------------------------------------------

_UNREAD_WITHOUT_TYPE = "DeepSpeed silently ignores the section without it"


def _check_precision(root: dict[str, Any], problems: ProblemList) -> None:
    if get_path(root, "fp16.enabled", False) is True and get_path(root, "bf16.enabled", False) is True:
        fix = "set fp16.enabled or bf16.enabled to false"
        problems.add("bf16.enabled", True, "fp16 and bf16 cannot both be enabled", fix)
    power, floor = get_path(root, "fp16.initial_scale_power", 16), get_path(root, "fp16.min_loss_scale", 1)
    dynamic = get_path(root, "fp16.loss_scale", 0) == 0
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (power, floor))
    if get_path(root, "fp16.enabled", False) is True and dynamic and numbers and 0 <= power <= 64 and floor > 2.0**power:
        problems.add("fp16.min_loss_scale", floor,
                     f"is above the initial loss scale 2**initial_scale_power = {2.0 ** power:g}, so the first "
                     "overflow could never lower the scale", f"write at most {2.0 ** power:g}, or raise initial_scale_power")
    if get_path(root, "torch_autocast.enabled", False) is True:
        _check_autocast(root, problems)


def _check_autocast(root: dict[str, Any], problems: ProblemList) -> None:
    """[Note: torch_autocast] in hf_zero.config.hf_zero_config: fp32 weights, so no 16-bit section."""
    for name in ("fp16", "bf16"):
        if get_path(root, f"{name}.enabled", False) is True:
            problems.add(f"{name}.enabled", True,
                         f"cannot be enabled with torch_autocast: {name} keeps {name} weights, torch_autocast fp32 ones",
                         f"set {name}.enabled to false (or \"auto\": the Trainer's --{name} then means torch_autocast), "
                         "or turn torch_autocast off")
    dtype = get_path(root, "torch_autocast.dtype", None)
    short = DTYPE_SPELLINGS.get(str(dtype).lower()) if isinstance(dtype, str) else None
    if short == "fp32":
        problems.add("torch_autocast.dtype", dtype, "autocast to float32 changes nothing",
                     'write "bfloat16", or set torch_autocast.enabled to false')


def _check_offload(root: dict[str, Any], problems: ProblemList) -> None:
    zero = root.get("zero_optimization")
    if not isinstance(zero, dict):
        return
    stage = _int(zero.get("stage", 0))
    for name in ("offload_param", "offload_optimizer"):
        section = zero.get(name)
        if isinstance(section, dict):
            _check_offload_section(name, section, stage, problems)
    optim = zero.get("offload_optimizer")
    ratio = optim.get("ratio", 1.0) if isinstance(optim, dict) else 1.0
    device = optim.get("device", "none") if isinstance(optim, dict) else "none"
    if isinstance(ratio, (int, float)) and 0.0 <= ratio < 1.0 and device != "cpu":
        # DeepSpeed's Twin-Flow: a part of the state on the host, the rest on the device.
        rule = f"partial offload (ratio < 1) is implemented for device \"cpu\" (device is {device!r})"
        problems.add("zero_optimization.offload_optimizer.ratio", ratio, rule,
                     'set offload_optimizer.device to "cpu", or ratio to 1.0')
    for legacy, modern in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        if zero.get(legacy) is not None and zero.get(modern) is not None:
            rule = f"is the deprecated form of '{modern}', which is also given"
            problems.add(f"zero_optimization.{legacy}", zero[legacy], rule, f"remove '{legacy}'")


def _check_shard_groups(root: dict[str, Any], problems: ProblemList) -> None:
    """Hybrid sharding shards states inside a group; stage 0 shards nothing."""
    zero = root.get("zero_optimization")
    if not isinstance(zero, dict):
        return
    size, stage = _int(zero.get("mics_shard_size", -1)), _int(zero.get("stage", 0))
    if size is not None and size > 1 and stage == 0:
        problems.add("zero_optimization.mics_shard_size", size,
                     "hybrid sharding needs ZeRO stage 1, 2 or 3 (stage is 0, which shards nothing)",
                     "set zero_optimization.stage to 1, 2 or 3, or remove mics_shard_size")
    if zero.get("zero_quantized_weights") is True and stage is not None and stage != 3:
        problems.add("zero_optimization.zero_quantized_weights", True,
                     f"ZeRO++ qwZ quantizes stage 3's parameter gathers; stage {stage} keeps every parameter "
                     "gathered and gathers none", "set zero_optimization.stage to 3, or remove zero_quantized_weights")
    if zero.get("zero_quantized_gradients") is True:
        if stage == 0:
            problems.add("zero_optimization.zero_quantized_gradients", True,
                         "ZeRO++ qgZ quantizes the gradient reduce-scatter; stage 0 all-reduces the gradients instead",
                         "set zero_optimization.stage to 1, 2 or 3, or remove zero_quantized_gradients")
        elif size is not None and size > 1:
            problems.add("zero_optimization.zero_quantized_gradients", True,
                         f"with mics_shard_size {size} the reduce-scatter stays inside the shard group and only the "
                         "replicas' all-reduce crosses nodes, which qgZ does not quantize",
                         "remove one: mics_shard_size, or zero_quantized_gradients")
    hpz = _int(zero.get("zero_hpz_partition_size", 1))
    if hpz is not None and hpz > 1:
        offload = zero.get("offload_param")
        offload_device = offload.get("device", "none") if isinstance(offload, dict) else "none"
        if stage is not None and stage != 3:
            problems.add("zero_optimization.zero_hpz_partition_size", hpz,
                         f"ZeRO++ hpZ keeps secondary shards for stage 3's parameter gathers; stage {stage} gathers "
                         "none", "set zero_optimization.stage to 3, or zero_hpz_partition_size to 1")
        elif size is not None and size > 1:
            problems.add("zero_optimization.zero_hpz_partition_size", hpz,
                         f"with mics_shard_size {size} every gather already stays inside its shard group; hpZ's "
                         "secondary shards would cost memory and save no traffic",
                         "use one: mics_shard_size (fewer bytes between nodes, more memory per rank) or "
                         "zero_hpz_partition_size (states sharded over all ranks); see the README's multi-node section")
        elif offload_device in ("cpu", "nvme"):
            problems.add("zero_optimization.zero_hpz_partition_size", hpz,
                         f"hpZ keeps 1/{hpz} of the 16-bit weights on the GPU, which offload_param {offload_device} "
                         "exists to keep off it", "set zero_hpz_partition_size to 1, or offload_param.device to none")


def _check_offload_section(name: str, section: dict[str, Any], stage: int | None, problems: ProblemList) -> None:
    path = f"zero_optimization.{name}"
    device = section.get("device", "none")
    if device == "nvme" and section.get("nvme_path") is None:
        fix = "set nvme_path to a directory on the NVMe drive"
        problems.add(f"{path}.nvme_path", MISSING, "device 'nvme' needs nvme_path", fix)
    if device not in ("cpu", "nvme") or stage is None:
        return
    buffers = _int(section.get("buffer_count", 5))
    if name == "offload_param" and device == "nvme" and buffers is not None and buffers < 1:
        rule = "device 'nvme' reads shards through buffer_count host buffers, so it needs at least one"
        problems.add(f"{path}.buffer_count", section["buffer_count"], rule, "set buffer_count to 1 or more (default 5)")
    if name == "offload_param" and stage != 3:
        rule = f"parameter offload needs ZeRO stage 3 (stage is {stage})"
        problems.add(f"{path}.device", device, rule, "set zero_optimization.stage to 3, or remove offload_param")
    if name == "offload_optimizer" and stage == 0:
        rule = "optimizer offload needs ZeRO stage 1, 2 or 3 (stage is 0)"
        fix = "set zero_optimization.stage to 1, 2 or 3, or remove offload_optimizer"
        problems.add(f"{path}.device", device, rule, fix)


# What a null optimizer / scheduler section does elsewhere: transformers tests `"optimizer" in
# config`, so null makes it leave the optimizer to the config (hf_zero then finds none) and a null
# scheduler leaves the run with none at all (a constant learning rate); DeepSpeed calls
# `param_dict["optimizer"].keys()` and fails with AttributeError. So null is not "absent".
_NULL_SECTION: dict[str, tuple[str, str]] = {
    "optimizer": (
        "transformers then skips building its optimizer and DeepSpeed fails reading it",
        'remove the key to use the Trainer\'s (or your) optimizer, or write {"type": "AdamW", ...}',
    ),
    "scheduler": (
        "transformers then builds no scheduler at all (a constant learning rate) and DeepSpeed fails reading it",
        'remove the key to use the Trainer\'s (or your) scheduler, or write {"type": "WarmupLR", ...}',
    ),
}


def _check_null_sections(root: dict[str, Any], problems: ProblemList) -> None:
    for name, (effect, fix) in _NULL_SECTION.items():
        if name in root and root[name] is None:
            problems.add(name, None, f"null is not the same as leaving the key out: {effect}", fix)


def _check_optimizer(root: dict[str, Any], problems: ProblemList) -> None:
    optimizer = root.get("optimizer")
    if not isinstance(optimizer, dict):
        return
    if "type" not in optimizer:
        rule = f"is required when an optimizer section is given ({_UNREAD_WITHOUT_TYPE})"
        problems.add("optimizer.type", MISSING, rule, 'add "type": "AdamW"')
        return
    name = optimizer["type"]
    if not isinstance(name, str) or _is_auto(name):
        return  # reported by the walk
    canonical = canonical_optimizer(name)
    if canonical in IMPLEMENTED_OPTIMIZERS:
        return
    if canonical is not None or _is_torch_class("torch.optim", name):
        rule = f"{NOT_IMPLEMENTED_RULE} (the {canonical or name} optimizer)"
        fix = 'use "AdamW", "Adam", "Muon" or "Adafactor", or remove the optimizer section and pass your own optimizer'
        problems.add("optimizer.type", name, rule, fix)
    else:
        guess = closest(name.lower(), [n.lower() for n in DEEPSPEED_OPTIMIZERS])
        fix = f"did you mean '{canonical_optimizer(guess)}'?" if guess else 'use "AdamW", "Adam", "Muon" or "Adafactor"'
        problems.add("optimizer.type", name, "unknown optimizer type", fix)
    params = optimizer.get("params")
    rejected = "optimizer.params.max_grad_norm"
    if isinstance(params, dict) and "max_grad_norm" in params:  # params of other types are not walked
        problems.add(rejected, params["max_grad_norm"], *REJECTED_KEYS[rejected])


def _is_torch_class(module_name: str, name: str) -> bool:
    """Whether ``module_name.name`` is a class. torch is imported only here, for a type that is
    none of DeepSpeed's names ([Note: the command imports torch late] in hf_zero.cli)."""
    if not name[:1].isupper():
        return False
    import importlib

    return isinstance(getattr(importlib.import_module(module_name), name, None), type)


def _check_scheduler(root: dict[str, Any], problems: ProblemList) -> None:
    scheduler = root.get("scheduler")
    if not isinstance(scheduler, dict):
        return
    if "type" not in scheduler:
        rule = f"is required when a scheduler section is given ({_UNREAD_WITHOUT_TYPE})"
        problems.add("scheduler.type", MISSING, rule, 'add "type": "WarmupDecayLR"')
        return
    name = scheduler["type"]
    if not isinstance(name, str) or _is_auto(name):
        return  # reported by the walk
    if name in IMPLEMENTED_SCHEDULERS:
        if name in ("WarmupDecayLR", "WarmupCosineLR"):
            _require_total_steps(name, scheduler, problems)
        if isinstance(scheduler.get("params"), dict):
            _check_warmup_direction(name, scheduler["params"], problems)
        return
    if name in DEEPSPEED_SCHEDULERS or _is_torch_class("torch.optim.lr_scheduler", name):
        rule = f"{NOT_IMPLEMENTED_RULE} (the {name} scheduler)"
        fix = 'use "WarmupLR", "WarmupDecayLR" or "WarmupCosineLR", or remove the scheduler section and pass your own'
        problems.add("scheduler.type", name, rule, fix)
        return
    guess = {n.lower(): n for n in DEEPSPEED_SCHEDULERS}.get(name.lower()) or closest(name, DEEPSPEED_SCHEDULERS)
    fix = f"did you mean '{guess}'?" if guess else 'use "WarmupLR", "WarmupDecayLR" or "WarmupCosineLR"'
    problems.add("scheduler.type", name, "unknown scheduler type (names are case-sensitive)", fix)


def _require_total_steps(name: str, scheduler: dict[str, Any], problems: ProblemList) -> None:
    params = scheduler.get("params")
    if not isinstance(params, dict) or "total_num_steps" not in params:
        fix = 'set it, or "auto" to take the Trainer\'s total optimizer steps'
        problems.add("scheduler.params.total_num_steps", MISSING, f"is required by {name}", fix)


def _numbers(value: Any) -> list[float] | None:
    """A warmup LR as a list (one entry, or one per group); None when not all numbers (reported, or "auto")."""
    values = value if isinstance(value, list) else [value]
    ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    return [float(v) for v in values] if ok and values else None


def _check_warmup_direction(name: str, params: dict[str, Any], problems: ProblemList) -> None:
    """Warmup must not lower the learning rate (DeepSpeed runs it backwards without a word)."""
    if name == "WarmupCosineLR":  # warms up from warmup_min_ratio * lr to lr
        ratio = params.get("warmup_min_ratio", 0.0)
        if isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and ratio > 1:
            rule = "is above 1: the warmup would start above the optimizer's lr and lower it"
            problems.add("scheduler.params.warmup_min_ratio", ratio, rule, "write a ratio in [0, 1] (the default is 0)")
        return
    low = _numbers(params.get("warmup_min_lr", 0.0))
    high = _numbers(params.get("warmup_max_lr", 0.001))
    if low is None or high is None:
        return
    if len(low) == 1:  # one number for every group
        low = low * len(high)
    if len(high) == 1:
        high = high * len(low)
    if len(low) == len(high) and any(h < lo for lo, h in zip(low, high)):
        absent = "" if "warmup_max_lr" in params else "(absent: DeepSpeed's default 0.001) "
        rule = (f"{absent}is below warmup_min_lr ({echo(params.get('warmup_min_lr', 0.0))}): the warmup would lower "
                "the learning rate instead of raising it (DeepSpeed accepts this silently)")
        problems.add("scheduler.params.warmup_max_lr", params.get("warmup_max_lr", MISSING), rule,
                     "swap the two: warmup_min_lr is where warmup starts, warmup_max_lr where it ends")


def _check_grad_accum_dtype(root: dict[str, Any], problems: ProblemList) -> None:
    value = get_path(root, "data_types.grad_accum_dtype", None)
    stage = _int(get_path(root, "zero_optimization.stage", 0))
    fp16, bf16 = get_path(root, "fp16.enabled", False), get_path(root, "bf16.enabled", False)
    if not isinstance(value, str) or stage is None or not isinstance(fp16, bool) or not isinstance(bf16, bool):
        return  # unset, or depends on a value still "auto" (checked again by resolve)
    # fp32 always; stages 0-1 may keep the compute dtype (their full gradient buffer), as
    # DeepSpeed's bf16 optimizer allows. Stages 2-3 accumulate into the fp32 gradient shard.
    compute = "fp16" if fp16 else "bf16" if bf16 else "fp32"
    allowed = ["fp32"] if stage >= 2 else sorted({"fp32", compute})
    if DTYPE_SPELLINGS.get(value) not in allowed:
        policy = (f"hf_zero accumulates gradients in fp32 at stage {stage}" if stage >= 2 else
                  f"at stage {stage} gradients accumulate in fp32 or in the compute dtype ({compute})")
        rule = f"{NOT_IMPLEMENTED_RULE} ({policy})"
        fix = " or ".join(f'"{a}"' for a in allowed)
        problems.add("data_types.grad_accum_dtype", value, rule, f"remove it or set it to {fix}")


def _check_batch(root: dict[str, Any], problems: ProblemList) -> None:
    values = [root.get(key) for key in (MICRO, GAS, TOTAL)]
    # "auto" (and values already reported as wrong) are unknown yet, not absent.
    pending = any(v is not None and _int(v) is None for v in values)
    micro, gas, total = (_int(v) for v in values)
    problems.extend(derive_batch(micro, gas, total, None, pending=pending).problems)


# ---- warnings: valid, but probably not what was meant ---------------------------------------


def config_warnings(root: dict[str, Any]) -> list[str]:
    """Values hf_zero runs with that a user would want to hear about (``check-config`` prints
    them; ``HfZeroConfig`` logs them)."""
    found = []
    zero = root.get("zero_optimization") if isinstance(root.get("zero_optimization"), dict) else {}
    for key in ("reduce_bucket_size", "allgather_bucket_size"):
        if zero.get(key) == 0:
            found.append(f"zero_optimization.{key} = 0: one collective per unit group (no bucketing; DeepSpeed "
                         f"rejects 0). Fix: remove it for the default 5e8, or write e.g. 5e7 for smaller buckets")
    if zero.get("stage") == 3 and zero.get("stage3_max_live_parameters") == 0:
        found.append("zero_optimization.stage3_max_live_parameters = 0: no gathered parameter is kept beyond the "
                     "unit in use, so nothing is prefetched. Fix: remove it for the default 1e9")
    found += _scheduler_warnings(root)
    found += _stage3_key_warnings(zero)
    for name in ("offload_param", "offload_optimizer"):
        section = zero.get(name)
        if isinstance(section, dict) and section.get("device") == "nvme" and isinstance(section.get("nvme_path"), str):
            path = section["nvme_path"]
            if os.path.isfile(path):  # a warning: the config may be checked on another machine than the run's
                found.append(f"zero_optimization.{name}.nvme_path = {echo(path)} is a file on this machine; offload "
                             "writes its files into a directory. Fix: point nvme_path at a directory on the NVMe drive")
            elif not os.path.exists(path):
                found.append(f"zero_optimization.{name}.nvme_path = {echo(path)} does not exist on this machine. Fix: "
                             "create it on every machine before training, or point it at a directory on the NVMe drive")
    return found


def _stage3_key_warnings(zero: dict[str, Any]) -> list[str]:
    """stage3_* keys set below stage 3 do nothing. A warning, not an error: Accelerate's generated
    config writes stage3_gather_16bit_weights_on_model_save at every stage, and DeepSpeed accepts
    them silently. Values left at their default or "auto" (filled by the tools) are not reported."""
    stage = _int(zero.get("stage", 0))
    if stage is None or stage == 3:
        return []
    found = []
    for key, value in zero.items():
        spec = children_of("zero_optimization").get(key)
        if not key.startswith("stage3_") or spec is None or _is_auto(value) or value == spec.default:
            continue
        found.append(f"zero_optimization.{key} = {as_json(value)} has no effect at ZeRO stage {stage}: only stage 3 "
                     "reads the stage3_* keys (DeepSpeed ignores them silently). Fix: remove it, or set "
                     "zero_optimization.stage to 3")
    return found


def _scheduler_warnings(root: dict[str, Any]) -> list[str]:
    scheduler = root.get("scheduler")
    params = scheduler.get("params") if isinstance(scheduler, dict) else None
    if not isinstance(params, dict) or scheduler.get("type") not in ("WarmupDecayLR", "WarmupCosineLR"):
        return []
    total, warmup = params.get("total_num_steps"), params.get("warmup_num_steps", 1000)
    if isinstance(total, int) and isinstance(warmup, int) and total < warmup:
        return [f"scheduler.params.total_num_steps = {total} is below warmup_num_steps ({warmup}): {scheduler['type']} "
                "ends before its warmup does, so the learning rate never reaches warmup_max_lr. Fix: write at least "
                f"{warmup}, or shorten warmup_num_steps"]
    return []
