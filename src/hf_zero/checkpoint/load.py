"""``load_checkpoint``: any saved world size and stage into this engine's layout.

[Note: checked, then applied]
Loading runs in two phases. The first only reads: it resolves the tag and every path inside the
checkpoint folder (see [Note: confined paths]), reads the manifest, checks the values it will
apply (see [Note: validated run state]), checks that the checkpoint holds this model (every
parameter name and shape), plans which slices of which rank files fill this rank's shards (see
[Note: resharding by name]), verifies every tensor it will read (see [Note: verified loads])
and decodes the run state (optimizer hyperparameters and scalars, scheduler, loss scaler, RNG),
trying the scheduler, scaler and RNG states on their objects and putting the current ones back,
so a state they refuse is found here. All ranks then exchange their outcome, so a problem seen
by one rank is raised by every rank, and the engine is untouched. Only then does the second
phase copy data in: masters (or, for frozen groups, the compute shards), the 16-bit compute
shards cast from the loaded masters, the full parameters re-gathered for stages 0-2 and
persistent groups, the optimizer state (placed as torch places it: see ``optimizer_value_on``),
buffers, scheduler, loss scaler, counters and RNG states.
"""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from hf_zero.checkpoint.deepspeed_import import refuse_deepspeed_checkpoint
from hf_zero.checkpoint.engine_state import EngineState, flat_groups
from hf_zero.checkpoint.errors import CheckpointError, listed
from hf_zero.checkpoint.manifest import (
    BUFFER_PREFIX, MANIFEST_NAME, OPTIM_PREFIX, PARAM_KEY, capture_rng, decode_state, manifest_errors,
    optimizer_value_on, param_group_of, persistent_buffers, read_manifest, resolve_checkpoint_dir, restore_rng,
    tensor_name,
)
from hf_zero.checkpoint.optimizer_records import record_problems
from hf_zero.checkpoint.offloaded import (
    check_streamed_keys, is_streamed, load_streamed_optimizer, load_streamed_parameters,
)
from hf_zero.checkpoint.reader import RankFiles
from hf_zero.checkpoint.reshard import (
    Piece, SavedSlot, index_saved_slots, merged_scalars, plan_pieces,
)
from hf_zero.checkpoint.safetensors_io import TAG_DTYPES
from hf_zero.checkpoint.scheduler_state import scheduler_state_problems, takes_a_plain_step, trial_step_problem
from hf_zero.checkpoint.validate import check_run_state
from hf_zero.checkpoint.whole_state import (
    WholeRead, apply_whole_state, expected_tensors, plan_whole_state, whole_params_of,
)

if TYPE_CHECKING:
    from hf_zero.engine.sharding.flat_group import FlatParamGroup

logger = logging.getLogger("hf_zero")


@dataclass
class _GroupPlan:
    group: FlatParamGroup  # FlatParamGroup
    pieces: list[Piece]
    source: int  # the saved group holding this group's first parameter (optimizer scalars)
    optim_keys: list[str]  # element-wise optimizer state to read ("exp_avg", ...)
    optim_dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    optim_scalars: dict[str, Any] = field(default_factory=dict)  # decoded from the manifest


@dataclass
class _Plan:
    ckpt_dir: str
    manifest: dict[str, Any]
    files: RankFiles
    groups: list[_GroupPlan]
    load_optimizer: bool
    buffers: list[tuple[str, torch.Tensor]]
    whole_reads: list[WholeRead] = field(default_factory=list)  # see [Note: whole-parameter state in checkpoints]
    run_state: "_RunState | None" = None  # None with load_module_only


@dataclass
class _RunState:
    """The run state of a checkpoint, decoded and tried before anything is applied."""

    hyper: list[dict[str, Any]] | None  # the optimizer's param group hyperparameters
    scheduler: dict[str, Any] | None
    scaler: dict[str, Any] | None
    rng: Any  # this rank's saved RNG state, or None
    counters: tuple[int, int, int]  # global_steps, micro_steps, global_samples


