"""fp16 loss scaling with DeepSpeed's knobs and DeepSpeed's exact update rule.

The ``fp16`` config section maps onto these classes as DeepSpeed maps it
(``deepspeed/runtime/fp16/loss_scaler.py``, deepspeedai/DeepSpeed, read at commit
68ee9f83ae9a278ac09e02b3697094673c9896cd):

==========================  ==============================================
``fp16.loss_scale`` > 0     ``LossScaler(loss_scale)``: a fixed scale
``fp16.loss_scale`` == 0    ``DynamicLossScaler`` with the keys below
``initial_scale_power``     ``init_scale = 2 ** initial_scale_power``
``loss_scale_window``       ``scale_window``
``hysteresis``              ``delayed_shift``
``consecutive_hysteresis``  ``consecutive_hysteresis``
``min_loss_scale``          ``min_scale``
==========================  ==============================================

``update_scale(overflow)`` is called once per optimizer step, after the overflow check:

* overflow, with ``delayed_shift == 1`` or ``cur_hysteresis == 1``: if the scale already equals
  ``min_scale`` (and ``raise_error_at_min_scale``) raise, else
  ``scale = max(scale / scale_factor, min_scale)``;
* overflow otherwise: ``cur_hysteresis -= 1`` and the scale stays;
* either overflow case records ``last_overflow_iter = cur_iter`` and counts a skipped step;
* no overflow: with ``consecutive_hysteresis`` refill ``cur_hysteresis``; then, with
  ``stable = cur_iter - last_overflow_iter - 1``, if ``stable > 0 and stable % scale_window == 0``
  multiply the scale by ``scale_factor`` (and refill ``cur_hysteresis`` if not refilled above);
* ``cur_iter += 1``.

[Note: DeepSpeed quirks kept on purpose]
* ``stable`` counts the clean steps *before* the current one, so the scale grows on the
  ``scale_window + 1``-th consecutive clean step, from the start of training as after an overflow.
* Without ``consecutive_hysteresis`` a clean step does not refill the hysteresis; only a scale
  increase does. Once spent, every later overflow halves the scale until the next increase.
* The at-minimum error needs ``scale == min_scale`` exactly and is reached only on the halving
  branch, so with ``hysteresis=2`` the first overflow at the minimum spends hysteresis and the
  second one raises.
"""

from __future__ import annotations

import logging
import math
from numbers import Integral, Real
from typing import Any

import torch

__all__ = ["DynamicLossScaler", "LossScaler", "build_loss_scaler"]

logger = logging.getLogger(__name__)

# DeepSpeed's wording, kept verbatim so that users searching for it find this error.
DEEPSPEED_MIN_SCALE_MESSAGE = "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run."


def _positive_finite(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}.")
    return float(value)


def _int_at_least(value: Any, lowest: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < lowest:
        raise ValueError(f"{name} must be an integer >= {lowest}, got {value!r}.")
    return int(value)


def _positive_int(value: Any, name: str) -> int:
    return _int_at_least(value, 1, name)


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}.")
    return value


def _non_negative_int(value: Any, name: str) -> int:
    return _int_at_least(value, 0, name)


# [Note: the loss scale on the device]
# The scale a backward multiplies the loss by, and the one the step divides out, are also kept as
# device tensors and moved on the device by the same rule (update_on_device, torch.where over
# 0-d tensors, as torch._amp_update_scale_ does for torch's GradScaler), so that a step whose
# overflow check stays on the device ([Note: a step the host does not wait for] in
# step_pipeline.py) never makes the host read it. The host values above stay the record
# (state_dict, what the engine reports): update_scale replays the same step on them once the
# host has read whether it overflowed, and the device tensors are rebuilt from them after a
# load (torch.full: a fill on the device, no copy from host memory). The scale is float64 there,
# as the host's Python float is; the kernels take it as fp32, as they did the float.


