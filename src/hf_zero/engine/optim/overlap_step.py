"""The offloaded optimizer step, started per group while the backward is still running.

[Note: overlapped offload step]
With ``offload_optimizer`` (cpu or nvme) the Adam step runs on the host. Once a group's fp32
gradient shard is final (its bucket has been reduce-scattered at the accumulation boundary: see
``UnitProtocol.on_grads_final``), nothing that is still to come in this backward can change it, so
its step can start at once on a worker thread and overlap the backward of the units before it
(on a GPU machine the host is otherwise idle then). ``ZeroOptimizer.step`` then only waits for the
worker, steps the groups it never got, reports the global gradient norm and all-gathers. This is a
schedule of [Note: the step pipeline], not a second step: ``apply`` of one group at a time first
(``InnerStep.apply_group``), then the pipeline's ``measure``, ``commit`` or ``roll_back`` and
``publish``.

This is exact only when no group's update depends on the others' gradients:
- gradient clipping needs the global norm first, so ``gradient_clipping > 0`` steps after the
  backward, as without overlap;
- fp16 needs the overflow check over every gradient before any step (a skipped step must skip
  every group), so fp16 does too;
- a non-finite gradient may reach a group after others were stepped (a later unit, another
  rank), and a step must be all-or-nothing on every rank (see [Note: non-finite steps]). So
  before stepping a group the worker keeps an undo copy of what the step changes (the master and
  Adam's moments and step count, in memory; with NVMe, copies of the group's three files), and
  checks the group's gradient for inf/nan (a non-finite group is not stepped). ``step``
  all-reduces the flag; if any group on any rank was non-finite, every rank restores the groups
  it stepped from their copies (and rewrites their compute shards from the restored masters),
  then the step is skipped or raises like the non-overlapped one; otherwise the copies are
  dropped. The price is one more copy of the stepped groups' optimizer state for the length of
  a step (12 bytes per parameter of this rank's shards, host memory or NVMe).
Requires hf_zero's Adam/AdamW (the config's optimizer section), which steps one shard at a time.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from hf_zero.engine.sharding.flat_group import FlatParamGroup
from hf_zero.engine.optim.inner_step import NvmeInnerStep
from hf_zero.engine.optim.optimizer import ZeroAdam
from hf_zero.engine.optim.step_pipeline import StepOutcome, StepPipeline
from hf_zero.execution import bound_thread_initializer
from hf_zero.offload.threads import running_on
from hf_zero.transfer import host_snapshot

if TYPE_CHECKING:
    from hf_zero.offload import NvmeOptimizerStore


def can_overlap(inner: torch.optim.Optimizer, gradient_clipping: float, fp16: bool, nvme: bool) -> bool:
    """Whether [Note: overlapped offload step] applies to this optimizer set-up."""
    return (isinstance(inner, ZeroAdam) or nvme) and gradient_clipping <= 0 and not fp16


class OverlappedOffloadStep:
    """Runs each group's host step on one worker thread as soon as its gradients are final."""

    def __init__(self, pipeline: StepPipeline, device: torch.device) -> None:
        # The pipeline whose stages this schedules; ZeroOptimizer builds this step over it.
        if pipeline.loss_scaler is not None:  # can_overlap rules fp16 out: its skip needs every gradient first
            raise NotImplementedError("the overlapped offload step with fp16's loss scaling; see can_overlap")
        self.pipeline = pipeline
        self.inner_step = pipeline.inner_step
        # Groups kept on the device (offload_optimizer.ratio < 1) step on the worker too: it
        # launches on the rank's device ([Note: the launching thread's device]).
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_zero-offload-step",
                                       initializer=bound_thread_initializer(device))
        self.futures: dict[int, Future] = {}
        self.first_submit_s: float | None = None  # when this step's first group went to the worker
        self.last_first_submit_s: float | None = None  # the same, for the last completed step
        self.overlapped_groups = 0  # groups of the last step started before ``step`` was called
        self.undo: dict[int, tuple[FlatParamGroup, Any]] = {}  # id(group) -> (group, its state before the step)

    def submit(self, groups: list[FlatParamGroup]) -> None:
        """Start the step of ``groups`` (their gradient shards are final)."""
        if self.first_submit_s is None and groups:
            self.first_submit_s = time.perf_counter()
        for group in groups:
            if id(group) in self.futures:
                raise RuntimeError(
                    f"{group.label}: a second backward reached the accumulation boundary before "
                    "engine.step(); with offload_optimizer the step starts during the boundary's "
                    "backward, so call engine.step() after each boundary backward (or set "
                    "gradient_accumulation_steps to accumulate)")
            group.params_used = [True] * len(group.params)  # submitted only when this rank used all
            self.futures[id(group)] = self.pool.submit(self.step_group, group)

    def step_group(self, group: FlatParamGroup) -> tuple[float, bool]:
        """Check and step one group; returns its squared gradient norm and whether it had an
        inf/nan (then it is left unchanged)."""
        from hf_zero.kernels import nonfinite_and_sqnorm

        with running_on(self.pipeline.host_threads):  # on the worker too: [Note: host threads]
            group.grads.land_host_grads()  # the host waits for the copy here, on the worker, not in the backward
            found, sqnorm = nonfinite_and_sqnorm([group.grads.shard])
            if bool(found):
                return float(sqnorm), True
            self.undo[id(group)] = (group, self._snapshot(group))
            self.inner_step.apply_group(group)
        return float(sqnorm), False

    def finish(self, some_rank_left_unused: bool | None = None) -> None:
        """The step, at ``ZeroOptimizer.step``: wait for the worker, step what it did not get,
        then measure, and commit or roll back, as the plain step does."""
        pipeline = self.pipeline
        results = self.wait()
        # Groups this rank did not use in full were held back ([Note: parameters no rank used]):
        # step those some rank used, each parameter as the ranks used it.
        used = pipeline.used_over_ranks(some_rank_left_unused)
        for group, group_used in zip(pipeline.groups, used):
            if id(group) in results:  # stepped on the worker: this rank used every parameter
                continue
            group.params_used = group_used
            if group.grads.shard is not None and any(group_used):
                results[id(group)] = self.step_group(group)
        sqnorm = sum(sq for sq, _ in results.values())
        nonfinite = any(found for _, found in results.values())
        # The host steps these groups and has read their norms already; only two numbers move.
        local = torch.tensor([sqnorm, float(nonfinite)], dtype=torch.float32, device=pipeline.device)
        measured = pipeline.read_terms(pipeline.all_ranks_terms(local))
        if measured.nonfinite:  # some group on some rank: undo every group stepped, on every rank
            pipeline.roll_back(StepOutcome.ROLLED_BACK, undo=self)
            return
        pipeline.record(StepOutcome.STEPPED, math.sqrt(measured.sqnorm))
        pipeline.commit(undo=self)

    # ------------------------------------------------------------------ undo copies
    def _snapshot(self, group: FlatParamGroup) -> Any:
        """What the step of ``group`` will change, copied to host memory (also for a group kept
        on the device: the undo copies must not cost device memory)."""
        nvme = self._nvme
        if nvme is not None:
            return nvme.snapshot(group.master_state.nvme_index)
        pin = group.offload.pin_memory
        state = self.inner_step.inner.state.get(group.master_state.tensor) or {}
        saved = {k: host_snapshot(v.detach(), pin) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        return host_snapshot(group.master_state.tensor.detach(), pin), saved

    @property
    def _nvme(self) -> NvmeOptimizerStore | None:
        return self.inner_step.nvme if isinstance(self.inner_step, NvmeInnerStep) else None

    def restore(self) -> None:
        """Restore every group stepped in this step (see [Note: overlapped offload step])."""
        inner = self.inner_step.inner
        nvme = self._nvme
        for group, saved in self.undo.values():
            if nvme is not None:
                nvme.restore(group.master_state.nvme_index, saved, group.storage.write_shard)
                continue
            master, state = saved
            group.master_state.tensor.copy_(master)
            device_state = inner.state.get(group.master_state.tensor) or {}
            for key, value in state.items():  # back where the optimizer keeps each tensor
                where = device_state.get(key)
                if isinstance(value, torch.Tensor) and isinstance(where, torch.Tensor):
                    state[key] = value.to(where.device)
            if state:
                inner.state[group.master_state.tensor] = state
            else:
                inner.state.pop(group.master_state.tensor, None)
            if group.master_state.tensor.data_ptr() != group.storage.shard.data_ptr():
                group.storage.write_shard(group.master_state.tensor)
        self.drop()

    def drop(self) -> None:
        """The step stands: drop the undo copies."""
        nvme = self._nvme
        for group, saved in self.undo.values():
            if nvme is not None:
                nvme.drop_snapshot(saved)
        self.undo.clear()

    def wait(self) -> dict[int, tuple[float, bool]]:
        """Results of every submitted group (``id(group)`` keys); re-raises a worker's error."""
        self.overlapped_groups = len(self.futures)
        try:
            return {key: future.result() for key, future in self.futures.items()}
        finally:
            self.futures.clear()
            self.last_first_submit_s, self.first_submit_s = self.first_submit_s, None
