"""[Note: sharding policy]: a DeepSpeed stage is a named preset of ShardingPolicy's fields, the
config resolves to one policy, and the engine decides on the fields, never on the stage. In one
process (world size 1, no process group)."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest
import torch

import hf_zero
from hf_zero.config import HfZeroConfig
from hf_zero.engine.sharding.flat_group import FlatParamGroup, GroupKind
from hf_zero.engine.policy import BUCKETS_IN_FLIGHT, ShardingPolicy
from hf_zero.engine.sharding.param_storage import StorageState
from hf_zero.comm import Communicator
from tests.tiny_models import batch_for_step, tiny_gpt2

FIELDS = ("shards_optimizer_state", "shards_gradients", "shards_params", "reshard_after_forward")
PRESETS = {  # the table in [Note: sharding policy]
    0: (False, False, False, False),
    1: (True, False, False, False),
    2: (True, True, False, False),
    3: (True, True, True, True),
}


@pytest.fixture
def no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


# ---------------------------------------------------------------------------- presets
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_each_stage_is_a_preset(stage: int) -> None:
    policy = ShardingPolicy.for_stage(stage, overlap_comm=True, persistence_threshold=7, prefetch_numel=11,
                                      max_reuse_numel=13)
    assert tuple(getattr(policy, f) for f in FIELDS) == PRESETS[stage]
    assert policy.preset_stage == stage
    # The stage-3 knobs are off below stage 3, as DeepSpeed ignores them there.
    knobs = (policy.persistence_threshold, policy.prefetch_numel, policy.max_reuse_numel)
    assert knobs == ((7, 11, 13) if stage == 3 else (0, 0, 0))


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_reductions_in_flight_are_bounded_by_the_buckets_except_at_stage_2(stage: int) -> None:
    for overlap in (False, True):
        assert ShardingPolicy.for_stage(stage, overlap_comm=overlap).reductions_in_flight == BUCKETS_IN_FLIGHT
    # Stage 2: overlap_comm keeps one reduction in flight; without it each is done at once.
    assert ShardingPolicy.for_stage(2, overlap_comm=True).reductions_in_flight == 1
    assert ShardingPolicy.for_stage(2, overlap_comm=False).reductions_in_flight == 0


def test_the_config_resolves_to_its_stage_preset_with_its_knobs() -> None:
    config = HfZeroConfig({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 5, "stage3_prefetch_bucket_size": 6,
        "stage3_max_reuse_distance": 8}}).resolve(world_size=2)
    assert ShardingPolicy.from_config(config) == ShardingPolicy.for_stage(
        3, overlap_comm=True, persistence_threshold=5, prefetch_numel=6, max_reuse_numel=8)
    stage2 = HfZeroConfig({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}).resolve(world_size=2)
    assert ShardingPolicy.from_config(stage2) == ShardingPolicy.for_stage(2)  # overlap_comm defaults off at stage 2


def test_a_policy_is_frozen_and_refuses_what_no_code_path_means() -> None:
    policy = ShardingPolicy.for_stage(3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.shards_params = False  # type: ignore[misc]
    with pytest.raises(ValueError, match="stage 4"):
        ShardingPolicy.for_stage(4)
    for wrong in (dict(shards_optimizer_state=False), dict(shards_gradients=False),
                  dict(shards_params=False), dict(reductions_in_flight=-1)):
        with pytest.raises(ValueError):
            dataclasses.replace(policy, **wrong)
    with pytest.raises(ValueError, match="need shards_params"):
        dataclasses.replace(ShardingPolicy.for_stage(2), prefetch_numel=1)
    custom = dataclasses.replace(policy, reshard_after_forward=False)
    assert custom.preset_stage is None  # no stage names it


def test_no_engine_code_below_initialize_compares_a_stage() -> None:
    """The stage is read once, where the config becomes a policy (ShardingPolicy.for_stage)."""
    engine_dir = pathlib.Path(hf_zero.__file__).parent / "engine"
    comparison = re.compile(r"stage\s*(==|>=|!=|<=|<|>)")
    found = [f"{path.name}:{number}: {line.strip()}"
             for path in sorted(engine_dir.glob("*.py")) if path.name != "policy.py"
             for number, line in enumerate(path.read_text().splitlines(), 1) if comparison.search(line)]
    assert found == []


# ---------------------------------------------------------------------------- the fields drive the code
def test_a_flat_group_shards_what_its_policy_says() -> None:
    """The same group under hand-built policies: FlatParamGroup reads the fields, not a stage."""
    def group(policy: ShardingPolicy) -> FlatParamGroup:
        model = torch.nn.Linear(4, 3)
        return FlatParamGroup("g#0", list(model.named_parameters()), GroupKind(True, False, 0), Communicator(),
                              policy, torch.float32, torch.device("cpu"))

    sharded = ShardingPolicy(shards_optimizer_state=True, shards_gradients=True, shards_params=True,
                             reshard_after_forward=True)
    g = group(sharded)
    assert g.storage.sharded_between_uses and not g.storage.is_unsharded  # only the shard is left after construction
    assert g.grads.full is not None and not g.grads.has_grads()  # the full gradients come and go

    g = group(dataclasses.replace(sharded, shards_params=False, reshard_after_forward=False))
    assert not g.storage.sharded_between_uses and g.storage.is_unsharded

    replicated = ShardingPolicy(shards_optimizer_state=False, shards_gradients=False, shards_params=False,
                                reshard_after_forward=False)
    g = group(replicated)
    # Nothing sharded: the all-reduce's gradient buffer lives for the run and, in fp32, is the
    # gradient the optimizer reads.
    assert g.grads.has_grads() and g.master_state.tensor is not None and g.master_state.tensor.grad is g.grads.full


def _engine(monkeypatch: pytest.MonkeyPatch, **changes: object):
    """A stage-3 engine whose policy differs from the preset by ``changes``."""
    resolve = ShardingPolicy.from_config.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(ShardingPolicy, "from_config",
                        classmethod(lambda cls, config: dataclasses.replace(resolve(cls, config), **changes)))
    config = {"train_micro_batch_size_per_gpu": 2,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_max_reuse_distance": 0},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, *_ = hf_zero.initialize(model=tiny_gpt2(), config=config)
    return engine


def test_reshard_after_forward_is_what_the_protocol_reads(no_launcher_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stage 3 with a reuse distance of 0 frees every unit after its forward; the same policy
    with reshard_after_forward off keeps each unit whose backward reads its parameters gathered
    until that backward, and trains to the same numbers."""
    runs = {}
    for reshard in (True, False):
        engine = _engine(monkeypatch, reshard_after_forward=reshard)
        assert engine.stage == 3 and engine.policy.reshard_after_forward is reshard
        sharded = [u for u in engine.units[:-1] if u.sharded_numel and u.backward_reads_params]
        assert sharded
        losses = []
        for step in range(2):
            ids = batch_for_step(step, 2)
            loss = engine(input_ids=ids, labels=ids).loss
            after_forward = {u.param_state for u in sharded}
            assert after_forward == ({StorageState.SHARDED} if reshard else {StorageState.GATHERED})
            engine.backward(loss)
            engine.step()
            assert {u.param_state for u in sharded} == {StorageState.SHARDED}  # freed before the step
            losses.append(loss.item())
        with engine.gathered_parameters():
            runs[reshard] = (losses, [p.detach().clone() for p in engine.module.parameters()])
    assert runs[True][0] == runs[False][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[True][1], runs[False][1], strict=True))
