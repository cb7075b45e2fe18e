"""Resuming a DeepSpeed ZeRO checkpoint: convert it once into an hf_zero checkpoint, which
``engine.load_checkpoint`` then loads at any world size and stage like one hf_zero saved.

[Note: DeepSpeed's flat partitions]
DeepSpeed keeps the fp32 masters of each *flat group* as one flat buffer split across the
data-parallel ranks, and Adam's moments exactly as the master they step (DeepSpeed's own
``zero_to_fp32.py`` reconstructs the masters this way; the moments follow the same cuts). A
flat group's parameters, names and shapes are in ``param_shapes`` of the model-states file, in
buffer order:

- ZeRO-1/2 (``zero_pp_rank_R_..._optim_states.pt``, ``bf16_`` prefixed under bf16): one flat
  group per optimizer param group. Each parameter is followed by its alignment padding
  (``param_alignment_paddings``), and the buffer is padded at the end to split in equal
  partitions, rank r holding ``[r * P, (r + 1) * P)``; only the last rank holds padding
  (``group_paddings``). The masters are saved without that padding, the moments with it (or
  without, in DeepSpeed's elastic format). BF16_Optimizer (bf16 at stage 1 with fp32 gradient
  accumulation) writes the same layout, its masters with the padding too.
- ZeRO-3: one flat group per *sub-group* (``sub_group_size`` elements of one param group);
  each parameter is split on its own, rank r holding elements ``[r * c, (r + 1) * c)`` of it
  (``c = ceil(numel / world)``, the last rank padded), and a rank's flat buffer is its slices of
  the sub-group's parameters back to back (``fp32_flat_groups``).

Each parameter is therefore a list of :class:`Piece` s (a slice of one rank's tensor), the same
for the master and for each moment of its flat group. Every size is checked against these
rules before anything is written: a partition that does not add up is refused, naming the file.

[Note: importing DeepSpeed checkpoints]
:func:`import_deepspeed_checkpoint` writes an ordinary hf_zero checkpoint of world size 1: one
group per DeepSpeed flat group, its slots the parameters by name (tied names as DeepSpeed's
``shared_params`` says), the fp32 master as ``param`` and the moments as ``optim.exp_avg`` /
``optim.exp_avg_sq``; frozen parameters (their compute-dtype values) in groups of their own;
persistent buffers. Loading it reshards by name at any world size and stage ([Note: resharding
by name]), so the loader needs nothing of DeepSpeed. DeepSpeed steps a flat group with one
``step``; every parameter of the group gets that count (``slot_steps``: [Note: one step count
per group]). Carried over too: the optimizer hyperparameters of each param group (lr, betas,
eps, weight_decay and the decoupled flag), the scheduler state (DeepSpeed's warmup schedulers
save the keys hf_zero's do), the fp16 loss scaler with ``skipped_steps`` (hf_zero counts them
there), ``global_steps``, ``global_samples`` and ``client_state``.
Not carried over: RNG states (DeepSpeed saves none), the data sampler and random-LTD states,
checkpoints with tensor or pipeline parallelism or MoE experts, and optimizers other than
Adam/AdamW (no other state is read; AMSGrad, ``maximize`` and ``bias_correction=False`` are
refused). The CRC-32 of every zip member of every file is checked before the file is read
([Note: DeepSpeed's pickles]). The rank file is streamed a slice at a time and every value is
checked finite as it is written; the folder is published only when complete (as a save is:
[Note: atomic save]).
"""

from __future__ import annotations

import math
import os
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import torch
from torch import nn

from hf_zero.checkpoint.converted import CARRIED_HYPER, TARGET_OPTIMIZERS, check_conversion_target, write_converted
from hf_zero.checkpoint.deepspeed_files import (
    DeepSpeedFolder, DynamicLossScalerRecord, LossScalerRecord, find_files, is_deepspeed_checkpoint,
    load_deepspeed_file, plain_ordered,
)
from hf_zero.checkpoint.errors import CheckpointError, listed
from hf_zero.checkpoint.manifest import (
    BUFFER_PREFIX, FORMAT, FORMAT_VERSION, OPTIM_PREFIX, PARAM_KEY, check_plain_json, check_tag,
    describe_model, encode_state, persistent_buffers, tensor_name,
)
from hf_zero.checkpoint.safetensors_io import DTYPE_TAGS, TensorEntry
from hf_zero.checkpoint.validate import check_run_state

if TYPE_CHECKING:
    from hf_zero.checkpoint.engine_state import EngineState

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")
# The keys DeepSpeed writes at the top of the model-states file; any other key is client_state.
DEEPSPEED_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
    "ds_version", "checkpoint_parallel_dimensions", "csr_tensor_module_names", "universal_checkpoint_info",
    "num_experts", "ds_autoep_layers", "autoep_layers",
})
UNIT = "deepspeed"
_CHUNK_NUMEL = 1 << 22  # elements checked and written at a time


@dataclass(frozen=True)
class Piece:
    """Elements [lo, hi) of source tensor ``source`` (one rank's partition) are the next
    elements of a parameter; see [Note: DeepSpeed's flat partitions]."""

    source: int
    lo: int
    hi: int


