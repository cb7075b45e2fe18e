"""Where asynchronous device work runs, and what waits for what.

[Note: streams and events]
hf_zero's device work falls in four kinds besides the model's own compute, each with a stream
of its own on a GPU, after FSDP2's ``_fsdp_collectives.py`` and comm context:

| stream | work | overlaps |
|---|---|---|
| ``all_gather`` | parameter all-gathers (stage 3, prefetches included) | the compute of the unit before |
| ``reduce_scatter`` | gradient reduce-scatters | the backward of the units before |
| ``copy_in`` | host -> device copies (offloaded parameter shards before their gather) | compute |
| ``copy_out`` | device -> host copies (gradient shards and updated parameters) | compute |

The rules, each applied in this module only:

1. A side stream first waits on the compute stream (``wait_stream``): what it reads was made
   there. A dependency on another side stream's work is an event wait (``after=``).
2. The compute stream waits on the work's event, never the host (``Completion.wait``); the host
   blocks only where it reads the result itself (``wait_on_host``: a host step reading a copied
   gradient).
3. Every buffer a side stream touches is allocated on the compute stream and kept alive by the
   completion until the compute stream has waited on its event. A buffer freed after that wait
   is reused by the caching allocator only for work queued after the event, so no side-stream
   read or write can meet a reused buffer.
4. Every launch runs on the thread's bound device ([Note: the launching thread's device]).

On the CPU there are no streams: gloo's asynchronous work returns its ``Work`` and the waits
block. Under [Note: late completion] every operation completes at its wait, on any machine, so a
CPU test sees a read that comes before its wait.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from hf_zero.execution.completion import DONE, Completion, EventCompletion, WorkCompletion
from hf_zero.execution.device import check_launch
from hf_zero.execution.late import late_completion, run_late

# A collective: ``issue(output, input, async_op)`` returns the torch.distributed work (or None
# when it completed synchronously, or had nothing to do).
Issue = Callable[[torch.Tensor, torch.Tensor, bool], Any]

STREAM_KINDS = ("all_gather", "reduce_scatter", "copy_in", "copy_out")


class Execution:
    """The streams of one compute device (none on the CPU) and the launches that use them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.streams: dict[str, Any] = {}
        if device.type == "cuda":
            # Communication ahead of compute when both are ready, as FSDP2 does for its all-gathers.
            priority = {"all_gather": -1, "reduce_scatter": -1}
            self.streams = {kind: torch.cuda.Stream(device=device, priority=priority.get(kind, 0))
                            for kind in STREAM_KINDS}

    # ------------------------------------------------------------------ collectives
    def collective(self, kind: str, what: str, output: torch.Tensor, input: torch.Tensor, issue: Issue,
                   async_op: bool, after: Sequence[Completion] = ()) -> Completion:
        """Run a collective that writes ``output`` from ``input`` on the stream of ``kind``; the
        compute stream (or, blocking, the host) waits for it at the completion's ``wait``.
        ``after``: completions the collective's input depends on (an offloaded shard's copy)."""
        check_launch(output, what, strict=late_completion())
        if late_completion():
            for dependency in after:  # the input is what the collective reads once they are done
                dependency.wait()

            def launch(result: torch.Tensor, snapshots: list[torch.Tensor]) -> Completion:
                return self._collective(kind, result, snapshots[0], issue, async_op=True, after=())

            completion: Completion = run_late(what, output, [input], launch)
        else:
            completion = self._collective(kind, output, input, issue, async_op, after)
        if not async_op:
            completion.wait()
        return completion

    def _collective(self, kind: str, output: torch.Tensor, input: torch.Tensor, issue: Issue,
                    async_op: bool, after: Sequence[Completion]) -> Completion:
        stream = self.streams.get(kind)
        if stream is None:  # the CPU: gloo's own thread, the host waits on the work
            for dependency in after:
                dependency.wait()
            work = issue(output, input, async_op)
            return WorkCompletion(work, (output, input)) if work is not None else DONE
        stream.wait_stream(torch.cuda.current_stream(self.device))
        for dependency in after:
            dependency.wait(stream)
        with torch.cuda.stream(stream):
            # Blocking from the side stream's view: NCCL's own stream is joined into ``stream``,
            # and the event below marks the end of the collective.
            issue(output, input, False)
            event = torch.cuda.Event()
            event.record(stream)
        return EventCompletion(event, (output, input))

    # ------------------------------------------------------------------ copies
    def copy_in(self, host: torch.Tensor, what: str) -> tuple[torch.Tensor, Completion]:
        """A copy of host memory on this device, and its completion. The result is a new tensor
        (a host store is never handed out, even when the device is the CPU)."""
        dst = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        return dst, self._copy("copy_in", dst, host, what)

    def copy_out(self, dst: torch.Tensor, src: torch.Tensor, what: str) -> Completion:
        """``dst.copy_(src)`` from this device into host memory; the host may read ``dst`` after
        the completion's ``wait_on_host``. ``src`` stays alive (and unchanged) until then."""
        return self._copy("copy_out", dst, src, what)

    def stage_to_host(self, src: torch.Tensor, pin: bool, what: str) -> tuple[torch.Tensor, Completion]:
        """``src`` in host memory, and the completion after which the host may read it: a copy
        on the copy-out stream into a new (pinned, when ``pin``) buffer. A CPU tensor already is
        host memory and is handed back as it is, except under [Note: late completion], where it
        is copied like a device tensor so that a read before the wait is caught."""
        if src.device.type == "cpu" and not late_completion():
            return src, DONE
        staging = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin and torch.cuda.is_available())
        return staging, self.copy_out(staging, src, what)

    def _copy(self, kind: str, dst: torch.Tensor, src: torch.Tensor, what: str) -> Completion:
        def launch(result: torch.Tensor, source: torch.Tensor) -> Completion:
            stream = self.streams.get(kind)
            if stream is None or self.device.type != "cuda":
                result.copy_(source)
                return DONE
            host = source if source.device.type == "cpu" else result
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                result.copy_(source, non_blocking=host.is_pinned())  # pinned: truly asynchronous
                event = torch.cuda.Event()
                event.record(stream)
            return EventCompletion(event, (result, source))

        check_launch(dst if kind == "copy_in" else src, what, strict=late_completion())
        if late_completion():
            return run_late(what, dst, [src], lambda result, snapshots: launch(result, snapshots[0]))
        return launch(dst, src)


_EXECUTIONS: dict[torch.device, Execution] = {}


def execution_for(device: torch.device) -> Execution:
    """The process's :class:`Execution` for ``device`` (made on first use)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    found = _EXECUTIONS.get(device)
    if found is None:
        found = _EXECUTIONS[device] = Execution(device)
    return found
