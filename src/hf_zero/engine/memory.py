"""What a rank holds, by category: the figures the ZeRO formulas predict.

Each storage is counted once, at its full allocated size, in the first category that reaches it
(a master that aliases the compute parameters is counted as parameters; see
[Note: master aliasing] in master_state.py). Freed storages count zero.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from hf_zero.transfer import host_footprint_bytes

CATEGORIES = ("compute_params", "gradients", "fp32_master", "optimizer_state", "buffers")
# Device memory only some configs have, shown in a table where a rank has it: hpZ's secondary
# shards ([Note: secondary shards] in param_storage.py).
OPTIONAL_CATEGORIES = ("secondary_params",)
# Offloaded state (zero_optimization.offload_*): host memory, and bytes in NVMe files.
HOST_CATEGORIES = ("host_params", "host_gradients", "host_fp32_master", "host_optimizer_state")


class _StorageCounter:
    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.totals = {name: 0 for name in CATEGORIES + OPTIONAL_CATEGORIES + HOST_CATEGORIES}

    def add(self, category: str, tensors: Iterable[torch.Tensor | None]) -> None:
        for tensor in tensors:
            if tensor is None:
                continue
            storage = tensor.untyped_storage()
            nbytes = storage.nbytes()
            if nbytes == 0 or storage.data_ptr() in self.seen:
                continue
            self.seen.add(storage.data_ptr())
            # Host categories count what pinned memory really takes ([Note: host-device transfers]).
            self.totals[category] += host_footprint_bytes(tensor) if category in HOST_CATEGORIES else nbytes


def _state_tensors(optimizer: Any, hosted: set[int], on_host: bool) -> Iterable[torch.Tensor]:
    if optimizer is None:
        return
    for param, state in optimizer.state.items():
        if (id(param) in hosted) != on_host:
            continue
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield value


def memory_report(units: list[Any], optimizer: Any, module: nn.Module) -> dict[str, int]:
    """Device categories, their ``total``, host categories (offload), ``host_total``, and
    ``nvme`` (bytes in files: optimizer state under offload_optimizer nvme, compute shards under
    offload_param nvme)."""
    counter = _StorageCounter()
    groups = [g for u in units for g in u.groups]
    host = {id(g): g.offload.optimizer_on_host for g in groups}
    counter.add("compute_params", (g.storage.full for g in groups))
    counter.add("host_params", (g.storage.shard for g in groups if g.storage.shard_on_host))
    # NVMe parameter offload: the pool of host buffers the file-backed shards are read into.
    counter.add("host_params", (b for s in _param_stores(groups) for b in s.pool.buffers))
    counter.add("compute_params", (g.storage.shard for g in groups if not g.storage.shard_on_host))
    counter.add("secondary_params", (g.storage.secondary for g in groups))
    counter.add("gradients", (g.grads.full for g in groups))
    counter.add("host_gradients", (g.grads.shard for g in groups if host[id(g)]))
    counter.add("gradients", (g.grads.shard for g in groups if not host[id(g)]))
    counter.add("host_fp32_master", (g.master_state.tensor for g in groups if host[id(g)]))
    counter.add("fp32_master", (g.master_state.tensor for g in groups if not host[id(g)]))
    # A shape-aware optimizer's full-shape masters, one owner rank each ([Note: whole-parameter
    # step]), live on the compute device whatever the offload.
    whole = getattr(optimizer, "whole_params", None)
    if whole is not None:
        counter.add("fp32_master", (master for _, master in whole.owned_masters()))
    # Step counters are 0-d tensors in torch optimizers; they are state too.
    hosted_masters = {id(g.master_state.tensor) for g in groups if host[id(g)] and g.master_state.tensor is not None}
    counter.add("host_optimizer_state", _state_tensors(optimizer, hosted_masters, True))
    counter.add("optimizer_state", _state_tensors(optimizer, hosted_masters, False))
    counter.add("buffers", module.buffers())
    report = dict(counter.totals)
    report["total"] = sum(counter.totals[k] for k in CATEGORIES + OPTIONAL_CATEGORIES)
    report["host_total"] = sum(counter.totals[k] for k in HOST_CATEGORIES)
    report["nvme"] = _nvme_file_bytes(groups, optimizer)
    return report


def _param_stores(groups: list[Any]) -> list[Any]:
    stores = {id(g.offload.param_store): g.offload.param_store for g in groups if g.offload.param_store is not None}
    return list(stores.values())


def _nvme_file_bytes(groups: list[Any], optimizer: Any) -> int:
    """Optimizer state (master and moments) and compute shards kept in NVMe files."""
    nvme = getattr(optimizer, "nvme", None)
    return (nvme.file_bytes if nvme is not None else 0) + sum(s.file_bytes for s in _param_stores(groups))


_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9}


def _pick_unit(reports: list[dict[str, int]], unit: str) -> tuple[str, int]:
    if unit == "auto":
        largest = max((max(r.get("total", 0), r.get("host_total", 0), r.get("nvme", 0)) for r in reports), default=0)
        unit = "GiB" if largest >= 2**30 else "MiB"
    if unit not in _UNITS:
        raise ValueError(f"unit={unit!r} is not one of {['auto', *_UNITS]}")
    return unit, _UNITS[unit]


def format_memory_table(
    reports: list[dict[str, int]], unit: str = "auto", markdown: bool = False, max_rank_columns: int = 8
) -> str:
    """Per-rank ``memory_report()`` dicts (index = rank) as one table: a row per category plus
    the total, a column per rank plus the sum over ranks. Beyond ``max_rank_columns`` ranks the
    per-rank columns become min / max / mean. The offload rows (host categories, ``host_total``,
    ``nvme``) are shown when some rank has offloaded bytes.

    ``unit`` is ``"auto"`` (GiB when a rank holds at least 1 GiB, else MiB, as ``hf-zero
    estimate`` prints), or one of B, KiB, MiB, GiB, KB, MB, GB. ``markdown=True`` gives a pipe
    table (for notebooks and issue reports) instead of aligned text.
    """
    if not reports:
        raise ValueError("format_memory_table needs at least one report (engine.memory_report())")
    unit, scale = _pick_unit(reports, unit)
    per_rank = len(reports) <= max_rank_columns
    header = ["category"] + ([f"rank {r}" for r in range(len(reports))] if per_rank else ["min", "max", "mean"])
    header.append("all ranks")
    rows = [header]
    categories = [*CATEGORIES, *(k for k in OPTIONAL_CATEGORIES if any(r.get(k, 0) for r in reports)), "total"]
    offload = [*HOST_CATEGORIES, "host_total", "nvme"]
    if any(r.get(k, 0) for r in reports for k in offload):
        categories += offload
    for category in categories:
        values = [r.get(category, 0) / scale for r in reports]
        shown = values if per_rank else [min(values), max(values), sum(values) / len(values)]
        rows.append([category] + [f"{v:,.2f}" for v in shown] + [f"{sum(values):,.2f}"])
    title = f"memory by category ({unit}), {len(reports)} rank{'s' if len(reports) > 1 else ''}"
    if markdown:
        lines = ["| " + " | ".join(row) + " |" for row in rows]
        lines.insert(1, "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|")
        return f"**{title}**\n\n" + "\n".join(lines)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return title + "\n" + "\n".join(lines)
