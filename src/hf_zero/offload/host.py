"""What a rank keeps off its compute device; the host copies themselves are made in
hf_zero.transfer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hf_zero.offload.nvme_io import AioSettings



@dataclass(frozen=True)
class OffloadSettings:
    """What a rank keeps off its compute device (``zero_optimization.offload_*``)."""

    optimizer: str = "none"  # "none" | "cpu" | "nvme": fp32 master, gradient shard, Adam state
    params: str = "none"  # "none" | "cpu" | "nvme": stage-3 compute shards between gathers
    pin_memory: bool = True  # offload_optimizer.pin_memory: masters, gradient shards, moments
    pin_params: bool = True  # offload_param.pin_memory: stage-3 parameter shards on the host
    nvme_path: str | None = None
    tile_numel: int = 1 << 20  # elements per NVMe read/step/write tile (sub_group_size)
    # Threads the host step of offloaded optimizer state runs on ([Note: host threads] in
    # hf_zero.offload.threads); 0: torch's own count (no optimizer state on the host).
    host_threads: int = 0
    # optimizer "nvme": the aio section and whether tiles overlap ([Note: NVMe I/O]).
    aio: AioSettings = AioSettings()
    # params "nvme": the rank's NvmeParamStore (hf_zero.offload.nvme_params), which the flat
    # groups register their shards with as they are built.
    param_store: Any = field(default=None, compare=False, repr=False)
    # optimizer on the host: the engine's HostGradCopies (hf_zero.offload.grad_copies), through
    # which reduced gradients reach the host gradient shards.
    grad_copies: Any = field(default=None, compare=False, repr=False)

    @property
    def optimizer_on_host(self) -> bool:
        return self.optimizer != "none"

    @property
    def params_on_host(self) -> bool:
        """Stage-3 compute shards leave the compute device between gathers (cpu, or nvme with
        the shards that stay cached in host memory)."""
        return self.params != "none"
