"""One flat, sharded buffer of parameters: the storage every stage is a policy over.

[Note: views into flat buffers]
Each module parameter's ``.data`` is a view into its group's full flat buffer, and each ``.grad``
is a view into a flat gradient buffer of the same layout, so autograd accumulates gradients
exactly where the reduce-scatter reads them and the optimizer's all-gather writes parameters
exactly where the module reads them: no copies. Freeing a full buffer empties its *storage*
and allocating gives it memory back (from the engine's pool, [Note: the buffer pool]); the
tensor objects, and so every view, every autograd saved tensor and every ``.grad`` binding, stay
valid. Module code never sees the sharding.

[Note: master aliasing]
Master weights are fp32. When the compute dtype is fp32 too, the master shard *is* the compute
shard (a view for stages 0-2, the shard tensor for stage 3): the optimizer updates the parameters
in place and no second fp32 copy exists. With 16-bit compute the master is a separate fp32 shard
and the optimizer writes the 16-bit compute copy in the same pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from hf_zero.comm import Communicator, Handle
from hf_zero.engine.buffer_pool import BufferPool, allocate_storage, free_storage, storage_bytes
from hf_zero.engine.grad_average import plan_average, post_divisor
from hf_zero.engine.param_source import ParamSource
from hf_zero.engine.param_usage import shard_segments
from hf_zero.engine.policy import ShardingPolicy
from hf_zero.engine.sharded_param import mark_gathered, mark_sharded
from hf_zero.execution import execution_for
from hf_zero.offload import NvmeShard, OffloadSettings
from hf_zero.offload.shard_store import DeviceShard, HostShard, ShardStore
from hf_zero.transfer import is_host_store, to_host
from hf_zero.partition import FlatLayout, build_flat_layout

if TYPE_CHECKING:  # unit.py builds the groups: imports this module
    from hf_zero.engine.unit import ZeroUnit
    from hf_zero.offload import NvmeOptimizerStore


@dataclass
class PendingReduce:
    """A gradient reduction in flight: its handle, where the result lands, and the input the
    collective still reads (kept alive until :meth:`FlatParamGroup.finish_reduce`)."""

    handle: Handle | None
    received: torch.Tensor
    send: torch.Tensor


@dataclass(frozen=True)
class GroupKind:
    """What decides how a group of parameters is handled."""

    trainable: bool
    persistent: bool  # with policy.shards_params only: stays gathered between steps
    param_group_index: int  # the optimizer param group it steps in


class FlatParamGroup:
    """The parameters of one unit that share a :class:`GroupKind`, in one padded flat buffer
    split into ``world_size`` equal shards (rank r owns shard r).

    What it shards is its :class:`ShardingPolicy`'s ([Note: sharding policy]): without
    ``shards_optimizer_state`` (stage 0) it keeps everything full and all-reduces gradients; with
    it, it owns one shard of the optimizer state (``shards_gradients``: of the gradients too);
    with ``shards_params`` (stage 3) a group that is not persistent also keeps only its parameter
    shard outside :meth:`unshard` / :meth:`reshard` (:attr:`sharded_between_uses`).
    """

    def __init__(
        self,
        label: str,
        named_params: list[tuple[str, nn.Parameter]],
        kind: GroupKind,
        comm: Communicator,
        policy: ShardingPolicy,
        compute_dtype: torch.dtype,
        device: torch.device,
        source: ParamSource | None = None,
        offload: OffloadSettings = OffloadSettings(),
        buffers: BufferPool | None = None,
        *,
        owner: ZeroUnit | None = None,
    ) -> None:
        self.label = label
        # The memory of the full buffers that come and go ([Note: the buffer pool]).
        self.buffers = buffers if buffers is not None else BufferPool(device)
        self.owner = owner  # the ZeroUnit this group belongs to (the unit building it)
        self.offload = offload
        self.kind = kind
        self.comm = comm
        self.policy = policy
        self.params = [p for _, p in named_params]
        shard_world = comm.world_size if policy.shards_optimizer_state else 1
        persistent = policy.shards_params and kind.persistent  # padded less: [Note: alignment in flat buffers]
        self.layout: FlatLayout = build_flat_layout(named_params, shard_world, persistent)
        # This group's parameters are only a shard outside use (gathered around it, then freed):
        # the policy shards parameters and the group is not persistent.
        self.sharded_between_uses = policy.shards_params and not kind.persistent
        if self.sharded_between_uses:
            self.buffers.register(self.layout.padded_numel * compute_dtype.itemsize, self)
        lo, hi = self.shard_range
        lazy = source is not None and any(p.is_meta for p in self.params)
        if lazy and self.sharded_between_uses:
            # Sharded loading: read only this rank's ranges; the full buffer is never touched
            # (torch.empty leaves its pages unallocated) and freed at once.
            self.full = torch.empty(self.layout.padded_numel, dtype=compute_dtype, device=device)
            shard = torch.zeros(hi - lo, dtype=compute_dtype, device=device)
            self._fill_from_source(source, shard, lo, hi)
            self._bind_param_views()
            self._free_full()
        else:
            self.full = self._flatten(compute_dtype, device, source if lazy else None)
            self._bind_param_views()
            # See [Note: views into flat buffers].
            shard = self.full[lo:hi].clone() if self.sharded_between_uses else self.full[lo:hi]
            if self.sharded_between_uses:
                self._free_full()
        # offload_param: the compute shard waits on the host between gathers (stage 3), or in a
        # file (see [Note: NVMe parameter offload] in hf_zero.offload.nvme_params).
        # See [Note: shard stores]; the device store until the master is made from it.
        self.store: ShardStore = DeviceShard(shard)
        nvme_shard: NvmeShard | None = None
        if offload.params == "nvme" and self.sharded_between_uses:
            nvme_shard = offload.param_store.register(label, shard)
        leaves_device = offload.params_on_host and self.sharded_between_uses
        self.nvme_index: int | None = None  # set when an NVMe store holds this group's state
        self.nvme_store: NvmeOptimizerStore | None = None  # that store (offload_optimizer nvme)
        self._pending_gather: Handle | None = None
        self.master: torch.Tensor | None = None
        self.grad_full: torch.Tensor | None = None
        # Stages 0-1 with 16-bit gradients: the micro-steps' sum in fp32 until the accumulation
        # boundary's reduction (see fold_grads); allocated by the first fold, freed by the reduction.
        self.grad_accum: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        # [Note: parameters no rank used] in hf_zero.engine.param_usage: per parameter, whether
        # it got a gradient on this rank since the last optimizer step, and whether some rank
        # did (set by the optimizer step, the same on every rank).
        self.grads_received = [False] * len(self.params)
        self.params_used = [True] * len(self.params)
        self.segments = shard_segments(self.layout, self.shard_range)
        if kind.trainable:
            self._init_master_and_grads(compute_dtype, device, separate_master=leaves_device)
        # The shard leaves the device after the master is made from it (the master stays on
        # the device unless the optimizer is offloaded too).
        if nvme_shard is not None:
            nvme_shard.write(shard)
            self.store = nvme_shard
        elif leaves_device:
            self.store = HostShard(shard, offload.pin_params)

    # ----------------------------------------------------------------- construction
    @property
    def shard_range(self) -> tuple[int, int]:
        rank = self.comm.rank if self.policy.shards_optimizer_state else 0
        return self.layout.shard_range(rank)

    def _flatten(self, dtype: torch.dtype, device: torch.device, source: ParamSource | None) -> torch.Tensor:
        full = torch.zeros(self.layout.padded_numel, dtype=dtype, device=device)
        if source is not None:  # every rank reads the same files: no broadcast needed
            self._fill_from_source(source, full, 0, self.layout.padded_numel)
            return full
        with torch.no_grad():
            for slot, param in zip(self.layout.slots, self.params):
                slot.view_in(full).copy_(param.detach())
        # Every rank must start from the same weights, whatever its seed was.
        self.comm.broadcast_(full, src=0, label=f"{self.label}.init")
        return full

    def _fill_from_source(self, source: ParamSource, out: torch.Tensor, lo: int, hi: int) -> None:
        """Elements [lo, hi) of the flat buffer, read parameter by parameter from ``source``
        (a parameter that is already real, such as a resized embedding, gives its own values)."""
        for slot, param in zip(self.layout.slots, self.params):
            start, stop = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if start >= stop:
                continue
            if param.is_meta:
                source.fill_(slot.name, slot.shape, start - slot.offset, stop - slot.offset,
                             out[start - lo : stop - lo])
            else:
                out[start - lo : stop - lo].copy_(param.detach().reshape(-1)[start - slot.offset : stop - slot.offset])

    def _bind_param_views(self) -> None:
        for slot, param in zip(self.layout.slots, self.params):
            view = slot.view_in(self.full)
            if param.is_meta:
                # .data cannot move a tensor off the meta device; swapping keeps the Parameter
                # object (tied weights, optimizer param groups). Swap in an empty one and then
                # assign .data like the eager path: a Parameter built on the view would share
                # the flat buffer's version counter, and the stage-3 re-gather before backward
                # (an in-place write) would then fail autograd's saved-tensor check.
                empty = torch.empty(0, dtype=view.dtype, device=view.device)
                torch.utils.swap_tensors(param, nn.Parameter(empty, requires_grad=param.requires_grad))
            param.data = view
            param._hf_zero_name = slot.name  # named in errors ([Note: parameters read outside their unit])

    @property
    def shard(self) -> torch.Tensor:
        """This rank's compute shard as its store holds it (an empty placeholder for a file)."""
        return self.store.tensor

    @property
    def shard_on_host(self) -> bool:
        """The compute shard leaves the device between gathers (host memory or a file)."""
        return self.store.location != "device"

    @property
    def nvme_shard(self) -> NvmeShard | None:
        return self.store if self.store.location == "nvme" else None  # type: ignore[return-value]

    def _init_master_and_grads(self, compute_dtype: torch.dtype, device: torch.device,
                               separate_master: bool) -> None:
        # See [Note: master aliasing]. Offloaded, the master is always a separate fp32 copy on
        # the host (cpu) or a placeholder whose values live in files (nvme).
        if self.offload.optimizer == "nvme":
            self.master = torch.zeros(0, dtype=torch.float32)
        elif self.offload.optimizer == "cpu":
            self.master = to_host(self.shard.to(torch.float32, copy=True), self.offload.pin_memory)
        elif separate_master:
            # offload_param alone: the compute shard leaves the device, the master stays on it.
            self.master = self.shard.to(torch.float32, copy=True)
        else:
            self.master = self.shard if compute_dtype == torch.float32 else self.shard.float()
        if not self.policy.shards_optimizer_state:  # all-reduced in place, kept for the run
            self.grad_full = torch.zeros(self.layout.padded_numel, dtype=compute_dtype, device=device)
        else:
            # Freed at once below, so never written: zeroing it would make every page resident
            # and, through the host allocator, keep a full unit's bytes per group after the load
            # (prepare_grads zeroes it when a backward first needs it).
            self.grad_full = torch.empty(self.layout.padded_numel, dtype=compute_dtype, device=device)
            self.buffers.register(storage_bytes(self.grad_full), self)
        if not self.policy.shards_optimizer_state and compute_dtype == torch.float32:
            self.grad_shard = self.grad_full  # all-reduced in place, already fp32
            self.master.grad = self.grad_shard
        if self.policy.shards_optimizer_state:
            self.release_grads()
        # Otherwise the fp32 gradient shard is allocated by the first reduction: right after
        # initialize a rank holds its parameter shards and nothing else (see sharded loading).

    def _ensure_grad_shard(self) -> torch.Tensor:
        if self.grad_shard is None:
            if self.master is None:
                raise RuntimeError(f"{self.label} is frozen: it has no fp32 master to give a gradient shard")
            host = self.offload.optimizer_on_host
            self.grad_shard = torch.zeros(self.layout.shard_numel, dtype=torch.float32,
                                          device="cpu" if host else self.full.device)
            if host:
                self.grad_shard = to_host(self.grad_shard, self.offload.pin_memory)
            if self.master.numel() == self.grad_shard.numel():
                self.master.grad = self.grad_shard
        return self.grad_shard

    # ----------------------------------------------------------------- parameters
    @property
    def is_unsharded(self) -> bool:
        return storage_bytes(self.full) > 0 and self._pending_gather is None

    def unshard(self, async_op: bool = False) -> None:
        """Gather the full parameters (stage 3). Idempotent; ``wait_unshard`` finishes an
        asynchronous gather."""
        if not self.sharded_between_uses or self._pending_gather is not None:
            return
        if not self.buffers.acquire(self.full):
            return
        shard, copied = self.store.gather_input(self.full.device, reclaim=self.wait_unshard)
        self._pending_gather = self.comm.all_gather_into(
            self.full, shard, label=self.label, async_op=async_op, after=(copied,)
        )
        if not async_op:
            self.wait_unshard()

    def wait_unshard(self) -> None:
        if self._pending_gather is not None:
            self._pending_gather.wait()
            self._pending_gather = None
            self.store.gather_done()
            # Readable only now: while a gather is in flight the parameters keep their guard, so
            # a read that no module hook waited for (a fused loss reading lm_head.weight) waits
            # for the values instead of reading the buffer's stale bytes.
            mark_gathered(self.params)

    def reshard(self) -> None:
        if self.sharded_between_uses:
            self.wait_unshard()
            self._free_full()

    def _free_full(self) -> None:
        """Free the full buffer; its parameters raise a clear error if read until the next gather
        ([Note: parameters read outside their unit])."""
        self.buffers.release(self.full)
        mark_sharded(self.params)

    def gather_updated_shards(self) -> None:
        """After the optimizer step, bring every rank's updated shard into the full buffer
        (stages 1-2, and persistent stage-3 groups); sharded stage-3 groups gather lazily."""
        if not self.policy.shards_optimizer_state or self.sharded_between_uses:
            return
        lo, hi = self.shard_range
        self.comm.all_gather_into(self.full, self.full[lo:hi], label=f"{self.label}.step")

    def refresh_from_full(self) -> None:
        """The full buffer was changed from outside (``gathered_parameters`` with a modifier):
        make the shard and the master agree with it."""
        lo, hi = self.shard_range
        if self.sharded_between_uses:
            self.write_compute_shard(self.full[lo:hi])
        if self.nvme_store is not None:
            self.nvme_store.store_master(self.nvme_index, self.full[lo:hi])
        elif self.master is not None and self.master.data_ptr() != self.shard.data_ptr():
            self.master.copy_(self.full[lo:hi])

    @property
    def master_is_compute_shard(self) -> bool:
        """fp32 compute without a separate master (see [Note: master aliasing])."""
        return (self.master is not None and self.nvme_store is None and self.nvme_shard is None
                and self.master.data_ptr() == self.shard.data_ptr())

    def read_master(self) -> torch.Tensor | None:
        """The fp32 master shard, read from the optimizer's NVMe files when they hold it."""
        if self.nvme_store is not None:
            return self.nvme_store.read(self.nvme_index, "master", 0, self.layout.shard_numel)
        return self.master

    def write_master(self, values: torch.Tensor) -> None:
        """Replace the fp32 master shard (in the optimizer's NVMe files when they hold it)."""
        if self.nvme_store is not None:
            self.nvme_store.store_master(self.nvme_index, values)
        elif self.master is not None and self.master.data_ptr() != values.data_ptr():
            self.master.copy_(values)

    def write_compute_shard(self, values: torch.Tensor, start: int = 0) -> None:
        """New values for elements [start, start + values.numel()) of this rank's compute shard
        (the optimizer's update, a loaded checkpoint): into ``shard``, or into its file under
        NVMe parameter offload."""
        self.store.write(values, start)

    def read_compute_shard(self) -> torch.Tensor:
        """This rank's compute shard (read from its file, into a new tensor, under NVMe parameter
        offload)."""
        return self.store.read()

    # ----------------------------------------------------------------- gradients
    # [Note: a gradient autograd hands over]
    # A stage-3 group's full gradient is a flat buffer that the ``.grad`` views point into, so
    # autograd accumulates each parameter's gradient into it. For a parameter alone in its group
    # and filling it exactly (an embedding, an untied head: the largest buffers of a decoder), the
    # buffer would be a second copy of the tensor autograd makes anyway: the buffer, zeroed before
    # the backward, plus autograd's gradient, added into it, held 3 x 1002 MiB per rank at the
    # Llama-3-8B head's backward (parameters, buffer, autograd's gradient). Such a group gets no
    # buffer before its backward: autograd's gradient becomes ``.grad`` itself, and at the
    # reduction its memory moves into the flat buffer's storage object
    # (``UntypedStorage._swap_data_ptr_``; the object, which views and the pool know, stays), so
    # the reduction reads it where autograd wrote it. A gradient that does not fit (another dtype,
    # not contiguous, a second micro-step's sum already in the buffer) takes the usual path.
    @property
    def adopts_autograd_grad(self) -> bool:
        """[Note: a gradient autograd hands over]: this group's flat gradient can be the tensor
        autograd made for its one parameter."""
        slot = self.layout.slots[0] if len(self.layout.slots) == 1 else None
        return (self.policy.shards_params and slot is not None and slot.offset == 0 and slot.numel == self.layout.padded_numel
                and hasattr(torch.UntypedStorage, "_swap_data_ptr_"))

    def prepare_grads(self, for_backward: bool = False) -> None:
        """Before this group's backward (``for_backward``) or its reduction: make sure the flat
        gradient buffer exists (fresh ones are zeroed; an accumulating one is kept) and that each
        ``.grad`` is a view into it. A group that adopts autograd's gradient gets no buffer
        before its backward ([Note: a gradient autograd hands over])."""
        if self.grad_full is None:
            return
        if not self.has_grads() and self.adopts_autograd_grad:
            if for_backward or self._adopt_autograd_grad():
                return
        if self.buffers.acquire(self.grad_full):
            self.grad_full.zero_()
        for slot, param in zip(self.layout.slots, self.params):
            view = slot.view_in(self.grad_full)
            grad = param.grad
            if grad is None or grad.data_ptr() != view.data_ptr():
                if grad is not None:  # produced outside our buffer (see collect_stray_grads)
                    view.add_(grad.to(view.dtype))
                param.grad = view

    def _adopt_autograd_grad(self) -> bool:
        """Make the parameter's own ``.grad`` tensor (autograd's, not a view into the buffer) the
        flat gradient buffer's memory. Returns whether it did."""
        param, slot = self.params[0], self.layout.slots[0]
        grad = param.grad
        needed = self.grad_full.numel() * self.grad_full.element_size()
        if (grad is None or grad.dtype != self.grad_full.dtype or grad.device != self.grad_full.device
                or not grad.is_contiguous() or grad.storage_offset() != 0 or storage_bytes(grad) != needed):
            return False
        # The buffer's storage object stays (views and the pool know it); the memory changes hands.
        self.grad_full.untyped_storage()._swap_data_ptr_(grad.untyped_storage())
        param.grad = slot.view_in(self.grad_full)
        return True

    @property
    def grad_bytes(self) -> int:
        """The bytes of the full gradient buffer while it exists (0 for a frozen group)."""
        return 0 if self.grad_full is None else self.grad_full.numel() * self.grad_full.element_size()

    def has_grads(self) -> bool:
        return self.grad_full is not None and storage_bytes(self.grad_full) > 0

    def fold_grads(self, accum_dtype: torch.dtype) -> None:
        """End of a micro-step before the accumulation boundary (stages 0-1): add the 16-bit
        full gradients into a fp32 buffer and zero them, so that a long accumulation sums in
        fp32 as DeepSpeed's bf16 optimizer does (``data_types.grad_accum_dtype``; the next
        micro-step's ``.grad`` then holds that micro-step only)."""
        if self.grad_full is None or self.grad_full.dtype == accum_dtype:
            return
        # Every trainable group folds, with or without gradients: a bucket packs groups of one dtype.
        if self.grad_accum is None:
            self.grad_accum = torch.zeros(self.layout.padded_numel, dtype=accum_dtype, device=self.grad_full.device)
        elif allocate_storage(self.grad_accum):
            self.grad_accum.zero_()
        if self.has_grads():
            self.grad_accum.add_(self.grad_full)
            self.grad_full.zero_()

    def grads_to_reduce(self) -> torch.Tensor:
        """The full gradients a reduction sends: the buffer autograd wrote, or with it the fp32
        sum of the earlier micro-steps (see :meth:`fold_grads`)."""
        if self.grad_accum is not None and storage_bytes(self.grad_accum) > 0:
            return self.grad_accum.add_(self.grad_full)
        return self.grad_full

    def start_reduce(self, reduce_dtype: torch.dtype, async_op: bool) -> PendingReduce | None:
        """Issue the gradient reduction; :meth:`finish_reduce` waits for it and accumulates.
        Until then the full gradient buffer is the collective's input and must stay alive. The
        division by the world size happens where [Note: averaging gradients over ranks] says."""
        if self.grad_full is None:
            return None
        self._ensure_grad_shard()
        self.prepare_grads()  # allocates zeros if this group got no gradient this backward
        source = self.grads_to_reduce()
        send = source if source.dtype == reduce_dtype else source.to(reduce_dtype)
        average = plan_average(reduce_dtype, self.comm, send.device)
        if average.pre_divisor > 1:
            send.div_(average.pre_divisor)
        if not self.policy.shards_optimizer_state:
            handle = self.comm.all_reduce_into(send, label=self.label, op=average.op, async_op=async_op)
            return PendingReduce(handle, send, send)
        if self.reduces_into_pool:  # [Note: the buffer pool]
            received = self.buffers.take(self.layout.shard_numel, reduce_dtype)
        else:
            received = torch.empty(self.layout.shard_numel, dtype=reduce_dtype, device=send.device)
        handle = self.comm.reduce_scatter_into(received, send, label=self.label, async_op=async_op, op=average.op)
        return PendingReduce(handle, received, send)

    @property
    def reduces_into_pool(self) -> bool:
        """A reduction's output comes from the pool and goes back once added into the gradient
        shard; not when a copy to the host reads it after that ([Note: gradients copied to the
        host]), which keeps it alive itself."""
        return self.offload.grad_copies is None

    def finish_reduce(self, pending: PendingReduce) -> None:
        if pending.handle is not None:
            pending.handle.wait()
        received = pending.received
        if self.grad_shard is not None and self.grad_shard.data_ptr() != received.data_ptr():
            self.accept_reduced(received, post_divisor(received.dtype, self.comm.data_parallel_size))
        if self.policy.shards_optimizer_state:
            if self.reduces_into_pool:
                self.buffers.give_back(received)  # added into the gradient shard
            self.release_grads()
        else:
            self.drop_grad_accum()

    def accept_reduced(self, reduced: torch.Tensor, divisor: int = 1) -> None:
        """This rank's part of a finished reduction into the fp32 gradient shard."""
        if self.grad_full is not None and self.grad_shard is not None and self.grad_shard.data_ptr() == self.grad_full.data_ptr():
            # Stage 0, fp32 compute, reduced elsewhere (a bucket, a 16-bit reduction): the fp32
            # gradient buffer is the gradient shard and still holds this rank's own gradients;
            # the average replaces them.
            self.grad_shard.zero_()
        self.accumulate_grad_shard(reduced, divisor)

    def accumulate_grad_shard(self, reduced: torch.Tensor, divisor: int = 1) -> None:
        """Add this rank's reduced part of the gradients (any dtype, any device), divided by
        ``divisor`` in fp32, into the fp32 gradient shard: micro-steps of an accumulation add up
        there. ``divisor`` is what [Note: averaging gradients over ranks] left to divide. Into a
        host shard the add happens when the copy lands ([Note: gradients copied to the host])."""
        shard = self._ensure_grad_shard()
        copies = self.offload.grad_copies
        if copies is None or not is_host_store(shard) or is_host_store(reduced):
            shard.add_(reduced, alpha=1.0 / divisor)
            return
        staging, copied = execution_for(reduced.device).stage_to_host(
            reduced, self.offload.pin_memory, f"{self.label} gradients to the host")
        copies.push(self, staging, copied, divisor)

    def land_host_grads(self) -> None:
        """The host reads this group's gradient shard next: its copies in flight land first."""
        if self.offload.grad_copies is not None:
            self.offload.grad_copies.land(self)

    def drop_grad_accum(self) -> None:
        """The fp32 sum of the micro-steps went into a reduction: the next window starts at zero."""
        if self.grad_accum is not None:
            free_storage(self.grad_accum)

    def release_grads(self) -> None:
        self.drop_grad_accum()
        if self.grad_full is None:
            return
        for param in self.params:
            param.grad = None
        self.buffers.release(self.grad_full)

    @property
    def grad_received(self) -> bool:
        """Some parameter of the group got a gradient on this rank since the last step."""
        return any(self.grads_received)

    @property
    def fully_received(self) -> bool:
        """Every parameter of the group got a gradient on this rank: all are used, whatever
        the other ranks did."""
        return all(self.grads_received)

    @property
    def used_in_step(self) -> bool:
        """Some rank used some parameter of the group in this step: it is stepped."""
        return any(self.params_used)

    def zero_grad_shard(self) -> None:
        self.grads_received = [False] * len(self.params)
        self.land_host_grads()  # a copy in flight must not land in the next step's shard
        if self.grad_shard is not None:
            self.grad_shard.zero_()
        if not self.policy.shards_optimizer_state and self.grad_full is not None:
            self.grad_full.zero_()

    # ----------------------------------------------------------------- reporting
    def owned_numel(self) -> int:
        """Real (unpadded) parameter elements inside this rank's shard."""
        lo, hi = self.shard_range
        return max(0, min(hi, self.layout.numel) - lo)
