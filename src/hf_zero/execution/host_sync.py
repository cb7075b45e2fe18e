"""Counting host synchronisations: the calls that make the host wait for the compute device.

[Note: host synchronisations]
On a GPU, every read of a device value on the host (``.item()``, ``.tolist()``, ``bool(t)``,
``float(t)``, a copy to pageable host memory, ``nonzero``, whose output size depends on the
values) and every copy of a Python list onto the device (``torch.tensor(values,
device=cuda)``, staged through pageable memory, which CUDA synchronises) blocks the host until
the GPU has run everything queued before it. The GPU then idles until the host queues more: a
step with such calls is split into phases that cannot borrow slack from one another, and is
paced by the host. ``torch.cuda.set_sync_debug_mode("error")`` turns them into errors on a GPU.

:class:`HostSyncCounter` counts the same calls on any machine, so that a CPU-only test can pin
that a steady-state step makes none. While it is active it wraps those methods of
``torch.Tensor`` and those functions of ``torch`` (on every thread: autograd runs the backward's
hooks where a torch function mode is not seen), and counts a call when

- it reads the values of a tensor on the compute device: on a GPU, any CUDA tensor; on the CPU,
  where host and compute memory are one, any tensor that is not registered as host memory
  (``hf_zero.transfer.mark_host``: the host side's own buffers, such as the phase check-ins'
  exchange over the host group, which are host tensors on a GPU run too);
- or it builds a tensor on the compute device from Python data (``torch.tensor(values,
  device=...)`` with the compute device passed).

Each counted call is recorded with the first frame outside torch that made it, and whether
that frame is hf_zero's own (``engine``) or someone else's (the model, the training loop).

Two things are not reads of a tensor and are counted by name instead:

- a host wait for device work just queued, which reads a host buffer the counter cannot tell
  from any other (a reported value read right after the step that computes it, [Note: a step
  the host does not wait for] in hf_zero.engine.optim.step_pipeline): the code that waits calls
  :func:`waited_for_device`;
- the CPU backend of ``hf_zero.kernels`` is host code: on the CPU, the tensors it reads were
  written by CPU kernels that have finished (CPU ops are synchronous, there is no queue to
  drain), and on a GPU run it only ever sees host memory (offloaded shards), so the values it
  reads (whether a norm is finite, [Note: step factors]) wait for nothing. It runs inside
  :func:`host_code`, and nothing else does.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

# Methods of torch.Tensor that read the values on the host.
_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "__complex__", "cpu", "numpy",
          "nonzero", "equal", "allclose", "unique", "masked_select")
# Functions of torch that do the same, and those that build a tensor from Python data.
_READ_FUNCTIONS = ("equal", "allclose", "nonzero", "unique", "masked_select")
_FACTORIES = ("tensor", "as_tensor")

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../hf_zero
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_THIS_FILE = os.path.abspath(__file__)
_ACTIVE: list["HostSyncCounter"] = []
_LOCK = threading.Lock()
_HOST_CODE = threading.local()  # .depth > 0 inside host_code() on this thread


@contextlib.contextmanager
def host_code() -> Iterator[None]:
    """Host code over host memory (the kernels' CPU backend): its reads are not counted (see
    [Note: host synchronisations])."""
    _HOST_CODE.depth = getattr(_HOST_CODE, "depth", 0) + 1
    try:
        yield
    finally:
        _HOST_CODE.depth -= 1


def waited_for_device(what: str) -> None:
    """The host waits for device work it has just queued (see [Note: host synchronisations]):
    counted as one synchronisation by the active counter, if any."""
    if _ACTIVE and not getattr(_HOST_CODE, "depth", 0):
        _ACTIVE[0]._record(f"wait({what})")


@dataclass(frozen=True)
class HostSync:
    """One counted call: what it was and where it came from."""

    call: str
    where: str  # "path:line" of the first frame outside torch
    engine: bool  # that frame is inside hf_zero


@dataclass
class HostSyncCounter:
    """Counts [Note: host synchronisations] while active (``with HostSyncCounter(device) as c:``).
    One at a time per process."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    syncs: list[HostSync] = field(default_factory=list)
    _restore: list[tuple[Any, str, Any]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)

    def __enter__(self) -> "HostSyncCounter":
        with _LOCK:
            if _ACTIVE:
                raise RuntimeError("hf_zero: a HostSyncCounter is already counting in this process")
            _ACTIVE.append(self)
        for name in _READS:
            self._wrap(torch.Tensor, name, self._read_wrapper)
        self._wrap(torch.Tensor, "to", self._to_wrapper)
        for name in _READ_FUNCTIONS:
            self._wrap(torch, name, self._read_wrapper)
        for name in _FACTORIES:
            self._wrap(torch, name, self._factory_wrapper)
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, original in reversed(self._restore):
            if original is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._restore.clear()
        with _LOCK:
            _ACTIVE.remove(self)

    def _wrap(self, owner: Any, name: str, make: Callable[[str, Callable], Callable]) -> None:
        original = owner.__dict__.get(name, _ABSENT) if isinstance(owner, type) else getattr(owner, name)
        current = getattr(owner, name)
        self._restore.append((owner, name, original))
        setattr(owner, name, make(name, current))

    def _read_wrapper(self, name: str, original: Callable) -> Callable:
        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if args and _on_device(args[0], self.device):
                self._record(name)
            return original(*args, **kwargs)

        return wrapper

    def _to_wrapper(self, name: str, original: Callable) -> Callable:
        @functools.wraps(original)
        def wrapper(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if _on_device(tensor, self.device) and _to_host(args, kwargs, self.device):
                self._record("to(cpu)")
            return original(tensor, *args, **kwargs)

        return wrapper

    def _factory_wrapper(self, name: str, original: Callable) -> Callable:
        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            data = args[0] if args else kwargs.get("data")
            if _compute_device(kwargs.get("device"), self.device) and not isinstance(data, torch.Tensor):
                self._record(f"{name}(device={self.device.type})")
            return original(*args, **kwargs)

        return wrapper

    def _record(self, call: str) -> None:
        if getattr(_HOST_CODE, "depth", 0):
            return
        frame = sys._getframe(2)
        while frame is not None and (frame.f_code.co_filename.startswith(_TORCH_DIR)
                                     or os.path.abspath(frame.f_code.co_filename) == _THIS_FILE):
            frame = frame.f_back
        path = frame.f_code.co_filename if frame is not None else "?"
        line = frame.f_lineno if frame is not None else 0
        self.syncs.append(HostSync(call, f"{path}:{line}", os.path.abspath(path).startswith(_PACKAGE_DIR)))

    # ------------------------------------------------------------------ reporting
    @property
    def engine_syncs(self) -> list[HostSync]:
        return [s for s in self.syncs if s.engine]

    def by_place(self, engine_only: bool = True) -> dict[str, int]:
        """``"call at path:line" -> count``, most frequent first."""
        counted = Counter(f"{s.call} at {_short(s.where)}" for s in self.syncs if s.engine or not engine_only)
        return dict(counted.most_common())

    def reset(self) -> None:
        self.syncs.clear()


_ABSENT = object()


def _on_device(tensor: Any, device: torch.device) -> bool:
    """Reading ``tensor`` on the host waits for ``device``: see [Note: host synchronisations]."""
    if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
        return False
    if tensor.device.type != "cpu":
        return True
    if device.type != "cpu":
        return False  # a host tensor on a GPU run
    from hf_zero.transfer import is_host_store

    try:
        return not is_host_store(tensor)
    except RuntimeError:  # a wrapper subclass (a DTensor) has no storage of its own: its values are read
        return True


def _compute_device(requested: Any, device: torch.device) -> bool:
    if requested is None:
        return False
    requested = torch.device(requested)
    return requested.type == device.type and requested.type != "meta"


def _to_host(args: tuple, kwargs: dict, device: torch.device) -> bool:
    """Whether ``tensor.to(*args, **kwargs)`` copies a device tensor to the host."""
    if device.type == "cpu":
        return False  # on the CPU, .to(cpu) is the tensor itself
    target = kwargs.get("device", args[0] if args else None)
    if isinstance(target, (str, torch.device)):
        return torch.device(target).type == "cpu"
    return False


def _short(path_line: str) -> str:
    path, _, line = path_line.rpartition(":")
    if os.path.abspath(path).startswith(_PACKAGE_DIR):
        path = "hf_zero" + os.path.abspath(path)[len(_PACKAGE_DIR):]
    return f"{path}:{line}"
