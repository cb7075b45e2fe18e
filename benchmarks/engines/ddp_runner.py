"""PyTorch DDP: every rank keeps everything; gradients all-reduced during backward.

DDP's own gradient all-reduce runs in C++ (the Reducer calls the ProcessGroup directly), where
the Python collective counter cannot see it. So by default the runner registers DDP's reference
Python hook, ``default_hooks.allreduce_hook`` (divide by world size, all-reduce the bucket): the
same math, counted. ``ddp_builtin_allreduce`` keeps the C++ path (comm then reads 0).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from engines.base import Runner
from engines.probes import StorageTally
from engines.workload import Workload, build_model


class DdpRunner(Runner):
    name = "ddp"

    def __init__(self, workload: Workload, options: dict[str, Any], device: torch.device) -> None:
        self.workload = workload
        self.model = build_model(workload).to(device)
        self.builtin_allreduce = bool(options.get("ddp_builtin_allreduce", False))
        device_ids = [device.index] if device.type == "cuda" else None
        self.ddp = DistributedDataParallel(self.model, device_ids=device_ids)
        if not self.builtin_allreduce:
            self.ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), **workload.adamw_kwargs())
        self.device = device

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.workload.dtype == "bf16":  # GPU mode: fp32 weights, bf16 compute
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def forward_backward(self, batch: torch.Tensor) -> torch.Tensor:
        with self._autocast():
            loss = self.ddp(input_ids=batch, labels=batch).loss
        loss.backward()
        return loss.detach()

    def optimizer_step(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.workload.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def model_state(self) -> StorageTally:
        tally = StorageTally()
        params = list(self.model.parameters())
        tally.add("params", "module.parameters", params)
        tally.add("grads", "param.grad", (p.grad for p in params))
        tally.add("optim", "optimizer.state", (v for s in self.optimizer.state.values() for v in s.values()))
        return tally

    def info(self) -> dict[str, Any]:
        return {
            "comm_hook": "builtin C++ all-reduce (uncounted)" if self.builtin_allreduce
            else "default_hooks.allreduce_hook (Python, counted)",
            "bucket_cap_mb": self.ddp.bucket_bytes_cap / 2**20 if hasattr(self.ddp, "bucket_bytes_cap") else None,
            "optimizer": "torch.optim.AdamW (torch default implementation)",
            "engine_buffers": "DDP's gradient buckets live in the C++ Reducer: not visible here",
        }


def build(workload: Workload, options: dict[str, Any], device: torch.device) -> Runner:
    return DdpRunner(workload, options, device)
