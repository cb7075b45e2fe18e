"""The batch triple: train_batch_size = micro batch x gradient accumulation x world size.

DeepSpeed (runtime/config.py `_set_batch_related_parameters`) derives a missing member from the
other two with floor division and then asserts the product; we derive the same way but report a
remainder as a problem (naming the numbers) instead of silently flooring. One extension: when none
of the three is given anywhere, micro batch 1 and accumulation 1 are used (DeepSpeed asserts) and
the summary says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import MISSING, ConfigProblem

__all__ = ["Batch", "derive_batch", "MICRO", "GAS", "TOTAL"]

MICRO = "train_micro_batch_size_per_gpu"
GAS = "gradient_accumulation_steps"
TOTAL = "train_batch_size"


@dataclass(frozen=True)
class Batch:
    """The derived triple; a member is None when it needs the world size (or is still "auto")."""

    micro: int | None
    gas: int | None
    total: int | None
    note: str | None = None
    problems: list[ConfigProblem] = field(default_factory=list)


def _not_multiple(total: int, factors: str, product: int, derived: str) -> ConfigProblem:
    return ConfigProblem(
        TOTAL,
        total,
        f"must be a multiple of {factors} = {product} ({derived} is derived from it)",
        f"set {TOTAL} to a multiple of {product}, or to \"auto\"",
    )


def derive_batch(
    micro: int | None,
    gas: int | None,
    total: int | None,
    world_size: int | None,
    *,
    pending: bool = False,
) -> Batch:
    """Fill the unknown members DeepSpeed's way.

    `pending` means some member is still "auto": no defaults are invented and nothing is reported
    as missing, because resolve(...) has not run yet.
    """
    if world_size is None:
        return _derive_without_world(micro, gas, total, pending)
    return _derive_with_world(micro, gas, total, world_size, pending)


def _derive_without_world(micro: int | None, gas: int | None, total: int | None, pending: bool) -> Batch:
    # Without the world size only divisibility can be checked: total / (micro * gas) must be a
    # whole number of ranks.
    if micro is not None and gas is not None and total is not None and total % (micro * gas):
        return Batch(micro, gas, total, problems=[_not_multiple(total, f"{MICRO} * {GAS}", micro * gas, "world_size")])
    if micro is not None and gas is None and total is not None and total % micro:
        return Batch(micro, gas, total, problems=[_not_multiple(total, MICRO, micro, GAS)])
    if micro is None and gas is not None and total is not None and total % gas:
        return Batch(micro, gas, total, problems=[_not_multiple(total, GAS, gas, MICRO)])
    if micro is None and gas is None and total is None and not pending:
        return Batch(1, 1, None, note=_DEFAULT_NOTE)
    if micro is None and total is None and gas is not None and not pending:
        return Batch(None, gas, None, problems=[_only_gas()])
    if gas is None and not pending and (micro is None) != (total is None):
        gas = 1  # DeepSpeed: only one of micro / total given means no accumulation.
    return Batch(micro, gas, total)


def _derive_with_world(
    micro: int | None, gas: int | None, total: int | None, world: int, pending: bool
) -> Batch:
    known = (micro is not None, gas is not None, total is not None)
    if known == (True, True, True):
        if total != micro * gas * world:
            rule = f"must equal {MICRO} * {GAS} * world_size = {micro} * {gas} * {world} = {micro * gas * world}"
            fix = f"set {TOTAL} to {micro * gas * world}, or to \"auto\""
            return Batch(micro, gas, total, problems=[ConfigProblem(TOTAL, total, rule, fix)])
        return Batch(micro, gas, total)
    if known == (True, False, True):
        if total % (micro * world):
            problem = _not_multiple(total, f"{MICRO} * world_size", micro * world, GAS)
            return Batch(micro, gas, total, problems=[problem])
        return Batch(micro, total // (micro * world), total)
    if known == (False, True, True):
        if total % (gas * world):
            return Batch(micro, gas, total, problems=[_not_multiple(total, f"{GAS} * world_size", gas * world, MICRO)])
        return Batch(total // (gas * world), gas, total)
    if known == (True, True, False):
        return Batch(micro, gas, micro * gas * world)
    if pending:
        return Batch(micro, gas, total)
    if known == (False, False, True):
        if total % world:
            return Batch(micro, gas, total, problems=[_not_multiple(total, "world_size", world, MICRO)])
        return Batch(total // world, 1, total)
    if known == (True, False, False):
        return Batch(micro, 1, micro * world)
    if known == (False, False, False):
        return Batch(1, 1, world, note=_DEFAULT_NOTE)
    return Batch(micro, gas, total, problems=[_only_gas()])


_DEFAULT_NOTE = (
    f"none of {TOTAL} / {MICRO} / {GAS} was given; using {MICRO}=1 and {GAS}=1"
)


def _only_gas() -> ConfigProblem:
    return ConfigProblem(
        MICRO,
        MISSING,
        f"DeepSpeed needs {TOTAL} or {MICRO} when only {GAS} is given",
        f"add {MICRO} (a number, or \"auto\" to take the Trainer's per-device batch size)",
    )
