"""Which byte ranges of which saved rank file fill a rank's shard now (pure arithmetic), and
whether the saved groups merged into one agree on their optimizer scalars.

[Note: resharding by name]
A saved group is a padded flat buffer split in ``W`` equal shards, shard k in rank file k. A
layout is a pure function of (model, world size, stage, persistence threshold, optimizer param
groups), so after a change of world size or stage the groups themselves may differ (stage 3
splits small parameters into persistent groups; stage 0 has one shard). Data is therefore
mapped *by parameter name*: for each slot of a new group that overlaps the range a rank now owns,
find the same name in the saved layout, turn the overlap into a range of the saved flat buffer,
and cut that range at the saved shard boundaries. Each piece is a contiguous slice of one
tensor in one rank file; adjacent pieces are merged, so an unchanged layout reads exactly one
slice per group. Padding is never read: the destination starts zeroed.

[Note: one step count per group]
Element-wise optimizer state is mapped by name like the parameters. The config's Adam keeps its
step counts per parameter too (``slot_steps``, [Note: parameters no rank used] in
hf_zero.engine.sharding.param_usage), so they are mapped by name as well, whatever groups a new layout
merges or splits (a checkpoint saved before per-parameter counts gives each parameter its group's
``step``). An optimizer whose scalars are one per flat tensor (a torch optimizer rebuilt over the
shards) cannot be split that way: a new layout may merge several saved groups into one (stage 3
keeps parameters under the persistence threshold in groups of their own; stage 0-2 do not), and
if the saved groups stepped a different number of times, any one value would be wrong for part
of it, so the load refuses unless every merged group holds the same scalars; the checkpoint
loads at the layout it was saved with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch

from hf_zero.checkpoint.errors import CheckpointError
from hf_zero.checkpoint.manifest import decode_state


@dataclass(frozen=True)
class SavedSlot:
    """Where a parameter lives in the checkpoint."""

    name: str
    shape: tuple[int, ...]
    group_index: int  # index into the manifest's "groups"
    label: str  # the saved group's label: tensor names in rank files start with it
    offset: int  # in the saved group's flat buffer
    numel: int
    shard_numel: int  # of the saved group


@dataclass(frozen=True)
class Piece:
    """Elements [src_lo, src_hi) of tensor ``{label}/<key>`` in rank file ``file_index`` go to
    elements [dst_lo, dst_hi) of the destination shard."""

    file_index: int
    label: str
    src_lo: int
    src_hi: int
    dst_lo: int
    dst_hi: int

    @property
    def numel(self) -> int:
        return self.src_hi - self.src_lo


def index_saved_slots(groups: Iterable[Mapping[str, Any]]) -> dict[str, SavedSlot]:
    """Saved slots by parameter name, from the manifest's group list."""
    slots: dict[str, SavedSlot] = {}
    for index, group in enumerate(groups):
        shard_numel = group["padded_numel"] // group["world_size"]
        for slot in group["slots"]:
            slots[slot["name"]] = SavedSlot(
                slot["name"], tuple(slot["shape"]), index, group["group"], slot["offset"], slot["numel"], shard_numel
            )
    return slots


def plan_pieces(
    slots: Iterable[Mapping[str, Any]], dst_range: tuple[int, int], saved: Mapping[str, SavedSlot]
) -> list[Piece]:
    """The reads that fill the destination range [lo, hi) of a group whose slots are ``slots``
    (dicts or objects with name/offset/numel) from the saved layout; see [Note: resharding by name]."""
    lo, hi = dst_range
    pieces: list[Piece] = []
    for slot in slots:
        name, offset, numel = _slot_fields(slot)
        start, stop = max(offset, lo), min(offset + numel, hi)
        if start >= stop:
            continue
        src = saved[name]
        flat_lo = src.offset + (start - offset)
        flat_hi = flat_lo + (stop - start)
        dst = start - lo
        while flat_lo < flat_hi:
            k = flat_lo // src.shard_numel
            end = min(flat_hi, (k + 1) * src.shard_numel)
            base = k * src.shard_numel
            pieces.append(Piece(k, src.label, flat_lo - base, end - base, dst, dst + end - flat_lo))
            dst += end - flat_lo
            flat_lo = end
    return coalesce(pieces)


def saved_sources(slots: Iterable[Any], saved: Mapping[str, SavedSlot]) -> list[int]:
    """The indices of the saved groups that hold a group's parameters, in saved order."""
    return sorted({saved[_slot_fields(slot)[0]].group_index for slot in slots})


