"""HfZeroConfig: a DeepSpeed-schema config, checked to the last key, with typed access."""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import logging
import math
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .auto import RESOLVE_ARGUMENTS, auto_paths, resolve_dict
from .batch import GAS, MICRO, TOTAL, Batch, derive_batch
from .keys import DTYPE_SPELLINGS, Status
from .live import set_live_zero3_config
from .loading import load_config
from .schema import (
    Bf16Config,
    Fp16Config,
    OptimizerConfig,
    SchedulerConfig,
    ZeroConfig,
    auto_error,
    build_bf16,
    build_fp16,
    build_optimizer,
    build_scheduler,
    build_zero,
)
from .validate import AUTO, get_path, present_specs, validate

if TYPE_CHECKING:
    import torch

__all__ = ["HfZeroConfig"]

logger = logging.getLogger("hf_zero")



# torch.amp.GradScaler's defaults in DynamicLossScaler's terms ([Note: torch_autocast]): start at
# 2**16, halve on every overflow (no hysteresis), double after 2000 clean steps (a window of
# 1999: DeepSpeed's window counts one step fewer, engine/optim/loss_scaler.py).
AUTOCAST_FP16_SCALING: dict[str, Any] = {"mode": "dynamic", "initial_scale": 2.0**16, "window": 1999, "hysteresis": 1,
                                         "consecutive_hysteresis": False, "min_scale": 1.0}


def _dtype(name: str) -> torch.dtype:
    """"fp16" | "bf16" | "fp32" as a torch dtype. torch is imported here, not at the top: checking
    a config needs none ([Note: the command imports torch late] in hf_zero.cli)."""
    import torch

    return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[name]

_LOGGED_NO_EFFECT: set[str] = set()  # "logged once" is per process


