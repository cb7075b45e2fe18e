"""``save_checkpoint``: one safetensors file per rank, a JSON manifest, ``latest``; atomic.

[Note: atomic save]
A checkpoint must never look complete unless it is, and a failed save must never damage the
checkpoint before it. The save runs in four rounds; each ends with an exchange of every rank's
outcome (``all_gather_objects``, which is also the barrier), so all ranks raise together and no
rank is left waiting in a collective:

1. refuse early: the tag, the client state (JSON), the scheduler state and every tensor to write
   are checked on every rank before anything touches the disk;
2. rank 0 creates ``<save_dir>/.<tag>.tmp-<save_id>/``;
3. every data rank streams its file into it (see [Note: streamed safetensors]) and fsyncs it;
4. rank 0 writes ``manifest.json`` (with each file's size), renames the directory to
   ``<save_dir>/<tag>/`` (an existing tag is swapped out first and removed after), then writes
   ``latest`` through a temporary file and ``os.replace``. Re-saving an existing tag swaps the
   two directories in one atomic call where the OS has one (Linux ``renameat2``), so ``latest``
   never names a missing directory; folders left by interrupted saves are reported.

A failure in rounds 2-4 removes the temporary directory; a crash leaves at most a hidden
``.<tag>.tmp-*`` directory, which loading ignores. ``save_dir`` must be one filesystem that
every rank sees (a shared mount on several nodes).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import secrets
import shutil
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

from hf_zero.checkpoint.engine_state import EngineState, flat_groups
from hf_zero.checkpoint.errors import CheckpointError
from hf_zero.checkpoint.manifest import (
    BUFFER_PREFIX, FORMAT, FORMAT_VERSION, LATEST_NAME, MANIFEST_NAME, OPTIM_PREFIX, PARAM_KEY,
    capture_rng, check_plain_json, check_tag, describe_model, encode_state, persistent_buffers,
    rank_file_name, tensor_name,
)
from hf_zero.checkpoint.offloaded import is_streamed, streamed_entries
from hf_zero.checkpoint.safetensors_io import DTYPE_TAGS, TensorEntry, fsync_dir, write_safetensors
from hf_zero.checkpoint.whole_state import MANIFEST_KEY, merge_records, whole_params_of, whole_state_entries
from hf_zero.offload.nvme import format_bytes

if TYPE_CHECKING:
    from hf_zero.engine.sharding.flat_group import FlatParamGroup

logger = logging.getLogger("hf_zero")


@dataclass
class _Prepared:
    """Everything a rank will write, gathered before the disk is touched."""

    entries: list[TensorEntry] = field(default_factory=list)
    manifest: dict[str, Any] = field(default_factory=dict)
    data_world_size: int = 1
    # This rank's part of the manifest's whole_param_state (see [Note: whole-parameter state in
    # checkpoints]): rank 0 writes the manifest, so every rank sends it in the first exchange.
    whole_state: dict[str, Any] | None = None


def default_tag(engine: EngineState) -> str:
    """DeepSpeed's default tag."""
    return f"global_step{engine.global_steps}"


