"""Every copy between the compute device and host memory, and what lives on the host.

[Note: host-device transfers]
hf_zero keeps offloaded state (fp32 masters, gradient shards, Adam moments, stage-3 parameter
shards) in host memory, pinned when a GPU is present. Copies between that memory and the compute
device go through this module and nowhere else, so that each one is ordered correctly:

- device -> host (:func:`copy_to_host_`, :func:`to_host_copy`): the copy is issued without
  blocking and an event is recorded after it; the function waits on that event before it
  returns, because the caller reads the host data next (a CPU Adam step, an add into a host
  gradient shard). Reading a pinned buffer whose copy has not landed is a silent race on CUDA.
- host -> device (:func:`to_compute`): issued without blocking on the current stream, so every
  kernel or collective that later reads the result on that stream runs after it.

Host tensors made by :func:`to_host` are registered as host-store memory. The communicator
refuses them (``assert_not_host``): a collective on the compute device's backend (NCCL) cannot
take a host tensor, and registering makes that mistake visible on a CPU-only machine too, where
host and compute device are the same memory. A value computed on the host from host shards (a
partial gradient norm) is registered with :func:`mark_host` for the same reason and reaches a
collective only through :func:`to_compute`.
"""

from __future__ import annotations

import weakref

import torch

_HOST_STORAGES: dict[int, int] = {}  # storage data_ptr -> live host tensors registered on it


def _unregister(ptr: int) -> None:
    count = _HOST_STORAGES.get(ptr, 0) - 1
    if count <= 0:
        _HOST_STORAGES.pop(ptr, None)
    else:
        _HOST_STORAGES[ptr] = count


def mark_host(tensor: torch.Tensor) -> torch.Tensor:
    """Register ``tensor``'s storage as host-store memory (see [Note: host-device transfers])."""
    ptr = tensor.untyped_storage().data_ptr()
    if ptr:
        _HOST_STORAGES[ptr] = _HOST_STORAGES.get(ptr, 0) + 1
        weakref.finalize(tensor, _unregister, ptr)
    return tensor


def is_host_store(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.untyped_storage().data_ptr() in _HOST_STORAGES


def assert_not_host(tensor: torch.Tensor, what: str) -> None:
    """Raise if ``tensor`` lives in host-store memory: collectives take compute-device tensors."""
    if is_host_store(tensor):
        raise RuntimeError(
            f"hf_zero: {what} was given a tensor that lives in host (offload) memory; collectives "
            "run on the compute device's backend. Move it with hf_zero.transfer.to_compute "
            "first (this is a bug in hf_zero: please report it)"
        )


def to_host(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    """A host copy registered as host-store memory (the tensor itself when it already is a
    registered host tensor), page-locked when asked and a GPU exists to make pinning useful."""
    if is_host_store(tensor):
        return tensor
    host = tensor if tensor.device.type == "cpu" else to_host_copy(tensor)
    if pin and torch.cuda.is_available() and not host.is_pinned():
        host = host.pin_memory()
    elif host is tensor:
        host = tensor.clone()  # a host store owns its memory: never alias the caller's tensor
    return mark_host(host)


def to_compute(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on the compute ``device``: a new tensor whenever ``tensor`` is host-store memory
    (even on a CPU-only machine), so what reaches a collective is never the host store itself.
    Host -> device copies are issued on the current stream: later readers on it are ordered."""
    if tensor.device == device and not is_host_store(tensor):
        return tensor
    if tensor.device == device:
        return tensor.clone()
    return tensor.to(device, non_blocking=tensor.is_pinned())


def copy_to_host_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for a host ``dst``; returns once the data has landed."""
    if src.device.type == "cpu":
        dst.copy_(src)
        return
    dst.copy_(src, non_blocking=dst.is_pinned())
    if src.device.type == "cuda":
        event = torch.cuda.Event()
        event.record()
        event.synchronize()  # the caller reads dst next


def to_host_copy(src: torch.Tensor) -> torch.Tensor:
    """A host copy of a compute-device tensor, complete when returned."""
    if src.device.type == "cpu":
        return src
    dst = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=torch.cuda.is_available())
    copy_to_host_(dst, src)
    return dst
