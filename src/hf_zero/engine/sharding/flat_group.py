"""A unit's parameters of one :class:`GroupKind` in one padded flat buffer: the identity (kind,
parameters, owner, layout) and its three parts, each with its own state: the parameter storage
(:class:`~hf_zero.engine.sharding.param_storage.ParamStorage`: layout, views, gather and free), the
gradient buffer (:class:`~hf_zero.engine.sharding.grad_buffer.GradBuffer`: accumulate, reduce, shard) and
the fp32 master (:class:`~hf_zero.engine.sharding.master_state.MasterState`: precision, placement).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from hf_zero.comm import Communicator
from hf_zero.comm.block_wire import BlockWire
from hf_zero.engine.sharding.buffer_pool import BufferPool
from hf_zero.engine.sharding.gather_wire import CastWire, GatherWire
from hf_zero.engine.sharding.grad_buffer import GradBuffer
from hf_zero.engine.sharding.master_state import MasterState
from hf_zero.engine.sharding.param_source import ParamSource
from hf_zero.engine.sharding.param_storage import ParamStorage
from hf_zero.engine.sharding.param_usage import shard_segments
from hf_zero.engine.policy import ShardingPolicy
from hf_zero.offload import OffloadSettings
from hf_zero.partition import FlatLayout, build_flat_layout

if TYPE_CHECKING:  # unit.py builds the groups: imports this module
    from hf_zero.engine.schedule.unit import ZeroUnit


@dataclass(frozen=True)
class GroupKind:
    """What decides how a group of parameters is handled."""

    trainable: bool
    persistent: bool  # with policy.shards_params only: stays gathered between steps
    param_group_index: int  # the optimizer param group it steps in
    # The dtype its stage-3 gathers and its gradient reductions send, where it is not the
    # engine's: [Note: lower-precision-safe modules] in hf_zero.engine.lower_precision.
    wire_dtype: torch.dtype | None = None


class FlatParamGroup:
    """The parameters of one unit that share a :class:`GroupKind`, in one padded flat buffer
    split into ``world_size`` equal shards (rank r owns shard r).

    What it shards is its :class:`ShardingPolicy`'s ([Note: sharding policy]): without
    ``shards_optimizer_state`` (stage 0) it keeps everything full and all-reduces gradients; with
    it, it owns one shard of the optimizer state (``shards_gradients``: of the gradients too);
    with ``shards_params`` (stage 3) a group that is not persistent also keeps only its parameter
    shard outside ``storage.unshard`` / ``storage.reshard`` (``storage.sharded_between_uses``).

    The work is its parts': ``storage`` (:class:`ParamStorage`), ``grads`` (:class:`GradBuffer`)
    and ``master_state`` (:class:`MasterState`); callers use the parts directly.
    """

    def __init__(
        self,
        label: str,
        named_params: list[tuple[str, nn.Parameter]],
        kind: GroupKind,
        comm: Communicator,
        policy: ShardingPolicy,
        compute_dtype: torch.dtype,
        device: torch.device,
        source: ParamSource | None = None,
        offload: OffloadSettings = OffloadSettings(),
        buffers: BufferPool | None = None,
        *,
        owner: ZeroUnit | None = None,
    ) -> None:
        self.label = label
        # The memory of the full buffers that come and go ([Note: the buffer pool]).
        buffers = buffers if buffers is not None else BufferPool(device)
        self.owner = owner  # the ZeroUnit this group belongs to (the unit building it)
        self.offload = offload
        self.kind = kind
        self.comm = comm
        self.policy = policy
        self.params = [p for _, p in named_params]
        shard_world = comm.world_size if policy.shards_optimizer_state else 1
        persistent = policy.shards_params and kind.persistent  # padded less: [Note: alignment in flat buffers]
        self.layout: FlatLayout = build_flat_layout(named_params, shard_world, persistent)
        sharded_between_uses = policy.shards_params and not kind.persistent
        # The pool counts a size's users by group: the parameter and gradient buffers of one
        # group are one user ([Note: the buffer pool]).
        self.storage = ParamStorage(label, self.params, self.layout, self.shard_range, comm, sharded_between_uses,
                                    compute_dtype, device, source, buffers, pool_user=self,
                                    lend_shard=not offload.optimizer_on_host,
                                    wire=self._gather_wire(compute_dtype))
        leaves_device = offload.params_on_host and sharded_between_uses
        self.master_state = MasterState(label, self.storage.shard if kind.trainable else None, compute_dtype,
                                        offload, separate=leaves_device)
        self.grads = GradBuffer(label, self.params, self.layout, comm, policy, offload, buffers, self,
                                compute_dtype, device, self.master_state.tensor)
        # [Note: parameters no rank used] in hf_zero.engine.sharding.param_usage: per parameter, whether
        # some rank got a gradient for it (set by the optimizer step, the same on every rank).
        self.params_used = [True] * len(self.params)
        self.segments = shard_segments(self.layout, self.shard_range)
        # The shard leaves the device after the master is made from it.
        self.storage.leave_device(offload)

    def _gather_wire(self, compute_dtype: torch.dtype) -> GatherWire | None:
        """What a stage-3 gather of this group sends, where it is not the compute-dtype shard."""
        if self.policy.quantized_weight_gathers and compute_dtype.is_floating_point:
            lo, hi = self.shard_range
            return BlockWire(hi - lo, bits=8)
        if self.kind.wire_dtype is not None and self.kind.wire_dtype != compute_dtype:
            return CastWire(self.kind.wire_dtype)
        return None

    @property
    def shard_range(self) -> tuple[int, int]:
        rank = self.comm.rank if self.policy.shards_optimizer_state else 0
        return self.layout.shard_range(rank)

    def gather_updated_shards(self) -> None:
        """After the optimizer step, bring every rank's updated shard into the full buffer
        (stages 1-2, and persistent stage-3 groups); sharded stage-3 groups gather lazily."""
        if not self.policy.shards_optimizer_state or self.storage.sharded_between_uses:
            return
        self.storage.gather_updated_shards(self.shard_range)

    def refresh_from_full(self) -> None:
        """The full buffer was changed from outside (``gathered_parameters`` with a modifier):
        make the shard and the master agree with it."""
        lo, hi = self.shard_range
        if self.storage.sharded_between_uses:
            self.storage.write_shard(self.storage.full[lo:hi])
        if not self.master_state.is_compute_shard:
            self.master_state.write(self.storage.full[lo:hi])

    @property
    def used_in_step(self) -> bool:
        """Some rank used some parameter of the group in this step: it is stepped."""
        return any(self.params_used)
