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
            # Bit for bit the chunks added in rank order (sum() starts from 0 + chunk 0: exact).
            expected = sum(_rank_input(r, seed, world) for r in range(world))[rank * SHARD:(rank + 1) * SHARD]
            assert torch.equal(torch.tensor(shard), expected), (rank, seed)
        assert torch.allclose(torch.tensor(got["blocking"]), torch.tensor(got["native"]), rtol=0, atol=1e-6)


def _aliased(world: int) -> dict[str, Any]:
    """Each reduce-scatter twice on the same input: into a separate output, and in place (the
    output is this rank's chunk of the input). Late completion is off for the communicator's
    calls: under it the exchange writes a private result, so the aliasing would never reach it."""
    import torch.distributed as dist

    from hf_zero.comm import Communicator, ensure_process_group
    from hf_zero.comm.exchange import ExchangeReduceScatter
    from hf_zero.execution import checking

    ensure_process_group(torch.device("cpu"))
    comm = Communicator()
    rank = dist.get_rank()
    inputs = [_rank_input(rank, seed, world) for seed in range(3)]
    separate = [torch.empty(SHARD) for _ in inputs]
    for out, full in zip(separate, inputs):
        ExchangeReduceScatter(out, full.clone(), None).wait()
    # In place, straight on the exchange: two in flight at once, waited in reverse.
    direct = [full.clone() for full in inputs[:2]]
    works = [ExchangeReduceScatter(x.view(world, -1)[rank], x, None) for x in direct]
    for work in reversed(works):
        work.wait()
    # In place through the communicator, blocking and asynchronous.
    through_comm = inputs[2].clone()
    with checking(False):
        comm.reduce_scatter_into(through_comm.view(world, -1)[rank], through_comm, label="in_place")
        kept = inputs[0].clone()
        comm.reduce_scatter_into(kept.view(world, -1)[rank], kept, label="in_place_async", async_op=True).wait()
    chunk = slice(rank * SHARD, (rank + 1) * SHARD)
    return {"exchange": comm._reduce_scatter_by_exchange, "separate": [s.tolist() for s in separate],
            "in_place": [direct[0][chunk].tolist(), direct[1][chunk].tolist(),
                         through_comm[chunk].tolist(), kept[chunk].tolist()]}


def test_an_output_aliasing_its_own_input_chunk_gets_the_same_sum():
    world = 3  # from rank 2 on, the first addition would overwrite the rank's own chunk
    ranks = run_distributed(_aliased, world, world)
    for rank, got in enumerate(ranks):
        assert got["exchange"]
        for seed, shard in enumerate(got["separate"]):
            expected = sum(_rank_input(r, seed, world) for r in range(world))[rank * SHARD:(rank + 1) * SHARD]
            assert torch.allclose(torch.tensor(shard), expected, rtol=0, atol=1e-6), (rank, seed)
        # Same additions in the same order: bit for bit the non-aliased result.
        for which, (in_place, seed) in enumerate(zip(got["in_place"], [0, 1, 2, 0])):
            assert in_place == got["separate"][seed], (rank, which)
