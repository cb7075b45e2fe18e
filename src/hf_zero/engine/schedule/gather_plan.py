"""Which units are gathered when, beyond the one running: the prefetch ahead of the shared
schedule and the units kept gathered from their forward to their backward.

[Note: reuse distance]
DeepSpeed's ``stage3_max_reuse_distance``: a unit is kept gathered after its forward when its
next use, its own backward, comes within that many gathered elements. On the forward order, the
elements gathered between a unit's forward and its backward are twice those of the units after
it (each runs forward, then backward, before this one's backward). Kept units skip the re-gather,
so stage 3 moves 2Ψ instead of 3Ψ per step, at the cost of holding those parameters; a unit is
only kept while the gathered elements stay within ``stage3_max_live_parameters``. Nothing is kept
without autograd (evaluation) or with a distance of 0. The decision reads the shared schedule's
state only, so every rank keeps the same units. Whatever is still gathered is freed at the end
of backward, and before every optimizer step (an update makes a gathered copy stale).
"""

from __future__ import annotations

from hf_zero.engine.policy import ShardingPolicy
from hf_zero.engine.schedule.unit import GatheredNumel, ZeroUnit
from hf_zero.engine.sharding.param_storage import StorageState


class GatherPlan:
    """The prefetch and reuse decisions of one model's units ([Note: reuse distance],
    [Note: the shared schedule] in hooks.py). Every decision reads only what the ranks share
    (the schedule's order and which units are gathered), so every rank makes the same ones."""

    def __init__(self, units: list[ZeroUnit], backward_order: list[ZeroUnit], policy: ShardingPolicy,
                 max_live_numel: int) -> None:
        self.units = units
        self.root = units[-1]
        self.backward_order = backward_order
        self.policy = policy
        self.prefetch_numel = policy.prefetch_numel
        self.max_reuse_numel = policy.max_reuse_numel
        self.max_live_numel = max_live_numel
        self.numel_after: dict[int, int] = {self.root.index: 0}  # sharded elements after a unit
        after = 0
        for unit in reversed(units[:-1]):
            self.numel_after[unit.index] = after
            after += unit.sharded_numel
        # What is gathered, kept as the units move ([Note: gathered elements, counted as they move]
        # in unit.py): every decision below reads it in O(1).
        self.gathered = GatheredNumel()
        for unit in units:
            unit.count_gathered_in(self.gathered)

    # ------------------------------------------------------------------ reuse
    def keeps_for_backward(self, unit: ZeroUnit, training_pass: bool) -> bool:
        """Whether ``unit`` stays gathered until its backward: [Note: reuse distance]; always
        in a pass with autograd when the policy does not reshard after the forward."""
        if not training_pass or not unit.sharded_numel:
            return False
        if not unit.backward_reads_params:  # see [Note: units whose backward reads no parameter] in hooks.py
            return False
        if not self.policy.reshard_after_forward:
            return True
        if self.max_reuse_numel <= 0:
            return False
        if 2 * self.numel_after[unit.index] >= self.max_reuse_numel:
            return False
        return self.live_numel() <= self.max_live_numel

    def live_numel(self) -> int:
        """Gathered (or gathering) elements: in a forward, the same on every rank."""
        return self.gathered.total

    def live_numel_ahead(self) -> int:
        """Gathered elements of the root and of the units the backward has not passed yet (the
        one being visited included): the part of the backward's state every rank shares (units
        behind the cursor are freed when this rank's own backward of them ends, at different
        times on different ranks)."""
        return self.gathered.total - self.gathered.behind

    def passed(self, unit: ZeroUnit) -> None:
        """The backward's visit of ``unit`` has made its gather decisions: from now on it is behind."""
        self.gathered.pass_cursor(unit)

    def backward_done(self) -> None:
        self.gathered.reset_cursor(self.units)

    # ------------------------------------------------------------------ prefetch
    def prefetch(self, order: list[ZeroUnit], start: int, live: int) -> None:
        """Start gathering the units of ``order`` from ``start`` on.

        The next unit is always prefetched when prefetching is on (a unit is gathered whole, and
        DeepSpeed's per-parameter bucket defaults, 0.9 x hidden^2, are smaller than one decoder
        layer); further units only while the bucket holds them. Nothing is prefetched that would
        take the gathered elements past ``stage3_max_live_parameters``."""
        if self.prefetch_numel <= 0:
            return
        budget = self.prefetch_numel
        first = True
        backward = order is self.backward_order
        for upcoming in order[start:]:
            if not upcoming.sharded_numel or (backward and not upcoming.backward_reads_params):
                continue
            budget -= upcoming.sharded_numel
            if (budget < 0 and not first) or live + upcoming.sharded_numel > self.max_live_numel:
                break
            first = False
            if upcoming.param_state is StorageState.SHARDED:
                live += upcoming.sharded_numel
                upcoming.unshard(async_op=True)
