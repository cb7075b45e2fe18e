"""hf_zero.config: loading real DeepSpeed configs, "auto" resolution, typed access, defaults."""

from __future__ import annotations

import copy
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_zero.config import HfZeroConfig, HfZeroConfigError
from hf_zero.config import hf_zero_config

# transformers tests/deepspeed/ds_config_zero2.json (the "auto" template from the docs).
DS_ZERO2 = """{
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": true},
        "allgather_partitions": true,
        "allgather_bucket_size": 2e8,
        "overlap_comm": true,
        "reduce_scatter": true,
        "reduce_bucket_size": 2e8,
        "contiguous_gradients": true
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": false
}"""

# transformers tests/deepspeed/ds_config_zero3.json.
DS_ZERO3 = """{
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": true},
        "offload_param": {"device": "cpu", "pin_memory": true},
        "overlap_comm": true,
        "contiguous_gradients": true,
        "sub_group_size": 1e14,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_fp16_weights_on_model_save": true
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": false
}"""

# The docs' ZeRO-3 without offload, as LLaMA-Factory ships it (ds_z3_config.json).
LLAMA_FACTORY_Z3 = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_allow_untested_optimizer": True,
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": False,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
}

# transformers' resolved output of AUTO_EXAMPLE (research exp1, one rank: a --deepspeed Trainer
# run's config as transformers and Accelerate filled it), kept with the tests so they run in any
# checkout.
RESOLVED_EXAMPLE = (Path(__file__).parent / "data" / "hf_resolved_config_example.json").read_text()

# The same config before transformers filled it: every key it fills is "auto".
AUTO_EXAMPLE = """{
 "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
 "gradient_clipping": "auto", "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
 "amp": {"enabled": "auto"},
 "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
 "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
               "warmup_num_steps": "auto", "total_num_steps": "auto"}},
 "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
   "stage3_param_persistence_threshold": "auto", "stage3_gather_16bit_weights_on_model_save": "auto"},
 "steps_per_print": Infinity
}"""

TRAINER_VALUES: dict[str, Any] = dict(
    hidden_size=768, lr=3e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1,
    train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2, gradient_clipping=0.5,
    warmup_num_steps=10, total_num_steps=100, warmup_max_lr=3e-4, warmup_min_lr=0, bf16=True, fp16=False,
)  # fmt: skip


def _write(tmp_path: Path, text: str, name: str = "ds_config.json") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ---- real configs load unchanged ------------------------------------------------------------


@pytest.mark.parametrize("text", [DS_ZERO2, DS_ZERO3], ids=["zero2", "zero3"])
def test_hf_docs_configs_load_unchanged(tmp_path: Path, text: str) -> None:
    path = _write(tmp_path, text)
    config = HfZeroConfig(path)
    assert config.to_dict() == json.loads(text) | _normalised_aliases(json.loads(text))
    assert "optimizer.params.lr" in config.auto_keys()
    resolved = config.resolve(world_size=2, **TRAINER_VALUES | {"bf16": False, "fp16": True})
    assert resolved.train_batch_size == 16
    assert resolved.fp16.enabled and resolved.compute_dtype == torch.float16
    assert resolved.zero.offloads_optimizer


def _normalised_aliases(raw: dict[str, Any]) -> dict[str, Any]:
    """The deprecated stage3_gather_fp16_weights_on_model_save is stored under its current name."""
    zero = dict(raw["zero_optimization"])
    if "stage3_gather_fp16_weights_on_model_save" in zero:
        zero["stage3_gather_16bit_weights_on_model_save"] = zero.pop("stage3_gather_fp16_weights_on_model_save")
    return {"zero_optimization": zero}


def test_zero3_without_offload_loads_and_resolves() -> None:
    config = HfZeroConfig(LLAMA_FACTORY_Z3)
    assert config.is_zero3() and config.zero.overlap_comm is False
    assert config.zero.stage3_max_live_parameters == 1_000_000_000
    resolved = config.resolve(world_size=4, **TRAINER_VALUES)
    assert resolved.zero.reduce_bucket_size == 768**2
    assert resolved.zero.stage3_prefetch_bucket_size == int(0.9 * 768**2)
    assert resolved.zero.stage3_param_persistence_threshold == 7680
    assert resolved.zero.stage3_gather_16bit_weights_on_model_save is True  # not "auto": kept
    assert (resolved.train_micro_batch_size_per_gpu, resolved.gradient_accumulation_steps, resolved.train_batch_size) == (4, 2, 32)


