"""The gradient buckets whose reductions are in flight: how many may be, which are finished
before another goes out, and what finishing one does.

[Note: gradients in flight]
A bucket in flight holds its units' full gradients until its reduction finishes. Two buckets
in flight overlap a reduction with the next unit's backward, but the bound counts buckets, not
bytes: an untied head's gradient (1002 MiB per rank at the Llama-3-8B shape in bf16, 2.4x a
layer's) stayed in flight through the next layer's backward and, with the fake process group of
the simulation (torch 2.13: its reductions never report completion), through the embedding's. So under
stage 3 a bucket going out first finishes the oldest ones while they hold more than
``BUCKETS_IN_FLIGHT - 1`` times its own bytes: equal layers keep two in flight, a bucket much
larger than the next is finished before the next goes out. The estimator's replay applies the
same rule ([Note: stage-3 working memory] in hf_zero/estimator.py).
"""

from __future__ import annotations

from typing import Callable

import torch

from hf_zero.comm import Communicator
from hf_zero.engine.policy import ShardingPolicy
from hf_zero.engine.schedule.buckets import PendingBucket, finish_bucket, start_bucket
from hf_zero.engine.schedule.unit import GradState
from hf_zero.engine.sharding.flat_group import FlatParamGroup


class ReductionFlight:
    """Launches the reductions of buckets and finishes them, within the policy's bound
    (``policy.reductions_in_flight``) and [Note: gradients in flight]."""

    def __init__(self, policy: ShardingPolicy, comm: Communicator, reduce_dtype: torch.dtype,
                 is_boundary: Callable[[], bool],
                 on_grads_final: Callable[[list[FlatParamGroup]], None] | None = None) -> None:
        self.policy = policy
        self.comm = comm
        self.reduce_dtype = reduce_dtype
        self.is_boundary = is_boundary
        # Called with groups whose fp32 gradient shard is final at the accumulation boundary.
        self.on_grads_final = on_grads_final
        self.in_flight: list[PendingBucket] = []

    def launch(self, groups: list[FlatParamGroup]) -> None:
        """Reduce one bucket (stage 0: all-reduce; else reduce-scatter). Stages 0, 1 and 3 keep
        at most ``BUCKETS_IN_FLIGHT`` in flight ([Note: the shared schedule] in hooks.py; stages
        0-1 only in the boundary's backward, as DDP's reducer overlaps its buckets with the rest
        of the backward); stage 2 with overlap_comm keeps one; otherwise it is done before this
        returns: ``policy.reductions_in_flight``."""
        limit = self.policy.reductions_in_flight
        async_op = limit > 0
        self.collect_finished()
        # [Note: gradients in flight]: a bucket larger than the one going out is finished first.
        new_bytes = sum(g.grads.full_bytes for g in groups)
        while self.in_flight and (len(self.in_flight) >= max(limit, 1) or (
                self.policy.shards_params and sum(p.grad_bytes for p in self.in_flight) > (limit - 1) * new_bytes)):
            self._finish(self.in_flight.pop(0))
        pending = start_bucket(groups, self.comm, self.reduce_dtype, async_op)
        for unit in {id(g.owner): g.owner for g in groups}.values():
            if unit.grad_state is GradState.READY:
                unit.move_grads(GradState.REDUCING)
        if pending is None:
            return
        if async_op:
            self.in_flight.append(pending)
        else:
            self._finish(pending)

    def collect_finished(self) -> None:
        """Finish the reductions in flight that have completed, without waiting."""
        done = [p for p in self.in_flight if p.is_completed()]
        for pending in done:
            self.in_flight.remove(pending)
            self._finish(pending)

    def finish_all(self) -> None:
        while self.in_flight:
            self._finish(self.in_flight.pop(0))

    def _finish(self, pending: PendingBucket) -> None:
        finish_bucket(pending)
        for group in pending.groups:
            group.owner.group_reduced()
        if self.on_grads_final is not None and self.is_boundary():
            # Only groups whose every parameter this rank used: whether another rank used the
            # rest is known at the step ([Note: parameters no rank used]).
            self.on_grads_final([g for g in pending.groups if g.grads.shard is not None and g.grads.fully_received])