def _check_same_model(engine: EngineState, saved: dict[str, SavedSlot], saved_class: str, manifest_path: str) -> None:
    current = {s.name: tuple(s.shape) for g in flat_groups(engine) for s in g.layout.slots}
    problems = [f"{n} {shape} is not in the checkpoint" for n, shape in current.items() if n not in saved]
    problems += [f"{n} is {saved[n].shape} in the checkpoint, {shape} in the model"
                 for n, shape in current.items() if n in saved and saved[n].shape != shape]
    problems += [f"{n} {s.shape} is in the checkpoint, not in the model" for n, s in saved.items() if n not in current]
    if problems:
        shown = listed(problems, 5)
        raise CheckpointError(
            f"{manifest_path}: the checkpoint holds a different model (saved from a {saved_class}, this engine "
            f"wraps a {type(engine.module).__name__}; {len(problems)} mismatches): {shown}"
        )


def _optim_keys(group: FlatParamGroup, saved: dict[str, SavedSlot], manifest: dict[str, Any], manifest_path: str) -> list[str]:
    """The element-wise optimizer state the saved groups feeding ``group`` hold (all the same)."""
    records = manifest["groups"]
    key_sets = set()
    for index in sorted({saved[s.name].group_index for s in group.layout.slots}):
        record = records[index]
        if not record["trainable"]:
            first = next(s.name for s in group.layout.slots if saved[s.name].group_index == index)
            raise CheckpointError(
                f"{manifest_path}: {first} is trainable now but was frozen when saved, so it has no "
                "optimizer state; load with load_optimizer_states=False"
            )
        key_sets.add(tuple(sorted(k[len(OPTIM_PREFIX):] for k in record["tensors"] if k.startswith(OPTIM_PREFIX))))
    if len(key_sets) > 1:
        raise CheckpointError(f"{manifest_path}: the saved groups feeding {group.label} hold different optimizer state {sorted(key_sets)}")
    return list(key_sets.pop()) if key_sets else []


def _check_optimizer(engine: EngineState, manifest: dict[str, Any], manifest_path: str) -> None:
    saved = manifest.get("optimizer")
    if saved is None:
        raise CheckpointError(f"{manifest_path}: the checkpoint has no optimizer state; load with load_optimizer_states=False")
    inner = engine.optimizer.inner
    if saved["class"] != type(inner).__name__:
        raise CheckpointError(
            f"{manifest_path}: optimizer state of {saved['class']}, but the engine's optimizer is "
            f"{type(inner).__name__}; use the same optimizer or load with load_optimizer_states=False"
        )
    if len(saved["param_groups"]) != len(inner.param_groups):
        raise CheckpointError(
            f"{manifest_path}: {len(saved['param_groups'])} optimizer param groups saved, the engine has "
            f"{len(inner.param_groups)}; build the optimizer with the same groups or load with load_optimizer_states=False"
        )


def _check_records(engine: EngineState, saved: dict[str, SavedSlot], manifest: dict[str, Any],
                   manifest_path: str) -> None:
    """The records optimizer state is read from are complete: [Note: complete optimizer records]."""
    indices = sorted({saved[s.name].group_index for g in flat_groups(engine) if g.master_state.tensor is not None
                      for s in g.layout.slots})
    problems = record_problems(manifest, engine.optimizer.inner, indices)
    if problems:
        raise CheckpointError(
            f"{manifest_path}: incomplete optimizer state (edited by hand or damaged): {listed(problems, 5)}. "
            "Load another checkpoint, or "
            "load with load_optimizer_states=False"
        )


