"""The engine on CUDA with NCCL, against single-process AdamW (skipped without CUDA).

One process per visible GPU (world size 1 on a one-GPU machine: still a real NCCL group, so a
host tensor handed to a collective fails here as it would at scale). Every stage, CPU optimizer
offload, parameter offload, offload ratio below 1, and bf16.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed import scenarios as S
from tests.distributed.launch import run_distributed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

FP32_ATOL = 1e-5
BF16_PARAM_ATOL = 2e-2


def _offload(optimizer: str = "none", params: str = "none", ratio: float = 1.0) -> dict[str, Any]:
    zero: dict[str, Any] = {}
    if optimizer != "none":
        zero["offload_optimizer"] = {"device": optimizer, **({"ratio": ratio} if ratio < 1 else {})}
    if params != "none":
        zero["offload_param"] = {"device": params}
    return zero


CASES = {f"stage{s}": S.scenario("llama", s, 2) for s in (0, 1, 2, 3)} | {
    "offload_optimizer_s2": S.scenario("llama", 2, 1, zero=_offload("cpu")),
    "offload_optimizer_s3": S.scenario("llama", 3, 1, zero=_offload("cpu")),
    "offload_param_s3": S.scenario("llama", 3, 1, zero=_offload(params="cpu")),
    "offload_both_s3": S.scenario("llama", 3, 1, zero=_offload("cpu", "cpu")),
    "ratio_s3": S.scenario("llama", 3, 1, zero=_offload("cpu", ratio=0.5)),
    "bf16_s3": S.scenario("gpt2", 3, 2, dtype="bf16"),
}


def _worker(scenarios: list[dict[str, Any]]) -> list[dict[str, Any]]:
    import torch.distributed as dist

    results = S.run_scenarios(scenarios)
    assert dist.get_backend() == "nccl"
    return results


@pytest.fixture(scope="module")
def runs() -> tuple[int, list[list[dict[str, Any]]]]:
    world = torch.cuda.device_count()
    return world, run_distributed(_worker, world, list(CASES.values()))


@pytest.mark.parametrize("name", list(CASES))
def test_cuda_engine_matches_single_process_adamw(runs, name):
    world, per_rank = runs
    sc = CASES[name]
    index = list(CASES).index(name)
    reference = S.train_reference(sc, world)
    atol = BF16_PARAM_ATOL if sc["dtype"] == "bf16" else FP32_ATOL
    for rank_results in per_rank:
        params = rank_results[index]["params"]
        worst = max(max(abs(a - b) for a, b in zip(params[n], reference["params"][n])) for n in params)
        assert worst <= atol, (name, worst)
