"""On gloo, hf_zero's reduce-scatter is an exchange of chunks ([Note: reduce-scatter on gloo]):
each rank gets the sum of its chunk over every rank, also with several in flight at once."""

from __future__ import annotations

from typing import Any

import torch

from tests.distributed.launch import run_distributed

SHARD = 1000


def _rank_input(rank: int, seed: int, world: int) -> torch.Tensor:
    return torch.randn(world * SHARD, generator=torch.Generator().manual_seed(100 * seed + rank))


def _reduce(world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from hf_zero.comm import Communicator, ensure_process_group

    ensure_process_group(torch.device("cpu"))
    comm = Communicator()
    rank = dist.get_rank()
    inputs = [_rank_input(rank, seed, world) for seed in range(3)]
    shards = [torch.empty(SHARD) for _ in inputs]
    # Three in flight before any is waited for, waited out of order: each must get its own chunks.
    handles = [comm.reduce_scatter_into(s, x, label=f"bucket{i}", async_op=True) for i, (s, x) in enumerate(zip(shards, inputs))]
    for handle in reversed(handles):
        handle.wait()
    blocking = torch.empty(SHARD)
    comm.reduce_scatter_into(blocking, inputs[0], label="blocking")
    native = torch.empty(SHARD)
    dist.reduce_scatter_tensor(native, inputs[0].clone(), group=comm.grad_group)
    return {"exchange": comm._reduce_scatter_by_exchange, "shards": [s.tolist() for s in shards],
            "blocking": blocking.tolist(), "native": native.tolist(), "calls": comm.stats.as_dict()["reduce_scatter"]["calls"]}


def test_each_rank_gets_the_sum_of_its_chunk_with_several_in_flight():
    world = 3
    ranks = run_distributed(_reduce, world, world)
    for rank, got in enumerate(ranks):
        assert got["exchange"] and got["calls"] == 4
        for seed, shard in enumerate(got["shards"]):
            expected = sum(_rank_input(r, seed, world) for r in range(world))[rank * SHARD:(rank + 1) * SHARD]
            assert torch.allclose(torch.tensor(shard), expected, rtol=0, atol=1e-6), (rank, seed)
        assert torch.allclose(torch.tensor(got["blocking"]), torch.tensor(got["native"]), rtol=0, atol=1e-6)
