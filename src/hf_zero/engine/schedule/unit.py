"""A unit: one module and the flat groups of the parameters it owns (see partition.py).

[Note: unit states]
Each unit carries two explicit states, and every change of either goes through one method that
checks the transition is allowed, so a protocol error fails loudly where it happens instead of
surfacing later as a wrong storage size:

- its parameters (:class:`StorageState`, the states its sharded groups' storages share):
  SHARDED (only this rank's shards exist), GATHERING (an all-gather is in flight), GATHERED
  (full parameters usable). A unit with nothing to shard (stages 0-2, persistent or root-only
  groups) is GATHERED for good.
- its gradients in the current backward (:class:`GradState`): IDLE (its backward has not
  started), ACCUMULATING (its output got a gradient: autograd is filling ``.grad``), READY (final
  for this backward: every trainable parameter got its gradient, or the shared schedule passed
  the unit without this rank running it, see [Note: the shared schedule] in hooks.py), REDUCING
  (in a reduction in flight), REDUCED. The end-of-backward sweep puts every unit back to IDLE.
"""

from __future__ import annotations

import enum

import torch
from torch import nn

from hf_zero.comm import Communicator
from hf_zero.engine.sharding.buffer_pool import BufferPool
from hf_zero.engine.sharding.flat_group import FlatParamGroup, GroupKind
from hf_zero.engine.sharding.param_source import ParamSource
from hf_zero.engine.sharding.param_storage import StorageState
from hf_zero.engine.policy import ShardingPolicy
from hf_zero.offload import OffloadSettings
from hf_zero.partition import UnitSpec, is_persistent


class GradState(enum.Enum):
    IDLE = "idle"
    ACCUMULATING = "accumulating"
    READY = "ready"
    REDUCING = "reducing"
    REDUCED = "reduced"


_PARAM_MOVES = {
    StorageState.SHARDED: {StorageState.GATHERING, StorageState.GATHERED},
    StorageState.GATHERING: {StorageState.GATHERED},
    StorageState.GATHERED: {StorageState.SHARDED},
}
_GRAD_MOVES = {
    GradState.IDLE: {GradState.ACCUMULATING, GradState.READY},
    GradState.ACCUMULATING: {GradState.READY},
    GradState.READY: {GradState.REDUCING, GradState.REDUCED},
    GradState.REDUCING: {GradState.REDUCED},
    GradState.REDUCED: set(),
}


class GatheredNumel:
    """How many sharded elements are gathered (or gathering) now, in total and among the units
    the backward has passed.

    [Note: gathered elements, counted as they move]
    The prefetch budget, ``stage3_max_live_parameters`` and the reuse distance read how much is
    gathered at every unit's forward and backward; summing it over every unit made that
    O(units) per unit, O(units^2) per step (22 layers: about a thousand unit visits a step).
    Each unit instead reports its own moves (``ZeroUnit._move_params``: SHARDED -> GATHERING or
    GATHERED adds its sharded elements, GATHERED -> SHARDED takes them away), and the backward
    marks the units it has passed (``GatherPlan.passed``), so both sums are kept as they change."""

    def __init__(self) -> None:
        self.total = 0
        self.behind = 0  # of units the backward has passed

    def moved(self, unit: "ZeroUnit", gathered: bool) -> None:
        delta = unit.sharded_numel if gathered else -unit.sharded_numel
        self.total += delta
        if unit.behind_cursor:
            self.behind += delta

    def pass_cursor(self, unit: "ZeroUnit") -> None:
        if not unit.behind_cursor:
            unit.behind_cursor = True
            if unit.is_unsharded:
                self.behind += unit.sharded_numel

    def reset_cursor(self, units: list["ZeroUnit"]) -> None:
        for unit in units:
            unit.behind_cursor = False
        self.behind = 0


class UnitStateError(RuntimeError):
    """A unit was asked for a transition its state does not allow: a bug in the protocol."""


