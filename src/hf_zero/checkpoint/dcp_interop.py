"""Checkpoints shared with PyTorch FSDP2 through ``torch.distributed.checkpoint`` (DCP) folders:
:func:`export_dcp_checkpoint` writes an hf_zero checkpoint as a DCP folder an FSDP2 run loads,
:func:`import_dcp_checkpoint` writes a DCP folder an FSDP2 run saved as an hf_zero checkpoint
that ``engine.load_checkpoint`` resumes at any world size and stage. Both run on one process.

[Note: the DCP layout]
The state dict is the one PyTorch's DCP recipe saves and loads,
``{"model": model_sd, "optim": optim_sd}`` with ``model_sd, optim_sd = get_state_dict(model,
optimizer)`` (``torch.distributed.checkpoint.state_dict``, default options: parameter names,
optimizer state keyed by name, not flattened). DCP flattens it to these keys:

    model.<name>                      every parameter (a tied one under each of its names) and
                                      persistent buffer, full shape
    optim.state.<name>.step           float32 scalar tensor: the optimizer steps of this parameter
    optim.state.<name>.exp_avg        float32, the parameter's shape
    optim.state.<name>.exp_avg_sq     float32, the parameter's shape
    optim.param_groups.<i>.<key>      lr, betas, eps, weight_decay, amsgrad, maximize, foreach,
                                      capturable, differentiable, fused, decoupled_weight_decay,
                                      initial_lr, and params: the names of group i's parameters

Names are those of the Hugging Face model (``fully_shard`` shards modules in place, so an FSDP2
model has the names of the plain one); optimizer state is keyed by a tied parameter's first
name, as ``get_state_dict`` keys it. An FSDP2 script loads an export with
``dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=DIR)`` then
``set_state_dict(model, optimizer, model_state_dict=..., optim_state_dict=...)``; its optimizer
must hold the same parameters in each param group. Export writes every param-group key
``torch.optim.AdamW`` of the installed torch has (``initial_lr`` too, for a script that attached
a scheduler before loading): ``dcp.load`` refuses a key its state dict has and the folder lacks.

Carried: fp32 masters (the FSDP2 parameters), ``exp_avg``, ``exp_avg_sq``, the step count of
every parameter (hf_zero's ``slot_steps``: [Note: one step count per group]), each param
group's lr, betas, eps, weight_decay and decoupled flag, frozen parameters and persistent
buffers. Not carried: LR scheduler, loss scaler, RNG states, ``client_state``, sampler state
(``get_state_dict`` holds none of them); an import sets ``global_steps`` and ``micro_steps``
to the largest step count and ``global_samples`` to 0. Only Adam/AdamW state goes either way.

[Note: reading a DCP folder]
DCP's own reader unpickles ``.metadata`` with ``pickle.load`` and every non-tensor value with
``torch.load(weights_only=False)``: either runs whatever a file names. A DCP folder is
untrusted input like an hf_zero or a DeepSpeed one ([Note: DeepSpeed's pickles]), so the
import reads the format itself:

- ``.metadata`` with an unpickler that finds only DCP's metadata classes, ``torch.Size``, the
  dtypes a safetensors file holds, torch's layout lookup and pathlib paths
  (:data:`METADATA_GLOBALS`); then every field it uses is checked: names are strings, sizes
  integers >= 0, each chunk inside its tensor and the chunks' elements adding up to the
  tensor's, every chunk and value stored in a plain-named file of the folder ([Note: confined
  paths]) within the file's size, no stream transform (compression).
- each value from exactly its byte range, with ``torch.load(weights_only=True)``; a chunk must be
  a tensor of the recorded dtype and shape, finite, and overlap no other chunk (with the sizes
  adding up, the chunks then tile the tensor exactly).

DCP writes no checksums, so a flipped byte inside tensor data cannot be detected: each import
logs one warning that the tensor data is unchecked (only its dtype, shape and finiteness are).

Names, shapes and the optimizer's kind are compared with the model and param groups before
anything is written; chunks are read and checked as they are written, into a temporary
folder published only when complete, as a save is ([Note: atomic save]).
"""

from __future__ import annotations

import io
import logging
import math
import os
import pickle
import secrets
import shutil
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import nn

from hf_zero.checkpoint.converted import CARRIED_HYPER, TARGET_OPTIMIZERS, check_conversion_target, write_converted
from hf_zero.checkpoint.errors import CheckpointError, CheckpointNotFoundError
from hf_zero.checkpoint.export import check_export_manifest
from hf_zero.checkpoint.manifest import (
    BUFFER_PREFIX, FORMAT, FORMAT_VERSION, LATEST_NAME, MANIFEST_NAME, OPTIM_PREFIX, PARAM_KEY, check_tag,
    decode_state, describe_model, encode_state, list_tags, manifest_errors, parameter_aliases, persistent_buffers,
    read_manifest, resolve_checkpoint_dir, tensor_name,
)
from hf_zero.checkpoint.paths import is_plain_name, resolve_inside
from hf_zero.checkpoint.reader import RankFiles, check_every_tensor
from hf_zero.checkpoint.reshard import SavedSlot, index_saved_slots, plan_pieces
from hf_zero.checkpoint.safetensors_io import DTYPE_TAGS, TAG_DTYPES, TensorEntry, fsync_dir
from hf_zero.checkpoint.validate import check_run_state, step_problem

logger = logging.getLogger("hf_zero")