class LossScaler:
    """A fixed loss scale (``fp16.loss_scale > 0``). Overflowing steps are still skipped and counted."""

    dynamic: bool = False

    def __init__(self, scale: float = 1.0) -> None:
        self.cur_scale = _positive_finite(scale, "loss scale (fp16.loss_scale)")
        self.skipped_steps = 0
        self._device: dict[str, torch.Tensor] | None = None  # [Note: the loss scale on the device]

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Multiply the loss by the scale before backward, so small fp16 gradients do not flush to 0.
        The scale is fp32 here (2**16 is beyond fp16's range, so a scale of the loss's dtype would
        be inf for an fp16 loss); an fp32 loss gives the product a Python float gave."""
        return loss * self.device_scale(loss.device).float()

    # ------------------------------------------------------------------ on the device
    def device_scale(self, device: torch.device) -> torch.Tensor:
        """The current scale as a 0-d float64 tensor on ``device``."""
        return self._device_state(device)["scale"]

    def update_on_device(self, overflow: torch.Tensor, device: torch.device) -> None:
        """The device side of :meth:`update_scale` for one step whose overflow flag (a 0-d bool)
        is on the device: a fixed scale does not move."""

    def _device_state(self, device: torch.device) -> dict[str, torch.Tensor]:
        state = self._device
        if state is None or state["scale"].device != torch.device(device):
            state = self._device = {name: torch.full((), float(value), dtype=torch.float64, device=device)
                                    for name, value in self._host_values().items()}
        return state

    def _host_values(self) -> dict[str, float]:
        return {"scale": self.cur_scale}

    def rebuild_device_state(self) -> None:
        """The host values changed outside :meth:`update_on_device` (a load, a host-side
        update): the device tensors are made again from them at their next use."""
        self._device = None

    def update_scale(self, overflow: bool) -> None:
        """Record the outcome of one optimizer step; the static scale itself never moves."""
        if overflow:
            self.skipped_steps += 1

    def state_dict(self) -> dict[str, Any]:
        return {"dynamic": False, "cur_scale": self.cur_scale, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # The scale comes from the config; only the counter is run state. A dynamic state is
        # accepted too, so a run stuck under dynamic scaling can resume with a fixed scale.
        self.skipped_steps = _non_negative_int(state_dict.get("skipped_steps", 0), "state_dict['skipped_steps']")
        self.rebuild_device_state()


class DynamicLossScaler(LossScaler):
    """DeepSpeed's dynamic loss scaler. Defaults are the DeepSpeed ``fp16`` config defaults.

    Args:
        init_scale: first scale tried (``2 ** fp16.initial_scale_power``).
        scale_factor: divisor on overflow and multiplier on growth. DeepSpeed fixes it at 2.0.
        scale_window: clean steps (plus one, see the module note) between two increases.
        min_scale: floor of the scale (``fp16.min_loss_scale``).
        delayed_shift: overflows tolerated before the scale is cut (``fp16.hysteresis``).
        consecutive_hysteresis: refill the hysteresis on every clean step, not only on growth.
        raise_error_at_min_scale: raise instead of staying at ``min_scale`` when an overflow
            happens there.
    """

    dynamic: bool = True

    def __init__(
        self,
        init_scale: float = 2.0**16,
        scale_factor: float = 2.0,
        scale_window: int = 1000,
        min_scale: float = 1.0,
        delayed_shift: int = 2,
        consecutive_hysteresis: bool = False,
        raise_error_at_min_scale: bool = True,
    ) -> None:
        super().__init__(_positive_finite(init_scale, "init_scale (2 ** fp16.initial_scale_power)"))
        self.scale_factor = _positive_finite(scale_factor, "scale_factor")
        if self.scale_factor <= 1.0:
            raise ValueError(f"scale_factor must be > 1 so that an overflow lowers the scale, got {scale_factor!r}.")
        self.scale_window = _positive_int(scale_window, "scale_window (fp16.loss_scale_window)")
        self.min_scale = _positive_finite(min_scale, "min_scale (fp16.min_loss_scale)")
        if self.cur_scale < self.min_scale:
            # DeepSpeed would raise the scale to min_scale on the first overflow; almost surely a typo.
            raise ValueError(
                f"init_scale ({self.cur_scale:g}) is below min_scale ({self.min_scale:g}). Raise "
                "fp16.initial_scale_power or lower fp16.min_loss_scale."
            )
        self.delayed_shift = _positive_int(delayed_shift, "delayed_shift (fp16.hysteresis)")
        self.consecutive_hysteresis = _bool(
            consecutive_hysteresis, "consecutive_hysteresis (fp16.consecutive_hysteresis)"
        )
        self.raise_error_at_min_scale = _bool(raise_error_at_min_scale, "raise_error_at_min_scale")
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.cur_hysteresis = self.delayed_shift

    def update_scale(self, overflow: bool) -> None:
        """Apply DeepSpeed's rule for one optimizer step (see the module docstring)."""
        if overflow:
            self._on_overflow()
        else:
            self._on_clean_step()
        self.cur_iter += 1

    def update_on_device(self, overflow: torch.Tensor, device: torch.device) -> None:
        """:meth:`update_scale`'s rule on the device tensors, for the step ``cur_iter`` (the host's
        count: it replays every earlier step before this one is taken)."""
        state = self._device_state(device)
        scale, hysteresis, last_overflow = state["scale"], state["hysteresis"], state["last_overflow_iter"]
        now = float(self.cur_iter)
        # An overflow: halve (never below the minimum) once the hysteresis is spent, else spend one.
        halve = overflow if self.delayed_shift == 1 else overflow & (hysteresis == 1)
        lowered = torch.clamp(scale / self.scale_factor, min=self.min_scale)
        # A clean step: grow on the scale_window + 1-th clean step in a row.
        stable = now - last_overflow - 1
        grow = ~overflow & (stable > 0) & (torch.remainder(stable, self.scale_window) == 0)
        refill = ~overflow if self.consecutive_hysteresis else grow
        new_scale = torch.where(halve, lowered, torch.where(grow, scale * self.scale_factor, scale))
        new_hysteresis = torch.where(refill, float(self.delayed_shift),
                                     torch.where(overflow & ~halve, hysteresis - 1, hysteresis))
        state["scale"] = new_scale
        state["hysteresis"] = new_hysteresis
        state["last_overflow_iter"] = torch.where(overflow, now, last_overflow)

    def _host_values(self) -> dict[str, float]:
        return {"scale": self.cur_scale, "hysteresis": self.cur_hysteresis,
                "last_overflow_iter": self.last_overflow_iter}

    def _on_overflow(self) -> None:
        if self.delayed_shift == 1 or self.cur_hysteresis == 1:
            if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                # Raised before any state changes, so the scaler can still be saved for a post-mortem.
                raise RuntimeError(self._stuck_at_min_message())
            next_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            logger.info(
                "fp16 gradient overflow: skipping step %d, loss scale %g -> %g",
                self.cur_iter, self.cur_scale, next_scale,
            )
            self.cur_scale = next_scale
        else:
            logger.info(
                "fp16 gradient overflow: skipping step %d, loss scale stays %g (hysteresis %d -> %d)",
                self.cur_iter, self.cur_scale, self.cur_hysteresis, self.cur_hysteresis - 1,
            )
            self.cur_hysteresis -= 1
        self.last_overflow_iter = self.cur_iter
        self.skipped_steps += 1

    def _on_clean_step(self) -> None:
        if self.consecutive_hysteresis:
            self.cur_hysteresis = self.delayed_shift
        stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
        if stable_interval > 0 and stable_interval % self.scale_window == 0:
            if not self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            self.cur_scale *= self.scale_factor

    def _stuck_at_min_message(self) -> str:
        step = self.cur_iter + 1
        skipped = self.skipped_steps + 1
        return (
            f"fp16 loss scale is stuck at the minimum: the gradients overflowed at optimizer step {step} "
            f"while the loss scale was already at min_loss_scale={self.min_scale:g} "
            f"({skipped} of {step} steps skipped for overflow so far). "
            f"DeepSpeed: '{DEEPSPEED_MIN_SCALE_MESSAGE}' "
            "Raising fp16.min_loss_scale is NOT a fix: a larger scale overflows sooner. Try, in order: "
            "train in bf16 instead of fp16 (\"bf16\": {\"enabled\": true}); lower the learning rate; "
            "enable gradient clipping (\"gradient_clipping\": 1.0); check the data and the loss for inf/nan "
            "(at a scale this small, an overflow usually means the unscaled gradients are already inf/nan)."
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "dynamic": True,
            "cur_scale": self.cur_scale,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "cur_hysteresis": self.cur_hysteresis,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the run state. The knobs (window, minimum, hysteresis) stay those of the config."""
        missing = sorted({"cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis"} - set(state_dict))
        if missing:
            raise ValueError(
                f"DynamicLossScaler state_dict is missing {missing} (keys found: {sorted(state_dict)}). "
                "It was probably saved with a static fp16.loss_scale; set fp16.loss_scale back to that "
                "value, or skip loading the loss scaler state to restart dynamic scaling."
            )
        self.cur_scale = _positive_finite(state_dict["cur_scale"], "state_dict['cur_scale']")
        self.cur_iter = _non_negative_int(state_dict["cur_iter"], "state_dict['cur_iter']")
        last_overflow_iter = state_dict["last_overflow_iter"]
        # -1 means "no overflow yet", so this one counter may be negative.
        self.last_overflow_iter = _int_at_least(last_overflow_iter, -1, "state_dict['last_overflow_iter']")
        self.cur_hysteresis = _positive_int(state_dict["cur_hysteresis"], "state_dict['cur_hysteresis']")
        self.skipped_steps = _non_negative_int(state_dict.get("skipped_steps", 0), "state_dict['skipped_steps']")
        self.rebuild_device_state()


def build_loss_scaler(
    enabled: bool,
    loss_scale: float,
    initial_scale_power: int,
    loss_scale_window: int,
    hysteresis: int,
    consecutive_hysteresis: bool,
    min_loss_scale: float,
) -> LossScaler | None:
    """The scaler an ``fp16`` config section asks for, or None when fp16 is off (bf16/fp32 need none).

    Returns a ``DynamicLossScaler`` when ``loss_scale == 0``, else a fixed ``LossScaler``.
    """
    if not enabled:
        return None
    if isinstance(loss_scale, bool) or not isinstance(loss_scale, Real) or not (0 <= loss_scale < math.inf):
        raise ValueError(
            f"fp16.loss_scale must be 0 (dynamic scaling) or a finite number > 0 (fixed scale), got {loss_scale!r}."
        )
    if loss_scale > 0:
        return LossScaler(float(loss_scale))
    if isinstance(initial_scale_power, bool) or not isinstance(initial_scale_power, Integral):
        raise ValueError(f"fp16.initial_scale_power must be an integer, got {initial_scale_power!r}.")
    try:
        init_scale = math.ldexp(1.0, int(initial_scale_power))
    except OverflowError:
        init_scale = math.inf  # reported by the finiteness check below
    if not math.isfinite(init_scale) or init_scale == 0.0:
        raise ValueError(
            f"fp16.initial_scale_power={initial_scale_power} gives a scale outside float range; "
            "DeepSpeed's default is 16 and values above 32 only add overflowing steps."
        )
    return DynamicLossScaler(
        init_scale=init_scale,
        scale_window=loss_scale_window,
        min_scale=min_loss_scale,
        delayed_shift=hysteresis,
        consecutive_hysteresis=consecutive_hysteresis,
    )
