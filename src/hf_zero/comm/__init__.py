"""The only importer of torch.distributed collectives in hf_zero."""

from hf_zero.comm.collectives import CommStats, Communicator, Handle
from hf_zero.comm.phases import CheckIn, check_in, out_of_step
from hf_zero.comm.process_group import default_device, ensure_process_group, hf_zero_timeout_s

__all__ = ["CheckIn", "CommStats", "Communicator", "Handle", "default_device", "ensure_process_group", "hf_zero_timeout_s", "check_in", "out_of_step"]
