"""A flat group's parameter storage: the full flat buffer, the parameters' views into it, this
rank's compute shard (in its store), and the gather and free around each use.

[Note: views into flat buffers]
Each module parameter's ``.data`` is a view into its group's full flat buffer, and each ``.grad``
is a view into a flat gradient buffer of the same layout, so autograd accumulates gradients
exactly where the reduce-scatter reads them and the optimizer's all-gather writes parameters
exactly where the module reads them: no copies. Freeing a full buffer empties its *storage*
and allocating gives it memory back (from the engine's pool, [Note: the buffer pool]); the
tensor objects, and so every view, every autograd saved tensor and every ``.grad`` binding, stay
valid. Module code never sees the sharding.

[Note: the shard lent to the gathered buffer]
While a stage-3 group is gathered, this rank's chunk of its full buffer holds exactly the values
of this rank's shard: the all-gather runs in place from that chunk. Keeping the shard's own
memory as well would hold the group's parameters at (1 + 1/N)x their size for as long as it is
gathered, and under the recipe's reuse distance (``stage3_max_reuse_distance: 1e9``, which keeps
every unit gathered from its forward to its backward, as DeepSpeed does) that is a whole shard of
the model at the step's peak: 268 MB per rank of a 134M model at 2 ranks, as much as its
gradient shard. So the shard is *lent* to its chunk: when the gather completes, the shard
tensor's storage is emptied (the tensor object stays: the master and the optimizer hold it), and
when the group is freed the storage gets memory again and the chunk's values are copied back,
before the full buffer goes. Reads and writes of the shard meanwhile (a checkpoint, a
``gathered_parameters`` modifier) reach the chunk. Only a shard on the compute device in the
compute dtype is lent, and not under ``offload_optimizer``: its step writes the shards from a
worker thread while the backward runs ([Note: overlapped offload step]).

[Note: secondary shards]
With ``zero_hpz_partition_size`` P (DeepSpeed ZeRO++'s hpZ) a gather over the whole shard group
leaves, besides the full buffer, a *secondary shard*: this rank's 1/P of the gathered buffer,
split over the P ranks of its node group ([Note: node groups for hpZ] in hf_zero.comm.collectives),
kept after the buffer is freed. Every later gather while the shards do not change (the
backward's, a recomputed forward's, the next micro-step's forward) is an all-gather of the
secondary shards over those P ranks only, so it never leaves the node. A secondary shard holds
what that gather received: the compute dtype, or, where the gather came over a narrower wire,
the wire's payloads of its 1/P (the int8 blocks of [Note: quantized weight gathers] at 1 + 4/512
bytes an element, as DeepSpeed's hpZ with qwZ), decoded after the node gather as after the first
one. So the backward sees, bit for bit, the weights the forward saw, and with qwZ the secondary
costs half the memory and the node gathers half the bytes; an exact gather does not use a
rounded secondary. Anything that changes the shards drops it first: the optimizer
step (before which every unit is freed), ``write_shard`` (a loaded checkpoint, a modifier), and
the next gather over the shard group makes it again. It costs 1/P of the group at the wire's
width per rank for as long as it lives (``memory_report()['secondary_params']``); only a shard
kept on the device has one (offload_param refuses the key: it would put back on the device what
the offload takes off).
"""

from __future__ import annotations

import enum

import torch
from torch import nn

from hf_zero.comm import Communicator, Handle
from hf_zero.engine.sharding.buffer_pool import BufferPool
from hf_zero.engine.sharding.gather_wire import GatherWire
from hf_zero.engine.sharding.param_source import ParamSource
from hf_zero.engine.sharding.sharded_param import mark_gathered, mark_sharded
from hf_zero.host_memory import CAN_SWAP_STORAGE, lasting_zeros
from hf_zero.offload import NvmeShard, OffloadSettings
from hf_zero.offload.shard_store import DeviceShard, HostShard, ShardStore
from hf_zero.partition import FlatLayout


