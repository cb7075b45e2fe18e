"""Which parameters of a flat shard a step updates, and the step count each one reaches.

[Note: parameters no rank used]
torch decides per parameter: a parameter whose gradient is None is skipped by the optimizer (its
value, its moments and its step count stay), and DDP(find_unused_parameters=True) leaves the
gradient None exactly when no rank used the parameter. A flat group holds several parameters, so
hf_zero keeps the same decision per parameter, not per group:

- Each group records which of its parameters got a gradient on this rank since the last step
  (``FlatParamGroup.grads.received``, set by the post-accumulate-grad hook: a parameter used in any
  micro-step of the accumulation counts as used). The step's check-in carries how many this rank
  left without a gradient ([Note: phases in step] in hf_zero.comm.phases); when some rank left
  any, the flags themselves are exchanged over the host group ([Note: the host group] in
  hf_zero.comm.collectives), a few bytes per parameter, so every rank learns which parameters
  *some* rank used (``params_used``) without the host reading anything from the device.
- A parameter no rank used has a zero gradient in the shard (the other ranks' zeros), so the norm
  and clipping are unchanged by it, as torch's norm skips None gradients.
- The step leaves its elements alone. A flat shard is cut into *segments*, one per parameter
  (from its offset to the next parameter's, so alignment gaps and the trailing padding belong to
  the parameter before them), and the update runs over *runs*: consecutive used segments whose
  parameters have the same step count. When every parameter is used and none ever skipped a step
  (the usual case) that is one run over the whole shard, the single fused call it always was.
- Step counts are per parameter (``slot_steps``: one count per parameter of the group, the same
  list on every rank), so Adam's bias correction for a parameter that skipped steps is the one
  torch gives it. Checkpoints save them and reshard them by parameter name.

Optimizers that step whole tensors (a torch optimizer rebuilt over the flat shards) cannot skip
part of a tensor: for them the elements of unused parameters, and their element-wise state, are
put back after the step; their step count is the shard's (see docs/how-it-works.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from hf_zero.partition import FlatLayout


@dataclass(frozen=True)
class Segment:
    """Shard-local elements [lo, hi) that belong to parameter ``slot`` of the group's layout."""

    slot: int
    lo: int
    hi: int


@dataclass(frozen=True)
class Run:
    """Shard-local elements [lo, hi) stepped together, their parameters reaching step ``step``."""

    lo: int
    hi: int
    step: int


def shard_segments(layout: FlatLayout, shard_range: tuple[int, int]) -> list[Segment]:
    """The segments that tile the shard ``shard_range`` of ``layout`` (see [Note: parameters no
    rank used]); elements before the first parameter, if any, are left out (padding only)."""
    lo, hi = shard_range
    starts = [slot.offset for slot in layout.slots] + [layout.padded_numel]
    segments = []
    for index in range(len(layout.slots)):
        start, stop = max(lo, starts[index]), min(hi, starts[index + 1])
        if start < stop:
            segments.append(Segment(index, start - lo, stop - lo))
    return segments


def advanced_steps(slot_steps: Sequence[int], used: Sequence[bool]) -> list[int]:
    """The step counts after a step in which the parameters ``used`` were stepped."""
    return [count + 1 if was_used else count for count, was_used in zip(slot_steps, used)]


def step_runs(segments: Sequence[Segment], used: Sequence[bool], slot_steps: Sequence[int]) -> list[Run]:
    """The runs of a step: used segments, merged while adjacent with equal step counts
    (``slot_steps``: the counts the step reaches)."""
    runs: list[Run] = []
    for segment in segments:
        if not used[segment.slot]:
            continue
        step = slot_steps[segment.slot]
        if runs and runs[-1].hi == segment.lo and runs[-1].step == step:
            runs[-1] = Run(runs[-1].lo, segment.hi, step)
        else:
            runs.append(Run(segment.lo, segment.hi, step))
    return runs


def unused_ranges(segments: Sequence[Segment], used: Sequence[bool]) -> list[tuple[int, int]]:
    """Shard-local element ranges of the parameters nobody used (what a whole-tensor optimizer's
    step must put back)."""
    return [(s.lo, s.hi) for s in segments if not used[s.slot]]
