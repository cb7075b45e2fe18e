"""A unit: one module and the flat groups of the parameters it owns (see partition.py)."""

from __future__ import annotations

import torch
from torch import nn

from hf_zero.comm import Communicator
from hf_zero.engine.flat_group import FlatParamGroup, GroupKind
from hf_zero.engine.param_source import ParamSource
from hf_zero.offload import OffloadSettings
from hf_zero.partition import UnitSpec, is_persistent


class ZeroUnit:
    """The groups of one unit, handled together: gathered together, reduced together."""

    def __init__(
        self,
        index: int,
        spec: UnitSpec,
        param_group_of: dict[int, int],
        comm: Communicator,
        stage: int,
        compute_dtype: torch.dtype,
        device: torch.device,
        persistence_threshold: int,
        source: ParamSource | None = None,
        offload: OffloadSettings = OffloadSettings(),
    ) -> None:
        self.index = index
        self.name = spec.name
        self.module: nn.Module = spec.module
        buckets: dict[GroupKind, list[tuple[str, nn.Parameter]]] = {}
        for name, param in spec.params:
            kind = GroupKind(
                trainable=param.requires_grad,
                persistent=is_persistent(param, stage, persistence_threshold),
                param_group_index=param_group_of.get(id(param), 0) if param.requires_grad else -1,
            )
            buckets.setdefault(kind, []).append((name, param))
        self.groups = [
            FlatParamGroup(
                f"{spec.name}#{i}", named, kind, comm, stage, compute_dtype, device, source,
                offload if kind.trainable or offload.params != "none" else OffloadSettings(),
            )
            for i, (kind, named) in enumerate(sorted(buckets.items(), key=_kind_order))
        ]
        self.trainable_params = [p for g in self.groups if g.kind.trainable for p in g.params]
        # Frozen gathered parameters get no gradient hook, yet the backward may still read them
        # after the last trainable gradient: see [Note: releasing a unit in backward].
        self.has_frozen_sharded = any(g.shards_params and not g.kind.trainable for g in self.groups)
        # Per-backward state, reset by the end-of-backward sweep.
        self.backward_started = False
        self.grads_reduced = False
        self.pending_grads = 0

    @property
    def numel(self) -> int:
        return sum(g.layout.numel for g in self.groups)

    @property
    def sharded_numel(self) -> int:
        """Elements that are gathered and freed around use (stage 3, non-persistent)."""
        return sum(g.layout.padded_numel for g in self.groups if g.shards_params)

    @property
    def is_unsharded(self) -> bool:
        """Whether the sharded groups are gathered (or being gathered)."""
        return any(g.shards_params and g.full.untyped_storage().nbytes() > 0 for g in self.groups)

    def unshard(self, async_op: bool = False) -> None:
        for group in self.groups:
            group.unshard(async_op=async_op)

    def wait_unshard(self) -> None:
        for group in self.groups:
            group.wait_unshard()

    def reshard(self) -> None:
        for group in self.groups:
            group.reshard()

    def prepare_grads(self) -> None:
        for group in self.groups:
            group.prepare_grads()

    def reduce_grads(self, reduce_dtype: torch.dtype) -> None:
        """Reduce every group now, one collective each (stage 0's all-reduce; the other stages
        reduce through buckets, see hf_zero.engine.buckets)."""
        self.grads_reduced = True
        for group in self.groups:
            group.reduce_grads(reduce_dtype)

    def reset_backward_state(self) -> None:
        self.backward_started = False
        self.grads_reduced = False
        self.pending_grads = len(self.trainable_params)
        self.input_signal = False  # a hook waits for the gradients of this unit's inputs
        self.inputs_done = False


def _kind_order(item: tuple[GroupKind, list]) -> tuple[int, int, int]:
    kind = item[0]
    return (not kind.trainable, kind.persistent, kind.param_group_index)
