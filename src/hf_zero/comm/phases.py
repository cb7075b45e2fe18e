"""Ranks agree on what they are about to do before the first collective that depends on it.

[Note: phases in step]
Collectives pair by issue order only: if one rank starts a forward while another saves a
checkpoint, the first one's parameter all-gather meets the other's exchange of a few bytes, and
gloo aborts the process (SIGABRT, "size mismatch") where NCCL hangs or corrupts. At stage 3
every forward and backward issues collectives, so a rank that skipped a step, ran an extra
micro-step or called ``save_checkpoint`` alone got a native abort instead of an error.

So every *phase* that issues collectives starts with the same small exchange: each rank's
(phase, optimizer step, micro-step, payload), four int64s gathered over [Note: the host group]
(collectives.py). It has one size whatever the phase, so two ranks in different phases pair it
with each other, see the difference in the first three and raise on every rank, naming what
each rank was doing, before either issues a collective the other cannot match. The payload is
what a phase's caller wants every rank to know at no extra cost (the optimizer step: how many
parameters this rank left without a gradient, so the exchange of which ones happens only when
some rank has any). The phases that check in: a stage-3 forward (at the root unit, before its
gather), a stage-3 backward (at its first unit, before any gather or reduction), an optimizer
step (at the accumulation boundary, before the norm and the unscale), ``save_checkpoint`` and
``load_checkpoint`` (before their first exchange). Stages 0-2 run no collective in the
forward, and their backward reduces on the gradient group only, so a rank out of step there
meets a check-in of the other rank in a step or a save, or a timeout ([Note: collective
errors]); the check-in is skipped for them.

The cost is one exchange of 4 x world_size integers between the ranks' hosts per stage-3
forward, backward and optimizer step; it never waits for the compute device, so the GPU keeps
running what was queued while the hosts agree. At world size 1 nothing is exchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_zero.comm.collectives import Communicator

PHASES = ("forward", "backward", "optimizer step", "save_checkpoint", "load_checkpoint")
_DOING = {
    "forward": "starting a forward",
    "backward": "starting a backward",
    "optimizer step": "starting an optimizer step",
    "save_checkpoint": "in save_checkpoint",
    "load_checkpoint": "in load_checkpoint",
}


@dataclass(frozen=True)
class CheckIn:
    """What a phase's check-in learnt: how the ranks are out of step (None when in step), and
    every rank's payload, in rank order."""

    problem: str | None
    payloads: list[int]


def check_in(comm: Communicator, phase: str, global_steps: int, micro_steps: int, payload: int = 0) -> CheckIn:
    """Exchange every rank's (phase, step, micro-step, ``payload``) over the host group: see
    [Note: phases in step]."""
    if not comm.active:
        return CheckIn(None, [payload])
    everyone = comm.exchange_on_host((PHASES.index(phase), global_steps, micro_steps, payload), phase)
    payloads = [row[3] for row in everyone]
    if len({row[:3] for row in everyone}) == 1:
        return CheckIn(None, payloads)
    shown = "; ".join(f"rank {rank} at step {step} micro-step {micro}, {_DOING[PHASES[code]]}"
                      for rank, (code, step, micro, _) in enumerate(everyone))
    return CheckIn(
        f"the ranks are out of step ({shown}). Every rank must make the same forward, backward, "
        "step and save_checkpoint calls in the same order: an uneven last batch, a rank-dependent "
        "loop or a call made on one rank only (a save under `if rank == 0`) is the usual cause", payloads)


def out_of_step(comm: Communicator, phase: str, global_steps: int, micro_steps: int) -> str | None:
    """How the ranks are out of step as they start ``phase``, or None when every rank is in the
    same phase at the same step and micro-step (see [Note: phases in step])."""
    return check_in(comm, phase, global_steps, micro_steps).problem