def test_default_valued_unimplemented_keys_load() -> None:
    """A config listing not-implemented features at their off values is fine."""
    config = HfZeroConfig(
        {
            "zero_optimization": {
                "stage": 2,
                "offload_optimizer": {"device": "none", "ratio": 1.0, "super_offload": False},
                "zero_quantized_weights": False,
                "zero_hpz_partition_size": 1,
                "stage3_module_granularity_threshold": 0,
                "round_robin_gradients": True,
            },
            "fp16": {"enabled": False, "auto_cast": False},
            "bf16": {"enabled": True, "immediate_grad_update": False, "bf16_master_weights_and_grads": False},
            "amp": {"enabled": False, "opt_level": "O1"},
            "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False, "number_checkpoints": None},
            "flops_profiler": {"enabled": False, "profile_step": 1},
            "tensorboard": {"enabled": False, "output_path": "tb/"},
            "wandb": {"enabled": False},
            "csv_monitor": {"enabled": False},
            "comms_logger": {"enabled": False},
            "checkpoint": {"load_universal": False, "use_node_local_storage": False, "tag_validation": "warn"},
            "torch_autocast": {"enabled": False},
            "pipeline": {"stages": "auto", "partition": "best"},
            "elasticity": {"enabled": False, "max_train_batch_size": 2000},
            "compression_training": {"weight_quantization": {"shared_parameters": {"enabled": False}}},
            "data_efficiency": {"enabled": False},
            "sparse_gradients": False,
            "train_micro_batch_size_per_gpu": 2,
        }
    )
    assert config.stage == 2 and config.bf16.enabled
    assert "zero_optimization.round_robin_gradients" in config.no_effect_keys()


def test_gated_unimplemented_key_is_fine_while_its_feature_is_off() -> None:
    # auto_cast only matters when fp16 is on; fp16 is off here.
    assert not HfZeroConfig({"fp16": {"enabled": False, "auto_cast": True}}).fp16.enabled


def test_gated_key_under_auto_is_checked_at_resolve() -> None:
    config = HfZeroConfig({"fp16": {"enabled": "auto", "auto_cast": True}})
    assert config.resolve(fp16=False).fp16.enabled is False
    with pytest.raises(HfZeroConfigError) as info:
        config.resolve(fp16=True)
    assert [p.path for p in info.value.problems] == ["fp16.auto_cast"]


# ---- loading --------------------------------------------------------------------------------


def test_infinity_json_and_copy(tmp_path: Path) -> None:
    config = HfZeroConfig(_write(tmp_path, '{"steps_per_print": Infinity, "train_micro_batch_size_per_gpu": 1}'))
    assert config.steps_per_print is None
    assert config.to_dict()["steps_per_print"] is None
    json.dumps(config.to_dict(), allow_nan=False)  # strict JSON
    clone = HfZeroConfig(config)
    assert clone.to_dict() == config.to_dict() and clone is not config


def test_inline_json_and_pathlike(tmp_path: Path) -> None:
    assert HfZeroConfig('{"zero_optimization": {"stage": 1}}').stage == 1
    assert HfZeroConfig(str(_write(tmp_path, '{"zero_optimization": {"stage": 2}}'))).stage == 2


def test_missing_file_names_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(HfZeroConfigError, match="nope.json") as info:
        HfZeroConfig(missing)
    assert info.value.problems[0].rule == "config file not found"


def test_invalid_json_names_the_file_and_line(tmp_path: Path) -> None:
    path = _write(tmp_path, '{\n  "zero_optimization": {"stage": 2,,},\n}', "broken.json")  # neither JSON nor hjson
    with pytest.raises(HfZeroConfigError) as info:
        HfZeroConfig(path)
    (problem,) = info.value.problems
    assert problem.path == str(path) and "line 2" in problem.rule