@dataclass
class ImportedParam:
    name: str
    shape: tuple[int, ...]
    pieces: list[Piece]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class FlatGroup:
    """One DeepSpeed flat group: a param group at stages 1-2, a sub-group at stage 3."""

    index: int
    param_group: int  # the optimizer param group it steps in
    params: list[ImportedParam]
    tensors: dict[str, list[torch.Tensor]]  # PARAM_KEY (the fp32 master) and the moments: one per rank
    step: int | None  # None: saved before the first optimizer step (no moments)


@dataclass
class FrozenParam:
    param: ImportedParam
    fragments: list[torch.Tensor]  # the pieces' sources


@dataclass
class DeepSpeedCheckpoint:
    """A DeepSpeed ZeRO checkpoint, read and checked; tensors are memory-mapped slices."""

    folder: DeepSpeedFolder
    stage: int
    dp_world_size: int
    groups: list[FlatGroup]
    frozen: list[FrozenParam]
    buffers: dict[str, torch.Tensor]
    shared_params: dict[str, str]
    hyper: list[dict[str, Any]]  # the carried hyperparameters of each optimizer param group
    counters: dict[str, int]  # global_steps, micro_steps, global_samples, skipped_steps
    scheduler: dict[str, Any] | None  # {"class", "state"}
    loss_scaler: dict[str, Any] | None  # {"class", "state"}, hf_zero's keys
    client_state: dict[str, Any]
    compute_dtype: str
    ds_version: str


def _problem(path: str, message: str) -> CheckpointError:
    return CheckpointError(f"{path}: {message}; it was edited or damaged, or written by a DeepSpeed layout this "
                           "import does not read")


def _require(condition: bool, path: str, message: str) -> None:
    if not condition:
        raise _problem(path, message)


def _count(value: Any, path: str, what: str, low: int = 0) -> int:
    """A non-negative integer (a 0-d tensor or an integral float too, as DeepSpeed's steps are)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dim() == 0:
        value = value.item()
    if isinstance(value, float) and math.isfinite(value) and value == int(value):
        value = int(value)
    _require(isinstance(value, int) and not isinstance(value, bool) and value >= low, path,
             f"{what} is {value!r:.60}, expected an integer >= {low}")
    return int(value)


def _flat(value: Any, path: str, what: str, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
    ok = isinstance(value, torch.Tensor) and value.dim() == 1 and (dtype is None or value.dtype == dtype)
    found = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
    _require(ok, path, f"{what} is {found}, expected a flat {dtype or 'floating'} tensor")
    if dtype is None:
        _require(value.dtype in DTYPE_TAGS and value.is_floating_point(), path, f"{what} is {value.dtype}")
    return value


def _item(seq: Any, index: int, path: str, what: str) -> Any:
    _require(isinstance(seq, (list, tuple)) and index < len(seq), path, f"{what} has no entry {index}")
    return seq[index]


def _shapes(value: Any, path: str, what: str) -> list[tuple[str, tuple[int, ...]]]:
    """``name -> torch.Size`` in saved order."""
    _require(isinstance(value, dict), path, f"{what} is not a dict of parameter shapes")
    shapes = []
    for name, shape in value.items():
        ok = isinstance(name, str) and isinstance(shape, (tuple, list)) and all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        _require(ok, path, f"{what}[{name!r:.80}] is {shape!r:.60}, not a shape")
        shapes.append((name, tuple(int(d) for d in shape)))
    return shapes


# --------------------------------------------------------------------------- optimizer state
def _adam_state(states: list[Any], sizes: list[tuple[int, ...]], paths: list[str],
                what: str) -> tuple[dict[str, list[torch.Tensor]], int | None]:
    """The moments (one tensor per rank, of one of the sizes ``sizes[r]`` allows) and the step of
    one flat group; ``({}, None)`` before the first step."""
    if all(isinstance(s, dict) and not s for s in states):
        return {}, None
    moments: dict[str, list[torch.Tensor]] = {key: [] for key in ADAM_MOMENTS}
    steps = []
    for state, allowed, path in zip(states, sizes, paths):
        keys = sorted(state) if isinstance(state, dict) else None
        if keys != sorted(("step",) + ADAM_MOMENTS):
            raise NotImplementedError(
                f"{path}: the optimizer state of {what} holds {keys}, not Adam's step, exp_avg and exp_avg_sq: only "
                "Adam/AdamW checkpoints can be imported (the optimizer and every rank must have stepped)")
        for key in ADAM_MOMENTS:
            tensor = _flat(state[key], path, f"{key} of {what}")
            _require(tensor.numel() in allowed, path, f"{key} of {what} has {tensor.numel()} elements, expected "
                     f"{' or '.join(map(str, sorted(set(allowed))))} as its fp32 partition")
            moments[key].append(tensor)
        steps.append(_count(state["step"], path, f"step of {what}"))
    _require(len(set(steps)) == 1, paths[0], f"the ranks of {what} are at different optimizer steps {steps}")
    return moments, steps[0]


def _carried_hyper(group: Any, path: str, index: int) -> dict[str, Any]:
    _require(isinstance(group, dict), path, f"param_groups[{index}] is not a dict")
    unsupported = (("amsgrad", True), ("maximize", True), ("bias_correction", False))
    refused = [f"{key}={group[key]!r}" for key, bad in unsupported if key in group and group[key] == bad]
    if refused:
        raise NotImplementedError(f"{path}: param_groups[{index}] has {', '.join(refused)}; hf_zero's Adam/AdamW "
                                  "does not step that way, so this optimizer state cannot be imported")
    return {key: tuple(group[key]) if key == "betas" and isinstance(group[key], list) else group[key]
            for key in CARRIED_HYPER if key in group}


# --------------------------------------------------------------------------- stages 1 and 2
def _lean_numels(masters: list[torch.Tensor], pads: list[int], masters_padded: bool, path: str, what: str) -> list[int]:
    """Each rank's elements of the flat buffer without the end padding ([Note: DeepSpeed's flat
    partitions])."""
    padded = [m.numel() + (0 if masters_padded else pad) for m, pad in zip(masters, pads)]
    _require(len(set(padded)) == 1, path, f"the ranks' partitions of {what} have different sizes {padded}")
    _require(all(p == 0 for p in pads[:-1]) and pads[-1] <= padded[0], path,
             f"group_paddings {pads} of {what}: only the last rank holds padding, less than a partition")
    return [padded[0] - pad for pad in pads]


def _cut(shapes: list[tuple[str, tuple[int, ...]]], gaps: list[int], lean: list[int], path: str,
         what: str) -> list[ImportedParam]:
    """Parameters laid end to end (each followed by its alignment gap) in the concatenation of
    the ranks' partitions of ``lean`` elements each."""
    starts = [sum(lean[:r]) for r in range(len(lean))]
    params, offset = [], 0
    for (name, shape), gap in zip(shapes, gaps):
        lo, hi = offset, offset + math.prod(shape)
        pieces = [Piece(r, max(lo, s) - s, min(hi, s + n) - s)
                  for r, (s, n) in enumerate(zip(starts, lean)) if max(lo, s) < min(hi, s + n)]
        params.append(ImportedParam(name, shape, pieces))
        offset = hi + gap
    _require(offset == sum(lean), path, f"the parameters of {what} take {offset} elements with their alignment, "
             f"the ranks' partitions hold {sum(lean)}")
    return params


