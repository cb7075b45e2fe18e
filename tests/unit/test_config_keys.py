"""The key table: consistent, complete for DeepSpeed, and every key at its default loads."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest

from hf_zero.config import MISSING, HfZeroConfig, KeySpec, Status, reference_markdown
from hf_zero.config import schema
from hf_zero.config.keys import DEEPSPEED_SCHEDULERS, iter_specs
from hf_zero.config.kinds import Opaque, Section


def _set(root: dict[str, Any], path: str, value: Any) -> None:
    *parents, name = path.split(".")
    for part in parents:
        root = root.setdefault(part, {})
    root[name] = copy.deepcopy(value)


def _all_defaults(scheduler: str, optimizer: str = "AdamW") -> dict[str, Any]:
    config: dict[str, Any] = {}
    for spec in iter_specs():
        if spec.default is MISSING or (isinstance(spec.kind, Section) and spec.default is None):
            continue
        if spec.scheduler_types and scheduler not in spec.scheduler_types:
            continue
        if spec.optimizer_types and optimizer not in spec.optimizer_types:
            continue
        _set(config, spec.path, spec.default)
    _set(config, "optimizer.type", optimizer)
    _set(config, "scheduler.type", scheduler)
    if "total_num_steps" in [s.name for s in iter_specs() if scheduler in s.scheduler_types]:
        _set(config, "scheduler.params.total_num_steps", 100)
    return config


@pytest.mark.parametrize("optimizer", ["AdamW", "Muon", "Adafactor"])
@pytest.mark.parametrize("scheduler", ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"])
def test_every_key_at_its_default_loads(scheduler: str, optimizer: str) -> None:
    """The RULE: an unimplemented key is only an error when it turns its feature on."""
    config = HfZeroConfig(_all_defaults(scheduler, optimizer))
    assert config.scheduler is not None and config.scheduler.type == scheduler
    assert config.optimizer is not None and config.optimizer.type == optimizer
    assert config.to_dict()["zero_optimization"]["stage"] == 0


def test_specs_are_consistent() -> None:
    seen: set[str] = set()
    for spec in iter_specs():
        assert spec.path not in seen, spec.path
        seen.add(spec.path)
        assert spec.doc, spec.path
        if spec.status is not Status.IMPLEMENTED:
            assert spec.reason, f"{spec.path}: a no-effect or not-implemented key needs its reason"
        if spec.status is Status.NOT_IMPLEMENTED and spec.default is not MISSING:
            assert spec.is_off(spec.default), f"{spec.path}: its default must leave the feature off"
        if spec.parent:
            assert spec.parent in seen, f"{spec.path}: parent section listed after it"
        for scheduler in spec.scheduler_types:
            assert scheduler in DEEPSPEED_SCHEDULERS
        assert bool(spec.optimizer_types) == spec.path.startswith("optimizer.params."), spec.path


def test_dataclass_fields_are_table_keys() -> None:
    for cls, section in (
        (schema.ZeroConfig, "zero_optimization"),
        (schema.OffloadParamConfig, "zero_optimization.offload_param"),
        (schema.OffloadOptimizerConfig, "zero_optimization.offload_optimizer"),
        (schema.Fp16Config, "fp16"),
        (schema.Bf16Config, "bf16"),
    ):
        for field in dataclasses.fields(cls):
            assert isinstance(_spec(f"{section}.{field.name}"), KeySpec)


def _spec(path: str) -> KeySpec | None:
    from hf_zero.config.keys import spec_for

    return spec_for(path)


# Keys DeepSpeed 0.19 accepts, listed independently of the table (research section 1 and the
# DeepSpeed sources): none may ever be reported as unknown.
DEEPSPEED_KEYS = """
train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps gradient_clipping steps_per_print
wall_clock_breakdown memory_breakdown dump_state disable_allgather communication_data_type prescale_gradients
gradient_predivide_factor sparse_gradients zero_allow_untested_optimizer zero_force_ds_cpu_optimizer
dataloader_drop_last vocabulary_size graph_harvesting use_data_before_expert_parallelism
seq_parallel_communication_data_type zero_optimization fp16 bf16 amp torch_autocast optimizer scheduler checkpoint
data_types aio activation_checkpointing flops_profiler comms_logger tensorboard wandb csv_monitor comet pipeline
elasticity autotuning compression_training data_efficiency curriculum_learning quantize_training
progressive_layer_drop sparse_attention hybrid_engine weight_quantization nebula compile tensor_parallel timers
zero_optimization.stage zero_optimization.contiguous_gradients zero_optimization.reduce_scatter
zero_optimization.reduce_bucket_size zero_optimization.use_multi_rank_bucket_allreduce
zero_optimization.allgather_partitions zero_optimization.allgather_bucket_size zero_optimization.overlap_comm
zero_optimization.load_from_fp32_weights zero_optimization.elastic_checkpoint zero_optimization.offload_param
zero_optimization.offload_optimizer zero_optimization.zenflow zero_optimization.sub_group_size
zero_optimization.cpu_offload zero_optimization.cpu_offload_param zero_optimization.cpu_offload_use_pin_memory
zero_optimization.stage3_prefetch_bucket_size zero_optimization.stage3_param_persistence_threshold
zero_optimization.stage3_model_persistence_threshold zero_optimization.stage3_max_live_parameters
zero_optimization.stage3_max_reuse_distance zero_optimization.stage3_gather_16bit_weights_on_model_save
zero_optimization.stage3_module_granularity_threshold zero_optimization.stage3_use_all_reduce_for_fetch_params
zero_optimization.stage3_allgather_sequential zero_optimization.ignore_unused_parameters
zero_optimization.legacy_stage1 zero_optimization.round_robin_gradients zero_optimization.zero_hpz_partition_size
zero_optimization.zero_quantized_weights zero_optimization.zero_quantized_nontrainable_weights
zero_optimization.zero_quantized_gradients zero_optimization.zeropp_loco_param zero_optimization.mics_shard_size
zero_optimization.mics_hierarchical_params_gather zero_optimization.memory_efficient_linear
zero_optimization.pipeline_loading_checkpoint zero_optimization.override_module_apply
zero_optimization.log_trace_cache_warnings zero_optimization.enable_sanity_checks
zero_optimization.save_muon_momentum_buffer_in_memory zero_optimization.leaf_module
zero_optimization.offload_param.device zero_optimization.offload_param.nvme_path
zero_optimization.offload_param.buffer_count zero_optimization.offload_param.buffer_size
zero_optimization.offload_param.max_in_cpu zero_optimization.offload_param.pin_memory
zero_optimization.offload_optimizer.device zero_optimization.offload_optimizer.nvme_path
zero_optimization.offload_optimizer.buffer_count zero_optimization.offload_optimizer.pin_memory
zero_optimization.offload_optimizer.pipeline_read zero_optimization.offload_optimizer.pipeline_write
zero_optimization.offload_optimizer.fast_init zero_optimization.offload_optimizer.ratio
zero_optimization.offload_optimizer.super_offload zero_optimization.offload_optimizer.cpuadam_cores_perc
fp16.enabled fp16.auto_cast fp16.loss_scale fp16.initial_scale_power fp16.loss_scale_window fp16.hysteresis
fp16.consecutive_hysteresis fp16.min_loss_scale fp16.fp16_master_weights_and_grads
bf16.enabled bf16.immediate_grad_update bf16.check_grad_overflow bf16.bf16_master_weights_and_grads
bf16.bf16_optimizer_states amp.enabled torch_autocast.enabled torch_autocast.dtype
torch_autocast.lower_precision_safe_modules checkpoint.tag_validation checkpoint.load_universal
checkpoint.use_node_local_storage checkpoint.parallel_write checkpoint.parallel_write.pipeline_stage
data_types.grad_accum_dtype aio.block_size aio.queue_depth aio.intra_op_parallelism aio.single_submit
aio.overlap_events aio.use_gds activation_checkpointing.partition_activations
activation_checkpointing.number_checkpoints activation_checkpointing.contiguous_memory_optimization
activation_checkpointing.cpu_checkpointing activation_checkpointing.synchronize_checkpoint_boundary
activation_checkpointing.profile flops_profiler.enabled flops_profiler.recompute_fwd_factor
flops_profiler.profile_step flops_profiler.module_depth flops_profiler.top_modules flops_profiler.detailed
flops_profiler.output_file comms_logger.enabled comms_logger.verbose comms_logger.prof_all comms_logger.debug
comms_logger.prof_ops tensorboard.enabled tensorboard.output_path tensorboard.job_name wandb.enabled wandb.group
wandb.team wandb.project csv_monitor.enabled csv_monitor.output_path csv_monitor.job_name
optimizer.type optimizer.params optimizer.params.lr optimizer.params.betas optimizer.params.eps
optimizer.params.weight_decay optimizer.params.adam_w_mode optimizer.params.torch_adam
optimizer.params.bias_correction optimizer.params.amsgrad scheduler.type scheduler.params
""".split()


def test_every_deepspeed_key_is_known() -> None:
    missing = [path for path in DEEPSPEED_KEYS if _spec(path) is None]
    assert not missing


def test_reference_lists_every_key() -> None:
    text = reference_markdown()
    for spec in iter_specs():
        assert f"`{spec.path}`" in text
    assert "| `zero_optimization.stage` | int | 0 | implemented |" in text
    assert "not_implemented when true" in text


def test_opaque_sections_are_documented_as_dicts() -> None:
    opaque = [s for s in iter_specs() if isinstance(s.kind, Opaque) and not isinstance(s.kind, Section)]
    assert {"pipeline", "compression_training", "zero_optimization.zenflow"} <= {s.path for s in opaque}


def test_compact_reference_has_every_key_once() -> None:
    text = reference_markdown(compact=True)
    for spec in iter_specs():
        if not isinstance(spec.kind, Section):
            assert text.count(f"`{spec.path}`") == 1, spec.path
    assert "| `zero_optimization.offload_param.device` | \"none\" | implemented |" in text
    assert "| `zero_optimization.offload_optimizer.super_offload` | false | not_implemented when true |" in text
