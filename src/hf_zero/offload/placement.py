"""Which units' optimizer state is offloaded under ``offload_optimizer.ratio`` below 1.

[Note: partial optimizer offload]
DeepSpeed's Twin-Flow (``offload_optimizer: {"device": "cpu", "ratio": r}``) offloads about a
fraction r of the optimizer state and steps the rest on the compute device. hf_zero decides by
whole units (all trainable flat groups of a unit move together) and by element count: the units
are walked in model order (the order of ``partition.plan_units``: the input embedding, the repeated
blocks, then the root unit), and a unit is offloaded when that brings the offloaded element count closer to
r x (all trainable elements), i.e. when ``offloaded + numel / 2 <= r x total``. The rule is a
pure function of the model, so every rank chooses the same units; because a rank's shard of a
group is 1/N of it, each rank offloads the same fraction of its own state. Offloaded units
behave exactly as with ratio 1 (fp32 master, gradient shard and moments on the host, step on the
CPU); the others exactly as without offload.
"""

from __future__ import annotations


def units_to_offload(trainable_numels: list[int], ratio: float) -> list[bool]:
    """For each unit (its trainable element count, in model order): is its optimizer state
    offloaded? See [Note: partial optimizer offload]."""
    target = ratio * sum(trainable_numels)
    offloaded = 0
    chosen = []
    for numel in trainable_numels:
        take = numel > 0 and offloaded + numel / 2 <= target
        offloaded += numel if take else 0
        chosen.append(take)
    return chosen