def _zero12_states(optim: list[dict], index: int, paths: list[str]) -> list[Any]:
    """Each rank's optimizer state of flat group ``index``: DeepSpeed's rigid format (the inner
    optimizer's ``state_dict``, one flat tensor per param group) or its elastic one (a list)."""
    states = []
    for state, path in zip(optim, paths):
        base = state.get("base_optimizer_state")
        if isinstance(base, list):
            entry = _item(base, index, path, "base_optimizer_state")
            _require(isinstance(entry, dict), path, f"base_optimizer_state[{index}] is not a dict")
            entry = dict(entry)
            if "step" not in entry and "base_optimizer_state_step" in state:
                entry["step"] = state["base_optimizer_state_step"]
            states.append(entry)
            continue
        _require(isinstance(base, dict) and isinstance(base.get("state"), dict), path,
                 "base_optimizer_state is neither the optimizer's state_dict nor a list of group states")
        group = _item(base.get("param_groups"), index, path, "base_optimizer_state.param_groups")
        _require(isinstance(group, dict) and list(group.get("params", [])) == [index], path,
                 f"base_optimizer_state.param_groups[{index}] does not hold flat tensor {index} alone")
        states.append(base["state"].get(index, {}))
    return states


def _zero12_hyper(optim0: dict, count: int, path: str) -> list[dict[str, Any]]:
    base = optim0.get("base_optimizer_state")
    if not isinstance(base, dict):  # elastic format: no hyperparameters saved
        return [{} for _ in range(count)]
    groups = base.get("param_groups")
    _require(isinstance(groups, list) and len(groups) == count, path,
             f"base_optimizer_state has {len(groups) if isinstance(groups, list) else 'no'} param groups, "
             f"param_shapes {count}")
    return [_carried_hyper(group, path, i) for i, group in enumerate(groups)]


def _zero12_groups(shape_groups: list[Any], optim: list[dict], paths: list[str], model_path: str) -> list[FlatGroup]:
    masters_padded = "zero_stage" not in optim[0]  # BF16_Optimizer keeps the end padding in its masters
    alignment = optim[0].get("param_alignment_paddings")
    groups = []
    for g, saved_shapes in enumerate(shape_groups):
        what = f"param group {g}"
        shapes = _shapes(saved_shapes, model_path, f"param_shapes[{g}]")
        masters = [_flat(_item(s.get("single_partition_of_fp32_groups"), g, p, "single_partition_of_fp32_groups"), p,
                         f"the fp32 partition of {what}") for s, p in zip(optim, paths)]
        pads = [_count(_item(s.get("group_paddings"), g, p, "group_paddings"), p, "group_paddings")
                for s, p in zip(optim, paths)]
        lean = _lean_numels(masters, pads, masters_padded, paths[-1], what)
        gaps = _item(alignment, g, paths[0], "param_alignment_paddings") if alignment is not None else [0] * len(shapes)
        _require(isinstance(gaps, (list, tuple)) and len(gaps) == len(shapes), paths[0],
                 f"param_alignment_paddings[{g}] is not one padding for each of the {len(shapes)} parameters")
        params = _cut(shapes, [_count(x, paths[0], "an alignment padding") for x in gaps], lean, paths[-1], what)
        # the moments of a partition with or without its end padding ([Note: DeepSpeed's flat partitions])
        sizes = [(n, n + pad) for n, pad in zip(lean, pads)]
        moments, step = _adam_state(_zero12_states(optim, g, paths), sizes, paths, what)
        groups.append(FlatGroup(g, g, params, {PARAM_KEY: masters, **moments}, step))
    return groups