MODEL_KEY, OPTIM_KEY = "model", "optim"  # see [Note: the DCP layout]
STATE_PREFIX, GROUPS_PREFIX = f"{OPTIM_KEY}.state.", f"{OPTIM_KEY}.param_groups."
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")
ADAM_STATE = ("step",) + ADAM_MOMENTS
METADATA_NAME = ".metadata"
UNIT = "dcp"
_MAX_METADATA_BYTES = 1 << 30  # names, shapes and offsets: megabytes for the largest models
_MAX_VALUE_BYTES = 1 << 24  # a param-group value (the names of its parameters at most)
_MAX_LISTED = 10
_DCP = "torch.distributed.checkpoint"
# Every global the metadata unpickler finds (see [Note: reading a DCP folder]).
METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {(f"{_DCP}.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")}
    | {(f"{_DCP}.filesystem", "_StorageInfo"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
       ("collections", "OrderedDict")}
    | {(module, name) for module in ("pathlib", "pathlib._local") for name in ("PosixPath", "PurePosixPath")}
    | {("torch", str(dtype).removeprefix("torch.")) for dtype in DTYPE_TAGS}
)


def _problem(path: str, message: str) -> CheckpointError:
    return CheckpointError(f"{path}: {message}; it was edited or damaged, or not written by dcp.save")


def _require(condition: bool, path: str, message: str) -> None:
    if not condition:
        raise _problem(path, message)


def _listed(items: list[str]) -> str:
    more = len(items) - _MAX_LISTED
    return "; ".join(items[:_MAX_LISTED]) + (f"; and {more} more" if more > 0 else "")


# --------------------------------------------------------------------------- the folder's index
@dataclass(frozen=True)
class Stored:
    """Where one value's bytes are: ``length`` bytes at ``offset`` of ``file``."""

    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    stored: Stored


@dataclass(frozen=True)
class TensorRecord:
    """A tensor of the checkpoint: its dtype, full shape and the chunks that tile it."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class DcpFolder:
    """A DCP folder's index, read and checked: tensors and other values by flattened key."""

    path: str
    tensors: dict[str, TensorRecord]
    objects: dict[str, Stored]


class _MetadataUnpickler(pickle.Unpickler):
    """Finds only :data:`METADATA_GLOBALS`: see [Note: reading a DCP folder]."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in METADATA_GLOBALS:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which is not one of DCP's metadata classes")
        return super().find_class(module, name)


def _read_metadata(folder: str) -> Any:
    path = os.path.join(folder, METADATA_NAME)
    resolve_inside(os.path.realpath(folder), METADATA_NAME, path)
    if not os.path.isfile(path):
        raise CheckpointNotFoundError(f"{path}: missing, so {folder} is not a complete DCP checkpoint (dcp.save writes "
                                      ".metadata last: a save that did not finish has none); pass the folder given to "
                                      "dcp.save as checkpoint_id")
    _require(os.path.getsize(path) <= _MAX_METADATA_BYTES, path, "larger than DCP metadata is")
    try:
        with open(path, "rb") as handle:
            return _MetadataUnpickler(handle).load()
    except Exception as exc:  # the unpickler's refusal, or a metadata class's own check of values from the file
        raise CheckpointError(f"{path}: not DCP metadata this import reads ({type(exc).__name__}: {exc!s:.300}); "
                              "nothing but torch.distributed.checkpoint's metadata classes is unpickled, so "
                              "nothing in it was run") from exc


def _sizes(value: Any, path: str, what: str) -> tuple[int, ...]:
    ok = isinstance(value, (tuple, list)) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in value)
    _require(ok, path, f"{what} is {value!r:.80}, not a list of sizes")
    return tuple(int(d) for d in value)


class _Files:
    """The folder's data files by name, each resolved inside it once, with its size."""

    def __init__(self, folder: str, metadata_path: str) -> None:
        self.folder, self.root, self.metadata_path = folder, os.path.realpath(folder), metadata_path
        self.sizes: dict[str, int] = {}

    def stored(self, info: Any, key: str) -> Stored:
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        where = self.metadata_path
        _require(isinstance(info, _StorageInfo), where, f"no storage entry for {key}")
        name, offset, length = (getattr(info, k, None) for k in ("relative_path", "offset", "length"))
        if getattr(info, "transform_descriptors", None):
            raise NotImplementedError(f"{where}: {key} is stored through the stream transforms "
                                      f"{info.transform_descriptors!r:.80} (a DCP extension such as compression), "
                                      "which this import does not read; save without extensions")
        _require(is_plain_name(name), where, f"{key} is stored in {name!r:.80}, not a plain file name in the folder")
        _require(all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (offset, length)), where,
                 f"{key} is stored at offset {offset!r:.40}, length {length!r:.40}: not byte counts")
        path = os.path.join(self.folder, name)
        if name not in self.sizes:
            resolve_inside(self.root, name, path)
            if not os.path.isfile(path):
                raise CheckpointNotFoundError(f"{path}: missing (the metadata stores {key} in it): the checkpoint "
                                              "is incomplete or was copied in part")
            self.sizes[name] = os.path.getsize(path)
        _require(offset + length <= self.sizes[name], path, f"{key} lies at bytes {offset}..{offset + length}, beyond "
                 f"the file's {self.sizes[name]} bytes: the file is truncated")
        return Stored(path, offset, length)


