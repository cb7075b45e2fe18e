"""The Transformers ``Trainer`` on hf_zero: ``--zero_config zero3.json`` instead of ``--deepspeed``.

Three ways in, one set of overrides:

- explicit: ``HfZeroTrainingArguments(zero_config="zero3.json", ...)`` and ``HfZeroTrainer``
  (``HfZeroSeq2SeqTrainer`` for ``Seq2SeqTrainer``);
- :func:`enable` applies the same overrides in place on ``TrainingArguments`` and ``Trainer``, so
  unmodified scripts, ``Seq2SeqTrainer`` and third-party subclasses pick them up. They are inert
  unless a config is given, by the ``zero_config`` field or the ``HF_ZERO_CONFIG`` variable;
- ``python -m hf_zero.run script.py --zero_config zero3.json ...`` (see hf_zero.run) calls
  :func:`enable` and runs an unmodified script.

Nothing here sets transformers' DeepSpeed weak reference, ``--deepspeed`` or
``ACCELERATE_USE_DEEPSPEED``: each routes into the deepspeed package. The Trainer runs its
non-DeepSpeed code path with an :class:`HfZeroAccelerator` in place of ``Accelerator``
(docs/how-it-works.md, "The Trainer integration").

[Note: when "auto" is resolved]
transformers fills a DeepSpeed config in two passes and raises the mismatches only at train time.
hf_zero keeps the two passes but reports every contradiction as early as it can:

- when ``TrainingArguments`` is built: batch sizes, accumulation, clipping, optimizer
  hyperparameters, warmup_min_lr / warmup_max_lr and fp16 / bf16 are filled from the arguments,
  and every non-"auto" value that contradicts them is reported, all in one HfZeroConfigError. With
  ``max_steps > 0`` the step count is known, so total_num_steps and warmup_num_steps are filled
  and checked here too. The result, with the model-dependent keys still "auto", is
  ``args.hf_zero_config`` (kept alive as long as the arguments).
- when training starts (``max_steps`` known, the model in hand): the hidden-size keys
  (reduce_bucket_size = h*h, stage3_prefetch_bucket_size = 0.9*h*h,
  stage3_param_persistence_threshold = 10*h), total_num_steps and
  warmup_num_steps = max(1, args.get_warmup_steps(n)).

Mixed precision follows Accelerate's DeepSpeed plugin: ``--bf16`` / ``--fp16`` with no such
section in the config adds one (enabled), as ``DeepSpeedPlugin.set_mixed_precision`` does.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
# accelerate.utils exports this only when deepspeed is installed; the module defines it always.
from accelerate.utils.deepspeed import DummyOptim
from transformers import Seq2SeqTrainer, Trainer, TrainingArguments
from transformers import trainer as trainer_module

from hf_zero.config import ConfigProblem, HfZeroConfig, HfZeroConfigError
from hf_zero.config.auto import resolve_dict
from hf_zero.engine.initialize import hidden_size_of
from hf_zero.integrations._accelerator import (
    CONFIG_ENV,
    HfZeroAccelerator,
    HfZeroOptimizerWrapper,
    HfZeroSchedulerWrapper,
    derived_config,
)
from hf_zero.integrations._weights import engine_of, load_state_dict_into_engine, release_engine
from hf_zero.integrations.parallelism import parallelism_from_env, with_sequence_parallel
from hf_zero.sequence_parallel.layout import configured_size

logger = logging.getLogger("hf_zero")

__all__ = [
    "HfZeroTrainingArguments",
    "HfZeroTrainer",
    "HfZeroSeq2SeqTrainer",
    "HfZeroTrainerMixin",
    "HfZeroAccelerator",
    "enable",
    "disable",
    "is_enabled",
    "trainer_values",
    "resolve_zero_config",
]

SCHEDULER_NAME = "scheduler.pt"  # the Trainer's file name for its own scheduler state

# Keys only the model or the step count can fill: left "auto" when TrainingArguments is built.
_MODEL_KEYS = (
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
)
_STEP_KEYS = ("scheduler.params.total_num_steps", "scheduler.params.warmup_num_steps")

# resolve(...) argument -> the TrainingArguments field(s) it comes from, for error messages.
_ARGUMENT_FIELDS = {
    "train_micro_batch_size_per_gpu": "per_device_train_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "train_batch_size": "train_batch_size (world_size x per_device_train_batch_size x gradient_accumulation_steps)",
    "gradient_clipping": "max_grad_norm",
    "lr": "learning_rate",
    "betas": "adam_beta1+adam_beta2",
    "eps": "adam_epsilon",
    "weight_decay": "weight_decay",
    "warmup_max_lr": "learning_rate",
    "warmup_num_steps": "warmup_steps (as steps)",
    "total_num_steps": "max_steps (num_training_steps)",
    "fp16": "fp16|fp16_full_eval",
    "bf16": "bf16|bf16_full_eval",
}


# ====================================================================== "auto" resolution
def trainer_values(args: TrainingArguments, num_training_steps: int | None = None,
                   sequence_parallel_size: int = 1) -> dict[str, Any]:
    """The values transformers' ``HfTrainerDeepSpeedConfig`` fills "auto" with, key for key
    (``HfTrainerDeepSpeedConfig.trainer_config_process``), as ``HfZeroConfig.resolve(...)`` arguments. The
    batch counts data-parallel ranks: with sequence parallelism, world / S
    ([Note: sequence-parallel layout])."""
    data_parallel = max(1, args.world_size // max(1, sequence_parallel_size))
    values: dict[str, Any] = dict(
        train_micro_batch_size_per_gpu=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        train_batch_size=data_parallel * args.per_device_train_batch_size * args.gradient_accumulation_steps,
        gradient_clipping=args.max_grad_norm,
        lr=args.learning_rate,
        betas=[args.adam_beta1, args.adam_beta2],
        eps=args.adam_epsilon,
        weight_decay=args.weight_decay,
        warmup_min_lr=0,
        warmup_max_lr=args.learning_rate,
        fp16=bool(args.fp16 or args.fp16_full_eval),
        bf16=bool(args.bf16 or args.bf16_full_eval),
    )
    if num_training_steps is not None:
        values["total_num_steps"] = num_training_steps
        values["warmup_num_steps"] = max(1, args.get_warmup_steps(num_training_steps))
    return values


def _with_precision_sections(raw: dict[str, Any], mixed_precision: str) -> dict[str, Any]:
    """Accelerate's ``DeepSpeedPlugin.set_mixed_precision``: an absent section for the requested
    precision is added, enabled; resolution then fills and checks it like any other."""
    for name in ("fp16", "bf16"):
        if mixed_precision == name and name not in raw:
            raw[name] = {"enabled": "auto"}
    return raw


def _problems_in_trainer_terms(problems: list[ConfigProblem], mismatches: set[tuple[str, str]],
                               values: dict[str, Any]) -> list[ConfigProblem]:
    """Mismatch problems name the TrainingArguments field, as transformers' message does."""
    from hf_zero.config.auto import MATCHED_KEYS

    out = []
    for problem in problems:
        argument = MATCHED_KEYS.get(problem.path)
        if (problem.path, problem.rule) not in mismatches or argument is None:
            out.append(problem)
            continue
        field_name = _ARGUMENT_FIELDS.get(argument, argument)
        given = values.get(argument)
        out.append(ConfigProblem(
            problem.path, problem.value,
            f"contradicts TrainingArguments {field_name}={given!r}",
            f'set {problem.path} to "auto" (it then takes {given!r}), or change {field_name.split(" ")[0]}',
        ))
    return out


