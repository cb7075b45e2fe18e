"""The optimizer step as one pipeline of named stages, each written once.

[Note: the step pipeline]
Every optimizer step goes through the same stages, whichever inner step it runs and whether or
not it overlaps the backward:

- ``measure``: this rank's squared gradient norm and inf/nan flag (:meth:`StepPipeline.local_norm_terms`),
  summed over ranks in one all-reduce on the compute device (:meth:`StepPipeline.all_ranks_terms`);
  which parameters some rank used comes from the host ([Note: parameters no rank used]:
  :meth:`StepPipeline.used_over_ranks`).
- ``apply``: the inner step, one kind chosen when the optimizer is built (hf_zero.engine.optim.inner_step:
  fused Adam, a torch optimizer, the whole-parameter step, NVMe). It leaves the stepped groups'
  compute shards holding the new values.
- ``commit`` (the step stands: undo copies dropped, ``publish``, the loss scale kept or grown,
  gradients zeroed) or ``roll_back`` (undo copies restored, gradients dropped, the loss scale
  lowered, or else [Note: non-finite steps]).
- ``publish``: every rank's updated shard gathered into the full buffers that are not
  resharded until their next use (``all_gather_updated``).

:meth:`StepPipeline.run` runs them in one of two orders. With hf_zero's fused Adam over shards
on the compute device, the host never reads what ``measure`` found: [Note: a step the host does
not wait for]. Otherwise (a torch optimizer, the whole-parameter step, optimizer state on the
host or in files) the host reads the norm and the flag first: it rolls back at once when some
gradient is not finite (nothing was applied, so nothing is undone), else applies with the loss
scale and the clip coefficient, and commits. The [Note: overlapped offload step]
(hf_zero.engine.optim.overlap_step) is another schedule of the same stages: ``apply`` per group on
a worker while the backward runs, then ``measure``, and ``commit`` or ``roll_back`` with its undo
copies. Each step records its :class:`StepOutcome` and the global gradient norm.

[Note: a step the host does not wait for]
Reading the global norm or the inf/nan flag on the host makes it wait for the GPU to finish the
whole backward and the norm's all-reduce: the GPU then idles while the host computes the clip
coefficient and launches the step, and the next forward starts from an empty queue. FSDP2 keeps
its clip coefficient on the device for this reason. With the fused Adam on device shards, the
step is taken without that read:

- the all-reduced [squared norm, flag] stays on the device, and so do the loss scale, the clip
  coefficient and the skip flag computed from it, in the float64 arithmetic the host used
  (``step_factors``), handed to the kernel as [Note: step factors]: a step with an inf/nan
  gradient on any rank changes no master, moment or compute shard there;
- what the host keeps (each parameter's step count, the scheduler, the fp16 scaler's record,
  the outcome and the norm it reports) is advanced as if the step stood, and the two numbers are
  copied to a host buffer behind the step (copy-out stream, pinned memory);
- the host reads them when it needs them: at the next optimizer step, before it applies anything
  (by then the GPU has long finished the copy: no wait in a steady state), or when asked
  (``get_global_grad_norm``, ``was_step_applied``, ``skipped_steps``, ``loss_scale``, a
  checkpoint or a state dict), which is a wait for the GPU, counted as one ([Note: host
  synchronisations] in hf_zero.execution.host_sync);
- a step that turns out to have been skipped then has its host records put back (step counts,
  the scheduler through the engine's undo, the fp16 scaler replayed with the overflow), is
  counted and logged like a skipped step; under the raise policy ([Note: non-finite steps]) its
  FloatingPointError is raised by the engine step that read it, after that step was taken.
  Either way no parameter, master or moment ever changed, on any rank.
"""

from __future__ import annotations

import enum
import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

import torch

