"""fp32 master weights and Adam moments in files, streamed through a few tile buffers.

[Note: NVMe optimizer offload]
Each trainable flat group of a rank has three files (master, exp_avg, exp_avg_sq; fp32, one
shard long) in ``<nvme_path>/hf_zero-rank<r>-pid<pid>/``. The step walks each group in tiles of
``sub_group_size`` elements: read the three tiles into three reusable buffers, run the fused Adam
kernel on them with the (in-memory) fp32 gradient tile, write the updated compute copy straight
into the rank's parameter shard, and write the three tiles back. Resident memory for the
optimizer is therefore three tiles (six with ``pipeline_read``/``pipeline_write``, which read the
next tile and write the last while a tile steps), whatever the model's size. Files are read and
written with ``os.preadv`` / ``os.pwrite`` on I/O threads ([Note: NVMe I/O] in nvme_io.py),
past the page cache where the filesystem allows ([Note: direct I/O] there). The
folder is removed at a clean exit; a missing, read-only or too small ``nvme_path`` is an error
before anything is written.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import logging
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from hf_zero.offload.nvme_io import (DIRECT_ALIGNMENT, AioSettings, FileIo, IoRequest, aligned_empty, aligned_up,
                                     open_direct, pread_all, pwrite_all)
from hf_zero.processes import pid_alive

logger = logging.getLogger("hf_zero")

STATES = ("master", "exp_avg", "exp_avg_sq")


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, writable, for ``os.pwrite`` / ``os.preadv``.
    Not through numpy: ``Tensor.numpy()`` marks the storage non-resizable for good, and the
    stage-3 flat buffers must stay resizable (see [Note: views into flat buffers])."""
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError("byte_view needs a contiguous host tensor")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def format_bytes(count: int) -> str:
    """Bytes in the largest binary unit that keeps a figure above 1 (never "0.00 GiB")."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.2f} {unit}"
    return f"{count} bytes"


def ranks_on_this_machine() -> int:
    """How many ranks the launcher started on this machine (they share a local nvme_path)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def check_nvme_path(path: str | None, needed_bytes: int, what: str = "the optimizer state of this rank") -> None:
    """The path exists, is writable, and has room for this machine's ranks together: every rank
    on a machine writes the same amount there, so one rank's need times ``LOCAL_WORLD_SIZE``."""
    if not path:
        raise ValueError("offload device \"nvme\" needs zero_optimization.offload_*.nvme_path")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"nvme_path {path!r} does not exist or is not a directory; create it or point "
                                "nvme_path at a directory on the NVMe drive")
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(f"nvme_path {path!r} is not writable by this process; fix its permissions or choose another directory")
    report_stale_folders(path)
    free = shutil.disk_usage(path).free
    ranks = ranks_on_this_machine()
    if free < needed_bytes * ranks:
        together = f", {format_bytes(needed_bytes * ranks)} for the {ranks} ranks on this machine" if ranks > 1 else ""
        raise OSError(f"nvme_path {path!r} has {format_bytes(free)} free; {what} needs "
                      f"{format_bytes(needed_bytes)}{together}; free space or choose a larger drive")


_RANK_FOLDER = re.compile(r"^hf_zero-rank\d+-pid(\d+)$")


def report_stale_folders(path: str) -> list[str]:
    """Folders of hf_zero processes that no longer run on this machine (a killed run leaves its
    files). Reported, not removed: nvme_path may be shared with another machine, whose process
    ids mean nothing here."""
    stale = []
    for entry in os.listdir(path):
        match = _RANK_FOLDER.match(entry)
        if match and int(match.group(1)) != os.getpid() and not pid_alive(int(match.group(1))):
            stale.append(entry)
    if stale:
        size = sum(os.path.getsize(os.path.join(root, name)) for entry in stale
                   for root, _, names in os.walk(os.path.join(path, entry)) for name in names)
        logger.warning("hf_zero: nvme_path %s holds %d folder(s) of hf_zero runs whose process is gone (%s, %s): "
                       "if no other machine writes there, delete them to free the space", path, len(stale),
                       ", ".join(sorted(stale)[:5]), format_bytes(size))
    return stale


