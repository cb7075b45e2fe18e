"""Checkpoints of state that lives in NVMe files: streamed out of and into the files a tile at
a time, in the same format as resident state.

[Note: checkpoints of NVMe-offloaded state]
Under ``offload_optimizer.device: "nvme"`` a group's fp32 master and Adam moments are in the
optimizer store's files and its step count in the store; under ``offload_param.device: "nvme"``
a frozen group's compute shard is in the parameter store's file (a trainable group's compute
copy is the cast of its master, which is what checkpoints hold). Saving writes exactly the
tensors the resident path writes (``<label>/param`` fp32, ``<label>/optim.exp_avg``,
``<label>/optim.exp_avg_sq``, the step as an optimizer scalar), read from the files in tiles of
``sub_group_size`` elements straight into the safetensors file (see [Note: streamed
safetensors]); loading fills the files tile by tile from the saved slices (see [Note:
resharding by name]) and writes the compute copy next to the master. Memory stays at one tile,
and a checkpoint saved with NVMe offload loads without it, at another world size, and back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from hf_zero.checkpoint.engine_state import EngineState
from hf_zero.checkpoint.errors import CheckpointError
from hf_zero.checkpoint.manifest import OPTIM_PREFIX, PARAM_KEY, tensor_name
from hf_zero.checkpoint.reshard import Piece
from hf_zero.checkpoint.safetensors_io import TensorEntry

MOMENTS = ("exp_avg", "exp_avg_sq")

if TYPE_CHECKING:
    from hf_zero.engine.sharding.flat_group import FlatParamGroup


def _store(engine: EngineState, group: FlatParamGroup) -> Any:
    """The optimizer's NVMe store when it holds this group's state, else None."""
    optimizer = engine.optimizer
    if optimizer is None or optimizer.nvme is None or group.master_state.nvme_index is None:
        return None
    return optimizer.nvme


def is_streamed(engine: EngineState, group: FlatParamGroup) -> bool:
    """Whether the group's checkpointed state is in files (then this module saves and loads it)."""
    return _store(engine, group) is not None or (group.master_state.tensor is None and group.storage.nvme_shard is not None)


def _tile_numel(group: FlatParamGroup) -> int:
    return max(1, int(group.offload.tile_numel))


# ------------------------------------------------------------------ save
def streamed_entries(engine: EngineState, group: FlatParamGroup) -> tuple[TensorEntry, list[tuple[str, TensorEntry]], dict[str, Any]]:
    """A streamed group's parameter entry, its element-wise optimizer entries (key, entry) and
    its optimizer scalars: what ``save._group_records`` takes from resident tensors otherwise."""
    label, numel = group.label, group.layout.shard_numel
    store = _store(engine, group)
    if store is None:  # a frozen group whose compute shard is in a file
        shard = group.storage.nvme_shard
        produce = lambda: shard.iter_tiles(_tile_numel(group))  # noqa: E731
        return TensorEntry(tensor_name(label, PARAM_KEY), shard.dtype, (numel,), produce), [], {}
    index = group.master_state.nvme_index

    def tiles(state: str) -> Callable[[], Iterator[torch.Tensor]]:
        return lambda: store.iter_tiles(index, state)

    param = TensorEntry(tensor_name(label, PARAM_KEY), torch.float32, (numel,), tiles("master"))
    if store.steps[index] == 0:  # as ZeroAdam: no state before the first step
        return param, [], {}
    moments = [(key, TensorEntry(tensor_name(label, OPTIM_PREFIX + key), torch.float32, (numel,), tiles(key)))
               for key in MOMENTS]
    scalars: dict[str, Any] = {"step": store.steps[index]}
    if store.slot_steps[index] is not None:  # see [Note: parameters no rank used]
        scalars["slot_steps"] = list(store.slot_steps[index])
    return param, moments, scalars


# ------------------------------------------------------------------ load
def check_streamed_keys(engine: EngineState, group: FlatParamGroup, keys: list[str], manifest_path: str) -> None:
    """Before anything is loaded: NVMe-offloaded Adam keeps only its two moments."""
    unknown = sorted(set(keys) - set(MOMENTS))
    if _store(engine, group) is not None and unknown:
        raise CheckpointError(f"{manifest_path}: optimizer state {unknown} of {group.label} cannot go to "
                              f"NVMe-offloaded Adam, which keeps only {list(MOMENTS)}; load with "
                              "load_optimizer_states=False")


def _filled_tiles(numel: int, pieces: list[Piece], key: str, files: Any, tile_numel: int) -> Iterator[tuple[int, torch.Tensor]]:
    """Elements [0, numel) of a destination shard in tiles (start, values): each tile zeroed
    (padding is never read), then filled from the saved pieces that overlap it."""
    buffer = torch.empty(min(tile_numel, max(numel, 1)), dtype=torch.float32)
    for start in range(0, numel, buffer.numel()):
        stop = min(numel, start + buffer.numel())
        tile = buffer[: stop - start].zero_()
        for piece in pieces:
            lo, hi = max(piece.dst_lo, start), min(piece.dst_hi, stop)
            if lo < hi:
                src = piece.src_lo + (lo - piece.dst_lo)
                tile[lo - start : hi - start].copy_(
                    files.read(piece.file_index, tensor_name(piece.label, key), src, src + hi - lo))
        yield start, tile


def load_streamed_parameters(engine: EngineState, group: FlatParamGroup, pieces: list[Piece], files: Any) -> None:
    """The saved master (or frozen shard) of a streamed group into its files, with the compute
    copy written next to it."""
    store = _store(engine, group)
    numel = group.layout.shard_numel
    for start, tile in _filled_tiles(numel, pieces, PARAM_KEY, files, _tile_numel(group)):
        if store is not None:
            store.write(group.master_state.nvme_index, "master", start, tile)
        group.storage.write_shard(tile, start)


def load_streamed_optimizer(engine: EngineState, group: FlatParamGroup, pieces: list[Piece], keys: list[str],
                            scalars: dict[str, Any], files: Any) -> None:
    """Adam's moments and step count of a group whose optimizer state is in NVMe files."""
    store = _store(engine, group)
    numel = group.layout.shard_numel
    for key in MOMENTS:
        if key in keys:
            for start, tile in _filled_tiles(numel, pieces, OPTIM_PREFIX + key, files, store.tile_numel):
                store.write(group.master_state.nvme_index, key, start, tile)
        else:  # saved before the first step: fresh moments
            zeros = torch.zeros(store.tile_numel, dtype=torch.float32)
            for start in range(0, numel, store.tile_numel):
                store.write(group.master_state.nvme_index, key, start, zeros[: min(store.tile_numel, numel - start)])
    store.steps[group.master_state.nvme_index] = int(scalars.get("step", 0)) if keys else 0
    slot_steps = scalars.get("slot_steps") if keys else None
    store.slot_steps[group.master_state.nvme_index] = [int(c) for c in slot_steps] if slot_steps is not None else None
