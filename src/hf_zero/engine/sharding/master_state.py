"""A flat group's fp32 master shard: its precision and where it lives (through the stores).

[Note: master aliasing]
Master weights are fp32. When the compute dtype is fp32 too, the master shard *is* the compute
shard (a view for stages 0-2, the shard tensor for stage 3): the optimizer updates the parameters
in place and no second fp32 copy exists. With 16-bit compute the master is a separate fp32 shard
and the optimizer writes the 16-bit compute copy in the same pass.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import torch

from hf_zero.offload import OffloadSettings
from hf_zero.transfer import to_host

if TYPE_CHECKING:
    from hf_zero.offload import NvmeOptimizerStore


class MasterPlacement(enum.Enum):
    """Where a group's fp32 master shard is, and whether it is a tensor of its own."""

    NONE = "none"  # a frozen group: no master
    ALIASED = "aliased"  # the compute shard itself ([Note: master aliasing])
    DEVICE = "device"  # a separate fp32 copy on the compute device
    HOST = "host"  # a separate fp32 copy in host memory (offload_optimizer cpu)
    UNBOUND_NVME = "unbound_nvme"  # offload_optimizer nvme before bind_nvme: a placeholder
    NVME = "nvme"  # in the optimizer's NVMe files (index ``nvme_index`` of ``nvme_store``)


class MasterState:
    """The fp32 master shard of one group. ``tensor`` is what the optimizer steps (an empty
    placeholder under NVMe optimizer offload, whose values live in the files); :meth:`read` and
    :meth:`write` reach the values wherever ``placement`` says they are."""

    def __init__(self, label: str, compute_shard: torch.Tensor | None, compute_dtype: torch.dtype,
                 offload: OffloadSettings, separate: bool) -> None:
        """``compute_shard`` is None for a frozen group; ``separate``: the compute shard leaves
        the device (offload_param alone), so the master must be a copy that stays on it."""
        self.label = label
        self.nvme_store: NvmeOptimizerStore | None = None
        self.nvme_index: int | None = None
        self.tensor: torch.Tensor | None
        self.placement: MasterPlacement
        # See [Note: master aliasing]. Offloaded, the master is always a separate fp32 copy on
        # the host (cpu) or a placeholder whose values live in files (nvme).
        if compute_shard is None:
            self.tensor, self.placement = None, MasterPlacement.NONE
        elif offload.optimizer == "nvme":
            self.tensor, self.placement = torch.zeros(0, dtype=torch.float32), MasterPlacement.UNBOUND_NVME
        elif offload.optimizer == "cpu":
            self.tensor = to_host(compute_shard.to(torch.float32, copy=True), offload.pin_memory)
            self.placement = MasterPlacement.HOST
        elif separate:
            # offload_param alone: the compute shard leaves the device, the master stays on it.
            self.tensor, self.placement = compute_shard.to(torch.float32, copy=True), MasterPlacement.DEVICE
        elif compute_dtype == torch.float32:
            self.tensor, self.placement = compute_shard, MasterPlacement.ALIASED
        else:
            self.tensor, self.placement = compute_shard.float(), MasterPlacement.DEVICE

    def bind_nvme(self, store: NvmeOptimizerStore, index: int) -> None:
        """UNBOUND_NVME -> NVME: the optimizer's NVMe store (which sizes itself from every group,
        so it exists only after them) holds this master as its entry ``index``."""
        self._expect_not(MasterPlacement.NONE, "bind an NVMe store")
        if self.placement is not MasterPlacement.UNBOUND_NVME:
            raise RuntimeError(f"{self.label}: cannot bind an NVMe store: its master is {self.placement.value}, "
                               f"expected {MasterPlacement.UNBOUND_NVME.value} (bind_nvme runs once, under "
                               "offload_optimizer nvme)")
        self.nvme_store, self.nvme_index, self.placement = store, index, MasterPlacement.NVME

    @property
    def is_compute_shard(self) -> bool:
        """fp32 compute without a separate master (see [Note: master aliasing])."""
        return self.placement is MasterPlacement.ALIASED

    def read(self) -> torch.Tensor | None:
        """The fp32 master shard, read from the optimizer's NVMe files when they hold it."""
        self._expect_not(MasterPlacement.UNBOUND_NVME, "read the master")
        if self.nvme_store is not None:
            return self.nvme_store.read(self.nvme_index, "master", 0, self.nvme_store.numels[self.nvme_index])
        return self.tensor

    def write(self, values: torch.Tensor) -> None:
        """Replace the fp32 master shard (in the optimizer's NVMe files when they hold it)."""
        self._expect_not(MasterPlacement.UNBOUND_NVME, "write the master")
        if self.nvme_store is not None:
            self.nvme_store.store_master(self.nvme_index, values)
        elif self.tensor is not None and self.tensor.data_ptr() != values.data_ptr():
            self.tensor.copy_(values)

    def _expect_not(self, placement: MasterPlacement, action: str) -> None:
        if self.placement is placement:
            raise RuntimeError(f"{self.label}: cannot {action}: its master is {placement.value}"
                               + (" (initialize binds the NVMe store with bind_nvme() first)"
                                  if placement is MasterPlacement.UNBOUND_NVME else ""))