def _tensor_record(key: str, entry: Any, storage: dict, files: _Files) -> TensorRecord:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties

    where = files.metadata_path
    properties = getattr(entry, "properties", None)
    dtype = getattr(properties, "dtype", None)
    _require(isinstance(properties, TensorProperties) and dtype in DTYPE_TAGS, where,
             f"{key} has dtype {dtype!r:.40}, not one of {', '.join(str(d) for d in DTYPE_TAGS)}")
    shape = _sizes(getattr(entry, "size", None), where, f"the size of {key}")
    chunks, numel = [], 0
    raw_chunks = getattr(entry, "chunks", None)
    _require(isinstance(raw_chunks, list), where, f"the chunks of {key} are not a list")
    for chunk in raw_chunks:
        _require(isinstance(chunk, ChunkStorageMetadata), where, f"a chunk of {key} is not ChunkStorageMetadata")
        offsets = _sizes(getattr(chunk, "offsets", None), where, f"a chunk offset of {key}")
        sizes = _sizes(getattr(chunk, "sizes", None), where, f"a chunk size of {key}")
        inside = len(offsets) == len(sizes) == len(shape) and all(o + s <= d for o, s, d in zip(offsets, sizes, shape))
        _require(inside, where, f"a chunk of {key} at {list(offsets)} of size {list(sizes)} is not inside "
                 f"{list(shape)}")
        chunks.append(Chunk(offsets, sizes, files.stored(storage.get(MetadataIndex(key, offsets)), key)))
        numel += math.prod(sizes)
    _require(numel == math.prod(shape), where, f"the chunks of {key} hold {numel} elements, its shape {list(shape)} "
             f"{math.prod(shape)}")
    return TensorRecord(key, dtype, shape, tuple(chunks))


def read_dcp_folder(dcp_dir: str | os.PathLike[str]) -> DcpFolder:
    """Read and check the index of a DCP folder (see [Note: reading a DCP folder])."""
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata,
    )

    folder = os.path.abspath(os.fspath(dcp_dir))
    if not os.path.isdir(folder):
        raise CheckpointNotFoundError(f"{folder}: no such DCP checkpoint directory")
    metadata = _read_metadata(folder)
    where = os.path.join(folder, METADATA_NAME)
    entries, storage = getattr(metadata, "state_dict_metadata", None), getattr(metadata, "storage_data", None)
    _require(isinstance(metadata, Metadata) and isinstance(entries, dict) and isinstance(storage, dict), where,
             "no state_dict_metadata and storage_data of the filesystem writer")
    files, tensors, objects = _Files(folder, where), {}, {}
    for key, entry in entries.items():
        _require(isinstance(key, str), where, f"a key {key!r:.80} is not a string")
        if isinstance(entry, TensorStorageMetadata):
            tensors[key] = _tensor_record(key, entry, storage, files)
        elif isinstance(entry, BytesStorageMetadata):
            objects[key] = files.stored(storage.get(MetadataIndex(key)), key)
        else:
            raise _problem(where, f"{key} is a {type(entry).__name__}, neither a tensor nor a value")
    return DcpFolder(folder, tensors, objects)


# --------------------------------------------------------------------------- reading values
def _load(stored: Stored, what: str) -> Any:
    """One value, from exactly its byte range (see [Note: reading a DCP folder])."""
    with open(stored.file, "rb") as handle:
        handle.seek(stored.offset)
        data = handle.read(stored.length)
    _require(len(data) == stored.length, stored.file, f"{what} is cut short")
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch's weights-only unpickler on bytes from a file
        raise CheckpointError(f"{stored.file}: {what} at bytes {stored.offset}..{stored.offset + stored.length} is not "
                              f"a value torch.load(weights_only=True) reads ({type(exc).__name__}: {exc!s:.200}); the "
                              "file was edited or damaged") from exc


def read_value(stored: Stored, key: str) -> Any:
    if stored.length > _MAX_VALUE_BYTES:
        raise _problem(stored.file, f"{key} takes {stored.length} bytes, more than a param-group value does")
    return _load(stored, key)


def read_tensor(record: TensorRecord) -> torch.Tensor:
    """The whole tensor from its chunks, each checked (see [Note: reading a DCP folder])."""
    out = torch.empty(record.shape, dtype=record.dtype)
    covered = torch.zeros(record.shape, dtype=torch.bool)
    for chunk in record.chunks:
        value = _load(chunk.stored, f"a chunk of {record.key}")
        found = f"{value.dtype} {list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
        _require(isinstance(value, torch.Tensor) and value.dtype == record.dtype and tuple(value.shape) == chunk.sizes,
                 chunk.stored.file, f"a chunk of {record.key} is {found}, the metadata records {record.dtype} "
                 f"{list(chunk.sizes)}")
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise CheckpointError(f"{chunk.stored.file}: {record.key} holds inf or nan values: the run had diverged "
                                  "when it was saved; import an earlier checkpoint")
        region = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
        _require(not bool(covered[region].any()), chunk.stored.file, f"chunks of {record.key} overlap at "
                 f"{list(chunk.offsets)}")
        covered[region] = True
        out[region] = value
    return out


# --------------------------------------------------------------------------- the layout
@dataclass
class DcpLayout:
    """A DCP folder in the layout of [Note: the DCP layout]."""

    folder: DcpFolder
    model: dict[str, TensorRecord]  # parameter or buffer name -> its tensor
    state: dict[str, dict[str, TensorRecord | Stored]]  # parameter name -> optimizer state key -> value
    groups: list[dict[str, Any]]  # the param groups, their values read
    ignored: list[str] = field(default_factory=list)  # keys outside "model" and "optim"


