"""The gradient reduce-scatter of ZeRO++'s qgZ: 4-bit payloads, within the node first, then across.

[Note: quantized gradient reduction]
With ``zero_quantized_gradients`` every gradient reduce-scatter of N ranks, L to a node
(``LOCAL_WORLD_SIZE`` consecutive ranks, [Note: bytes between nodes] in collectives.py), is two
all-to-alls of 4-bit blocks ([Note: blockwise int4] in hf_zero.kernels.reference, payloads of
hf_zero.comm.block_wire; DeepSpeed's qgZ sends 4 bits too) instead of one collective in the
reduce dtype:

1. Inside the node: the input's N chunks (chunk r is rank r's shard) are regrouped into L rows,
   row j holding the chunks of every node's local rank j, quantized per row and exchanged over
   the node's L ranks; each rank dequantizes the L rows it receives and sums them in fp32: the
   node's partial sums of the chunks of the ranks at its own place in every node.
2. Across nodes: those N/L partial chunks, quantized again, are exchanged over the N/L ranks at
   the same place in every node; the fp32 sum of the N/L received is this rank's shard.

So only step 2 leaves the node, and it carries 1/L of the gradients at 1/2 + 4/64 bytes an
element (``QGZ_BLOCK``): at 8 x 8 ranks 7/64 of the elements cross per rank where a bf16 reduce-scatter sends
56/64 of them at 2 bytes: 0.035x. The sums are in fp32, each addend off by at most half a step of its
block (absmax / 14), rounded twice (once per step); the reduce dtype no longer matters. That is
coarse per element, but unbiased enough for Adam: the curve stays within 2% of the exact one
(tests/distributed/test_quantized_gradients.py). On one
node, or without ``LOCAL_WORLD_SIZE``, step 1 alone runs over all N ranks. The two steps run on
groups of their own (the gradient side of [Note: two process groups]), one after the other on
the calling thread: the reduction is not overlapped with the backward on gloo.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from hf_zero.comm.block_wire import BlockWire

# Elements per scale of the 4-bit codes: 1/16 byte of scale an element (0.5625 bytes in all).
# Gradients are sparser than weights (an embedding's rows a batch did not touch are 0): with
# blocks of 512 the small ones round to 0 and a GPT-2 run through the Trainer fell 4.4% behind
# the exact loss in 6 steps, with 64 0.41% (tests/integration/test_trainer_zero.py).
QGZ_BLOCK = 64

# (kind, label, payload, group): what counts each all-to-all (Communicator._count).
Count = Callable[[str, str, torch.Tensor, dist.ProcessGroup], None]


@dataclass(frozen=True)
class ReductionGroups:
    """The two groups of [Note: quantized gradient reduction] for one rank."""

    inside: dist.ProcessGroup  # the L ranks of this rank's node (all N ranks on one node)
    across: dist.ProcessGroup | None  # the N/L ranks at this rank's place in every node; None: one node
    local_size: int  # L


_GROUPS: dict[tuple[object, int], ReductionGroups] = {}


def reduction_groups(group: dist.ProcessGroup | None, key: object, local_size: int,
                     timeout_s: float | None) -> ReductionGroups:
    """Made once per (group, L) by every rank of ``group`` in one order (``new_group`` is collective)."""
    if (key, local_size) in _GROUPS:
        return _GROUPS[(key, local_size)]
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    me = dist.get_rank()
    kwargs = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    inside = across = None
    for start in range(0, len(ranks), local_size):
        made = dist.new_group(ranks=ranks[start:start + local_size], **kwargs)
        if me in ranks[start:start + local_size]:
            inside = made
    if local_size < len(ranks):
        for offset in range(local_size):
            made = dist.new_group(ranks=ranks[offset::local_size], **kwargs)
            if me in ranks[offset::local_size]:
                across = made
    assert inside is not None
    _GROUPS[(key, local_size)] = found = ReductionGroups(inside, across, local_size)
    return found


def release_groups() -> None:
    _GROUPS.clear()


def quantized_reduce_scatter(out: torch.Tensor, full: torch.Tensor, groups: ReductionGroups, label: str,
                             count: Count, divisor: int = 1) -> None:
    """``out`` = this rank's chunk of the sum over the ranks of ``full`` (divided by ``divisor``),
    as [Note: quantized gradient reduction] says."""
    shard = out.numel()
    local = groups.local_size
    nodes = full.numel() // shard // local
    wire = BlockWire(shard, bits=4, block=QGZ_BLOCK)
    # One payload a chunk, ordered (local rank j, node k): the L parts of the all-to-all are the
    # chunks of every node's local rank j, each quantized from a strided view of ``full`` (no copy).
    chunks = full.view(nodes, local, shard)
    send = torch.empty(local * nodes * wire.payload_bytes, dtype=torch.uint8, device=full.device)
    parts = send.view(local, -1)
    for j in range(local):
        wire.encode_rows_into(parts[j], chunks[:, j, :])
    # partial[k]: this node's sum of the chunk of node k's rank at this rank's place.
    partial = _exchange_and_sum(wire, send, nodes, groups.inside, f"{label}.inside", count)
    if groups.across is not None:
        partial = _exchange_and_sum(wire, wire.encode_rows(partial), 1, groups.across, f"{label}.across", count)
    if divisor > 1:
        partial.div_(divisor)
    out.copy_(partial.view(-1))


def _exchange_and_sum(wire: BlockWire, send: torch.Tensor, rows: int, group: dist.ProcessGroup, label: str,
                      count: Count) -> torch.Tensor:
    """``send`` (``rows`` payloads for each rank of ``group``, in rank order) through one
    all-to-all; the fp32 [rows, numel] sums over the senders of what arrives."""
    received = torch.empty_like(send)
    count("quantized_reduce_scatter", label, send, group)
    dist.all_to_all_single(received, send, group=group)
    return wire.decode_sum(received, rows)