class StorageState(enum.Enum):
    """Where a group's parameter values are readable. A group that is not
    :attr:`ParamStorage.sharded_between_uses` is ``GATHERED`` for its whole life."""

    SHARDED = "sharded"  # only this rank's shard, in its store; the full buffer has no memory
    GATHERING = "gathering"  # an all-gather into the full buffer is in flight
    GATHERED = "gathered"  # the full buffer holds every rank's values


class ParamStorage:
    """The full flat buffer of one group's parameters, its views, and this rank's compute shard.

    ``state`` says what the full buffer holds ([Note: views into flat buffers]): :meth:`unshard`
    (idempotent) starts a gather from ``SHARDED``, :meth:`wait_unshard` finishes it, and
    :meth:`reshard` frees the buffer again; the checked steps under them are
    :meth:`start_gather`, :meth:`finish_gather` and :meth:`free`.
    """

    def __init__(
        self,
        label: str,
        params: list[nn.Parameter],
        layout: FlatLayout,
        shard_range: tuple[int, int],
        comm: Communicator,
        sharded_between_uses: bool,
        compute_dtype: torch.dtype,
        device: torch.device,
        source: ParamSource | None,
        buffers: BufferPool,
        pool_user: object,
        lend_shard: bool = False,
        wire: GatherWire | None = None,
    ) -> None:
        """``lend_shard``: lend the compute shard to the full buffer while gathered ([Note: the
        shard lent to the gathered buffer]), where the store allows it. ``wire``: what a gather
        sends in place of the compute-dtype shard (hf_zero.engine.sharding.gather_wire: a
        narrower dtype, [Note: lower-precision-safe modules], or int8 blocks, [Note: quantized
        weight gathers]); such a shard is never lent."""
        self.label = label
        self.params = params
        self.layout = layout
        self.comm = comm
        self.buffers = buffers
        # This group's parameters are only a shard outside use (gathered around it, then freed):
        # the policy shards parameters and the group is not persistent.
        self.sharded_between_uses = sharded_between_uses
        if sharded_between_uses:
            buffers.register(layout.padded_numel * compute_dtype.itemsize, pool_user)
        self._pending_gather: Handle | None = None
        self.state = StorageState.GATHERED
        self.shard_range = shard_range
        self.wire = wire if sharded_between_uses else None
        self._lend_shard = lend_shard and sharded_between_uses and self.wire is None
        self._received: torch.Tensor | None = None  # a gather's wire payloads, until they are decoded
        self.rounded = False  # the full buffer holds values that came over the wire rounded
        # [Note: secondary shards]: kept after a gather over the shard group, with whether its
        # values came over the wire rounded; None while there is none.
        self._keeps_secondary = sharded_between_uses and comm.node_size > 1
        self.secondary: torch.Tensor | None = None
        # Its values came over the wire rounded, and so it holds the wire's payloads, not values.
        self._secondary_rounded = False
        lo, hi = shard_range
        lazy = source is not None and any(p.is_meta for p in params)
        if lazy and sharded_between_uses:
            # Sharded loading: read only this rank's ranges; the full buffer is never touched
            # (torch.empty leaves its pages unallocated) and freed at once.
            self.full = torch.empty(layout.padded_numel, dtype=compute_dtype, device=device)
            shard = lasting_zeros(hi - lo, compute_dtype, device)  # [Note: memory kept for the run]
            self._fill_from_source(source, shard, lo, hi)
            self._bind_param_views()
        else:
            self.full = self._flatten(compute_dtype, device, source if lazy else None)
            self._bind_param_views()
            # See [Note: views into flat buffers].
            shard = self.full[lo:hi]
            if sharded_between_uses:  # its own memory, kept for the run: [Note: memory kept for the run]
                shard = lasting_zeros(hi - lo, compute_dtype, device).copy_(shard)
        # See [Note: shard stores]; the device store until the master is made from it
        # (:meth:`leave_device`).
        self.store: ShardStore = DeviceShard(shard)
        if sharded_between_uses:
            self.free()

    # ----------------------------------------------------------------- construction
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

    def leave_device(self, offload: OffloadSettings) -> None:
        """offload_param: the compute shard waits on the host between gathers (stage 3), or in a
        file (see [Note: NVMe parameter offload] in hf_zero.offload.nvme_params). Called once the
        master is made from the device shard (the master stays on the device unless the
        optimizer is offloaded too)."""
        if not self.sharded_between_uses:
            return
        shard = self.store.tensor
        nvme_shard: NvmeShard | None = None
        if offload.params == "nvme":
            nvme_shard = offload.param_store.register(self.label, shard)
        if nvme_shard is not None:
            nvme_shard.write(shard)
            self.store = nvme_shard
        elif offload.params_on_host:
            self.store = HostShard(shard, offload.pin_params)

    # ----------------------------------------------------------------- the compute shard
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

    def write_shard(self, values: torch.Tensor, start: int = 0) -> None:
        """New values for elements [start, start + values.numel()) of this rank's compute shard
        (the optimizer's update, a loaded checkpoint): into ``shard``, or into its file under
        NVMe parameter offload."""
        self.drop_secondary()
        self.store.write(values, start)

    def drop_secondary(self) -> None:
        """The shards are about to change: the next gather goes over the shard group ([Note:
        secondary shards])."""
        self.secondary = None

    @property
    def lends_shard(self) -> bool:
        """[Note: the shard lent to the gathered buffer] applies: a device shard in the compute
        dtype (not one that waits on the host or in a file between gathers)."""
        store = self.store
        return (self._lend_shard and isinstance(store, DeviceShard) and store.tensor.dtype == self.full.dtype
                and store.tensor.device == self.full.device and CAN_SWAP_STORAGE)

    def _own_chunk(self) -> torch.Tensor:
        lo, hi = self.shard_range
        return self.full[lo:hi]

    def read_shard(self) -> torch.Tensor:
        """This rank's compute shard (read from its file, into a new tensor, under NVMe parameter
        offload)."""
        return self.store.read()

    # ----------------------------------------------------------------- gather and free
    @property
    def is_unsharded(self) -> bool:
        return self.state is StorageState.GATHERED

    def unshard(self, async_op: bool = False, exact: bool = False) -> None:
        """Gather the full parameters (stage 3). Idempotent; ``wait_unshard`` finishes an
        asynchronous gather. ``exact``: in the compute dtype, whatever ``wire`` says."""
        if self.sharded_between_uses and self.state is StorageState.SHARDED:
            self.start_gather(async_op, exact)
            if not async_op:
                self.wait_unshard()

    def wait_unshard(self) -> None:
        if self.state is StorageState.GATHERING:
            self.finish_gather()

    def reshard(self) -> None:
        if self.sharded_between_uses:
            self.wait_unshard()
            if self.state is StorageState.GATHERED:
                self.free()

    def start_gather(self, async_op: bool, exact: bool = False) -> None:
        """SHARDED -> GATHERING: the full buffer gets memory and the all-gather into it starts."""
        self._expect(StorageState.SHARDED, "start a gather")
        if not self.buffers.acquire(self.full):
            raise RuntimeError(f"{self.label}: its storage is {self.state.value} but the full buffer already "
                               "has memory; only ParamStorage.free() may take it away")
        if self.secondary is not None and not (exact and self._secondary_rounded):
            # Inside the node, from the secondary shards ([Note: secondary shards]).
            self.state = StorageState.GATHERING
            self.rounded = self._secondary_rounded
            target = self.full
            if self._secondary_rounded:
                self._received = target = self.wire.receive_buffer(self.full)  # type: ignore[union-attr]
            self._pending_gather = self.comm.all_gather_into(target, self.secondary, label=f"{self.label}.node",
                                                             async_op=async_op, within_node=True)
            return
        shard, copied = self.store.gather_input(self.full.device, reclaim=self.wait_unshard)
        if self.wire is not None and not exact:
            # The shard goes out encoded, and finish_gather decodes what arrives into the full
            # buffer ([Note: lower-precision-safe modules], [Note: quantized weight gathers]).
            copied.wait()
            send = self.wire.encode(shard)
            self._received = self.wire.receive_buffer(self.full)
            self.state = StorageState.GATHERING
            self.rounded = True
            self._pending_gather = self.comm.all_gather_into(self._received, send, label=self.label,
                                                             async_op=async_op)
            return
        self.rounded = False
        if self.lends_shard:
            # In place from this rank's chunk, which then holds the lent shard's values
            # ([Note: the shard lent to the gathered buffer]), whatever the backend writes there.
            chunk = self._own_chunk()
            chunk.copy_(shard)
            shard = chunk
        self.state = StorageState.GATHERING
        self._pending_gather = self.comm.all_gather_into(
            self.full, shard, label=self.label, async_op=async_op, after=(copied,)
        )

    def finish_gather(self) -> None:
        """GATHERING -> GATHERED: wait for the all-gather."""
        self._expect(StorageState.GATHERING, "finish a gather")
        if self._pending_gather is not None:
            self._pending_gather.wait()
        self._pending_gather = None
        received, self._received = self._received, None
        if received is not None:
            self.wire.decode(received, self.full)  # type: ignore[union-attr]
        self.state = StorageState.GATHERED
        self.store.gather_done()
        if self._keeps_secondary and self.secondary is None and isinstance(self.store, DeviceShard):
            # What came over the wire, where it came encoded: the same values at its width.
            kept = self.full if received is None else received
            self.secondary = kept.view(self.comm.node_size, -1)[self.comm.node_rank].clone()
            self._secondary_rounded = received is not None  # == self.rounded
        if self.lends_shard:
            self.store.lend(self._own_chunk())  # type: ignore[attr-defined]
        # Readable only now: while a gather is in flight the parameters keep their guard, so
        # a read that no module hook waited for (a fused loss reading lm_head.weight) waits
        # for the values instead of reading the buffer's stale bytes.
        mark_gathered(self.params)

    def make_exact(self) -> None:
        """A gathered buffer that holds values rounded on the wire gets every rank's exact values
        (one all-gather in the compute dtype); otherwise nothing happens."""
        if not self.rounded or self.state is not StorageState.GATHERED:
            return
        shard, copied = self.store.gather_input(self.full.device, reclaim=lambda: None)
        self.comm.all_gather_into(self.full, shard, label=f"{self.label}.exact", after=(copied,))
        self.store.gather_done()
        self.rounded = False

    def free(self) -> None:
        """GATHERED -> SHARDED: free the full buffer; its parameters raise a clear error if read
        until the next gather ([Note: parameters read outside their unit])."""
        self._expect(StorageState.GATHERED, "free the full buffer")
        if isinstance(self.store, DeviceShard) and self.store.lent:
            self.store.take_back()  # before the buffer that holds its values goes
        self.buffers.release(self.full)
        self.state = StorageState.SHARDED
        mark_sharded(self.params)

    def gather_updated_shards(self, shard_range: tuple[int, int]) -> None:
        """After the optimizer step, bring every rank's updated shard into the full buffer
        (stages 1-2, and persistent stage-3 groups); sharded stage-3 groups gather lazily."""
        self._expect(StorageState.GATHERED, "gather the updated shards into the full buffer")
        lo, hi = shard_range
        self.comm.all_gather_into(self.full, self.full[lo:hi], label=f"{self.label}.step")

    def _expect(self, state: StorageState, action: str) -> None:
        if self.state is not state:
            raise RuntimeError(
                f"{self.label}: cannot {action}: its parameter storage is {self.state.value}, expected "
                f"{state.value} (unshard() gathers, wait_unshard() finishes a gather, reshard() frees)")