def _split_keys(folder: DcpFolder, where: str) -> tuple[dict, dict, dict, list[str]]:
    model, state, groups, ignored = {}, {}, {}, []
    for key, value in [*folder.tensors.items(), *folder.objects.items()]:
        if key.startswith(f"{MODEL_KEY}."):
            _require(isinstance(value, TensorRecord), where, f"{key} is not a tensor")
            model[key[len(MODEL_KEY) + 1:]] = value
        elif key.startswith(STATE_PREFIX):
            name, _, item = key[len(STATE_PREFIX):].rpartition(".")
            _require(bool(name), where, f"{key} names no parameter")
            state.setdefault(name, {})[item] = value
        elif key.startswith(GROUPS_PREFIX):
            index, _, item = key[len(GROUPS_PREFIX):].partition(".")
            if not index.isdigit() or not item or "." in item:
                raise CheckpointError(f"{where}: {key} is not optim.param_groups.<index>.<key>: an optimizer state "
                                      "dict saved with flatten_optimizer_state_dict=True (torchtitan's), which this "
                                      "import does not read; save get_state_dict(model, optimizer) with its default "
                                      "options")
            groups.setdefault(int(index), {})[item] = value
        else:
            ignored.append(key)
    return model, state, groups, ignored


def read_layout(folder: DcpFolder) -> DcpLayout:
    """The model and optimizer state of a DCP folder, its param-group values read."""
    where = os.path.join(folder.path, METADATA_NAME)
    model, state, groups, ignored = _split_keys(folder, where)
    if not model or not groups:
        missing = " and ".join(k for k, found in ((MODEL_KEY, model), (OPTIM_KEY, groups)) if not found)
        raise CheckpointError(f"{where}: holds no {missing} state ({len(folder.tensors) + len(folder.objects)} keys, "
                              f"e.g. {sorted([*folder.tensors, *folder.objects])[:3]}); the import reads "
                              "dcp.save({'model': model_sd, 'optim': optim_sd}) with model_sd, optim_sd = "
                              "get_state_dict(model, optimizer) (docs/checkpoints.md, 'FSDP2 and DCP')")
    _require(sorted(groups) == list(range(len(groups))), where, f"param groups {sorted(groups)} are not 0 to "
             f"{len(groups) - 1}")
    read = [{k: read_value(v, f"{GROUPS_PREFIX}{i}.{k}") if isinstance(v, Stored) else v for k, v in groups[i].items()}
            for i in range(len(groups))]
    if ignored:
        logger.warning("hf_zero: %s: keys outside 'model' and 'optim' are not imported: %s", folder.path,
                       _listed(sorted(ignored)))
    return DcpLayout(folder, model, state, read, ignored)