# --------------------------------------------------------------------------- stage 3
def _zero3_param_groups(inner: dict, count: int, path: str) -> tuple[list[int], list[dict[str, Any]]]:
    """Which param group each sub-group steps in, and the groups' hyperparameters."""
    groups = inner.get("param_groups")
    _require(isinstance(groups, list) and groups, path, "optimizer_state_dict.param_groups is missing")
    member = [i for i, group in enumerate(groups) for _ in (group.get("params", []) if isinstance(group, dict) else [])]
    order = [k for group in groups if isinstance(group, dict) for k in group.get("params", [])]
    _require(order == list(range(count)), path, f"the param groups hold sub-groups {order}, expected 0 to {count - 1} "
             "in order")
    return member, [_carried_hyper(group, path, i) for i, group in enumerate(groups)]


def _zero3_group(k: int, shapes: list[tuple[str, tuple[int, ...]]], optim: list[dict], paths: list[str],
                 param_group: int) -> FlatGroup:
    world, what = len(optim), f"sub-group {k}"
    params, local = [], 0
    for name, shape in shapes:
        numel = math.prod(shape)
        chunk = -(-numel // world)
        pieces = [Piece(r, local, local + min(chunk, numel - r * chunk)) for r in range(world) if numel > r * chunk]
        params.append(ImportedParam(name, shape, pieces))
        local += chunk
    masters = []
    for state, path in zip(optim, paths):
        master = _flat(_item(state.get("fp32_flat_groups"), k, path, "fp32_flat_groups"), path,
                       f"the fp32 partition of {what}")
        _require(master.numel() == local, path, f"the fp32 partition of {what} has {master.numel()} elements, its "
                 f"parameters' partitions {local}")
        masters.append(master)
    inner_states = [s["optimizer_state_dict"].get("state") for s in optim]
    _require(all(isinstance(s, dict) for s in inner_states), paths[0], "optimizer_state_dict.state is missing")
    moments, step = _adam_state([s.get(k, {}) for s in inner_states], [(local,)] * world, paths, what)
    return FlatGroup(k, param_group, params, {PARAM_KEY: masters, **moments}, step)


def _zero3_groups(shape_groups: list[Any], optim: list[dict], paths: list[str],
                  model_path: str) -> tuple[list[FlatGroup], list[dict[str, Any]]]:
    for state, path in zip(optim, paths):
        _require(isinstance(state.get("optimizer_state_dict"), dict), path, "optimizer_state_dict is missing")
    member, hyper = _zero3_param_groups(optim[0]["optimizer_state_dict"], len(shape_groups), paths[0])
    groups = [_zero3_group(k, _shapes(s, model_path, f"param_shapes[{k}]"), optim, paths, member[k])
              for k, s in enumerate(shape_groups)]
    return groups, hyper


# --------------------------------------------------------------------------- the model states
def _frozen(models: list[dict], paths: list[str], stage3: bool, trainable: set[str], buffers: set[str],
            shared: set[str]) -> list[FrozenParam]:
    """Parameters no optimizer steps: DeepSpeed's ``frozen_param_fragments`` (whole at stages
    1-2, one slice per rank at stage 3), or at stage 1 the full values in ``module``."""
    shapes_value = models[0].get("frozen_param_shapes")
    if not shapes_value:
        if stage3:
            return []
        rest = {n: t for n, t in models[0]["module"].items() if n not in trainable | buffers | shared}
        for name, value in rest.items():
            _require(isinstance(value, torch.Tensor), paths[0], f"module[{name!r:.80}] is not a tensor")
        return [FrozenParam(ImportedParam(n, tuple(t.shape), [Piece(0, 0, t.numel())]),
                            [_flat(t.reshape(-1), paths[0], f"frozen parameter {n}", dtype=None)])
                for n, t in rest.items()]
    frozen = []
    for name, shape in _shapes(shapes_value, paths[0], "frozen_param_shapes"):
        sources = models if stage3 else models[:1]
        fragments = []
        for model, path in zip(sources, paths):
            table = model.get("frozen_param_fragments")
            _require(isinstance(table, dict) and name in table, path, f"frozen_param_fragments lacks {name}")
            value = table[name]
            fragments.append(_flat(value.reshape(-1) if isinstance(value, torch.Tensor) else value, path,
                                   f"frozen parameter {name}", dtype=None))
        numel, world = math.prod(shape), len(fragments)
        chunk = -(-numel // world)
        _require(all(f.numel() == chunk for f in fragments), paths[0], f"frozen parameter {name} {shape} has "
                 f"fragments of {[f.numel() for f in fragments]} elements, expected {chunk} on each of {world}")
        _require(len({f.dtype for f in fragments}) == 1, paths[0], f"the fragments of frozen parameter {name} have "
                 f"different dtypes {sorted(str(f.dtype) for f in fragments)}")
        pieces = [Piece(r, 0, min(chunk, numel - r * chunk)) for r in range(world) if numel > r * chunk]
        frozen.append(FrozenParam(ImportedParam(name, shape, pieces), fragments))
    return frozen


def _buffers(model0: dict, path: str) -> dict[str, torch.Tensor]:
    names = model0.get("buffer_names") or []
    _require(isinstance(names, list) and all(isinstance(n, str) for n in names), path,
             "buffer_names is not a list of names")
    found = {}
    for name in names:
        value = model0["module"].get(name)
        _require(isinstance(value, torch.Tensor) and value.dtype in DTYPE_TAGS, path,
                 f"buffer {name} is {type(value).__name__}, not a tensor of a dtype safetensors stores")
        found[name] = value
    return found


def _gradient_accumulation_steps(config: Mapping[str, Any], dp_world_size: int) -> int:
    """DeepSpeed's own resolution of the accumulation steps from its saved config."""
    gas, micro, batch = (config.get(k) for k in ("gradient_accumulation_steps", "train_micro_batch_size_per_gpu",
                                                   "train_batch_size"))
    if isinstance(gas, int) and gas >= 1:
        return gas
    if isinstance(micro, int) and isinstance(batch, int) and micro >= 1 and batch >= micro * dp_world_size:
        return batch // (micro * dp_world_size)
    return 1


def _enabled(config: Mapping[str, Any], key: str) -> bool:
    section = config.get(key)
    return isinstance(section, dict) and section.get("enabled") is True


def _loss_scaler(config: Mapping[str, Any], optim0: dict, skipped: int, path: str) -> dict[str, Any] | None:
    """The fp16 loss scaler in hf_zero's keys (a bf16 or fp32 run has none)."""
    if not _enabled(config, "fp16"):
        return None
    record = optim0.get("loss_scaler")
    _require(isinstance(record, (LossScalerRecord, DynamicLossScalerRecord)), path,
             f"loss_scaler is {type(record).__name__}, not DeepSpeed's LossScaler or DynamicLossScaler")
    state = record.state
    if isinstance(record, LossScalerRecord) or not state.get("dynamic", True):
        return {"class": "LossScaler", "state": {"dynamic": False, "cur_scale": state.get("cur_scale"),
                                                 "skipped_steps": skipped}}
    keys = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
    return {"class": "DynamicLossScaler",
            "state": {"dynamic": True, **{k: state.get(k) for k in keys}, "skipped_steps": skipped}}


def _scheduler(model0: dict, config: Mapping[str, Any], path: str) -> dict[str, Any] | None:
    state = model0.get("lr_scheduler")
    if state is None:
        return None
    _require(isinstance(state, dict), path, f"lr_scheduler is a {type(state).__name__}, not a state_dict")
    section = config.get("scheduler")
    kind = section.get("type") if isinstance(section, dict) else None
    return {"class": kind if isinstance(kind, str) else "DeepSpeed client scheduler",
            "state": encode_state(plain_ordered(state), f"{path}: lr_scheduler")}


def _client_state(model0: dict, path: str) -> dict[str, Any]:
    client = plain_ordered({k: v for k, v in model0.items() if k not in DEEPSPEED_KEYS})
    try:
        check_plain_json(client)
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: {exc}; hf_zero keeps client_state as JSON, so re-save the DeepSpeed "
                              "checkpoint with plain values in client_state") from exc
    return client


def _counters(model0: dict, config: Mapping[str, Any], path: str, dp_world_size: int) -> dict[str, int]:
    steps = _count(model0.get("global_steps"), path, "global_steps")
    return {
        "global_steps": steps,
        "micro_steps": steps * _gradient_accumulation_steps(config, dp_world_size),
        "global_samples": _count(model0.get("global_samples", 0), path, "global_samples"),
        "skipped_steps": _count(model0.get("skipped_steps", 0), path, "skipped_steps"),
    }


def _compute_dtype(config: Mapping[str, Any]) -> str:
    if _enabled(config, "bf16") or _enabled(config, "bfloat16"):
        return "bfloat16"
    return "float16" if _enabled(config, "fp16") else "float32"


# --------------------------------------------------------------------------- reading
def _check_topology(model0: dict, optim: list[dict], folder: DeepSpeedFolder) -> int:
    """The ZeRO stage, after checking the files agree on it and on the data-parallel size."""
    path, world = folder.model_files[0], len(folder.optim_files)
    _require(isinstance(model0.get("module"), dict), path, "no 'module' state dict")
    _require(model0.get("optimizer") is None, path, "holds a whole optimizer state: a checkpoint without ZeRO")
    if model0.get("mp_world_size", 1) != 1:
        raise NotImplementedError(f"{path}: mp_world_size is {model0['mp_world_size']}; importing a checkpoint with "
                                  "tensor or pipeline parallelism is not supported")
    if any(model0.get(k) for k in ("num_experts", "ds_autoep_layers", "autoep_layers")):
        raise NotImplementedError(f"{path}: a checkpoint with MoE experts; importing one is not supported")
    _require(model0.get("dp_world_size", world) == world, path,
             f"dp_world_size is {model0.get('dp_world_size')}, but {world} optimizer files are present")
    stages = [s.get("zero_stage", 1) for s in optim]  # BF16_Optimizer (stage 1) writes none
    stage = stages[0] if all(isinstance(x, int) and x == stages[0] for x in stages) else -1
    _require(stage in (1, 2, 3) and (stage == 3) == folder.stage3, folder.optim_files[0],
             f"zero_stage {stages} does not match the files of a stage-{'3' if folder.stage3 else '1/2'} checkpoint")
    for state, file in zip(optim, folder.optim_files):
        counts = state.get("partition_count")
        counts = counts if isinstance(counts, list) else [counts]
        _require(all(c == world for c in counts), file, f"partition_count {state.get('partition_count')} is not the "
                 f"{world} ranks whose files are present")
    return int(stage)


def _optim_state(loaded: Any, path: str) -> dict:
    _require(isinstance(loaded, dict) and isinstance(loaded.get("optimizer_state_dict"), dict), path,
             "no 'optimizer_state_dict' (not a DeepSpeed ZeRO optimizer file)")
    return loaded["optimizer_state_dict"]


def read_deepspeed_checkpoint(ds_dir: str | os.PathLike[str], tag: str | None = None) -> DeepSpeedCheckpoint:
    """Read and check a DeepSpeed ZeRO-1/2/3 checkpoint (see [Note: DeepSpeed's pickles] and
    [Note: DeepSpeed's flat partitions]); finiteness is checked when the values are written."""
    folder = find_files(ds_dir, tag)
    try:
        return _read(folder)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:  # a value of an unexpected kind
        raise CheckpointError(f"{folder.tag_dir}: malformed DeepSpeed checkpoint ({type(exc).__name__}: {exc}); it "
                              "was edited or damaged, or written by a DeepSpeed layout this import does not read") from exc


def _read(folder: DeepSpeedFolder) -> DeepSpeedCheckpoint:
    models = [load_deepspeed_file(p) for p in folder.model_files]
    optim = [_optim_state(load_deepspeed_file(p), p) for p in folder.optim_files]
    model0, model_path = models[0], folder.model_files[0]
    _require(all(isinstance(m, dict) for m in models), model_path, "not a dict of model states")
    stage = _check_topology(model0, optim, folder)
    shape_groups = model0.get("param_shapes")
    _require(isinstance(shape_groups, list) and shape_groups, model_path, "param_shapes is missing")
    if folder.stage3:
        groups, hyper = _zero3_groups(shape_groups, optim, folder.optim_files, model_path)
    else:
        groups = _zero12_groups(shape_groups, optim, folder.optim_files, model_path)
        hyper = _zero12_hyper(optim[0], len(groups), folder.optim_files[0])
    _require(len({g.step is None for g in groups}) == 1, folder.optim_files[0],
             "some flat groups have optimizer state and others none")
    config = model0.get("ds_config") if isinstance(model0.get("ds_config"), dict) else {}
    shared = model0.get("shared_params") or {}
    _require(isinstance(shared, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in shared.items()),
             model_path, "shared_params is not a dict of names")
    buffers = _buffers(model0, model_path)
    trainable = {p.name for g in groups for p in g.params}
    frozen = _frozen(models, folder.model_files, folder.stage3, trainable, set(buffers), set(shared))
    counters = _counters(model0, config, model_path, len(optim))
    return DeepSpeedCheckpoint(
        folder, stage, len(optim), groups, frozen, buffers, dict(shared), hyper, counters,
        _scheduler(model0, config, model_path),
        _loss_scaler(config, optim[0], counters["skipped_steps"], folder.optim_files[0]),
        _client_state(model0, model_path), _compute_dtype(config), str(model0.get("ds_version", "unknown")),
    )


# --------------------------------------------------------------------------- checks against the model
def _all_params(ds: DeepSpeedCheckpoint) -> list[ImportedParam]:
    return [p for g in ds.groups for p in g.params] + [f.param for f in ds.frozen]


def check_against_model(ds: DeepSpeedCheckpoint, model: nn.Module) -> None:
    """Names and shapes of every parameter (first names of tied ones) and persistent buffer."""
    current = {n: tuple(p.shape) for n, p in model.named_parameters()}
    saved = {p.name: p.shape for p in _all_params(ds)}
    problems = [f"{n} {s} is not in the checkpoint" for n, s in current.items() if n not in saved]
    problems += [f"{n} is {saved[n]} in the checkpoint, {s} in the model" for n, s in current.items()
                 if n in saved and saved[n] != s]
    problems += [f"{n} {s} is in the checkpoint, not in the model" for n, s in saved.items() if n not in current]
    buffers = dict(persistent_buffers(model))
    problems += [f"buffer {n} is {tuple(t.shape)} in the checkpoint, {tuple(buffers[n].shape)} in the model"
                 for n, t in ds.buffers.items() if n in buffers and buffers[n].shape != t.shape]
    if problems:
        shown = listed(problems, 5)
        raise CheckpointError(f"{ds.folder.tag_dir}: the DeepSpeed checkpoint holds a different model than the "
                              f"{type(model).__name__} given ({len(problems)} mismatches): {shown}")


# --------------------------------------------------------------------------- writing
def _chunks(param: ImportedParam, sources: list[torch.Tensor], files: list[str], what: str) -> Iterator[torch.Tensor]:
    """A parameter's elements from its pieces, checked finite (see [Note: verified loads])."""
    for piece in param.pieces:
        for lo in range(piece.lo, piece.hi, _CHUNK_NUMEL):
            chunk = sources[piece.source][lo:min(lo + _CHUNK_NUMEL, piece.hi)]
            if not bool(torch.isfinite(chunk).all()):
                raise CheckpointError(f"{files[piece.source]}: {what} of {param.name} holds inf or nan values: the "
                                      "run had diverged when it was saved; import an earlier checkpoint")
            yield chunk


@dataclass(frozen=True)
class _Part:
    """The parameters of one written group and where each one's pieces come from."""

    label: str
    params: list[ImportedParam]
    sources: list[list[torch.Tensor]]  # per parameter: its pieces' source tensors
    files: list[str]  # the file of each source, for messages

    def entry(self, key: str, dtype: torch.dtype, sources: list[list[torch.Tensor]] | None = None) -> TensorEntry:
        def produce() -> Iterator[torch.Tensor]:
            for param, param_sources in zip(self.params, sources or self.sources):
                yield from _chunks(param, param_sources, self.files, key)
        return TensorEntry(tensor_name(self.label, key), dtype, (sum(p.numel for p in self.params),), produce)


def _slots(params: list[ImportedParam]) -> list[dict[str, Any]]:
    offsets = [sum(p.numel for p in params[:i]) for i in range(len(params))]
    return [{"name": p.name, "shape": list(p.shape), "offset": o, "numel": p.numel} for p, o in zip(params, offsets)]


def _record(label: str, param_group: int | None, params: list[ImportedParam], tensors: dict[str, str],
            scalars: dict[str, Any]) -> dict[str, Any]:
    numel = sum(p.numel for p in params)
    return {"unit": UNIT, "group": label, "trainable": param_group is not None, "persistent": False,
            "param_group": param_group if param_group is not None else -1, "numel": numel, "padded_numel": numel,
            "world_size": 1, "slots": _slots(params), "tensors": tensors,
            "optimizer_scalars": encode_state(scalars, f"optimizer state of {label}")}


def _scalars(step: int | None, optimizer_class: str, slot_count: int) -> dict[str, Any]:
    """A group's step as the resuming optimizer keeps it: ZeroAdam an int and one count per
    parameter ([Note: one step count per group]), torch's Adam a float32 tensor."""
    if step is None:
        return {}
    if optimizer_class == "ZeroAdam":
        return {"step": step, "slot_steps": [step] * slot_count}
    return {"step": torch.tensor(float(step))}


def _trainable_part(ds: DeepSpeedCheckpoint, optimizer_class: str) -> tuple[list[TensorEntry], list[dict[str, Any]]]:
    """Each flat group: its fp32 master as ``param``, its moments as ``optim.<key>``."""
    entries, records = [], []
    for group in ds.groups:
        part = _Part(f"{UNIT}.group{group.index}", group.params, [], ds.folder.optim_files)
        keys = [PARAM_KEY] + ([OPTIM_PREFIX + k for k in ADAM_MOMENTS] if group.step is not None else [])
        for key in keys:
            per_rank = group.tensors[key.removeprefix(OPTIM_PREFIX)]
            entries.append(part.entry(key, torch.float32, [per_rank] * len(group.params)))
        scalars = _scalars(group.step, optimizer_class, len(group.params))
        records.append(_record(part.label, group.param_group, group.params, {k: "F32" for k in keys}, scalars))
    return entries, records


def _frozen_part(ds: DeepSpeedCheckpoint) -> tuple[list[TensorEntry], list[dict[str, Any]]]:
    """Frozen parameters, in one group per dtype (a flat tensor has one)."""
    entries, records = [], []
    by_dtype: dict[torch.dtype, list[FrozenParam]] = {}
    for frozen in ds.frozen:
        by_dtype.setdefault(frozen.fragments[0].dtype, []).append(frozen)
    for dtype, members in by_dtype.items():
        part = _Part(f"{UNIT}.frozen.{str(dtype).removeprefix('torch.')}", [f.param for f in members],
                     [f.fragments for f in members], ds.folder.model_files)
        entries.append(part.entry(PARAM_KEY, dtype))
        records.append(_record(part.label, None, part.params, {PARAM_KEY: DTYPE_TAGS[dtype]}, {}))
    return entries, records


def _model_record(ds: DeepSpeedCheckpoint, model: nn.Module | None) -> dict[str, Any]:
    buffers = [{"name": n, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
               for n, t in ds.buffers.items()]
    if model is not None:
        return dict(describe_model(model), buffers=buffers)
    return {"class": "unknown (imported from DeepSpeed without the model)", "config": None, "generation_config": None,
            "aliases": dict(ds.shared_params), "tied_weight_names": [], "tied_weight_keys": [],
            "keys_to_ignore_on_save": [], "buffers": buffers}


def _manifest(ds: DeepSpeedCheckpoint, model: nn.Module | None, records: list[dict[str, Any]],
              optimizer_class: str, save_id: str) -> dict[str, Any]:
    from hf_zero.version import __version__

    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "tag": ds.folder.tag, "save_id": save_id,
        "hf_zero_version": __version__, "torch_version": torch.__version__,
        "world_size": 1, "data_world_size": 1, "stage": ds.stage, "compute_dtype": ds.compute_dtype,
        **{k: ds.counters[k] for k in ("global_steps", "micro_steps", "global_samples")},
        "config": {}, "model": _model_record(ds, model), "groups": records,
        "optimizer": {"class": optimizer_class, "param_groups": encode_state(ds.hyper, "optimizer.param_groups")},
        "lr_scheduler": ds.scheduler, "loss_scaler": ds.loss_scaler, "client_state": ds.client_state,
        "rng": [], "files": [],
        "imported_from": {"format": "deepspeed", "ds_version": ds.ds_version, "stage": ds.stage,
                          "dp_world_size": ds.dp_world_size, "tag_dir": ds.folder.tag_dir,
                          "skipped_steps": ds.counters["skipped_steps"]},
    }


def import_deepspeed_checkpoint(ds_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str],
                                model: nn.Module | None = None, tag: str | None = None,
                                optimizer_class: str = "ZeroAdam") -> str:
    """Convert a DeepSpeed ZeRO-1/2/3 checkpoint into an hf_zero checkpoint ``out_dir/<tag>``
    (and ``out_dir/latest``) that ``engine.load_checkpoint(out_dir)`` resumes at any world size
    and stage; see [Note: importing DeepSpeed checkpoints]. Run it once, on one process.

    ``tag`` defaults to the one ``ds_dir/latest`` names. ``model`` (the model the run resumes,
    built or loaded as for training) is checked by parameter name and shape and described in the
    manifest, so ``hf-zero export`` can write a Hugging Face folder from the result.
    ``optimizer_class`` is the class of the optimizer that resumes: ``"ZeroAdam"`` for the
    config's Adam/AdamW, ``"AdamW"`` (or ``"Adam"``) for a torch optimizer passed to
    ``hf_zero.initialize`` (the Trainer's). Returns the checkpoint directory written. Raises
    :class:`CheckpointError` naming the file for anything the checkpoint holds that is not
    DeepSpeed's (see [Note: DeepSpeed's pickles]) or does not add up; nothing is written then.

    Every file is read once in full before it is converted, to check the CRC-32 of each zip
    member (``torch.load(mmap=True)`` checks none): the import reads the DeepSpeed folder twice,
    the first time at disk speed, and the second mostly from the page cache when it fits in memory.
    """
    ds_dir, out_dir = os.path.abspath(os.fspath(ds_dir)), os.path.abspath(os.fspath(out_dir))
    check_conversion_target(ds_dir, out_dir, optimizer_class, "DeepSpeed",
                            " (the import would replace DeepSpeed's 'latest')")
    ds = read_deepspeed_checkpoint(ds_dir, tag)
    check_tag(ds.folder.tag)
    if model is not None:
        check_against_model(ds, model)
    entries, records = _trainable_part(ds, optimizer_class)
    frozen_entries, frozen_records = _frozen_part(ds)
    entries += frozen_entries + [TensorEntry.of(BUFFER_PREFIX + n, t) for n, t in ds.buffers.items()]
    save_id = secrets.token_hex(8)
    manifest = _manifest(ds, model, records + frozen_records, optimizer_class, save_id)
    check_run_state(manifest, ds.folder.tag_dir, counters=True, optimizer_groups=[{} for _ in ds.hyper])
    return write_converted(out_dir, ds.folder.tag, save_id, entries, manifest)