class ZeroUnit:
    """The groups of one unit, handled together: gathered together, reduced together."""

    def __init__(
        self,
        index: int,
        spec: UnitSpec,
        param_group_of: dict[int, int],
        comm: Communicator,
        policy: ShardingPolicy,
        compute_dtype: torch.dtype,
        device: torch.device,
        source: ParamSource | None = None,
        offload: OffloadSettings = OffloadSettings(),
        buffers: BufferPool | None = None,
        wire_dtype_of: dict[int, torch.dtype] | None = None,
    ) -> None:
        """``wire_dtype_of``: parameter id -> the dtype it is gathered and reduced in, for the
        parameters of [Note: lower-precision-safe modules] in hf_zero.engine.lower_precision."""
        self.index = index
        self.name = spec.name
        self.module: nn.Module = spec.module
        buckets: dict[GroupKind, list[tuple[str, nn.Parameter]]] = {}
        for name, param in spec.params:
            kind = GroupKind(
                trainable=param.requires_grad,
                persistent=is_persistent(param, policy.shards_params, policy.persistence_threshold),
                param_group_index=param_group_of.get(id(param), 0) if param.requires_grad else -1,
                wire_dtype=(wire_dtype_of or {}).get(id(param)),
            )
            buckets.setdefault(kind, []).append((name, param))
        self.groups = [
            FlatParamGroup(
                f"{spec.name}#{i}", named, kind, comm, policy, compute_dtype, device, source,
                offload if kind.trainable or offload.params != "none" else OffloadSettings(), buffers,
                owner=self,
            )
            for i, (kind, named) in enumerate(sorted(buckets.items(), key=_kind_order))
        ]
        self.trainable_params = [p for g in self.groups if g.kind.trainable for p in g.params]
        self.trainable_groups = [g for g in self.groups if g.kind.trainable]
        # Frozen gathered parameters get no gradient hook, yet the backward may still read them
        # after the last trainable gradient: see [Note: releasing a unit in backward].
        self.has_frozen_sharded = any(g.storage.sharded_between_uses and not g.kind.trainable for g in self.groups)
        # A plain nn.Embedding's backward reads only the indices, never the weight: stage 3
        # neither keeps it gathered for the backward nor gathers it there ([Note: units whose
        # backward reads no parameter] in hooks.py).
        self.backward_reads_params = not (isinstance(self.module, nn.Embedding)
                                          and type(self.module).forward is nn.Embedding.forward)
        # Elements gathered and freed around use (stage 3, non-persistent); fixed by the layout.
        self.sharded_numel = sum(g.layout.padded_numel for g in self.groups if g.storage.sharded_between_uses)
        self.param_state = StorageState.SHARDED if self.sharded_numel else StorageState.GATHERED
        self.grad_state = GradState.IDLE
        self._gathered: GatheredNumel | None = None  # [Note: gathered elements, counted as they move]
        self.behind_cursor = False  # the current backward has passed this unit
        self.reset_backward_state()

    # ----------------------------------------------------------------- sizes
    @property
    def numel(self) -> int:
        return sum(g.layout.numel for g in self.groups)

    def count_gathered_in(self, gathered: GatheredNumel) -> None:
        """Report this unit's gathers and frees to ``gathered`` from now on."""
        self._gathered = gathered
        if self.is_unsharded:
            gathered.moved(self, gathered=True)

    def buffer_sizes_in_backward(self) -> frozenset[int]:
        """The sizes of the buffers this unit's backward takes from the pool: its gathered
        parameters (unless its backward reads none), its flat gradients (unless autograd's are
        adopted: [Note: a gradient autograd hands over] in grad_buffer.py)."""
        sizes = set()
        for group in self.groups:
            if group.storage.sharded_between_uses and self.backward_reads_params:
                sizes.add(group.storage.full.numel() * group.storage.full.element_size())
            if group.grads.full is not None and not group.grads.adopts_autograd_grad:
                sizes.add(group.grads.full_bytes)
        return frozenset(sizes)

    # ----------------------------------------------------------------- parameter state
    def _move_params(self, new: StorageState) -> None:
        if new not in _PARAM_MOVES[self.param_state]:
            raise UnitStateError(f"unit {self.name}: parameters cannot go from {self.param_state.value} to {new.value}")
        was_sharded = self.param_state is StorageState.SHARDED
        self.param_state = new
        if self._gathered is not None and self.sharded_numel and was_sharded != (new is StorageState.SHARDED):
            self._gathered.moved(self, gathered=was_sharded)

    @property
    def is_unsharded(self) -> bool:
        """Whether the sharded groups are gathered or being gathered."""
        return bool(self.sharded_numel) and self.param_state is not StorageState.SHARDED

    def unshard(self, async_op: bool = False, exact: bool = False) -> None:
        """Start gathering (``async_op``) or gather; no collective is issued unless the unit is
        SHARDED, or, with ``exact`` (a full-precision gather, never async), unless a group holds
        values gathered in a lower dtype ([Note: lower-precision-safe modules])."""
        if self.param_state is not StorageState.SHARDED:
            if not async_op:
                self.wait_unshard()
            if exact:
                for group in self.groups:
                    group.storage.make_exact()
            return
        self._move_params(StorageState.GATHERING if async_op else StorageState.GATHERED)
        for group in self.groups:
            group.storage.unshard(async_op=async_op, exact=exact)

    def wait_unshard(self) -> None:
        if self.param_state is StorageState.GATHERING:
            for group in self.groups:
                group.storage.wait_unshard()
            self._move_params(StorageState.GATHERED)

    def reshard(self) -> None:
        """Free the gathered parameters (a no-op for a unit with nothing sharded)."""
        if not self.sharded_numel or self.param_state is StorageState.SHARDED:
            return
        self.wait_unshard()
        for group in self.groups:
            group.storage.reshard()
        self._move_params(StorageState.SHARDED)

    # ----------------------------------------------------------------- gradient state
    def move_grads(self, new: GradState) -> None:
        if new not in _GRAD_MOVES[self.grad_state]:
            raise UnitStateError(f"unit {self.name}: gradients cannot go from {self.grad_state.value} to {new.value}")
        self.grad_state = new

    def group_reduced(self) -> None:
        """One of this unit's groups finished its reduction in this backward."""
        self.unreduced_groups -= 1
        if self.unreduced_groups == 0 and self.grad_state is GradState.REDUCING:
            self.move_grads(GradState.REDUCED)

    def prepare_grads(self) -> None:
        """Before the unit's backward."""
        for group in self.groups:
            group.grads.prepare(for_backward=True)

    def reset_backward_state(self) -> None:
        self.grad_state = GradState.IDLE
        self.pending_grads = len(self.trainable_params)
        self.unreduced_groups = len(self.trainable_groups)
        self.backward_visited = False  # the shared backward schedule reached this unit
        self.input_signal = False  # a hook waits for the gradients of this unit's inputs
        self.inputs_done = False


def _kind_order(item: tuple[GroupKind, list]) -> tuple[int, int, int, str]:
    kind = item[0]
    return (not kind.trainable, kind.persistent, kind.param_group_index, str(kind.wire_dtype or ""))