def _optimizer_state(engine: EngineState, group: FlatParamGroup) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The inner optimizer's state of a group's master, split in element-wise tensors (sharded
    like the master, written to the rank file) and the rest (small, written to the manifest)."""
    master = group.master_state.tensor
    if engine.optimizer is None or master is None:
        return {}, {}
    state = engine.optimizer.inner.state.get(master, {})
    elementwise, scalars = {}, {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == master.shape:
            elementwise[key] = value
        else:
            scalars[key] = value
    return elementwise, scalars


def _group_tensors(engine: EngineState, group: FlatParamGroup) -> tuple[TensorEntry, list[tuple[str, TensorEntry]], dict[str, Any]]:
    """A group's parameter entry (its fp32 master, or a frozen group's compute shard), its
    element-wise optimizer entries and its optimizer scalars."""
    if is_streamed(engine, group):  # see [Note: checkpoints of NVMe-offloaded state]
        return streamed_entries(engine, group)
    master = group.master_state.tensor
    # The compute shard through its store: while its unit is gathered the values are in the
    # gathered buffer ([Note: the shard lent to the gathered buffer] in hf_zero.engine.sharding.param_storage).
    data = group.storage.read_shard() if master is None or group.master_state.is_compute_shard else master
    elementwise, scalars = _optimizer_state(engine, group)
    optim = [(key, TensorEntry.of(tensor_name(group.label, OPTIM_PREFIX + key), value)) for key, value in elementwise.items()]
    return TensorEntry.of(tensor_name(group.label, PARAM_KEY), data), optim, scalars


def _group_records(engine: EngineState) -> tuple[list[TensorEntry], list[dict[str, Any]]]:
    entries, records = [], []
    for group, layout in zip(flat_groups(engine), engine.layout()):
        param, optim, scalars = _group_tensors(engine, group)
        label = group.label
        tensors = {PARAM_KEY: DTYPE_TAGS.get(param.dtype, str(param.dtype))}
        entries.append(param)
        for key, entry in optim:
            entries.append(entry)
            tensors[OPTIM_PREFIX + key] = DTYPE_TAGS.get(entry.dtype, str(entry.dtype))
        record = dict(layout, tensors=tensors,
                      optimizer_scalars=encode_state(scalars, f"optimizer state of {label}"))
        records.append(record)
    return entries, records


def _run_state(engine: EngineState) -> dict[str, Any]:
    optimizer = engine.optimizer
    scheduler = engine.lr_scheduler
    scaler = optimizer.loss_scaler if optimizer is not None else None
    hyper = ([{k: v for k, v in g.items() if k != "params"} for g in optimizer.inner.param_groups]
             if optimizer is not None else None)
    return {
        "optimizer": None if optimizer is None else {
            "class": type(optimizer.inner).__name__,
            "param_groups": encode_state(hyper, "optimizer.param_groups"),
        },
        "lr_scheduler": None if scheduler is None or not hasattr(scheduler, "state_dict") else {
            "class": type(scheduler).__name__,
            "state": encode_state(scheduler.state_dict(), "lr_scheduler.state_dict()"),
        },
        "loss_scaler": None if scaler is None else {
            "class": type(scaler).__name__, "state": encode_state(scaler.state_dict(), "loss_scaler.state_dict()"),
        },
    }


def _prepare(engine: EngineState, tag: str, client_state: Any) -> _Prepared:
    check_tag(tag)
    check_plain_json(client_state)
    entries, records = _group_records(engine)
    data_world = records[0]["world_size"] if records else 1  # 1 under stage 0: one copy is enough
    whole_entries, whole_record = whole_state_entries(engine)
    entries += whole_entries
    if engine.rank == 0:
        entries += [TensorEntry.of(BUFFER_PREFIX + name, buf) for name, buf in persistent_buffers(engine.module)]
    from hf_zero import __version__

    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "tag": tag,
        "hf_zero_version": __version__, "torch_version": torch.__version__,
        "world_size": engine.world_size, "data_world_size": data_world, "stage": engine.stage,
        "compute_dtype": str(engine.config.compute_dtype).removeprefix("torch."),
        "global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
        "global_samples": engine.global_samples,
        "config": engine.config.to_dict(),
        "model": describe_model(engine.module),
        "groups": records,
        **_run_state(engine),
        "client_state": json.loads(json.dumps(client_state)),
    }
    writes = engine.rank < data_world
    return _Prepared(entries if writes else [], manifest, data_world, whole_record if writes else None)


def _exchange(comm: Any, outcome: dict[str, Any]) -> list[dict[str, Any]]:
    return comm.all_gather_objects(outcome)  # type: ignore[return-value]


def _raise_if_failed(outcomes: list[dict[str, Any]], what: str, local: BaseException | None) -> None:
    errors: list[str] = []
    for rank, outcome in enumerate(outcomes):
        message = outcome.get("error")
        if message and message not in errors:
            errors.append(message if len(outcomes) == 1 else f"rank {rank}: {message}")
    if errors:
        raise CheckpointError(f"{what}:\n  " + "\n  ".join(errors)) from local


def _write_rank_file(path: str, entries: list[TensorEntry], metadata: dict[str, str]) -> dict[str, Any]:
    """One rank's file (a separate function so a test can make it fail half-way): its manifest
    record, with each tensor's dtype, shape and digest (see [Note: verified loads])."""
    digests: dict[str, str] = {}
    nbytes = write_safetensors(path, entries, metadata, digests)
    tensors = {e.name: {"dtype": DTYPE_TAGS[e.dtype], "shape": list(e.shape), "sha256": digests[e.name]}
               for e in entries}
    return {"name": os.path.basename(path), "bytes": nbytes, "tensors": tensors}


def _write_json(path: str, data: Any) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=1)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())


