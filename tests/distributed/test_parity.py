"""Parity, memory and communication of stages 0-3 on real gloo process groups (world sizes 2, 3).

Every scenario trains the same tiny model for 6 steps on learnable data through hf_zero and, in
this process, with plain single-process torch.optim.AdamW (see scenarios.py: the whole global
batch in fp32; a same-precision data-parallel reference in bf16/fp16). One spawn per world size
runs all scenarios, so process start-up is paid once.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed import scenarios as S
from tests.distributed.launch import run_distributed
from tests.distributed.parity_checks import check_fp32_parity, check_low_precision_parity

PARITY = [S.scenario(m, stage, gas) for m in ("gpt2", "llama") for stage in (0, 1, 2, 3) for gas in (1, 2)]
EXTRA = {
    "frozen_s2": S.scenario("llama", 2, 1, freeze=True),
    "frozen_s3": S.scenario("gpt2", 3, 1, freeze=True),
    # A frozen input RMSNorm is read by the backward after the layer's last weight gradient
    # ([Note: releasing a unit in backward]); with checkpointing the recompute reads it too.
    "frozen_llama_s3": S.scenario("llama", 3, 1, freeze=True, zero={"stage3_max_reuse_distance": 0}),
    "frozen_llama_ckpt_s3": S.scenario("llama", 3, 2, freeze=True, checkpointing=True),
    "checkpointing_s3": S.scenario("llama", 3, 1, checkpointing=True),
    "checkpointing_s2": S.scenario("gpt2", 2, 2, checkpointing=True),
    "torch_optimizer_s3": S.scenario("llama", 3, 1, optimizer="torch"),
    "torch_optimizer_s1": S.scenario("gpt2", 1, 2, optimizer="torch"),
    "persistent_s3": S.scenario("gpt2", 3, 1, zero={"stage3_param_persistence_threshold": 100}),
    "no_prefetch_s3": S.scenario("llama", 3, 2, zero={"stage3_prefetch_bucket_size": 0}),
    "overlap_s2": S.scenario("llama", 2, 2, zero={"overlap_comm": True}),
    "no_overlap_s3": S.scenario("gpt2", 3, 2, zero={"overlap_comm": False}),
    "max_live_s3": S.scenario("gpt2", 3, 1, zero={"stage3_max_live_parameters": 1}),
    "no_reuse_s3": S.scenario("llama", 3, 2, zero={"stage3_max_reuse_distance": 0}),
    "buckets_s2": S.scenario("gpt2", 2, 2, zero={"reduce_bucket_size": 3000, "allgather_bucket_size": 3000}),
    "one_bucket_s3": S.scenario("llama", 3, 1, zero={"reduce_bucket_size": 10**9, "overlap_comm": True}),
    "no_buckets_s1": S.scenario("gpt2", 1, 1, zero={"reduce_bucket_size": 0, "allgather_bucket_size": 0}),
    "bert_s3": S.scenario("bert", 3, 1),
}
BF16 = {f"bf16_s{stage}": S.scenario("gpt2", stage, 2, dtype="bf16") for stage in (0, 1, 2, 3)}
_CPU = {"offload_optimizer": {"device": "cpu"}}
LOW_PRECISION = BF16 | {f"fp16_s{stage}": S.scenario("gpt2", stage, 2, dtype="fp16") for stage in (0, 1, 2, 3)} | {
    "bf16_llama_s3": S.scenario("llama", 3, 1, dtype="bf16"),
    "fp16_llama_s2": S.scenario("llama", 2, 1, dtype="fp16"),
    "bf16_offload_s2": S.scenario("gpt2", 2, 2, dtype="bf16", zero=_CPU),
    "bf16_offload_s3": S.scenario("llama", 3, 1, dtype="bf16", zero=_CPU),
    "fp16_offload_s3": S.scenario("gpt2", 3, 2, dtype="fp16", zero=_CPU),
    "fp16_offload_s1": S.scenario("llama", 1, 1, dtype="fp16", zero=_CPU),
}
ALL = PARITY + list(EXTRA.values()) + list(LOW_PRECISION.values())


def _worker(scenarios: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return S.run_scenarios(scenarios)


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def runs(request: pytest.FixtureRequest) -> tuple[int, list[list[dict[str, Any]]]]:
    world = request.param
    return world, run_distributed(_worker, world, ALL)


def _result(runs: tuple[int, list], sc: dict[str, Any]) -> tuple[int, list[dict[str, Any]]]:
    world, per_rank = runs
    index = ALL.index(sc)
    return world, [rank_results[index] for rank_results in per_rank]


def _check(runs: tuple[int, list], sc: dict[str, Any]) -> None:
    world, results = _result(runs, sc)
    if sc["dtype"] == "fp32":
        check_fp32_parity(results, sc, world)
    else:
        check_low_precision_parity(results, sc, world)


@pytest.mark.parametrize("sc", PARITY, ids=lambda s: f"{s['model']}-stage{s['stage']}-gas{s['gas']}")
def test_fp32_parity_with_single_process_adamw(runs, sc):
    _check(runs, sc)


@pytest.mark.parametrize("name", list(EXTRA))
def test_fp32_parity_features(runs, name):
    _check(runs, EXTRA[name])


@pytest.mark.parametrize("name", list(LOW_PRECISION))
def test_low_precision_parity_with_same_precision_reference(runs, name):
    _check(runs, LOW_PRECISION[name])


def test_frozen_parameters_get_no_gradient_and_no_optimizer_state(runs):
    world, results = _result(runs, EXTRA["frozen_s3"])
    for r in results:
        frozen = [g for g in r["layout"] if not g["trainable"]]
        assert frozen, "the scenario must freeze something"
        expected = _expected_memory(r["layout"], stage=3, compute_bytes=4)
        assert r["memory"]["optimizer_state"] == expected["optimizer_state"]
        assert r["memory"]["gradients"] == expected["gradients"]


# ------------------------------------------------------------------ memory
def _expected_memory(layout: list[dict[str, Any]], stage: int, compute_bytes: int) -> dict[str, int]:
    """The ZeRO formulas, group by group: what each rank holds after an optimizer step."""
    mem = dict(compute_params=0, gradients=0, fp32_master=0, optimizer_state=0)
    for g in layout:
        padded, shard = g["padded_numel"], g["padded_numel"] // g["world_size"]
        sharded = stage == 3 and not g["persistent"]
        mem["compute_params"] += (shard if sharded else padded) * compute_bytes
        if not g["trainable"]:
            continue
        if stage == 0:  # full gradients, plus an fp32 copy when computing in 16 bits
            mem["gradients"] += padded * compute_bytes + (padded * 4 if compute_bytes != 4 else 0)
        else:  # the fp32 gradient shard; full gradients are freed after the reduce-scatter
            mem["gradients"] += shard * 4
        mem["fp32_master"] += shard * 4 if compute_bytes != 4 else 0  # fp32: master = params
        mem["optimizer_state"] += 2 * shard * 4  # Adam exp_avg and exp_avg_sq
    return mem


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_memory_report_equals_zero_formula(runs, model, stage):
    sc = S.scenario(model, stage, 1)
    world, results = _result(runs, sc)
    for r in results:
        expected = _expected_memory(r["layout"], stage, compute_bytes=4)
        report = {k: r["memory"][k] for k in expected}
        assert report == expected
        assert r["memory"]["buffers"] == r["buffer_bytes"]
    # The same in Ψ (real parameters): stage 1 holds 4Ψ + 4Ψ/N + 8Ψ/N, stage 2 the same, stage 3
    # (4 + 4 + 8)Ψ/N, stage 0 16Ψ; padding is the only difference.
    psi = sum(g["numel"] for g in results[0]["layout"])
    padding = sum(g["padded_numel"] - g["numel"] for g in results[0]["layout"])
    per_rank = {0: 16 * psi, 1: 4 * psi + 12 * psi / world, 2: 4 * psi + 12 * psi / world, 3: 16 * psi / world}[stage]
    for r in results:
        held = sum(r["memory"][k] for k in ("compute_params", "gradients", "fp32_master", "optimizer_state"))
        assert abs(held - per_rank) <= 16 * padding


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_memory_report_equals_zero_formula(runs, stage):
    world, results = _result(runs, BF16[f"bf16_s{stage}"])
    for r in results:
        expected = _expected_memory(r["layout"], stage, compute_bytes=2)
        assert {k: r["memory"][k] for k in expected} == expected


# ------------------------------------------------------------------ communication
def _embedding_units(sc: dict[str, Any]) -> set[str]:
    """Units that are exactly an nn.Embedding: their backward reads no parameter, so stage 3
    never gathers them for it ([Note: units whose backward reads no parameter])."""
    model = S.build_model(sc)
    return {name for name, m in model.named_modules()
            if isinstance(m, torch.nn.Embedding) and type(m).forward is torch.nn.Embedding.forward}


def _expected_comm(layout: list[dict[str, Any]], stage: int, gas: int, step: int, reuse: bool,
                   no_backward_gather: set[str] = frozenset()) -> dict[str, int]:
    """Elements per step. Stage 3 gathers each sharded unit for its forward and, unless it was
    kept (the reuse distance: the shared schedule knows the order from the first step) or its
    backward reads no parameter (an embedding), again for its backward."""
    trainable = sum(g["padded_numel"] for g in layout if g["trainable"])
    if stage == 0:
        return {"all_reduce": trainable}
    if stage in (1, 2):  # stage 2 reduce-scatters every micro-step, stage 1 once per step
        return {"reduce_scatter": trainable * (gas if stage == 2 else 1), "all_gather": trainable}
    sharded = sum(g["padded_numel"] for g in layout if not g["persistent"])
    persistent = sum(g["padded_numel"] for g in layout if g["persistent"] and g["trainable"])
    regathered = sum(g["padded_numel"] for g in layout if not g["persistent"] and g["unit"] not in no_backward_gather)
    return {"reduce_scatter": trainable * gas,
            "all_gather": sharded * gas + (0 if reuse else regathered * gas) + persistent}


COMM_SCENARIOS = PARITY + [EXTRA[k] for k in ("persistent_s3", "frozen_s3", "checkpointing_s3", "no_reuse_s3",
                                              "buckets_s2", "one_bucket_s3", "no_buckets_s1")]


@pytest.mark.parametrize("sc", COMM_SCENARIOS,
                         ids=lambda s: f"{s['model']}-stage{s['stage']}-gas{s['gas']}-{s['zero'] or s['freeze'] or s['checkpointing']}")
def test_comm_volume_per_step(runs, sc):
    world, results = _result(runs, sc)
    layout = results[0]["layout"]
    reuse = sc["zero"].get("stage3_max_reuse_distance", 1) > 0
    embeddings = _embedding_units(sc)
    assert all(r["layout"] == layout for r in results)
    for step, step_stats in ((s, st) for r in results for s, st in enumerate(r["comm_per_step"])):
        expected = _expected_comm(layout, sc["stage"], sc["gas"], step, reuse, embeddings)
        # One all-reduce per step carries the global grad norm and the non-finite flag; which
        # parameters some rank used goes over the host group, and only when some rank has one
        # without a gradient ([Note: parameters no rank used]), not counted as model traffic.
        flags = 2
        norm = {"calls": 1, "numel": flags, "bytes": 4 * flags, "bytes_inside_node": 4 * flags, "bytes_between_nodes": 0}
        moved = {k: v["numel"] for k, v in step_stats.items() if k != "all_reduce"}
        assert moved == {k: v for k, v in expected.items() if k != "all_reduce"}
        if sc["stage"] == 0:
            assert step_stats["all_reduce"]["numel"] == expected["all_reduce"] + flags
        else:
            assert step_stats["all_reduce"] == norm
    if sc["gas"] == 1 and not sc["zero"] and not sc["freeze"]:
        # ZeRO's volumes, measured on every rank and step: Ψ (stage 0), 2Ψ (stages 1-2), and 2Ψ
        # at stage 3 because the reuse distance keeps the forward's gathers for the backward (3Ψ
        # without it: no_reuse_s3).
        psi = sum(g["padded_numel"] for g in layout)
        for r in results:
            for step_stats in r["comm_per_step"]:
                moved = sum(v["numel"] for v in step_stats.values()) - flags
                assert moved == {0: 1, 1: 2, 2: 2, 3: 2}[sc["stage"]] * psi


def _collective_calls(step_stats: dict[str, dict[str, int]], kind: str) -> int:
    return step_stats.get(kind, {}).get("calls", 0)


def test_small_units_share_a_bucket(runs):
    """reduce_bucket_size / allgather_bucket_size: small groups go out together, one
    collective per bucket; 0 means one collective per group (see [Note: buckets])."""
    world, _ = runs
    for rank in range(world):
        per_group = _result(runs, EXTRA["no_buckets_s1"])[1][rank]
        groups = sum(1 for g in per_group["layout"] if g["trainable"])
        last = per_group["comm_per_step"][-1]
        assert _collective_calls(last, "reduce_scatter") == groups
        assert _collective_calls(last, "all_gather") == groups
        default = _result(runs, S.scenario("gpt2", 1, 1))[1][rank]["comm_per_step"][-1]  # 5e8: one bucket
        assert _collective_calls(default, "reduce_scatter") == 1
        assert _collective_calls(default, "all_gather") == 1
        small = _result(runs, EXTRA["buckets_s2"])[1][rank]
        calls = _collective_calls(small["comm_per_step"][-1], "reduce_scatter")
        assert 2 * 1 < calls < 2 * sum(1 for g in small["layout"] if g["trainable"])  # gas 2: two backward
        one = _result(runs, EXTRA["one_bucket_s3"])[1][rank]["comm_per_step"][-1]
        assert _collective_calls(one, "reduce_scatter") == 1
