"""Late completion: a checking mode in which every asynchronous operation completes as late as
it is allowed to.

[Note: late completion]
On a GPU, a collective on a side stream or a ``non_blocking`` copy finishes at some time
between its launch and the event its reader waits on; reading its output earlier, or writing
its input (or freeing it) before then, is a race that gives wrong numbers only sometimes and
only on a GPU. On the CPU with gloo such races hide too: gloo finishes small collectives before
anyone looks. Under ``HF_ZERO_CHECK_ASYNC=1`` (or :func:`checking`), hf_zero makes each of
them visible on any machine:

- the operation runs on private copies: its input is snapshotted at launch, its result goes to
  a private buffer;
- its real output is *poisoned* at launch (NaN, or all bits set for integers) and receives the
  result only when the completion is waited (``wait`` / ``wait_on_host``): whoever reads it
  before its wait reads poison, and the training run's numbers show it;
- at the wait, each input is compared bit for bit with its snapshot: an input written or freed
  while the operation was in flight is an :class:`AsyncOrderError` naming the operation;
- a buffer hf_zero frees is poisoned first (:func:`poison_before_free`), so a stale alias
  reads poison rather than the old values.

The real collective still runs asynchronously (on the snapshot), so ranks progress as they
would without the mode: two collectives in flight on different groups cannot deadlock because
of it. The distributed tests run under it (tests/distributed/conftest.py), and a test moves one
wait after the read it guards to show that it fails.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterator

import torch

from hf_zero.execution.completion import Completion

CHECK_ENV = "HF_ZERO_CHECK_ASYNC"

_forced: list[bool] = []


def _from_environment() -> bool:
    return os.environ.get(CHECK_ENV, "0").lower() not in ("", "0", "false", "no", "off")


# Read when hf_zero is imported and again by every hf_zero.initialize (read_environment), not at
# each of the hundreds of launches a step asks about it.
_from_env = [_from_environment()]


def read_environment() -> None:
    """Read ``HF_ZERO_CHECK_ASYNC`` again (``hf_zero.initialize`` does, for the engine it builds)."""
    _from_env[0] = _from_environment()


def late_completion() -> bool:
    """Whether [Note: late completion] is on."""
    if _forced:
        return _forced[-1]
    return _from_env[0]


@contextlib.contextmanager
def checking(enabled: bool = True) -> Iterator[None]:
    """Turn [Note: late completion] on (or off) inside the block, whatever the environment says."""
    _forced.append(enabled)
    try:
        yield
    finally:
        _forced.pop()


class AsyncOrderError(RuntimeError):
    """An input of an asynchronous operation changed, or was freed, while it was in flight."""


def poison_(tensor: torch.Tensor) -> None:
    """Fill ``tensor`` with values no correct computation reads: NaN, or all bits set."""
    if tensor.numel() == 0 or tensor.untyped_storage().nbytes() == 0:
        return
    with torch.no_grad():
        if tensor.is_floating_point() or tensor.is_complex():
            tensor.fill_(float("nan"))
        elif tensor.dtype == torch.bool:
            tensor.fill_(True)
        else:
            tensor.fill_(-1)


def poison_before_free(tensor: torch.Tensor) -> None:
    """Under [Note: late completion], poison a buffer about to be freed."""
    if late_completion():
        poison_(tensor)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads included), for any dtype."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.element_size() in (1, 2, 4, 8) and a.dtype != torch.bool:
        view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(view), b.contiguous().view(view))
    return torch.equal(a, b)


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a_lo, b_lo = a.data_ptr(), b.data_ptr()
    a_hi, b_hi = a_lo + a.numel() * a.element_size(), b_lo + b.numel() * b.element_size()
    return a_lo < b_hi and b_lo < a_hi


class LateCompletion:
    """The completion of an operation run on private copies; its effect lands at the wait."""

    def __init__(self, what: str, inner: Completion, output: torch.Tensor, result: torch.Tensor,
                 inputs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.what = what
        self.inner: Completion | None = inner
        self.output, self.result, self.inputs = output, result, inputs

    def wait(self, stream: Any = None) -> None:
        if self.inner is None:
            return
        self.inner.wait()
        self.inner = None
        for original, snapshot in self.inputs:
            if original.untyped_storage().nbytes() == 0:
                raise AsyncOrderError(
                    f"hf_zero: the input of {self.what} was freed while the operation was in flight; "
                    "free it only after the operation's completion was waited ([Note: late completion])")
            if not _same_bits(original, snapshot):
                raise AsyncOrderError(
                    f"hf_zero: the input of {self.what} was written while the operation was in flight; "
                    "on a GPU the operation could read the new values. Wait for its completion before "
                    "writing the input ([Note: late completion])")
        if self.output.untyped_storage().nbytes() == 0:
            raise AsyncOrderError(
                f"hf_zero: the output of {self.what} was freed before the operation's completion was waited")
        with torch.no_grad():
            self.output.copy_(self.result)
        self.inputs, self.result = [], self.output

    def wait_on_host(self) -> None:
        self.wait()

    def is_completed(self) -> bool:
        return self.inner is None  # as late as possible: done only once waited


def run_late(what: str, output: torch.Tensor, inputs: list[torch.Tensor],
             launch: Callable[[torch.Tensor, list[torch.Tensor]], Completion]) -> LateCompletion:
    """Launch an operation under [Note: late completion]: ``launch(private_output,
    input_snapshots)`` runs it on copies; ``output`` is poisoned until the returned completion is
    waited, and each input that does not overlap ``output`` is checked then."""
    snapshots = [t.detach().clone() for t in inputs]
    result = torch.empty_like(output)
    inner = launch(result, snapshots)
    checked = [(t, s) for t, s in zip(inputs, snapshots) if not _overlaps(t, output)]
    poison_(output)
    return LateCompletion(what, inner, output, result, checked)
