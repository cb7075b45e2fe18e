"""Every copy between the compute device and host memory, and what lives on the host.

[Note: host-device transfers]
hf_zero keeps offloaded state (fp32 masters, gradient shards, Adam moments, stage-3 parameter
shards) in host memory, pinned when a GPU is present. Copies between that memory and the compute
device go through this module and nowhere else, so that each one is ordered correctly:

- device -> host (:func:`copy_to_host_`, :func:`to_host_copy`): the copy is issued without
  blocking and an event is recorded after it; the function waits on that event before it
  returns, because the caller reads the host data next (a CPU Adam step, an add into a host
  gradient shard). Reading a pinned buffer whose copy has not landed is a silent race on CUDA.
- host -> device (:func:`to_compute`, :func:`to_compute_async`): issued on the copy-in stream;
  the compute stream waits on its event (or the all-gather that sends it does, see
  [Note: streams and events] in hf_zero.execution).

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

from hf_zero.execution import DONE, Completion, execution_for

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


def host_footprint_bytes(tensor: torch.Tensor) -> int:
    """The host memory ``tensor``'s storage really takes: torch's pinned-memory allocator hands
    out blocks rounded up to a power of two (a 3 MiB pinned master takes 4 MiB), pageable
    memory what it asks for."""
    nbytes = tensor.untyped_storage().nbytes()
    pinned = nbytes and torch.cuda.is_available() and tensor.is_pinned()  # no pinning without a GPU
    return pinned_block_bytes(nbytes) if pinned else nbytes


def pinned_block_bytes(nbytes: int) -> int:
    """The block torch's caching host allocator gives a pinned request of ``nbytes``."""
    return 1 << max(0, nbytes - 1).bit_length() if nbytes else 0


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
    host = tensor if tensor.device.type == "cpu" else to_host_copy(tensor, pin)
    if pin and torch.cuda.is_available() and not host.is_pinned():
        host = host.pin_memory()
    elif host is tensor:
        host = tensor.clone()  # a host store owns its memory: never alias the caller's tensor
    return mark_host(host)


def host_snapshot(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    """A new host-store copy of ``tensor`` (from the host or a device), complete when returned:
    never the tensor itself, even when it already lives in host memory."""
    dst = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin and torch.cuda.is_available())
    copy_to_host_(dst, tensor)
    return mark_host(dst)


def to_compute(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on the compute ``device``: a new tensor whenever ``tensor`` is host-store memory
    (even on a CPU-only machine), so what reaches a collective is never the host store itself.
    The compute stream is ordered after the copy: work queued on it next reads the result."""
    copied, completion = to_compute_async(tensor, device)
    completion.wait()
    return copied


def to_compute_async(tensor: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Completion]:
    """As :func:`to_compute`, with the copy on the copy-in stream: the returned completion must
    be waited (or passed as a collective's ``after``) before the result is read."""
    if tensor.device == device and not is_host_store(tensor):
        return tensor, DONE
    return execution_for(device).copy_in(tensor, f"host -> {device} copy of {tuple(tensor.shape)}")


def copy_to_host_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for a host ``dst``; returns once the data has landed (the event is
    recorded on the copy-out stream of ``src``'s device, and the host waits on it)."""
    if src.device.type == "cpu":
        dst.copy_(src)
        return
    execution_for(src.device).copy_out(dst, src, f"{src.device} -> host copy of {tuple(src.shape)}").wait_on_host()


def to_host_copy(src: torch.Tensor, pin: bool = True) -> torch.Tensor:
    """A host copy of a compute-device tensor, complete when returned."""
    if src.device.type == "cpu":
        return src
    dst = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin and torch.cuda.is_available())
    copy_to_host_(dst, src)
    return dst