def test_duplicate_json_keys_are_problems(tmp_path: Path) -> None:
    with pytest.raises(HfZeroConfigError) as info:
        HfZeroConfig(_write(tmp_path, '{"zero_optimization": {"stage": 1, "stage": 2}}'))
    assert info.value.problems[0].path == "zero_optimization.stage"


def test_callers_dict_is_never_modified() -> None:
    raw = json.loads(AUTO_EXAMPLE)
    raw["zero_optimization"]["prefetch_bucket_size"] = raw["zero_optimization"].pop("stage3_prefetch_bucket_size")
    raw["zero_optimization"]["sub_group_size"] = 1e9
    snapshot = copy.deepcopy(raw)
    config = HfZeroConfig(raw)
    resolved = config.resolve(world_size=1, **TRAINER_VALUES)
    assert raw == snapshot
    assert resolved.to_dict()["zero_optimization"]["sub_group_size"] == 1_000_000_000
    assert config.auto_keys() and not resolved.auto_keys()  # resolve returned a new object


def test_wrong_argument_type() -> None:
    with pytest.raises(TypeError, match="expects a path"):
        HfZeroConfig(42)  # type: ignore[arg-type]


# ---- "auto" resolution ----------------------------------------------------------------------


def test_resolves_transformers_example_exactly() -> None:
    """transformers' resolved config (HfTrainerDeepSpeedConfig's output for one rank)."""
    config = HfZeroConfig(AUTO_EXAMPLE)
    resolved = config.resolve(world_size=1, **TRAINER_VALUES)
    expected = json.loads(RESOLVED_EXAMPLE)
    expected["amp"]["enabled"] = False  # transformers leaves it "auto"; hf_zero resolves it to false
    expected["steps_per_print"] = None  # Infinity: to_dict() is strict JSON
    assert resolved.to_dict() == expected
    assert resolved.compute_dtype == torch.bfloat16 and resolved.gradient_clipping == 0.5


def test_brief_world_size_two_doubles_train_batch_size() -> None:
    # The same values at world_size=2: train_batch_size = 4 * 2 * 2, not the example's 8.
    resolved = HfZeroConfig(AUTO_EXAMPLE).resolve(world_size=2, **TRAINER_VALUES)
    assert resolved.train_batch_size == 16
    assert resolved.to_dict()["train_batch_size"] == 16


@pytest.mark.parametrize(
    ("given", "world", "expected"),
    [
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 3, (4, 2, 24)),
        ({"train_micro_batch_size_per_gpu": 4, "train_batch_size": 24}, 3, (4, 2, 24)),
        ({"gradient_accumulation_steps": 2, "train_batch_size": 24}, 3, (4, 2, 24)),
        ({"train_batch_size": 24}, 3, (8, 1, 24)),
        ({"train_micro_batch_size_per_gpu": 4}, 3, (4, 1, 12)),
        ({}, 3, (1, 1, 3)),
    ],
)
def test_batch_triple_deepspeed_way(given: dict[str, int], world: int, expected: tuple[int, int, int]) -> None:
    resolved = HfZeroConfig(given).resolve(world_size=world)
    got = (resolved.train_micro_batch_size_per_gpu, resolved.gradient_accumulation_steps, resolved.train_batch_size)
    assert got == expected


def test_batch_defaults_are_said_in_the_summary() -> None:
    resolved = HfZeroConfig({}).resolve(world_size=2)
    assert "using train_micro_batch_size_per_gpu=1 and gradient_accumulation_steps=1" in resolved.summary()


def test_batch_from_resolve_arguments_when_keys_absent() -> None:
    resolved = HfZeroConfig({}).resolve(world_size=2, train_micro_batch_size_per_gpu=3, gradient_accumulation_steps=5)
    assert (resolved.train_micro_batch_size_per_gpu, resolved.gradient_accumulation_steps, resolved.train_batch_size) == (3, 5, 30)


