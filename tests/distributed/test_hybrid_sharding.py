"""Hybrid sharding ([Note: hybrid sharding] in hf_zero/comm/collectives.py) on 4 real gloo ranks
as 2 shard groups of 2: ``zero_optimization.mics_shard_size: 2``.

Every scenario trains for 6 steps and is compared with single-process AdamW on the whole global
batch of 4 ranks (what DDP at world 4 computes; scenarios.py), to the parity tolerances of
test_parity.py. The states are sharded 2 ways, not 4 (each group's layout says so), and every
gradient reduce-scatter inside a shard group is followed by the all-reduce of its shard across
the replicas, half its elements at a shard group of 2: the only traffic between shard groups.

A checkpoint saved by the hybrid run has one file per shard (2, written by the first shard
group) and resumes at world 4 without replicas; one saved without replicas resumes with them.
Both continuations end where 6 uninterrupted steps end.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.distributed import scenarios as S
from tests.distributed.launch import run_distributed
from tests.distributed.parity_checks import FP32_PARAM_ATOL, check_fp32_parity, check_low_precision_parity, max_param_diff

WORLD, SHARD = 4, 2
HYBRID = {"mics_shard_size": SHARD}
CASES = {
    "llama_s3_gas2": S.scenario("llama", 3, 2, zero=HYBRID),
    "gpt2_s3_prefetch_none": S.scenario("gpt2", 3, 1, zero={**HYBRID, "stage3_prefetch_bucket_size": 0}),
    "gpt2_s2": S.scenario("gpt2", 2, 1, zero=HYBRID),
    "gpt2_s1_gas2_buckets": S.scenario("gpt2", 1, 2, zero={**HYBRID, "reduce_bucket_size": 3000}),
    "llama_s3_offload": S.scenario("llama", 3, 1, zero={**HYBRID, "offload_optimizer": {"device": "cpu"}}),
    "bf16_llama_s3": S.scenario("llama", 3, 1, dtype="bf16", zero=HYBRID),
    "fp16_gpt2_s2": S.scenario("gpt2", 2, 2, dtype="fp16", zero=HYBRID),
}
SCENARIOS = list(CASES.values())
RESUME = {  # (saved with, resumed with): 3 steps each
    "hybrid_to_plain": (HYBRID, {}),
    "plain_to_hybrid": ({}, HYBRID),
}
RESUME_SC = S.scenario("llama", 3, 1)
RESUME_AT = 3


def _train_span(sc: dict[str, Any], zero: dict[str, Any], first: int, last: int, folder: str,
                load: bool) -> tuple[dict[str, list[float]], list[str]]:
    """Steps [first, last) of ``sc`` with ``zero`` added, loading ``folder`` first or saving into
    it after; the full parameters, and the checkpoint's files."""
    import hf_zero

    run = dict(sc, zero={**sc["zero"], **zero})
    model = S.build_model(run)
    engine, _, _, _ = hf_zero.initialize(model=model, config=S.make_config(run))
    if load:
        engine.load_checkpoint(folder)
    world, rank, micro = engine.world_size, engine.rank, run["micro"]
    for step in range(first, last):
        batch = S.learnable_batch(step, world * micro)
        loss = S.model_loss(engine, run["model"], batch[rank * micro:(rank + 1) * micro])
        engine.backward(loss)
        engine.step()
    files: list[str] = []
    if not load:
        saved = engine.save_checkpoint(folder, tag="step3")
        files = sorted(os.listdir(saved))
    return S.full_params(engine), files


def _start_from_other_weights() -> dict[str, list[float]]:
    """Every rank builds the model with weights of its own (rank r adds r / 10): after
    ``initialize`` every rank holds rank 0's, the replicas included."""
    import torch

    import hf_zero

    model = S.build_model(RESUME_SC)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(int(os.environ["RANK"]) / 10)
    run = dict(RESUME_SC, zero=HYBRID)
    engine, _, _, _ = hf_zero.initialize(model=model, config=S.make_config(run))
    return S.full_params(engine)


def _shard_size_not_dividing_the_world() -> str:
    import hf_zero

    run = dict(RESUME_SC, zero={"mics_shard_size": 3})
    try:
        hf_zero.initialize(model=S.build_model(run), config=S.make_config(run))
    except ValueError as error:
        return str(error)
    return "initialize accepted it"


