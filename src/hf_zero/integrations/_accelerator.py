"""HfZeroAccelerator: an ``accelerate.Accelerator`` whose ``prepare`` returns a ZeroEngine.

Accelerate has no plugin registry (``DistributedType`` is a closed enum), so hf_zero enters as a
subclass. It behaves like Accelerate's DeepSpeed path, without the deepspeed package:

- ``prepare(model, optimizer, scheduler, dataloaders...)`` wraps the model with
  :func:`hf_zero.initialize` (a torch optimizer is rebuilt over the shards; ``DummyOptim`` /
  ``DummyScheduler`` select the config's ``optimizer`` / ``scheduler`` sections) and prepares
  dataloaders as usual. The model is never wrapped in DDP.
- ``backward`` runs ``engine.backward`` with ``sync_gradients`` as the accumulation boundary,
  then ``engine.step()``: reduce, clip, optimizer step, engine-owned scheduler step, zero grads.
  The returned optimizer's ``step`` / ``zero_grad`` and an engine-owned scheduler's ``step`` are
  therefore no-ops, and ``clip_grad_norm_`` returns the global norm the engine computed. In a
  custom loop the script's own torch scheduler is not engine-owned: see [Note: who steps the
  script's scheduler]. With ``"gradient_clipping": "auto"`` a custom loop's boundary step waits
  for the script's ``clip_grad_norm_`` or ``optimizer.step()``: see [Note: "auto" clipping
  follows the script].
- ``prepare_model(model, evaluation_mode=True)`` under stage 3 builds an optimizer-less engine
  (ZeRO inference); stages 0-2 evaluate the plain, replicated model.
- ``get_state_dict`` gathers the full weights on rank 0 (fp32 unless the config asks for 16-bit);
  ``save_model`` writes them with ``save_pretrained`` (a folder ``from_pretrained`` loads).
- ``save_state`` / ``load_state``: the engine's sharded checkpoint plus Accelerate's RNG and
  dataloader state; see [Note: save_state under hf_zero].
- The config comes from ``hf_zero_plugin=HfZeroPlugin(...)`` (hf_zero.integrations._plugin),
  ``hf_zero_config=`` (the Trainer integration), or the ``HF_ZERO_*`` environment. Its "auto"
  values are filled in ``prepare`` from what it sees, as Accelerate's ``_prepare_deepspeed`` does.

Accelerate's own mixed precision is forced to "no": the engine owns precision, as DeepSpeed does.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
from typing import Any, Iterator

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import DynamoBackend
# accelerate.utils exports these only when deepspeed is installed; the module defines them always.
from accelerate.utils.deepspeed import DummyOptim, DummyScheduler
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

import hf_zero
from hf_zero.config import HfZeroConfig
from hf_zero.engine.engine import ZeroEngine
from hf_zero.engine.initialize import hidden_size_of
from hf_zero.engine.optim.optimizer import ZeroOptimizer
from hf_zero.integrations._plugin import HfZeroPlugin, plugin_from_env
from hf_zero.integrations._weights import attach_engine, engine_of, gather_full_state_dict, release_engine
from hf_zero.integrations.parallelism import hidden_from_accelerate, parallelism_from_env, with_sequence_parallel
from hf_zero.sequence_parallel.layout import configured_size, data_parallel_place

logger = logging.getLogger("hf_zero")

# The environment variable the runner (and a user) sets to switch hf_zero on: a JSON path or text.
CONFIG_ENV = "HF_ZERO_CONFIG"
# The tag save_state gives the engine checkpoint inside its folder (DeepSpeed under Accelerate
# uses the same ckpt_id).
ENGINE_CHECKPOINT_TAG = "pytorch_model"
# A folder: each rank writes memory-rank<R>.json (engine.memory_report()) after its first
# optimizer step, so a run of an unmodified script can show its per-rank memory.
MEMORY_REPORT_ENV = "HF_ZERO_MEMORY_REPORT"
# Accelerate's other distributed backends: hf_zero replaces them, it cannot run under them.
_OTHER_BACKEND_ARGUMENTS = ("deepspeed_plugin", "deepspeed_plugins", "fsdp_plugin", "megatron_lm_plugin")
_OTHER_BACKEND_VARIABLES = ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_MEGATRON_LM")

# How many models an accelerator with an hf_zero config took (training engines, inference
# engines, and stage 0-2 evaluation models): hf_zero.run fails a run with a config that took none.
_MODELS_PREPARED = [0]


def hf_zero_models_prepared() -> int:
    return _MODELS_PREPARED[0]


def _check_no_other_backend(kwargs: dict[str, Any]) -> None:
    given = [name for name in _OTHER_BACKEND_ARGUMENTS if kwargs.get(name) is not None]
    given += [f"{name}={os.environ[name]}" for name in _OTHER_BACKEND_VARIABLES
              if os.environ.get(name, "").lower() in ("1", "true", "yes")]
    if given:
        raise NotImplementedError(
            f"an hf_zero config is set but the accelerator is also asked for another backend ({', '.join(given)}); "
            "hf_zero replaces DeepSpeed/FSDP/Megatron-LM: launch with a plain multi-process accelerate config "
            "(no deepspeed_config / fsdp_config) and drop the plugin argument")


class HfZeroOptimizerWrapper(AcceleratedOptimizer):
    """The engine's :class:`ZeroOptimizer` as Accelerate hands it out. ``step`` and ``zero_grad``
    are no-ops because ``accelerator.backward`` steps the engine at the accumulation boundary;
    ``param_groups`` are the sharded optimizer's, so torch LR schedulers built on this object
    drive the real learning rate."""

    def __init__(self, optimizer: ZeroOptimizer, engine: ZeroEngine, accelerator: HfZeroAccelerator) -> None:
        super().__init__(optimizer, device_placement=False, scaler=None)
        self.engine = engine
        self.accelerator = accelerator

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        pass  # the engine zeroes its gradient shards after each step

    def step(self, closure: Any = None) -> None:
        # see the class docstring; a boundary step still waiting runs here, unclipped
        # ([Note: "auto" clipping follows the script])
        self.accelerator._finish_pending_step()

    @property
    def step_was_skipped(self) -> bool:
        """True when the last engine step was skipped (an fp16 overflow, or inf/nan gradients
        with ``bf16.check_grad_overflow``). The Trainer asks after every step; under the raise
        policy the answer needs no wait for the device (``ZeroOptimizer.skipped``)."""
        return self.optimizer.skipped


class HfZeroSchedulerWrapper(AcceleratedScheduler):
    """A scheduler the engine steps itself (``engine.step()``); ``step`` here is a no-op."""

    def step(self, *args: Any, **kwargs: Any) -> None:
        pass


def config_from_env() -> HfZeroConfig | None:
    source = os.environ.get(CONFIG_ENV)
    return HfZeroConfig(source) if source else None


def derived_config(raw: dict[str, Any]) -> HfZeroConfig:
    """A config computed from the user's (resolved, sections dropped): unlike the user's own, it
    must not become the live stage-3 config that switches on sharded loading (config/live.py)."""
    from hf_zero.config.live import live_zero3_config, set_live_zero3_config

    live = live_zero3_config()
    config = HfZeroConfig(raw)
    if live is not None and live_zero3_config() is not live:
        set_live_zero3_config(live)
    return config


def _without_sections(config: HfZeroConfig, names: tuple[str, ...]) -> HfZeroConfig:
    raw = config.to_dict()
    for name in names:
        raw.pop(name, None)
    return derived_config(raw)


class HfZeroAccelerator(Accelerator):
    """``Accelerator`` with hf_zero's ZeRO engine in place of DDP (see the module docstring).

    ``hf_zero_config`` is an :class:`HfZeroConfig`, a dict or a JSON path; when omitted it comes
    from the ``HF_ZERO_CONFIG`` environment variable, and with neither this is a plain
    Accelerator. The config may still hold "auto" values: ``prepare`` fills the world size and the
    model's hidden size, and reports anything else left unresolved in one HfZeroConfigError.
    """

    def __init__(self, *args: Any, hf_zero_plugin: HfZeroPlugin | None = None,
                 hf_zero_config: HfZeroConfig | dict | str | None = None, **kwargs: Any) -> None:
        if hf_zero_plugin is not None and hf_zero_config is not None:
            raise ValueError("pass either hf_zero_plugin= or hf_zero_config= to HfZeroAccelerator, not both")
        if hf_zero_config is not None:
            config: HfZeroConfig | None = HfZeroConfig(hf_zero_config)
        else:
            if hf_zero_plugin is None:
                hf_zero_plugin = plugin_from_env()
            config = hf_zero_plugin.hf_zero_config if hf_zero_plugin is not None else None
        # The precision asked for fills "auto" in fp16/bf16.enabled; Accelerate's own is then
        # forced to "no" because the engine owns precision (as DeepSpeed does).
        requested = kwargs.get("mixed_precision") or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
        self._requested_precision = str(getattr(requested, "value", requested))
        if config is not None:
            _check_no_other_backend(kwargs)
            kwargs["mixed_precision"] = "no"
            # [Note: parallelism_config]: its sp_size becomes the config's; Accelerate never sees it
            parallelism = kwargs.pop("parallelism_config", None) or parallelism_from_env()
            if parallelism is not None:
                config = derived_config(with_sequence_parallel(config.to_dict(), parallelism,
                                                               int(os.environ.get("WORLD_SIZE", "1"))))
        with hidden_from_accelerate() if config is not None else contextlib.nullcontext():
            super().__init__(*args, **kwargs)
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if config is not None and launched != self.num_processes:
            raise RuntimeError(
                f"the launcher started {launched} processes but Accelerate joined {self.num_processes} "
                f"({self.distributed_type}): on a machine without GPUs set ACCELERATE_USE_CPU=true with "
                "`accelerate launch --multi_gpu --num_processes N` (or use_cpu: true in the yaml), or pass "
                "cpu=True to the accelerator, so the processes join over gloo")
        self.hf_zero_plugin = hf_zero_plugin
        # [Note: who resolves "auto"]
        # With a plugin (or the environment) this accelerator runs a
        # custom loop: prepare() fills "auto" from what it sees and keeps Accelerate's
        # accumulation steps equal to the config's. With hf_zero_config= (the Trainer
        # integration) the Trainer has resolved the config and counts accumulation itself.
        self._owns_accumulation = hf_zero_config is None
        self.hf_zero_config: HfZeroConfig | None = config
        self.hf_zero_engine: ZeroEngine | None = None
        self._clip_follows_script = False  # [Note: "auto" clipping follows the script]
        self._pending_step: ZeroEngine | None = None
        self._memory_report_dir = os.environ.get(MEMORY_REPORT_ENV) if config is not None else None

    # ------------------------------------------------------------------ prepare
    def _resolved_config(self, model: nn.Module, inference: bool, values: dict[str, Any] | None = None) -> HfZeroConfig:
        config = self.hf_zero_config
        if inference:  # as transformers' deepspeed_init(inference=True): no optimizer, no scheduler
            config = _without_sections(config, ("optimizer", "scheduler"))
        resolved = config.resolve(world_size=self.num_processes, hidden_size=hidden_size_of(model), **(values or {}))
        gas = resolved.gradient_accumulation_steps
        if self._owns_accumulation and not inference and gas is not None and gas != self.gradient_accumulation_steps:
            logger.warning("Gradient accumulation steps mismatch: the accelerator has %d, the hf_zero config has "
                           "%d. Using the hf_zero config's value.", self.gradient_accumulation_steps, gas)
            self.gradient_accumulation_steps = gas
        return resolved

    def _auto_values(self, args: tuple[Any, ...], optimizer: Any, scheduler: Any) -> dict[str, Any]:
        """What fills the config's "auto" keys, as Accelerate's ``_prepare_deepspeed`` does: the
        dataloaders' batch size, the accelerator's accumulation steps and precision, and
        DummyOptim / DummyScheduler hyper-parameters. Clipping is the exception: "auto" is 0 (off)
        until the script asks for it ([Note: "auto" clipping follows the script])."""
        values: dict[str, Any] = {
            "gradient_accumulation_steps": self.gradient_accumulation_steps, "gradient_clipping": 0.0,
            "fp16": self._requested_precision == "fp16", "bf16": self._requested_precision == "bf16",
        }
        size = self._train_batch_size(args)
        if size is not None:
            values["train_micro_batch_size_per_gpu"] = size // self.num_processes if self.split_batches else size
        if isinstance(optimizer, DummyOptim):
            values.update(lr=optimizer.lr, weight_decay=optimizer.weight_decay)
            if isinstance(scheduler, DummyScheduler):
                values.update(warmup_min_lr=0, warmup_max_lr=optimizer.lr,
                              warmup_num_steps=scheduler.warmup_num_steps, total_num_steps=scheduler.total_num_steps)
        return values

    def _train_batch_size(self, args: tuple[Any, ...]) -> int | None:
        """The batch size of the dataloader that trains, for an "auto" micro-batch: the one shuffled
        dataloader (a training sampler) among several, else the first prepared (Accelerate's
        order: ``prepare(model, optimizer, train_dataloader, eval_dataloader, ...)``). Only when
        several are shuffled does the plugin's ``is_train_batch_min`` choose, as DeepSpeedPlugin's
        does for all of them, whose smallest-batch rule logged an eval loader's batch as trained."""
        loaders = [a for a in args if isinstance(a, DataLoader) and a.batch_size is not None]
        shuffled = [loader for loader in loaders if isinstance(loader.sampler, RandomSampler)
                    or isinstance(loader.sampler, DistributedSampler) and loader.sampler.shuffle]
        if len(shuffled) > 1:
            sizes = [loader.batch_size for loader in shuffled]
            return min(sizes) if getattr(self.hf_zero_plugin, "is_train_batch_min", True) else max(sizes)
        chosen = shuffled or loaders
        return chosen[0].batch_size if chosen else None

    def _build_engine(self, model: nn.Module, optimizer: Any = None, scheduler: Any = None,
                      inference: bool = False, values: dict[str, Any] | None = None) -> ZeroEngine:
        existing = engine_of(model)
        if existing is not None and (existing.optimizer is not None or inference):
            return self._track(existing)
        if existing is not None:
            release_engine(existing)  # an evaluation-only engine makes way for a training one
        current = self.hf_zero_engine
        if not inference and current is not None and current.optimizer is not None and current in self._models:
            raise NotImplementedError(
                "hf_zero's accelerator trains one model: a second model was prepared for training "
                "(accelerator.backward steps one engine). Train the models in one nn.Module with one optimizer, "
                "or prepare a frozen model with accelerator.prepare_model(model, evaluation_mode=True)")
        config = self._resolved_config(model, inference, values)
        torch_optimizer = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
        if isinstance(optimizer, DummyOptim) and config.optimizer is None:
            raise ValueError(
                "DummyOptim was passed to prepare() but the hf_zero config has no \"optimizer\" "
                "section; add one, or pass a torch optimizer"
            )
        lr_scheduler = scheduler
        if isinstance(scheduler, DummyScheduler):
            lr_scheduler = None if config.scheduler is not None else scheduler.lr_scheduler_callable
        elif self._script_steps_scheduler(scheduler):
            lr_scheduler = None  # re-pointed below; see [Note: who steps the script's scheduler]
        # Without an optimizer this is an evaluation engine (prepare_model(evaluation_mode=True), an
        # eval-only prepare(model), the Trainer's evaluate before train): initialize must not refuse it.
        engine, _, _, _ = hf_zero.initialize(
            model=model, config=config, optimizer=torch_optimizer, lr_scheduler=lr_scheduler,
            _inference_only=inference or (torch_optimizer is None and config.optimizer is None),
        )
        if self._script_steps_scheduler(scheduler) and engine.optimizer is not None:
            # The sharded optimizer's param groups carry the same hyperparameters (initial_lr included).
            scheduler.optimizer = engine.optimizer
        attach_engine(engine)
        self._compile_units(engine)
        return self._track(engine)

    def _compile_units(self, engine: ZeroEngine) -> None:
        """Accelerate's dynamo plugin (the Trainer's ``torch_compile``) compiles each unit's
        forward, never the whole engine: see [Note: compiled units]."""
        plugin = self.state.dynamo_plugin
        if plugin is None or plugin.backend == DynamoBackend.NO:
            return
        kwargs = plugin.to_kwargs()
        engine.compile(backend=kwargs.pop("backend", plugin.backend.value.lower()), compile_kwargs=kwargs)

    # [Note: who steps the script's scheduler]
    # In a custom loop (a plugin or the environment gives the config) a torch LR scheduler the
    # script built stays the script's: prepare() wraps it in Accelerate's own AcceleratedScheduler,
    # re-pointed at the sharded optimizer, so ``scheduler.step()`` moves the learning rate exactly
    # as it does under plain DDP (once per sync step, times the number of processes unless
    # split_batches, which is why run_clm_no_trainer.py multiplies its step counts by it) and
    # Accelerate's save_state / load_state keep its state. The engine steps before the script's
    # ``scheduler.step()`` (inside accelerator.backward), as the optimizer does under DDP, so
    # each step uses the learning rate DDP would use. DummyScheduler and the config's "scheduler"
    # section are engine-owned, as under DeepSpeed; so is the Trainer's scheduler (it counts
    # its own steps).
    def _script_steps_scheduler(self, scheduler: Any) -> bool:
        return self._owns_accumulation and isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler)

    def _track(self, engine: ZeroEngine) -> ZeroEngine:
        # backward() steps hf_zero_engine: a frozen model's inference engine (a DPO reference
        # model, prepared before or after the trained one) must not take its place, and a second
        # trained model would leave the first one unstepped.
        current = self.hf_zero_engine
        if engine.optimizer is not None or current is None or current.optimizer is None:
            self.hf_zero_engine = engine
        if engine not in self._models:
            self._models.append(engine)
            _MODELS_PREPARED[0] += 1
        return engine

    def _wrap_optimizer(self, engine: ZeroEngine) -> HfZeroOptimizerWrapper | None:
        if engine.optimizer is None:
            return None
        for existing in self._optimizers:
            if getattr(existing, "optimizer", None) is engine.optimizer:
                return existing
        wrapper = HfZeroOptimizerWrapper(engine.optimizer, engine, self)
        self._optimizers.append(wrapper)
        return wrapper

    def _wrap_scheduler(self, engine: ZeroEngine, optimizer: HfZeroOptimizerWrapper | None,
                        scheduler: Any = None) -> Any:
        if engine.lr_scheduler is None and self._script_steps_scheduler(scheduler) and optimizer is not None:
            wrapper = AcceleratedScheduler(scheduler, optimizer, step_with_optimizer=self.step_scheduler_with_optimizer,
                                           split_batches=self.split_batches)
            self._schedulers.append(wrapper)
            return wrapper
        if engine.lr_scheduler is None:
            return None
        wrapper = HfZeroSchedulerWrapper(engine.lr_scheduler, optimizer or [])
        self._schedulers.append(wrapper)
        return wrapper

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        if self.hf_zero_config is None:
            return super().prepare(*args, device_placement=device_placement)
        models = [i for i, a in enumerate(args) if isinstance(a, nn.Module)]
        if len(models) > 1:
            raise NotImplementedError(
                f"hf_zero's accelerator prepares one model per prepare() call ({len(models)} were passed): "
                "prepare the trained model with its optimizer, and a frozen model (a reference or teacher) "
                "with accelerator.prepare_model(model, evaluation_mode=True)")
        optimizers = [i for i, a in enumerate(args) if isinstance(a, (torch.optim.Optimizer, DummyOptim))]
        schedulers = [i for i, a in enumerate(args)
                      if isinstance(a, (torch.optim.lr_scheduler.LRScheduler, DummyScheduler))]
        result = list(args)
        if models:
            self._prepare_training(result, models[0], optimizers, schedulers)
        elif optimizers:  # an optimizer prepared again on a later train() call
            for i in optimizers:
                result[i] = self._already_prepared_optimizer(args[i])
        rest = [i for i, a in enumerate(result) if isinstance(a, DataLoader)]
        if rest:
            prepared = super().prepare(*(result[i] for i in rest))
            prepared = prepared if len(rest) > 1 else (prepared,)
            for i, obj in zip(rest, prepared):
                result[i] = obj
        return tuple(result) if len(result) > 1 else result[0]

    def prepare_data_loader(self, data_loader: DataLoader, device_placement: bool | None = None,
                            slice_fn_for_dispatch: Any = None) -> Any:
        """Accelerate's sharding over the data-parallel ranks: with ``sequence_parallel_size: S``
        the S ranks of a group get the same batches ([Note: sequence-parallel layout])."""
        size = configured_size(self.hf_zero_config.to_dict()) if self.hf_zero_config is not None else 1
        if size <= 1:
            return super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)
        if self.dispatch_batches:
            raise NotImplementedError(
                "sequence_parallel_size > 1 with dispatch_batches (an iterable dataset dispatched from rank 0): "
                "use a map-style dataset, or dispatch_batches=False in the accelerator's dataloader_config")
        rank, ranks = data_parallel_place(size, self.process_index, self.num_processes)
        # Accelerate shards by the state's process count and index, read while the loader is
        # built (the shard keeps them): the data-parallel ones for the duration of the call.
        state = self.state
        saved = state.num_processes, state.process_index
        state.num_processes, state.process_index = ranks, rank
        try:
            return super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)
        finally:
            state.num_processes, state.process_index = saved

    def _prepare_training(self, result: list[Any], model_index: int, optimizers: list[int],
                          schedulers: list[int]) -> None:
        if len(optimizers) > 1 or len(schedulers) > 1:
            raise NotImplementedError(
                f"hf_zero's accelerator prepares at most one optimizer and one scheduler with the model "
                f"({len(optimizers)} optimizers, {len(schedulers)} schedulers were passed): put every parameter "
                "in one optimizer, with one param group per set of hyperparameters")
        optimizer = result[optimizers[0]] if optimizers else None
        scheduler = result[schedulers[0]] if schedulers else None
        values = self._auto_values(tuple(result), optimizer, scheduler) if self._owns_accumulation else None
        self._clip_follows_script = self._owns_accumulation and "gradient_clipping" in self.hf_zero_config.auto_keys()
        engine = self._build_engine(result[model_index], optimizer, scheduler, values=values)
        result[model_index] = engine
        wrapped_optimizer = self._wrap_optimizer(engine)
        if optimizers:
            result[optimizers[0]] = wrapped_optimizer
        if schedulers:
            result[schedulers[0]] = self._wrap_scheduler(engine, wrapped_optimizer, scheduler)

    def _already_prepared_optimizer(self, optimizer: Any) -> Any:
        if isinstance(optimizer, HfZeroOptimizerWrapper):
            self._track(optimizer.engine)
            if optimizer not in self._optimizers:
                self._optimizers.append(optimizer)
            return optimizer
        raise RuntimeError(
            "HfZeroAccelerator.prepare got an optimizer without its model: pass the model and the "
            "optimizer to the same prepare() call so the optimizer can be rebuilt over the shards"
        )

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> nn.Module:
        if self.hf_zero_config is None:
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        existing = engine_of(model)
        if existing is not None:
            return existing
        if evaluation_mode:
            if self.hf_zero_config.stage != 3:
                _MODELS_PREPARED[0] += 1
                return model.to(self.device)  # stages 0-2 keep full parameters anyway
            return self._build_engine(model, inference=True)
        return self._build_engine(model)

    # ------------------------------------------------------------------ training step
    # [Note: "auto" clipping follows the script]
    # Under DDP a custom loop clips only where it calls ``accelerator.clip_grad_norm_(params,
    # max_norm)``, at that max_norm; run_clm_no_trainer.py never calls it. Accelerate's DeepSpeed
    # plugin turns "auto" into 1.0 and clips inside ``backward`` whatever the script does. On
    # hf_zero's custom-loop routes (a plugin or the HF_ZERO_* environment) "auto" follows the
    # script instead: it resolves to 0 (off), and at an accumulation boundary ``backward`` runs
    # only the engine's backward; the engine's step (clip, optimizer step, engine-owned scheduler,
    # zero grads) waits for the first of
    #   - ``clip_grad_norm_(params, max_norm)``: the step clips at max_norm (that step only) and the
    #     call returns the global norm before clipping, as torch's does;
    #   - ``optimizer.step()``: the step does not clip.
    # Either comes before the script's ``scheduler.step()``, so the order is DDP's. A boundary left
    # without either is an error at the next ``backward``. A number in the config (and the
    # Trainer, which fills "auto" from max_grad_norm) keeps the step inside ``backward``, clipped
    # at that number, as under DeepSpeed.
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        engine = self.hf_zero_engine
        if engine is None or engine.optimizer is None:
            return super().backward(loss, **kwargs)
        if self._pending_step is not None:
            raise RuntimeError(
                "accelerator.backward was called again before the last accumulation boundary's optimizer step: "
                "with \"gradient_clipping\": \"auto\" the hf_zero engine steps at optimizer.step() (or at "
                "accelerator.clip_grad_norm_); call optimizer.step() after accelerator.backward at each boundary, "
                "as under DDP, or set gradient_clipping to a number in the ZeRO config")
        kwargs.pop("scale_wrt_gas", None)  # Accelerate's accumulation divides here, as for DDP
        loss = loss / self.gradient_accumulation_steps
        engine.set_gradient_accumulation_boundary(self.sync_gradients)
        engine.backward(loss, scale_wrt_gas=False, **kwargs)
        if self.sync_gradients and self._clip_follows_script:
            self._pending_step = engine  # stepped by clip_grad_norm_ or optimizer.step()
            return
        self._step_engine(engine)

    def _step_engine(self, engine: ZeroEngine, clipping: float | None = None) -> None:
        """``engine.step()``, clipping at ``clipping`` for this step when given."""
        self._pending_step = None
        optimizer = engine.optimizer
        configured = optimizer.gradient_clipping
        if clipping is not None:
            optimizer.gradient_clipping = clipping
        try:
            engine.step()
        finally:
            optimizer.gradient_clipping = configured
        if self._memory_report_dir and self.sync_gradients:
            self._write_memory_report(engine)

    def _finish_pending_step(self) -> None:
        if self._pending_step is not None:
            self._step_engine(self._pending_step)

    def _write_memory_report(self, engine: ZeroEngine) -> None:
        """This rank's memory after its first optimizer step (``HF_ZERO_MEMORY_REPORT``)."""
        os.makedirs(self._memory_report_dir, exist_ok=True)
        path = os.path.join(self._memory_report_dir, f"memory-rank{self.process_index}.json")
        with open(path, "w") as f:
            json.dump({"rank": self.process_index, "world_size": self.num_processes,
                       "stage": engine.config.stage, "memory": engine.memory_report()}, f)
        self._memory_report_dir = None  # once per accelerator

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor | None:
        """The global gradient norm (before clipping) of this boundary's step. With
        ``"gradient_clipping": "auto"`` in a custom loop the step runs here, clipped at
        ``max_norm`` ([Note: "auto" clipping follows the script]). Otherwise the engine has
        clipped with the config's ``gradient_clipping`` during its step (inside ``backward``, as
        DeepSpeed does), and a ``max_norm`` other than that one cannot be honoured: an error."""
        engine = self.hf_zero_engine
        if engine is None or engine.optimizer is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        wanted = float(max_norm) if math.isfinite(float(max_norm)) and float(max_norm) > 0 else 0.0
        if self._pending_step is not None and float(norm_type) == 2.0:
            self._step_clipped(engine, wanted)
        elif not self._clip_follows_script:
            self._check_configured_clipping(engine, max_norm, norm_type, wanted)
        elif float(norm_type) != 2.0:
            raise ValueError(f"clip_grad_norm_(norm_type={norm_type}): the hf_zero engine clips the global 2-norm only")
        # A tensor, as torch's clip_grad_norm_ returns: still on the device when the step's outcome
        # has not been read ([Note: a step the host does not wait for]), so a loop that does not
        # read it does not wait for the GPU.
        return None if engine.optimizer is None else engine.optimizer.global_grad_norm_tensor()

    def _step_clipped(self, engine: ZeroEngine, max_norm: float) -> None:
        if max_norm > 0 and getattr(engine.optimizer, "overlapped", None) is not None:
            raise NotImplementedError(
                f"clip_grad_norm_(max_norm={max_norm:g}) with \"gradient_clipping\": \"auto\" and the overlapped "
                "offloaded optimizer step: that step starts during the backward, before a clipping factor is "
                f"known. Set gradient_clipping to {max_norm:g} in the ZeRO config (the offloaded step then waits "
                "for the global norm)")
        self._step_engine(engine, clipping=max_norm)

    @staticmethod
    def _check_configured_clipping(engine: ZeroEngine, max_norm: float, norm_type: float, wanted: float) -> None:
        configured = float(engine.config.gradient_clipping or 0.0)
        if abs(wanted - configured) > 1e-12 or float(norm_type) != 2.0:
            raise ValueError(
                f"clip_grad_norm_(max_norm={max_norm}, norm_type={norm_type}): the hf_zero engine has already "
                f"stepped inside accelerator.backward with the config's gradient_clipping={configured:g} (2-norm; "
                "0 = off), as DeepSpeed does, and cannot clip this step at another value. Set gradient_clipping "
                f"to {wanted:g} in the ZeRO config (or HF_ZERO_GRADIENT_CLIPPING / HfZeroPlugin(gradient_clipping=...)), "
                "or to \"auto\" to clip where the script asks")

    # ------------------------------------------------------------------ models and weights
    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True,
                     keep_torch_compile: bool = True) -> nn.Module:
        if isinstance(model, ZeroEngine):
            model = model.module
        return super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """Full weights on rank 0 (an empty dict elsewhere); collective under hf_zero."""
        engine = engine_of(model)
        if engine is None:
            return super().get_state_dict(model, unwrap=unwrap)
        return gather_full_state_dict(engine)

    def free_memory(self, *objects: Any) -> Any:
        # The engine stays attached to its model (the Trainer frees memory at the start of
        # train()); only the accelerator's references go.
        self.hf_zero_engine = None
        self._pending_step = None
        return super().free_memory(*objects)

    def save_model(self, model: nn.Module, save_directory: str | os.PathLike[str], max_shard_size: int | str = "10GB",
                   safe_serialization: bool = True) -> None:
        """A folder ``from_pretrained`` loads (config and full weights) for a Hugging Face model
        under hf_zero; collective. Other models take Accelerate's path (weights only)."""
        engine = engine_of(model)
        if engine is None:
            return super().save_model(model, save_directory, max_shard_size=max_shard_size,
                                      safe_serialization=safe_serialization)
        state_dict = self.get_state_dict(engine)
        module = engine.module
        if self.is_main_process and hasattr(module, "save_pretrained"):
            module.save_pretrained(save_directory, state_dict=state_dict, max_shard_size=max_shard_size,
                                   safe_serialization=safe_serialization)
        elif self.is_main_process:  # not a transformers model: the full weights, sharded by size
            from huggingface_hub import save_torch_state_dict

            save_torch_state_dict(state_dict, save_directory, max_shard_size=max_shard_size,
                                  safe_serialization=safe_serialization)
        self.wait_for_everyone()

    # ------------------------------------------------------------------ checkpoints
    # [Note: save_state under hf_zero]
    # As under DeepSpeed, the engine writes the model, optimizer and its scheduler itself
    # (``engine.save_checkpoint(dir, tag="pytorch_model")``: a sharded checkpoint every rank
    # writes and that loads at any world size). Accelerate's own save_state then runs with the
    # engine's model, optimizer and schedulers hidden, so it still writes the RNG states, the
    # dataloader samplers, registered objects and the step counter, and runs its naming and
    # rotation (``ProjectConfiguration``). Loading reverses it, RNG last.
    def _hidden_engine_objects(self) -> tuple[list[Any], list[Any], list[Any]]:
        engine_models = [m for m in self._models if isinstance(m, ZeroEngine)]
        engine_optimizers = [o for o in self._optimizers if isinstance(o, HfZeroOptimizerWrapper)]
        engine_schedulers = [s for s in self._schedulers if isinstance(s, HfZeroSchedulerWrapper)]
        return engine_models, engine_optimizers, engine_schedulers

    @contextlib.contextmanager
    def _without_engine_objects(self) -> Iterator[None]:
        saved = (self._models, self._optimizers, self._schedulers)
        models, optimizers, schedulers = self._hidden_engine_objects()
        self._models = [m for m in saved[0] if m not in models]
        self._optimizers = [o for o in saved[1] if o not in optimizers]
        self._schedulers = [s for s in saved[2] if s not in schedulers]
        try:
            yield
        finally:
            self._models, self._optimizers, self._schedulers = saved

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any) -> str:
        engines = self._hidden_engine_objects()[0]
        if self.hf_zero_config is None or not engines:
            return super().save_state(output_dir, safe_serialization=safe_serialization, **kwargs)
        if len(engines) > 1:
            raise NotImplementedError("HfZeroAccelerator.save_state with more than one hf_zero engine")
        with self._without_engine_objects():
            location = super().save_state(output_dir, safe_serialization=safe_serialization, **kwargs)
        engines[0].save_checkpoint(location, tag=ENGINE_CHECKPOINT_TAG)
        self.wait_for_everyone()
        return location

    def _latest_automatic_checkpoint(self) -> str:
        """``load_state(None)``: the newest ``checkpoint_<n>`` of Accelerate's automatic naming
        (``ProjectConfiguration(automatic_checkpoint_naming=True)``), as Accelerate picks it."""
        if not self.project_configuration.automatic_checkpoint_naming:
            raise ValueError("load_state(None): no input_dir given and automatic checkpoint naming is disabled; pass "
                             "the directory save_state returned, or use ProjectConfiguration(automatic_checkpoint_naming=True)")
        root = os.path.join(self.project_dir, "checkpoints")
        numbered = [(int(m.group(1)), name) for name in (os.listdir(root) if os.path.isdir(root) else [])
                    if (m := re.fullmatch(r"checkpoint_(\d+)", name))]
        if not numbered:
            raise FileNotFoundError(f"load_state(None): {root} holds no checkpoint_<n> folder written by save_state()")
        return os.path.join(root, max(numbered)[1])

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **kwargs: Any) -> None:
        engines = self._hidden_engine_objects()[0]
        if self.hf_zero_config is None or not engines:
            return super().load_state(input_dir, load_kwargs=load_kwargs, **kwargs)
        if input_dir is None:
            input_dir = self._latest_automatic_checkpoint()
        if not os.path.isdir(os.path.join(input_dir, ENGINE_CHECKPOINT_TAG)):
            raise FileNotFoundError(
                f"{input_dir} holds no hf_zero engine checkpoint ({ENGINE_CHECKPOINT_TAG}/): was it written by "
                "HfZeroAccelerator.save_state? A plain Accelerate checkpoint cannot resume a ZeRO run")
        engines[0].load_checkpoint(input_dir, tag=ENGINE_CHECKPOINT_TAG)
        with self._without_engine_objects():
            super().load_state(input_dir, load_kwargs=load_kwargs, **kwargs)