# --------------------------------------------------------------------------- checks of an import
def _number(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dim() == 0:
        return value.item()
    return value


def _refuse_flags(group: dict[str, Any], index: int, where: str) -> None:
    refused = [f"{k}={group[k]!r}" for k in ("amsgrad", "maximize") if group.get(k) is True]
    if refused:
        raise NotImplementedError(f"{where}: param_groups[{index}] has {', '.join(refused)}; hf_zero's Adam/AdamW "
                                  "does not step that way, so this optimizer state cannot be imported")


def _carried_hyper(group: dict[str, Any], index: int, where: str) -> dict[str, Any]:
    """The hyperparameters hf_zero's Adam keeps, from an AdamW param group."""
    missing = [k for k in ("lr", "betas", "eps", "weight_decay") if k not in group]
    if missing:
        raise NotImplementedError(f"{where}: param_groups[{index}] lacks {missing}: not torch.optim.Adam/AdamW "
                                  "param groups; only Adam/AdamW state can be imported")
    hyper = {k: _number(group[k]) for k in CARRIED_HYPER if k in group}
    if isinstance(hyper["betas"], (list, tuple)):
        hyper["betas"] = tuple(_number(b) for b in hyper["betas"])
    if "decoupled_weight_decay" not in hyper and hyper["weight_decay"] != 0:
        raise NotImplementedError(f"{where}: param_groups[{index}] has weight_decay {hyper['weight_decay']} but no "
                                  "decoupled_weight_decay flag (torch < 2.6 writes none), so Adam and AdamW cannot "
                                  "be told apart; save it with torch >= 2.6")
    return hyper


def _group_names(layout: DcpLayout, where: str) -> list[list[str]]:
    names: list[list[str]] = []
    seen: set[str] = set()
    for index, group in enumerate(layout.groups):
        params = group.get("params")
        _require(isinstance(params, list) and all(isinstance(n, str) for n in params), where,
                 f"param_groups[{index}].params is not a list of parameter names")
        counts: dict[str, int] = {}
        for name in params:
            counts[name] = counts.get(name, 0) + 1
        again = sorted(seen & counts.keys()) or sorted(n for n, count in counts.items() if count > 1)
        _require(not again, where, f"{again[:3]} are listed more than once in the param groups")
        seen |= set(params)
        names.append(list(params))
    return names


def _model_problems(layout: DcpLayout, model: nn.Module, names: list[list[str]]) -> list[str]:
    params = {n: tuple(p.shape) for n, p in model.named_parameters()}
    aliases = parameter_aliases(model)
    expected = {**params, **{n: tuple(b.shape) for n, b in persistent_buffers(model)},
                **{a: params[c] for a, c in aliases.items() if a in layout.model}}
    saved = {n: r.shape for n, r in layout.model.items()}
    problems = [f"model.{n} {list(s)} is missing" for n, s in expected.items() if n not in saved]
    problems += [f"model.{n} is {list(saved[n])} in the checkpoint, {list(s)} in the model"
                 for n, s in expected.items() if n in saved and saved[n] != s]
    problems += [f"model.{n} {list(s)} is not in the model" for n, s in saved.items() if n not in expected]
    listed = {n for group in names for n in group}
    problems += [f"optim.state.{n} is not a parameter of the model (under its first name)"
                 for n in layout.state if n not in params]
    problems += [f"param group parameter {n} is not a parameter of the model (under its first name)"
                 for n in sorted(listed) if n not in params]
    problems += [f"optim.state.{n} has state but is in no param group" for n in layout.state if n not in listed]
    return problems


def _check_state(name: str, entries: dict[str, Any], shape: tuple[int, ...], where: str) -> int:
    """One parameter's AdamW state: its keys, its moments' shapes; returns its step count."""
    if sorted(entries) != sorted(ADAM_STATE):
        raise NotImplementedError(f"{where}: the optimizer state of {name} holds {sorted(entries)}, not AdamW's "
                                  f"{list(ADAM_STATE)}: only Adam/AdamW state can be imported")
    for key in ADAM_MOMENTS:
        record = entries[key]
        _require(isinstance(record, TensorRecord) and record.dtype.is_floating_point and record.shape == shape, where,
                 f"optim.state.{name}.{key} is not a floating tensor of the parameter's shape {list(shape)}")
    step = entries["step"]
    value = _number(read_tensor(step) if isinstance(step, TensorRecord) else read_value(step, f"step of {name}"))
    problem = step_problem(f"optim.state.{name}.step", value)
    _require(problem is None, where, problem or "")
    return int(value)


@dataclass
class ImportPlan:
    """What an import writes, every name and shape checked against the model."""

    layout: DcpLayout
    names: list[list[str]]  # the trainable parameters of each param group
    hyper: list[dict[str, Any]]
    steps: dict[str, int]  # per parameter with optimizer state
    frozen: list[str]  # parameters in no param group
    buffers: list[str]
    aliases: dict[str, str]


def plan_import(layout: DcpLayout, model: nn.Module) -> ImportPlan:
    """Every check of an import against ``model`` (see [Note: reading a DCP folder])."""
    where = os.path.join(layout.folder.path, METADATA_NAME)
    names = _group_names(layout, where)
    problems = _model_problems(layout, model, names)
    if problems:
        raise CheckpointError(f"{where}: the checkpoint holds a different model than the {type(model).__name__} given "
                              f"({len(problems)} mismatches: {_listed(problems)}); pass the model the FSDP2 run "
                              "trained (the same config)")
    for index, group in enumerate(layout.groups):
        _refuse_flags(group, index, where)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    steps = {n: _check_state(n, entries, shapes[n], where) for n, entries in layout.state.items()}
    hyper = [_carried_hyper(group, i, where) for i, group in enumerate(layout.groups)]
    listed = {n for group in names for n in group}
    aliases = {a: c for a, c in parameter_aliases(model).items() if a in layout.model}
    _check_ties(layout, aliases)
    return ImportPlan(layout, names, hyper, steps, [n for n in shapes if n not in listed],
                      [n for n, _ in persistent_buffers(model)], aliases)


def _check_ties(layout: DcpLayout, aliases: dict[str, str]) -> None:
    """A tied name saved apart holds its first name's values (the model shares one tensor)."""
    for alias, canonical in aliases.items():
        if not torch.equal(read_tensor(layout.model[alias]), read_tensor(layout.model[canonical])):
            raise CheckpointError(f"{layout.folder.path}: model.{alias} and model.{canonical} differ, but the model "
                                  "ties them (one tensor): the run that saved it did not tie them; pass that model")


# --------------------------------------------------------------------------- writing an import
def _flat(record: TensorRecord | None, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A tensor's elements in ``dtype``; zeros for optimizer state never created (torch's AdamW
    starts a parameter's moments at zero on its first step)."""
    if record is None:
        return torch.zeros(numel, dtype=dtype)
    return read_tensor(record).reshape(-1).to(dtype)


def _entry(label: str, key: str, records: list[TensorRecord | None], numels: list[int],
           dtype: torch.dtype = torch.float32) -> TensorEntry:
    """A group's flat tensor ``key``: its parameters' values back to back, read as written."""
    def produce() -> Iterator[torch.Tensor]:
        for record, numel in zip(records, numels):
            yield _flat(record, numel, dtype)
    return TensorEntry(tensor_name(label, key), dtype, (sum(numels),), produce)


def _record(label: str, param_group: int, names: list[str], shapes: list[tuple[int, ...]], tensors: dict[str, str],
            scalars: dict[str, Any]) -> dict[str, Any]:
    numels = [math.prod(s) for s in shapes]
    slots = [{"name": n, "shape": list(s), "offset": sum(numels[:i]), "numel": numels[i]}
             for i, (n, s) in enumerate(zip(names, shapes))]
    return {"unit": UNIT, "group": label, "trainable": param_group >= 0, "persistent": False,
            "param_group": param_group, "numel": sum(numels), "padded_numel": sum(numels), "world_size": 1,
            "slots": slots, "tensors": tensors,
            "optimizer_scalars": encode_state(scalars, f"optimizer state of {label}")}


def _group_scalars(names: list[str], steps: dict[str, int], optimizer_class: str, label: str) -> dict[str, Any]:
    """The step counts as the resuming optimizer keeps them ([Note: one step count per group])."""
    counts = [steps.get(n, 0) for n in names]
    if optimizer_class == "ZeroAdam":
        return {"step": max(counts, default=0), "slot_steps": counts}
    if len(set(counts)) > 1:
        raise CheckpointError(f"{label}: its parameters took different numbers of steps {sorted(set(counts))}; a torch "
                              f"{optimizer_class} passed to hf_zero.initialize keeps one count per group: import with "
                              "optimizer_class='ZeroAdam' (the config's Adam/AdamW, which counts per parameter)")
    return {"step": torch.tensor(float(counts[0] if counts else 0))}


def _trainable_part(plan: ImportPlan, optimizer_class: str) -> tuple[list[TensorEntry], list[dict[str, Any]]]:
    entries, records = [], []
    model, state = plan.layout.model, plan.layout.state
    with_state = bool(state)  # none at all: saved before the first step, the optimizer starts fresh
    for index, names in enumerate(plan.names):
        if not names:
            continue
        label, shapes = f"{UNIT}.group{index}", [model[n].shape for n in names]
        numels = [math.prod(s) for s in shapes]
        entries.append(_entry(label, PARAM_KEY, [model[n] for n in names], numels))
        keys = [PARAM_KEY]
        if with_state:
            for key in ADAM_MOMENTS:
                entries.append(_entry(label, OPTIM_PREFIX + key, [state.get(n, {}).get(key) for n in names], numels))
            keys += [OPTIM_PREFIX + k for k in ADAM_MOMENTS]
        scalars = _group_scalars(names, plan.steps, optimizer_class, label) if with_state else {}
        records.append(_record(label, index, names, shapes, {k: "F32" for k in keys}, scalars))
    return entries, records


def _frozen_part(plan: ImportPlan) -> tuple[list[TensorEntry], list[dict[str, Any]]]:
    """Parameters in no param group, in one group per saved dtype, kept in that dtype."""
    entries, records = [], []
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name in plan.frozen:
        by_dtype.setdefault(plan.layout.model[name].dtype, []).append(name)
    for dtype, names in by_dtype.items():
        label = f"{UNIT}.frozen.{str(dtype).removeprefix('torch.')}"
        shapes = [plan.layout.model[n].shape for n in names]
        entries.append(_entry(label, PARAM_KEY, [plan.layout.model[n] for n in names], [math.prod(s) for s in shapes],
                              dtype))
        records.append(_record(label, -1, names, shapes, {PARAM_KEY: DTYPE_TAGS[dtype]}, {}))
    return entries, records


def _buffer_entries(plan: ImportPlan) -> list[TensorEntry]:
    model = plan.layout.model
    return [TensorEntry(BUFFER_PREFIX + n, model[n].dtype, model[n].shape, lambda r=model[n]: read_tensor(r))
            for n in plan.buffers]


def _manifest(plan: ImportPlan, model: nn.Module, records: list[dict[str, Any]], optimizer_class: str, tag: str,
              save_id: str, global_steps: int) -> dict[str, Any]:
    from hf_zero.version import __version__

    buffers = [{"name": n, "dtype": str(plan.layout.model[n].dtype).removeprefix("torch."),
                "shape": list(plan.layout.model[n].shape)} for n in plan.buffers]
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "tag": tag, "save_id": save_id,
        "hf_zero_version": __version__, "torch_version": torch.__version__,
        "world_size": 1, "data_world_size": 1, "stage": 3, "compute_dtype": "float32",
        "global_steps": global_steps, "micro_steps": global_steps, "global_samples": 0,
        "config": {}, "model": dict(describe_model(model), buffers=buffers), "groups": records,
        "optimizer": {"class": optimizer_class, "param_groups": encode_state(plan.hyper, "optimizer.param_groups")},
        "lr_scheduler": None, "loss_scaler": None, "client_state": {}, "rng": [], "files": [],
        "imported_from": {"format": "torch.distributed.checkpoint", "dcp_dir": plan.layout.folder.path,
                          "ignored_keys": sorted(plan.layout.ignored)[:100]},
    }


def _check_import_target(dcp_dir: str, out_dir: str, optimizer_class: str) -> None:
    check_conversion_target(dcp_dir, out_dir, optimizer_class, "DCP")
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise CheckpointError(f"{out_dir} exists and is not a directory; choose a new folder for the hf_zero "
                              "checkpoint")
    tags = list_tags(out_dir)
    if tags or os.path.lexists(os.path.join(out_dir, LATEST_NAME)):
        raise CheckpointError(f"{out_dir} already holds an hf_zero checkpoint ({', '.join(tags) or LATEST_NAME}); the "
                              "import never replaces one: choose a new or empty OUT_DIR, or move that checkpoint away")


def import_dcp_checkpoint(dcp_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], model: nn.Module,
                          tag: str | None = None, optimizer_class: str = "ZeroAdam") -> str:
    """Convert a DCP folder saved by FSDP2 (``dcp.save({"model": ..., "optim": ...})`` of
    ``get_state_dict(model, optimizer)``, any world size) into an hf_zero checkpoint
    ``out_dir/<tag>`` (and ``out_dir/latest``) that ``engine.load_checkpoint(out_dir)`` resumes
    at any world size and stage; see [Note: the DCP layout]. Run it once, on one process.

    ``model`` is the model the run resumes (``hf-zero import-dcp`` builds it on the meta
    device from ``--model``): every name and shape is checked against it, and it is described
    in the manifest so ``hf-zero export`` works on the result. ``tag`` defaults to
    ``global_step<N>``, N the largest step count. ``optimizer_class`` as in
    ``import_deepspeed_checkpoint``. Returns the checkpoint directory written. A folder that is
    not what it claims raises :class:`CheckpointError` naming the file, optimizer state other
    than Adam/AdamW :class:`NotImplementedError`; nothing is written then (see [Note: reading
    a DCP folder]). Logs one warning that the tensor data is unchecked: DCP keeps no checksums.
    """
    dcp_dir, out_dir = os.path.abspath(os.fspath(dcp_dir)), os.path.abspath(os.fspath(out_dir))
    _check_import_target(dcp_dir, out_dir, optimizer_class)
    plan = plan_import(read_layout(read_dcp_folder(dcp_dir)), model)
    logger.warning("hf_zero: %s: the tensor data is imported unchecked: a DCP folder carries no checksums, so "
                   "flipped bytes inside a tensor cannot be detected (dtypes, shapes and finiteness are checked)",
                   dcp_dir)
    global_steps = max(plan.steps.values(), default=0)
    tag = f"global_step{global_steps}" if tag is None else str(tag)
    entries, records = _trainable_part(plan, optimizer_class)
    frozen_entries, frozen_records = _frozen_part(plan)
    entries += frozen_entries + _buffer_entries(plan)
    save_id = secrets.token_hex(8)
    manifest = _manifest(plan, model, records + frozen_records, optimizer_class, tag, save_id, global_steps)
    check_tag(tag)
    check_run_state(manifest, os.path.join(dcp_dir, METADATA_NAME), counters=True,
                    optimizer_groups=[{} for _ in plan.hyper])
    return write_converted(out_dir, tag, save_id, entries, manifest)


