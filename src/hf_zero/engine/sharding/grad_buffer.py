"""A flat group's gradients: the full flat gradient buffer autograd writes into (its ``.grad``
views, [Note: views into flat buffers] in param_storage.py), its fp32 sum across micro-steps,
its reduction, and the fp32 gradient shard the optimizer reads.

[Note: a gradient autograd hands over]
A stage-3 group's full gradient is a flat buffer that the ``.grad`` views point into, so
autograd accumulates each parameter's gradient into it. For a parameter alone in its group
and filling it exactly (an embedding, an untied head: the largest buffers of a decoder), the
buffer would be a second copy of the tensor autograd makes anyway: the buffer, zeroed before
the backward, plus autograd's gradient, added into it, held 3 x 1002 MiB per rank at the
Llama-3-8B head's backward (parameters, buffer, autograd's gradient). Such a group gets no
buffer before its backward: autograd's gradient becomes ``.grad`` itself, and at the
reduction its memory moves into the flat buffer's storage object
(``UntypedStorage._swap_data_ptr_``; the object, which views and the pool know, stays), so
the reduction reads it where autograd wrote it. A gradient that does not fit (another dtype,
not contiguous, a second micro-step's sum already in the buffer) takes the usual path.

[Note: gradients landing in a fresh buffer]
Autograd adds a gradient into an existing ``.grad`` and hands over its own tensor when
``.grad`` is None. Pointing ``.grad`` at a zeroed buffer therefore costs a zeroing pass and an
addition (two reads, one write) for every gradient byte, on top of the matmul that made the
gradient. So a buffer the pool has just handed out (its contents undefined) is not zeroed and
the ``.grad`` stay None for the backward: autograd hands its gradient over, and once the unit's
last gradient has arrived (its post-backward, ``land``) the gradients are copied into their
slots in one pass (``torch._foreach_copy_``: one read and one write per byte, one launch for
the unit, as FSDP2 packs its gradients with one ``_chunk_cat``), the bytes no gradient wrote
(the slots of parameters that got none, the alignment padding) are zeroed in one
``_foreach_zero_``, and ``.grad`` points at the slots, where any later gradient of that
backward is added in place. A gradient of ``LAND_AT_ONCE_BYTES`` or more is copied when it
arrives instead (``land_one``), so that autograd's tensor goes at once: held until the unit's
end, the large ones would add up to a second copy of the unit's gradients (a Mixtral layer's
fused experts at world 64: +1 GiB per rank), while a copy that large takes as long on the GPU
as launching it takes on the host, so batching it saves nothing. A unit some of whose
parameters get no gradient lands what it has before its buffer is read (its reduction, or the
fp32 fold of a micro-step). This is what DeepSpeed and FSDP2 do (autograd's gradient, copied
into the reduction's input). A buffer that already holds gradients (an accumulation window,
stage 0's kept buffer) keeps ``.grad`` on its views.

[Note: reducing into the gradient shard]
A reduce-scatter's result is normally added into the fp32 gradient shard, divided by what
[Note: averaging gradients over ranks] left to divide, and its buffer goes back to the pool. In
a step's first fp32 reduction of a group the shard still holds zeros, and an fp32 reduction
leaves nothing to divide (its inputs were divided), so the collective writes the shard itself:
no result buffer (at the untied head of the 134M Llama of the Trainer test, 49 MiB per rank
alive during its reduction) and no addition. Adding into zeros is exact, so the values are
those of the buffered path. Later reductions of the step (micro-steps of an accumulation), 16-bit ones, and those whose
result is copied to the host, take the buffer and add (on the host, a first one into the zeroed
shard is a copy: [Note: landing 16-bit gradients on the host] in hf_zero.kernels.cpu).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import nn

from hf_zero.comm import Communicator, Handle
from hf_zero.engine.sharding.buffer_pool import BufferPool, allocate_storage, free_storage, storage_bytes
from hf_zero.engine.sharding.grad_average import plan_average, post_divisor
from hf_zero.kernels import add_scaled_
from hf_zero.engine.policy import ShardingPolicy
from hf_zero.host_memory import CAN_SWAP_STORAGE, lasting_zeros
from hf_zero.execution import execution_for
from hf_zero.offload import OffloadSettings
from hf_zero.partition import FlatLayout
from hf_zero.transfer import is_host_store, to_host


# [Note: gradients landing in a fresh buffer]: 16 MiB takes about 5 us to copy at 3 TB/s, what
# a kernel launch costs the host.
LAND_AT_ONCE_BYTES = 16 << 20


class GradBufferState(enum.Enum):
    """What the full gradient buffer holds. Under stage 0 (no ``shards_optimizer_state``) the
    buffer is kept for the run: it is ``ACCUMULATING`` outside its reduction, and after it holds
    the all-reduced gradients until the step's :meth:`GradBuffer.zero_shard`."""

    EMPTY = "empty"  # no memory: a frozen group, or a sharded one outside its backward and reduction
    ACCUMULATING = "accumulating"  # memory, with the .grad views into it: autograd adds gradients
    REDUCING = "reducing"  # start_reduce issued the collective that reads it, until finish_reduce


