"""Bad configs: each raises ONE HfZeroConfigError whose .problems names every problem."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from hf_zero.config import MISSING, ConfigProblem, HfZeroConfig, HfZeroConfigError

NOT_IMPLEMENTED = "accepted by DeepSpeed, not implemented in hf_zero yet"


def _problems(config: Any, **resolve: Any) -> list[ConfigProblem]:
    with pytest.raises(HfZeroConfigError) as info:
        built = HfZeroConfig(config)
        if resolve:
            built.resolve(**resolve)
    error = info.value
    for problem in error.problems:  # the message lists every problem, one per line
        assert str(problem) in str(error)
    assert str(error).count("\n  - ") == len(error.problems)
    return error.problems


def _one(config: Any, **resolve: Any) -> ConfigProblem:
    (problem,) = _problems(config, **resolve)
    return problem


# ---- one problem each -----------------------------------------------------------------------


def test_top_level_typo_gets_did_you_mean() -> None:
    problem = _one({"micro_batch_size_per_gpu": 8})
    assert problem.path == "micro_batch_size_per_gpu" and problem.value == 8
    assert "unknown top-level key" in problem.rule and "silently" in problem.rule
    assert problem.fix == "did you mean 'train_micro_batch_size_per_gpu'?"


def test_nested_typo_gets_did_you_mean() -> None:
    problem = _one({"zero_optimization": {"stage": 2, "overlap_com": True}})
    assert problem.path == "zero_optimization.overlap_com"
    assert problem.fix == "did you mean 'overlap_comm'?"


@pytest.mark.parametrize(
    ("config", "path"),
    [
        ({"fp16": {"enabled": True, "loss_scale_windw": 100}}, "fp16.loss_scale_windw"),
        ({"zero_optimization": {"offload_param": {"devise": "none"}}}, "zero_optimization.offload_param.devise"),
        ({"optimizer": {"type": "AdamW", "params": {"learning_rate": 1e-3}}}, "optimizer.params.learning_rate"),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3, "total_num_steps": 10}}}, "scheduler.params.total_num_steps"),
        ({"checkpoint": {"load_universl": False}}, "checkpoint.load_universl"),
        ({"aio": {"queue_dept": 8}}, "aio.queue_dept"),
        ({"data_types": {"grad_acum_dtype": "fp32"}}, "data_types.grad_acum_dtype"),
        ({"amp": {"enabled": False, "opt_levl": "O1"}}, "amp.opt_levl"),
        ({"bf16": {"enable": True}}, "bf16.enable"),
    ],
)
def test_unknown_keys_at_any_depth(config: dict[str, Any], path: str) -> None:
    problem = _one(config)
    assert problem.path == path and "unknown" in problem.rule


def test_key_in_the_wrong_section_says_where_it_belongs() -> None:
    problem = _one({"stage3_max_live_parameters": 1e9})
    assert "zero_optimization.stage3_max_live_parameters" in problem.fix


@pytest.mark.parametrize(
    ("config", "path", "fix_part"),
    [
        ({"zero_optimization": {"stage": "3"}}, "zero_optimization.stage", "use 3"),
        ({"zero_optimization": {"reduce_bucket_size": "5e8"}}, "zero_optimization.reduce_bucket_size", "use 500000000"),
        ({"zero_optimization": {"contiguous_gradients": 1}}, "zero_optimization.contiguous_gradients", "write true"),
        ({"wall_clock_breakdown": "false"}, "wall_clock_breakdown", "without quotes"),
        ({"gradient_clipping": "1.0"}, "gradient_clipping", "use 1.0"),
        ({"train_micro_batch_size_per_gpu": 2.5}, "train_micro_batch_size_per_gpu", "whole number"),
        ({"optimizer": {"type": "AdamW", "params": {"betas": 0.9}}}, "optimizer.params.betas", "[0.9, 0.999]"),
        ({"zero_optimization": {"offload_optimizer": {"device": "CPU"}}}, "zero_optimization.offload_optimizer.device", "did you mean 'cpu'?"),
        ({"fp16": None}, "fp16", "remove the key"),
    ],
)
def test_wrong_types(config: dict[str, Any], path: str, fix_part: str) -> None:
    problem = _one(config)
    assert problem.path == path and fix_part in problem.fix


@pytest.mark.parametrize(
    ("config", "path"),
    [
        ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage"),
        ({"zero_optimization": {"reduce_bucket_size": -1}}, "zero_optimization.reduce_bucket_size"),
        ({"fp16": {"loss_scale_window": 0}}, "fp16.loss_scale_window"),
        ({"fp16": {"hysteresis": 0}}, "fp16.hysteresis"),
        ({"fp16": {"min_loss_scale": 0}}, "fp16.min_loss_scale"),
        ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 1.0]}}}, "optimizer.params.betas"),
        ({"optimizer": {"type": "AdamW", "params": {"lr": -1e-3}}}, "optimizer.params.lr"),
        ({"optimizer": {"type": "AdamW", "params": {"eps": 0}}}, "optimizer.params.eps"),
        ({"gradient_accumulation_steps": 0, "train_micro_batch_size_per_gpu": 1}, "gradient_accumulation_steps"),
        ({"gradient_clipping": -0.5}, "gradient_clipping"),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}}, "scheduler.params.warmup_num_steps"),
        ({"zero_optimization": {"offload_optimizer": {"ratio": 1.5}}}, "zero_optimization.offload_optimizer.ratio"),
    ],
)
def test_out_of_range(config: dict[str, Any], path: str) -> None:
    problem = _one(config)
    assert problem.path == path and "must be" in problem.rule


@pytest.mark.parametrize(
    ("config", "path", "rule_part"),
    [
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "bf16.enabled", "cannot both"),
        ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, "train_batch_size", "multiple of"),
        ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}, "train_batch_size", "multiple of"),
        ({"gradient_accumulation_steps": 4}, "train_micro_batch_size_per_gpu", "DeepSpeed needs"),
        ({"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}}, "optimizer.params.max_grad_norm", "DeepSpeed raises"),
        ({"optimizer": {"params": {"lr": 1e-3}}}, "optimizer.type", "is required"),
        ({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}}, "scheduler.params.total_num_steps", "required by WarmupDecayLR"),
        ({"zero_optimization": {"stage": 1, "prefetch_bucket_size": 1, "stage3_prefetch_bucket_size": 2}}, "zero_optimization.stage3_prefetch_bucket_size", "given twice"),
        ({"data_types": {"grad_accum_dtype": "bf16"}, "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}, "data_types.grad_accum_dtype", "fp32 at stage 2"),
    ],
)
def test_contradictions(config: dict[str, Any], path: str, rule_part: str) -> None:
    problem = _one(config)
    assert problem.path == path and rule_part in problem.rule


def test_offload_contradictions_are_all_reported() -> None:
    problems = _problems({"zero_optimization": {"stage": 2, "offload_param": {"device": "nvme", "buffer_count": 0}}})
    rules = {(p.path, p.rule.split(" (")[0]) for p in problems}
    assert rules == {
        ("zero_optimization.offload_param.nvme_path", "device 'nvme' needs nvme_path"),
        ("zero_optimization.offload_param.buffer_count",
         "device 'nvme' reads shards through buffer_count host buffers, so it needs at least one"),
        ("zero_optimization.offload_param.device", "parameter offload needs ZeRO stage 3"),
    }


def test_offload_contradictions_once_offload_is_implemented(monkeypatch: pytest.MonkeyPatch) -> None:
    from hf_zero.config import keys

    monkeypatch.setattr(keys, "OFFLOAD_DEVICES_NOT_IMPLEMENTED", ())
    problems = _problems({"zero_optimization": {"stage": 0, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}})
    assert [p.path for p in problems] == [
        "zero_optimization.offload_param.device",
        "zero_optimization.offload_optimizer.device",  # ratio itself is fine wherever cpu offload is
    ]
    assert "stage 3" in problems[0].rule and "stage 1, 2 or 3" in problems[1].rule


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_partial_optimizer_offload_is_accepted_with_device_cpu(stage: int) -> None:
    zero = HfZeroConfig({"zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}).zero
    assert zero.offload_optimizer.ratio == 0.5


@pytest.mark.parametrize("device", ["none", "nvme"])
def test_partial_optimizer_offload_needs_device_cpu(device: str) -> None:
    section = {"device": device, "ratio": 0.3, **({"nvme_path": "/tmp"} if device == "nvme" else {})}
    problem = _one({"zero_optimization": {"stage": 3, "offload_optimizer": section}})
    assert problem.path == "zero_optimization.offload_optimizer.ratio" and f"device is {device!r}" in problem.rule
    assert "cpu" in problem.fix


@pytest.mark.parametrize(
    ("config", "path"),
    [
        ({"zero_optimization": {"stage": 2, "cpu_offload": True}}, "zero_optimization.cpu_offload"),
        ({"zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": True}}, "zero_optimization.zero_quantized_nontrainable_weights"),
        ({"zero_optimization": {"stage": 3, "zenflow": {"topk_ratio": 0.1}}}, "zero_optimization.zenflow"),
        ({"zero_optimization": {"stage": 3, "stage3_module_granularity_threshold": 100}}, "zero_optimization.stage3_module_granularity_threshold"),
        ({"zero_optimization": {"stage": 3, "offload_optimizer": {"super_offload": True}}}, "zero_optimization.offload_optimizer.super_offload"),
        ({"zero_optimization": {"stage": 2, "ignore_unused_parameters": False}}, "zero_optimization.ignore_unused_parameters"),
        ({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3, "max_coeff": 10}}}, "optimizer.type"),
        ({"optimizer": {"type": "lion"}}, "optimizer.type"),
        ({"optimizer": {"type": "OneBitAdam"}}, "optimizer.type"),
        ({"optimizer": {"type": "Adagrad"}}, "optimizer.type"),
        ({"optimizer": {"type": "SGD", "params": {"momentum": 0.9}}}, "optimizer.type"),  # any torch.optim class
        ({"optimizer": {"type": "AdamW", "params": {"amsgrad": True}}}, "optimizer.params.amsgrad"),
        ({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0, "cycle_max_lr": 1e-3}}}, "scheduler.type"),
        ({"scheduler": {"type": "LRRangeTest"}}, "scheduler.type"),
        ({"amp": {"enabled": True, "opt_level": "O2"}}, "amp.enabled"),
        ({"fp16": {"enabled": True, "auto_cast": True}}, "fp16.auto_cast"),
        ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}, "zero_optimization": {"stage": 2}}, "fp16.fp16_master_weights_and_grads"),
        ({"bf16": {"enabled": True, "immediate_grad_update": True}}, "bf16.immediate_grad_update"),
        ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}, "bf16.bf16_master_weights_and_grads"),
        ({"bf16": {"enabled": True, "bf16_optimizer_states": True}}, "bf16.bf16_optimizer_states"),
        ({"activation_checkpointing": {"partition_activations": True}}, "activation_checkpointing.partition_activations"),
        ({"activation_checkpointing": {"number_checkpoints": 4}}, "activation_checkpointing.number_checkpoints"),
        ({"pipeline": {"stages": 2}}, "pipeline"),
        ({"elasticity": {"enabled": True, "max_train_batch_size": 100}}, "elasticity"),
        ({"compression_training": {"weight_quantization": {"shared_parameters": {"enabled": True}}}}, "compression_training"),
        ({"data_efficiency": {"enabled": True}}, "data_efficiency"),
        ({"sparse_gradients": True}, "sparse_gradients"),
        ({"flops_profiler": {"enabled": True}}, "flops_profiler.enabled"),
        ({"tensorboard": {"enabled": True, "output_path": "tb"}}, "tensorboard.enabled"),
        ({"wandb": {"enabled": True}}, "wandb.enabled"),
        ({"csv_monitor": {"enabled": True}}, "csv_monitor.enabled"),
        ({"comms_logger": {"enabled": True}}, "comms_logger.enabled"),
        ({"checkpoint": {"load_universal": True}}, "checkpoint.load_universal"),
        ({"checkpoint": {"use_node_local_storage": True}}, "checkpoint.use_node_local_storage"),
        ({"tensor_parallel": {"autotp_size": 2}}, "tensor_parallel"),
        ({"compile": {"deepcompile": True}}, "compile"),
        ({"gradient_allreduce_op": "sum"}, "gradient_allreduce_op"),
    ],
)
def test_unimplemented_feature_turned_on(config: dict[str, Any], path: str) -> None:
    problem = _one(config)
    assert problem.path == path
    assert NOT_IMPLEMENTED in problem.rule
    assert problem.fix.startswith(("remove", "use "))


def test_unknown_optimizer_and_scheduler_types() -> None:
    problems = _problems({"optimizer": {"type": "AdamWW"}, "scheduler": {"type": "warmuplr"}})
    assert [(p.path, p.fix) for p in problems] == [
        ("optimizer.type", "did you mean 'AdamW'?"),
        ("scheduler.type", "did you mean 'WarmupLR'?"),
    ]


def test_auto_where_nothing_fills_it_fails_at_construction() -> None:
    problem = _one({"zero_optimization": {"stage": "auto"}})
    assert problem.path == "zero_optimization.stage" and "only accepted" in problem.rule


def test_unresolvable_auto_at_resolve_time() -> None:
    config = {
        "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
        "fp16": {"enabled": "auto"},
        "train_micro_batch_size_per_gpu": 2,
    }
    problems = _problems(config, world_size=2)
    assert {p.path: p.value for p in problems} == {
        "zero_optimization.reduce_bucket_size": "auto",
        "zero_optimization.stage3_param_persistence_threshold": "auto",
        "optimizer.params.lr": "auto",
        "fp16.enabled": "auto",
    }
    fixes = {p.path: p.fix for p in problems}
    assert "hidden_size=" in fixes["zero_optimization.reduce_bucket_size"]
    assert "lr=" in fixes["optimizer.params.lr"]
    assert "fp16=True/False" in fixes["fp16.enabled"]
    assert all("still 'auto'" in p.rule for p in problems)


def test_unresolved_batch_auto_says_how_to_fill_it() -> None:
    problem = _one({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2}, gradient_accumulation_steps=2)
    assert problem.path == "train_batch_size" and "world_size=" in problem.fix


def test_batch_triple_that_does_not_multiply() -> None:
    config = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
    HfZeroConfig(config).resolve(world_size=4)  # 4 * 2 * 4 = 32
    problem = _one(config, world_size=3)
    assert problem.path == "train_batch_size" and problem.value == 32
    assert "4 * 2 * 3 = 24" in problem.rule and "24" in problem.fix


def test_resolved_value_breaking_a_rule_names_the_argument() -> None:
    problem = _one({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, lr=-1.0)
    assert problem.path == "optimizer.params.lr" and "resolve(lr=...)" in problem.rule


def test_bad_resolve_arguments() -> None:
    problems = _problems({}, world_size=0, hidden_size=-3, train_micro_batch_size_per_gpu=2.5)
    assert [p.path for p in problems] == ["world_size", "hidden_size", "train_micro_batch_size_per_gpu"]


def test_check_mismatches_reports_all_four_in_one_error() -> None:
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 4,
        "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": "auto"}},
    }
    values = dict(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2, lr=3e-4, betas=(0.9, 0.999), weight_decay=0.1, gradient_clipping=1.0)
    problems = _problems(config, check_mismatches=True, **values)
    assert [p.rule for p in problems] == [
        "config train_micro_batch_size_per_gpu=8 vs given train_micro_batch_size_per_gpu=4",
        "config gradient_accumulation_steps=4 vs given gradient_accumulation_steps=2",
        "config optimizer.params.lr=0.001 vs given lr=0.0003",
        "config optimizer.params.betas=[0.9, 0.95] vs given betas=(0.9, 0.999)",
    ]
    assert all('"auto"' in p.fix for p in problems)
    # Without check_mismatches the config's own values win, as in transformers.
    resolved = HfZeroConfig(config).resolve(**values)
    assert resolved.optimizer.lr == 1e-3 and resolved.train_micro_batch_size_per_gpu == 8


# ---- many problems at once ------------------------------------------------------------------


def test_every_problem_is_listed_in_one_error() -> None:
    config = {
        "micro_batch_size_per_gpu": 8,  # typo
        "gradient_clipping": "1.0",  # string number
        "zero_optimization": {
            "stage": 3,
            "overlap_com": True,  # nested typo
            "reduce_bucket_size": -5,  # out of range
            "zero_quantized_nontrainable_weights": True,  # not implemented
            "offload_param": {"device": "nvme"},  # missing nvme_path
        },
        "fp16": {"enabled": True},
        "bf16": {"enabled": True},  # contradiction
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "max_grad_norm": 1.0}},  # DeepSpeed refuses it
        "train_batch_size": 10,
        "train_micro_batch_size_per_gpu": 4,  # 10 is not a multiple of 4
    }
    problems = _problems(config)
    assert [p.path for p in problems] == [
        "micro_batch_size_per_gpu",
        "gradient_clipping",
        "zero_optimization.overlap_com",
        "zero_optimization.reduce_bucket_size",
        "zero_optimization.zero_quantized_nontrainable_weights",
        "optimizer.params.max_grad_norm",
        "bf16.enabled",
        "zero_optimization.offload_param.nvme_path",
        "train_batch_size",
    ]
    assert problems[-2].value is MISSING and "<missing>" in str(problems[-2])


def test_error_is_a_value_error_and_pickles() -> None:
    with pytest.raises(ValueError) as info:
        HfZeroConfig({"zero_optimization": {"stage": 9}})
    error = info.value
    assert isinstance(error, HfZeroConfigError)
    clone = pickle.loads(pickle.dumps(error))
    assert clone.problems == error.problems and str(clone) == str(error)
    assert str(error).startswith("hf_zero config <dict> has 1 problem:")


def test_optimizer_params_are_checked_against_the_type() -> None:
    """Muon takes its own keys (and the auxiliary AdamW's lr, betas, eps); a key of one type
    under another is named as unknown there."""
    muon = HfZeroConfig({"optimizer": {"type": "muon", "params": {"lr": 0.02, "momentum": 0.9, "ns_steps": 4,
                                                                   "adam_lr": 1e-3, "betas": [0.9, 0.95]}}}).optimizer
    assert (muon.type, muon.lr, muon.momentum, muon.ns_steps, muon.adam_lr, muon.betas) == ("Muon", 0.02, 0.9, 4, 1e-3, (0.9, 0.95))
    assert [p.path for p in _problems({"optimizer": {"type": "AdamW", "params": {"momentum": 0.9}}})] == ["optimizer.params.momentum"]
    assert [p.path for p in _problems({"optimizer": {"type": "Muon", "params": {"amsgrad": True}}})] == ["optimizer.params.amsgrad"]
    assert [p.path for p in _problems({"optimizer": {"type": "Muon", "params": {"ns_steps": 0}}})] == ["optimizer.params.ns_steps"]


@pytest.mark.parametrize("zero, rule_part", [
    ({"stage": 0, "mics_shard_size": 8}, "hybrid sharding needs ZeRO stage 1, 2 or 3"),
    ({"stage": 3, "mics_shard_size": 1}, "every rank its own full copy of the optimizer state"),
])
def test_shard_group_size_contradictions(zero: dict[str, Any], rule_part: str) -> None:
    problem = _one({"zero_optimization": zero})
    assert problem.path == "zero_optimization.mics_shard_size" and rule_part in problem.rule


@pytest.mark.parametrize("size", [-1, 0, 2, 8])
def test_shard_group_size_off_or_a_group_is_accepted(size: int) -> None:
    assert HfZeroConfig({"zero_optimization": {"stage": 3, "mics_shard_size": size}}).zero.mics_shard_size == size


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_quantized_weights_below_stage_3_say_there_is_nothing_to_gather(stage: int) -> None:
    (problem,) = _problems({"zero_optimization": {"stage": stage, "zero_quantized_weights": True}})
    assert problem.path == "zero_optimization.zero_quantized_weights"
    assert f"stage {stage} keeps every parameter gathered" in problem.rule and "stage to 3" in problem.fix


def test_quantized_weights_at_stage_3_are_accepted() -> None:
    assert HfZeroConfig({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}).zero.zero_quantized_weights


@pytest.mark.parametrize(("zero", "rule_part", "fix_part"), [
    ({"stage": 2}, "stage 2 gathers none", "stage to 3"),
    ({"stage": 3, "mics_shard_size": 8}, "every gather already stays inside its shard group", "use one"),
    ({"stage": 3, "offload_param": {"device": "cpu"}}, "which offload_param cpu exists to keep off", "device to none"),
])
def test_secondary_shards_refused_where_they_cannot_help(zero: dict, rule_part: str, fix_part: str) -> None:
    (problem,) = _problems({"zero_optimization": {**zero, "zero_hpz_partition_size": 8}})
    assert problem.path == "zero_optimization.zero_hpz_partition_size"
    assert rule_part in problem.rule and fix_part in problem.fix


@pytest.mark.parametrize("size", [0, 1, 2, 8])
def test_secondary_shards_at_stage_3_are_accepted(size: int) -> None:
    config = {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": size, "zero_quantized_weights": True}}
    assert HfZeroConfig(config).zero.zero_hpz_partition_size == size


@pytest.mark.parametrize(("zero", "rule_part"), [
    ({"stage": 0}, "stage 0 all-reduces the gradients"),
    ({"stage": 2, "mics_shard_size": 4}, "only the replicas' all-reduce crosses nodes"),
])
def test_quantized_gradients_refused_where_there_is_no_reduce_scatter_to_quantize(zero: dict, rule_part: str) -> None:
    (problem,) = _problems({"zero_optimization": {**zero, "zero_quantized_gradients": True}})
    assert problem.path == "zero_optimization.zero_quantized_gradients" and rule_part in problem.rule


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_quantized_gradients_at_stages_1_to_3_are_accepted(stage: int) -> None:
    config = {"zero_optimization": {"stage": stage, "zero_quantized_gradients": True}}
    assert HfZeroConfig(config).zero.zero_quantized_gradients
