"""``hf_zero.initialize``: the Trainer-less entry point, in the shape of ``deepspeed.initialize``."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from hf_zero.comm import Communicator, default_device, ensure_process_group, hf_zero_timeout_s
from hf_zero.config import HfZeroConfig
from hf_zero.config.auto import fillable_paths
from hf_zero.config.errors import ConfigProblem, HfZeroConfigError
from hf_zero.config.validate import AUTO, STILL_AUTO_RULE, config_warnings
from hf_zero.engine.sharding.deferred_load import disarm_materialisation, find_source, initialise_new_adapters
from hf_zero.engine.sharding.buffer_pool import BufferPool
from hf_zero.comm.block_wire import QWZ_BLOCK
from hf_zero.comm.quantized_reduce import QGZ_BLOCK
from hf_zero.engine.engine import ZeroEngine
from hf_zero.engine.lower_precision import lower_precision_params, resolve_module_classes, unmatched_classes
from hf_zero.engine.policy import BUCKETS_IN_FLIGHT, ShardingPolicy
from hf_zero.engine.optim.loss_scaler import build_loss_scaler
from hf_zero.engine.optim.muon import MuonWithAuxAdamW, muon_param_groups
from hf_zero.engine.optim.optimizer import ZeroAdam, ZeroOptimizer
from hf_zero.engine.optim.optimizer_kinds import OptimizerKind, check_flat_shard_optimizer
from hf_zero.engine.optim.whole_param_step import WholeParamStep
from hf_zero.engine.sharding.param_source import SOURCE_ATTRIBUTE, ParamSource
from hf_zero.engine.optim.overlap_step import OverlappedOffloadStep, can_overlap
from hf_zero.engine.schedule.rank_agreement import TIMEOUT_ENV, agree, collective_timeout_s, fingerprint
from hf_zero.engine.optim.schedulers import build_scheduler
from hf_zero.engine.schedule.unit import ZeroUnit
from hf_zero.execution import read_environment
from hf_zero.host_memory import hand_back_free_heap_pages
from hf_zero.offload import NvmeOptimizerStore, NvmeParamStore, OffloadSettings, units_to_offload
from hf_zero.offload.grad_copies import HostGradCopies
from hf_zero.offload.nvme_io import AioSettings
from hf_zero.offload.threads import host_step_threads, log_choice
from hf_zero.partition import KEEP_GATHERED, is_persistent, plan_units
from hf_zero.sequence_parallel import (SequenceParallel, causal_lm_heads, check_model, check_tiling,
                                      data_parallel_place, install_tiled_loss, install_tiled_mlp, make_layout,
                                      tileable_mlps)
from hf_zero.sequence_parallel.layout import configured_size

logger = logging.getLogger("hf_zero")

OptimizerArg = torch.optim.Optimizer | Callable[[list[dict[str, Any]]], torch.optim.Optimizer] | None


def hidden_size_of(model: nn.Module) -> int | None:
    """The hidden size transformers uses for DeepSpeed's "auto" bucket sizes, or None."""
    config = getattr(model, "config", None)
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is None:
            continue
        if getattr(cfg, "hidden_size", None):
            return int(cfg.hidden_size)
        if getattr(cfg, "hidden_sizes", None):
            return int(max(cfg.hidden_sizes))
    return None


def _param_group_index(
    model: nn.Module, optimizer: OptimizerArg, model_parameters: Iterable[Any] | None
) -> tuple[dict[int, int], list[dict[str, Any]]]:
    """Which optimizer param group each parameter steps in, and each group's hyperparameters.

    Groups come from a passed torch optimizer, else from ``model_parameters`` given as group
    dicts, else there is one group."""
    groups: list[dict[str, Any]]
    if isinstance(optimizer, torch.optim.Optimizer):
        groups = optimizer.param_groups
    elif model_parameters is not None:
        given = list(model_parameters)
        groups = given if given and isinstance(given[0], dict) else [{"params": given}]
    else:
        return {}, [{}]
    index: dict[int, int] = {}
    for i, group in enumerate(groups):
        for param in group["params"]:
            index.setdefault(id(param), i)
    known = {id(p) for p in model.parameters()}
    stray = [k for k in index if k not in known]
    if stray:
        raise ValueError(
            f"{len(stray)} optimizer parameter(s) are not parameters of the model; build the "
            "optimizer from model.parameters() (or model.named_parameters()) of this model"
        )
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups]
    return index, hyper


_NOT_COPIED_FROM_USER_OPTIMIZER = frozenset({"param_groups", "state", "defaults", "step", "_opt_called"})


def _rebuild_torch_optimizer(
    optimizer: torch.optim.Optimizer, shard_groups: list[dict[str, Any]]
) -> torch.optim.Optimizer:
    """The same optimizer class and hyperparameters, over this rank's fp32 shards. Its state
    starts empty: the shards are new tensors."""
    rebuilt = type(optimizer).__new__(type(optimizer))
    # Instance attributes carry subclass settings; "step" may be an instance attribute too (a
    # torch LR scheduler wraps the optimizer's step), and copying it would step the old optimizer.
    rebuilt.__dict__.update(
        {k: v for k, v in optimizer.__dict__.items() if k not in _NOT_COPIED_FROM_USER_OPTIMIZER}
    )
    torch.optim.Optimizer.__init__(rebuilt, shard_groups, optimizer.defaults)
    return rebuilt