def _plan(engine: EngineState, load_dir: str | os.PathLike[str], tag: str | None, load_optimizer: bool,
          load_scheduler: bool, module_only: bool, allow_unverified: bool) -> _Plan:
    refuse_deepspeed_checkpoint(engine, load_dir, tag)  # a DeepSpeed folder: the call that converts it
    ckpt_dir = resolve_checkpoint_dir(load_dir, tag)
    manifest = read_manifest(ckpt_dir, allow_unverified)
    with manifest_errors(ckpt_dir):
        check_run_state(manifest, os.path.join(ckpt_dir, MANIFEST_NAME), counters=not module_only,
                        optimizer_groups=engine.optimizer.inner.param_groups if load_optimizer else None)
        plan = _plan_reads(engine, ckpt_dir, manifest, load_optimizer, allow_unverified)
        if not module_only:
            plan.run_state = _decode_run_state(engine, manifest, load_optimizer, load_scheduler,
                                               os.path.join(ckpt_dir, MANIFEST_NAME))
            _try_run_state(engine, plan.run_state, os.path.join(ckpt_dir, MANIFEST_NAME))
    return plan


def _plan_reads(engine: EngineState, ckpt_dir: str, manifest: dict[str, Any], load_optimizer: bool,
                allow_unverified: bool) -> _Plan:
    manifest_path = os.path.join(ckpt_dir, MANIFEST_NAME)
    saved = index_saved_slots(manifest["groups"])
    _check_same_model(engine, saved, manifest["model"]["class"], manifest_path)
    if load_optimizer:
        _check_optimizer(engine, manifest, manifest_path)
        _check_records(engine, saved, manifest, manifest_path)
    plans = []
    per_slot = engine.optimizer is not None and getattr(engine.optimizer.inner, "per_slot_steps", False)
    for group in flat_groups(engine):
        pieces = plan_pieces(group.layout.slots, group.shard_range, saved)
        keys = _optim_keys(group, saved, manifest, manifest_path) if load_optimizer and group.master_state.tensor is not None else []
        check_streamed_keys(engine, group, keys, manifest_path)
        source = saved[group.layout.slots[0].name].group_index
        record = manifest["groups"][source]
        dtypes = {key: TAG_DTYPES[record["tensors"][OPTIM_PREFIX + key]] for key in keys}
        if not isinstance(decode_state(record.get("optimizer_scalars") or {}, f"groups[{source}].optimizer_scalars"), dict):
            raise CheckpointError(f"{manifest_path}: optimizer_scalars of {record['group']} is not an object")
        # Step counts per parameter, mapped by name ([Note: one step count per group] in reshard.py).
        scalars = merged_scalars(group.label, group.layout.slots, saved, manifest, manifest_path,
                                 per_slot=per_slot) if keys else {}
        plans.append(_GroupPlan(group, pieces, source, keys, dtypes, scalars))
    saved_buffers = {b["name"] for b in manifest["model"].get("buffers", [])}
    buffers = [(n, b) for n, b in persistent_buffers(engine.module) if n in saved_buffers]
    whole_reads = plan_whole_state(engine, manifest, manifest_path) if load_optimizer else []
    files = RankFiles(ckpt_dir, manifest, allow_unverified)
    try:
        _check_files(files, manifest, plans, buffers)
        for index, expected in sorted(expected_tensors(whole_reads).items()):
            files.check(index, expected)
    except BaseException:
        files.close()
        raise
    return _Plan(ckpt_dir, manifest, files, plans, load_optimizer, buffers, whole_reads)


