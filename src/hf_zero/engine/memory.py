"""What a rank holds, by category: the figures the ZeRO formulas predict.

Each storage is counted once, at its full allocated size, in the first category that reaches it
(a master that aliases the compute parameters is counted as parameters; see
[Note: master aliasing] in flat_group.py). Freed storages count zero.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

CATEGORIES = ("compute_params", "gradients", "fp32_master", "optimizer_state", "buffers")


class _StorageCounter:
    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.totals = {name: 0 for name in CATEGORIES}

    def add(self, category: str, tensors: Iterable[torch.Tensor | None]) -> None:
        for tensor in tensors:
            if tensor is None:
                continue
            storage = tensor.untyped_storage()
            nbytes = storage.nbytes()
            if nbytes == 0 or storage.data_ptr() in self.seen:
                continue
            self.seen.add(storage.data_ptr())
            self.totals[category] += nbytes


def _state_tensors(optimizer: Any) -> Iterable[torch.Tensor]:
    if optimizer is None:
        return
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield value


def memory_report(units: list[Any], optimizer: Any, module: nn.Module) -> dict[str, int]:
    counter = _StorageCounter()
    groups = [g for u in units for g in u.groups]
    counter.add("compute_params", (t for g in groups for t in (g.full, g.shard)))
    counter.add("gradients", (t for g in groups for t in (g.grad_full, g.grad_shard)))
    counter.add("fp32_master", (g.master for g in groups))
    # Step counters are 0-d tensors in torch optimizers; they are state too.
    counter.add("optimizer_state", _state_tensors(optimizer))
    counter.add("buffers", module.buffers())
    report = dict(counter.totals)
    report["total"] = sum(counter.totals.values())
    return report