@dataclass
class PendingReduce:
    """A gradient reduction in flight: its handle, where the result lands, and the input the
    collective still reads (kept alive until :meth:`GradBuffer.finish_reduce`)."""

    handle: Handle | None
    received: torch.Tensor
    send: torch.Tensor


class GradBuffer:
    """The gradients of one group of parameters (see the module docstring); ``state`` says what
    the full buffer holds. ``full`` is None for a frozen group."""

    def __init__(
        self,
        label: str,
        params: list[nn.Parameter],
        layout: FlatLayout,
        comm: Communicator,
        policy: ShardingPolicy,
        offload: OffloadSettings,
        buffers: BufferPool,
        pool_user: object,
        compute_dtype: torch.dtype,
        device: torch.device,
        master: torch.Tensor | None,
    ) -> None:
        """``master`` is the group's fp32 master tensor (None: frozen, so no gradients); a
        gradient shard of its size becomes its ``.grad``."""
        self.label = label
        self.params = params
        self.layout = layout
        self.comm = comm
        self.policy = policy
        self.offload = offload
        self.buffers = buffers
        self.device = device
        self.master = master
        self.state = GradBufferState.EMPTY
        self.full: torch.Tensor | None = None
        # Stages 0-1 with 16-bit gradients: the micro-steps' sum in fp32 until the accumulation
        # boundary's reduction (see fold); allocated by the first fold, freed by the reduction.
        self.accum: torch.Tensor | None = None
        self.shard: torch.Tensor | None = None
        # The gradient shard holds nothing yet in this step (all zeros): a reduction may write
        # it instead of being added into it ([Note: reducing into the gradient shard]).
        self.shard_is_zero = True
        # [Note: parameters no rank used] in hf_zero.engine.sharding.param_usage: per parameter, whether
        # it got a gradient on this rank since the last optimizer step.
        self.received = [False] * len(params)
        # While autograd's gradients land in a fresh buffer: which slots one has written
        # ([Note: gradients landing in a fresh buffer]); None otherwise.
        self.landed: list[bool] | None = None
        self._views: list[torch.Tensor] | None = None  # each parameter's slot in ``full``, made once
        self._padding: list[torch.Tensor] | None = None  # what no slot covers (alignment, the tail)
        self.lands_at_once = [slot.numel * compute_dtype.itemsize >= LAND_AT_ONCE_BYTES for slot in layout.slots]
        if master is not None:
            self._allocate(compute_dtype, device, pool_user)

    def _allocate(self, compute_dtype: torch.dtype, device: torch.device, pool_user: object) -> None:
        self.state = GradBufferState.ACCUMULATING
        if not self.policy.shards_optimizer_state:  # all-reduced in place, kept for the run
            self.full = torch.zeros(self.layout.padded_numel, dtype=compute_dtype, device=device)
        else:
            # Freed at once below, so never written: zeroing it would make every page resident
            # and, through the host allocator, keep a full unit's bytes per group after the load
            # (prepare zeroes it when a backward first needs it).
            self.full = torch.empty(self.layout.padded_numel, dtype=compute_dtype, device=device)
            self.buffers.register(storage_bytes(self.full), pool_user)
        if not self.policy.shards_optimizer_state and compute_dtype == torch.float32:
            self.shard = self.full  # all-reduced in place, already fp32
            self.master.grad = self.shard
        if self.policy.shards_optimizer_state:
            self.release()
        # Otherwise the fp32 gradient shard is allocated by the first reduction: right after
        # initialize a rank holds its parameter shards and nothing else (see sharded loading).

    def ensure_shard(self) -> torch.Tensor:
        if self.shard is None:
            if self.master is None:
                raise RuntimeError(f"{self.label} is frozen: it has no fp32 master to give a gradient shard")
            if self.offload.optimizer_on_host:
                self.shard = to_host(torch.zeros(self.layout.shard_numel, dtype=torch.float32), self.offload.pin_memory)
            else:  # kept for the run: [Note: memory kept for the run] in hf_zero.host_memory
                self.shard = lasting_zeros(self.layout.shard_numel, torch.float32, self.device)
            if self.master.numel() == self.shard.numel():
                self.master.grad = self.shard
        return self.shard

    # ----------------------------------------------------------------- the full buffer
    @property
    def adopts_autograd_grad(self) -> bool:
        """[Note: a gradient autograd hands over]: this group's flat gradient can be the tensor
        autograd made for its one parameter."""
        slot = self.layout.slots[0] if len(self.layout.slots) == 1 else None
        return (self.policy.shards_params and slot is not None and slot.offset == 0 and slot.numel == self.layout.padded_numel
                and CAN_SWAP_STORAGE)

    @property
    def views(self) -> list[torch.Tensor]:
        """Each parameter's slot in the full buffer, in the parameter's shape. Made once: the
        buffer's tensor object stays for the run (freeing empties its storage, [Note: views into
        flat buffers] in param_storage.py), so its views do too."""
        if self._views is None:
            self._views = [slot.view_in(self.full) for slot in self.layout.slots]
            covered = sorted((slot.offset, slot.offset + slot.numel) for slot in self.layout.slots)
            gaps, start = [], 0
            for lo, hi in covered + [(self.full.numel(), self.full.numel())]:
                if lo > start:
                    gaps.append(self.full[start:lo])
                start = max(start, hi)
            self._padding = gaps
        return self._views

    def prepare(self, for_backward: bool = False) -> None:
        """Before this group's backward (``for_backward``) or its reduction: make sure the flat
        gradient buffer exists (fresh ones are zeroed; an accumulating one is kept) and that each
        ``.grad`` is a view into it. A group that adopts autograd's gradient gets no buffer
        before its backward ([Note: a gradient autograd hands over]); a fresh buffer before a
        backward is not zeroed: autograd's gradients land in it ([Note: gradients landing in a
        fresh buffer])."""
        if self.full is None:
            return
        if not self.has_grads() and self.adopts_autograd_grad:
            if for_backward or self._adopt_autograd_grad():
                return
        fresh = self.buffers.acquire(self.full)
        if self.state is GradBufferState.EMPTY:
            self.state = GradBufferState.ACCUMULATING
        # A unit's parameters may be sharded here (its reduction after its backward freed them):
        # reading ``.grad`` then needs no guard ([Note: parameters read outside their unit]).
        with torch._C.DisableTorchFunctionSubclass():
            if fresh and for_backward and all(param.grad is None for param in self.params):
                self.landed = [False] * len(self.params)
                return
            if fresh:
                self.full.zero_()
            elif self.landed is not None:
                self.land()  # what arrived, and zeros where nothing did
            self.landed = None
            for view, param in zip(self.views, self.params):
                grad = param.grad
                if grad is None or grad.data_ptr() != view.data_ptr():
                    if grad is not None:  # produced outside our buffer (a parameter read outside its unit)
                        view.add_(grad.to(view.dtype))
                    param.grad = view

    def land_one(self, index: int) -> None:
        """A large gradient, as it arrives ([Note: gradients landing in a fresh buffer]): into its
        slot, and ``.grad`` becomes the view."""
        if self.landed is None or self.landed[index]:
            return
        view = self.views[index]
        param = self.params[index]
        with torch._C.DisableTorchFunctionSubclass():
            grad = param.grad
            if grad is None:
                return
            view.copy_(grad)
            self.landed[index] = True
            param.grad = view

    def land(self) -> None:
        """The unit's post-backward ([Note: gradients landing in a fresh buffer]): the gradients
        autograd handed over are copied into their slots in one pass, what no gradient wrote is
        zeroed, and each ``.grad`` becomes its view. A buffer that holds gradients already took
        autograd's additions in place: nothing to do."""
        if self.landed is None:
            return
        views = self.views
        with torch._C.DisableTorchFunctionSubclass():  # an embedding unit is sharded again by now
            arrived = [(index, param.grad) for index, param in enumerate(self.params)
                       if param.grad is not None and not self.landed[index]]
            if arrived:
                torch._foreach_copy_([views[index] for index, _ in arrived], [grad for _, grad in arrived])
            for index, _ in arrived:
                self.landed[index] = True
                self.params[index].grad = views[index]
        unwritten = [view for view, landed in zip(views, self.landed) if not landed] + self._padding
        if unwritten:
            torch._foreach_zero_(unwritten)
        self.landed = None

    def _adopt_autograd_grad(self) -> bool:
        """Make the parameter's own ``.grad`` tensor (autograd's, not a view into the buffer) the
        flat gradient buffer's memory. Returns whether it did."""
        param, slot = self.params[0], self.layout.slots[0]
        grad = param.grad
        needed = self.full.numel() * self.full.element_size()
        if (grad is None or grad.dtype != self.full.dtype or grad.device != self.full.device
                or not grad.is_contiguous() or grad.storage_offset() != 0 or storage_bytes(grad) != needed):
            return False
        # The buffer's storage object stays (views and the pool know it); the memory changes hands.
        self.full.untyped_storage()._swap_data_ptr_(grad.untyped_storage())
        self.state = GradBufferState.ACCUMULATING
        param.grad = slot.view_in(self.full)
        return True

    @property
    def full_bytes(self) -> int:
        """The bytes of the full gradient buffer while it exists (0 for a frozen group)."""
        return 0 if self.full is None else self.full.numel() * self.full.element_size()

    def has_grads(self) -> bool:
        return self.state is not GradBufferState.EMPTY

    def fold(self, accum_dtype: torch.dtype) -> None:
        """End of a micro-step before the accumulation boundary (stages 0-1): add the 16-bit
        full gradients into a fp32 buffer and zero them, so that a long accumulation sums in
        fp32 as DeepSpeed's bf16 optimizer does (``data_types.grad_accum_dtype``; the next
        micro-step's ``.grad`` then holds that micro-step only)."""
        if self.full is None or self.full.dtype == accum_dtype:
            return
        # Every trainable group folds, with or without gradients: a bucket packs groups of one dtype.
        if self.landed is not None:
            self.prepare()  # what arrived landed, what no gradient wrote zero, every .grad a view
        if self.accum is None:
            self.accum = torch.zeros(self.layout.padded_numel, dtype=accum_dtype, device=self.full.device)
        elif allocate_storage(self.accum):
            self.accum.zero_()
        if self.has_grads():
            self.accum.add_(self.full)
            self.full.zero_()

    def to_reduce(self) -> torch.Tensor:
        """The full gradients a reduction sends: the buffer autograd wrote, or with it the fp32
        sum of the earlier micro-steps (see :meth:`fold`)."""
        if self.accum is not None and storage_bytes(self.accum) > 0:
            return self.accum.add_(self.full)
        return self.full

    def drop_accum(self) -> None:
        """The fp32 sum of the micro-steps went into a reduction: the next window starts at zero."""
        if self.accum is not None:
            free_storage(self.accum)

    def release(self) -> None:
        """The full gradients are no longer needed: the buffer (from any state) gives its memory up."""
        self.drop_accum()
        if self.full is None:
            return
        with torch._C.DisableTorchFunctionSubclass():  # the parameters may be sharded by now
            for param in self.params:
                param.grad = None
        self.buffers.release(self.full)
        self.state = GradBufferState.EMPTY
        self.landed = None

    # ----------------------------------------------------------------- the reduction
    @property
    def reduces_into_pool(self) -> bool:
        """A reduction's output comes from the pool and goes back once added into the gradient
        shard; not when a copy to the host reads it after that ([Note: gradients copied to the
        host]), which keeps it alive itself."""
        return self.offload.grad_copies is None

    def start_reduce(self, reduce_dtype: torch.dtype, async_op: bool) -> PendingReduce | None:
        """Issue the gradient reduction; :meth:`finish_reduce` waits for it and accumulates.
        Until then the full gradient buffer is the collective's input and must stay alive. The
        division by the world size happens where [Note: averaging gradients over ranks] says."""
        if self.full is None:
            return None
        if self.state is GradBufferState.REDUCING:
            raise RuntimeError(f"{self.label}: cannot start a gradient reduction: one is already in flight "
                               "(call finish_reduce with its PendingReduce first)")
        self.ensure_shard()
        self.prepare()  # allocates zeros if this group got no gradient this backward
        source = self.to_reduce()
        send = source if source.dtype == reduce_dtype else source.to(reduce_dtype)
        average = plan_average(reduce_dtype, self.comm, send.device)
        if average.pre_divisor > 1:
            send.div_(average.pre_divisor)
        self.state = GradBufferState.REDUCING
        if not self.policy.shards_optimizer_state:
            handle = self.comm.all_reduce_into(send, label=self.label, op=average.op, async_op=async_op)
            return PendingReduce(handle, send, send)
        if self.reduces_into_shard(send):  # [Note: reducing into the gradient shard]
            received = self.shard
        elif self.reduces_into_pool:  # [Note: the buffer pool]
            received = self.buffers.take(self.layout.shard_numel, reduce_dtype)
        else:
            received = torch.empty(self.layout.shard_numel, dtype=reduce_dtype, device=send.device)
        handle = self.comm.reduce_scatter_into(received, send, label=self.label, async_op=async_op, op=average.op)
        return PendingReduce(handle, received, send)

    def finish_reduce(self, pending: PendingReduce) -> None:
        if self.state is not GradBufferState.REDUCING:
            raise RuntimeError(f"{self.label}: cannot finish a gradient reduction: its gradients are "
                               f"{self.state.value}, expected {GradBufferState.REDUCING.value} (start_reduce issues one)")
        if pending.handle is not None:
            pending.handle.wait()
        self.state = GradBufferState.ACCUMULATING
        received = pending.received
        if self.shard.data_ptr() == received.data_ptr():
            # The collective wrote the gradient shard itself: stage 0's in-place all-reduce, or
            # [Note: reducing into the gradient shard].
            self.shard_is_zero = False
        else:
            self.accept_reduced(received, post_divisor(received.dtype, self.comm.data_parallel_size))
            if self.policy.shards_optimizer_state and self.reduces_into_pool:
                self.buffers.give_back(received)  # added into the gradient shard
        if self.policy.shards_optimizer_state:
            self.release()
        else:
            self.drop_accum()

    def reduces_into_shard(self, send: torch.Tensor) -> bool:
        """[Note: reducing into the gradient shard]: this reduction may write the fp32 gradient
        shard itself."""
        return (self.policy.shards_optimizer_state and self.shard_is_zero and self.reduces_into_pool
                and send.dtype == self.shard.dtype and send.device == self.shard.device
                and post_divisor(send.dtype, self.comm.data_parallel_size) == 1 and not is_host_store(self.shard))

    # ----------------------------------------------------------------- the gradient shard
    def accept_reduced(self, reduced: torch.Tensor, divisor: int = 1) -> None:
        """This rank's part of a finished reduction into the fp32 gradient shard."""
        if self.full is not None and self.shard is not None and self.shard.data_ptr() == self.full.data_ptr():
            # Stage 0, fp32 compute, reduced elsewhere (a bucket, a 16-bit reduction): the fp32
            # gradient buffer is the gradient shard and still holds this rank's own gradients;
            # the average replaces them.
            self.shard.zero_()
        self.accumulate_shard(reduced, divisor)

    def accumulate_shard(self, reduced: torch.Tensor, divisor: int = 1) -> None:
        """Add this rank's reduced part of the gradients (any dtype, any device), divided by
        ``divisor`` in fp32, into the fp32 gradient shard: micro-steps of an accumulation add up
        there. ``divisor`` is what [Note: averaging gradients over ranks] left to divide. Into a
        host shard the add happens when the copy lands ([Note: gradients copied to the host])."""
        shard = self.ensure_shard()
        # The step's first part into a zeroed shard overwrites it ([Note: landing 16-bit
        # gradients on the host] in hf_zero.kernels.cpu); stage 0's shard is autograd's buffer.
        overwrite = self.shard_is_zero and self.policy.shards_optimizer_state
        self.shard_is_zero = False
        copies = self.offload.grad_copies
        if copies is None or not is_host_store(shard) or is_host_store(reduced):
            add_scaled_(shard, reduced, 1.0 / divisor, dst_is_zero=overwrite)
            return
        staging, copied = execution_for(reduced.device).stage_to_host(
            reduced, self.offload.pin_memory, f"{self.label} gradients to the host")
        copies.push(self, staging, copied, divisor, overwrite)

    def land_host_grads(self) -> None:
        """The host reads this group's gradient shard next: its copies in flight land first."""
        if self.offload.grad_copies is not None:
            self.offload.grad_copies.land(self)

    @property
    def unreceived(self) -> int:
        """How many of the group's parameters got no gradient on this rank since the last step."""
        return len(self.received) - sum(self.received)

    @property
    def fully_received(self) -> bool:
        """Every parameter of the group got a gradient on this rank: all are used, whatever
        the other ranks did."""
        return all(self.received)

    def zero_shard(self, zero_tensor: bool = True) -> None:
        """The step is done: nothing received, the gradient shard zeros (``zero_tensor``: here;
        else the caller zeroes it, with the other groups' in one pass)."""
        self.received = [False] * len(self.params)
        self.land_host_grads()  # a copy in flight must not land in the next step's shard
        if self.shard is not None and zero_tensor:
            self.shard.zero_()
        self.shard_is_zero = True
        if not self.policy.shards_optimizer_state and self.full is not None:
            self.full.zero_()