def test_batch_without_world_size() -> None:
    config = HfZeroConfig({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2})
    assert config.train_batch_size is None  # needs the world size
    assert config.resolve(world_size=2).train_batch_size == 16


def test_resolve_keeps_non_auto_values_and_fills_only_auto() -> None:
    config = HfZeroConfig({"optimizer": {"type": "adamw", "params": {"lr": 1e-3, "eps": "auto"}}})
    resolved = config.resolve(lr=5e-5, eps=1e-6)
    assert resolved.optimizer.lr == 1e-3 and resolved.optimizer.eps == 1e-6
    assert resolved.optimizer.type == "AdamW"


def test_amp_auto_resolves_to_false() -> None:
    assert HfZeroConfig({"amp": {"enabled": "auto"}}).resolve().to_dict()["amp"] == {"enabled": False}


def test_gather_16bit_auto_takes_given_value_else_false() -> None:
    config = HfZeroConfig({"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": "auto"}})
    assert config.resolve().zero.stage3_gather_16bit_weights_on_model_save is False
    assert config.resolve(stage3_gather_16bit_weights_on_model_save=True).zero.stage3_gather_16bit_weights_on_model_save is True


def test_resolve_rejects_unknown_keywords() -> None:
    with pytest.raises(TypeError, match="learning_rate"):
        HfZeroConfig({}).resolve(learning_rate=1e-3)