# --------------------------------------------------------------------------- loading
def refuse_deepspeed_checkpoint(engine: EngineState, load_dir: str | os.PathLike[str], tag: str | None) -> None:
    """``load_checkpoint`` on a DeepSpeed folder: a :class:`CheckpointError` giving the one call
    that converts it (see [Note: importing DeepSpeed checkpoints])."""
    if not is_deepspeed_checkpoint(load_dir, tag):
        return
    inner = type(engine.optimizer.inner).__name__ if engine.optimizer is not None else "ZeroAdam"
    extra = (f", tag={tag!r}" if tag is not None else "") + (
        f", optimizer_class={inner!r}" if inner in TARGET_OPTIMIZERS and inner != "ZeroAdam" else "")
    raise CheckpointError(
        f"{os.fspath(load_dir)} is a DeepSpeed ZeRO checkpoint, not an hf_zero one. Convert it once, on one "
        f"process: hf_zero.checkpoint.import_deepspeed_checkpoint({os.fspath(load_dir)!r}, OUT_DIR, model=model"
        f"{extra}) (or `hf-zero import-deepspeed {os.fspath(load_dir)} OUT_DIR --model MODEL_DIR`); then "
        "engine.load_checkpoint(OUT_DIR) resumes it at any world size and stage "
        "(docs/checkpoints.md, 'Resuming a DeepSpeed checkpoint')"
    )
