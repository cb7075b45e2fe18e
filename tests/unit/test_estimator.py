"""The memory estimator against hand calculations and the formulas of its docstring.

(tests/distributed/test_checkpoint.py checks it against ``memory_report()`` of real runs.)"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from hf_zero.estimator import (
    WorkingSettings, estimate_model_states, format_table, group_stats, meta_model, model_state_bytes,
)


class Toy(nn.Module):
    """Three 110-element units and a 33-element root unit (no _no_split_modules: the ModuleList
    children become units)."""

    def __init__(self, bias: bool = True, width: int = 10, depth: int = 3, head: bool = True) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width, bias=bias) for _ in range(depth)])
        self.head = nn.Linear(width, 3) if head else None


def test_hand_calculation_stage3_fp32_world2():
    # A unit: weight 100 at 0, bias 10 at 104 (100 rounded up to a multiple of 8), ends at 114 ->
    # padded to 128 (a multiple of world 2 x alignment 8), shard 64. Root: weight 30 at 0, bias 3
    # at 32, ends at 35 -> 48, shard 24.
    assert model_state_bytes(Toy(), world_size=2, stage=3, dtype="fp32", persistence_threshold=0) == {
        "compute_params": (3 * 64 + 24) * 4, "gradients": (3 * 64 + 24) * 4,
        "fp32_master": 0, "optimizer_state": (3 * 64 + 24) * 8}


def test_hand_calculation_stage1_bf16_world2():
    assert model_state_bytes(Toy(), world_size=2, stage=1, dtype="bf16") == {
        "compute_params": (3 * 128 + 48) * 2, "gradients": (3 * 64 + 24) * 4,
        "fp32_master": (3 * 64 + 24) * 4, "optimizer_state": (3 * 64 + 24) * 8}


def test_hand_calculation_stage0_bf16_keeps_everything_whole():
    padded = 3 * 120 + 40  # one shard: ends at 114 and 35 (as above), padded to multiples of 8 only
    assert model_state_bytes(Toy(), world_size=4, stage=0, dtype="bf16") == {
        "compute_params": padded * 2, "gradients": padded * (2 + 4), "fp32_master": padded * 4,
        "optimizer_state": padded * 8}


def test_persistent_parameters_stay_whole_under_stage3():
    # biases (10, 3 elements) are at or under the threshold: kept whole, in their own groups.
    # Weights 100 -> 112 (a multiple of 2 x 8), shard 56, and 30 -> 32, shard 16; biases, padded
    # to a multiple of the world size only ([Note: alignment in flat buffers]): 10 -> 10, shards
    # of 5, and 3 -> 4, shards of 2.
    mem = model_state_bytes(Toy(), world_size=2, stage=3, dtype="fp32", persistence_threshold=10)
    weights_shard, bias_full, bias_shard = 3 * 56 + 16, 3 * 10 + 4, 3 * 5 + 2
    assert mem["compute_params"] == (weights_shard + bias_full) * 4
    assert mem["optimizer_state"] == (weights_shard + bias_shard) * 8
    kinds = {(g.unit, g.persistent) for g in group_stats(Toy(), 2, 3, persistence_threshold=10)}
    assert ("layers.0", True) in kinds and ("<root>", True) in kinds


def test_frozen_parameters_have_no_gradient_or_optimizer_state():
    model = Toy()
    model.layers[0].requires_grad_(False)
    mem = model_state_bytes(model, world_size=2, stage=2, dtype="fp32")
    assert mem["optimizer_state"] == (2 * 64 + 24) * 8 and mem["compute_params"] == (3 * 128 + 48) * 4


@pytest.mark.parametrize("stage,dtype,per_psi", [
    (0, "fp32", lambda n: 16), (0, "bf16", lambda n: 20),
    (1, "fp32", lambda n: 4 + 12 / n), (2, "bf16", lambda n: 2 + 16 / n),
    (3, "fp32", lambda n: 16 / n), (3, "bf16", lambda n: 18 / n),
])
@pytest.mark.parametrize("world", [2, 4])
def test_docstring_formulas_hold_exactly_without_padding(stage, dtype, per_psi, world):
    model = Toy(bias=False, width=8, depth=4, head=False)  # 4 units of 64 elements: no padding
    psi = 4 * 64
    total = sum(model_state_bytes(model, world, stage, dtype, persistence_threshold=0).values())
    assert total == per_psi(world) * psi


def test_offload_moves_master_gradients_and_adam_state_to_the_host():
    rows = estimate_model_states(Toy(), num_gpus_per_node=2, dtype="fp32", stages=(3,), persistence_threshold=0)
    assert [(r.offload_optimizer, r.offload_param) for r in rows] == [(False, False), (True, False), (True, True)]
    shard, none, opt, both = 3 * 64 + 24, rows[0], rows[1], rows[2]
    assert none.device_bytes == shard * 16 and none.host_bytes == 0
    assert opt.device_bytes == shard * 4 and opt.host_bytes == shard * 16
    assert both.device_bytes == 0 and both.host_bytes == shard * 20
    assert both.host_bytes_per_node == 2 * both.host_bytes
    # Working set at DeepSpeed's defaults ([Note: stage-3 working memory]; 3 units of 128 and a
    # root of 48, padded as in test_hand_calculation_stage3_fp32_world2): the forward gathers and
    # keeps everything (432); one bucket holds every gradient until the end. The root's backward
    # holds 432 gathered + its 48 gradients + its weight's 30 before they are added in; layer
    # k's, the root and the layers after it freed: 128 (k + 1) gathered + 48 + 128 (3 - k)
    # gradients + its weight's 100 = 660 for every k.
    assert none.working_bytes == 660 * 4
    assert opt.working_bytes == both.working_bytes == none.working_bytes


def _stage3_working_numel(model: nn.Module, **settings: int) -> int:
    row = estimate_model_states(model, num_gpus_per_node=2, dtype="fp32", stages=(3,), persistence_threshold=0,
                                working=WorkingSettings(**settings))[0]
    return row.working_bytes // 4


def test_working_memory_follows_bucket_and_in_flight_settings():
    """Four units of 128 (their weight 100) and a root of 48 (weight 30), nothing kept or
    prefetched, so one unit is gathered at a time: layer k's backward holds 128 gathered, the
    root's 48 gradients (its bucket is the last), the gradients of the layers after k still in
    their buckets, its own 128 and its weight's 100 before they are added in."""
    regather = dict(stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0)
    # One bucket per group: at most two reductions in flight, so layer 0 holds layers 1 and 2
    # (layer 3's finished when layer 1's went out): 128 + 48 + 2 x 128 + 128 + 100.
    assert _stage3_working_numel(Toy(depth=4), reduce_bucket_size=0, **regather) == 660
    # One bucket for all: every gradient stays until the end: 128 + 48 + 3 x 128 + 128 + 100.
    assert _stage3_working_numel(Toy(depth=4), **regather) == 788