def _resolve_raw(raw: dict[str, Any], *, world_size: int, hidden_size: int | None,
                 values: dict[str, Any], deferred: tuple[str, ...], source: str) -> dict[str, Any]:
    """Fill what ``values`` can; raise one HfZeroConfigError with every problem, except the
    ``deferred`` keys that are still "auto" (filled later)."""
    resolved, problems, _ = resolve_dict(raw, world_size=world_size, hidden_size=hidden_size,
                                         check_mismatches=True, values=values)
    _, without_mismatches, _ = resolve_dict(raw, world_size=world_size, hidden_size=hidden_size,
                                            check_mismatches=False, values=values)
    plain = {(p.path, p.rule) for p in without_mismatches}
    mismatches = {(p.path, p.rule) for p in problems if (p.path, p.rule) not in plain}
    kept = [p for p in problems if not (p.path in deferred and p.value == "auto")]
    if kept:
        raise HfZeroConfigError(_problems_in_trainer_terms(kept, mismatches, values), source)
    return resolved


def _source_label(source: Any) -> str:
    if isinstance(source, (str, os.PathLike)) and not str(source).lstrip().startswith("{"):
        return str(source)
    return "<zero_config>"


def _zero_config_source(args: TrainingArguments) -> Any:
    return getattr(args, "zero_config", None) or os.environ.get(CONFIG_ENV) or None


