"""Where a flat group's compute shard lives, behind one interface.

[Note: shard stores]
A flat group's compute shard (this rank's slice of its 16- or 32-bit parameters) lives in one of
three places, and the group talks to it through the same five members whatever the place, so it
does not branch on offload flags:

| store | where | used for |
|---|---|---|
| :class:`DeviceShard` | a tensor on the compute device | no ``offload_param`` (and every stage 0-2 group) |
| :class:`HostShard` | host memory (pinned with a GPU) | ``offload_param: cpu``, and NVMe shards within ``max_in_cpu`` |
| ``NvmeShard`` (hf_zero.offload.nvme_params) | a file, read through a bounded buffer pool | ``offload_param: nvme`` |

- ``tensor``: what the group holds as its ``storage.shard`` (the values, or an empty placeholder for a
  file).
- ``gather_input(device, reclaim)``: the tensor the all-gather sends, on the compute device,
  and the completion of its copy there (the all-gather waits on it: ``after=``);
  ``gather_done()`` once that gather has completed (a file's pool buffer is given back).
- ``read()``: the whole shard (a new host tensor for a file); ``write(values, start)``: new
  values for a range of it, from any device and dtype (the optimizer's update, a loaded
  checkpoint).
- A device shard can be *lent* to the gathered buffer while its unit is gathered
  ([Note: the shard lent to the gathered buffer] in hf_zero.engine.sharding.param_storage):
  ``lend(home)`` frees its memory, ``read`` and ``write`` reach ``home`` instead, and
  ``take_back()`` gives it memory and the values back.
Every copy between host and device goes through hf_zero.transfer.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from hf_zero.execution import DONE, Completion, poison_before_free
from hf_zero.host_memory import lasting_storage
from hf_zero.transfer import copy_to_host_, to_compute, to_compute_async, to_host


class ShardStore(Protocol):
    location: str  # "device" | "host" | "nvme"

    @property
    def tensor(self) -> torch.Tensor: ...

    def gather_input(self, device: torch.device, reclaim: Callable[[], None]) -> tuple[torch.Tensor, Completion]: ...

    def gather_done(self) -> None: ...

    def read(self) -> torch.Tensor: ...

    def write(self, values: torch.Tensor, start: int = 0) -> None: ...


class DeviceShard:
    """The shard as a tensor on the compute device (it may alias the fp32 master)."""

    location = "device"

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        # While lent: this rank's chunk of the gathered buffer, which holds the shard's values;
        # ``tensor`` keeps its identity (the master and the optimizer hold it) but no memory.
        self._home: torch.Tensor | None = None

    @property
    def lent(self) -> bool:
        return self._home is not None

    def lend(self, home: torch.Tensor) -> None:
        """``home`` holds the shard's values until :meth:`take_back`: free the shard's memory."""
        if self._home is not None:
            raise RuntimeError("the shard is already lent; take_back() first")
        if home.shape != self.tensor.shape or home.dtype != self.tensor.dtype or home.device != self.tensor.device:
            raise ValueError(f"cannot lend a shard of {tuple(self.tensor.shape)} {self.tensor.dtype} on "
                             f"{self.tensor.device} to {tuple(home.shape)} {home.dtype} on {home.device}")
        self._home = home
        poison_before_free(self.tensor)  # [Note: late completion]: a stale alias reads poison
        # Swapped out, not resized: saving a checkpoint reads the shard through numpy, which
        # marks its storage non-resizable for good. The holder takes the memory and frees it.
        holder = torch.UntypedStorage(0, device=self.tensor.device)
        holder._swap_data_ptr_(self.tensor.untyped_storage())

    def take_back(self) -> None:
        """The shard's memory again, with the values ``home`` holds now (before ``home`` goes)."""
        if self._home is None:
            raise RuntimeError("the shard is not lent")
        # Kept for the run again: [Note: memory kept for the run] in hf_zero.host_memory.
        fresh = lasting_storage(self.tensor.numel() * self.tensor.element_size(), self.tensor.device)
        self.tensor.untyped_storage()._swap_data_ptr_(fresh)
        self.tensor.copy_(self._home)
        self._home = None

    def _values(self) -> torch.Tensor:
        return self.tensor if self._home is None else self._home

    def gather_input(self, device: torch.device, reclaim: Callable[[], None]) -> tuple[torch.Tensor, Completion]:
        return self._values(), DONE

    def gather_done(self) -> None:
        return None

    def read(self) -> torch.Tensor:
        return self._values()

    def write(self, values: torch.Tensor, start: int = 0) -> None:
        target = self._values()[start : start + values.numel()]
        if values.device != target.device:
            # An updated host master: copied as it is (fp32, pinned) on the copy-in stream and
            # cast on the device, not cast on the host into a pageable buffer that the copy
            # then has to wait for.
            values = to_compute(values.reshape(-1), target.device)
        target.copy_(values.reshape(-1))


class HostShard:
    """The shard in host memory between gathers."""

    location = "host"

    def __init__(self, tensor: torch.Tensor, pin: bool) -> None:
        self.tensor = to_host(tensor, pin)

    def gather_input(self, device: torch.device, reclaim: Callable[[], None]) -> tuple[torch.Tensor, Completion]:
        return to_compute_async(self.tensor, device)  # on the copy-in stream: overlaps compute

    def gather_done(self) -> None:
        return None

    def read(self) -> torch.Tensor:
        return self.tensor

    def write(self, values: torch.Tensor, start: int = 0) -> None:
        copy_to_host_(self.tensor[start : start + values.numel()], values.reshape(-1))