from hf_zero.comm import Communicator
from hf_zero.engine.schedule.buckets import all_gather_updated
from hf_zero.engine.sharding.flat_group import FlatParamGroup
from hf_zero.engine.optim.inner_step import InnerStep
from hf_zero.engine.policy import ShardingPolicy
from hf_zero.execution import Completion, execution_for
from hf_zero.execution.host_sync import waited_for_device
from hf_zero.transfer import is_host_store, mark_host, to_compute

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
    """What ``measure`` learns over all ranks, read on the host."""

    sqnorm: float  # squared norm of the (loss-scaled) gradients of every shard of every rank
    nonfinite: bool  # some gradient element on some rank is inf or nan


class UndoCopies(Protocol):
    """What an ``apply`` that ran before ``measure`` kept of the state it changed."""

    def restore(self) -> None:
        """Put back every group stepped, then drop the copies."""

    def drop(self) -> None:
        """The step stands: drop the copies."""


@dataclass
class PendingOutcome:
    """A step taken on the device whose [squared norm, flag] the host has not read yet: [Note: a
    step the host does not wait for]."""

    terms: torch.Tensor  # host buffer the two numbers land in
    copied: Completion
    scale: float  # the loss scale the step's gradients carried
    undo: list[Callable[[], None]] = field(default_factory=list)  # run if the step was skipped


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
        self._nonfinite_skipped_steps = 0
        self._outcome: StepOutcome | None = None  # None before the first step
        self._grad_norm: float | None = None
        self.pending: PendingOutcome | None = None
        # A FloatingPointError for a step read after it was taken on the device, raised by the
        # engine step that read it (see [Note: a step the host does not wait for]).
        self.deferred_error: FloatingPointError | None = None
        self._all_used = [[True] * len(g.params) for g in groups]
        self._terms_on_host: torch.Tensor | None = None  # where a pending step's two numbers land
        self._norm_on_device: torch.Tensor | None = None  # the pending step's norm, unread
        # [Note: host threads] in hf_zero.offload.threads: what a step with optimizer state on the
        # host runs on (0: torch's own count, nothing is on the host).
        self.host_threads = max((g.offload.host_threads for g in groups if g.offload.optimizer_on_host), default=0)

    @property
    def device(self) -> torch.device:
        """The compute device: where collectives take their tensors."""
        return self.groups[0].storage.full.device if self.groups else torch.device("cpu")

    # ------------------------------------------------------------------ what the last step did
    @property
    def outcome(self) -> StepOutcome | None:
        self.settle()
        return self._outcome

    @property
    def grad_norm(self) -> float | None:
        self.settle()
        return self._grad_norm

    @property
    def nonfinite_skipped_steps(self) -> int:
        self.settle()
        return self._nonfinite_skipped_steps

    def grad_norm_tensor(self) -> torch.Tensor | None:
        """The last step's gradient norm as a 0-d tensor, without reading it: on the compute
        device while the step's outcome is pending (inf or nan for a step that had inf/nan
        gradients, as torch's ``clip_grad_norm_`` returns), else made from the value read."""
        if self.pending is not None and self._norm_on_device is not None:
            return self._norm_on_device
        return None if self._grad_norm is None else torch.tensor(self._grad_norm)

    def record(self, outcome: StepOutcome, grad_norm: float) -> None:
        self._outcome = outcome
        self._grad_norm = grad_norm

    # ------------------------------------------------------------------ the step
    def run(self, some_rank_left_unused: bool | None = None) -> None:
        """One step. ``some_rank_left_unused``: whether some rank has a parameter without a
        gradient (the engine learns it from the step's check-in); None: not known, ask."""
        self.settle(at_next_step=True)
        for group in self.groups:
            group.grads.land_host_grads()  # [Note: gradients copied to the host]
        used = self.used_over_ranks(some_rank_left_unused)
        terms = self.all_ranks_terms(self.local_norm_terms())
        if self.inner_step.skips_on_device:
            self._run_on_device(terms, used)
        else:
            self._run_on_host(terms, used)

    def _run_on_host(self, terms: torch.Tensor, used: list[list[bool]]) -> None:
        """The host reads the norm and the flag first (see [Note: the step pipeline])."""
        measured = self.read_terms(terms)
        if measured.nonfinite:
            self.roll_back(StepOutcome.SKIPPED_NONFINITE)
            return
        scale = self.loss_scaler.loss_scale if self.loss_scaler is not None else 1.0
        norm = math.sqrt(measured.sqnorm) / scale
        self.record(StepOutcome.STEPPED, norm)
        clip_coef = 1.0
        if self.gradient_clipping > 0:
            clip_coef = min(1.0, self.gradient_clipping / (norm + CLIP_EPS))
        self.inner_step.apply(self.groups, used, scale, clip_coef)
        self.commit()

    def _run_on_device(self, terms: torch.Tensor, used: list[list[bool]]) -> None:
        """[Note: a step the host does not wait for]."""
        scaler = self.loss_scaler
        scale = scaler.device_scale(terms.device) if scaler is not None else None
        factors, overflow, self._norm_on_device = step_factors(terms, scale, self.gradient_clipping)
        undo = self.inner_step.apply_on_device(self.groups, used, factors)
        self.pending = PendingOutcome(*self._copy_terms_to_host(terms),
                                      scale=scaler.loss_scale if scaler is not None else 1.0, undo=[undo])
        self._outcome, self._grad_norm = StepOutcome.STEPPED, None
        self.publish()
        if scaler is not None:
            scaler.update_on_device(overflow, terms.device)
        self.zero_grad()

    def _copy_terms_to_host(self, terms: torch.Tensor) -> tuple[torch.Tensor, Completion]:
        if self._terms_on_host is None:
            pin = terms.device.type == "cuda"
            self._terms_on_host = mark_host(torch.empty(2, dtype=torch.float32, pin_memory=pin))
        copied = execution_for(terms.device).copy_out(self._terms_on_host, terms, "the step's norm to the host")
        return self._terms_on_host, copied

    def on_skipped(self, undo: Callable[[], None]) -> None:
        """Run ``undo`` if the pending step turns out to have been skipped (the engine's
        scheduler step); nothing pending: nothing to do."""
        if self.pending is not None:
            self.pending.undo.append(undo)

    def settle(self, at_next_step: bool = False) -> None:
        """Read the pending step's outcome on the host and put its records right ([Note: a step
        the host does not wait for]). ``at_next_step``: called by the next step, when the GPU
        has finished the copy long ago; otherwise the host waits for it now (counted)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        if not at_next_step:
            waited_for_device("the last step's norm and inf/nan flag")
        pending.copied.wait_on_host()
        sqnorm, flag = pending.terms.tolist()
        if flag <= 0:
            self.record(StepOutcome.STEPPED, math.sqrt(sqnorm) / pending.scale)
            if self.loss_scaler is not None:
                self.loss_scaler.update_scale(False)
            return
        for undo in reversed(pending.undo):
            undo()
        self.record(StepOutcome.SKIPPED_NONFINITE, math.inf)
        if self.loss_scaler is not None:
            self.loss_scaler.update_scale(True)
            return
        try:
            self._nonfinite_step()
        except FloatingPointError as exc:
            self.deferred_error = FloatingPointError(
                f"{exc} This was an earlier step: the host reads a step's outcome once the GPU has "
                "finished it, without waiting, so the steps taken since were taken normally.")

    def raise_deferred(self) -> None:
        """Raise the FloatingPointError of a step read after it was taken, once."""
        error, self.deferred_error = self.deferred_error, None
        if error is not None:
            raise error

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

    def all_ranks_terms(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's [squared norm, non-finite flag] summed over ranks, on the compute device."""
        if not self.policy.shards_optimizer_state and self.comm.rank != 0:
            local.zero_()  # all-reduced gradients are identical on every rank: count them once
        elif self.comm.replica_index != 0:
            # Every shard group holds the same reduced shards ([Note: hybrid sharding]): the norm
            # is the first group's.
            local.zero_()
        return self.comm.all_reduce_(local, label="grad_norm", over_all_ranks=True)

    @staticmethod
    def read_terms(terms: torch.Tensor) -> NormMeasure:
        """The all-reduced terms, read on the host: a wait for the device (see [Note: the step
        pipeline] for the steps that do it)."""
        sqnorm, flag = terms.tolist()
        return NormMeasure(sqnorm, flag > 0)

    def used_over_ranks(self, some_rank_left_unused: bool | None) -> list[list[bool]]:
        """Per group, per parameter: whether some rank gave it a gradient since the last step
        ([Note: parameters no rank used] in hf_zero.engine.sharding.param_usage; torch's norm
        skips a None gradient, and an unused parameter's gradient here is zeros, so the norm is
        the same). Exchanged over the host group ([Note: the host group] in hf_zero.comm), and
        only when some rank has one without (``some_rank_left_unused``: None when not known)."""
        if some_rank_left_unused is False:
            return self._all_used
        flags = [received for g in self.groups for received in g.grads.received]
        used_flat = self.comm.any_on_host(flags, "params used")
        used, start = [], 0
        for group in self.groups:
            used.append(used_flat[start:start + len(group.params)])
            start += len(group.params)
        return used

    def unused_here(self) -> int:
        """How many parameters got no gradient on this rank since the last step."""
        return sum(g.grads.unreceived for g in self.groups)

    # ------------------------------------------------------------------ commit / roll back
    def commit(self, undo: UndoCopies | None = None) -> None:
        """The step stands on every rank."""
        if undo is not None:
            undo.drop()
        self.publish()
        if self.loss_scaler is not None:
            self.loss_scaler.update_scale(False)
            self.loss_scaler.rebuild_device_state()
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
            self.loss_scaler.rebuild_device_state()
            return
        self._nonfinite_step()

    def publish(self) -> None:
        """The updated shards to every rank ([Note: buckets]); stage-3 groups gather at their
        next use instead."""
        all_gather_updated(self.groups, self.comm, self.allgather_bucket_numel)

    def zero_grad(self) -> None:
        for group in self.groups:
            group.grads.zero_shard(zero_tensor=False)
        shards = [g.grads.shard for g in self.groups if g.grads.shard is not None]
        if shards:
            torch._foreach_zero_(shards)  # one launch for every group

    def _nonfinite_step(self) -> None:
        """A step whose gradients hold inf/nan on some rank, in fp32/bf16 (no loss scaler).

        [Note: non-finite steps]
        By the time this runs the step's gradients are dropped and nothing else changed on any
        rank: parameters, masters, moments and step counts are as before the step (the
        overlapped offload step restored the groups it had stepped: see [Note: overlapped
        offload step]; a step taken on the device changed nothing there: [Note: a step the host
        does not wait for]), and the engine does not step the scheduler (or puts its step back).
        Every rank reaches this together (the non-finite flag is all-reduced). Then, as
        configured: skip the step and count it (``bf16.check_grad_overflow``, DeepSpeed's key),
        or raise FloatingPointError. Either way the next step trains normally, without a
        ``zero_grad()``."""
        if self.skip_nonfinite:
            self._nonfinite_skipped_steps += 1
            logger.warning("hf_zero: step skipped: non-finite gradients (inf or nan); %d skipped so far",
                           self._nonfinite_skipped_steps)
            return
        raise FloatingPointError(_nonfinite_message(self.gradient_clipping))


def step_factors(terms: torch.Tensor, scale: torch.Tensor | None,
                 gradient_clipping: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[Note: step factors] from the all-reduced [squared norm, flag], on the device: the fp32
    ``[grad_scale, clip_coef, skip]``, the 0-d overflow flag and the unscaled norm (fp32). The
    norm and the coefficient are computed in float64, as the host computes them from the same
    fp32 sum, so both paths give the kernel the same fp32 coefficient."""
    sqnorm, flag = terms[0].double(), terms[1]
    overflow = flag > 0
    scale = scale if scale is not None else torch.ones((), dtype=torch.float64, device=terms.device)
    norm = sqnorm.sqrt() / scale
    if gradient_clipping > 0:
        clip_coef = torch.clamp(gradient_clipping / (norm + CLIP_EPS), max=1.0)
    else:
        clip_coef = torch.ones((), dtype=torch.float64, device=terms.device)
    factors = torch.stack([scale, clip_coef, overflow.double()]).float()
    return factors, overflow, norm.float()


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
