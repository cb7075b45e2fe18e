"""Reduce-scatter and all-gather on gloo as one exchange of chunks.

[Note: reduce-scatter on gloo]
torch's gloo backend runs a reduce-scatter as an all-reduce of the whole input (after copying it
into a scratch buffer) and keeps the caller's chunk: each rank sends and receives twice the
bytes a reduce-scatter needs. On gloo, hf_zero instead sends chunk j of its input to rank j and
receives every peer's copy of its own chunk, all point-to-point and posted at once, then adds
them to its own in rank order: (N-1)/N of the input goes out and comes in, as in a ring
reduce-scatter. The lowest-ranked peer's chunk is received straight into the output, so the only
extra memory is N-2 received chunks (none between 2 ranks). One 3.3M-element fp32
reduce-scatter between 2 CPU ranks took 16-20 ms through torch's and 5.5-6.7 ms as an exchange.

Gloo matches the messages between two ranks in the order they were posted, and every rank
issues the gradient group's reductions in the same order ([Note: two process groups] in
collectives.py), so exchanges in flight at once cannot take each other's chunks (tested with
three in flight, waited in reverse). Only the owner of a chunk holds its sum, so the order of
the additions needs no agreement between ranks. NCCL and other backends keep their native
reduce-scatter.

The output may alias the input's chunk of this rank (an in-place reduce-scatter, as
``dist.reduce_scatter_tensor`` allows): a peer's chunk is received into the output, which would
overwrite this rank's own chunk before it is added. The chunk is then copied first, one chunk of
extra memory and only when they overlap; the sum, and its order, are those of the non-aliased
call.

[Note: all-gather on gloo]
torch's gloo all-gather receives into a scratch buffer the size of the whole output, allocated
on gloo's worker thread for every call, and then copies it into the caller's output chunk by
chunk: one more pass over every gathered byte, and a unit-sized block in a heap the engine does
not own ([Note: the buffer pool] in hf_zero.engine.sharding.buffer_pool). Stage 3 gathers every unit once
per step and stages 1-2 gather the updated shards, so on gloo hf_zero exchanges instead: each rank
sends its shard to every peer and receives each peer's shard straight into that peer's chunk of
the output, all posted at once. The bytes on the wire are a ring all-gather's ((N-1) shards out
and in); nothing is allocated and nothing copied, except this rank's own shard into its chunk
when it is not already there (an in-place gather passes the chunk itself). One 3.1M-element fp32
all-gather between 2 CPU ranks took 15.4 ms through torch's and 8.1 ms as an exchange (12M:
80 vs 26 ms). Several gathers may be in flight (prefetch): gloo matches them in posting order,
which is the same on every rank, as for the reduce-scatter above.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _Exchange:
    """Point-to-point messages in flight, all posted at once; :meth:`wait` waits for them and
    then runs :meth:`_finish` (once)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self._group = group
        self._works: list[dist.Work] = []
        self._done = False

    def _post(self, peer: int, receive_into: torch.Tensor, send: torch.Tensor) -> None:
        """Receive ``receive_into`` from ``peer`` (a rank of the group) and send it ``send``."""
        group = self._group
        global_peer = dist.get_global_rank(group, peer) if group is not None else peer
        self._works.append(dist.irecv(receive_into, src=global_peer, group=group))
        self._works.append(dist.isend(send, dst=global_peer, group=group))

    def is_completed(self) -> bool:
        return self._done or all(w.is_completed() for w in self._works)

    def wait(self) -> None:
        if self._done:
            return
        for work in self._works:
            work.wait()
        self._finish()
        self._done = True

    def _finish(self) -> None:
        """What the received messages still need once they are in."""


class ExchangeReduceScatter(_Exchange):
    """A reduce-scatter in flight as point-to-point sends and receives; :meth:`wait` sums.

    The chunk of the lowest-ranked peer is received straight into the output; the other peers'
    go into one scratch row each (none between 2 ranks). The sum is the same, bit for bit, as
    adding every rank's chunk in rank order: the output's first addition adds this rank's
    chunk to it or it to the second (a + b is b + a exactly), and the rest follow in order."""

    def __init__(self, shard: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup | None) -> None:
        super().__init__(group)
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        chunks = full.view(world, -1)
        self._shard, self._rank, self._world = shard, rank, world
        # The output receives a peer's chunk: a copy of this rank's own first, if they share bytes.
        own = chunks[rank]
        self._own = own.clone() if _overlaps(own, shard) else own
        peers = [p for p in range(world) if p != rank]
        # Row i holds the chunk from the (i+1)-th peer in rank order; the first goes into the output.
        received = torch.empty((world - 2, shard.numel()), dtype=full.dtype, device=full.device)
        self._into = [shard, *received]
        for into, peer in zip(self._into, peers):
            self._post(peer, into, chunks[peer])

    def _finish(self) -> None:
        # This rank's chunk from every rank, added in rank order: the same order on every run.
        received = iter(self._into)
        ordered = [self._own if r == self._rank else next(received) for r in range(self._world)]
        # ordered[0] or ordered[1] is the output (the lowest-ranked peer's chunk): their sum into it.
        first, second = ordered[0], ordered[1]
        self._shard.add_(second if first is self._shard else first)
        for part in ordered[2:]:
            self._shard.add_(part)


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share any byte of memory."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a_lo, b_lo = a.data_ptr(), b.data_ptr()
    return a_lo < b_lo + b.numel() * b.element_size() and b_lo < a_lo + a.numel() * a.element_size()


class ExchangeAllGather(_Exchange):
    """An all-gather in flight as point-to-point sends and receives ([Note: all-gather on gloo])."""

    def __init__(self, output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None) -> None:
        super().__init__(group)
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        chunks = output.view(world, -1)
        for peer in range(world):
            if peer != rank:
                self._post(peer, chunks[peer], shard)
        if chunks[rank].data_ptr() != shard.data_ptr():
            chunks[rank].copy_(shard)
