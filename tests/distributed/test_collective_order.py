"""Every rank issues the same collectives in the same order, across both process groups, even
when ranks take different paths through the model ([Note: one order for both groups] in
hf_zero/engine/schedule/hooks.py). On NCCL that is what makes two communicators safe: no rank's queue
can wait on work a peer queued later. Each rank records what it issued (kind and label, in
order) and the sequences are compared."""

from __future__ import annotations

from typing import Any

import pytest

from tests import divergent_models as M
from tests.distributed.launch import run_distributed
from tests.distributed.test_divergent_paths import _config

STEPS = 3
# Re-gathered units in the backward (reuse distance 0) with little or no prefetch, so that
# gathers and reductions interleave; one reduction per group, so that each bucket's moment shows.
_INTERLEAVED = {"stage3_max_reuse_distance": 0, "reduce_bucket_size": 0}
SCENARIOS = [
    dict(model="layerdrop_tower", stage=2, zero={"overlap_comm": True, "reduce_bucket_size": 0}),
    dict(model="layerdrop_tower", stage=3, zero={**_INTERLEAVED, "stage3_prefetch_bucket_size": 0}),
    dict(model="layerdrop_tower", stage=3, zero={**_INTERLEAVED, "stage3_prefetch_bucket_size": 1}),
    dict(model="layerdrop_tower", stage=3, gas=2, zero={**_INTERLEAVED, "stage3_prefetch_bucket_size": 1}),
    dict(model="moe", stage=3, zero={**_INTERLEAVED, "stage3_prefetch_bucket_size": 0}),
    dict(model="moe", stage=3, zero={**_INTERLEAVED, "stage3_prefetch_bucket_size": 1}),
]


def _issue_order(sc: dict[str, Any]) -> list[list[str]]:
    import torch.distributed as dist

    import hf_zero

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    engine, *_ = hf_zero.initialize(model=M.build(sc["model"]), config=_config(sc))
    engine.comm.trace = trace = []
    gas = sc.get("gas", 1)
    for step in range(STEPS):
        for k in range(gas):
            engine.backward(engine(**M.rank_batch(sc["model"], step * gas + k, rank)))
            engine.step()
    return [list(item) for item in trace]


@pytest.mark.parametrize("sc", SCENARIOS, ids=lambda sc: f"{sc['model']}-s{sc['stage']}-{sc.get('zero', {})}")
def test_ranks_on_different_paths_issue_one_order(sc: dict[str, Any]) -> None:
    orders = run_distributed(_issue_order, 2, sc)
    kinds = [kind for kind, _ in orders[0]]
    interleaved = any(a == "reduce_scatter" and b == "all_gather" for a, b in zip(kinds, kinds[1:]))
    assert interleaved or sc["stage"] < 3, "no gather follows a reduction: the scenario checks no interleaving"
    first_difference = next((i for i, (a, b) in enumerate(zip(*orders)) if a != b), None)
    assert orders[0] == orders[1], (
        f"rank 0 and rank 1 diverge at collective {first_difference}: "
        f"{orders[0][first_difference - 2:first_difference + 3] if first_difference else orders}"
        f" vs {orders[1][first_difference - 2:first_difference + 3] if first_difference else ''}")