class EmbeddingFirst(nn.Module):
    """A plain nn.Embedding unit (64 x 8 = 512), a linear unit (64) and a root head (32)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Embedding(64, 8), nn.Linear(8, 8, bias=False)])
        self.head = nn.Linear(8, 4, bias=False)


def test_an_embeddings_backward_gathers_nothing_and_makes_its_gradient_whole():
    # The forward gathers all three (608); the embedding is freed after its forward, the linear
    # and the root kept. The root's backward holds 96 + 32 + 32, the linear's 64 + 96 + 64, the
    # embedding's nothing gathered, the root's and the linear's gradients (one bucket) and its
    # own 512: the dense backward's gradient, which its group (one unpadded parameter) takes as
    # it is: 32 + 64 + 512 = 608. Copied into a buffer of its own it would be 1120.
    assert _stage3_working_numel(EmbeddingFirst()) == 608


def test_stage1_and_2_rows_and_the_table():
    rows = estimate_model_states(Toy(), num_gpus_per_node=4, num_nodes=2, dtype="bf16", stages=(1, 2))
    assert [(r.stage, r.offload_optimizer) for r in rows] == [(1, False), (1, True), (2, False), (2, True)]
    assert all(r.world_size == 8 for r in rows)
    table = format_table(rows)
    assert table.splitlines()[0].split(" | ")[0].strip() == "stage" and len(table.splitlines()) == 7
    assert "host/node" in table and table.splitlines()[-1].startswith("formula: ")  # the footnote


def test_a_config_dict_builds_on_meta_and_counts_the_same(tmp_path):
    from tests.tiny_models import tiny_llama

    real = tiny_llama()
    config = json.loads(real.config.to_json_string(use_diff=False))
    skeleton = meta_model(config)
    assert next(skeleton.parameters()).is_meta
    for stage in (1, 3):
        assert (model_state_bytes(skeleton, 3, stage, "bf16", persistence_threshold=0)
                == model_state_bytes(real, 3, stage, "bf16", persistence_threshold=0))
    (tmp_path / "config.json").write_text(json.dumps(config))
    from_file = meta_model(tmp_path / "config.json")
    from_dir = meta_model(tmp_path)
    assert sum(p.numel() for p in from_file.parameters()) == sum(p.numel() for p in from_dir.parameters())


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="dtype"):
        model_state_bytes(Toy(), 2, 1, dtype="int8")
    with pytest.raises(ValueError, match=">= 1"):
        estimate_model_states(Toy(), num_gpus_per_node=0)


def test_each_row_names_its_formula_and_the_papers():
    """The formula column, checked against the row's own bytes on a model with nothing
    persistent and no padding to speak of: device bytes / Ψ at the formula's coefficients."""
    psi = sum(p.numel() for p in Toy().parameters())
    rows = estimate_model_states(Toy(), num_gpus_per_node=4, dtype="bf16", stages=(1, 3), persistence_threshold=0)
    by = {(r.stage, r.offload_optimizer, r.offload_param): r for r in rows}
    assert by[(1, False, False)].formula == "2Ψ + 16Ψ/N" and by[(1, False, False)].paper_formula == "4Ψ + 12Ψ/N"
    assert by[(3, False, False)].formula == "18Ψ/N" and by[(3, False, False)].paper_formula == "16Ψ/N"
    assert by[(3, True, False)].formula == "2Ψ/N" and by[(3, True, False)].paper_formula == "-"
    assert by[(3, True, True)].formula == "0 (persistent only)"
    # The formula is the row's bytes up to padding: at N = 4 a unit ends at 114 (see the hand
    # calculations above) and is padded to 128, the root ends at 35 and is padded to 64.
    padded_psi = 3 * 128 + 64
    assert psi == 3 * 110 + 33 and by[(3, False, False)].device_bytes == 18 * padded_psi // 4
    table = format_table(rows)
    assert "2Ψ + 16Ψ/N" in table and "ZeRO paper has 16Ψ (stage 0), 4Ψ + 12Ψ/N (1)" in table.splitlines()[-1]
    fp32 = estimate_model_states(Toy(), num_gpus_per_node=4, dtype="fp32", stages=(0, 2), persistence_threshold=0)
    assert [r.formula for r in fp32 if not r.offload_optimizer] == ["16Ψ", "4Ψ + 12Ψ/N"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hybrid_sharding_shards_states_over_the_shard_group_only(stage: int):
    """mics_shard_size 8 on 8 x 8 ranks: each rank holds what a world of 8 holds."""
    hybrid = estimate_model_states(Toy(width=64), 8, 8, dtype="bf16", stages=(stage,), shard_group_size=8)
    node = estimate_model_states(Toy(width=64), 8, 1, dtype="bf16", stages=(stage,))
    everywhere = estimate_model_states(Toy(width=64), 8, 8, dtype="bf16", stages=(stage,))
    assert [e.device_bytes for e in hybrid] == [e.device_bytes for e in node]
    assert hybrid[0].device_bytes > everywhere[0].device_bytes
    with pytest.raises(ValueError, match="does not divide the world size 64"):
        estimate_model_states(Toy(width=64), 8, 8, stages=(stage,), shard_group_size=6)


class LargeSmallLarge(nn.Module):
    """Units of 512, 64 and 512 weights (one parameter each, unpadded at world 2) and a root of 8
    elements (padded to 16)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 64, bias=False), nn.Linear(8, 8, bias=False),
                                     nn.Linear(8, 64, bias=False)])
        self.scale = nn.Parameter(torch.ones(8))


def test_a_bucket_larger_than_the_next_is_finished_before_the_next_goes_out():
    # Nothing kept or prefetched, one bucket per unit, the root's last (its 16 gradient elements
    # held through the backward). The last unit's backward holds its 512 gathered and its 512
    # gradient (autograd's, taken as it is): 16 + 1024. When the middle unit's 64 go out, the
    # 512 in flight are more than one 64 bucket, so they are finished first: the first unit's
    # backward holds 512 gathered, 16 + 64 + its own 512: 1104. Counting buckets only, the 512
    # stayed in flight there too: 1616.
    assert _stage3_working_numel(LargeSmallLarge(), reduce_bucket_size=1, stage3_prefetch_bucket_size=0,
                                 stage3_max_reuse_distance=0) == 1104


def test_working_set_and_activations_are_added_where_each_unit_runs():
    """[Note: activations by unit]: the stage-3 replay adds each unit's activations to the working
    set it holds while that unit runs. Without prefetch or keeps, layers.0's forward holds the root
    (35 elements padded to 48 at N = 2) and itself (128): 176 fp32 elements."""
    bare = WorkingSettings(stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0)

    def row(activations):
        return estimate_model_states(Toy(), num_gpus_per_node=2, dtype="fp32", stages=(3,), persistence_threshold=0,
                                     working=bare, activations=activations)[0]

    def only(unit, phase):
        units = ("layers.0", "layers.1", "layers.2", "<root>")
        return {**{(u, p): 0 for u in units for p in ("forward", "backward")}, (unit, phase): 10_000}

    working = row(None).working_bytes
    assert row({}).working_and_activations == working
    assert row(only("layers.0", "forward")).working_and_activations == 176 * 4 + 10_000 < working + 10_000
    # The same activations during layers.0's backward, the last unit's: it is gathered again (128),
    # every gradient is still whole (the root's 48 and three layers' 128: one bucket of B holds them
    # all, reduced once the last unit is done), and autograd's copy of its weight (100).
    assert row(only("layers.0", "backward")).working_and_activations == (128 + 48 + 3 * 128 + 100) * 4 + 10_000
    # A unit the activations do not name gets their largest figure: every unit, so the two peaks add.
    assert row({("<root>", "forward"): 10_000}).working_and_activations == working + 10_000


def test_deepspeeds_zero3_estimate_is_restated_exactly(monkeypatch):
    """The column beside the stage-3 rows equals DeepSpeed's own function on the same model (a
    GPT-2 with tied embeddings, counted once) for each offload choice and node layout."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # DeepSpeed's accelerator detection, quietly
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs, model_to_params

    from hf_zero.estimator import deepspeed_zero3_estimate, human_bytes
    from tests.tiny_models import tiny_gpt2

    model = tiny_gpt2()
    total, largest = model_to_params(model)  # real tensors: its data_ptr dedup works here
    assert total == sum(p.numel() for p in model.parameters()) and model.lm_head.weight is model.transformer.wte.weight
    for gpus, nodes in ((8, 1), (4, 2)):
        for offload_optimizer, offload_param in ((False, False), (True, False), (True, True)):
            cpu, gpu, _ = estimate_zero3_model_states_mem_needs(total, largest, gpus, nodes, offload_optimizer,
                                                                offload_param, zero_init=True)
            assert deepspeed_zero3_estimate(model, gpus, nodes, offload_optimizer, offload_param) == (gpu, cpu)
    table = format_table(estimate_model_states(model, 4, 2, stages=(1, 3)), model)
    gpu = estimate_zero3_model_states_mem_needs(total, largest, 4, 2, False, False, zero_init=True)[1]
    assert f"| {human_bytes(gpu)}, " in table.splitlines()[4]  # the first stage-3 row