def _check_no_deepspeed(args: TrainingArguments) -> None:
    """Before transformers' own __post_init__, which would set its DeepSpeed weak reference."""
    if args.deepspeed:
        raise ValueError(
            "both --zero_config and --deepspeed were given: hf_zero replaces DeepSpeed; keep "
            "--zero_config (it reads the same JSON) and drop --deepspeed"
        )
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() in ("1", "true", "yes"):
        raise ValueError(
            "ACCELERATE_USE_DEEPSPEED is set, which routes the Trainer into the deepspeed package; "
            "unset it (and use a multi-GPU accelerate config, not a DeepSpeed one) with --zero_config"
        )


def _check_supported(args: TrainingArguments) -> None:
    if args.fsdp:
        raise ValueError("--zero_config and --fsdp were both given: choose one sharding engine")
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != args.world_size:
        raise ValueError(
            f"the launcher started {launched} processes but the Trainer runs as world size "
            f"{args.world_size}, so each process would train alone. On a machine without GPUs, "
            "pass --use_cpu (Accelerate then joins the processes over gloo)"
        )
    unsupported = {
        "auto_find_batch_size": "auto_find_batch_size with --zero_config",
    }
    for name, what in unsupported.items():
        if getattr(args, name, False):
            raise NotImplementedError(f"{what} is not supported yet; turn {name} off")


def attach_zero_config(args: TrainingArguments) -> None:
    """The TrainingArguments-time pass of [Note: when "auto" is resolved]; sets
    ``args.hf_zero_config`` (None when no config was given)."""
    source = _zero_config_source(args)
    args.hf_zero_config = None
    if source is None:
        return
    _check_supported(args)
    raw = _with_precision_sections(HfZeroConfig(source).to_dict(), args.mixed_precision)
    raw = with_sequence_parallel(raw, getattr(args, "parallelism_config", None) or parallelism_from_env(),
                                 args.world_size)
    if "optimizer" not in raw:  # the Trainer builds the optimizer: as transformers does for DeepSpeed
        raw.setdefault("zero_allow_untested_optimizer", True)
    steps = args.max_steps if args.max_steps > 0 else None
    deferred = _MODEL_KEYS + (() if steps is not None else _STEP_KEYS)
    resolved = _resolve_raw(raw, world_size=args.world_size, hidden_size=None,
                            values=trainer_values(args, steps, configured_size(raw)), deferred=deferred,
                            source=_source_label(source))
    # This config is the user's, kept alive by the arguments: under stage 3, from_pretrained then
    # loads sharded (hf_zero.config.live).
    args.hf_zero_config = HfZeroConfig(resolved)


def resolve_zero_config(args: TrainingArguments, model: torch.nn.Module | None = None,
                        num_training_steps: int | None = None) -> HfZeroConfig:
    """The train-time pass of [Note: when "auto" is resolved]: ``args.hf_zero_config`` with the
    model's hidden size and the step count filled. Keys that nothing given can fill stay "auto"
    (the engine then reports them)."""
    config = args.hf_zero_config
    if config is None:
        raise RuntimeError("these TrainingArguments have no zero_config; pass --zero_config or set HF_ZERO_CONFIG")
    hidden_size = hidden_size_of(model) if model is not None else None
    resolved = _resolve_raw(config.to_dict(), world_size=args.world_size, hidden_size=hidden_size,
                            values=trainer_values(args, num_training_steps, configured_size(config.to_dict())),
                            deferred=_MODEL_KEYS + _STEP_KEYS, source="<zero_config>")
    return derived_config(resolved)


# ====================================================================== TrainingArguments
_PRISTINE_TA_POST_INIT = TrainingArguments.__post_init__
_PRISTINE_PLACE_MODEL = TrainingArguments.place_model_on_device


def _ta_post_init(self: TrainingArguments) -> None:
    if _zero_config_source(self) is not None:
        _check_no_deepspeed(self)
    _PRISTINE_TA_POST_INIT(self)
    attach_zero_config(self)


