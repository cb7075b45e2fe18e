"""The optimizer state of a whole-parameter step in checkpoints: saved and found by parameter name.

[Note: whole-parameter state in checkpoints]
A shape-aware optimizer's state ([Note: whole-parameter step]) belongs to one owner rank per
parameter and has the parameter's shape or its own (Adafactor's row and column variances), so it
cannot be cut into flat shards. Each owner writes the state of the parameters it owns into its
own rank file, as ``whole_optim/<parameter name>/<key>`` (0-d values such as ``step``, and
non-tensor ones, go to the manifest), and the manifest's ``whole_param_state`` says, per
parameter name, which rank file holds it. A load at any world size or stage looks up the
parameters the new owners own by name, verifies those tensors with the rest of the load, and
only then gives them to the optimizer, after the flat masters were written and copied into the
owners' full-shape masters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from hf_zero.checkpoint.engine_state import EngineState
from hf_zero.checkpoint.errors import CheckpointError
from hf_zero.checkpoint.manifest import decode_state, encode_state, optimizer_value_on, param_group_of
from hf_zero.checkpoint.reader import RankFiles
from hf_zero.checkpoint.safetensors_io import DTYPE_TAGS, TAG_DTYPES, TensorEntry

WHOLE_PREFIX = "whole_optim/"
MANIFEST_KEY = "whole_param_state"


def whole_params_of(engine: EngineState) -> Any:
    """The engine's WholeParamStep, or None on the flat path."""
    return getattr(engine.optimizer, "whole_params", None) if engine.optimizer is not None else None


def whole_tensor_name(param: str, key: str) -> str:
    return f"{WHOLE_PREFIX}{param}/{key}"


def whole_state_entries(engine: EngineState) -> tuple[list[TensorEntry], dict[str, Any]]:
    """This rank's entries for its rank file and its record for the manifest (parameter name ->
    tensor specs and encoded scalars), for the parameters it owns."""
    whole = whole_params_of(engine)
    if whole is None:
        return [], {}
    entries: list[TensorEntry] = []
    record: dict[str, Any] = {}
    for name, master in whole.owned_masters():
        state = whole.inner.state.get(master, {})
        tensors, scalars = {}, {}
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                entries.append(TensorEntry.of(whole_tensor_name(name, key), value))
                tensors[key] = {"dtype": DTYPE_TAGS[value.dtype], "shape": list(value.shape)}
            else:
                scalars[key] = value
        if state:
            record[name] = {"tensors": tensors, "scalars": encode_state(scalars, f"optimizer state of {name}")}
    return entries, record


def merge_records(records: list[Mapping[str, Any] | None]) -> dict[str, Any]:
    """The manifest's ``whole_param_state``: every writing rank's record, with its file index."""
    merged: dict[str, Any] = {}
    for index, record in enumerate(records):
        for name, spec in (record or {}).items():
            merged[name] = dict(spec, file=index)
    return merged


@dataclass
class WholeRead:
    """The saved state of one parameter this rank owns now."""

    master: torch.Tensor
    name: str
    file_index: int | None  # None: no tensors to read
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    scalars: dict[str, Any]


def plan_whole_state(engine: EngineState, manifest: Mapping[str, Any], manifest_path: str) -> list[WholeRead]:
    """The reads that restore the optimizer state of the parameters this rank owns; raises a
    :class:`CheckpointError` naming the checkpoint when it has no such state."""
    whole = whole_params_of(engine)
    if whole is None:
        return []
    saved = manifest.get(MANIFEST_KEY)
    if not isinstance(saved, Mapping):
        raise CheckpointError(
            f"{manifest_path}: the checkpoint has no per-parameter optimizer state for "
            f"{type(whole.inner).__name__} (it was saved by a version of hf_zero that did not write it); "
            "load with load_optimizer_states=False to restore the weights and start the optimizer fresh"
        )
    reads = []
    for name, master in whole.owned_masters():
        spec = saved.get(name)
        if spec is None:  # never stepped (saved before the first step, or a parameter no rank used)
            reads.append(WholeRead(master, name, None, {}, {}))
            continue
        tensors = {key: (TAG_DTYPES[t["dtype"]], tuple(t["shape"])) for key, t in spec["tensors"].items()}
        scalars = decode_state(spec.get("scalars") or {}, f"{MANIFEST_KEY}[{name!r}].scalars")
        if not isinstance(scalars, dict):
            raise CheckpointError(f"{manifest_path}: {MANIFEST_KEY}[{name!r}].scalars is not an object")
        reads.append(WholeRead(master, name, int(spec["file"]) if tensors else None, tensors, scalars))
    return reads


def expected_tensors(reads: list[WholeRead]) -> dict[int, dict[str, int]]:
    """File index -> tensor name -> element count, for :meth:`RankFiles.check`."""
    expected: dict[int, dict[str, int]] = {}
    for read in reads:
        for key, (_, shape) in read.tensors.items():
            expected.setdefault(read.file_index, {})[whole_tensor_name(read.name, key)] = math.prod(shape)
    return expected


def apply_whole_state(engine: EngineState, reads: list[WholeRead], files: RankFiles) -> None:
    """Give the optimizer the verified state (after the owners' masters were reloaded)."""
    whole = whole_params_of(engine)
    for read in reads:
        if not read.tensors and not read.scalars:
            whole.inner.state.pop(read.master, None)
            continue
        state: dict[str, Any] = {}
        for key, (dtype, shape) in read.tensors.items():
            data = files.read(read.file_index, whole_tensor_name(read.name, key))
            state[key] = data.to(device=read.master.device, dtype=dtype).reshape(shape)
        param_group = param_group_of(whole.inner, read.master)
        for key, value in read.scalars.items():
            state[key] = optimizer_value_on(read.master, key, value, param_group)
        whole.inner.state[read.master] = state
