"""Which byte ranges of which saved rank file fill a rank's shard now: pure arithmetic.

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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping


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
