"""DeepSpeed's warmup learning-rate schedulers, reproduced to the last bit.

A DeepSpeed config that names ``WarmupLR``, ``WarmupDecayLR`` or ``WarmupCosineLR`` must give the
same learning rate at every step under hf_zero, so these classes follow
``deepspeed/runtime/lr_schedules.py`` (deepspeedai/DeepSpeed, 0.19.x line, read at commit
614e3f17a0ca82dfc1ee9aaf887b783cac97a5bb) formula for formula, including the order of the
floating-point operations.

Notation: ``t`` is ``last_batch_iteration`` (the number of ``step()`` calls minus one; ``-1`` before
the first call), ``W = max(2, warmup_num_steps)`` (DeepSpeed silently turns a warmup of 1 into 2 so
that ``log(W)`` is not zero), ``T = total_num_steps``.

Warmup fraction ``g(t)`` for ``0 <= t < W``::

    log:    g(t) = (1 / ln W) * ln(t + 1)        # reaches 1.0 at t = W - 1
    linear: g(t) = t / W                         # reaches 1.0 only at t = W (the post-warmup branch)

``WarmupLR`` (per parameter group ``i``)::

    lr_i(t) = min_lr_i                             for t < 0
    lr_i(t) = min_lr_i + (max_lr_i - min_lr_i) * g(t)   for 0 <= t < W
    lr_i(t) = max_lr_i                             for t >= W

``WarmupDecayLR``: as ``WarmupLR`` during warmup, then a linear decay to ``min_lr``::

    lr_i(t) = min_lr_i + (max_lr_i - min_lr_i) * max(0, (T - t) / max(1, T - W))   for t >= W

``WarmupCosineLR`` scales each group's learning rate at construction, ``base_lr_i``, by a ratio::

    ratio(t) = 0                                                   for t < 0
    ratio(t) = warmup_min_ratio + g(t) * (1 - warmup_min_ratio)    for 0 <= t < W
    p(t)     = min(1, (t - W + 1) / max(1, T - W))                 for t >= W
    ratio(t) = max(0, cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p(t))) / 2)
    lr_i(t)  = base_lr_i * ratio(t)

[Note: first steps of a warmup]
The constructor (with ``last_batch_iteration=-1``) writes ``lr(-1)`` into the optimizer, and the
engine calls ``step()`` *after* each optimizer step, so optimizer step ``k`` (0-based) runs with
``lr(k - 1)``. For both warmup types ``g(0) = 0``, hence the first two optimizer steps of
``WarmupLR``/``WarmupDecayLR`` both use ``warmup_min_lr`` (0 by default: no update at all). For
``WarmupCosineLR`` the first step uses lr 0 whatever ``warmup_min_ratio`` is, and the second
``base_lr * warmup_min_ratio``. Under linear warmup ``WarmupCosineLR`` never reaches
``base_lr`` exactly: ``t = W - 1`` gives ``(W - 1) / W`` of the way and ``t = W`` is already the
first cosine step. All of this is DeepSpeed's behaviour and is kept on purpose.

Deliberate differences from DeepSpeed, each one an error or a no-op where DeepSpeed would run on:

* An unknown ``warmup_type`` raises ``ValueError``; DeepSpeed logs a warning and uses ``'log'``.
* Learning rates, ratios and ``total_num_steps`` are checked for type and sign (an unresolved
  ``"auto"`` is caught here, not as a ``TypeError`` deep inside ``step()``).
* ``load_state_dict`` also writes ``lr(t)`` into the optimizer, which is the value the optimizer
  held when the state was saved, so a resume gives the same learning rates whether the optimizer
  state is loaded before or after the scheduler state.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Sequence
from numbers import Integral, Real
from typing import Any, Union

import torch
from torch.optim import Optimizer

__all__ = [
    "SUPPORTED_SCHEDULERS",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "build_scheduler",
]

WARMUP_LOG = "log"
WARMUP_LINEAR = "linear"
_WARMUP_TYPES = (WARMUP_LOG, WARMUP_LINEAR)

LrValue = Union[float, Sequence[float]]


# ----------------------------------------------------------------------------- validation helpers


def _check_warmup_num_steps(warmup_num_steps: Any) -> int:
    # DeepSpeed >= 0.19.6 rejects 0 and negatives; before that a 0 crashed later in log(W).
    if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, Integral) or warmup_num_steps <= 0:
        raise ValueError(
            f"warmup_num_steps must be a positive integer, got {warmup_num_steps!r}. "
            "Set scheduler.params.warmup_num_steps to the number of optimizer steps to warm up over "
            "(at least 1; DeepSpeed treats 1 as 2)."
        )
    return int(warmup_num_steps)


def _check_warmup_type(warmup_type: Any) -> str:
    if warmup_type not in _WARMUP_TYPES:
        raise ValueError(
            f"warmup_type must be one of {list(_WARMUP_TYPES)}, got {warmup_type!r}. "
            "DeepSpeed would silently fall back to 'log'; set scheduler.params.warmup_type to 'log' "
            "to keep that behaviour or to 'linear' for a straight ramp."
        )
    return str(warmup_type)


def _check_total_num_steps(total_num_steps: Any) -> int:
    if isinstance(total_num_steps, bool) or not isinstance(total_num_steps, Integral) or total_num_steps <= 0:
        raise ValueError(
            f"total_num_steps must be a positive integer, got {total_num_steps!r}. "
            "Set scheduler.params.total_num_steps to the number of optimizer steps of the run "
            "(the Hugging Face integration fills it from max_steps when it is 'auto')."
        )
    return int(total_num_steps)


def _check_last_batch_iteration(last_batch_iteration: Any) -> int:
    value = last_batch_iteration
    if isinstance(value, bool) or not isinstance(value, Integral) or value < -1:
        raise ValueError(
            f"last_batch_iteration must be an integer >= -1, got {last_batch_iteration!r}. "
            "Use -1 to start a new schedule, or the index of the last finished step to resume."
        )
    return int(last_batch_iteration)


def _check_non_negative(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or value < 0:
        raise ValueError(
            f"{name} must be a finite number >= 0, got {value!r}. "
            f"Set scheduler.params.{name} to a number (an 'auto' must be filled in before the "
            "scheduler is built)."
        )
    return float(value)


def _per_group(value: LrValue, num_groups: int, name: str) -> list[float]:
    """Broadcast a scalar to every param group, or check a per-group list (DeepSpeed's _format_param)."""
    if isinstance(value, (list, tuple)):
        if len(value) != num_groups:
            raise ValueError(
                f"{name} has {len(value)} values but the optimizer has {num_groups} param groups. "
                f"Give one value per param group, or a single number for all of them."
            )
        return [_check_non_negative(v, f"{name}[{i}]") for i, v in enumerate(value)]
    return [_check_non_negative(value, name)] * num_groups


def _current_lr(group: dict[str, Any]) -> float:
    lr = group["lr"]
    return float(lr.item()) if isinstance(lr, torch.Tensor) else float(lr)


def _apply_lrs(optimizer: Optimizer, lrs: list[float]) -> list[float]:
    """Write ``lrs`` into the param groups and return them as plain floats."""
    for group, lr in zip(optimizer.param_groups, lrs):
        # A tensor lr (capturable/compiled optimizers) must stay a tensor of the same shape and
        # device, so it is filled in place rather than replaced by a Python float.
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    return [float(lr) for lr in lrs]


def _warn_if_no_decay_window(total_num_steps: int, warmup_num_steps: int, effective_warmup: int) -> None:
    # DeepSpeed only warns here: a short debug run (max_steps below the warmup) must still start.
    if total_num_steps < effective_warmup:
        warmup = (f"warmup_num_steps ({warmup_num_steps})" if warmup_num_steps == effective_warmup else
                  f"the warmup's {effective_warmup} steps (warmup_num_steps {warmup_num_steps}, raised to "
                  f"DeepSpeed's minimum of 2)")
        warnings.warn(
            f"total_num_steps ({total_num_steps}) is less than {warmup}: the run ends before the warmup does, and any step past the "
            "warmup goes straight to the final learning rate. Lower warmup_num_steps or raise "
            "total_num_steps if this is not a deliberate short run.",
            UserWarning,
            stacklevel=3,
        )


# ----------------------------------------------------------------------------- schedulers


class _BatchScheduler:
    """Shared step/state logic: the schedule is a pure function of ``last_batch_iteration``."""

    def __init__(
        self, optimizer: Optimizer, warmup_num_steps: int, warmup_type: str, last_batch_iteration: int
    ) -> None:
        if not hasattr(optimizer, "param_groups"):
            raise TypeError(
                f"{type(self).__name__} needs a torch.optim.Optimizer (an object with param_groups), "
                f"got {type(optimizer).__name__}. Pass the inner torch optimizer."
            )
        self.optimizer = optimizer
        self.requested_warmup_num_steps = _check_warmup_num_steps(warmup_num_steps)
        # DeepSpeed: max(2, warmup_num_steps), so that 1 / ln(W) is finite. Kept for parity.
        self.warmup_num_steps = max(2, self.requested_warmup_num_steps)
        self.warmup_type = _check_warmup_type(warmup_type)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.last_batch_iteration = _check_last_batch_iteration(last_batch_iteration)
        self._last_lr: list[float] | None = None

    def _start(self) -> None:
        # Called last by subclasses, once every field get_lr() reads exists. DeepSpeed writes the
        # lr only for a fresh schedule; a resumed one (t >= 0) waits for step() or load_state_dict().
        if self.last_batch_iteration == -1:
            self._last_lr = _apply_lrs(self.optimizer, self.get_lr())

    def _warmup_fraction(self) -> float:
        """g(t) for 0 <= t < W, in DeepSpeed's operation order."""
        if self.warmup_type == WARMUP_LOG:
            return self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
        return self.last_batch_iteration / self.warmup_num_steps

    def get_lr(self) -> list[float]:
        """Learning rate of every param group at ``last_batch_iteration``."""
        raise NotImplementedError

    def get_last_lr(self) -> list[float]:
        """Learning rates last written into the optimizer by this scheduler."""
        if self._last_lr is None:
            raise RuntimeError(
                f"{type(self).__name__}.get_last_lr() has no value yet: the scheduler was built with "
                f"last_batch_iteration={self.last_batch_iteration} and has not written an lr. "
                "Call step() or load_state_dict() first."
            )
        return list(self._last_lr)

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to ``last_batch_iteration`` (default: the next one) and write its lr."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = _check_last_batch_iteration(last_batch_iteration)
        self._last_lr = _apply_lrs(self.optimizer, self.get_lr())

    def state_dict(self) -> dict[str, int]:
        """DeepSpeed's format: the schedule is stateless apart from the iteration."""
        return {"last_batch_iteration": int(self.last_batch_iteration)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the iteration and write its lr (see the module docstring for why)."""
        if "last_batch_iteration" not in state_dict:
            raise ValueError(
                f"{type(self).__name__} state_dict needs the key 'last_batch_iteration', got keys "
                f"{sorted(state_dict)}. Pass the dict returned by state_dict()."
            )
        self.last_batch_iteration = _check_last_batch_iteration(state_dict["last_batch_iteration"])
        self._last_lr = _apply_lrs(self.optimizer, self.get_lr())


class WarmupLR(_BatchScheduler):
    """Warm each param group's lr from ``warmup_min_lr`` to ``warmup_max_lr``, then hold it.

    ``warmup_min_lr``/``warmup_max_lr`` are a number for all groups or one per group;
    ``warmup_max_lr=None`` takes each group's current lr (DeepSpeed after PR #8171; earlier
    releases used group 0's lr for every group).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_min_lr: LrValue = 0.0,
        warmup_max_lr: LrValue | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)
        num_groups = len(self.optimizer.param_groups)
        if warmup_max_lr is None:
            warmup_max_lr = [_current_lr(group) for group in self.optimizer.param_groups]
        self.min_lrs = _per_group(warmup_min_lr, num_groups, "warmup_min_lr")
        self.max_lrs = _per_group(warmup_max_lr, num_groups, "warmup_max_lr")
        self.delta_lrs = [big - small for big, small in zip(self.max_lrs, self.min_lrs)]
        self._start()

    def _gamma(self) -> float:
        """Fraction of the way from min_lr to max_lr at t >= 0."""
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_fraction()
        return 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [min_lr + (delta_lr * gamma) for min_lr, delta_lr in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """``WarmupLR`` followed by a linear decay back to ``warmup_min_lr`` at ``total_num_steps``.

    Unlike ``WarmupLR``, ``warmup_max_lr`` defaults to 1e-3 here (DeepSpeed's default), not to
    the optimizer's lr.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_lr: LrValue = 0.0,
        warmup_max_lr: LrValue = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG,
        last_batch_iteration: int = -1,
    ) -> None:
        # Set before super().__init__, which calls get_lr() through _start().
        self.total_num_steps = _check_total_num_steps(total_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)
        _warn_if_no_decay_window(self.total_num_steps, self.requested_warmup_num_steps, self.warmup_num_steps)

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_fraction()
        # max(1.0, ...) keeps T <= W from dividing by zero; every post-warmup step is then min_lr.
        return max(
            0.0,
            float(self.total_num_steps - self.last_batch_iteration)
            / float(max(1.0, self.total_num_steps - self.warmup_num_steps)),
        )


class WarmupCosineLR(_BatchScheduler):
    """Warm up to each group's own lr, then follow a cosine down to ``cos_min_ratio`` of it.

    The base lrs are the optimizer's lrs at construction, so build this scheduler before loading
    optimizer state that already holds scheduled lrs (DeepSpeed has the same requirement).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = WARMUP_LOG,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)
        self.total_num_steps = _check_total_num_steps(total_num_steps)
        self.warmup_min_ratio = _check_non_negative(warmup_min_ratio, "warmup_min_ratio")
        self.cos_min_ratio = _check_non_negative(cos_min_ratio, "cos_min_ratio")
        _warn_if_no_decay_window(self.total_num_steps, self.requested_warmup_num_steps, self.warmup_num_steps)
        self.org_lrs = [_current_lr(group) for group in self.optimizer.param_groups]
        self._start()

    def get_lr_ratio(self) -> float:
        """Multiplier applied to every group's base lr at ``last_batch_iteration``."""
        if self.last_batch_iteration < 0:
            return 0.0
        if self.last_batch_iteration < self.warmup_num_steps:
            return self.warmup_min_ratio + self._warmup_fraction() * (1.0 - self.warmup_min_ratio)
        real_last_step = self.last_batch_iteration - self.warmup_num_steps + 1
        real_total_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        # Clamped (as in current DeepSpeed) so that steps past total_num_steps stay at
        # cos_min_ratio instead of climbing back up the cosine; max(1, ...) is PR #8142's guard
        # against total_num_steps == warmup_num_steps.
        cosine_progress = min(1.0, real_last_step / real_total_steps)
        ratio = (1 + math.cos(math.pi * cosine_progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * ratio)

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.org_lrs]
        lr_ratio = self.get_lr_ratio()
        return [org_lr * lr_ratio for org_lr in self.org_lrs]


# ----------------------------------------------------------------------------- config entry point

SUPPORTED_SCHEDULERS: dict[str, type[_BatchScheduler]] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
}

