"""Which device a thread launches work on, set once per thread and checked at every launch.

[Note: the launching thread's device]
CUDA keeps a *current device* per host thread, and every kernel, event, NCCL object exchange
and Triton launch goes to it unless told otherwise. A rank computes on ``cuda:LOCAL_RANK``; a
thread whose current device was never set computes on ``cuda:0``, so on ranks >= 1 its launches
land on another rank's GPU (or fault). Two places make such threads:

- the script's main thread, when the script creates the process group itself (every
  DeepSpeed-style script calls ``init_process_group`` before ``hf_zero.initialize``): hf_zero then
  never passed through the code that set the device;
- hf_zero's own worker threads (the overlapped offload step, ``overlap_step.py``), which start
  with device 0 whatever the rank.

So every thread that launches device work on hf_zero's behalf is *bound* first, with
:func:`bind_device` (the main thread, at ``initialize`` and whenever hf_zero joins a group) or
:func:`bound_thread_initializer` (a pool's threads). Binding sets CUDA's current device and
records the binding per thread. :func:`check_launch` runs before every collective, copy and
kernel launch: on CUDA it compares CUDA's current device with the tensor's; on the CPU, where
there is one device, it checks the binding the same way against the device *index* the rank
would use on a GPU machine (its ``LOCAL_RANK``), when asynchronous checking is on
([Note: late completion] in hf_zero.execution.late). An unbound thread, or one bound to another
rank's index, is the same mistake on both, and a CPU test catches it.

Host-store tensors (offloaded state, hf_zero.transfer) are not device work: the host step of
an offloaded group runs on any thread.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Binding:
    """What a thread was bound to: the device type and the index it launches on."""

    device_type: str
    index: int


_thread = threading.local()


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def rank_device() -> torch.device:
    """The device this rank computes on: its local CUDA device if there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def binding_for(device: torch.device) -> Binding:
    """The binding a thread computing on ``device`` must have. The CPU has one device; its index
    is the one this rank's GPU would have (see [Note: the launching thread's device])."""
    if device.type == "cuda":
        return Binding("cuda", device.index if device.index is not None else torch.cuda.current_device())
    return Binding(device.type, local_rank())


def bind_device(device: torch.device) -> None:
    """Make ``device`` the calling thread's current device, and record it."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _thread.binding = binding_for(device)


def bound_thread_initializer(device: torch.device) -> Callable[[], None]:
    """For ``ThreadPoolExecutor(initializer=...)``: every worker thread is bound to ``device``."""
    return lambda: bind_device(device)


def thread_binding() -> Binding | None:
    return getattr(_thread, "binding", None)


class WrongDeviceError(RuntimeError):
    """Device work was launched from a thread whose current device is not the tensor's."""


def check_launch(tensor: torch.Tensor, what: str, strict: bool) -> None:
    """Raise if the calling thread would launch ``what`` on another device than ``tensor``'s.
    ``strict`` (asynchronous checking on) also checks CPU launches against the thread's binding."""
    device = tensor.device
    if device.type == "cuda":
        current = torch.cuda.current_device()
        if device.index is not None and current != device.index:
            raise WrongDeviceError(
                f"hf_zero: {what} on {device} was launched from thread {threading.current_thread().name!r} "
                f"whose current CUDA device is cuda:{current}; the thread must be bound first "
                "(hf_zero.execution.bind_device). This is a bug in hf_zero or a thread the script made: "
                "call torch.cuda.set_device(LOCAL_RANK) in it")
        return
    if not strict or device.type != "cpu":
        return
    expected, bound = binding_for(device), thread_binding()
    # A thread bound to this rank's GPU may compute on the CPU (the offloaded optimizer step does):
    # what must agree is the index, i.e. that the thread belongs to this rank's device.
    if bound is None or bound.index != expected.index:
        found = "no device" if bound is None else f"{bound.device_type} index {bound.index}"
        raise WrongDeviceError(
            f"hf_zero: {what} was launched from thread {threading.current_thread().name!r}, which is bound to "
            f"{found}; this rank launches on index {expected.index} (LOCAL_RANK). On a GPU machine it would run "
            f"on the wrong GPU. Bind the thread with hf_zero.execution.bind_device before it launches work "
            "(see [Note: the launching thread's device])")