# Ranks on different paths (tests/divergent_models.py): at steps 1 and 4 only rank 2 runs the
# side tower, so only the second shard group uses its parameters, which must still step on
# every rank, as DDP(find_unused_parameters=True) steps them.
DIVERGENT = {
    "layerdrop_tower_s3": dict(model="layerdrop_tower", stage=3, zero=HYBRID),
    "moe_s2": dict(model="moe", stage=2, zero=HYBRID),
    "layerdrop_tower_s3_offload": dict(model="layerdrop_tower", stage=3, clip=0.0,
                                       zero={**HYBRID, "offload_optimizer": {"device": "cpu"}}),
}


def _worker(folder: str) -> dict[str, Any]:
    from tests.distributed.test_divergent_paths import _train_ddp, _train_hf_zero

    out: dict[str, Any] = {"scenarios": S.run_scenarios(SCENARIOS)}
    rank = int(os.environ["RANK"])
    out["divergent"] = {name: {"ddp": _train_ddp(sc, rank), "hf_zero": _train_hf_zero(sc, rank)}
                        for name, sc in DIVERGENT.items()}
    out["initial"] = _start_from_other_weights()
    out["not_dividing"] = _shard_size_not_dividing_the_world()
    for name, (saved_with, resumed_with) in RESUME.items():
        where = os.path.join(folder, name)
        _, files = _train_span(RESUME_SC, saved_with, 0, RESUME_AT, where, load=False)
        params, _ = _train_span(RESUME_SC, resumed_with, RESUME_AT, RESUME_SC["steps"], where, load=True)
        out[name] = {"files": files, "params": params}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(_worker, WORLD, str(tmp_path_factory.mktemp("hybrid")))


@pytest.mark.parametrize("name", list(CASES))
def test_trains_like_data_parallel_over_all_ranks(runs: list[dict[str, Any]], name: str) -> None:
    sc = CASES[name]
    results = [r["scenarios"][SCENARIOS.index(sc)] for r in runs]
    if sc["dtype"] == "fp32":
        check_fp32_parity(results, sc, WORLD)
    else:
        check_low_precision_parity(results, sc, WORLD)
    for r in results:
        assert {g["world_size"] for g in r["layout"]} == {SHARD}  # sharded in the group, not over all 4


@pytest.mark.parametrize("name", list(CASES))
def test_only_gradient_shards_cross_shard_groups(runs: list[dict[str, Any]], name: str) -> None:
    sc = CASES[name]
    for r in runs:
        for step in r["scenarios"][SCENARIOS.index(sc)]["comm_per_step"]:
            scattered, across = step["reduce_scatter"], step["replica_all_reduce"]
            assert across["calls"] == scattered["calls"] > 0
            assert across["numel"] * SHARD == scattered["numel"]


@pytest.mark.parametrize("name", list(RESUME))
def test_checkpoint_resumes_across_shard_groups(runs: list[dict[str, Any]], name: str) -> None:
    saved_with, _ = RESUME[name]
    files = [f for f in runs[0][name]["files"] if f.endswith(".safetensors")]
    assert len(files) == (SHARD if saved_with else WORLD), files
    reference = S.train_reference(RESUME_SC, WORLD)
    for r in runs:
        assert max_param_diff(r[name]["params"], reference["params"]) <= FP32_PARAM_ATOL


def test_every_rank_starts_from_rank_0s_weights(runs: list[dict[str, Any]]) -> None:
    from tests.distributed.scenarios import build_model, named_flat_params

    rank0 = named_flat_params(build_model(RESUME_SC))
    for r in runs:
        assert max_param_diff(r["initial"], rank0) == 0.0


def test_a_shard_group_size_that_does_not_divide_the_world_is_refused(runs: list[dict[str, Any]]) -> None:
    for r in runs:
        assert "mics_shard_size 3 does not divide the world size 4" in r["not_dividing"], r["not_dividing"]
        assert "write a divisor of it" in r["not_dividing"]


@pytest.mark.parametrize("name", list(DIVERGENT))
def test_ranks_on_different_paths_train_as_ddp_find_unused(runs: list[dict[str, Any]], name: str) -> None:
    from tests.distributed.test_divergent_paths import ATOL, _max_diff

    for r in runs:
        result = r["divergent"][name]
        assert _max_diff(result["hf_zero"], result["ddp"]) <= ATOL, name