def _check_files(files: RankFiles, manifest: dict[str, Any], plans: list[_GroupPlan],
                 buffers: list[tuple[str, torch.Tensor]]) -> None:
    expected: dict[int, dict[str, int]] = {}
    shard_numel = {r["group"]: r["padded_numel"] // r["world_size"] for r in manifest["groups"]}
    for plan in plans:
        for piece in plan.pieces:
            wanted = expected.setdefault(piece.file_index, {})
            for key in [PARAM_KEY] + [OPTIM_PREFIX + k for k in plan.optim_keys]:
                wanted[tensor_name(piece.label, key)] = shard_numel[piece.label]
    if buffers:
        expected.setdefault(0, {}).update({BUFFER_PREFIX + n: b.numel() for n, b in buffers})
    for index in sorted(expected):
        files.check(index, expected[index])


def _decode_run_state(engine: EngineState, manifest: dict[str, Any], load_optimizer: bool, load_scheduler: bool,
                      manifest_path: str) -> _RunState:
    hyper = decode_state(manifest["optimizer"]["param_groups"], "optimizer.param_groups") if load_optimizer else None
    if hyper is not None and not all(isinstance(h, dict) for h in hyper):
        raise TypeError("optimizer.param_groups must be a list of objects")
    saved_scheduler = manifest.get("lr_scheduler")
    scheduler = None
    if load_scheduler and engine.lr_scheduler is not None:
        if saved_scheduler is None:
            raise CheckpointError(f"{manifest_path}: the checkpoint holds no lr_scheduler state, and the engine has "
                                  f"a {type(engine.lr_scheduler).__name__}; load with load_lr_scheduler_states=False "
                                  "to keep the scheduler as it is, or load a checkpoint saved with a scheduler")
        if saved_scheduler["class"] != type(engine.lr_scheduler).__name__:
            logger.warning("hf_zero: loading %s state into a %s", saved_scheduler["class"], type(engine.lr_scheduler).__name__)
        scheduler = decode_state(saved_scheduler["state"], "lr_scheduler.state")
        _check_scheduler_state(engine, scheduler, manifest_path)
    saved_scaler = manifest.get("loss_scaler")
    live_scaler = engine.optimizer.loss_scaler if engine.optimizer is not None else None
    if load_optimizer and live_scaler is not None and saved_scaler is None:
        raise CheckpointError(f"{manifest_path}: the checkpoint holds no fp16 loss scaler state (it was saved "
                              "without fp16 loss scaling), and this engine scales its loss; load with "
                              "load_optimizer_states=False to start the scale afresh, or train with the precision "
                              "the checkpoint was saved with")
    scaler = decode_state(saved_scaler["state"], "loss_scaler.state") if saved_scaler is not None else None
    rng = manifest.get("rng") or []
    counters = (manifest["global_steps"], manifest["micro_steps"], manifest["global_samples"])  # checked ints
    return _RunState(hyper, scheduler, scaler, rng[engine.rank] if engine.rank < len(rng) else None, counters)


def _check_scheduler_state(engine: EngineState, saved: Any, manifest_path: str) -> None:
    """The saved state against the engine's scheduler: [Note: validated scheduler state]."""
    problems = scheduler_state_problems(saved, engine.lr_scheduler, len(engine.optimizer.param_groups)
                                        if engine.optimizer is not None else 0)
    if problems:
        raise CheckpointError(f"{manifest_path}: invalid lr_scheduler state (edited by hand or damaged, or saved by "
                              f"another scheduler): {listed(problems, 6)}; load with load_lr_scheduler_states=False, "
                              "or use the scheduler it was saved with")


def _try_state(what: str, manifest_path: str, current: Any, apply: Callable[[Any], None], saved: Any,
               owner: Any = None, trial: Callable[[Any], None] | None = None) -> None:
    """Apply ``saved`` (through ``trial`` when given, which may do more with it), then put
    ``current`` back with ``apply``: a state the object refuses is found now. The attributes of
    ``owner`` are restored as they were too (a ``load_state_dict`` that adds attributes would
    otherwise leave them behind)."""
    attributes = getattr(owner, "__dict__", {})
    names = set(attributes)
    try:
        (trial or apply)(saved)
    except Exception as exc:
        raise CheckpointError(f"{manifest_path}: the saved {what} does not load ({type(exc).__name__}: {exc})") from exc
    finally:
        apply(current)
        for name in set(attributes) - names:
            del attributes[name]


def _group_values(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in g.items() if k != "params"}
            for g in groups]


def _put_back_group_values(groups: list[dict[str, Any]], values: list[dict[str, Any]]) -> None:
    """The param groups' values as :func:`_group_values` took them (a tensor lr in place)."""
    for group, kept in zip(groups, values):
        for key in [k for k in group if k != "params" and k not in kept]:
            del group[key]
        for key, value in kept.items():
            if isinstance(value, torch.Tensor) and isinstance(group.get(key), torch.Tensor):
                group[key].copy_(value)
            else:
                group[key] = value