# DeepSpeed schedulers hf_zero knows by name but does not implement.
_UNIMPLEMENTED_DEEPSPEED_SCHEDULERS = ("OneCycle", "LRRangeTest")


def _check_params(cls: type[_BatchScheduler], params: dict[str, Any]) -> None:
    signature = inspect.signature(cls.__init__)
    accepted = [name for name in signature.parameters if name not in ("self", "optimizer")]
    required = [
        name for name in accepted if signature.parameters[name].default is inspect.Parameter.empty
    ]
    unknown = sorted(set(params) - set(accepted))
    missing = [name for name in required if name not in params]
    problems = []
    if unknown:
        problems.append(f"unknown key(s) {unknown}")
    if missing:
        problems.append(f"missing required key(s) {missing}")
    if problems:
        raise ValueError(
            f"scheduler.params for {cls.__name__}: {' and '.join(problems)}. "
            f"Accepted keys: {accepted}; required: {required}."
        )


def build_scheduler(type_name: str, optimizer: Optimizer, params: dict[str, Any]) -> _BatchScheduler:
    """Build the scheduler a DeepSpeed-style ``{"scheduler": {"type": ..., "params": ...}}`` names."""
    supported = sorted(SUPPORTED_SCHEDULERS)
    if type_name in _UNIMPLEMENTED_DEEPSPEED_SCHEDULERS:
        raise NotImplementedError(
            f"scheduler.type {type_name!r} is a DeepSpeed scheduler that hf_zero does not implement. "
            f"Use one of {supported}, or pass your own torch scheduler to the Trainer instead."
        )
    if type_name not in SUPPORTED_SCHEDULERS:
        raise ValueError(f"scheduler.type {type_name!r} is not supported. Use one of {supported}.")
    cls = SUPPORTED_SCHEDULERS[type_name]
    params = dict(params or {})
    _check_params(cls, params)
    return cls(optimizer, **params)
