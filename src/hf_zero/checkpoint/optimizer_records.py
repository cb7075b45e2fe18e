"""The optimizer state a checkpoint's group records hold, checked against what the optimizer needs.

[Note: complete optimizer records]
A torch optimizer builds a parameter's state at its first step and afterwards reads it without
looking: ``AdamW`` reads ``state["exp_avg"]`` once ``state`` is not empty, ``ZeroAdam`` reads
``state["step"]``. A record that lost one of its tensors or its step count would load and fail
at the next step with a ``KeyError``. So, before anything is applied, each trainable record that
will be loaded must be either

- without optimizer state (no ``optim.*`` tensor and no step count: the group never stepped,
  for example parameters no rank used yet; it starts afresh, as in the run that saved it), or
- complete: the element-wise tensors the engine's optimizer keeps, no more and no fewer, and its
  step count when the optimizer keeps one.

What the optimizer keeps is found by stepping its own class once over a two-element parameter
with each param group's hyperparameters (``amsgrad=True`` adds ``max_exp_avg_sq``, SGD without
momentum keeps nothing): a tensor of the parameter's size is element-wise state, anything else a
scalar. An optimizer class that cannot be built that way (its constructor needs more) is checked
for the shape of the rule only: state and step count together.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from hf_zero.checkpoint.manifest import OPTIM_PREFIX, PARAM_KEY, decode_state

logger = logging.getLogger("hf_zero")

_PROBE_NUMEL = 2


@dataclass(frozen=True)
class KeptState:
    """What an optimizer keeps per parameter: element-wise tensors and whether a step count."""

    elementwise: frozenset[str]
    step: bool


def kept_state(optimizer_class: type, group: Mapping[str, Any]) -> KeptState | None:
    """The state ``optimizer_class`` keeps for a parameter of a group like ``group`` (see
    [Note: complete optimizer records]), or None when the class cannot be probed."""
    try:
        accepted = inspect.signature(optimizer_class.__init__).parameters
        hyper = {k: v for k, v in group.items() if k in accepted and k not in ("self", "params")}
        param = torch.zeros(_PROBE_NUMEL, requires_grad=True)
        probe = optimizer_class([param], **hyper)
        param.grad = torch.full_like(param, 1e-3)
        probe.step()
        state = probe.state[param]
    except Exception as exc:  # a constructor or step that needs more than the group holds
        logger.debug("hf_zero: cannot probe the state %s keeps (%s: %s)", optimizer_class.__name__,
                     type(exc).__name__, exc)
        return None
    elementwise = frozenset(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.numel() == _PROBE_NUMEL)
    return KeptState(elementwise, "step" in state)


def _record_problems(index: int, record: Mapping[str, Any], kept: KeptState | None) -> list[str]:
    where = f"groups[{index}]"
    tensors = record["tensors"]
    if PARAM_KEY not in tensors:
        return [f"{where}.tensors has no {PARAM_KEY!r} entry"]
    saved = frozenset(k[len(OPTIM_PREFIX):] for k in tensors if k.startswith(OPTIM_PREFIX))
    scalars = decode_state(record.get("optimizer_scalars") or {}, f"{where}.optimizer_scalars")
    has_step = isinstance(scalars, dict) and "step" in scalars
    if not saved and not has_step:
        return []  # never stepped: it starts afresh
    if kept is None:
        if saved and not has_step:
            return [f"{where}.optimizer_scalars has no step count beside its optimizer state {sorted(saved)}"]
        return []
    problems = []
    if saved != kept.elementwise:
        problems.append(f"{where} ({record['group']}) holds optimizer state {sorted(saved)}, the optimizer keeps "
                        f"{sorted(kept.elementwise)}")
    if kept.step and not has_step:
        problems.append(f"{where}.optimizer_scalars has no step count")
    return problems


def record_problems(manifest: Mapping[str, Any], optimizer: torch.optim.Optimizer,
                    indices: list[int]) -> list[str]:
    """Every incomplete optimizer record among the manifest's groups ``indices`` (those a load
    reads optimizer state from), for ``optimizer``'s param groups."""
    cache: dict[int, KeptState | None] = {}
    problems = []
    for index in indices:
        record = manifest["groups"][index]
        if not record["trainable"]:
            continue
        group_index = record.get("param_group", 0)
        if group_index not in cache:
            groups = optimizer.param_groups
            group = groups[group_index] if isinstance(group_index, int) and 0 <= group_index < len(groups) else {}
            cache[group_index] = kept_state(type(optimizer), group) if group else None
        problems += _record_problems(index, record, cache[group_index])
    return problems
