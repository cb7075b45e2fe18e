"""Where offloaded state lives: host memory (pinned when a GPU is present) or files on NVMe.

These stores are storage plus the kernels' Adam; the engine (flat groups, optimizer) uses them,
so in the import order they sit between kernels and engine."""

from hf_zero.offload.host import OffloadSettings
from hf_zero.transfer import to_host
from hf_zero.offload.nvme import NvmeOptimizerStore
from hf_zero.offload.nvme_params import NvmeParamStore, NvmeShard
from hf_zero.offload.placement import units_to_offload

__all__ = ["NvmeOptimizerStore", "NvmeParamStore", "NvmeShard", "OffloadSettings", "to_host", "units_to_offload"]
