"""The forward/backward protocol: when each unit is gathered, freed and reduced.

[Note: the shared schedule]
Every collective hf_zero issues inside a forward or backward follows an order that depends on
the model and the step only, never on the path a rank took through the model, so ranks that skip
a layer, run a side tower only on some batches, or route no token to an expert neither hang nor
pair one unit's collective with another's:

- The *forward order* is the model's unit order (``plan_units``: the order in which the unit
  modules are registered), the root first; the *backward order* is its reverse, the root last.
- Forward (stage 3): a cursor walks the forward order. When unit k's forward starts, the units
  between the cursor and k that this rank skipped are *caught up* first: gathered (with the same
  prefetches) and released exactly as if they had run, then k is gathered; at the end of the
  root's forward the units after the last one run are caught up. Every rank therefore issues
  the same gathers in the same order, and every decision that depends on what is gathered (the
  prefetch budget, ``stage3_max_live_parameters``, the reuse distance) sees the same state.
- Backward: a second cursor walks the backward order. When a unit's output gets its first
  gradient, the units between the cursor and it that this rank has no backward for are caught
  up: under stage 3 gathered and released; at every stage their gradients are declared READY
  with zeros. What is left is caught up at the end of the backward.
- Gradients go out in buckets cut once from the backward order ([Note: buckets in a fixed
  order] in buckets.py), on a process group of their own ([Note: two process groups] in
  hf_zero.comm), so a reduction that one rank issues early cannot pair with another rank's
  gather. Under stage 3 at most ``BUCKETS_IN_FLIGHT`` buckets are in flight: finished
  ones are collected as later ones go out, and launching one more first waits for the oldest
  (each holds its units' full gradients, so without the bound a whole model's gradients were
  alive at the end of the backward: +512 MB per rank on a 134M Llama, where the gloo reductions
  only progressed when waited for). That wait cannot deadlock: a rank that has not yet issued
  the oldest reduction has not readied that bucket, so its backward cursor is at or before the
  bucket's units, and every gather it can be blocked in (the shared schedule's, prefetches
  included) was issued already by the waiting rank, whose cursor is past them. The rest is
  finished at the end of the backward. That argument is about the host, where gloo's wait
  blocks. On NCCL a wait is a stream dependency: the host issues on, and what could block is
  the GPU's queues. Every rank queues the same collectives in the same order ([Note: one order
  for both groups]), so no queue waits on work its peer queued later.
- A unit run out of the forward order (a module called twice, a submodule called directly) is
  gathered where it runs, as before: that is rank-invariant only if every rank does it.
- A gradient that reaches a unit after the schedule passed it (its backward ran out of order
  on this rank) is an error that names the unit, never a silent loss.

[Note: one order for both groups]
Parameter gathers and gradient reductions go out on two process groups, and on NCCL two
communicators whose kernels wait for their peers: if rank A queued a reduction before a gather
and rank B the gather before the reduction, each GPU could wait on work the other has not
reached. Every rank issues the two groups' collectives in one order, whatever its path:

- the forward's gathers follow the forward cursor, and the backward's gathers the backward
  cursor, with prefetches decided from state every rank shares (above);
- a reduction goes out when its bucket's units are READY, in the buckets' fixed order. A rank
  that runs unit k has k READY before the backward reaches the next unit of the backward
  order: every autograd node of unit k was made after that unit's output (the forward made
  them later), the engine runs ready nodes in reverse order of creation and gradient
  accumulation first, so all of k's gradients are accumulated before the next unit's output
  hook (its visit) fires. A rank that skipped k marks it READY in the catch-up, which runs in
  that same visit before the next unit's gather. Either way the reduction of k's bucket comes
  after k's gather and before the next unit's.
tests/distributed/test_collective_order.py records what each rank issues on ranks that skip
layers, towers and experts, and compares the sequences. What breaks the argument is a gradient
that reaches a unit after the backward moved past it on one rank only: a parameter read by
another unit's forward (a tied weight across units; an error names it when it arrives later
still, see ``grad_arrived``). On gloo the two groups make that harmless; on NCCL it relies on the
two communicators' kernels fitting on the GPU side by side.

[Note: the unit protocol]
- pre_forward (module forward pre-hook): stage 3 catches up and gathers the unit, then prefetches
  the next units of the forward order, up to ``stage3_prefetch_bucket_size`` elements.
- post_forward (module forward hook): stage 3 frees the unit, unless autograd is running (then
  this forward is an activation-checkpointing recompute inside the unit's backward, which is
  about to need the parameters) or the unit is reused soon (see [Note: reuse distance]). Hooks
  go on the unit's output tensors so that the first gradient reaching them announces the unit's
  backward.
- pre_backward (first output-gradient hook of the unit in this backward): catches up, then stage
  3 gathers the unit (a no-op when it was kept) and prefetches along the backward order; every
  stage binds ``.grad`` views. The unit's gradients are ACCUMULATING.
- post_backward (when the last trainable parameter's gradient has been accumulated; each
  parameter's accumulate hook only counts it, and lands it at once only when it is large):
  the unit's gradients land in their flat buffers in one pass per group ([Note: gradients
  landing in a fresh buffer] in grad_buffer.py), stage 3 frees the parameters; the unit's
  gradients are READY, and stages 2-3 (stages 0-1 in the
  accumulation boundary's backward) reduce every bucket that is now complete in the fixed
  order: stage 0 all-reduces, the others reduce-scatter. Stages 0, 1 and 3 keep up to
  ``BUCKETS_IN_FLIGHT`` reductions in flight, overlapping the backward of the units before
  them; stage 2 does with ``overlap_comm``, one bucket, so memory stays bounded by two buckets.
- finish_backward (queued on the autograd engine at the first pre_backward, so it runs once
  the whole backward is done): catches up the rest of the backward order, reduces what is left,
  folds stages 0-1's 16-bit gradients into their fp32 sum before the boundary, frees what is
  still gathered and resets the states.
- At the accumulation boundary, each group whose fp32 gradient shard is final and that this rank
  used is announced to ``on_grads_final`` (the offloaded optimizer starts its CPU step there,
  overlapping the backward still running).
- With ``wall_clock_breakdown``, each gather (with its wait and the prefetches it starts) runs
  under the ``gather`` timer and each reduction under ``reduce`` (hf_zero.engine.schedule.timers).

[Note: parameters read without their module]
Code may read a stage-3 parameter of a unit whose module it never calls: a fused loss reads
``lm_head.weight`` inside the model's forward (Liger's fused linear cross-entropy, TRL's
fused LM head). Such a read reaches the sharded parameter's guard ([Note: parameters read
outside their unit] in sharded_param.py), which asks the protocol to gather the unit, as
DeepSpeed gathers a module's external parameters:

- inside the model's forward only (between the root's forward pre-hook and its forward hook),
  through the shared schedule, as if the unit's forward started there: the units before it
  are caught up, and every rank issues the same gathers (the read happens at the same point on
  every rank). A read outside a forward (after the step, in a backward hook) keeps the clear
  error: nothing there frees what it would gather;
- the unit then stays gathered: its backward runs inside the fused loss's, with no output
  hook to announce it. Its gradients arrive through the post-accumulate hooks (the unit goes
  from IDLE to ACCUMULATING there) and are reduced in the buckets' order; its parameters are
  freed when the backward reaches the next unit of the backward order, or at the end of the
  backward. A fused loss whose backward recomputes from the weight after that (two forwards
  with autograd and one backward, as DPO runs the chosen and rejected halves) reads a freed
  unit: a unit read in a forward with autograd is gathered again on such a read, as an
  activation-checkpointing recompute gathers its unit, and freed at the end of the backward;
- what a forward without autograd gathered is freed at the end of that forward, unless an
  earlier forward with autograd read it too (a reference model's pass between the policy's
  forward and its backward, on a shared model with the adapter disabled);
- a read while the unit's prefetch is still in flight waits for it: the parameters keep their
  guard until the gather has completed, not only until the buffer exists, so a read that no
  module hook waited for never sees the buffer's previous bytes.

[Note: units whose backward reads no parameter]
An embedding lookup's backward scatters the output gradient into rows of the weight's gradient
from the saved indices; it never reads the weight. A unit that is exactly a ``nn.Embedding``
(with its own ``forward``: a subclass that transforms the weight may read it) is therefore
freed right after its forward whatever the reuse distance, and its backward gathers nothing:
its gradient is accumulated into ``.grad`` views that need the parameter's shape only. On a
Llama with a 32k vocabulary that is the vocabulary's rows (94 MB in fp32 at hidden 768) not
held from the forward to the end of the backward; the decision is a property of the unit, so
every rank skips the same gathers.

"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Iterator

import torch
from torch.utils.hooks import RemovableHandle

from hf_zero.comm import Communicator
from hf_zero.engine.sharding.buffer_pool import BufferPool
from hf_zero.engine.schedule.buckets import ReduceSchedule
from hf_zero.engine.schedule.gather_plan import GatherPlan
from hf_zero.engine.schedule.reduction_flight import ReductionFlight
from hf_zero.engine.sharding.flat_group import FlatParamGroup
from hf_zero.engine.policy import ShardingPolicy
from hf_zero.engine.schedule.timers import PhaseTimers
from hf_zero.engine.schedule.unit import GradState, ZeroUnit


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
    """Installs and runs [Note: the unit protocol] over a model's units (root unit last), along
    [Note: the shared schedule], as its :class:`ShardingPolicy` says ([Note: sharding policy])."""

    def __init__(
        self,
        units: list[ZeroUnit],
        policy: ShardingPolicy,
        comm: Communicator,
        reduce_dtype: torch.dtype,
        max_live_numel: int,
        is_boundary: Callable[[], bool],
        buffers: BufferPool,
        timers: PhaseTimers | None = None,
        reduce_bucket_numel: int = 0,
        grad_accum_dtype: torch.dtype = torch.float32,
        on_grads_final: Callable[[list[FlatParamGroup]], None] | None = None,
        check_in: Callable[[str], None] = lambda phase: None,
    ) -> None:
        self.units = units
        # Let go of its idle buffers at the phase boundaries ([Note: the buffer pool]).
        self.buffers = buffers
        self.root = units[-1]
        self.policy = policy
        # Without policy.shards_gradients: what micro-steps sum in (fold_grads).
        self.grad_accum_dtype = grad_accum_dtype
        self.timers = timers  # wall_clock_breakdown; None when off
        self.is_boundary = is_boundary
        # Raises unless every rank starts the phase named together ([Note: phases in step]);
        # the engine's. With policy.shards_params only: the phases here run collectives only there.
        self.check_in = check_in
        self.handles: list[RemovableHandle] = []
        self.finish_queued = False
        # The shared schedule: forward order (root excluded; it runs around everything) and
        # the backward order (its reverse).
        self.forward_order = units[:-1]
        self.forward_position = {u.index: i for i, u in enumerate(self.forward_order)}
        self.backward_order = self.forward_order[::-1]
        self.backward_position = {u.index: i for i, u in enumerate(self.backward_order)}
        # Per backward position, the buffer sizes the units after it take from the pool.
        self.backward_sizes_ahead: list[frozenset[int]] = []
        ahead: frozenset[int] = frozenset()
        for unit in reversed(self.backward_order):
            self.backward_sizes_ahead.append(ahead)
            ahead = ahead | unit.buffer_sizes_in_backward()
        self.backward_sizes_ahead.reverse()
        # What is gathered ahead, and what stays gathered for its backward.
        self.gathers = GatherPlan(units, self.backward_order, policy, max_live_numel)
        self.forward_cursor = len(self.forward_order)  # no forward pass open
        self.forward_open = False  # between the root's forward pre-hook and its forward hook
        self.training_pass = False  # the open forward pass runs with autograd
        # Units gathered by a read without their module ([Note: parameters read without their
        # module]): in a pass with autograd (their backward may read them again), and in the open
        # pass without autograd (freed when it ends).
        self.read_for_backward: list[ZeroUnit] = []
        self.read_without_grad: list[ZeroUnit] = []
        self.backward_cursor = 0
        self.backward_open = False
        self.reductions = ReduceSchedule(
            [(u, g) for u in self.backward_order + [self.root] for g in u.trainable_groups], reduce_bucket_numel)
        # The buckets whose reductions are in flight.
        self.flight = ReductionFlight(policy, comm, reduce_dtype, is_boundary, on_grads_final)

    # ------------------------------------------------------------------ install
    def install(self) -> None:
        for unit in self.units:
            self.handles.append(unit.module.register_forward_pre_hook(self._hook_pre_forward(unit), with_kwargs=True))
            self.handles.append(unit.module.register_forward_hook(self._hook_post_forward(unit)))
            for group in unit.trainable_groups:
                for index, param in enumerate(group.params):
                    self.handles.append(
                        param.register_post_accumulate_grad_hook(self._hook_post_accumulate(unit, group, index))
                    )

        if self.policy.shards_params:
            for unit in self.units[:-1]:
                for group in unit.groups:
                    if group.storage.sharded_between_uses:
                        for param in group.params:
                            param._hf_zero_gather_on_read = partial(self.gather_on_read, unit)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for unit in self.units:
            for param in (p for g in unit.groups for p in g.params):
                if hasattr(param, "_hf_zero_gather_on_read"):
                    del param._hf_zero_gather_on_read

    def gather_on_read(self, unit: ZeroUnit) -> bool:
        """A parameter of ``unit`` is read without its module: gather the unit if the read may
        ([Note: parameters read without their module]). Returns whether it is gathered."""
        if _in_backward():  # a fused loss's backward recomputing from the weight
            if unit not in self.read_for_backward:
                return False
            self._timed("gather", unit.unshard)
            return True
        if not self.forward_open:
            return False
        self.pre_forward(unit)  # the shared schedule inside a forward; where it runs after one
        unit.wait_unshard()
        held = self.read_for_backward if self.training_pass else self.read_without_grad
        if unit not in held:
            held.append(unit)
        return True

    def _hook_pre_forward(self, unit: ZeroUnit) -> Callable:
        def hook(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
            self.pre_forward(unit)
            if self.policy.shards_params and unit.has_frozen_sharded and torch.is_grad_enabled():
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

    def _hook_post_accumulate(self, unit: ZeroUnit, group: FlatParamGroup, index: int) -> Callable:
        def hook(param: torch.Tensor) -> None:
            self.grad_arrived(unit, group, index)

        return hook

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

    # ------------------------------------------------------------------ forward
    def pre_forward(self, unit: ZeroUnit) -> None:
        if not self.policy.shards_params:
            return
        if _in_backward():  # an activation-checkpointing recompute: gather, no prefetch
            self._timed("gather", unit.unshard)
            return
        if unit is self.root:  # a new forward pass starts
            self.check_in("forward")
            self.forward_open = True
            self.forward_cursor = 0
            self.training_pass = torch.is_grad_enabled()
            self._timed("gather", self._gather_forward, unit)
            return
        position = self.forward_position[unit.index]
        if position < self.forward_cursor:  # out of the forward order: see [Note: the shared schedule]
            self._timed("gather", unit.unshard)
            return
        self._catch_up_forward(position)
        self.forward_cursor = position + 1
        self._timed("gather", self._gather_forward, unit)

    def _catch_up_forward(self, stop: int) -> None:
        """The units of the forward order before ``stop`` that this rank skipped: gathered and
        released as if they had run."""
        while self.forward_cursor < stop:
            skipped = self.forward_order[self.forward_cursor]
            self.forward_cursor += 1
            self._timed("gather", self._gather_forward, skipped)
            self._end_forward(skipped)

    def _gather_forward(self, unit: ZeroUnit) -> None:
        unit.unshard()
        start = 0 if unit is self.root else self.forward_position[unit.index] + 1
        self.gathers.prefetch(self.forward_order, start, self.gathers.live_numel())

    def post_forward(self, unit: ZeroUnit, output: Any) -> None:
        if self.policy.shards_params and not _in_backward():
            if unit is self.root and self.forward_cursor <= len(self.forward_order):
                self._catch_up_forward(len(self.forward_order))
                self.forward_cursor = len(self.forward_order)
            self._end_forward(unit)
            if unit is self.root:
                self._end_forward_pass()
            if self.forward_cursor >= len(self.forward_order):
                self.buffers.release_idle()  # the last unit is done: the loss follows
        if not torch.is_grad_enabled():
            return
        for tensor in _tensors(output):
            if tensor.requires_grad:
                tensor.register_hook(self._hook_pre_backward(unit))

    def _end_forward(self, unit: ZeroUnit) -> None:
        if not self.gathers.keeps_for_backward(unit, self.training_pass):
            unit.reshard()

    def _end_forward_pass(self) -> None:
        self.forward_open = False
        if not self.training_pass:  # no backward will free what a read gathered
            for unit in self.read_without_grad:
                if unit not in self.read_for_backward:  # an earlier pass's backward still reads it
                    unit.reshard()
            self.read_without_grad.clear()

    # ------------------------------------------------------------------ backward
    def _hook_pre_backward(self, unit: ZeroUnit) -> Callable:
        def hook(grad: torch.Tensor) -> None:
            self.pre_backward(unit)

        return hook

    def _open_backward(self) -> None:
        if self.policy.shards_params:
            self.check_in("backward")
        self.backward_open = True
        self.backward_cursor = 0
        self.reductions.reset()
        if not self.finish_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)
            self.finish_queued = True

    def pre_backward(self, unit: ZeroUnit) -> None:
        if unit.backward_visited:
            return
        if not self.backward_open:
            self._open_backward()
        if unit is not self.root:
            position = self.backward_position[unit.index]
            if position >= self.backward_cursor:
                self._catch_up_backward(position)
                self.backward_cursor = position + 1
        self._visit_backward(unit, runs=True)

    def _catch_up_backward(self, stop: int) -> None:
        """The units of the backward order before ``stop`` that this rank has no backward for:
        gathered and released under stage 3, and their gradients READY with zeros."""
        while self.backward_cursor < stop:
            skipped = self.backward_order[self.backward_cursor]
            self.backward_cursor += 1
            if not skipped.backward_visited:
                # A unit a fused loss read in a forward with autograd has a backward although
                # no output of it announced one; its gradients may still be on their way (a
                # second forward's backward runs first): wait for them as for a unit that runs.
                runs = skipped in self.read_for_backward and skipped.grad_state is not GradState.READY
                self._visit_backward(skipped, runs=runs)

    def _visit_backward(self, unit: ZeroUnit, runs: bool) -> None:
        unit.backward_visited = True
        if self.policy.shards_params:
            self._timed("gather", self._gather_backward, unit)
        if not runs:
            if self.policy.shards_params:
                unit.reshard()
            if unit.grad_state is GradState.IDLE:
                self._grads_ready(unit)
            return
        if unit.grad_state is GradState.IDLE:
            unit.move_grads(GradState.ACCUMULATING)
        unit.prepare_grads()

    def _gather_backward(self, unit: ZeroUnit) -> None:
        if unit.backward_reads_params:  # see [Note: units whose backward reads no parameter]
            unit.unshard()
        start = 0 if unit is self.root else self.backward_position[unit.index] + 1
        self.gathers.prefetch(self.backward_order, start, self.gathers.live_numel_ahead())
        if unit is not self.root:
            self.gathers.passed(unit)

    def grad_arrived(self, unit: ZeroUnit, group: FlatParamGroup, index: int) -> None:
        """Parameter ``index`` of ``group`` got its gradient accumulated (post-accumulate-grad
        hook)."""
        if not self.backward_open:  # no unit output announced this backward (a parameter read
            self._open_backward()   # without its module, a root output without tensors)
        if unit.grad_state is GradState.IDLE:  # reached without its output: a parameter used
            unit.move_grads(GradState.ACCUMULATING)  # outside the unit's forward
        elif unit.grad_state is not GradState.ACCUMULATING:
            raise RuntimeError(
                f"hf_zero: unit {unit.name} got a gradient after the shared schedule passed it "
                f"(its gradients are {unit.grad_state.value}): its backward ran out of the model's "
                "unit order on this rank. Make the module a single unit "
                "(zero_optimization.wrap_modules) or run it in the model's order"
            )
        group.grads.received[index] = True  # [Note: parameters no rank used]
        if group.grads.lands_at_once[index]:
            group.grads.land_one(index)  # [Note: gradients landing in a fresh buffer]
        unit.pending_grads -= 1
        if unit.pending_grads == 0:
            self.post_backward(unit)

    def post_backward(self, unit: ZeroUnit) -> None:
        """Every trainable parameter of ``unit`` got its gradient in this backward: they land in
        the flat buffers in one pass per group ([Note: gradients landing in a fresh buffer] in
        grad_buffer.py), the parameters are freed, and the buckets now complete go out."""
        for group in unit.trainable_groups:
            group.grads.land()
        self._maybe_release(unit)  # the parameters; the gradients may still be in flight
        self._grads_ready(unit)

    def _grads_ready(self, unit: ZeroUnit) -> None:
        unit.move_grads(GradState.READY)
        if self.policy.shards_gradients or self.is_boundary():  # else at the boundary only
            for bucket in self.reductions.ready_buckets():
                self._timed("reduce", self.flight.launch, bucket)

    def finish_backward(self) -> None:
        self.finish_queued = False
        self._catch_up_backward(len(self.backward_order))
        for unit in self.units:
            if unit.grad_state in (GradState.IDLE, GradState.ACCUMULATING):
                unit.move_grads(GradState.READY)  # partly used, or not used on this rank: zeros
        if not self.policy.shards_gradients and not self.is_boundary():
            for unit in self.units:  # 16-bit gradients summed in fp32 across micro-steps
                for group in unit.trainable_groups:
                    group.grads.fold(self.grad_accum_dtype)
        if self.policy.shards_gradients or self.is_boundary():
            for bucket in self.reductions.remaining():
                self._timed("reduce", self.flight.launch, bucket)
            self._timed("reduce", self.flight.finish_all)
        for unit in self.units:
            if self.policy.shards_params:
                unit.reshard()
            unit.reset_backward_state()
        self.gathers.backward_done()
        self.read_for_backward.clear()
        self.backward_open = False
        self.buffers.release_idle()  # the optimizer step follows

    # [Note: releasing a unit in backward]
    # A stage-3 unit's gathered parameters are freed in the backward as soon as nothing will read
    # them again: the shared schedule has reached the unit (backward_visited) and every trainable
    # parameter's gradient has arrived (pending_grads 0). Gradient hooks fire per parameter, so a
    # unit with sharded frozen parameters (a LoRA base layer) could be freed after its last
    # trainable gradient while autograd still needs a frozen weight for the gradient of the unit's
    # inputs. Such a unit also hooks its forward inputs (register_multi_grad_hook, mode "all") and
    # waits for their gradients (inputs_done); a unit whose inputs need no gradient has no such
    # signal and is freed on its parameters' gradients alone.
    def _maybe_release(self, unit: ZeroUnit) -> None:
        """Free a stage-3 unit once its backward is done: [Note: releasing a unit in backward]."""
        if (self.policy.shards_params and unit.backward_visited and unit.pending_grads == 0
                and (unit.inputs_done or not unit.input_signal)):
            unit.reshard()
            if self.backward_open and unit is not self.root:
                # [Note: the buffer pool in the backward]
                self.buffers.release_idle(keep=self.backward_sizes_ahead[self.backward_position[unit.index]])

    def release_all(self) -> None:
        """Free every gathered stage-3 unit and drop its secondary shards (before an optimizer
        step; see [Note: reuse distance] and [Note: secondary shards])."""
        if self.policy.shards_params:
            for unit in self.units:
                unit.reshard()
                for group in unit.groups:
                    group.storage.drop_secondary()
            self.read_for_backward.clear()
            self.read_without_grad.clear()

