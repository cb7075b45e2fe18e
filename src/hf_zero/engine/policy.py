"""What the engine shards and when: one explicit policy, resolved once by ``hf_zero.initialize``.

[Note: sharding policy]
DeepSpeed names its behaviours by a stage number, and the engine used to compare that number
wherever it made a decision (``stage == 0``, ``stage >= 2``, ``stage != 2``, ...): about fifty
places, each silently encoding a different fact (does the all-reduce or a reduce-scatter run?
are gradients reduced every micro-step or only at the boundary? are parameters freed after
use?). PyTorch's FSDP2 has no stages at all, only a policy: ``reshard_after_forward`` and the
mesh say what is sharded and when. A stage is only a named preset of such a policy.

So :class:`ShardingPolicy` says, field by field, what each decision is, and the engine below
``initialize`` (units, flat groups, the unit protocol, buckets, the optimizer, the engine) reads
those fields and never the stage. ``ShardingPolicy.for_stage`` is the one place that maps a
DeepSpeed stage to them; ``engine.stage`` still reports the config's stage (checkpoints record
it, the integrations read it), but no code decides on it. The presets:

=========================  =======  =======  =======  =======
field                      stage 0  stage 1  stage 2  stage 3
=========================  =======  =======  =======  =======
shards_optimizer_state     no       yes      yes      yes
shards_gradients           no       no       yes      yes
shards_params              no       no       no       yes
reshard_after_forward      no       no       no       yes
reductions_in_flight       2        2        0 or 1   2
=========================  =======  =======  =======  =======

and the stage-3 knobs (persistence threshold, prefetch bucket, reuse distance) are 0, that is
off, below stage 3. Nothing here changes what any stage does: the policy is the same decisions
with names (tests/unit/test_policy.py pins the presets).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Gradient buckets whose reduction may be in flight at once ([Note: the shared schedule] in
# hooks.py): every preset but stage 2's.
BUCKETS_IN_FLIGHT = 2


@dataclass(frozen=True)
class ShardingPolicy:
    """What the engine shards, and when (see [Note: sharding policy])."""

    # Each rank owns one shard of the fp32 master and the optimizer state, receives its part of
    # the gradients by reduce-scatter, steps it, and all-gathers the updated parameters after
    # the step. Off (stage 0, DDP): every rank holds and steps everything, the gradients are
    # all-reduced in place in a full gradient buffer that lives for the whole run.
    shards_optimizer_state: bool
    # Every backward reduces the gradients into this rank's fp32 gradient shard and frees the
    # full gradients (stages 2-3). Off (stages 0-1): the full gradients accumulate over the
    # micro-steps (16-bit ones folded into an fp32 sum) and are reduced at the accumulation
    # boundary's backward only.
    shards_gradients: bool
    # Parameters are only a shard outside use: gathered around each unit's forward and backward
    # and freed after (stage 3), except groups at or below ``persistence_threshold``.
    shards_params: bool
    # The parameters a forward gathered are freed after it (unless the reuse distance keeps a
    # unit until its backward); with ``shards_params`` only.
    reshard_after_forward: bool
    # Gradient reductions that may be in flight while the backward goes on: 0 waits for each
    # before the backward continues (stage 2 without ``overlap_comm``).
    reductions_in_flight: int = BUCKETS_IN_FLIGHT
    # ``stage3_param_persistence_threshold``: parameters of at most this many elements (and
    # PEFT adapters) stay gathered. Only with ``shards_params``.
    persistence_threshold: int = 0
    # ``stage3_prefetch_bucket_size``: elements gathered ahead of the schedule. 0: no prefetch.
    prefetch_numel: int = 0
    # ``stage3_max_reuse_distance``: [Note: reuse distance] in gather_plan.py. 0: never kept.
    max_reuse_numel: int = 0
    # ``zero_quantized_weights`` (ZeRO++ qwZ): gathers send int8 blocks, [Note: quantized weight
    # gathers] in hf_zero.engine.sharding.gather_wire. Only with ``shards_params``.
    quantized_weight_gathers: bool = False

    def __post_init__(self) -> None:
        if self.shards_gradients and not self.shards_optimizer_state:
            raise ValueError("a ShardingPolicy that shards gradients shards the optimizer state too")
        if self.shards_params and not self.shards_gradients:
            raise ValueError("a ShardingPolicy that shards parameters shards gradients too")
        if self.reshard_after_forward and not self.shards_params:
            raise ValueError("reshard_after_forward needs shards_params: nothing else is gathered")
        if not self.shards_params and (self.persistence_threshold or self.prefetch_numel or self.max_reuse_numel):
            raise ValueError("persistence_threshold, prefetch_numel and max_reuse_numel need shards_params")
        if self.quantized_weight_gathers and not self.shards_params:
            raise ValueError("quantized_weight_gathers needs shards_params: only stage 3 gathers parameters")
        if self.reductions_in_flight < 0:
            raise ValueError("reductions_in_flight must be at least 0")

    @classmethod
    def for_stage(
        cls,
        stage: int,
        *,
        overlap_comm: bool = False,
        persistence_threshold: int = 0,
        prefetch_numel: int = 0,
        max_reuse_numel: int = 0,
        quantized_weight_gathers: bool = False,
    ) -> ShardingPolicy:
        """The preset a DeepSpeed ZeRO ``stage`` names. ``overlap_comm`` matters at stage 2 only
        (the other stages always keep ``BUCKETS_IN_FLIGHT`` reductions in flight); the stage-3
        knobs at stage 3 only, as in DeepSpeed."""
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage {stage!r}: expected 0, 1, 2 or 3")
        stage3 = stage == 3
        return cls(
            shards_optimizer_state=stage >= 1,
            shards_gradients=stage >= 2,
            shards_params=stage3,
            reshard_after_forward=stage3,
            reductions_in_flight=(1 if overlap_comm else 0) if stage == 2 else BUCKETS_IN_FLIGHT,
            persistence_threshold=int(persistence_threshold) if stage3 else 0,
            prefetch_numel=int(prefetch_numel) if stage3 else 0,
            max_reuse_numel=int(max_reuse_numel) if stage3 else 0,
            quantized_weight_gathers=bool(quantized_weight_gathers) and stage3,
        )

    @property
    def preset_stage(self) -> int | None:
        """The stage whose preset shards what this policy shards (the knobs aside), or None: for
        messages and reprs only, no code decides on it."""
        shards = self._what_is_sharded()
        return next((stage for stage in range(4) if ShardingPolicy.for_stage(stage)._what_is_sharded() == shards), None)

    def _what_is_sharded(self) -> tuple[bool, bool, bool, bool]:
        return (self.shards_optimizer_state, self.shards_gradients, self.shards_params, self.reshard_after_forward)

    @classmethod
    def from_config(cls, config: Any) -> ShardingPolicy:
        """The policy a resolved :class:`~hf_zero.config.HfZeroConfig` asks for (its stage's preset)."""
        zero = config.zero
        return cls.for_stage(
            config.stage,
            overlap_comm=bool(zero.overlap_comm),
            persistence_threshold=int(zero.stage3_param_persistence_threshold),
            prefetch_numel=int(zero.stage3_prefetch_bucket_size),
            max_reuse_numel=int(zero.stage3_max_reuse_distance),
            quantized_weight_gathers=bool(zero.zero_quantized_weights),
        )
