"""Every recipe config loads, validates, and resolves with typical launch values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_zero.config import HfZeroConfig

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
CONFIGS = sorted(RECIPES.glob("*.json"))
EXPECTED = {"zero1", "zero2", "zero3", "zero2_offload", "zero3_offload", "zero3_nvme",
            "zero2_bf16", "zero3_bf16", "zero2_fp16", "zero3_fp16"}
TYPICAL = dict(world_size=2, hidden_size=64, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2,
               gradient_clipping=1.0, fp16=False, bf16=False)


def test_the_recipe_set_is_complete() -> None:
    assert {p.stem for p in CONFIGS} == EXPECTED


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_recipe_validates_and_resolves(path: Path) -> None:
    config = HfZeroConfig(str(path))
    assert config.auto_keys(), "recipes leave launch-dependent values to \"auto\""
    resolved = config.resolve(**TYPICAL)
    assert resolved.is_resolved
    assert resolved.train_batch_size == 4 * 2 * 2
    stage = int(path.stem[4])
    assert resolved.stage == stage
    zero = resolved.zero
    if "offload" in path.stem:
        assert zero.offload_optimizer.device == "cpu"
        assert (zero.offload_param is not None and zero.offload_param.device == "cpu") == (stage == 3)
    if "nvme" in path.stem:  # ZeRO-Infinity: optimizer state and stage-3 parameters on NVMe
        assert zero.offload_optimizer.device == "nvme" and zero.offload_param.device == "nvme"
        assert zero.offload_param.max_in_cpu == 10**9 and zero.offload_param.buffer_size == 10**8
    assert resolved.bf16.enabled == path.stem.endswith("bf16")
    assert resolved.fp16.enabled == path.stem.endswith("fp16")
    if stage == 3:
        assert zero.stage3_param_persistence_threshold == 640


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_trainer_examples_use_the_same_configs(stage: int) -> None:
    example = json.loads((RECIPES / "examples" / f"zero{stage}.json").read_text())
    assert example == json.loads((RECIPES / f"zero{stage}.json").read_text())


def test_a_recipe_into_initialize_names_what_only_a_trainer_fills_and_the_call_that_does(monkeypatch) -> None:
    """Without a Trainer, a recipe's launch values are one problem naming them all; its fix works as written."""
    import torch

    import hf_zero
    from hf_zero.config import HfZeroConfigError
    from tests.tiny_models import tiny_gpt2

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    path = str(RECIPES / "zero3_bf16.json")
    model = tiny_gpt2()
    with pytest.raises(HfZeroConfigError) as raised:
        hf_zero.initialize(model=model, config=path, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    (problem,) = raised.value.problems
    assert problem.path == "train_micro_batch_size_per_gpu, gradient_accumulation_steps, train_batch_size, gradient_clipping"
    call = ("HfZeroConfig(path).resolve(hidden_size=model.config.hidden_size, world_size=torch.distributed"
            ".get_world_size(), train_micro_batch_size_per_gpu=..., gradient_accumulation_steps=..., gradient_clipping=...)")
    assert call in problem.fix
    config = hf_zero.HfZeroConfig(path).resolve(hidden_size=model.config.hidden_size, world_size=1,
                                               train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1,
                                               gradient_clipping=1.0)
    engine, *_ = hf_zero.initialize(model=model, config=config, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert engine.train_batch_size() == 2