def _ta_place_model_on_device(self: TrainingArguments) -> bool:
    # The engine places every shard itself; a model loaded already sharded must not be moved.
    if getattr(self, "hf_zero_config", None) is not None:
        return False
    return _PRISTINE_PLACE_MODEL.fget(self)


@dataclass
class HfZeroTrainingArguments(TrainingArguments):
    """``TrainingArguments`` with a ``zero_config`` field (``--zero_config`` on the command line).

    ``zero_config`` is a DeepSpeed-schema JSON path, inline JSON or a dict; when unset, the
    ``HF_ZERO_CONFIG`` environment variable is read. See [Note: when "auto" is resolved].
    """

    zero_config: str | None = field(
        default=None,
        metadata={"help": "hf_zero ZeRO config: a DeepSpeed-schema JSON file (or inline JSON). "
                          "Replaces --deepspeed; \"auto\" values are filled from these arguments."},
    )

    def __post_init__(self) -> None:
        _ta_post_init(self)

    @property
    def place_model_on_device(self) -> bool:
        return _ta_place_model_on_device(self)


# ====================================================================== Trainer overrides
# Each override is impl(trainer, next_fn, *args, **kwargs): next_fn is the method it overrides
# (super() for HfZeroTrainerMixin, the original function for enable()).


def _config_of(trainer: Trainer) -> HfZeroConfig | None:
    return getattr(trainer.args, "hf_zero_config", None)


def _engine(trainer: Trainer) -> Any:
    return engine_of(trainer.model) if _config_of(trainer) is not None else None


def _create_accelerator_and_postprocess(self: Trainer, next_fn: Callable) -> Any:
    config = _config_of(self)
    if config is None:
        return next_fn()
    original = trainer_module.Accelerator
    trainer_module.Accelerator = functools.partial(HfZeroAccelerator, hf_zero_config=config)
    try:
        return next_fn()
    finally:
        trainer_module.Accelerator = original


def _prepare_for_training(self: Trainer, next_fn: Callable, max_steps: int, *args: Any, **kwargs: Any) -> Any:
    if _config_of(self) is not None:
        self.accelerator.hf_zero_config = resolve_zero_config(self.args, self.model, max_steps)
        # The engine's memory, grad norm, loss scale (and timers) reach the Trainer's logs.
        from hf_zero.integrations.trainer_logging import install_logging_callback

        install_logging_callback(self)
    return next_fn(max_steps, *args, **kwargs)


def _create_optimizer(self: Trainer, next_fn: Callable, model: torch.nn.Module | None = None) -> Any:
    """The config's "optimizer" section wins, as with DeepSpeed (one group, every trainable
    parameter); without one, the Trainer builds its own and the engine rebuilds it over shards."""
    config = _config_of(self)
    if config is None or config.get_value("optimizer") is None or self.optimizer is not None:
        return next_fn(model)
    opt_model = self.model if model is None else model
    self.optimizer = DummyOptim(params=[p for p in opt_model.parameters() if p.requires_grad])
    return self.optimizer


def _create_scheduler(self: Trainer, next_fn: Callable, num_training_steps: int,
                      optimizer: Any = None) -> Any:
    """The config's "scheduler" section, stepped by the engine; otherwise the Trainer's own
    scheduler over the sharded optimizer's param groups, stepped by the Trainer."""
    engine = _engine(self)
    if engine is None or not isinstance(self.optimizer, HfZeroOptimizerWrapper):
        return next_fn(num_training_steps, optimizer)
    if self.lr_scheduler is None and engine.lr_scheduler is not None:
        self.lr_scheduler = HfZeroSchedulerWrapper(engine.lr_scheduler, self.optimizer)
        self._created_lr_scheduler = True
        return self.lr_scheduler
    passed = self.lr_scheduler
    if passed is not None and not isinstance(passed, HfZeroSchedulerWrapper):
        passed.optimizer = self.optimizer  # a scheduler passed to Trainer(optimizers=...)
    return next_fn(num_training_steps, optimizer)


def _wrap_model(self: Trainer, next_fn: Callable, model: torch.nn.Module, training: bool = True,
                dataloader: Any = None) -> Any:
    engine = engine_of(model) if _config_of(self) is not None else None
    if engine is not None and training and engine.optimizer is None:
        # evaluate() ran first and built an optimizer-less (ZeRO inference) engine: unshard the
        # model so accelerator.prepare(model, optimizer) builds the training engine.
        release_engine(engine)
        if engine in self.accelerator._models:
            self.accelerator._models.remove(engine)
        self.model_wrapped = self.model
        model = self.model
    return next_fn(model, training, dataloader)


