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

from engines.base import Runner, TorchLoopRunner
from engines.workload import Workload, build_model


class DdpRunner(TorchLoopRunner):
    name = "ddp"

    def __init__(self, workload: Workload, options: dict[str, Any], device: torch.device) -> None:
        self.workload = workload
        self.model = build_model(workload).to(device)
        self.builtin_allreduce = bool(options.get("ddp_builtin_allreduce", False))
        device_ids = [device.index] if device.type == "cuda" else None
        self.ddp = self.forward_module = DistributedDataParallel(self.model, device_ids=device_ids)
        if not self.builtin_allreduce:
            self.ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), **workload.adamw_kwargs())
        self.device = device

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.workload.dtype == "bf16":  # GPU mode: fp32 weights, bf16 compute
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

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
