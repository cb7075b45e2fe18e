"""Buckets: one collective for several small flat groups.

[Note: buckets]
A unit's gradients are reduce-scattered, and (stages 1-2) its updated shard all-gathered, as one
collective per flat group. Many units are small (norms, biases, a model's persistent pieces), and
a collective has a fixed cost, so groups are bucketed the way DeepSpeed's ``reduce_bucket_size``
and ``allgather_bucket_size`` buckets work:

- Gradients: a group of ``IN_PLACE_NUMEL`` elements or more is reduce-scattered alone, in
  place (from its own buffer: no copy). The smaller ones are bucketed in a fixed order (see
  [Note: buckets in a fixed order]); a bucket holds at least ``reduce_bucket_size`` elements
  (but the last); it is packed rank-major with ``kernels.pack_for_reduce_scatter`` (cast to the
  reduce dtype, and pre-divided where one is due, in the same pass) and reduce-scattered once;
  rank r receives its shard of every group back to back. Where the division by the world size
  happens is [Note: averaging gradients over ranks] (engine/sharding/grad_average.py). The full
  gradients are freed as soon as they are packed, so a bucket in flight holds one packed copy,
  not the groups' buffers. ``reduce_bucket_size`` 0 gives one collective per group; a bucket of
  one group skips the pack and reduces in place.
- Updated parameters (after the step): a group of ``IN_PLACE_NUMEL`` elements or more is
  all-gathered alone, in place (its shard is a view of its full buffer: no copy at all); the
  smaller ones, up to ``allgather_bucket_size`` elements, send their shards concatenated in one
  all-gather, and ``kernels.unpack_after_all_gather`` puts every rank's part back into each
  group's full buffer.

For a large group the copies into and out of a bucket cost more than one more collective: on a
29.5M GPT-2 at stage 2 on CPU, packing the one 118 MB gradient bucket took 69 ms of a 1.36 s step
and the all-gather's packing and unpacking 50 ms of a 350 ms optimizer step.

The elements moved are the same as without buckets (2Ψ / 3Ψ); the number of collectives drops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from hf_zero.comm import Communicator, Handle
from hf_zero.engine.sharding.flat_group import FlatParamGroup
from hf_zero.engine.sharding.grad_buffer import PendingReduce
from hf_zero.engine.sharding.grad_average import plan_average
from hf_zero.engine.schedule.unit import GradState, ZeroUnit
from hf_zero.kernels import pack_for_reduce_scatter, unpack_after_all_gather


@dataclass
class PendingBucket:
    """A bucket's reduction in flight: groups reducing in place (``per_group``: a lone group, or
    world size 1) or a packed buffer whose received part is split over ``groups`` at
    :func:`finish_bucket`."""

    groups: list[FlatParamGroup]
    per_group: list[tuple[FlatParamGroup, PendingReduce]] | None = None
    handle: Handle | None = None
    received: torch.Tensor | None = None
    send: torch.Tensor | None = None  # the collective's input, alive until it completes
    divisor: int = 1  # the received part is still divided by this ([Note: averaging gradients over ranks])

    @property
    def grad_bytes(self) -> int:
        """The gradient bytes the reduction holds until it finishes ([Note: gradients in flight]
        in hooks.py)."""
        return sum(g.grads.full_bytes for g in self.groups)

    def is_completed(self) -> bool:
        """Whether waiting would return at once."""
        if self.per_group is not None:
            return all(p.handle is None or p.handle.is_completed() for _, p in self.per_group)
        return self.handle is None or self.handle.is_completed()


def _bucket_label(groups: list[FlatParamGroup]) -> str:
    """The profiler label: the group's own label, or ``bucket[a,b,c]`` naming every group (the
    first and last and a count past 8 groups, to keep traces readable)."""
    if len(groups) == 1:
        return groups[0].label
    if len(groups) <= 8:
        return "bucket[" + ",".join(g.label for g in groups) + "]"
    return f"bucket[{groups[0].label},...,{groups[-1].label}]x{len(groups)}"


def start_bucket(
    groups: list[FlatParamGroup], comm: Communicator, reduce_dtype: torch.dtype, async_op: bool
) -> PendingBucket | None:
    """Issue the reduce-scatter of ``groups``' gradients (see [Note: buckets]) in ``reduce_dtype``,
    or in the groups' own wire dtype ([Note: lower-precision-safe modules] in
    hf_zero.engine.lower_precision: a bucket holds groups of one)."""
    if not groups:
        return None
    reduce_dtype = groups[0].kind.wire_dtype or reduce_dtype  # one per bucket: split_buckets' key
    if len(groups) == 1 or not comm.active:
        # Nothing to pack: a lone group (or world size 1) reduces in place, group by group.
        started = [(g, g.grads.start_reduce(reduce_dtype, async_op)) for g in groups]
        return PendingBucket(groups, per_group=[(g, p) for g, p in started if p is not None])
    world = comm.world_size
    for group in groups:
        group.grads.prepare()  # zeros for a group that got no gradient this backward
    send = torch.empty(sum(g.layout.padded_numel for g in groups), dtype=reduce_dtype,
                       device=groups[0].grads.full.device)
    average = plan_average(reduce_dtype, comm, send.device)
    if not groups[0].policy.shards_optimizer_state:
        return _start_all_reduce(groups, comm, send, average, async_op)
    pack_for_reduce_scatter([g.grads.to_reduce() for g in groups], world, send, scale=1.0 / average.pre_divisor)
    for group in groups:
        group.grads.release()  # packed: the full gradients are no longer needed
    received = torch.empty(send.numel() // world, dtype=reduce_dtype, device=send.device)
    handle = comm.reduce_scatter_into(received, send, label=_bucket_label(groups), async_op=async_op, op=average.op)
    return PendingBucket(groups, handle=handle, received=received, send=send, divisor=average.post_divisor)


def _start_all_reduce(groups: list[FlatParamGroup], comm: Communicator, send: torch.Tensor, average: Any,
                      async_op: bool) -> PendingBucket:
    """Stage 0: DDP's bucket. The groups' gradients back to back, divided as [Note: averaging
    gradients over ranks] says (a division, as DDP's reducer divides, so that the fp32 result is
    DDP's bit for bit at world size 2), all-reduced in place; each group reads its part back."""
    offset = 0
    for group in groups:
        numel = group.layout.padded_numel
        send[offset:offset + numel].copy_(group.grads.to_reduce())
        group.grads.drop_accum()  # packed; the 16-bit .grad views stay (stage 0 keeps them)
        offset += numel
    if average.pre_divisor > 1:
        send.div_(average.pre_divisor)
    handle = comm.all_reduce_into(send, label=_bucket_label(groups), op=average.op, async_op=async_op)
    return PendingBucket(groups, handle=handle, received=send, send=send, divisor=average.post_divisor)


def finish_bucket(pending: PendingBucket) -> None:
    """Wait for a bucket and add each group's part into its fp32 gradient shard."""
    if pending.per_group is not None:
        for group, reduce in pending.per_group:
            group.grads.finish_reduce(reduce)
        return
    if pending.handle is not None:
        pending.handle.wait()
    offset = 0
    for group in pending.groups:
        numel = group.layout.shard_numel
        part = pending.received[offset : offset + numel]
        group.grads.accept_reduced(part, pending.divisor)
        offset += numel


class ReduceSchedule:
    """The gradient buckets of a backward, formed once from the fixed unit order.

    [Note: buckets in a fixed order]
    Buckets are cut from the trainable groups in the shared backward order (the units in reverse
    model order, the root last; see [Note: the shared schedule] in hooks.py) by
    :func:`split_buckets` (a large group alone, the others until ``reduce_bucket_size``
    elements), so every rank has the same buckets. They go out in
    that order: bucket i is reduced once all its groups are READY on this rank and bucket i-1 has
    gone, as DDP's reducer does. A group this rank did not use is READY with zeros once the
    schedule has passed its unit, and at the latest at the end of the backward; so whatever path
    each rank took, the k-th reduce-scatter of every rank carries the same groups.
    """

    def __init__(self, groups_in_order: list[tuple[ZeroUnit, FlatParamGroup]], bucket_numel: int) -> None:
        owners = {id(g): u for u, g in groups_in_order}
        self.buckets: list[list[tuple[ZeroUnit, FlatParamGroup]]] = [
            [(owners[id(g)], g) for g in bucket]
            for bucket in split_buckets([g for _, g in groups_in_order], bucket_numel)
        ]
        self.next = 0  # the first bucket not yet reduced in this backward

    def reset(self) -> None:
        self.next = 0

    def ready_buckets(self) -> Iterator[list[FlatParamGroup]]:
        """Take, in order, every bucket whose units are all past ACCUMULATING (READY, or already
        reducing another of their groups) and all before it gone."""
        while self.next < len(self.buckets):
            bucket = self.buckets[self.next]
            if any(unit.grad_state in (GradState.IDLE, GradState.ACCUMULATING) for unit, _ in bucket):
                return
            self.next += 1
            yield [g for _, g in bucket]

    def remaining(self) -> Iterator[list[FlatParamGroup]]:
        """Every bucket not yet taken, in order (the end of the backward)."""
        while self.next < len(self.buckets):
            self.next += 1
            yield [g for _, g in self.buckets[self.next - 1]]


def split_buckets(groups: list[FlatParamGroup], bucket_numel: int,
                  key: Callable[[FlatParamGroup], object] = lambda g: g.kind.wire_dtype) -> Iterator[list[FlatParamGroup]]:
    """Groups in order, in buckets: a group of ``IN_PLACE_NUMEL`` elements or more is a bucket of
    its own; the others fill a bucket of their ``key`` (one collective has one dtype), closed (and
    yielded where its last group falls) once it holds ``bucket_numel`` elements; the buckets still
    open at the end follow in the order they were opened."""
    open_buckets: dict[object, tuple[list[FlatParamGroup], int]] = {}
    for group in groups:
        if group.layout.padded_numel >= IN_PLACE_NUMEL:
            yield [group]
            continue
        bucket, numel = open_buckets.pop(key(group), ([], 0))
        bucket.append(group)
        numel += group.layout.padded_numel
        if numel >= bucket_numel:
            yield bucket
        else:
            open_buckets[key(group)] = (bucket, numel)
    for bucket, _ in sorted(open_buckets.values(), key=lambda entry: groups.index(entry[0][0])):
        yield bucket


# Groups at least this large are reduce-scattered, and all-gathered after the step, alone and in
# place ([Note: buckets]).
IN_PLACE_NUMEL = 1 << 20


def all_gather_updated(groups: list[FlatParamGroup], comm: Communicator, bucket_numel: int) -> None:
    """After the step: every rank's updated shard into each group's full buffer (stages 1-2 and
    persistent stage-3 groups), one all-gather per bucket (see [Note: buckets])."""
    if not comm.active:
        return
    eligible = [g for g in groups if g.policy.shards_optimizer_state and not g.storage.sharded_between_uses]
    for bucket in split_buckets(eligible, bucket_numel, key=lambda g: g.storage.full.dtype):
        if len(bucket) == 1:
            bucket[0].gather_updated_shards()  # in place: the shard is a view of the full buffer
            continue
        send = torch.cat([g.storage.full[slice(*g.shard_range)] for g in bucket])
        received = torch.empty(send.numel() * comm.world_size, dtype=send.dtype, device=send.device)
        comm.all_gather_into(received, send, label=f"{_bucket_label(bucket)}.step")
        unpack_after_all_gather(received, comm.world_size, [g.storage.full for g in bucket])
