"""A saved LR scheduler state, checked against the engine's scheduler before it is applied.

[Note: validated scheduler state]
torch's ``LRScheduler.load_state_dict`` is ``self.__dict__.update(state_dict)``: it checks
nothing, and a bad value surfaces at the next ``scheduler.step()`` (a ``TypeError``), or worse
trains: a NaN or negative learning rate, saved again at the next checkpoint. So a saved state is
compared with the state the engine's own scheduler holds now (its ``state_dict()``), key by key,
before anything is applied:

- the keys: no key the scheduler lacks (it would become an attribute), and no number or list
  missing (the live scheduler would silently keep its own); a missing flag (``_is_initial``,
  which newer torch adds) keeps the scheduler's own;
- the kind of each value (number, flag, text, list, object) as the scheduler holds it there, a
  per-group list (``base_lrs``, ``_last_lr``, ``min_lrs``, ``lr_lambdas``...) as long as the
  optimizer's param groups, an integer where the scheduler holds an integer;
- every number not NaN, and finite unless the scheduler itself uses infinity there
  (``ReduceLROnPlateau``'s ``best`` and ``mode_worse``);
- torch's named quantities in range: learning rates (``base_lrs``, ``_last_lr``, ``eta_min``,
  ``min_lrs``, ``max_lrs``...) >= 0; ``gamma`` and ``factor`` > 0; ``last_epoch`` >= -1;
  ``step_size``, ``T_max``, ``T_0``, ``T_mult``, ``total_steps`` >= 1; the counts
  (``_step_count``, ``patience``, ``cooldown``...) >= 0; every integer at most 2**48.

Then the load tries the state (``load.py``'s ``_try_state``): it is applied, one step is taken
(for a scheduler whose ``step()`` needs no argument) and the learning rates it writes must be
finite and >= 0; the scheduler, its attributes and the optimizer's param groups are then put
back. A state that passes both is applied in the load's second phase.
"""

from __future__ import annotations

import inspect
import math
import warnings
from typing import Any, Mapping

from hf_zero.checkpoint.validate import MAX_COUNTER, as_number, value_kind

_RATES = frozenset({"base_lrs", "_last_lr", "eta_min", "min_lrs", "default_min_lr", "max_lrs", "initial_lr",
                    "base_lr", "max_lr", "initial_lrs"})
_POSITIVE = frozenset({"gamma", "factor"})
_AT_LEAST_ONE = frozenset({"step_size", "T_max", "T_0", "T_mult", "T_i", "total_steps", "total_iters"})
_AT_LEAST_MINUS_ONE = frozenset({"last_epoch"})
_INFINITE_ALLOWED = frozenset({"best", "mode_worse"})


def _kind(value: Any) -> str:
    kind = value_kind(value)
    return "object" if isinstance(value, Mapping) else kind


def _number_problem(where: str, key: str, value: Any, integer: bool) -> str | None:
    number = as_number(value)
    if number is None:
        return None
    if math.isnan(number) or (math.isinf(number) and key not in _INFINITE_ALLOWED):
        return f"{where} is {value!r:.60}: expected a finite number"
    if integer and (number != int(number) or abs(number) > MAX_COUNTER):
        return f"{where} is {value!r:.60}: expected an integer of at most 2**48"
    if key in _RATES and number < 0:
        return f"{where} is {value!r:.60}: a learning rate, expected >= 0"
    if key in _POSITIVE and number <= 0:
        return f"{where} is {value!r:.60}: expected > 0"
    if key in _AT_LEAST_ONE and number < 1:
        return f"{where} is {value!r:.60}: expected >= 1"
    if key in _AT_LEAST_MINUS_ONE and number < -1:
        return f"{where} is {value!r:.60}: expected >= -1"
    if integer and key not in _AT_LEAST_MINUS_ONE and number < 0:
        return f"{where} is {value!r:.60}: expected a count >= 0"
    return None


def _value_problems(where: str, key: str, saved: Any, current: Any, groups: int) -> list[str]:
    saved_kind, current_kind = _kind(saved), _kind(current)
    if saved_kind != current_kind and not {saved_kind, current_kind} <= {"none", "flag"}:
        return [f"{where} is a {saved_kind} ({saved!r:.60}), the scheduler holds a {current_kind} there"]
    if saved_kind == "sequence":
        if len(current) == groups and len(saved) != groups:
            return [f"{where} has {len(saved)} values, the optimizer has {groups} param groups"]
        numbers = bool(current) and all(_kind(item) == "number" for item in current)
        if numbers and not all(_kind(item) == "number" for item in saved):
            return [f"{where} is {saved!r:.60}: expected numbers, as the scheduler holds"]
        integer = numbers and all(_is_int(item) for item in current)
        items = [_number_problem(f"{where}[{i}]", key, item, integer) for i, item in enumerate(saved)]
        return [p for p in items if p]
    if saved_kind == "number":
        problem = _number_problem(where, key, saved, _is_int(current))
        return [problem] if problem else []
    return []


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def scheduler_state_problems(saved: Any, scheduler: Any, param_groups: int) -> list[str]:
    """Every way ``saved`` (a decoded scheduler state) differs from what ``scheduler`` holds
    (see [Note: validated scheduler state]); an empty list when it may be tried."""
    where = "lr_scheduler.state"
    if not isinstance(saved, dict):
        return [f"{where} is a {type(saved).__name__}, not an object"]
    current = scheduler.state_dict()
    extra = sorted(str(k) for k in saved if k not in current)
    if extra:
        return [f"{where} holds keys {extra[:5]} that {type(scheduler).__name__}.state_dict() does not have "
                "(each would become an attribute of the scheduler)"]
    problems = [f"{where}.{key} is missing (the scheduler holds {value!r:.40} there)"
                for key, value in current.items() if key not in saved and _kind(value) not in ("flag", "none")]
    for key, value in saved.items():
        problems += _value_problems(f"{where}.{key}", key, value, current[key], param_groups)
    return problems


def takes_a_plain_step(scheduler: Any) -> bool:
    """Whether ``scheduler.step()`` runs without an argument (``ReduceLROnPlateau`` needs a metric)."""
    try:
        parameters = inspect.signature(scheduler.step).parameters.values()
    except (TypeError, ValueError):
        return False
    return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters)


def trial_step_problem(scheduler: Any) -> str | None:
    """Step ``scheduler`` once (its state already replaced by the saved one) and check the
    learning rates it writes; the caller puts the scheduler and the param groups back."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "step() before optimizer.step()" advice
        scheduler.step()
    rates = [group.get("lr") for group in scheduler.optimizer.param_groups]
    bad = [rate for rate in rates if (n := as_number(rate)) is None or not math.isfinite(n) or n < 0]
    if bad:
        return f"its next step sets the learning rates {rates!r:.80}: expected finite numbers >= 0"
    return None
