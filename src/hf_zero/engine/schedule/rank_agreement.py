"""Ranks that must agree, checked before they depend on agreeing.

[Note: rank agreement]
Every rank of a ZeRO run must hold the same resolved config, the same model layout and the same
optimizer hyperparameters: a different learning rate on one rank trains silently wrong, a
different accumulation count or unit layout pairs collectives that do not match (an abort inside
gloo at best, a silent hang at worst). ``initialize`` therefore exchanges, before its first
collective on model data, each rank's outcome so far (an exception, or a fingerprint: every
resolved config key, every optimizer param group's hyperparameters, and per unit a digest of its
parameter names, shapes and trainability) in one ``all_gather_objects``. A rank that failed
re-raises its own error and every other rank raises one naming it, so nobody is left waiting in
a broadcast; fingerprints that differ raise on every rank, naming each key with its value per
rank. ``save_checkpoint`` compares the ranks' step counters the same way.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Iterable, Mapping

from hf_zero.comm import Communicator

TIMEOUT_ENV = "HF_ZERO_TIMEOUT"


class RankDisagreementError(RuntimeError):
    """The ranks hold different settings, or one of them failed; raised on every rank."""


def collective_timeout_s(config: Mapping[str, Any]) -> float | None:
    """``collective_timeout_s`` from the config, else ``HF_ZERO_TIMEOUT``, else None (torch's)."""
    value = config.get("collective_timeout_s")
    if value is not None:
        return float(value)
    text = os.environ.get(TIMEOUT_ENV)
    if not text:
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{TIMEOUT_ENV}={text!r}: expected a number of seconds above 0, e.g. {TIMEOUT_ENV}=600")
    return seconds


def _flatten(value: Any, path: str, out: dict[str, str]) -> None:
    if isinstance(value, dict) and value:
        for key, item in value.items():
            _flatten(item, f"{path}.{key}" if path else str(key), out)
    else:
        out[path] = json.dumps(value, sort_keys=True, default=repr)


def fingerprint(config: Mapping[str, Any], hyper: Iterable[Mapping[str, Any]],
                units: Iterable[Any]) -> dict[str, str]:
    """What must be equal on every rank, key -> a printable value (see [Note: rank agreement])."""
    found: dict[str, str] = {}
    _flatten(dict(config), "", found)
    for index, group in enumerate(hyper):
        for key, value in group.items():
            found[f"optimizer param group {index}: {key}"] = json.dumps(value, sort_keys=True, default=repr)
    unit_list = list(units)
    found["layout: number of units"] = str(len(unit_list))
    for index, unit in enumerate(unit_list):
        described = [(name, tuple(p.shape), bool(p.requires_grad), str(p.dtype)) for name, p in unit.params]
        digest = hashlib.sha256(repr(described).encode()).hexdigest()[:12]
        found[f"layout: unit {index} ({unit.name})"] = f"{len(described)} parameters, digest {digest}"
    return found


def _differences(prints: list[dict[str, str]]) -> list[str]:
    keys = sorted(set().union(*prints))
    lines = []
    for key in keys:
        values = [p.get(key, "<absent>") for p in prints]
        if len(set(values)) > 1:
            shown = ", ".join(f"rank {rank} = {value[:60]}" for rank, value in enumerate(values))
            lines.append(f"{key}: {shown}")
    return lines


def agree(comm: Communicator, what: str, local_error: BaseException | None, local_print: dict[str, str] | None) -> None:
    """Raise on every rank if any rank failed or the fingerprints differ (see [Note: rank agreement])."""
    outcomes = comm.all_gather_objects({
        "error": None if local_error is None else f"{type(local_error).__name__}: {local_error}",
        "fingerprint": local_print,
    })
    failed = [(rank, o["error"]) for rank, o in enumerate(outcomes) if o["error"]]
    if local_error is not None:
        raise local_error
    if failed:
        shown = "\n  ".join(f"rank {rank}: {message}" for rank, message in failed)
        raise RankDisagreementError(f"{what} failed on another rank, so this rank stops too:\n  {shown}")
    differences = _differences([o["fingerprint"] or {} for o in outcomes])
    if differences:
        shown = "\n  ".join(differences[:20]) + (f"\n  and {len(differences) - 20} more" if len(differences) > 20 else "")
        raise RankDisagreementError(
            f"{what}: the ranks disagree on {len(differences)} setting(s); every rank must run with the same "
            f"config, model and optimizer (a per-rank value is usually a script that builds them from the rank):\n  {shown}"
        )
