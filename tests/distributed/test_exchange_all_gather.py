"""On gloo, hf_zero's all-gather is an exchange of shards straight into the output
([Note: all-gather on gloo]): every rank gets every rank's shard in rank order, bit for bit what
torch's gloo all-gather gives, with several in flight at once and in place."""

from __future__ import annotations

from typing import Any

import torch

from tests.distributed.launch import run_distributed

SHARD = 1000
DTYPES = (torch.float32, torch.bfloat16, torch.float32)


def _rank_shard(rank: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(SHARD, generator=torch.Generator().manual_seed(100 * seed + rank)).to(dtype)


def _gather(world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from hf_zero.comm import Communicator, ensure_process_group
    from hf_zero.execution import checking

    ensure_process_group(torch.device("cpu"))
    comm = Communicator()
    rank = dist.get_rank()
    shards = [_rank_shard(rank, seed, dtype) for seed, dtype in enumerate(DTYPES)]
    outputs = [torch.full((world * SHARD,), float("nan"), dtype=s.dtype) for s in shards]
    # Three in flight before any is waited for, waited out of order: each must get its own shards.
    handles = [comm.all_gather_into(out, s, label=f"unit{i}", async_op=True) for i, (out, s) in enumerate(zip(outputs, shards))]
    for handle in reversed(handles):
        handle.wait()
    native = torch.empty(world * SHARD)
    dist.all_gather_into_tensor(native, shards[0], group=comm.shard_group)
    # In place: the shard is this rank's chunk of the output, blocking and asynchronous. Late
    # completion is off: under it the gather writes a private result, never the aliased chunk.
    in_place = []
    with checking(False):
        for async_op in (False, True):
            out = torch.full((world * SHARD,), float("nan"))
            out.view(world, -1)[rank].copy_(shards[2])
            handle = comm.all_gather_into(out, out.view(world, -1)[rank], label="in_place", async_op=async_op)
            handle.wait()
            in_place.append(out.tolist())
    return {"exchange": comm._all_gather_by_exchange, "outputs": [o.float().tolist() for o in outputs],
            "native": native.tolist(), "in_place": in_place, "calls": comm.stats.as_dict()["all_gather"]["calls"]}


def test_every_rank_gets_every_shard_in_rank_order_with_several_in_flight_and_in_place():
    world = 3
    ranks = run_distributed(_gather, world, world)
    for rank, got in enumerate(ranks):
        assert got["exchange"] and got["calls"] == 5, rank
        for seed, (out, dtype) in enumerate(zip(got["outputs"], DTYPES)):
            expected = torch.cat([_rank_shard(r, seed, dtype) for r in range(world)]).float()
            assert torch.equal(torch.tensor(out), expected), (rank, seed)
        assert got["outputs"][0] == got["native"], rank  # bit for bit torch's gloo all-gather
        expected = torch.cat([_rank_shard(r, 2, torch.float32) for r in range(world)]).tolist()
        assert got["in_place"] == [expected, expected], rank
