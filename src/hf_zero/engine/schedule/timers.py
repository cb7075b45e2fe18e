"""Per-phase wall-clock timers: what ``"wall_clock_breakdown": true`` measures.

[Note: what each phase covers]
- ``forward``: ``engine(...)``, summed over micro-steps. Under stage 3 it includes the forward
  gathers, which ``gather`` also counts.
- ``backward``: ``engine.backward(loss)``, summed over micro-steps. It includes the gradient
  reductions (``reduce``) of stages 2-3 and of stages 0-1 at the boundary, and the stage-3
  backward gathers (``gather``): the hooks and the end-of-backward sweep run inside autograd.
- ``reduce``: the time the host spends issuing and finishing gradient reduce-scatters /
  all-reduces (with ``overlap_comm``, only the part of the wait that was not hidden).
- ``step``: ``engine.step()`` at the accumulation boundary: unscale, clip, optimizer, the stage
  1-2 all-gather of the updated parameters, scheduler.
- ``gather``: stage-3 parameter all-gathers, issued or prefetched, including the waits for them.

So ``forward + backward + step`` is the step time, and ``reduce`` and ``gather`` say how much of
it was communication. On CPU the timers read the wall clock. On CUDA each interval is a pair of
CUDA events on the current stream, read (with one synchronisation) only when the figures are
asked for, so timing adds no host-device synchronisation to the step.

The engine creates timers only when the flag is on; every call site tests for ``None`` first, so
a run without the flag makes no timer calls at all.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

PHASES = ("forward", "backward", "reduce", "step", "gather")

# CUDA event pairs kept unread before they are folded into the totals (bounds host memory).
_MAX_PENDING_EVENTS = 512


@dataclass
class PhaseTotals:
    """Seconds and intervals of one phase: since the last reset (``seconds``, ``count``) and
    since the timers were created (``total_seconds``, ``total_count``)."""

    seconds: float = 0.0
    count: int = 0
    total_seconds: float = 0.0
    total_count: int = 0

    def add(self, seconds: float) -> None:
        self.seconds += seconds
        self.count += 1
        self.total_seconds += seconds
        self.total_count += 1

    def as_dict(self) -> dict[str, float | int]:
        return {"seconds": self.seconds, "count": self.count,
                "total_seconds": self.total_seconds, "total_count": self.total_count}


class PhaseTimers:
    """Accumulating timers for :data:`PHASES` (see [Note: what each phase covers]).

    ``start(name)`` / ``stop(name)`` bracket one interval. A phase started again while it runs
    (a stage-3 gather inside a gather-parameters block, say) is counted once, by its outermost
    pair.
    """

    def __init__(self, device: torch.device | str = "cpu", phases: tuple[str, ...] = PHASES) -> None:
        self.use_cuda_events = torch.device(device).type == "cuda"
        self.totals = {name: PhaseTotals() for name in phases}
        self._depth = {name: 0 for name in phases}
        self._started: dict[str, object] = {}
        self._pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    # ------------------------------------------------------------------ measuring
    def start(self, name: str) -> None:
        depth = self._depth[name]
        self._depth[name] = depth + 1
        if depth == 0:
            self._started[name] = self._mark()

    def stop(self, name: str) -> None:
        depth = self._depth[name]
        if depth == 0:
            raise RuntimeError(f"timer {name!r} was stopped without being started; call start({name!r}) first")
        self._depth[name] = depth - 1
        if depth > 1:
            return
        begin, end = self._started.pop(name), self._mark()
        if self.use_cuda_events:
            self._pending.append((name, begin, end))
            if len(self._pending) > _MAX_PENDING_EVENTS:
                self._fold_events()
        else:
            self.totals[name].add(end - begin)

    def _mark(self) -> float | torch.cuda.Event:
        if not self.use_cuda_events:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _fold_events(self) -> None:
        if not self._pending:
            return
        for name, begin, end in self._pending:
            end.synchronize()  # returns at once for all but the first still-running pair
            self.totals[name].add(begin.elapsed_time(end) / 1000.0)
        self._pending.clear()

    # ------------------------------------------------------------------ reading
    def as_dict(self) -> dict[str, dict[str, float | int]]:
        """``{phase: {"seconds", "count", "total_seconds", "total_count"}}``, in seconds."""
        self._fold_events()
        return {name: totals.as_dict() for name, totals in self.totals.items()}

    def reset(self) -> None:
        """Start a new window: ``seconds`` and ``count`` go to zero; the totals keep counting."""
        self._fold_events()
        for totals in self.totals.values():
            totals.seconds, totals.count = 0.0, 0

    def format(self, per: int = 1) -> str:
        """``"forward 12.3ms backward 20.1ms ..."``: each phase's window time divided by ``per``
        (the number of optimizer steps in the window, for per-step figures)."""
        per = max(1, per)
        return " ".join(f"{name} {1000.0 * t['seconds'] / per:.1f}ms" for name, t in self.as_dict().items())