def test_check_mismatches_accepts_agreeing_values() -> None:
    config = HfZeroConfig({"optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.999]}}, "gradient_clipping": 1})
    resolved = config.resolve(check_mismatches=True, lr=3e-4, betas=(0.9, 0.999), gradient_clipping=1.0, eps=None)
    assert resolved.optimizer.betas == (0.9, 0.999)


# ---- typed access ---------------------------------------------------------------------------


def test_typed_access_on_auto_raises_naming_the_key() -> None:
    config = HfZeroConfig(AUTO_EXAMPLE)
    reads = {
        "gradient_clipping": lambda: config.gradient_clipping,
        "optimizer.params.lr": lambda: config.optimizer.lr,
        "fp16.enabled": lambda: config.fp16.enabled,
        "zero_optimization.reduce_bucket_size": lambda: config.zero.reduce_bucket_size,
        "train_batch_size": lambda: config.train_batch_size,
        "scheduler.params.warmup_min_lr": lambda: config.scheduler.params,
    }
    for path, read in reads.items():
        with pytest.raises(RuntimeError, match=rf"{path} is still \"auto\".*resolve"):
            read()
    assert config.zero.stage == 3  # non-auto fields read fine
    assert "'auto'" in repr(config.zero)  # repr never raises


def test_compute_dtype_needs_resolved_precision() -> None:
    with pytest.raises(RuntimeError, match="fp16.enabled"):
        HfZeroConfig({"fp16": {"enabled": "auto"}}).compute_dtype  # noqa: B018


def test_deepspeed_defaults() -> None:
    """Absent keys read DeepSpeed 0.19's defaults (its runtime/*config.py and constants.py)."""
    config = HfZeroConfig({})
    zero = config.zero
    assert (zero.stage, zero.contiguous_gradients, zero.reduce_scatter, zero.overlap_comm) == (0, True, True, False)
    assert (zero.reduce_bucket_size, zero.allgather_bucket_size, zero.allgather_partitions) == (5e8, 5e8, True)
    assert (zero.stage3_prefetch_bucket_size, zero.stage3_param_persistence_threshold) == (5e7, 1e5)
    assert (zero.stage3_max_live_parameters, zero.stage3_max_reuse_distance, zero.sub_group_size) == (1e9, 1e9, 1e9)
    assert zero.stage3_model_persistence_threshold == sys.maxsize
    assert zero.stage3_gather_16bit_weights_on_model_save is False and zero.ignore_unused_parameters is True
    assert zero.zero_hpz_partition_size == 1 and not zero.zero_quantized_weights and zero.wrap_modules is None
    assert zero.offload_param is None and zero.offload_optimizer is None
    fp16 = config.fp16
    assert (fp16.enabled, fp16.loss_scale, fp16.initial_scale_power, fp16.loss_scale_window) == (False, 0, 16, 1000)
    assert (fp16.hysteresis, fp16.consecutive_hysteresis, fp16.min_loss_scale) == (2, False, 1)
    assert config.bf16.enabled is False
    assert config.gradient_clipping == 1.0
    assert config.steps_per_print is None and config.wall_clock_breakdown is False
    assert config.zero_allow_untested_optimizer is False
    assert config.optimizer is None and config.scheduler is None
    assert (config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) == (1, 1)
    assert config.communication_data_type == "fp32" and config.compute_dtype == torch.float32


def test_overlap_comm_default_is_true_for_stage_3_only() -> None:
    assert HfZeroConfig({"zero_optimization": {"stage": 3}}).zero.overlap_comm is True
    assert HfZeroConfig({"zero_optimization": {"stage": 2}}).zero.overlap_comm is False
    assert HfZeroConfig({"zero_optimization": {"stage": 3, "overlap_comm": False}}).zero.overlap_comm is False


def test_offload_defaults() -> None:
    zero = HfZeroConfig({"zero_optimization": {"stage": 3, "offload_param": {}, "offload_optimizer": {"device": "none"}}}).zero
    param, optim = zero.offload_param, zero.offload_optimizer
    assert (param.device, param.buffer_count, param.buffer_size, param.max_in_cpu, param.pin_memory) == ("none", 5, 1e8, 1e9, True)
    assert (optim.device, optim.buffer_count, optim.ratio, optim.pin_memory, optim.nvme_path) == ("none", 4, 1.0, True, None)
    assert not zero.offloads_optimizer and not zero.offloads_params


def test_optimizer_type_and_decoupled_weight_decay() -> None:
    def optimizer(**section: Any) -> Any:
        return HfZeroConfig({"optimizer": section}).optimizer

    adam = optimizer(type="adam")
    assert (adam.type, adam.lr, adam.betas, adam.eps, adam.weight_decay) == ("Adam", 1e-3, (0.9, 0.999), 1e-8, 0.0)
    assert adam.adam_w_mode and adam.decoupled_weight_decay  # DeepSpeed's Adam is AdamW by default
    assert not optimizer(type="Adam", params={"adam_w_mode": False}).decoupled_weight_decay
    assert optimizer(type="ADAMW", params={"adam_w_mode": False}).decoupled_weight_decay
    assert optimizer(type="AdamW", params={"torch_adam": True}).torch_adam


def test_scheduler_params_get_deepspeed_defaults() -> None:
    scheduler = HfZeroConfig({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}}).scheduler
    assert scheduler.type == "WarmupLR"
    assert scheduler.params == {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001, "warmup_num_steps": 5, "warmup_type": "log", "last_batch_iteration": -1}
    cosine = HfZeroConfig({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 9}}}).scheduler
    assert cosine.params["cos_min_ratio"] == 0.0001 and cosine.params["warmup_min_ratio"] == 0.0


def test_aliases_are_normalised() -> None:
    config = HfZeroConfig({"zero_optimization": {"stage": 3, "prefetch_bucket_size": 7, "max_live_parameters": 9}, "bfloat16": {"enabled": True}})
    assert config.zero.stage3_prefetch_bucket_size == 7 and config.zero.stage3_max_live_parameters == 9
    assert config.bf16.enabled
    assert "bf16" in config.to_dict() and "bfloat16" not in config.to_dict()