# --------------------------------------------------------------------------- export
def _adamw_defaults() -> dict[str, Any]:
    """Every key of an AdamW param group of the installed torch (see [Note: the DCP layout])."""
    probe = torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    return {k: v for k, v in probe.param_groups[0].items() if k != "params"}


def _export_hyper(manifest: dict[str, Any], path: str) -> list[dict[str, Any]]:
    """The AdamW param groups of a checkpoint, refusing any other optimizer's state."""
    optimizer = manifest.get("optimizer")
    if not isinstance(optimizer, dict):
        raise CheckpointError(f"{path}: saved without an optimizer, so it holds no AdamW state for FSDP2 to continue; "
                              "`hf-zero export` writes its weights alone as a Hugging Face folder")
    kind = optimizer.get("class")
    keys = {k for r in manifest["groups"] if r["trainable"] for k in r["tensors"] if k.startswith(OPTIM_PREFIX)}
    if kind not in TARGET_OPTIMIZERS or manifest.get("whole_param_state") or not keys <= {
            OPTIM_PREFIX + k for k in ADAM_MOMENTS}:
        raise NotImplementedError(f"{path}: optimizer state of {kind!r:.40} ({sorted(keys)}), not Adam/AdamW: FSDP2's "
                                  "torch.optim.AdamW cannot continue it; only Adam/AdamW checkpoints can be exported")
    saved = decode_state(optimizer["param_groups"], "optimizer.param_groups")
    _require(isinstance(saved, list) and all(isinstance(g, dict) for g in saved), path,
             "optimizer.param_groups is not a list of objects")
    groups = []
    for index, group in enumerate(saved):
        refused = [f"{k}={group[k]!r}" for k in ("amsgrad", "maximize") if group.get(k) is True]
        if refused:
            raise NotImplementedError(f"{path}: param group {index} has {', '.join(refused)}; exported state would not "
                                      "continue as it trained")
        hyper = dict(_adamw_defaults(), decoupled_weight_decay=kind != "Adam")
        hyper.update({k: group[k] for k in CARRIED_HYPER if k in group})
        hyper["betas"] = tuple(float(b) for b in hyper["betas"])
        hyper["initial_lr"] = group.get("initial_lr", hyper["lr"])
        groups.append(hyper)
    return groups


