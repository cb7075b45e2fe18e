"""The compute floor: each rank trains its own copy of the model with no collective at all.

Forward, backward, clipping and ``torch.optim.AdamW(fused=True)`` on the full model, as one
process would, under the same torchrun, threads and batches as the engines. Every engine pays at
least this: its step time is this floor plus whatever its sharding, communication and bookkeeping
add. Ranks do not average gradients, so its loss curve is not comparable to DDP's (the benchmark
leaves it out of the loss check).
"""

from __future__ import annotations

from typing import Any

import torch

from engines.base import Runner, TorchLoopRunner
from engines.workload import Workload, build_model


class FloorRunner(TorchLoopRunner):
    name = "nocomm"

    def __init__(self, workload: Workload, options: dict[str, Any], device: torch.device) -> None:
        self.workload = workload
        self.model = self.forward_module = build_model(workload).to(device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), fused=True, **workload.adamw_kwargs())

    def info(self) -> dict[str, Any]:
        return {"optimizer": "torch.optim.AdamW(fused=True)", "collectives": "none (each rank alone)"}


def build(workload: Workload, options: dict[str, Any], device: torch.device) -> Runner:
    return FloorRunner(workload, options, device)
