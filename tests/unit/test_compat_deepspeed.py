"""hf_zero.compat.deepspeed in one process ([Note: deepspeed.zero before initialize]): what
``zero.Init`` builds, what ``GatheredParameters`` reads, keeps and puts back before ``initialize``,
and the refusals. The 2-rank runs against real DeepSpeed are in
tests/integration/test_deepspeed_trainerless.py."""

from __future__ import annotations

import argparse

import pytest
import torch

import hf_zero.compat.deepspeed as deepspeed
from hf_zero.config import HfZeroConfig
from hf_zero.config.live import live_zero3_config
from tests.tiny_models import tiny_llama

ZERO3 = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
         "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


@pytest.fixture
def no_group(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def _from_config():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(tiny_llama().config)


def test_init_builds_the_model_sharded_only_inside_its_block(no_group: None) -> None:
    mine = HfZeroConfig({"zero_optimization": {"stage": 3}})  # the user's own live config
    with deepspeed.zero.Init(config_dict_or_path=ZERO3):
        model = _from_config()
        assert live_zero3_config() is not mine
    assert live_zero3_config() is mine  # given back at exit
    assert all(p.is_meta for p in model.parameters())
    del mine
    with deepspeed.zero.Init(config_dict_or_path=ZERO3, enabled=False):
        assert not any(p.is_meta for p in _from_config().parameters())
    with pytest.raises(NotImplementedError, match="pass the model to deepspeed.initialize"):
        deepspeed.zero.Init(module=torch.nn.Linear(2, 2))
    with pytest.raises(NotImplementedError, match="mpu"):
        deepspeed.zero.Init(mpu=object())


def test_gathered_parameters_before_initialize_read_and_put_back(no_group: None) -> None:
    with deepspeed.zero.Init(config_dict_or_path=ZERO3):
        model = _from_config()
    weight = model.lm_head.weight
    with deepspeed.zero.GatheredParameters(weight):
        assert not weight.is_meta and weight.shape == (97, 16)
        read = weight.detach().clone()
        assert read.abs().sum() > 0  # the model's own initialisation, not zeros
        weight.data.zero_()  # without modifier_rank a change is discarded, as in DeepSpeed
    assert torch.equal(weight.detach(), read)
    assert model.model.embed_tokens.weight.is_meta  # only what was asked for is read
    with deepspeed.zero.GatheredParameters(weight, modifier_rank=0):
        weight.data.fill_(0.5)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ZERO3)
    with deepspeed.zero.GatheredParameters(engine.module.lm_head.weight):  # after initialize: the engine's
        assert torch.all(engine.module.lm_head.weight == 0.5)


def test_initialize_takes_deepspeeds_arguments(no_group: None, tmp_path) -> None:
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}}')
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    model = tiny_llama()
    engine, optimizer, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    assert engine.zero_optimization_stage() == 0 and optimizer is not None
    with pytest.raises(NotImplementedError, match="drop mpu="):
        deepspeed.initialize(model=tiny_llama(), config=ZERO3, mpu=object())
    with pytest.raises(ValueError, match="needs a config"):
        deepspeed.initialize(model=tiny_llama())