def _optim_keys(record: dict[str, Any]) -> list[str]:
    return [k for k in record["tensors"] if k.startswith(OPTIM_PREFIX)]


def _check_files(files: RankFiles, manifest: dict[str, Any]) -> None:
    """Every tensor of every rank file verified ([Note: verified loads]), and the ones export
    reads present with the manifest's sizes."""
    expected: dict[int, dict[str, int]] = {}
    for record in manifest["groups"]:
        shard_numel = record["padded_numel"] // record["world_size"]
        for index in range(record["world_size"]):
            for key in [PARAM_KEY] + _optim_keys(record):
                expected.setdefault(index, {})[tensor_name(record["group"], key)] = shard_numel
    buffers = manifest["model"].get("buffers", [])
    if buffers:
        expected.setdefault(0, {}).update({BUFFER_PREFIX + b["name"]: math.prod(b["shape"]) for b in buffers})
    for index in sorted(expected):
        files.check(index, expected[index])
    check_every_tensor(files, range(len(manifest["files"])))


def _assembled(files: RankFiles, saved: dict[str, SavedSlot], record: dict[str, Any], name: str,
               key: str) -> torch.Tensor:
    """One parameter's ``key`` (its master or a moment) from its slices in the rank files."""
    slot = saved[name]
    out = torch.empty(slot.numel, dtype=TAG_DTYPES[record["tensors"][key]])
    for piece in plan_pieces([{"name": name, "offset": 0, "numel": slot.numel}], (0, slot.numel), saved):
        out[piece.dst_lo:piece.dst_hi].copy_(files.read(piece.file_index, tensor_name(piece.label, key),
                                                        piece.src_lo, piece.src_hi))
    return out.view(slot.shape)