class NvmeOptimizerStore:
    """The NVMe half of the optimizer: see [Note: NVMe optimizer offload]."""

    def __init__(self, nvme_path: str | None, rank: int, shard_numels: list[int], tile_numel: int,
                 aio: AioSettings = AioSettings()) -> None:
        check_nvme_path(nvme_path, needed_bytes=sum(shard_numels) * 4 * len(STATES))
        self.dir = os.path.join(str(nvme_path), f"hf_zero-rank{rank}-pid{os.getpid()}")
        os.makedirs(self.dir, exist_ok=True)
        self.numels = shard_numels
        self.steps = [0] * len(shard_numels)
        # Per group, one step count per parameter once it has stepped ([Note: parameters no rank
        # used] in hf_zero.engine.sharding.param_usage); None: every parameter at ``steps``.
        self.slot_steps: list[list[int] | None] = [None] * len(shard_numels)
        self.tile_numel = max(1, min(tile_numel, max(shard_numels, default=1)))
        if aio.direct:  # tiles start on a block: [Note: direct I/O] in nvme_io.py
            self.tile_numel = aligned_up(self.tile_numel, DIRECT_ALIGNMENT // 4)
        # Per file: the buffered descriptor (any offset) and the step's, direct where allowed.
        self._buffered: dict[tuple[int, str], int] = {}
        self._fds: dict[tuple[int, str], int] = {}
        for index, numel in enumerate(shard_numels):
            for state in STATES:
                fd = os.open(self.path(index, state), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                os.ftruncate(fd, aligned_up(numel * 4, DIRECT_ALIGNMENT))  # zeros: the initial moments
                self._buffered[(index, state)] = fd
        self.direct = aio.direct and all(self._open_direct(key) for key in self._buffered)
        if not self.direct:
            for fd in {fd for key, fd in self._fds.items() if fd != self._buffered[key]}:
                os.close(fd)
            self._fds = dict(self._buffered)
        # One set of tile buffers, two when tiles overlap ([Note: NVMe I/O] in nvme_io.py).
        self._buffer_sets = [{s: aligned_empty(self.tile_numel, torch.float32) for s in STATES}
                             for _ in range(2 if aio.pipeline else 1)]
        self.io = FileIo(dataclasses.replace(aio, direct=self.direct))
        # The next group's first tile, read while the last tile of a group stepped.
        self._prefetch: _ReadAhead | None = None
        self._last_stepped: int | None = None  # the group stepped before: which way the groups go
        # What the step did, in order, when a test asks (a list of (event, tile start)); None: off.
        self.trace: list[tuple[str, int]] | None = None
        atexit.register(self.close)

    def _open_direct(self, key: tuple[int, str]) -> bool:
        fd = open_direct(self.path(*key), "the NVMe optimizer state")
        self._fds[key] = fd if fd is not None else self._buffered[key]
        return fd is not None

    def _io_view(self, buffer: torch.Tensor, numel: int) -> memoryview:
        """The first ``numel`` elements of a tile buffer as the step moves them: whole blocks
        under direct I/O (the tail past ``numel`` is the file's padding)."""
        if self.direct:
            numel = min(buffer.numel(), aligned_up(numel, DIRECT_ALIGNMENT // 4))
        return byte_view(buffer[:numel])

    def path(self, index: int, state: str) -> str:
        return os.path.join(self.dir, f"group{index:04d}.{state}.fp32")

    @property
    def file_bytes(self) -> int:
        return sum(self.numels) * 4 * len(STATES)

    def write(self, index: int, state: str, start: int, values: torch.Tensor) -> None:
        self._drop_prefetch()  # it may hold what this overwrites
        data = values.detach().to("cpu", torch.float32).contiguous()
        pwrite_all(self._buffered[(index, state)], byte_view(data), start * 4, self.path(index, state))

    def read_into(self, index: int, state: str, start: int, out: torch.Tensor) -> torch.Tensor:
        pread_all(self._buffered[(index, state)], byte_view(out), start * 4, self.path(index, state))
        return out

    def store_master(self, index: int, shard: torch.Tensor) -> None:
        for start in range(0, shard.numel(), self.tile_numel):
            self.write(index, "master", start, shard[start:start + self.tile_numel])

    def read(self, index: int, state: str, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of one state, in a new tensor."""
        return self.read_into(index, state, start, torch.empty(stop - start, dtype=torch.float32))

    def iter_tiles(self, index: int, state: str) -> Iterator[torch.Tensor]:
        """One state of group ``index`` in tiles of ``sub_group_size`` elements; each tile is
        valid until the next one is produced (one reused buffer)."""
        buffer = torch.empty(self.tile_numel, dtype=torch.float32)
        for start in range(0, self.numels[index], self.tile_numel):
            stop = min(self.numels[index], start + self.tile_numel)
            yield self.read_into(index, state, start, buffer[: stop - start])

    def step(self, index: int, grad: torch.Tensor, write_compute: Callable[[torch.Tensor, int], None],
             hyper: dict[str, Any], grad_scale: float, clip_coef: float,
             usage: tuple[list[Any], list[bool]] | None = None) -> None:
        """One Adam step of group ``index``, tile by tile; each updated master tile goes to
        ``write_compute(tile, start)`` (the group's ``storage.write_shard``). ``usage``: the
        shard's segments and which parameters some rank used (all, when None); tiles holding only
        unused parameters are neither read nor written."""
        from hf_zero.engine.sharding.param_usage import Segment, advanced_steps, step_runs
        from hf_zero.kernels import fused_adam_

        segments, used = usage or ([Segment(0, 0, self.numels[index])], [True])
        slot_steps = self.slot_steps[index] or [self.steps[index]] * len(used)
        self.slot_steps[index] = advanced_steps(slot_steps, used)
        self.steps[index] += 1
        runs = step_runs(segments, used, self.slot_steps[index])
        beta1, beta2 = hyper["betas"]
        tiles = []  # (start, stop, parts): the tiles holding a parameter some rank used
        for start in range(0, self.numels[index], self.tile_numel):
            stop = min(self.numels[index], start + self.tile_numel)
            parts = [(max(r.lo, start) - start, min(r.hi, stop) - start, r.step) for r in runs
                     if r.lo < stop and r.hi > start]
            if parts:
                tiles.append((start, stop, parts))
        sets = self._buffer_sets
        pipelined = len(sets) > 1
        offset, reads = 0, []  # tile ``number`` steps in buffer set (number + offset) % len(sets)
        prefetch, self._prefetch = self._prefetch, None
        if prefetch is not None and tiles and (prefetch.index, prefetch.start, prefetch.stop) == (index, *tiles[0][:2]):
            offset, reads = prefetch.buffer_set, prefetch.reads
        elif prefetch is not None:
            _wait(prefetch.reads, quietly=True)  # another tile than this step's first: not used
        if tiles and not reads:
            reads = self._read_tile(index, *tiles[0][:2], sets[offset])
        before, self._last_stepped = self._last_stepped, index
        writes: list[list[IoRequest]] = [[] for _ in sets]  # per buffer set: its writes in flight
        try:
            for number, (start, stop, parts) in enumerate(tiles):
                current = (number + offset) % len(sets)
                if not pipelined and number > 0:
                    reads = self._read_tile(index, start, stop, sets[current])
                _wait(reads)
                reads = []
                if pipelined:  # the next tile is read while this one steps
                    following = (number + 1 + offset) % len(sets)
                    if number + 1 < len(tiles):
                        _wait(writes[following])  # into the buffers of the tile before this one
                        reads = self._read_tile(index, *tiles[number + 1][:2], sets[following])
                    elif (upcoming := self._next_group(index, before)) is not None:  # the next group's first tile
                        _wait(writes[following])
                        self._prefetch_next(upcoming, following)
                self._note("step", start)
                buffers = {state: buffer[: stop - start] for state, buffer in sets[current].items()}
                for lo, hi, step in parts:
                    fused_adam_(
                        buffers["master"][lo:hi], grad[start + lo:start + hi], buffers["exp_avg"][lo:hi],
                        buffers["exp_avg_sq"][lo:hi],
                        lr=float(hyper["lr"]), beta1=beta1, beta2=beta2, eps=hyper["eps"],
                        weight_decay=hyper["weight_decay"], step=step,
                        adamw=hyper.get("decoupled_weight_decay", True), grad_scale=grad_scale, clip_coef=clip_coef,
                    )
                write_compute(buffers["master"], start)
                writes[current] = [self._write_tile(index, state, start, sets[current][state], stop - start)
                                   for state in STATES]
                if not pipelined:  # the next tile is read into these buffers
                    _wait(writes[0])
            for pending in writes:
                _wait(pending)
        except BaseException:  # no read or write may still be moving once the step has returned
            for pending in [*writes, reads]:
                _wait(pending, quietly=True)
            self._drop_prefetch()
            raise

    def _next_group(self, index: int, before: int | None) -> int | None:
        """The group likely to step after ``index`` (``before`` stepped before it): the next one,
        or the one before when the groups go backwards (the overlapped step takes them in the
        backward's order)."""
        following = index - 1 if before == index + 1 else index + 1
        return following if 0 <= following < len(self.numels) else None

    def _prefetch_next(self, index: int, slot: int) -> None:
        """Read group ``index``'s first tile into buffer set ``slot``, for its step to take."""
        stop = min(self.numels[index], self.tile_numel)
        self._note("prefetch", index)
        self._prefetch = _ReadAhead(index, 0, stop, slot, self._submit_reads(index, 0, stop, self._buffer_sets[slot]))

    def _drop_prefetch(self) -> None:
        if self._prefetch is not None:
            _wait(self._prefetch.reads, quietly=True)
            self._prefetch = None

    def _read_tile(self, index: int, start: int, stop: int, buffers: dict[str, torch.Tensor]) -> list[IoRequest]:
        self._note("read", start)
        return self._submit_reads(index, start, stop, buffers)

    def _submit_reads(self, index: int, start: int, stop: int, buffers: dict[str, torch.Tensor]) -> list[IoRequest]:
        return [self.io.read(self._fds[(index, state)], self._io_view(buffers[state], stop - start), start * 4,
                             self.path(index, state)) for state in STATES]

    def _write_tile(self, index: int, state: str, start: int, buffer: torch.Tensor, numel: int) -> IoRequest:
        self._note("write", start)
        return self.io.write(self._fds[(index, state)], self._io_view(buffer, numel), start * 4, self.path(index, state))

    def _note(self, event: str, start: int) -> None:
        if self.trace is not None:
            self.trace.append((event, start))

    # ---------------------------------------------------------- undo copies (overlapped step)
    def snapshot(self, index: int) -> tuple[tuple[int, list[int] | None], list[str]]:
        """Copies of group ``index``'s files and its step counts, for :meth:`restore`."""
        copies = []
        for state in STATES:
            copy = self.path(index, state) + ".undo"
            shutil.copyfile(self.path(index, state), copy)
            copies.append(copy)
        return (self.steps[index], self.slot_steps[index]), copies

    def restore(self, index: int, saved: tuple[tuple[int, list[int] | None], list[str]],
                write_compute: Callable[[torch.Tensor, int], None]) -> None:
        """Group ``index`` as :meth:`snapshot` copied it; the compute shard rewritten from the master."""
        steps, copies = saved
        buffer = torch.empty(self.tile_numel, dtype=torch.float32)
        for state, copy in zip(STATES, copies):  # a tile at a time: memory stays at one tile
            with open(copy, "rb") as src:
                for start in range(0, self.numels[index], self.tile_numel):
                    tile = buffer[: min(self.tile_numel, self.numels[index] - start)]
                    src.readinto(byte_view(tile))
                    self.write(index, state, start, tile)
        self.steps[index], self.slot_steps[index] = steps
        for start, tile in zip(range(0, self.numels[index], self.tile_numel), self.iter_tiles(index, "master")):
            write_compute(tile, start)
        self.drop_snapshot(saved)

    @staticmethod
    def drop_snapshot(saved: tuple[tuple[int, list[int] | None], list[str]]) -> None:
        for copy in saved[1]:
            with contextlib.suppress(OSError):
                os.remove(copy)

    def close(self) -> None:
        self._drop_prefetch()
        self.io.close()
        for (index, state), fd in self._buffered.items():
            os.close(fd)
            if self._fds[(index, state)] != fd:
                os.close(self._fds[(index, state)])
            try:
                os.remove(self.path(index, state))
            except OSError:
                pass
        self._fds.clear()
        self._buffered.clear()
        try:
            os.rmdir(self.dir)  # unless parameter files (offload_param nvme) still live in it
        except OSError:
            pass


@dataclass
class _ReadAhead:
    """A tile read before its group's step asked for it: elements [start, stop) of group
    ``index``'s three states, into buffer set ``buffer_set``."""

    index: int
    start: int
    stop: int
    buffer_set: int
    reads: list[IoRequest]


def _wait(requests: list[IoRequest], quietly: bool = False) -> None:
    """Every request has completed; its error is raised unless ``quietly`` (then the first error
    already on its way up is the one the caller sees)."""
    for request in requests:
        if quietly:
            with contextlib.suppress(Exception):
                request.wait()
        else:
            request.wait()