_RENAME_EXCHANGE = 2  # linux/fs.h


def _exchange_dirs(a: str, b: str) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``), so that re-saving a tag
    never leaves ``latest`` naming a missing directory. False where the call is not available."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0


def _tree_bytes(path: str) -> int:
    """Bytes of the files under ``path`` (links not followed: a leftover may hold anything)."""
    total = 0
    for root, _dirs, names in os.walk(path, followlinks=False):
        for name in names:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:  # removed meanwhile by whoever owns it
                pass
    return total


def _report_leftovers(save_dir: str, tag: str) -> None:
    """Temporary folders of saves that crashed (loading ignores them, but they can be as large as
    a checkpoint). Reported with their sizes, not removed: another job may be saving into the
    same folder."""
    leftovers = sorted(n for n in os.listdir(save_dir)
                       if n.startswith(".") and (".tmp-" in n or ".old-" in n) and not n.startswith(f".{tag}.tmp-"))
    if leftovers:
        sized = [f"{name} ({format_bytes(_tree_bytes(os.path.join(save_dir, name)))})" for name in leftovers[:5]]
        more = f" and {len(leftovers) - 5} more" if len(leftovers) > 5 else ""
        logger.warning("hf_zero: %s holds %d folder(s) left by interrupted saves: %s%s; delete them if no other "
                       "job is saving there", save_dir, len(leftovers), ", ".join(sized), more)


def _publish(save_dir: str, tmp_dir: str, tag: str, save_id: str) -> str:
    """Rename the finished directory into place and point ``latest`` at it (rank 0). A failure
    on the way (a disk that fills exactly at the ``latest`` write) puts everything back: the
    previous checkpoint under the tag (or no directory under it), the previous ``latest``, no
    temporary file, so that no complete checkpoint is left that ``latest`` does not name."""
    final = os.path.join(save_dir, tag)
    latest_tmp = os.path.join(save_dir, f".{LATEST_NAME}.tmp-{save_id}")
    aside, placed = None, False
    try:
        if os.path.lexists(final):  # re-saving a tag: the old one stays until the new one is in place
            aside = tmp_dir if _exchange_dirs(tmp_dir, final) else os.path.join(save_dir, f".{tag}.old-{save_id}")
            if aside != tmp_dir:  # no atomic exchange here: a short window where the tag is absent
                os.rename(final, aside)
                os.rename(tmp_dir, final)
        else:
            os.rename(tmp_dir, final)
        placed = True
        fsync_dir(save_dir)
        with open(latest_tmp, "w", encoding="utf-8") as handle:
            handle.write(tag)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(latest_tmp, os.path.join(save_dir, LATEST_NAME))
    except OSError:
        _unpublish(final, tmp_dir, aside, placed, latest_tmp)
        raise
    fsync_dir(save_dir)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    _report_leftovers(save_dir, tag)
    return final


def _unpublish(final: str, tmp_dir: str, aside: str | None, placed: bool, latest_tmp: str) -> None:
    """Undo what ``_publish`` did before ``latest`` was replaced (best effort: the disk may be
    full). The new checkpoint goes back to ``tmp_dir``, which the caller removes."""
    with contextlib.suppress(OSError):
        os.remove(latest_tmp)
    if placed and aside == tmp_dir:  # exchanged: swap back
        _exchange_dirs(tmp_dir, final)
        return
    if placed:
        with contextlib.suppress(OSError):
            os.rename(final, tmp_dir)
    if aside is not None and aside != tmp_dir and os.path.lexists(aside) and not os.path.lexists(final):
        with contextlib.suppress(OSError):
            os.rename(aside, final)


def save_checkpoint(engine: EngineState, save_dir: str | os.PathLike[str], tag: str | None = None,
                    client_state: Any = None) -> str:
    """Write ``save_dir/<tag>/`` (default tag ``global_step<N>``) and ``save_dir/latest``; see
    [Note: atomic save]. Every rank must call it. Returns the checkpoint directory."""
    comm = engine.comm
    save_dir = os.path.abspath(os.fspath(save_dir))
    tag = default_tag(engine) if tag is None else str(tag)
    client_state = {} if client_state is None else client_state
    if engine.optimizer is not None:  # the host's records of a step taken on the device, read first
        engine.optimizer.settle()
    with comm.during(f"save_checkpoint({save_dir!r}, tag={tag!r}) after optimizer step {engine.global_steps}"):
        return _save(engine, save_dir, tag, client_state)


