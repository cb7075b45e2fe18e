"""A parameter no rank used in a step does not move, whatever unit it shares: torch's per-parameter
semantics ([Note: parameters no rank used]).

DDP(find_unused_parameters=True) leaves the gradient of a parameter that no rank used ``None``,
and torch's AdamW then leaves its value, its moments and its step count alone; the next time it is
used its bias correction counts only the steps it took. Here such parameters share a unit (and so
a flat shard) with parameters that are used: a side tower and an adapter inside the root unit, and
experts that get no token inside a Mixtral-style decoder layer. hf_zero at stages 0-3, at world 2
and 3, with accumulation and with the offloaded optimizer, must end within 1e-6 of DDP; stepping
such a parameter with a zero gradient moves it by about lr (Adam's momentum), 1e-2 here.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest

from tests import divergent_models as M
from tests.distributed.launch import run_distributed
from tests.distributed.test_divergent_paths import _id, _max_diff, _train_ddp, _train_hf_zero

ATOL = 1e-6
NVME = tempfile.gettempdir()  # each run's files go in a folder of its own there

SCENARIOS = [dict(model=m, stage=s, clip=0.0) for m in ("root_tower", "mixtral_style") for s in (0, 1, 2, 3)] + [
    dict(model="root_tower", stage=3, clip=1.0),  # clipping's norm leaves them out too
    dict(model="root_tower", stage=1, gas=2, clip=0.0),  # used in one micro-step of two counts as used
    dict(model="mixtral_style", stage=3, gas=2, clip=0.0),
    dict(model="root_tower", stage=2, clip=0.0, zero={"offload_optimizer": {"device": "cpu"}}),
    dict(model="mixtral_style", stage=3, clip=0.0, zero={"offload_optimizer": {"device": "cpu"},
                                                         "offload_param": {"device": "cpu"}}),
    dict(model="root_tower", stage=3, clip=1.0, zero={"offload_optimizer": {"device": "nvme", "nvme_path": NVME}}),
    # Adafactor steps whole parameters on their owner rank ([Note: whole-parameter step]).
    dict(model="root_tower", stage=2, clip=0.0, optimizer="adafactor"),
    dict(model="mixtral_style", stage=3, clip=0.0, optimizer="adafactor"),
    dict(model="mixtral_style", stage=2, clip=0.0, zero={"offload_optimizer": {"device": "nvme", "nvme_path": NVME}}),
]


def _worker(scenarios: list[dict[str, Any]]) -> list[dict[str, Any]]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    return [{"ddp": _train_ddp(sc, rank), "hf_zero": _train_hf_zero(sc, rank)} for sc in scenarios]


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def runs(request: pytest.FixtureRequest) -> list[list[dict[str, Any]]]:
    return run_distributed(_worker, request.param, SCENARIOS)


@pytest.mark.parametrize("index", range(len(SCENARIOS)), ids=[_id(s) for s in SCENARIOS])
def test_parameters_no_rank_used_stay_as_ddp_leaves_them(runs, index):
    for rank_results in runs:
        result = rank_results[index]
        assert _max_diff(result["hf_zero"], result["ddp"]) <= ATOL


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["root_tower", "mixtral_style"])
def test_some_step_leaves_parameters_unused_by_every_rank_beside_used_ones(kind, world):
    """The case this file is about happens: in some step, a parameter no rank used shares its
    unit (the root, a decoder layer) with parameters some rank used."""
    import torch

    model = M.build(kind)
    unit_of = {name: ".".join(name.split(".")[:2]) if name.startswith("layers.") else "root"  # Block / decoder layer
               for name, _ in model.named_parameters()}
    found = False
    for step in range(6):
        used: set[str] = set()
        for rank in range(world):
            model.zero_grad(set_to_none=True)
            model(**M.rank_batch(kind, step, rank)).backward()
            used |= {n for n, p in model.named_parameters() if p.grad is not None}
        unused = set(unit_of) - used
        found |= any(unit_of[n] == unit_of[u] for u in unused for n in used)
    assert found and torch.is_grad_enabled()