def _scheduler_trial(scheduler: Any) -> Callable[[Any], None]:
    """Load a state and take one step with it ([Note: validated scheduler state]); the
    optimizer's param groups, which the step writes, are put back."""
    def trial(saved: Any) -> None:
        scheduler.load_state_dict(saved)
        if not takes_a_plain_step(scheduler):
            return
        groups = scheduler.optimizer.param_groups
        values = _group_values(groups)
        try:
            problem = trial_step_problem(scheduler)
        finally:
            _put_back_group_values(groups, values)
        if problem is not None:
            raise ValueError(problem)
    return trial


def _try_run_state(engine: EngineState, run: _RunState, manifest_path: str) -> None:
    scheduler = engine.lr_scheduler
    if run.scheduler is not None:
        _try_state("lr_scheduler state", manifest_path, copy.deepcopy(scheduler.state_dict()),
                   scheduler.load_state_dict, run.scheduler, owner=scheduler, trial=_scheduler_trial(scheduler))
    scaler = engine.optimizer.loss_scaler if engine.optimizer is not None else None
    if scaler is not None and run.scaler is not None:
        _try_state("loss scaler state", manifest_path, copy.deepcopy(scaler.state_dict()),
                   scaler.load_state_dict, run.scaler, owner=scaler)
    if run.rng is not None:
        _try_state(f"RNG state of rank {engine.rank}", manifest_path, capture_rng(), restore_rng, run.rng)


def _agree(comm: Any, local: CheckpointError | None) -> None:
    """Every rank raises if any rank found a problem (the local error's class where there is one)."""
    outcomes = comm.all_gather_objects(str(local) if local is not None else None)
    errors: list[str] = []
    for message in outcomes:
        if message and message not in errors:
            errors.append(message)
    if errors:
        kind = type(local) if local is not None else CheckpointError
        raise kind("load_checkpoint: nothing was loaded:\n  " + "\n  ".join(errors)) from local


def _fill(dst: torch.Tensor, pieces: list[Piece], key: str, files: RankFiles) -> None:
    dst.zero_()  # padding is never read; see [Note: resharding by name]
    for piece in pieces:
        data = files.read(piece.file_index, tensor_name(piece.label, key), piece.src_lo, piece.src_hi)
        dst[piece.dst_lo:piece.dst_hi].copy_(data)


def _load_parameters(engine: EngineState, plan: _Plan) -> None:
    for unit in engine.units:  # a unit still gathered would go stale, and its lent shard has no memory
        unit.reshard()  # ([Note: the shard lent to the gathered buffer] in hf_zero.engine.sharding.param_storage)
        for group in unit.groups:  # the shards change under them ([Note: secondary shards])
            group.storage.drop_secondary()
    for item in plan.groups:
        group = item.group
        if is_streamed(engine, group):  # see [Note: checkpoints of NVMe-offloaded state]
            load_streamed_parameters(engine, group, item.pieces, plan.files)
            continue
        master = group.master_state.tensor
        _fill(master if master is not None else group.storage.shard, item.pieces, PARAM_KEY, plan.files)
        if master is not None and not group.master_state.is_compute_shard:
            group.storage.write_shard(master)  # the compute copy is the cast of the master
    for item in plan.groups:  # same order on every rank: these are collectives
        item.group.gather_updated_shards()
    whole = whole_params_of(engine)
    if whole is not None:  # the owners step from full-shape copies of the masters just written
        whole.reload_masters()


def _load_optimizer(engine: EngineState, plan: _Plan, hyper_groups: list[dict[str, Any]]) -> None:
    inner = engine.optimizer.inner
    for group, hyper in zip(inner.param_groups, hyper_groups):
        group.update({k: v for k, v in hyper.items() if k != "params"})
    for item in plan.groups:
        master = item.group.master_state.tensor
        if master is None:
            continue
        if is_streamed(engine, item.group):
            load_streamed_optimizer(engine, item.group, item.pieces, item.optim_keys, item.optim_scalars, plan.files)
            continue
        if not item.optim_keys:  # saved before the first optimizer step
            inner.state.pop(master, None)
            continue
        state: dict[str, Any] = {}
        for key in item.optim_keys:
            state[key] = torch.zeros(master.shape, dtype=item.optim_dtypes[key], device=master.device)
            _fill(state[key], item.pieces, OPTIM_PREFIX + key, plan.files)
        param_group = param_group_of(inner, master)  # its saved flags: see optimizer_value_on
        for key, value in item.optim_scalars.items():
            state[key] = optimizer_value_on(master, key, value, param_group)
        inner.state[master] = state
    apply_whole_state(engine, plan.whole_reads, plan.files)