def _save(engine: EngineState, save_dir: str, tag: str, client_state: Any) -> str:
    comm = engine.comm
    out_of_step = engine.out_of_step("save_checkpoint")  # before any other exchange: [Note: phases in step]
    if out_of_step is not None:
        raise CheckpointError(f"save_checkpoint({save_dir!r}) refused, nothing was written: {out_of_step}")
    prepared, local_error = None, None
    try:
        prepared = _prepare(engine, tag, client_state)
    except CheckpointError as exc:
        local_error = exc
    outcomes = _exchange(comm, {"error": str(local_error) if local_error else None, "tag": tag, "rng": capture_rng(),
                                "whole_state": prepared.whole_state if prepared else None})
    _raise_if_failed(outcomes, f"save_checkpoint({save_dir!r}, tag={tag!r}) refused; nothing was written", local_error)
    tags = sorted({o["tag"] for o in outcomes})
    if len(tags) > 1:
        raise CheckpointError(f"save_checkpoint: ranks passed different tags {tags}; pass the same tag on every rank")
    prepared = cast(_Prepared, prepared)  # _prepare succeeded on every rank
    if whole_params_of(engine) is not None:
        prepared.manifest[MANIFEST_KEY] = merge_records([o["whole_state"] for o in outcomes[:prepared.data_world_size]])
    rng_states = [o["rng"] for o in outcomes]
    tmp_dir, save_id = _make_tmp_dir(comm, save_dir, tag)
    try:
        files = _write_files(engine, prepared, tmp_dir, tag, save_id)
        return _finish(engine, prepared, save_dir, tmp_dir, tag, save_id, files, rng_states)
    except BaseException:
        if comm.global_rank == 0:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        raise


def _make_tmp_dir(comm: Any, save_dir: str, tag: str) -> tuple[str, str]:
    save_id, local_error = None, None
    if comm.global_rank == 0:
        save_id = secrets.token_hex(8)
        try:
            os.makedirs(save_dir, exist_ok=True)
            os.mkdir(os.path.join(save_dir, f".{tag}.tmp-{save_id}"))
        except OSError as exc:
            local_error = exc
    outcomes = _exchange(comm, {"error": f"creating a directory in {save_dir}: {local_error}" if local_error else None,
                                "save_id": save_id})
    _raise_if_failed(outcomes, "save_checkpoint failed; nothing was written", local_error)
    save_id = outcomes[0]["save_id"]
    return os.path.join(save_dir, f".{tag}.tmp-{save_id}"), save_id


def _write_files(engine: EngineState, prepared: _Prepared, tmp_dir: str, tag: str, save_id: str) -> list[dict[str, Any]]:
    count = prepared.data_world_size
    name = rank_file_name(engine.rank, count) if engine.rank < count else None
    record, local_error = None, None
    if name is not None:
        path = os.path.join(tmp_dir, name)
        metadata = {"format": "hf_zero", "save_id": save_id, "tag": tag, "rank": str(engine.rank),
                    "world_size": str(count)}
        try:
            record = _write_rank_file(path, prepared.entries, metadata)
        except Exception as exc:  # a full disk, a lost mount: every rank must hear of it
            local_error = exc
    message = f"writing {os.path.join(tmp_dir, name or '')}: {type(local_error).__name__}: {local_error}" if local_error else None
    outcomes = _exchange(engine.comm, {"error": message, "record": record})
    _raise_if_failed(outcomes, "save_checkpoint failed while writing rank files; the previous checkpoint and "
                     "'latest' are untouched and the partial files were removed", local_error)
    return [o["record"] for o in outcomes[:count]]


def _finish(engine: EngineState, prepared: _Prepared, save_dir: str, tmp_dir: str, tag: str, save_id: str,
            files: list[dict[str, Any]], rng_states: list[Any]) -> str:
    final, local_error = os.path.join(save_dir, tag), None
    if engine.rank == 0:
        manifest = dict(prepared.manifest, save_id=save_id, files=files, rng=rng_states)
        try:
            _write_json(os.path.join(tmp_dir, MANIFEST_NAME), manifest)
            final = _publish(save_dir, tmp_dir, tag, save_id)
        except OSError as exc:
            local_error = exc
    outcomes = _exchange(engine.comm, {"error": f"publishing {final}: {local_error}" if local_error else None})
    _raise_if_failed(outcomes, "save_checkpoint failed while publishing; the previous 'latest' is untouched", local_error)
    return final
