"""The test launcher's groups ([Note: a port when the group forms] in tests/distributed/launch.py):
one spawn forms groups of several world sizes in turn, each on a port rank 0 chose as it formed,
and every rank of a group joins the same one, also after groups it skipped."""

from __future__ import annotations

import os
from typing import Any

from tests.distributed.launch import in_group, run_distributed

WORLDS = (3, 1, 2, 3)


def _joined(_: str) -> dict[str, Any]:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=30))  # a rank on the wrong port fails
    ranks = torch.tensor([dist.get_rank()])
    dist.all_reduce(ranks)
    return {"port": int(os.environ["MASTER_PORT"]), "world": dist.get_world_size(), "rank_sum": int(ranks)}


def _every_group() -> list[Any]:
    return [in_group(world, _joined, "") for world in WORLDS]


def test_every_rank_of_a_group_joins_the_port_rank_0_chose_for_it() -> None:
    ranks = run_distributed(_every_group, 3)
    for index, world in enumerate(WORLDS):
        joined = [rank[index] for rank in ranks[:world]]
        assert all(rank[index] is None for rank in ranks[world:])
        assert {j["port"] for j in joined} == {joined[0]["port"]}, (world, joined)
        assert [j["world"] for j in joined] == [world] * world
        assert [j["rank_sum"] for j in joined] == [sum(range(world))] * world