def _prepare_input(self: Trainer, next_fn: Callable, data: Any) -> Any:
    """Float inputs take the engine's compute dtype (transformers does this for DeepSpeed)."""
    data = next_fn(data)
    engine = _engine(self)
    if engine is not None and isinstance(data, torch.Tensor) and torch.is_floating_point(data):
        return data.to(engine.config.compute_dtype)
    return data


def _save_model(self: Trainer, next_fn: Callable, output_dir: str | None = None,
                _internal_call: bool = False) -> None:
    """A normal model folder that ``from_pretrained`` loads without hf_zero: full weights
    gathered unit by unit to rank 0 (see [Note: which copy of the weights is saved])."""
    engine = _engine(self)
    if engine is None:
        return next_fn(output_dir, _internal_call)
    output_dir = self.args.output_dir if output_dir is None else output_dir
    state_dict = self.accelerator.get_state_dict(engine)
    self._save(output_dir, state_dict=state_dict)
    if self.args.push_to_hub and not _internal_call:
        self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)


def has_engine_checkpoint(folder: str | None) -> bool:
    """Whether ``folder`` holds an ``engine.save_checkpoint`` checkpoint."""
    if not folder or not os.path.isdir(folder):
        return False
    return os.path.isfile(os.path.join(folder, "latest")) or any(
        name.startswith("global_step") for name in os.listdir(folder)
    )


def _save_optimizer_and_scheduler(self: Trainer, next_fn: Callable, output_dir: str) -> None:
    """The engine's sharded checkpoint (masters, moments, loss scale, its scheduler) inside the
    Trainer's checkpoint folder; the Trainer's own scheduler, if any, as ``scheduler.pt``."""
    engine = _engine(self)
    if engine is None or engine.optimizer is None:
        return next_fn(output_dir)
    engine.save_checkpoint(output_dir)
    if self.args.should_save and self.lr_scheduler is not None and not isinstance(
        self.lr_scheduler, HfZeroSchedulerWrapper
    ):
        torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))


def _load_hf_folder(engine: Any, folder: str) -> None:
    """Load a ``save_pretrained`` folder's weights (single file or shards) into the engine."""
    import json

    from safetensors.torch import load_file

    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    state_dict: dict[str, torch.Tensor] = {}
    for name in files:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no model weights at {path}: expected a save_pretrained folder (safetensors)")
        state_dict.update(load_file(path))
    missing = load_state_dict_into_engine(engine, state_dict)
    if missing:
        logger.warning("hf_zero: %s had no weights for %s; they keep their current values", folder, missing)


def _load_from_checkpoint(self: Trainer, next_fn: Callable, resume_from_checkpoint: str,
                          model: torch.nn.Module | None = None) -> None:
    if _config_of(self) is None:
        return next_fn(resume_from_checkpoint, model)
    if has_engine_checkpoint(resume_from_checkpoint):
        return  # the engine restores weights and optimizer state after prepare()
    target = self.model if model is None else model
    engine = engine_of(target)
    if engine is not None:
        _load_hf_folder(engine, resume_from_checkpoint)
    elif any(p.is_meta for p in target.parameters()):
        # Loaded sharded (meta parameters): the weights go in once the engine exists.
        self._hf_zero_pending_weights = resume_from_checkpoint
    else:
        next_fn(resume_from_checkpoint, model)  # still a plain model: load it as usual


def _load_optimizer_and_scheduler(self: Trainer, next_fn: Callable, checkpoint: str | None) -> None:
    engine = _engine(self)
    if engine is None or checkpoint is None or engine.optimizer is None:
        return next_fn(checkpoint)
    pending = self.__dict__.pop("_hf_zero_pending_weights", None)
    if pending is not None:
        _load_hf_folder(engine, pending)
    if has_engine_checkpoint(checkpoint):
            engine.load_checkpoint(checkpoint, load_optimizer_states=True, load_lr_scheduler_states=True)
    else:
        logger.warning("hf_zero: %s has no engine checkpoint (saved with save_only_model?); the "
                       "optimizer state starts fresh", checkpoint)
    scheduler_file = os.path.join(checkpoint, SCHEDULER_NAME)
    if self.lr_scheduler is not None and not isinstance(self.lr_scheduler, HfZeroSchedulerWrapper) \
            and os.path.isfile(scheduler_file):
        self.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))


