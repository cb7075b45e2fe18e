"""The optimizer step as one pipeline of named stages, each written once.

[Note: the step pipeline]
Every optimizer step goes through the same stages, whichever inner step it runs and whether or
not it overlaps the backward:

- ``measure``: this rank's squared gradient norm and inf/nan flag (:meth:`StepPipeline.local_norm_terms`),
  summed over ranks together with which parameters some rank used (:meth:`StepPipeline.all_ranks_norm`):
  one all-reduce.
- ``apply``: the inner step, one kind chosen when the optimizer is built (hf_zero.engine.optim.inner_step:
  fused Adam, a torch optimizer, the whole-parameter step, NVMe). It leaves the stepped groups'
  compute shards holding the new values.
- ``commit`` (the step stands: undo copies dropped, ``publish``, the loss scale kept or grown,
  gradients zeroed) or ``roll_back`` (undo copies restored, gradients dropped, the loss scale
  lowered, or else [Note: non-finite steps]).
- ``publish``: every rank's updated shard gathered into the full buffers that are not
  resharded until their next use (``all_gather_updated``).

:meth:`StepPipeline.run` is the plain order: measure, then roll back at once when some gradient
is not finite (nothing was applied, so nothing is undone), else apply with the loss scale and the
clip coefficient, and commit. The [Note: overlapped offload step] (hf_zero.engine.optim.overlap_step) is
another schedule of the same stages: ``apply`` per group on a worker while the backward runs,
then ``measure``, and ``commit`` or ``roll_back`` with its undo copies. Each step records its
:class:`StepOutcome` and the global gradient norm.
"""

from __future__ import annotations

import enum
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from hf_zero.comm import Communicator
from hf_zero.engine.schedule.buckets import all_gather_updated
from hf_zero.engine.sharding.flat_group import FlatParamGroup
from hf_zero.engine.optim.inner_step import InnerStep
from hf_zero.engine.policy import ShardingPolicy
from hf_zero.transfer import assert_not_host, is_host_store, mark_host, to_compute

if TYPE_CHECKING:
    from hf_zero.engine.optim.loss_scaler import LossScaler

logger = logging.getLogger("hf_zero")

# torch.nn.utils.clip_grad_norm_ uses the same epsilon; matching it keeps parity exact.
CLIP_EPS = 1e-6


class StepOutcome(enum.Enum):
    """How the last step ended."""

    STEPPED = "stepped"
    SKIPPED_NONFINITE = "skipped-nonfinite"  # inf/nan (or fp16 overflow) seen before anything was applied
    ROLLED_BACK = "rolled-back"  # inf/nan seen after apply ran (the overlapped step): what it stepped was restored


@dataclass(frozen=True)
class NormMeasure:
    """What ``measure`` learns over all ranks."""

    sqnorm: float  # squared norm of the (loss-scaled) gradients of every shard of every rank
    nonfinite: bool  # some gradient element on some rank is inf or nan
    used: list[list[bool]]  # per group, per parameter: some rank used it in this step


class UndoCopies(Protocol):
    """What an ``apply`` that ran before ``measure`` kept of the state it changed."""

    def restore(self) -> None:
        """Put back every group stepped, then drop the copies."""

    def drop(self) -> None:
        """The step stands: drop the copies."""


