"""Reduced gradients on their way to host memory.

[Note: gradients copied to the host]
With ``offload_optimizer`` the fp32 gradient shard lives on the host, and each reduction's
result, on the device, is added into it. The add needs the copy to have landed, and waiting for
it inside the backward hook blocks the thread that queues the GPU's work: nothing new is queued
until the copy is done. So each reduced part is copied on the copy-out stream into a staging
buffer (pinned when the optimizer section says so) and queued here, and it is added into its
group's shard (converted in chunks, or copied into a shard that holds zeros: [Note: landing
16-bit gradients on the host] in hf_zero.kernels.cpu):

- when the host reads that shard: the offloaded step of the group (on its worker thread, see
  [Note: overlapped offload step]), the optimizer step, or a ``zero_grad``;
- or when more than ``IN_FLIGHT`` copies are queued: the oldest lands first. It was issued two
  reductions earlier, so the wait is for a copy long done, and host memory holds at most
  ``IN_FLIGHT`` staging buffers beyond the shards themselves.

On a CPU machine the reduced part already is host memory: it is queued as it is, no copy
(under [Note: late completion] it is copied like a device tensor, so that the tests see the
order a GPU has).

Copies land in the order they were issued, so a group's micro-steps add up in the same order as
before. The overlapped step lands groups on its worker thread while the backward queues more on
the autograd thread: one lock serialises the two.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from hf_zero.execution import Completion
from hf_zero.kernels import add_scaled_

IN_FLIGHT = 2  # reduced parts whose copy to the host may be in flight at once


@dataclass
class _Copy:
    grads: Any  # the GradBuffer whose gradient shard it goes into
    staging: torch.Tensor
    copied: Completion
    divisor: int
    overwrite: bool  # the shard holds zeros: the step's first part into it


class HostGradCopies:
    """The copies of one engine's reduced gradients to its host gradient shards, in flight."""

    def __init__(self) -> None:
        self._queue: deque[_Copy] = deque()
        self._lock = threading.Lock()

    def push(self, grads: Any, staging: torch.Tensor, copied: Completion, divisor: int, overwrite: bool) -> None:
        with self._lock:
            self._queue.append(_Copy(grads, staging, copied, divisor, overwrite))
            while len(self._queue) > IN_FLIGHT:
                self._land_oldest()

    def land(self, grads: Any) -> None:
        """Every copy queued up to the last one of ``grads`` (a flat group's GradBuffer) has
        landed in its shard."""
        with self._lock:
            while any(c.grads is grads for c in self._queue):
                self._land_oldest()

    def in_flight(self) -> int:
        return len(self._queue)

    def _land_oldest(self) -> None:
        copy = self._queue.popleft()
        copy.copied.wait_on_host()
        add_scaled_(copy.grads.shard, copy.staging, 1.0 / copy.divisor, dst_is_zero=copy.overwrite)
