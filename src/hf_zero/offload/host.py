"""Host (CPU) placement of offloaded tensors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class OffloadSettings:
    """What a rank keeps off its compute device (``zero_optimization.offload_*``)."""

    optimizer: str = "none"  # "none" | "cpu" | "nvme": fp32 master, gradient shard, Adam state
    params: str = "none"  # "none" | "cpu" | "nvme": stage-3 compute shards between gathers
    pin_memory: bool = True
    nvme_path: str | None = None
    tile_numel: int = 1 << 20  # elements per NVMe read/step/write tile (sub_group_size)
    # params "nvme": the rank's NvmeParamStore (hf_zero.offload.nvme_params), which the flat
    # groups register their shards with as they are built.
    param_store: Any = field(default=None, compare=False, repr=False)

    @property
    def optimizer_on_host(self) -> bool:
        return self.optimizer != "none"

    @property
    def params_on_host(self) -> bool:
        """Stage-3 compute shards leave the compute device between gathers (cpu, or nvme with
        the shards that stay cached in host memory)."""
        return self.params != "none"


def to_host(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    """A host copy (or the tensor itself when it already is one), page-locked when asked and a
    GPU exists to make pinning useful (pinning needs CUDA)."""
    host = tensor if tensor.device.type == "cpu" else tensor.to("cpu")
    if pin and torch.cuda.is_available() and not host.is_pinned():
        host = host.pin_memory()
    return host