def _slot_steps(record: dict[str, Any]) -> list[int]:
    """The step count of each parameter of a saved group ([Note: one step count per group])."""
    scalars = decode_state(record.get("optimizer_scalars") or {}, f"optimizer_scalars of {record['group']}")
    if "slot_steps" in scalars:
        return [int(_number(c)) for c in scalars["slot_steps"]]
    return [int(_number(scalars.get("step", 0)))] * len(record["slots"])


def _export_state(files: RankFiles, manifest: dict[str, Any], hyper: list[dict[str, Any]]) -> dict[str, Any]:
    """The state dict of [Note: the DCP layout], every tensor in memory."""
    saved = index_saved_slots(manifest["groups"])
    model_sd: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, torch.Tensor]] = {}
    members: list[list[str]] = [[] for _ in hyper]
    for record in manifest["groups"]:
        steps = _slot_steps(record) if record["trainable"] else []
        for position, slot in enumerate(record["slots"]):
            name = slot["name"]
            model_sd[name] = _assembled(files, saved, record, name, PARAM_KEY)
            files.unmap()
            if not record["trainable"]:
                continue
            if not 0 <= record["param_group"] < len(hyper):
                raise CheckpointError(f"groups of {name}: param_group {record['param_group']} is not one of the "
                                      f"{len(hyper)} saved optimizer param groups")
            members[record["param_group"]].append(name)
            moments = {k: _assembled(files, saved, record, name, OPTIM_PREFIX + k) if _optim_keys(record)
                       else torch.zeros(slot["shape"], dtype=torch.float32) for k in ADAM_MOMENTS}
            state[name] = {"step": torch.tensor(float(steps[position])), **moments}
            files.unmap()
    for alias, canonical in manifest["model"].get("aliases", {}).items():
        model_sd[alias] = model_sd[canonical]
    for buf in manifest["model"].get("buffers", []):
        model_sd[buf["name"]] = files.read(0, BUFFER_PREFIX + buf["name"]).clone()
    groups = [dict(h, params=names) for h, names in zip(hyper, members)]
    return {MODEL_KEY: model_sd, OPTIM_KEY: {"state": state, "param_groups": groups}}


def _check_export_target(out_dir: str, source: str) -> None:
    if os.path.realpath(source).startswith(os.path.realpath(out_dir) + os.sep):
        raise CheckpointError(f"{out_dir}: the export directory contains the checkpoint {source}; choose another")
    if not os.path.lexists(out_dir):
        return
    if not os.path.isdir(out_dir) or os.listdir(out_dir):
        what = ("already holds a DCP checkpoint" if os.path.lexists(os.path.join(out_dir, METADATA_NAME))
                else "exists and is not an empty directory")
        raise CheckpointError(f"{out_dir} {what}; export never replaces files: choose a new or empty OUT_DIR")


def _save_dcp(state: dict[str, Any], out_dir: str) -> None:
    """``dcp.save`` on this process alone, into a temporary sibling renamed into place."""
    import torch.distributed.checkpoint as dcp

    parent, name = os.path.split(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp_dir = os.path.join(parent, f".{name}.tmp-{secrets.token_hex(8)}")
    os.mkdir(tmp_dir)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # dcp.save's note that it saves from one process: it is meant to
            dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_dir), no_dist=True)
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty: _check_export_target
        os.rename(tmp_dir, out_dir)
        fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise


def export_dcp_checkpoint(ckpt_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], tag: str | None = None,
                          allow_unverified: bool = False) -> str:
    """Write the hf_zero checkpoint ``ckpt_dir`` (any stage, any world size; ``tag`` None: the
    one ``latest`` names) as the DCP folder ``out_dir`` that an FSDP2 run loads into the same
    model and a ``torch.optim.AdamW`` with the same param groups; see [Note: the DCP layout].
    Every tensor is verified first, as ``load_checkpoint`` does ([Note: verified loads]).
    ``out_dir`` must be new or empty; it appears only once complete. Only Adam/AdamW state
    exports (others raise :class:`NotImplementedError`). The whole state (weights and both
    moments, fp32) is held in memory while it is written. Returns ``out_dir``."""
    source = resolve_checkpoint_dir(ckpt_dir, tag)
    out_dir = os.path.abspath(os.fspath(out_dir))
    manifest = read_manifest(source, allow_unverified)
    path = os.path.join(source, MANIFEST_NAME)
    check_export_manifest(manifest, path)
    _check_export_target(out_dir, source)
    files = RankFiles(source, manifest, allow_unverified)
    try:
        with manifest_errors(source):
            hyper = _export_hyper(manifest, path)
            check_run_state(manifest, path, counters=False, optimizer_groups=[{} for _ in hyper])
            _check_files(files, manifest)
            state = _export_state(files, manifest, hyper)
    finally:
        files.close()
    try:
        _save_dcp(state, out_dir)
    except OSError as exc:  # a full disk, a read-only mount
        raise CheckpointError(f"export to {out_dir} failed: {exc.strerror or exc} ({type(exc).__name__}); nothing was "
                              "written") from exc
    return out_dir