class StepPipeline:
    """The stages of [Note: the step pipeline] over this rank's trainable groups."""

    def __init__(self, groups: list[FlatParamGroup], comm: Communicator, policy: ShardingPolicy,
                 inner_step: InnerStep, *, gradient_clipping: float, allgather_bucket_numel: int,
                 loss_scaler: LossScaler | None, skip_nonfinite: bool) -> None:
        self.groups = groups
        self.comm = comm
        self.policy = policy  # [Note: sharding policy]
        self.inner_step = inner_step
        self.gradient_clipping = gradient_clipping  # read at each step: an integration may change it
        self.allgather_bucket_numel = allgather_bucket_numel  # see [Note: buckets]
        self.loss_scaler = loss_scaler
        self.skip_nonfinite = skip_nonfinite  # [Note: non-finite steps]: skip (bf16.check_grad_overflow) or raise
        self.nonfinite_skipped_steps = 0
        self.outcome: StepOutcome | None = None  # None before the first step
        self.grad_norm: float | None = None

    @property
    def device(self) -> torch.device:
        """The compute device: where collectives take their tensors."""
        return self.groups[0].storage.full.device if self.groups else torch.device("cpu")

    def run(self) -> None:
        """The plain step: measure, then roll back or apply and commit."""
        for group in self.groups:
            group.grads.land_host_grads()  # [Note: gradients copied to the host]
        scale = self.loss_scaler.loss_scale if self.loss_scaler is not None else 1.0
        measured = self.all_ranks_norm(self.local_norm_terms())
        if measured.nonfinite:
            self.roll_back(StepOutcome.SKIPPED_NONFINITE)
            return
        norm = math.sqrt(measured.sqnorm) / scale
        self.record(StepOutcome.STEPPED, norm)
        clip_coef = 1.0
        if self.gradient_clipping > 0:
            clip_coef = min(1.0, self.gradient_clipping / (norm + CLIP_EPS))
        self.inner_step.apply(self.groups, measured.used, scale, clip_coef)
        self.commit()

    def record(self, outcome: StepOutcome, grad_norm: float) -> None:
        self.outcome = outcome
        self.grad_norm = grad_norm

    # ------------------------------------------------------------------ measure
    def local_norm_terms(self) -> torch.Tensor:
        """[squared norm, non-finite flag] of this rank's gradient shards, on the compute device.
        Shards on the host (offload_optimizer) are summed on the host and only the two numbers
        move (see [Note: host-device transfers])."""
        from hf_zero.kernels import nonfinite_and_sqnorm

        terms = torch.zeros(2, dtype=torch.float32, device=self.device)
        shards = [g.grads.shard for g in self.groups if g.grads.shard is not None]
        for host in (False, True):
            group_shards = [s for s in shards if is_host_store(s) == host]
            if group_shards:
                found, sqnorm = nonfinite_and_sqnorm(group_shards)
                part = torch.stack([sqnorm.float(), found.float()])
                terms += to_compute(mark_host(part), self.device) if host else part
        return terms

    def all_ranks_norm(self, local: torch.Tensor) -> NormMeasure:
        """This rank's [squared norm, non-finite flag] summed over ranks, and, per group, which
        parameters got a gradient on some rank: one all-reduce for all three ([Note: parameters
        no rank used] in hf_zero.engine.sharding.param_usage; torch's norm skips a None gradient, and an
        unused parameter's gradient here is zeros, so the norm is the same)."""
        assert_not_host(local, "the grad-norm all-reduce")  # packed below: the check must see it here
        flags = [float(received) for g in self.groups for received in g.grads.received]
        packed = torch.cat([local, torch.tensor(flags, dtype=torch.float32, device=self.device)])
        if not self.policy.shards_optimizer_state and self.comm.rank != 0:
            packed[:2] = 0  # all-reduced gradients are identical on every rank: count them once
        elif self.comm.replica_index != 0:
            # Every shard group holds the same reduced shards ([Note: hybrid sharding]): the norm
            # is the first group's; the flags go over every rank, since a parameter that only
            # another shard group's ranks used has a gradient here too and must step everywhere.
            packed[:2] = 0
        self.comm.all_reduce_(packed, label="grad_norm", over_all_ranks=True)
        used_flat = (packed[2:] > 0).tolist()
        used, start = [], 0
        for group in self.groups:
            used.append(used_flat[start:start + len(group.params)])
            start += len(group.params)
        return NormMeasure(float(packed[0]), bool(packed[1] > 0), used)

    # ------------------------------------------------------------------ commit / roll back
    def commit(self, undo: UndoCopies | None = None) -> None:
        """The step stands on every rank."""
        if undo is not None:
            undo.drop()
        self.publish()
        if self.loss_scaler is not None:
            self.loss_scaler.update_scale(False)
        self.zero_grad()

    def roll_back(self, outcome: StepOutcome, undo: UndoCopies | None = None) -> None:
        """Some gradient on some rank is inf/nan: the step is dropped on every rank, whatever
        ``apply`` had already done restored from ``undo``."""
        self.record(outcome, math.inf)
        if undo is not None:
            undo.restore()
        self.zero_grad()
        if self.loss_scaler is not None:
            self.loss_scaler.update_scale(True)
            return
        self._nonfinite_step()

    def publish(self) -> None:
        """The updated shards to every rank ([Note: buckets]); stage-3 groups gather at their
        next use instead."""
        all_gather_updated(self.groups, self.comm, self.allgather_bucket_numel)

    def zero_grad(self) -> None:
        for group in self.groups:
            group.grads.zero_shard()

    def _nonfinite_step(self) -> None:
        """A step whose gradients hold inf/nan on some rank, in fp32/bf16 (no loss scaler).

        [Note: non-finite steps]
        By the time this runs the step's gradients are dropped and nothing else changed on any
        rank: parameters, masters, moments and step counts are as before the step (the
        overlapped offload step restored the groups it had stepped: see [Note: overlapped
        offload step]), and the engine does not step the scheduler. Every rank reaches this
        together (the non-finite flag is all-reduced). Then, as configured: skip the step and
        count it (``bf16.check_grad_overflow``, DeepSpeed's key), or raise FloatingPointError.
        Either way the next step trains normally, without a ``zero_grad()``."""
        if self.skip_nonfinite:
            self.nonfinite_skipped_steps += 1
            logger.warning("hf_zero: step skipped: non-finite gradients (inf or nan); %d skipped so far",
                           self.nonfinite_skipped_steps)
            return
        raise FloatingPointError(_nonfinite_message(self.gradient_clipping))


def _nonfinite_message(gradient_clipping: float) -> str:
    clipping = (f"gradient_clipping ({gradient_clipping:g}) cannot help: it scales finite gradients, and an "
                "inf/nan norm has no finite scale" if gradient_clipping > 0
                else "gradient_clipping cannot fix inf/nan either")
    return (
        "non-finite gradients (inf or nan) on some rank; the step was dropped: parameters, optimizer state "
        "and scheduler are unchanged on every rank, and the next step trains normally (catch this error "
        "to go on, or set bf16.check_grad_overflow: true to skip such steps under bf16). "
        f"Look for an inf/nan loss, bad data or too high a learning rate; {clipping}"
    )