def _load_checked(config: str | os.PathLike[str] | Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """The config as a plain dict and its source name; one HfZeroConfigError listing every problem."""
    raw, source, problems = load_config(config)
    if raw or not problems:  # an unreadable file has nothing to validate
        problems += validate(raw, allow_auto=True)
    problems.raise_if_any(source)
    return raw, source


class HfZeroConfig:
    """A ZeRO config in DeepSpeed's JSON schema.

    ``HfZeroConfig(config)`` takes a path to a JSON file (``Infinity`` allowed, as transformers
    writes it), inline JSON, a Mapping (deep-copied; the caller's dict is never modified) or
    another HfZeroConfig (copied). It raises one HfZeroConfigError listing every problem; values
    set to "auto" are accepted and stay unresolved until ``resolve(...)`` returns a new, filled
    config. Typed sections (``zero``, ``fp16``, ``optimizer``, ...) read DeepSpeed's defaults for
    absent keys; reading a value still "auto" raises RuntimeError.
    """

    def __init__(self, config: str | os.PathLike[str] | Mapping[str, Any] | HfZeroConfig) -> None:
        if isinstance(config, HfZeroConfig):
            self._init_state(copy.deepcopy(config._dict), config._source, config._world_size, config._batch_note)
            return
        raw, source = _load_checked(config)
        self._init_state(raw, source, None, None)
        self._log_no_effect_once()
        if raw.get("zero_optimization", {}).get("stage") == 3:
            # Copies and resolved configs do not replace the user's own (see config/live.py).
            set_live_zero3_config(self)

    @classmethod
    def checked(cls, config: str | os.PathLike[str] | Mapping[str, Any]) -> HfZeroConfig:
        """The config, checked as ``HfZeroConfig(config)`` checks it, that never becomes the live
        stage-3 config (``hf-zero check-config``: checking a file must not change how models load,
        nor import transformers to hook ``from_pretrained``)."""
        raw, source = _load_checked(config)
        checked = cls.__new__(cls)
        checked._init_state(raw, source, None, None)
        return checked

    def _init_state(self, raw: dict[str, Any], source: str, world_size: int | None, batch_note: str | None) -> None:
        self._dict = raw
        self._source = source
        self._world_size = world_size
        self._batch_note = batch_note

    # ---- "auto" ------------------------------------------------------------------------------

    def resolve(
        self,
        *,
        world_size: int | None = None,
        hidden_size: int | None = None,
        check_mismatches: bool = False,
        **values: Any,
    ) -> HfZeroConfig:
        """Return a new config with every "auto" filled; this one is unchanged.

        Keyword values (None means unknown) fill only keys set to "auto", as transformers'
        HfTrainerDeepSpeedConfig does: train_micro_batch_size_per_gpu, gradient_accumulation_steps,
        train_batch_size, gradient_clipping, lr, betas, eps, weight_decay, warmup_min_lr,
        warmup_max_lr, warmup_num_steps, total_num_steps, fp16, bf16,
        stage3_gather_16bit_weights_on_model_save. ``hidden_size`` fills reduce_bucket_size
        (h**2), stage3_prefetch_bucket_size (int(0.9*h**2)) and stage3_param_persistence_threshold
        (10*h). With ``world_size`` the batch triple is completed DeepSpeed's way and checked.
        ``check_mismatches`` reports every given value that contradicts a non-"auto" config value.
        Raises one HfZeroConfigError with every problem, including any "auto" left unfilled.
        """
        unknown = sorted(set(values) - set(RESOLVE_ARGUMENTS))
        if unknown:
            expected = list(RESOLVE_ARGUMENTS)
            raise TypeError(f"resolve() got unexpected keyword argument(s) {unknown}; expected some of {expected}")
        world_size = self._world_size if world_size is None else world_size
        resolved, problems, note = resolve_dict(
            self._dict, world_size=world_size, hidden_size=hidden_size, check_mismatches=check_mismatches, values=values
        )
        problems.raise_if_any(self._source)
        new = object.__new__(HfZeroConfig)
        new._init_state(resolved, self._source, world_size, note or self._batch_note)
        return new

    def auto_keys(self) -> list[str]:
        """Dotted paths of the values still "auto"."""
        return auto_paths(self._dict)

    @property
    def is_resolved(self) -> bool:
        return not self.auto_keys()

    @property
    def world_size(self) -> int | None:
        """The world size given to resolve(...), or None."""
        return self._world_size

    # ---- typed sections ----------------------------------------------------------------------

    @functools.cached_property
    def zero(self) -> ZeroConfig:
        return build_zero(self._dict.get("zero_optimization", {}))

    @functools.cached_property
    def fp16(self) -> Fp16Config:
        return build_fp16(self._dict.get("fp16", {}))

    @functools.cached_property
    def bf16(self) -> Bf16Config:
        return build_bf16(self._dict.get("bf16", {}))

    @functools.cached_property
    def optimizer(self) -> OptimizerConfig | None:
        """The config's optimizer, or None when absent (the Trainer's / user's optimizer is used)."""
        return build_optimizer(self._dict.get("optimizer"))

    @functools.cached_property
    def scheduler(self) -> SchedulerConfig | None:
        """The config's LR scheduler, or None when absent."""
        return build_scheduler(self._dict.get("scheduler"))

    @property
    def stage(self) -> int:
        return self.zero.stage

    def is_zero3(self) -> bool:
        return self.stage == 3

    # ---- top-level scalars -------------------------------------------------------------------

    def _scalar(self, path: str) -> Any:
        value = get_path(self._dict, path)
        if isinstance(value, str) and value == AUTO:
            raise auto_error(path)
        return value

    @property
    def gradient_clipping(self) -> float:
        """Max global gradient norm; 0 means off. DeepSpeed 0.19's default is 1.0."""
        return float(self._scalar("gradient_clipping"))

    @functools.cached_property
    def _batch(self) -> Batch:
        values = [self._dict.get(key) for key in (MICRO, GAS, TOTAL)]
        pending = any(isinstance(v, str) for v in values)
        micro, gas, total = (None if isinstance(v, str) else v for v in values)
        return derive_batch(micro, gas, total, self._world_size, pending=pending)

    def _batch_member(self, key: str) -> int | None:
        self._scalar(key)  # raises while "auto"
        batch = self._batch
        return {MICRO: batch.micro, GAS: batch.gas, TOTAL: batch.total}[key]

    @property
    def train_micro_batch_size_per_gpu(self) -> int | None:
        """Samples per rank per micro-step; None until derivable (needs the world size)."""
        return self._batch_member(MICRO)

    @property
    def gradient_accumulation_steps(self) -> int | None:
        """Micro-steps per optimizer step; None until derivable (needs the world size)."""
        return self._batch_member(GAS)

    @property
    def train_batch_size(self) -> int | None:
        """Global samples per optimizer step; None until the world size is known."""
        return self._batch_member(TOTAL)

    @property
    def steps_per_print(self) -> int | None:
        """Log every N optimizer steps; None means never (0, null or Infinity in the JSON)."""
        value = self._scalar("steps_per_print")
        return None if value is None or value == math.inf or value == 0 else int(value)

    @property
    def wall_clock_breakdown(self) -> bool:
        return bool(self._scalar("wall_clock_breakdown"))

    @property
    def zero_allow_untested_optimizer(self) -> bool:
        return bool(self._scalar("zero_allow_untested_optimizer"))

    # ---- precision ---------------------------------------------------------------------------

    @property
    def compute_dtype(self) -> torch.dtype:
        """Dtype of forward/backward: fp16 / bf16 when enabled, else fp32."""
        return _dtype("fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32")

    # [Note: torch_autocast]
    # DeepSpeed's torch_autocast section is DDP's --bf16: the weights, gradients, masters and Adam
    # state stay fp32 (16 bytes per parameter, sharded), and the engine's forward runs under
    # torch.autocast, so each op on autocast's lists computes in bf16 from a bf16 copy of its fp32
    # inputs, as under DDP. With it on, a 16-bit section cannot be enabled (validate.py),
    # and the precision the Trainer or Accelerate asks for (--bf16) fills "auto" in fp16/bf16 with
    # false and means autocast instead, in the dtype asked for where torch_autocast.dtype is null
    # (auto.py). float16 autocast scales the loss as torch.amp.GradScaler does by default, which
    # is what DDP's --fp16 and DeepSpeed's torch_autocast use (AUTOCAST_FP16_SCALING): hf_zero's
    # dynamic scaler with those settings, the fp16 section's keys not read. The parameters of
    # lower_precision_safe_modules are gathered and reduced in the autocast dtype: [Note:
    # lower-precision-safe modules] in hf_zero.engine.lower_precision.
    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype the forward autocasts to ([Note: torch_autocast]), or None when it does not."""
        if get_path(self._dict, "torch_autocast.enabled", False) is not True:
            return None
        value = get_path(self._dict, "torch_autocast.dtype", None)
        return _dtype(DTYPE_SPELLINGS[str(value).lower()] if value is not None else "bf16")

    @property
    def lower_precision_safe_modules(self) -> list[str] | None:
        """The class names whose parameters are gathered and reduced in the autocast dtype
        ([Note: lower-precision-safe modules] in hf_zero.engine.lower_precision); None: DeepSpeed's
        default (Linear, Conv1d/2d/3d)."""
        value = get_path(self._dict, "torch_autocast.lower_precision_safe_modules", None)
        return None if value is None else [str(v) for v in value]

    @property
    def master_dtype(self) -> torch.dtype:
        """The master weights and Adam moments are always fp32."""
        return _dtype("fp32")

    @property
    def communication_data_type(self) -> str:
        """"fp16" | "bf16" | "fp32": the config's value, else DeepSpeed's rule (the compute dtype)."""
        value = self._scalar("communication_data_type")
        if value is not None:
            return str(value).lower()
        return "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"

    @property
    def reduce_dtype(self) -> torch.dtype:
        """Dtype gradients are reduced in (= communication_data_type)."""
        return _dtype(self.communication_data_type)

    @property
    def grad_accum_dtype(self) -> torch.dtype:
        """Gradients accumulate over micro-steps in fp32 (stages 2-3 in the fp32 gradient shard,
        stages 0-1 in a fp32 buffer, as DeepSpeed's bf16 optimizer); stages 0-1 may keep the
        compute dtype with ``data_types.grad_accum_dtype``, saving that buffer."""
        value = self._scalar("data_types.grad_accum_dtype") if self.stage < 2 else None
        return _dtype(DTYPE_SPELLINGS[str(value)] if value is not None else "fp32")

    def precision_policy(self) -> dict[str, Any]:
        """The dtypes of every copy of the model state, and the loss-scaling rule."""
        return {
            "compute_dtype": self.compute_dtype,
            "master_dtype": self.master_dtype,
            "optimizer_state_dtype": _dtype("fp32"),
            "reduce_dtype": self.reduce_dtype,
            "grad_accum_dtype": self.grad_accum_dtype,
            "loss_scaling": self._loss_scaling(),
        }

    def _loss_scaling(self) -> dict[str, Any] | None:
        fp16 = self.fp16
        value = get_path(self._dict, "torch_autocast.dtype", None)
        if (get_path(self._dict, "torch_autocast.enabled", False) is True and isinstance(value, str)
                and DTYPE_SPELLINGS.get(value.lower()) == "fp16"):
            return dict(AUTOCAST_FP16_SCALING)
        if not fp16.enabled:
            return None
        if not fp16.dynamic_loss_scale:
            return {"mode": "static", "scale": float(fp16.loss_scale)}
        return {
            "mode": "dynamic",
            "initial_scale": fp16.initial_dynamic_scale,
            "window": fp16.loss_scale_window,
            "hysteresis": fp16.hysteresis,
            "consecutive_hysteresis": fp16.consecutive_hysteresis,
            "min_scale": float(fp16.min_loss_scale),
        }

    # ---- export and logging ------------------------------------------------------------------

    def get_value(self, path: str, default: Any = None) -> Any:
        """The raw value at a dotted path ("auto" included), or `default` when absent."""
        return copy.deepcopy(get_path(self._dict, path, default))

    def to_dict(self) -> dict[str, Any]:
        """The config in DeepSpeed's schema (JSON-serialisable: Infinity becomes null)."""
        return _json_safe(copy.deepcopy(self._dict))

    def no_effect_keys(self) -> dict[str, str]:
        """{path: reason} for the keys present that are accepted but cannot change results."""
        present = present_specs(self._dict)
        return {path: spec.reason for path, spec, _ in present if spec.status is Status.ACCEPTED_NO_EFFECT}

    def summary(self) -> str:
        """The resolved config, the precision policy and the accepted no-effect keys, as text."""
        lines = [f"hf_zero config {self._source} (world_size={self._world_size}):"]
        lines += [f"  ZeRO stage {self._safe(lambda: self.stage)}; {self._batch_line()}"]
        if self._batch_note:
            lines.append(f"  note: {self._batch_note}")
        lines.append("precision policy:")
        lines += [f"  {line}" for line in self._policy_lines()]
        no_effect = self.no_effect_keys()
        if no_effect:
            lines.append("accepted, no effect in hf_zero:")
            lines += [f"  {path}: {reason}" for path, reason in no_effect.items()]
        if self.auto_keys():
            lines.append(f"still \"auto\" (call resolve(...)): {', '.join(self.auto_keys())}")
        lines.append("config:")
        lines.append(json.dumps(self.to_dict(), indent=2, sort_keys=False))
        return "\n".join(lines)

    def log_summary(self, rank: int, run: str = "") -> None:
        """On rank 0 only: one INFO line (stage, ``run``, which says where and how it runs, batch,
        precision policy and a digest of the resolved config, so that two runs' configs compare
        at a glance), and summary() in full, some 35 lines, at DEBUG (``HF_ZERO_VERBOSITY=debug``)."""
        if rank != 0:
            return
        digest = hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:12]
        policy = ", ".join(" ".join(line.split()) for line in self._policy_lines()
                           if line.startswith(("compute", "master", "reduce", "loss scaling", "unresolved")))
        logger.info("hf_zero: ZeRO stage %s%s; %s; precision: %s; config %s, resolved sha256 %s (in full at DEBUG)",
                    self._safe(lambda: self.stage), f", {run}" if run else "", self._batch_line(), policy,
                    self._source, digest)
        logger.debug("%s", self.summary())

    def _batch_line(self) -> str:
        parts = [f"{key}={self._safe(lambda k=key: self._batch_member(k))}" for key in (TOTAL, MICRO, GAS)]
        size = self.to_dict().get("sequence_parallel_size", 1)
        if isinstance(size, int) and size > 1:  # [Note: sequence-parallel layout]
            parts.append(f"sequence_parallel_size={size}")
        return "batch: " + ", ".join(parts)

    def _policy_lines(self) -> list[str]:
        try:
            policy = self.precision_policy()
        except RuntimeError as err:
            return [f"unresolved: {err}"]
        scaling = policy["loss_scaling"]
        if scaling is None:
            scaling_text = "none"
        elif scaling["mode"] == "static":
            scaling_text = f"static, scale {scaling['scale']}"
        else:
            scaling_text = (
                f"dynamic, start {scaling['initial_scale']:g}, x2 after {scaling['window']} clean steps, "
                f"/2 after {scaling['hysteresis']} overflows, min {scaling['min_scale']:g}"
            )
        autocast = self._safe(lambda: self.autocast_dtype)
        compute = f"{policy['compute_dtype']}, forward under torch.autocast({autocast})" if autocast else \
            policy["compute_dtype"]
        reduce = policy["reduce_dtype"]
        if autocast:  # [Note: lower-precision-safe modules] in hf_zero.engine.lower_precision
            safe = self._safe(lambda: self.lower_precision_safe_modules)
            listed = "Linear, Conv1d/2d/3d" if safe is None else ", ".join(s.rsplit(".", 1)[-1] for s in safe) or None
            if listed:
                reduce = f"{reduce}; {autocast} gathered and reduced for the parameters of {listed}"
        return [
            f"compute dtype:           {compute}",
            f"master weights dtype:    {policy['master_dtype']}",
            f"optimizer state dtype:   {policy['optimizer_state_dtype']}",
            f"reduce dtype:            {reduce}",
            f"grad accumulation dtype: {policy['grad_accum_dtype']}",
            f"loss scaling:            {scaling_text}",
        ]

    @staticmethod
    def _safe(read: Any) -> Any:
        try:
            return read()
        except RuntimeError:
            return '"auto"'

    def _log_no_effect_once(self) -> None:
        # Per process, and only where torchrun's RANK is 0 (or unset), so N ranks do not repeat it.
        # A key at DeepSpeed's default asks for nothing (every recipe writes contiguous_gradients:
        # true): only a changed value is worth a line; summary() and check-config list them all.
        if os.environ.get("RANK", "0") != "0":
            return
        changed = {path for path, spec, value in present_specs(self._dict) if value != spec.default}
        for path, reason in self.no_effect_keys().items():
            if path in changed and path not in _LOGGED_NO_EFFECT:
                _LOGGED_NO_EFFECT.add(path)
                logger.info("hf_zero config: %s is accepted but has no effect: %s", path, reason)

    def __repr__(self) -> str:
        state = "resolved" if self.is_resolved else f"auto: {len(self.auto_keys())} keys"
        stage = self._dict.get("zero_optimization", {}).get("stage", 0)
        return f"HfZeroConfig(source={self._source!r}, stage={stage!r}, {state})"


def _json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, float) and math.isinf(value):
        return None  # only steps_per_print may be Infinity, and null means the same there
    return value
