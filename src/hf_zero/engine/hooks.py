"""The forward/backward protocol: when each unit is gathered, freed and reduced.

[Note: the unit protocol]
- pre_forward (module forward pre-hook): stage 3 gathers the unit, then prefetches the next units
  of the recorded forward order, up to ``stage3_prefetch_bucket_size`` elements.
- post_forward (module forward hook): stage 3 frees the unit, unless autograd is running (then
  this forward is an activation-checkpointing recompute inside the unit's backward, which is
  about to need the parameters) or the unit is reused soon (see [Note: reuse distance]). Hooks
  go on the unit's output tensors so that the first gradient reaching them announces the unit's
  backward.
- pre_backward (first output-gradient hook of the unit in this backward): stage 3 gathers the
  unit again (a no-op when it was kept) and prefetches the unit that runs backward next; every
  stage binds ``.grad`` views.
- post_backward (when the last trainable parameter's gradient has been accumulated): stage 3
  frees the parameters; stages 2-3 put the unit's groups in the open gradient bucket, and a full
  bucket is reduce-scattered into the fp32 shards (hf_zero.engine.buckets, [Note: buckets]).
  With ``overlap_comm`` that reduce-scatter is asynchronous and overlaps the backward of the
  units before it; at most one bucket is in flight: the next flush (or finish_backward)
  finishes it first, so memory stays bounded by two buckets.
- finish_backward (queued on the autograd engine at the first pre_backward, so it runs once
  the whole backward is done): reduces what the hooks did not (the last partial bucket, unused
  parameters, frozen units, stages 0-1 at the accumulation boundary) in the fixed unit order so
  every rank issues the same collectives, frees what is still gathered, and records the forward
  order for prefetching.
- At the accumulation boundary, each group whose fp32 gradient shard is final is announced to
  ``on_grads_final`` (the offloaded optimizer starts its CPU step there, overlapping the
  backward still running).
- With ``wall_clock_breakdown``, each gather (with its wait and the prefetches it starts) runs
  under the ``gather`` timer and each reduction under ``reduce`` (hf_zero.engine.timers).

[Note: releasing a unit in backward]
A stage-3 unit's parameters can go once its backward no longer reads them. The last trainable
gradient says so for the trainable ones, but frozen parameters have no gradient to wait for and
may still be read after it: a frozen RMSNorm at a decoder layer's input computes the input's
gradient last, after every weight gradient of the layer has arrived (LoRA's frozen base weights
likewise). So a unit with frozen gathered parameters also waits for the gradients of its forward
inputs (``register_multi_grad_hook`` on the inputs that require grad, as FSDP2 does): once they
are computed, nothing in the unit runs again in this backward. Without such inputs (the first
unit, or inputs that need no gradient) the frozen parameters are only read on the way to a
trainable gradient, so the last trainable gradient is enough. Whatever is left is freed at the
end of the backward.

[Note: reuse distance]
DeepSpeed's ``stage3_max_reuse_distance``: a unit is kept gathered after its forward when its
next use, its own backward, comes within that many gathered elements. On the recorded order, the
elements gathered between a unit's forward and its backward are twice those of the units after
it (each runs forward, then backward, before this one's backward). Kept units skip the re-gather,
so stage 3 moves 2Ψ instead of 3Ψ per step, at the cost of holding those parameters; a unit is
only kept while the gathered elements stay within ``stage3_max_live_parameters``. Nothing is kept
before the order is recorded (the first step), without autograd (evaluation), or with a distance
of 0. Whatever is still gathered is freed at the end of backward, and before every optimizer
step (an update makes a gathered copy stale).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
from torch.utils.hooks import RemovableHandle

from hf_zero.comm import Communicator
from hf_zero.engine.buckets import GradBucket, PendingBucket, finish_bucket, start_bucket
from hf_zero.engine.flat_group import FlatParamGroup
from hf_zero.engine.timers import PhaseTimers
from hf_zero.engine.unit import ZeroUnit


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors inside a module output (tensors, tuples, lists, dicts, HF ModelOutputs)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


class UnitProtocol:
    """Installs and runs [Note: the unit protocol] over a model's units (root unit last)."""

    def __init__(
        self,
        units: list[ZeroUnit],
        stage: int,
        comm: Communicator,
        reduce_dtype: torch.dtype,
        prefetch_numel: int,
        max_live_numel: int,
        is_boundary: Callable[[], bool],
        overlap_comm: bool = False,
        timers: PhaseTimers | None = None,
        reduce_bucket_numel: int = 0,
        max_reuse_numel: int = 0,
    ) -> None:
        self.units = units
        self.stage = stage
        self.comm = comm
        self.reduce_dtype = reduce_dtype
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self.max_reuse_numel = max_reuse_numel
        self.overlap_comm = overlap_comm
        self.timers = timers  # wall_clock_breakdown; None when off
        self.bucket = GradBucket(reduce_bucket_numel)
        self.in_flight: PendingBucket | None = None
        self.is_boundary = is_boundary
        # Called with groups whose fp32 gradient shard is final at the accumulation boundary.
        self.on_grads_final: Callable[[list[FlatParamGroup]], None] | None = None
        self.handles: list[RemovableHandle] = []
        self.finish_queued = False
        self.forward_order: list[ZeroUnit] = []  # recorded on the previous forward
        self.position: dict[int, int] = {}
        self.numel_after: dict[int, int] = {}  # unit index -> sharded elements after it in order
        self.current_order: list[ZeroUnit] = []
        for unit in units:
            unit.reset_backward_state()

    # ------------------------------------------------------------------ install
    def install(self) -> None:
        for unit in self.units:
            self.handles.append(unit.module.register_forward_pre_hook(self._hook_pre_forward(unit), with_kwargs=True))
            self.handles.append(unit.module.register_forward_hook(self._hook_post_forward(unit)))
            if self.stage >= 2:
                for param in unit.trainable_params:
                    self.handles.append(
                        param.register_post_accumulate_grad_hook(self._hook_post_accumulate(unit))
                    )

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _hook_pre_forward(self, unit: ZeroUnit) -> Callable:
        def hook(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
            self.pre_forward(unit)
            if self.stage == 3 and unit.has_frozen_sharded and torch.is_grad_enabled():
                self._hook_inputs(unit, (args, kwargs))

        return hook

    def _hook_inputs(self, unit: ZeroUnit, inputs: Any) -> None:
        """See [Note: releasing a unit in backward]."""
        tensors = [t for t in _tensors(inputs) if t.requires_grad]
        if not tensors:
            return
        unit.input_signal = True

        def inputs_done(grads: Any) -> None:
            unit.inputs_done = True
            self._maybe_release(unit)

        torch.autograd.graph.register_multi_grad_hook(tensors, inputs_done, mode="all")

    def _hook_post_forward(self, unit: ZeroUnit) -> Callable:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            self.post_forward(unit, output)

        return hook

    def _hook_post_accumulate(self, unit: ZeroUnit) -> Callable:
        def hook(param: torch.Tensor) -> None:
            unit.pending_grads -= 1
            if unit.pending_grads == 0:
                self.post_backward(unit)

        return hook

    # ------------------------------------------------------------------ forward
    def pre_forward(self, unit: ZeroUnit) -> None:
        if self.stage != 3:
            return
        if _in_backward():  # an activation-checkpointing recompute: gather, no prefetch
            self._timed("gather", self._gather, unit, 0)
            return
        if unit is self.units[-1]:  # the root: a new forward starts
            self.current_order = []
        if unit.sharded_numel:
            self.current_order.append(unit)
        self._timed("gather", self._gather, unit, 1)

    def _gather(self, unit: ZeroUnit, prefetch_step: int) -> None:
        """Gather ``unit`` and wait for it, then prefetch in the direction ``prefetch_step``
        (1: forward order, -1: backward, 0: none)."""
        unit.unshard()
        unit.wait_unshard()
        if prefetch_step:
            self._prefetch(unit, step=prefetch_step)

    def _timed(self, phase: str, fn: Callable, *args: Any) -> None:
        """``fn(*args)``, timed as ``phase`` when wall_clock_breakdown is on."""
        if self.timers is None:
            fn(*args)
            return
        self.timers.start(phase)
        try:
            fn(*args)
        finally:
            self.timers.stop(phase)

    def post_forward(self, unit: ZeroUnit, output: Any) -> None:
        if self.stage == 3 and not _in_backward() and not self._keep_for_backward(unit):
            unit.reshard()
        if not torch.is_grad_enabled():
            return
        for tensor in _tensors(output):
            if tensor.requires_grad:
                tensor.register_hook(self._hook_pre_backward(unit))

    # ------------------------------------------------------------------ backward
    def _hook_pre_backward(self, unit: ZeroUnit) -> Callable:
        def hook(grad: torch.Tensor) -> None:
            self.pre_backward(unit)

        return hook

    def pre_backward(self, unit: ZeroUnit) -> None:
        if unit.backward_started:
            return
        unit.backward_started = True
        if not self.finish_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)
            self.finish_queued = True
        if self.stage == 3:
            self._timed("gather", self._gather, unit, -1)
        unit.prepare_grads()

    def post_backward(self, unit: ZeroUnit) -> None:
        self._maybe_release(unit)  # the parameters; the gradients may still be in flight
        unit.grads_reduced = True
        if self.bucket.add(unit.groups):
            self._timed("reduce", self._flush, self.overlap_comm)

    def _flush(self, async_op: bool) -> None:
        """Reduce-scatter the open bucket; asynchronously, after finishing the one in flight."""
        self._finish_in_flight()
        pending = start_bucket(self.bucket.take(), self.comm, self.reduce_dtype, async_op)
        if pending is None:
            return
        if async_op:
            self.in_flight = pending
        else:
            self._finish(pending)

    def _finish_in_flight(self) -> None:
        if self.in_flight is not None:
            pending, self.in_flight = self.in_flight, None
            self._finish(pending)

    def _finish(self, pending: PendingBucket) -> None:
        finish_bucket(pending)
        if self.on_grads_final is not None and self.is_boundary():
            self.on_grads_final([g for g in pending.groups if g.grad_shard is not None])

    def finish_backward(self) -> None:
        self.finish_queued = False
        if self.stage == 0:
            if self.is_boundary():
                for unit in self.units:
                    if unit.trainable_params:
                        self._timed("reduce", unit.reduce_grads, self.reduce_dtype)
        else:
            reduce_now = self.stage >= 2 or self.is_boundary()
            for unit in self.units:
                if reduce_now and unit.trainable_params and not unit.grads_reduced:
                    unit.grads_reduced = True
                    if self.bucket.add(unit.groups):
                        self._timed("reduce", self._flush, False)
            self._timed("reduce", self._flush, False)
        for unit in self.units:
            if self.stage == 3:
                unit.reshard()
            unit.reset_backward_state()
        self._record_order()

    def _maybe_release(self, unit: ZeroUnit) -> None:
        """Free a stage-3 unit once its backward is done: [Note: releasing a unit in backward]."""
        if self.stage == 3 and unit.pending_grads == 0 and (unit.inputs_done or not unit.input_signal):
            unit.reshard()

    def release_all(self) -> None:
        """Free every gathered stage-3 unit (before an optimizer step; see [Note: reuse distance])."""
        if self.stage == 3:
            for unit in self.units:
                unit.reshard()

    # ------------------------------------------------------------------ reuse
    def _keep_for_backward(self, unit: ZeroUnit) -> bool:
        """Whether ``unit`` stays gathered until its backward: [Note: reuse distance]."""
        if self.max_reuse_numel <= 0 or not torch.is_grad_enabled() or not unit.sharded_numel:
            return False
        after = self.numel_after.get(unit.index)
        if after is None or 2 * after >= self.max_reuse_numel:
            return False
        return self._live_numel() <= self.max_live_numel

    def _live_numel(self) -> int:
        return sum(u.sharded_numel for u in self.units if u.is_unsharded)

    # ------------------------------------------------------------------ prefetch
    def _record_order(self) -> None:
        if self.current_order and self.current_order != self.forward_order:
            self.forward_order = list(self.current_order)
            self.position = {u.index: i for i, u in enumerate(self.forward_order)}
            self.numel_after = {}
            after = 0
            for upcoming in reversed(self.forward_order):
                self.numel_after.setdefault(upcoming.index, after)
                after += upcoming.sharded_numel
        self.current_order = []

    def _prefetch(self, unit: ZeroUnit, step: int) -> None:
        """Start gathering the units expected next (forward: step=1; backward: step=-1).

        The next unit is always prefetched when prefetching is on (a unit is gathered whole, and
        DeepSpeed's per-parameter bucket defaults, 0.9 x hidden^2, are smaller than one decoder
        layer); further units only while the bucket holds them. Nothing is prefetched that would
        take the gathered elements past ``stage3_max_live_parameters``."""
        if self.prefetch_numel <= 0 or unit.index not in self.position:
            return
        budget = self.prefetch_numel
        live = self._live_numel()
        i = self.position[unit.index] + step
        first = True
        while 0 <= i < len(self.forward_order):
            upcoming = self.forward_order[i]
            budget -= upcoming.sharded_numel
            if (budget < 0 and not first) or live + upcoming.sharded_numel > self.max_live_numel:
                break
            first = False
            live += 0 if upcoming.is_unsharded else upcoming.sharded_numel
            upcoming.unshard(async_op=True)
            i += step