def test_ints_written_as_floats() -> None:
    config = HfZeroConfig({"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8, "allgather_bucket_size": 2e8}})
    assert config.zero.reduce_bucket_size == 500_000_000 and isinstance(config.zero.reduce_bucket_size, int)


def test_wrap_modules() -> None:
    config = HfZeroConfig({"zero_optimization": {"stage": 3, "wrap_modules": ["LlamaDecoderLayer"]}})
    assert config.zero.wrap_modules == ["LlamaDecoderLayer"]


# ---- precision policy and summary -----------------------------------------------------------


@pytest.mark.parametrize(
    ("section", "stage", "compute", "reduce", "accum"),
    [
        ({"bf16": {"enabled": True}}, 3, torch.bfloat16, torch.bfloat16, torch.float32),
        ({"bf16": {"enabled": True}}, 1, torch.bfloat16, torch.bfloat16, torch.float32),
        ({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}}, 1, torch.bfloat16, torch.bfloat16,
         torch.bfloat16),
        ({"fp16": {"enabled": True}}, 2, torch.float16, torch.float16, torch.float32),
        ({"bf16": {"enabled": True}, "communication_data_type": "FP32"}, 0, torch.bfloat16, torch.float32, torch.float32),
        ({}, 2, torch.float32, torch.float32, torch.float32),
    ],
)
def test_precision_policy(section: dict[str, Any], stage: int, compute: torch.dtype, reduce: torch.dtype, accum: torch.dtype) -> None:
    config = HfZeroConfig({**section, "zero_optimization": {"stage": stage}})
    policy = config.precision_policy()
    assert (policy["compute_dtype"], policy["reduce_dtype"], policy["grad_accum_dtype"]) == (compute, reduce, accum)
    assert policy["master_dtype"] == torch.float32 == config.master_dtype
    assert config.reduce_dtype == reduce


def test_torch_autocast_keeps_fp32_weights_and_takes_the_precision_asked_for() -> None:
    """[Note: torch_autocast]: fp32 everywhere but the forward; --bf16 ("auto") means the autocast."""
    config = HfZeroConfig({"torch_autocast": {"enabled": True}, "bf16": {"enabled": "auto"},
                           "fp16": {"enabled": "auto"}, "zero_optimization": {"stage": 3}})
    resolved = config.resolve(bf16=True, fp16=False)
    assert resolved.autocast_dtype == torch.bfloat16
    policy = resolved.precision_policy()
    assert (policy["compute_dtype"], policy["reduce_dtype"], policy["master_dtype"]) == (torch.float32,) * 3
    assert resolved.get_value("bf16.enabled") is False
    spelled = HfZeroConfig({"torch_autocast": {"enabled": True, "dtype": "BFloat16"}})
    assert spelled.autocast_dtype == torch.bfloat16
    assert HfZeroConfig({"torch_autocast": {"enabled": False, "dtype": "float16"}}).autocast_dtype is None
    # --fp16 with a null dtype autocasts to float16, with GradScaler's loss scale.
    half = config.resolve(bf16=False, fp16=True)
    assert half.autocast_dtype == torch.float16 and half.get_value("torch_autocast.dtype") == "float16"
    assert half.precision_policy()["loss_scaling"] == {"mode": "dynamic", "initial_scale": 65536.0, "window": 1999,
                                                       "hysteresis": 1, "consecutive_hysteresis": False, "min_scale": 1.0}
    assert resolved.precision_policy()["loss_scaling"] is None  # bf16 autocast needs none
    assert config.get_value("torch_autocast.dtype") is None  # resolving copies; the original is untouched
    for written, asked in (("bfloat16", {"fp16": True}), ("half", {"bf16": True})):
        other = HfZeroConfig({"torch_autocast": {"enabled": True, "dtype": written}, "bf16": {"enabled": "auto"},
                              "fp16": {"enabled": "auto"}})
        with pytest.raises(HfZeroConfigError, match=f"was asked for .*the config autocasts to .*write null"):
            other.resolve(**{"bf16": False, "fp16": False, **asked})


@pytest.mark.parametrize(("section", "message"), [
    ({"bf16": {"enabled": True}}, "bf16.enabled = True: cannot be enabled with torch_autocast"),
    ({"fp16": {"enabled": True}}, "fp16.enabled = True: cannot be enabled with torch_autocast"),
    ({"torch_autocast": {"enabled": True, "dtype": "fp32"}}, "autocast to float32 changes nothing"),
    ({"torch_autocast": {"enabled": True, "dtype": "int8"}}, "torch_autocast.dtype = 'int8': must be one of"),
])
def test_torch_autocast_refuses_what_it_cannot_be(section: dict[str, Any], message: str) -> None:
    with pytest.raises(HfZeroConfigError, match=message):
        HfZeroConfig({"torch_autocast": {"enabled": True}, **section} if "torch_autocast" not in section else section)


def test_loss_scaling_policy() -> None:
    dynamic = HfZeroConfig({"fp16": {"enabled": True, "initial_scale_power": 12}}).precision_policy()["loss_scaling"]
    assert dynamic == {"mode": "dynamic", "initial_scale": 4096.0, "window": 1000, "hysteresis": 2, "consecutive_hysteresis": False, "min_scale": 1.0}
    static = HfZeroConfig({"fp16": {"enabled": True, "loss_scale": 128}}).precision_policy()["loss_scaling"]
    assert static == {"mode": "static", "scale": 128.0}
    assert HfZeroConfig({"bf16": {"enabled": True}}).precision_policy()["loss_scaling"] is None


def test_summary_and_log_summary(caplog: pytest.LogCaptureFixture) -> None:
    resolved = HfZeroConfig(LLAMA_FACTORY_Z3).resolve(world_size=2, **TRAINER_VALUES)
    text = resolved.summary()
    for needle in ("ZeRO stage 3", "compute dtype:           torch.bfloat16", "grad accumulation dtype: torch.float32",
                   "zero_optimization.contiguous_gradients", '"train_batch_size": 16'):  # fmt: skip
        assert needle in text
    with caplog.at_level(logging.INFO, logger="hf_zero"):
        resolved.log_summary(rank=1)
        assert not caplog.records
        resolved.log_summary(rank=0, run="world size 2 on cpu (gloo), 3 units")
    assert len(caplog.records) == 1
    line = caplog.records[0].getMessage()
    assert line.startswith("hf_zero: ZeRO stage 3, world size 2 on cpu (gloo), 3 units; batch: train_batch_size=16")
    assert "precision: compute dtype: torch.bfloat16, master weights dtype: torch.float32" in line


def test_summary_of_unresolved_config_does_not_raise() -> None:
    text = HfZeroConfig(AUTO_EXAMPLE).summary()
    assert "unresolved" in text and 'still "auto"' in text


def test_no_effect_keys_are_logged_once(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    # "Once" is per process: start from a process that has logged nothing yet, as rank 0.
    monkeypatch.setattr(hf_zero_config, "_LOGGED_NO_EFFECT", set())
    monkeypatch.delenv("RANK", raising=False)
    config = {"zero_optimization": {"stage": 1, "use_multi_rank_bucket_allreduce": False}}
    with caplog.at_level(logging.INFO, logger="hf_zero"):
        HfZeroConfig(config)
        HfZeroConfig(config)
    lines = [r.getMessage() for r in caplog.records if "use_multi_rank_bucket_allreduce" in r.getMessage()]
    assert len(lines) == 1, lines
    assert HfZeroConfig(config).no_effect_keys() == {"zero_optimization.use_multi_rank_bucket_allreduce": "a speed hint; the math is unchanged"}
    with caplog.at_level(logging.INFO, logger="hf_zero"):  # at DeepSpeed's default it asks for nothing: no line
        HfZeroConfig({"zero_optimization": {"stage": 1, "contiguous_gradients": True}})
    assert not [r for r in caplog.records if "contiguous_gradients" in r.getMessage()]


def test_to_dict_round_trips() -> None:
    resolved = HfZeroConfig(AUTO_EXAMPLE).resolve(world_size=1, **TRAINER_VALUES)
    again = HfZeroConfig(json.loads(json.dumps(resolved.to_dict())))
    assert again.to_dict() == resolved.to_dict() and not again.auto_keys()
    assert math.isclose(again.optimizer.lr, 3e-4)


def test_per_parameter_group_warmup_lrs() -> None:
    """DeepSpeed's warmup schedulers take one LR per parameter group as a list."""
    config = HfZeroConfig({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": [1e-3, 2e-3], "total_num_steps": 10}}})
    assert config.scheduler.params["warmup_max_lr"] == [1e-3, 2e-3]
    with pytest.raises(HfZeroConfigError, match="warmup_max_lr"):
        HfZeroConfig({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": [1e-3, -1.0]}}})
