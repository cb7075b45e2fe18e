"""Render the key table as the README's "Config reference" (one source for code and docs)."""

from __future__ import annotations

import sys
from typing import Any

from .errors import MISSING
from .keys import KeySpec, Status, iter_specs
from .kinds import Opaque, Section

__all__ = ["reference_markdown"]

_HEADER = ["| key | type | default | status | meaning |", "|---|---|---|---|---|"]


def _default_text(value: Any) -> str:
    if value is MISSING:
        return "required"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if value == sys.maxsize:
        return "sys.maxsize"
    if isinstance(value, int) and value >= 10_000 and str(value).rstrip("0") in "123456789":
        digits = str(value)
        return f"{digits[0]}e{len(digits) - 1}"
    if isinstance(value, str):
        return f'"{value}"'
    return str(value).replace("'", '"')


def _status_text(spec: KeySpec) -> str:
    if spec.path == "optimizer.type":
        return "implemented for Adam, AdamW, Muon, Adafactor; not_implemented for other types"
    if spec.path == "scheduler.type":
        return "implemented for WarmupLR, WarmupDecayLR, WarmupCosineLR; not_implemented for other types"
    if spec.path == "data_types.grad_accum_dtype":
        return "implemented: fp32 (default), or the compute dtype at stages 0-1"
    if spec.status is Status.NOT_IMPLEMENTED:
        return f"not_implemented when {spec.when_on}" if spec.when_on else "not_implemented"
    return spec.status.value


def _kind_text(spec: KeySpec) -> str:
    if isinstance(spec.kind, Section):
        return "section"
    if isinstance(spec.kind, Opaque):
        return "dict"
    return spec.kind.label


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _row(spec: KeySpec) -> str:
    key = f"`{spec.path}`"
    if spec.aliases:
        key += " (alias " + ", ".join(f"`{a}`" for a in spec.aliases) + ")"
    notes = spec.doc
    if spec.status is Status.ACCEPTED_NO_EFFECT:
        notes += f" No effect: {spec.reason}."
    elif spec.status is Status.NOT_IMPLEMENTED:
        notes += f" Not in hf_zero yet: {spec.reason}."
    if spec.auto_from:
        filled = f"filled from `resolve({spec.auto_from}=...)`" if spec.auto_from != "false" else "resolves to false"
        notes += f' "auto": {filled}.'
    if spec.scheduler_types:
        notes += f" Scheduler types: {', '.join(spec.scheduler_types)}."
    if spec.optimizer_types:
        notes += f" Optimizer types: {', '.join(spec.optimizer_types)}."
    cells = [key, _kind_text(spec), _default_text(spec.default), _status_text(spec), notes]
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def _compact_section(specs: list[KeySpec]) -> list[str]:
    """key | default | status rows, with the no-effect keys folded into one line."""
    rows = ["| key | default | status |", "|---|---|---|"]
    folded: list[str] = []
    for spec in specs:
        if spec.status is Status.ACCEPTED_NO_EFFECT:
            folded.append(f"`{spec.path}` ({_cell(_default_text(spec.default))})")
        elif not isinstance(spec.kind, Section):
            rows.append(f"| `{spec.path}` | {_cell(_default_text(spec.default))} | {_cell(_status_text(spec))} |")
    lines = rows if len(rows) > 2 else []
    if folded:
        lines += [""] if lines else []
        lines += ["Accepted, no effect in hf_zero (default in brackets): " + ", ".join(folded) + "."]
    return lines


def reference_markdown(compact: bool = False) -> str:
    """Markdown tables of every key (type, DeepSpeed default, hf_zero status, meaning), by section.

    compact: only key / default / status, with the accepted-no-effect keys listed in one line per
    section (the README's version; the full one is for the docs).
    """
    groups: dict[str, list[KeySpec]] = {"top level": [], "other DeepSpeed features": []}
    for spec in iter_specs():
        top = spec.path.split(".")[0]
        top_spec = next(s for s in iter_specs() if s.path == top)
        if isinstance(top_spec.kind, Section):
            groups.setdefault(f"`{top}`", []).append(spec)
        elif isinstance(top_spec.kind, Opaque):
            groups["other DeepSpeed features"].append(spec)
        else:
            groups["top level"].append(spec)
    groups["other DeepSpeed features"] = groups.pop("other DeepSpeed features")  # last
    lines: list[str] = []
    for title, specs in groups.items():
        body = _compact_section(specs) if compact else [*_HEADER, *[_row(s) for s in specs]]
        lines += ["", f"### {title}", "", *body]
    return "\n".join(lines).lstrip("\n")