PER_SLOT_KEYS = ("step", "slot_steps")


def merged_scalars(label: str, slots: Iterable[Any], saved: Mapping[str, SavedSlot], manifest: Mapping[str, Any],
                   manifest_path: str, per_slot: bool) -> dict[str, Any]:
    """The optimizer scalars of the new group ``label`` (its layout's ``slots``) from the saved
    groups that hold its parameters: see [Note: one step count per group]."""
    slots = list(slots)
    sources = saved_sources(slots, saved)
    decoded = {i: _decoded(manifest["groups"][i]) for i in sources}
    if not per_slot:
        check_same_scalars(label, sources, manifest, manifest_path)
        return decoded[sources[0]]
    others = [{k: v for k, v in manifest["groups"][i].get("optimizer_scalars", {}).items() if k not in PER_SLOT_KEYS}
              if isinstance(manifest["groups"][i].get("optimizer_scalars"), dict) else None for i in sources]
    if any(o != others[0] for o in others[1:]):
        check_same_scalars(label, sources, manifest, manifest_path)  # raises, naming the groups
    result = {k: v for k, v in decoded[sources[0]].items() if k not in PER_SLOT_KEYS}
    counts = [_saved_slot_steps(_slot_fields(slot)[0], saved, manifest, decoded) for slot in slots]
    result["slot_steps"] = counts
    result["step"] = max(counts, default=0)
    return result


def _decoded(record: Mapping[str, Any]) -> dict[str, Any]:
    scalars = decode_state(record.get("optimizer_scalars") or {}, f"optimizer_scalars of {record['group']}")
    return scalars if isinstance(scalars, dict) else {}


def _saved_slot_steps(name: str, saved: Mapping[str, SavedSlot], manifest: Mapping[str, Any],
                      decoded: Mapping[int, dict[str, Any]]) -> int:
    """The step count parameter ``name`` reached in the checkpoint."""
    source = saved[name].group_index
    scalars = decoded[source]
    if "slot_steps" in scalars:
        position = [s["name"] for s in manifest["groups"][source]["slots"]].index(name)
        return int(scalars["slot_steps"][position])
    step = scalars.get("step", 0)
    return int(step.item() if isinstance(step, torch.Tensor) else step)


def check_same_scalars(label: str, sources: list[int], manifest: Mapping[str, Any], manifest_path: str) -> None:
    """The saved groups merged into group ``label`` hold the same optimizer scalars: see
    [Note: one step count per group]."""
    records = [manifest["groups"][i] for i in sources]
    encoded = [r.get("optimizer_scalars") or {} for r in records]
    if all(e == encoded[0] for e in encoded[1:]):
        return
    found = "; ".join(f"{r['group']}: {_describe(e, r['group'])}" for r, e in zip(records, encoded))
    raise CheckpointError(
        f"{manifest_path}: this engine's group {label} merges saved groups that stepped a different "
        f"number of times ({found}); it keeps one optimizer step count per group, so any one value "
        "would be wrong for part of it. Load at the layout the checkpoint was saved with (stage "
        f"{manifest.get('stage')}, the same stage3_param_persistence_threshold and optimizer param "
        "groups), or load with load_optimizer_states=False to start the optimizer fresh"
    )


def _describe(encoded: Any, label: str) -> str:
    """Optimizer scalars as ``step=3``, for an error message."""
    scalars = decode_state(encoded, f"optimizer_scalars of {label}")
    if not isinstance(scalars, dict) or not scalars:
        return "no optimizer step yet"
    parts = []
    for key, value in scalars.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        parts.append(f"{key}={value:g}" if isinstance(value, float) else f"{key}={value}")
    return ", ".join(parts)


def coalesce(pieces: list[Piece]) -> list[Piece]:
    merged: list[Piece] = []
    for piece in pieces:
        last = merged[-1] if merged else None
        if (last is not None and last.file_index == piece.file_index and last.label == piece.label
                and last.src_hi == piece.src_lo and last.dst_hi == piece.dst_lo):
            merged[-1] = Piece(last.file_index, last.label, last.src_lo, piece.src_hi, last.dst_lo, piece.dst_hi)
        else:
            merged.append(piece)
    return merged


def _slot_fields(slot: Any) -> tuple[str, int, int]:
    if isinstance(slot, Mapping):
        return slot["name"], slot["offset"], slot["numel"]
    return slot.name, slot.offset, slot.numel
