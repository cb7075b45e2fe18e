"""Pinned host memory: each offload section's ``pin_memory`` decides for its own state, and the
memory report counts the blocks torch's pinned allocator really hands out."""

from __future__ import annotations

import pytest

from hf_zero.config import HfZeroConfig
from hf_zero.engine.initialize import _offload_settings
from hf_zero.engine.policy import ShardingPolicy
from hf_zero.transfer import pinned_block_bytes


def _settings(zero: dict) -> object:
    config = HfZeroConfig({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, **zero},
                           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    resolved = config.resolve(world_size=2)
    return _offload_settings(resolved, None, ShardingPolicy.from_config(resolved))


@pytest.mark.parametrize("opt_pin,param_pin", [(True, False), (False, True), (False, False), (True, True)])
def test_each_offload_section_pins_its_own_state(opt_pin: bool, param_pin: bool) -> None:
    settings = _settings({"offload_optimizer": {"device": "cpu", "pin_memory": opt_pin},
                          "offload_param": {"device": "cpu", "pin_memory": param_pin}})
    assert (settings.pin_memory, settings.pin_params) == (opt_pin, param_pin)


def test_parameter_offload_alone_takes_its_own_pin_setting() -> None:
    settings = _settings({"offload_param": {"device": "cpu", "pin_memory": False}})
    assert settings.pin_params is False


@pytest.mark.parametrize("nbytes,block", [(0, 0), (1, 1), (4096, 4096), (3 << 20, 4 << 20), ((4 << 20) + 1, 8 << 20)])
def test_pinned_blocks_are_rounded_to_a_power_of_two(nbytes: int, block: int) -> None:
    assert pinned_block_bytes(nbytes) == block