# Config optimizer types that hf_zero steps whole ([Note: whole-parameter step]).
CONFIG_WHOLE_PARAM_TYPES = ("Muon", "Adafactor")


def _config_whole_param(config: HfZeroConfig, optimizer: OptimizerArg, model_parameters: Iterable[Any] | None) -> bool:
    """True when the config's optimizer section asks for Muon or Adafactor (and nothing contradicts it)."""
    if config.optimizer is None or config.optimizer.type not in CONFIG_WHOLE_PARAM_TYPES:
        return False
    if optimizer is not None:
        raise ValueError(
            "an optimizer was passed to hf_zero.initialize and the config has an \"optimizer\" "
            "section too; remove one of them")
    if config.optimizer.type == "Muon" and model_parameters is not None:
        raise ValueError(
            "the config's Muon optimizer makes its own two param groups (hidden 2-D weights on Muon, "
            "the rest on AdamW; see docs/optimizers.md); remove model_parameters, or pass your own "
            "optimizer built on them and no \"optimizer\" section")
    return True


def _whole_param_optimizer(config: HfZeroConfig, optimizer: OptimizerArg,
                           param_groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """The shape-aware optimizer over the owners' full-shape masters ([Note: whole-parameter step])."""
    if optimizer is None:
        return _config_whole_param_optimizer(config, param_groups)
    if isinstance(optimizer, MuonWithAuxAdamW):  # [Note: Muon with auxiliary AdamW]
        return MuonWithAuxAdamW(param_groups)
    return _rebuild_torch_optimizer(optimizer, param_groups)


def _config_whole_param_optimizer(config: HfZeroConfig, param_groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    opt = config.optimizer
    if opt.type == "Muon":
        return MuonWithAuxAdamW(param_groups)
    return torch.optim.Adafactor(param_groups, lr=opt.lr, beta2_decay=opt.beta2_decay, d=opt.d,
                                 weight_decay=opt.weight_decay)


def _check_muon_covers_matrices_only(optimizer: OptimizerArg, model: nn.Module) -> None:
    """torch.optim.Muon steps 2-D weights only, and hf_zero steps every trainable parameter in
    the passed optimizer (one it does not list joins its first group): refuse it before any step
    when the model trains anything else."""
    if type(optimizer) is not getattr(torch.optim, "Muon", None):
        return
    others = [name for name, p in model.named_parameters() if p.requires_grad and p.ndim != 2]
    if others:
        raise ValueError(
            f"torch.optim.Muon steps 2-D weights only, and the model trains {len(others)} other "
            f"parameter(s) ({', '.join(others[:3])}{', ...' if len(others) > 3 else ''}); use the config's "
            "\"optimizer\": {\"type\": \"Muon\"} (Muon for hidden 2-D weights, AdamW for the rest), or pass "
            "hf_zero.engine.optim.muon.MuonWithAuxAdamW(muon_param_groups(model, muon_hyper, adamw_hyper)) "
            "(see docs/optimizers.md)")


def _config_muon_groups(config: HfZeroConfig, model: nn.Module) -> list[dict[str, Any]]:
    opt = config.optimizer
    muon = dict(lr=opt.lr, weight_decay=opt.weight_decay, momentum=opt.momentum, nesterov=opt.nesterov,
                ns_steps=opt.ns_steps)
    adamw = dict(lr=opt.lr if opt.adam_lr is None else opt.adam_lr, weight_decay=opt.weight_decay,
                 betas=tuple(opt.betas), eps=opt.eps)
    return muon_param_groups(model, muon, adamw)


def _build_inner_optimizer(
    config: HfZeroConfig, optimizer: OptimizerArg, shard_groups: list[dict[str, Any]]
) -> torch.optim.Optimizer | None:
    if optimizer is not None and config.optimizer is not None:
        raise ValueError(
            "an optimizer was passed to hf_zero.initialize and the config has an \"optimizer\" "
            "section too; remove one of them"
        )
    if isinstance(optimizer, torch.optim.Optimizer):
        return _rebuild_torch_optimizer(optimizer, shard_groups)
    if callable(optimizer):
        built = optimizer(shard_groups)
        kind = check_flat_shard_optimizer(type(built), config.zero_allow_untested_optimizer, config.stage)
        if kind is OptimizerKind.WHOLE_PARAM:
            raise ValueError(
                f"{type(built).__name__} is shape-aware and a callable builds it over the flat shards it is "
                "given; pass the optimizer instance built on model.parameters() instead, and hf_zero steps "
                "each parameter whole on one rank (see docs/optimizers.md)")
        return built
    if config.optimizer is None:
        return None
    opt = config.optimizer
    return ZeroAdam(
        shard_groups, lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps,
        weight_decay=opt.weight_decay, decoupled_weight_decay=opt.decoupled_weight_decay,
    )


def _build_scheduler(config: HfZeroConfig, optimizer: ZeroOptimizer | None, lr_scheduler: Any) -> Any:
    if lr_scheduler is not None and config.scheduler is not None:
        raise ValueError(
            "an lr_scheduler was passed to hf_zero.initialize and the config has a \"scheduler\" "
            "section too; remove one of them"
        )
    if optimizer is None:
        return None
    if config.scheduler is not None:
        return build_scheduler(config.scheduler.type, optimizer, dict(config.scheduler.params))
    if lr_scheduler is None:
        return None
    if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        return lr_scheduler(optimizer)
    # A scheduler built on the user's optimizer: point it at the sharded one, whose param groups
    # carry the same hyperparameters (initial_lr included).
    lr_scheduler.optimizer = optimizer
    return lr_scheduler


def _build_dataloader(
    training_data: Dataset | None, config: HfZeroConfig, comm: Communicator, collate_fn: Callable | None
) -> DataLoader | None:
    if training_data is None:
        return None
    sampler = None
    # Data parallel over every rank, replicas included; the ranks of a sequence-parallel group
    # share their samples ([Note: sequence-parallel layout]).
    rank, ranks = data_parallel_place(_sequence_parallel_size(config), comm.global_rank, comm.global_world_size)
    if ranks > 1:
        sampler = DistributedSampler(training_data, num_replicas=ranks, rank=rank)
    return DataLoader(
        training_data, batch_size=config.train_micro_batch_size_per_gpu, sampler=sampler,
        shuffle=sampler is None, collate_fn=collate_fn,
        drop_last=bool(config.get_value("dataloader_drop_last", False)),
    )


def _resolve(parsed: HfZeroConfig, world_size: int, model: nn.Module) -> HfZeroConfig:
    """``parsed`` with the "auto" values the model and the world decide filled. The others (a
    recipe's batch sizes, clipping, learning rates) are a Trainer's or Accelerate's to fill from
    their arguments; here they are one problem naming them all and the call that fills them."""
    try:
        return parsed.resolve(world_size=world_size, hidden_size=hidden_size_of(model))
    except HfZeroConfigError as error:
        unfilled = [p for p in error.problems if p.rule == STILL_AUTO_RULE]
        if not unfilled:
            raise
        sources = fillable_paths()
        arguments = [sources.get(p.path, p.path) for p in unfilled]
        if {"train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size"} <= set(arguments):
            arguments.remove("train_batch_size")  # the world size gives it from the other two
            arguments.insert(0, "world_size=torch.distributed.get_world_size()")
        if any(sources.get(path) == "hidden_size" for path in parsed.auto_keys()):
            arguments.insert(0, "hidden_size=model.config.hidden_size")
        example = ", ".join(a if "=" in a else f"{a}=..." for a in arguments)
        grouped = ConfigProblem(
            ", ".join(p.path for p in unfilled), AUTO,
            f"{len(unfilled)} 'auto' value(s) that hf_zero.initialize cannot fill: a Trainer or Accelerate fills "
            "them from its arguments; initialize fills only the keys the model's hidden_size decides "
            "(reduce_bucket_size, stage3_prefetch_bucket_size, stage3_param_persistence_threshold) and, from the "
            "world size, the third of the three batch sizes",
            f"write numbers for them in the config, or pass config=hf_zero.HfZeroConfig(path).resolve({example})",
        )
        others = [p for p in error.problems if p.rule != STILL_AUTO_RULE]
        raise HfZeroConfigError([*others, grouped], error.source) from None


def initialize(
    model: nn.Module | None = None,
    config: HfZeroConfig | dict | str | None = None,
    optimizer: OptimizerArg = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: Dataset | None = None,
    lr_scheduler: Any = None,
    collate_fn: Callable | None = None,
    config_params: dict | None = None,
    *,
    _inference_only: bool = False,
) -> tuple[ZeroEngine, ZeroOptimizer | None, DataLoader | None, Any]:
    """Wrap ``model`` for ZeRO training; returns ``(engine, optimizer, dataloader, lr_scheduler)``.

    ``config`` is an :class:`HfZeroConfig`, a dict or a JSON path in DeepSpeed's schema
    (``config_params`` is DeepSpeed's older name for it). The default process group is joined
    from the launcher's environment; with none, this runs as world size 1.
    """
    if model is None:
        raise ValueError("hf_zero.initialize needs model=")
    if config is None:
        config = config_params
    if config is None:
        raise ValueError("hf_zero.initialize needs config= (an HfZeroConfig, a dict or a JSON path)")
    read_environment()  # HF_ZERO_CHECK_ASYNC, once for the engine: [Note: late completion]
    device = default_device()
    comm, parsed, local_error = _join_group(device, config)
    resolved = param_group_of = hyper = plan = prints = safe_classes = None
    optimizer_kind = OptimizerKind.ELEMENTWISE
    if local_error is None:  # until agree(): nothing that another rank could wait on
        try:
            resolved = _resolve(parsed, comm.world_size, model)
            if not _inference_only:
                _check_optimizer_given(model, optimizer, resolved)
            if isinstance(optimizer, torch.optim.Optimizer):  # before any sharding: [Note: element-wise optimizers]
                optimizer_kind = check_flat_shard_optimizer(type(optimizer), resolved.zero_allow_untested_optimizer,
                                                            resolved.stage)
            _check_muon_covers_matrices_only(optimizer, model)
            if _config_whole_param(resolved, optimizer, model_parameters):
                optimizer_kind = OptimizerKind.WHOLE_PARAM
                if resolved.optimizer.type == "Muon":
                    model_parameters = _config_muon_groups(resolved, model)
            param_group_of, hyper = _param_group_index(model, optimizer, model_parameters)
            plan = plan_units(model, resolved.zero.wrap_modules)
            if _sequence_parallel_size(resolved) > 1:
                check_model(model, _sequence_parallel_size(resolved))
            if _tiled_loss_tokens(resolved):
                check_tiling(model, causal_lm_heads(model))
            if _tiled_mlp_tokens(resolved):
                tileable_mlps(model)
            if resolved.autocast_dtype is not None:  # [Note: lower-precision-safe modules]
                safe_classes = resolve_module_classes(resolved.lower_precision_safe_modules)
            prints = fingerprint(resolved.to_dict(), hyper, plan.units)
        except Exception as exc:
            local_error = exc
    agree(comm, "hf_zero.initialize", local_error, prints)  # see [Note: rank agreement]
    comm = _shard_groups(comm, resolved)
    sequence_parallel = None
    if _sequence_parallel_size(resolved) > 1:  # [Note: sequence-parallel layout]
        layout = make_layout(_sequence_parallel_size(resolved), device, timeout_s=comm.timeout_s,
                             count=comm.count_issued_elsewhere)
        sequence_parallel = SequenceParallel(model, layout)
    if _tiled_loss_tokens(resolved):  # [Note: tiled logits and loss]
        install_tiled_loss(causal_lm_heads(model), _tiled_loss_tokens(resolved),
                           sequence_parallel.layout if sequence_parallel is not None else None)
    if _tiled_mlp_tokens(resolved):  # [Note: tiled MLP]
        install_tiled_mlp(tileable_mlps(model), _tiled_mlp_tokens(resolved))
    if comm.global_rank == 0:
        for warning in config_warnings(resolved.to_dict()):
            logger.warning("hf_zero config: %s", warning)

    source, source_owner = _lazy_source(model)
    if source is not None:
        _agree_on_real_params(model, comm, device)
        if hasattr(source, "agree_across_ranks"):  # see [Note: sharded initialisation]
            source.agree_across_ranks(comm, device)
    _place_buffers(model, device, comm, source)
    _keep_adapters_gathered(model)
    if source is not None:  # adapters made on the meta device are new Parameter objects now
        if optimizer is None and resolved.optimizer is not None and resolved.optimizer.type == "Muon":
            model_parameters = _config_muon_groups(resolved, model)
        param_group_of, hyper = _param_group_index(model, optimizer, model_parameters)
        plan = plan_units(model, resolved.zero.wrap_modules)
    policy = ShardingPolicy.from_config(resolved)  # the one place a stage is read: [Note: sharding policy]
    if policy.quantized_weight_gathers and comm.global_rank == 0:
        _log_quantized_gathers(comm.global_world_size)
    offload = _offload_settings(resolved, optimizer, policy)
    if offload.optimizer_on_host:  # see [Note: gradients copied to the host]
        offload = dataclasses.replace(offload, grad_copies=HostGradCopies())
    if offload.params == "nvme":
        offload = dataclasses.replace(offload, param_store=_nvme_param_store(resolved, model, comm, policy))
    unit_offloads = _offload_by_unit(resolved, offload, plan.units)
    buffers = _buffer_pool(resolved, device, policy)
    wire_dtype_of = _lower_precision_params(model, resolved, safe_classes, comm.global_rank)
    try:
        units = [
            ZeroUnit(i, spec, param_group_of, comm, policy, resolved.compute_dtype, device,
                     source, unit_offloads[i], buffers, wire_dtype_of)
            for i, spec in enumerate(plan.units)
        ]
        if offload.param_store is not None:
            offload.param_store.allocate_buffers()
    except BaseException:
        if offload.param_store is not None:  # a failed initialize leaves no files behind
            offload.param_store.close()
        raise
    if source_owner is not None:  # the weights are in the shards now; close the files
        source_owner.__dict__.pop(SOURCE_ATTRIBUTE, None)
    replicas = f" in shard groups of {comm.world_size}, {comm.replicas} replicas" if comm.replicas > 1 else ""
    resolved.log_summary(comm.global_rank, f"world size {comm.global_world_size}{replicas} on {device.type} "
                                           f"({dist.get_backend() if dist.is_initialized() else 'no process group'}), "
                                           f"{len(units)} units ({plan.rule})")

    # [Note: param groups keep their places]
    # The sharded optimizer has exactly the user's param groups, in the user's order, empty ones
    # and ones with equal hyperparameters included: a scheduler built on the user's optimizer
    # (one lr per group), a checkpoint's group list and ``param_groups[i]`` in the script all
    # index them by position (run_clm_no_trainer's "no_decay" group is empty for Llama).
    shard_groups = [dict(h, params=[]) for h in hyper]
    trainable = [g for u in units for g in u.groups if g.kind.trainable]
    for group in trainable:
        shard_groups[group.kind.param_group_index]["params"].append(group.master_state.tensor)
    # Each object is built with what it needs, in dependency order; the two pieces that need the
    # object using them (the whole-parameter step's optimizer over the masters it makes, the
    # overlapped step over the ZeroOptimizer's step pipeline) are given as factories their owner calls.
    whole_params = None
    if optimizer_kind is OptimizerKind.WHOLE_PARAM and trainable:  # see [Note: whole-parameter step]
        whole_params = WholeParamStep(trainable, comm, hyper, device,
                                      build_inner=functools.partial(_whole_param_optimizer, resolved, optimizer))
        inner = whole_params.inner
    else:
        inner = _build_inner_optimizer(resolved, optimizer, shard_groups) if trainable else None
    zero_optimizer = None
    if inner is not None:
        loss_scaler = build_loss_scaler(**_loss_scaler_kwargs(resolved))
        nvme = _nvme_store(offload, comm.global_rank, trainable) if offload.optimizer == "nvme" else None
        overlapped = None
        if offload.optimizer_on_host and can_overlap(inner, resolved.gradient_clipping, loss_scaler is not None,
                                                     nvme=offload.optimizer == "nvme"):
            overlapped = functools.partial(OverlappedOffloadStep, device=device)
        zero_optimizer = ZeroOptimizer(inner, trainable, comm, resolved.gradient_clipping, policy,
                                       allgather_bucket_numel=int(resolved.zero.allgather_bucket_size),
                                       loss_scaler=loss_scaler,
                                       skip_nonfinite=resolved.bf16.enabled and resolved.bf16.check_grad_overflow,
                                       nvme=nvme, whole_params=whole_params, overlapped=overlapped)
    scheduler = _build_scheduler(resolved, zero_optimizer, lr_scheduler)
    buffers.release_idle()  # a phase boundary: [Note: the buffer pool]
    hand_back_free_heap_pages()  # [Note: the heap after loading]
    engine = ZeroEngine(model, resolved, comm, device, units, plan.rule, zero_optimizer, scheduler, buffers, policy,
                        sequence_parallel=sequence_parallel)
    dataloader = _build_dataloader(training_data, resolved, comm, collate_fn)
    _ENGINES_MADE[0] += 1
    return engine, zero_optimizer, dataloader, scheduler


_ENGINES_MADE = [0]  # in this process, by any route: what hf_zero.run checks a run against


def engines_made() -> int:
    """How many engines ``initialize`` has made in this process (the runner's end check)."""
    return _ENGINES_MADE[0]


def _sequence_parallel_size(config: HfZeroConfig) -> int:
    return configured_size(config.to_dict())


def _tiled_loss_tokens(config: HfZeroConfig) -> int:
    return int(config.get_value("tiled_loss_tokens", 0) or 0)


def _tiled_mlp_tokens(config: HfZeroConfig) -> int:
    return int(config.get_value("tiled_mlp_tokens", 0) or 0)


def _check_optimizer_given(model: nn.Module, optimizer: OptimizerArg, resolved: HfZeroConfig) -> None:
    """A model in training mode with trainable parameters needs an optimizer from the config or
    the caller: without one, ``engine.step()`` could only fail, steps later. A model in eval mode
    (``from_pretrained`` returns one) is taken for inference, as ``deepspeed.initialize`` takes
    it; the integrations' evaluation engines pass ``_inference_only``."""
    if optimizer is not None or resolved.optimizer is not None or not model.training:
        return
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if trainable:
        raise ValueError(
            f"hf_zero.initialize: the model has {trainable:,} trainable parameter elements but no optimizer "
            "(the config has no \"optimizer\" section and optimizer= was not passed), so engine.step() could not "
            "train it. To train, add an \"optimizer\" section, e.g. {\"type\": \"AdamW\", \"params\": {\"lr\": 1e-4}}, "
            "or pass optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4); for evaluation or inference only, "
            "call model.eval() (or model.requires_grad_(False)) first")


def _join_group(device: torch.device, config: Any) -> tuple[Communicator, Any, Exception | None]:
    """Join the process group (with the collective timeout when hf_zero creates it) even when
    the config is bad, so that every rank can hear of the error (see [Note: rank agreement])."""
    parsed, local_error = None, None
    try:
        parsed = HfZeroConfig(config)
        timeout = collective_timeout_s(parsed.to_dict())
    except Exception as exc:
        local_error, timeout = exc, collective_timeout_s({})
    ensure_process_group(device, timeout_s=timeout)
    applied = hf_zero_timeout_s()
    if timeout is not None and applied != timeout:
        logger.warning("hf_zero: collective_timeout_s / %s (%g s) is not applied to the default process group, "
                       "which was created before this hf_zero.initialize; set its timeout where it is created "
                       "(Accelerate: InitProcessGroupKwargs(timeout=...))", TIMEOUT_ENV, timeout)
    return Communicator(timeout_s=applied), parsed, local_error


def _shard_groups(comm: Communicator, resolved: HfZeroConfig) -> Communicator:
    """The communicator the units shard over: ``comm`` itself, or with ``mics_shard_size`` one
    over groups of that many ranks ([Note: hybrid sharding] in hf_zero.comm.collectives), or with
    ``zero_hpz_partition_size`` one with node groups ([Note: node groups for hpZ]), or with
    ``zero_quantized_gradients`` one that reduces in 4-bit blocks ([Note: quantized gradient reduction]).
    Made after the ranks agreed on the config: making the groups is collective."""
    size = int(resolved.zero.mics_shard_size)
    hpz = int(resolved.zero.zero_hpz_partition_size)  # stage 3 only: validate.py
    quantize = bool(resolved.zero.zero_quantized_gradients)  # neither with mics_shard_size: validate.py
    if comm.global_rank == 0:
        if hpz > 1:
            _log_secondary_shards(hpz, comm.global_world_size)
        if quantize:
            _log_quantized_gradients(comm.global_world_size)
    node = hpz if 1 < hpz < comm.global_world_size else None
    if node is not None or quantize:
        return Communicator(comm.group, timeout_s=comm.timeout_s, node_size=node, quantize_gradients=quantize)
    if size <= 1 or size >= comm.global_world_size:
        return comm
    return Communicator(comm.group, timeout_s=comm.timeout_s, shard_size=size)


def _lazy_source(model: nn.Module) -> tuple[ParamSource | None, nn.Module | None]:
    """The weight source of a model loaded with its parameters on the meta device (sharded
    loading, see hf_zero.integrations.zero3_loading), after checking it covers every one, and
    the module that carries it (the model, or the model inside a wrapper such as PEFT's)."""
    disarm_materialisation(model)  # see [Note: materialising on first use]
    meta = [name for name, p in model.named_parameters() if p.is_meta]
    if not meta:
        return None, None
    found = find_source(model)
    if found is None:
        raise ValueError(
            f"{len(meta)} parameters of the model are on the meta device (e.g. {meta[:3]}) and "
            "nothing says where their values are; load the model with from_pretrained (with or "
            "without a live stage-3 HfZeroConfig) or materialise it before hf_zero.initialize"
        )
    source, owner = found
    if initialise_new_adapters(model):
        meta = [name for name, p in model.named_parameters() if p.is_meta]
    absent = [name for name in meta if not source.has(name)]
    if absent:
        raise ValueError(
            f"parameters {absent[:8]}{' ...' if len(absent) > 8 else ''} are not in the checkpoint "
            f"({len(absent)} in all); hf_zero's sharded loading needs every weight in the files. "
            "Load this model without a live stage-3 HfZeroConfig: initialize then shards the "
            "fully built model"
        )
    return source, owner


def _agree_on_real_params(model: nn.Module, comm: Communicator, device: torch.device) -> None:
    """A lazily loaded model may hold a few real parameters beside its meta ones (embeddings
    resized before initialize: their new rows are random). The groups take them as they are, so
    every rank must hold rank 0's values, as a fully built model's would be broadcast."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not param.is_meta:
                on_device = param.data.to(device)  # the collective's device (nccl: the GPU)
                comm.broadcast_(on_device, src=0, label=f"real_param.{name}")
                param.data.copy_(on_device)


def _keep_adapters_gathered(model: nn.Module) -> None:
    """A PEFT model's trainable parameters (its adapters) stay gathered under stage 3. They are
    a small fraction of the model, and PEFT's ``save_pretrained`` reads ``state_dict()`` outside
    any forward: sharded adapters would be saved empty (the bug DeepSpeed ZeRO-3 users of PEFT
    report). The frozen base model is sharded as usual."""
    if getattr(model, "peft_config", None) is None:
        return
    for param in model.parameters():
        if param.requires_grad:
            setattr(param, KEEP_GATHERED, True)


def _place_buffers(model: nn.Module, device: torch.device, comm: Communicator, source: ParamSource | None) -> None:
    """Buffers are replicated, never sharded: on the compute device, equal on every rank (read
    from the checkpoint when the model was loaded lazily, else rank 0's)."""
    for module_name, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf.device != device:
                module._buffers[name] = buf = buf.to(device)
            full_name = f"{module_name}.{name}" if module_name else name
            if source is not None and source.has(full_name):
                source.fill_(full_name, tuple(buf.shape), 0, buf.numel(), buf.view(-1))
            elif source is None:
                comm.broadcast_(buf, src=0, label=f"buffer.{name}")


def _log_secondary_shards(size: int, world_size: int) -> None:
    """What ``zero_hpz_partition_size`` does here ([Note: secondary shards]), said once."""
    if size >= world_size:
        logger.info("hf_zero: zero_hpz_partition_size %d covers all %d ranks: every gather already stays in one "
                    "group of that size, so hpZ keeps no secondary shards here (it does from %d ranks on)",
                    size, world_size, 2 * size)
        return
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    where = (f"all {world_size} ranks are on one node, so the gathers it keeps local were already (expect little "
             "speed-up)" if local >= world_size else "the backward's gathers no longer cross the network")
    logger.info("hf_zero: zero_hpz_partition_size %d: after a gather over all ranks each keeps 1/%d of what it "
                "received (16-bit weights, or int8 blocks under zero_quantized_weights), and the backward (and the "
                "next micro-step) gathers them within groups of %d ranks; %s", size, size, size, where)


def _log_quantized_gradients(world_size: int) -> None:
    """What ``zero_quantized_gradients`` does here ([Note: quantized gradient reduction]), said once."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    where = (f"all {world_size} ranks are on one node, so it runs as one exchange over them and saves the node's own "
             "links' bytes (expect little speed-up)" if local >= world_size or local <= 0 or world_size % local
             else f"inside each node of {local} ranks first, then 1/{local} of the gradients across nodes")
    logger.info("hf_zero: zero_quantized_gradients: gradient reduce-scatters send 4-bit codes with an fp32 scale per "
                "%d elements (0.28x the bytes of bf16) and sum in fp32, %s; each addend is rounded to half a block "
                "step (absmax / 14), twice", QGZ_BLOCK, where)


def _log_quantized_gathers(world_size: int) -> None:
    """What ``zero_quantized_weights`` does here ([Note: quantized weight gathers]), said once."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    where = (f"all {world_size} ranks are on one node, so the bytes saved are the node's own links' (NVLink, "
             "shared memory), rarely the limit: expect little speed-up" if local >= world_size or world_size == 1
             else "the bytes saved cross the network between nodes")
    logger.info("hf_zero: zero_quantized_weights: stage-3 gathers send int8 with an fp32 scale per %d elements "
                "(0.51x the bytes of bf16, 0.25x of fp32); forward and backward see weights rounded to half a "
                "block step, shards, masters and checkpoints stay exact; %s", QWZ_BLOCK, where)


def _offload_settings(config: HfZeroConfig, optimizer: OptimizerArg, policy: ShardingPolicy) -> OffloadSettings:
    zero = config.zero
    opt = zero.offload_optimizer.device if zero.offload_optimizer is not None else "none"
    params = zero.offload_param.device if zero.offload_param is not None else "none"
    if opt != "none" and not policy.shards_optimizer_state:
        raise NotImplementedError(
            "zero_optimization.offload_optimizer needs ZeRO stage 1, 2 or 3 (as in DeepSpeed); "
            "set zero_optimization.stage")
    if opt == "nvme" and (optimizer is not None or config.optimizer is None):
        raise NotImplementedError(
            "NVMe optimizer offload runs hf_zero's own Adam/AdamW tile by tile: put an \"optimizer\" "
            "section (Adam or AdamW) in the config instead of passing an optimizer")
    if opt == "nvme" and config.optimizer.type in CONFIG_WHOLE_PARAM_TYPES:
        raise NotImplementedError(
            f"NVMe optimizer offload runs hf_zero's own Adam/AdamW tile by tile, and the config's optimizer is "
            f"{config.optimizer.type} (stepped whole, one owner rank per parameter; see docs/optimizers.md): "
            "use offload_optimizer.device \"cpu\" with it, or an Adam/AdamW optimizer section")
    # Each section's pin_memory decides for its own state: offload_optimizer's for the masters,
    # gradient shards and moments, offload_param's for the parameter shards.
    return OffloadSettings(
        optimizer=opt, params=params,
        pin_memory=bool(getattr(zero.offload_optimizer, "pin_memory", True)) if opt != "none" else True,
        pin_params=bool(getattr(zero.offload_param, "pin_memory", True)) if params != "none" else True,
        nvme_path=getattr(zero.offload_optimizer, "nvme_path", None) if opt == "nvme" else None,
        tile_numel=int(zero.sub_group_size),
        host_threads=_host_threads(zero) if opt != "none" else 0,
        aio=_aio_settings(config) if opt == "nvme" else AioSettings(),
    )


def _aio_settings(config: HfZeroConfig) -> AioSettings:
    """[Note: NVMe I/O]: the ``aio`` section (``intra_op_parallelism`` over its older spelling
    ``thread_count``) and the optimizer section's pipeline keys."""
    section = config.get_value("aio", {}) or {}
    threads = section.get("intra_op_parallelism", section.get("thread_count", 1))
    offload = config.zero.offload_optimizer
    pipeline = bool(offload.pipeline_read or offload.pipeline_write
                    or config.get_value("zero_optimization.offload_optimizer.pipeline", False))
    return AioSettings(block_size=int(section.get("block_size", 1 << 20)), threads=int(threads), pipeline=pipeline)


def _host_threads(zero: Any) -> int:
    """[Note: host threads]: the offloaded step's thread count, logged once."""
    share = float(zero.offload_optimizer.cpuadam_cores_perc)
    threads = host_step_threads(share)
    log_choice(threads, share)
    return threads


def _nvme_store(offload: OffloadSettings, rank: int, groups: list[Any]) -> NvmeOptimizerStore:
    """Create the state files (checked before anything is written) and move the masters in."""
    store = NvmeOptimizerStore(offload.nvme_path, rank, [g.layout.shard_numel for g in groups], offload.tile_numel,
                               offload.aio)
    for index, group in enumerate(groups):
        group.master_state.bind_nvme(store, index)
        store.store_master(index, group.storage.read_shard())
    return store


def _nvme_param_store(config: HfZeroConfig, model: nn.Module, comm: Communicator,
                      policy: ShardingPolicy) -> NvmeParamStore:
    """The rank's store for ``offload_param.device: "nvme"``, created (and ``nvme_path``
    checked for the shard bytes beyond ``max_in_cpu``) before any unit is built."""
    section = config.zero.offload_param
    sharded = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()
                  if not is_persistent(p, policy.shards_params, policy.persistence_threshold))
    per_rank = -(-sharded // comm.world_size)
    itemsize = torch.empty((), dtype=config.compute_dtype).element_size()
    return NvmeParamStore(
        section.nvme_path, comm.global_rank, buffer_count=int(section.buffer_count),
        buffer_numel=int(section.buffer_size), max_in_cpu=int(section.max_in_cpu),
        pin_memory=bool(section.pin_memory), needed_bytes=max(0, per_rank - int(section.max_in_cpu)) * itemsize,
    )


def _lower_precision_params(model: nn.Module, config: HfZeroConfig, safe_classes: tuple[type[nn.Module], ...] | None,
                            rank: int) -> dict[int, torch.dtype]:
    """[Note: lower-precision-safe modules]: the parameters gathered and reduced in the autocast
    dtype, and a warning for a listed class the model has no module of."""
    if safe_classes is None or config.autocast_dtype is None:
        return {}
    missing = unmatched_classes(model, safe_classes)
    if missing and config.lower_precision_safe_modules is not None and rank == 0:
        logger.warning("hf_zero config: torch_autocast.lower_precision_safe_modules lists %s, which no module of "
                       "the model is (a subclass is not matched); those entries do nothing", ", ".join(missing))
    return lower_precision_params(model, safe_classes, config.autocast_dtype)


def _buffer_pool(config: HfZeroConfig, device: torch.device, policy: ShardingPolicy) -> BufferPool:
    """The engine's unit buffers ([Note: the buffer pool]), with room for what the schedule frees
    before it allocates again: the stage-3 prefetch bucket and the gradient buckets in flight."""
    return BufferPool(device, prefetch_bytes=policy.prefetch_numel * config.compute_dtype.itemsize,
                      buffers_in_flight=BUCKETS_IN_FLIGHT)


def _offload_by_unit(config: HfZeroConfig, offload: OffloadSettings, specs: list[Any]) -> list[OffloadSettings]:
    """Each unit's offload settings: all the same, except under ``offload_optimizer.ratio`` below
    1, where the units that keep their optimizer state on the device get optimizer "none"
    (see [Note: partial optimizer offload] in hf_zero.offload.placement)."""
    section = config.zero.offload_optimizer
    ratio = float(section.ratio) if section is not None else 1.0
    if offload.optimizer != "cpu" or ratio >= 1.0:
        return [offload] * len(specs)
    kept = dataclasses.replace(offload, optimizer="none")
    numels = [sum(p.numel() for _, p in spec.params if p.requires_grad) for spec in specs]
    return [offload if hosted else kept for hosted in units_to_offload(numels, ratio)]


def _loss_scaler_kwargs(config: HfZeroConfig) -> dict[str, Any]:
    if config.autocast_dtype == torch.float16:  # [Note: torch_autocast]: GradScaler's defaults
        scaling = config.precision_policy()["loss_scaling"]
        return dict(enabled=True, loss_scale=0, initial_scale_power=int(math.log2(scaling["initial_scale"])),
                    loss_scale_window=scaling["window"], hysteresis=scaling["hysteresis"],
                    consecutive_hysteresis=scaling["consecutive_hysteresis"], min_loss_scale=scaling["min_scale"])
    fp16 = config.fp16
    return dict(
        enabled=fp16.enabled, loss_scale=fp16.loss_scale, initial_scale_power=fp16.initial_scale_power,
        loss_scale_window=fp16.loss_scale_window, hysteresis=fp16.hysteresis,
        consecutive_hysteresis=fp16.consecutive_hysteresis, min_loss_scale=fp16.min_loss_scale,
    )
