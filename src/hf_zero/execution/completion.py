"""Completions: the one handle for device work that may still be running.

Every asynchronous collective and copy hf_zero issues returns a :class:`Completion`. Its two
waits say who reads the result next:

- ``wait(stream)``: work queued on ``stream`` after this call (the current, compute stream when
  ``stream`` is None) sees the result. On CUDA that is a stream dependency (the host does not
  block); on the CPU (gloo) it blocks until the work is done.
- ``wait_on_host()``: the host reads the result next (an offloaded step reads a gradient copied
  to pinned memory): on CUDA the host blocks on the work's event.

A completion keeps every tensor its work reads or writes alive until it is waited, so a buffer
is never freed (and so never reused by the caching allocator) while a side stream still uses it
([Note: streams and events] in hf_zero.execution.streams).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class Completion(Protocol):
    def wait(self, stream: Any = None) -> None: ...

    def wait_on_host(self) -> None: ...

    def is_completed(self) -> bool: ...


class Done:
    """Work that has finished already (done synchronously, or nothing to do)."""

    def wait(self, stream: Any = None) -> None:
        return None

    def wait_on_host(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


DONE = Done()


class WorkCompletion:
    """An asynchronous ``torch.distributed`` work object (gloo: the host waits for it)."""

    def __init__(self, work: Any, keepalive: tuple[torch.Tensor, ...] = ()) -> None:
        self.work: Any = work
        self.keepalive: tuple[torch.Tensor, ...] = keepalive

    def wait(self, stream: Any = None) -> None:
        if self.work is not None:
            self.work.wait()
            self.work, self.keepalive = None, ()

    def wait_on_host(self) -> None:
        self.wait()

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()


class EventCompletion:
    """Work queued on a side CUDA stream, followed by an event recorded on that stream."""

    def __init__(self, event: torch.cuda.Event, keepalive: tuple[torch.Tensor, ...]) -> None:
        self.event = event
        self.keepalive: tuple[torch.Tensor, ...] = keepalive

    def wait(self, stream: Any = None) -> None:
        waiter = stream if stream is not None else torch.cuda.current_stream()
        waiter.wait_event(self.event)
        if stream is None:  # the compute stream is ordered after the work: its buffers may go
            self.keepalive = ()

    def wait_on_host(self) -> None:
        self.event.synchronize()
        self.keepalive = ()

    def is_completed(self) -> bool:
        return self.event.query()