def _load_best_model(self: Trainer, next_fn: Callable) -> None:
    engine = _engine(self)
    if engine is None:
        return next_fn()
    best = self.state.best_model_checkpoint
    logger.info("hf_zero: loading the best model from %s (score: %s)", best, self.state.best_metric)
    if has_engine_checkpoint(best):
            engine.load_checkpoint(best, load_optimizer_states=False, load_lr_scheduler_states=False)
    else:
        _load_hf_folder(engine, best)


_TRAINER_OVERRIDES: dict[str, Callable] = {
    "create_accelerator_and_postprocess": _create_accelerator_and_postprocess,
    "_prepare_for_training": _prepare_for_training,
    "create_optimizer": _create_optimizer,
    "create_scheduler": _create_scheduler,
    "_wrap_model": _wrap_model,
    "_prepare_input": _prepare_input,
    "save_model": _save_model,
    "_save_optimizer_and_scheduler": _save_optimizer_and_scheduler,
    "_load_from_checkpoint": _load_from_checkpoint,
    "_load_optimizer_and_scheduler": _load_optimizer_and_scheduler,
    "_load_best_model": _load_best_model,
}


def _mixin_method(name: str, impl: Callable) -> Callable:
    def method(self: Trainer, *args: Any, **kwargs: Any) -> Any:
        next_fn = getattr(super(HfZeroTrainerMixin, self), name)
        if _STATE["enabled"]:  # Trainer itself carries the overrides: apply them once
            return next_fn(*args, **kwargs)
        return impl(self, next_fn, *args, **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = impl.__doc__
    return method


class HfZeroTrainerMixin:
    """The hf_zero overrides of ``Trainer``; put it first in the bases of a Trainer subclass."""


for _name, _impl in _TRAINER_OVERRIDES.items():
    setattr(HfZeroTrainerMixin, _name, _mixin_method(_name, _impl))


class HfZeroTrainer(HfZeroTrainerMixin, Trainer):
    """``Trainer`` on hf_zero's ZeRO engine when ``args.hf_zero_config`` is set (use
    :class:`HfZeroTrainingArguments`, or ``TrainingArguments`` after :func:`enable`); a plain
    ``Trainer`` otherwise."""


class HfZeroSeq2SeqTrainer(HfZeroTrainerMixin, Seq2SeqTrainer):
    """``Seq2SeqTrainer`` on hf_zero (``predict_with_generate`` syncs ranks under stage 3)."""


# ====================================================================== enable()
_STATE: dict[str, Any] = {"enabled": False, "originals": {}}


def _patched(impl: Callable, original: Callable) -> Callable:
    @functools.wraps(original)
    def method(self: Trainer, *args: Any, **kwargs: Any) -> Any:
        return impl(self, functools.partial(original, self), *args, **kwargs)

    return method


def enable() -> None:
    """Apply the overrides in place on ``TrainingArguments`` and ``Trainer`` (idempotent).

    Inert until a config is given: ``TrainingArguments`` reads the ``HF_ZERO_CONFIG`` variable
    (or a ``zero_config`` attribute) when it is built; without one, every override hands over to
    the original method. ``Seq2SeqTrainer`` and other subclasses inherit the overrides.
    """
    if _STATE["enabled"]:
        return
    originals = _STATE["originals"]
    originals[(TrainingArguments, "__post_init__")] = TrainingArguments.__dict__["__post_init__"]
    originals[(TrainingArguments, "place_model_on_device")] = TrainingArguments.__dict__["place_model_on_device"]
    TrainingArguments.__post_init__ = _ta_post_init
    TrainingArguments.place_model_on_device = property(_ta_place_model_on_device)
    for name, impl in _TRAINER_OVERRIDES.items():
        original = Trainer.__dict__[name]
        originals[(Trainer, name)] = original
        setattr(Trainer, name, _patched(impl, original))
    _STATE["enabled"] = True


def disable() -> None:
    """Undo :func:`enable`."""
    for (cls, name), original in _STATE["originals"].items():
        setattr(cls, name, original)
    _STATE["originals"] = {}
    _STATE["enabled"] = False


def is_enabled() -> bool:
    return bool(_STATE["enabled"])