def _load_run_state(engine: EngineState, run: _RunState) -> None:
    scaler = engine.optimizer.loss_scaler if engine.optimizer is not None else None
    if scaler is not None and run.scaler is not None:
        scaler.load_state_dict(run.scaler)
    elif scaler is not None or run.scaler is not None:
        logger.info("hf_zero: loss scaler state %s; the engine's scaler starts fresh",
                    "absent from the checkpoint" if run.scaler is None else "saved but the engine runs without fp16")
    if run.scheduler is not None:
        engine.lr_scheduler.load_state_dict(run.scheduler)
    engine.global_steps, engine.micro_steps, engine.global_samples = run.counters
    if run.rng is not None:
        restore_rng(run.rng)
    else:
        logger.info("hf_zero: rank %d has no saved RNG state; it keeps its own", engine.rank)


def load_checkpoint(
    engine: EngineState,
    load_dir: str | os.PathLike[str],
    tag: str | None = None,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
    allow_unverified: bool = False,
) -> tuple[str, Any]:
    """Load a checkpoint saved at any world size and stage; see [Note: checked, then applied].

    ``tag`` defaults to the one ``load_dir/latest`` names. ``load_module_only`` loads the
    parameters (and buffers) only: optimizer, scheduler, loss scaler, counters and RNG keep
    their current state. Returns ``(checkpoint directory, client_state)``. Every rank must call
    it; a missing, truncated, mismatched or edited checkpoint raises :class:`CheckpointError` on
    every rank and changes nothing. A checkpoint without per-tensor checksums (format 1) is
    refused unless ``allow_unverified=True``: the risk of loading data nothing can verify
    (see [Note: verified loads]).
    """
    if engine.optimizer is not None:  # a pending step's records are put right before any is replaced
        engine.optimizer.settle()
    with engine.comm.during(f"load_checkpoint({os.fspath(load_dir)!r}) at optimizer step {engine.global_steps}"):
        return _load(engine, load_dir, tag, load_optimizer_states, load_lr_scheduler_states, load_module_only,
                     allow_unverified)


def _load(engine: EngineState, load_dir: str | os.PathLike[str], tag: str | None, load_optimizer_states: bool,
          load_lr_scheduler_states: bool, load_module_only: bool, allow_unverified: bool) -> tuple[str, Any]:
    out_of_step = engine.out_of_step("load_checkpoint")  # before any other exchange: [Note: phases in step]
    if out_of_step is not None:
        raise CheckpointError(f"load_checkpoint({os.fspath(load_dir)!r}) refused, nothing was changed: {out_of_step}")
    load_optimizer = load_optimizer_states and not load_module_only and engine.optimizer is not None
    plan, local_error = None, None
    try:
        plan = _plan(engine, load_dir, tag, load_optimizer, load_lr_scheduler_states, load_module_only,
                     allow_unverified)
    except CheckpointError as exc:
        local_error = exc
    _agree(engine.comm, local_error)
    if plan is None:  # unreachable: _agree raised; keeps type checkers honest
        raise CheckpointError("load_checkpoint: no plan")
    try:
        with torch.no_grad():
            _load_parameters(engine, plan)
            for name, buf in plan.buffers:
                buf.copy_(plan.files.read(0, BUFFER_PREFIX + name))
            if load_optimizer and plan.run_state is not None:
                _load_optimizer(engine, plan, plan.run_state.hyper or [])
        if plan.run_state is not None:
            _load_run_state(engine, plan.run_state)
    finally:
        plan.files.close()
    return plan.ckpt_dir, plan.manifest.get("client_state", {})
