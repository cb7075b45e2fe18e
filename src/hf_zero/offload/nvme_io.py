"""Reads and writes of the NVMe state files, in blocks, on I/O threads.

[Note: NVMe I/O]
A request (one tile of one state file) is cut into blocks of ``aio.block_size`` bytes that
``aio.intra_op_parallelism`` threads (``aio.thread_count``, its older spelling) read or write
with ``os.preadv`` / ``os.pwrite``, which release the GIL: several blocks are in the drive's
queue at once, and the host computes while they move. A request returns at once with an
:class:`IoRequest`; ``wait()`` is where its completion, or the first error of any of its blocks
(a short read, a full disk), reaches the caller, so an I/O error is raised by the step that
needs the data, never lost on a thread.

With ``offload_optimizer.pipeline_read`` / ``pipeline_write`` (DeepSpeed's keys; ``pipeline``
sets both) the optimizer step keeps two sets of tile buffers: the next tile's three states are
read while the current tile steps, and the current tile's states are written while the next one
steps ([Note: NVMe optimizer offload] in nvme.py). Without them a tile's reads and writes are
waited for before the step goes on, with one set of buffers, as DeepSpeed does.

``aio.queue_depth``, ``single_submit`` and ``overlap_events`` tune libaio's submission, which
this thread backend does not have: they are accepted and do nothing. The files go through the
page cache (no ``O_DIRECT``).
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass


@dataclass(frozen=True)
class AioSettings:
    """The ``aio`` section, as the NVMe optimizer store uses it."""

    block_size: int = 1 << 20  # bytes per block of a request
    threads: int = 1  # intra_op_parallelism: threads that move one request's blocks
    pipeline: bool = False  # offload_optimizer.pipeline_read / pipeline_write: overlap tiles


class IoRequest:
    """One read or write of a byte range, in flight until :meth:`wait`."""

    def __init__(self, futures: list[Future], what: str) -> None:
        self._futures = futures
        self.what = what

    def wait(self) -> None:
        """Every block has moved (or failed); the first failed block's error is raised here."""
        futures_wait(self._futures)
        errors = [f.exception() for f in self._futures if f.exception() is not None]
        if errors:
            raise errors[0]


class FileIo:
    """The I/O threads of one NVMe optimizer store ([Note: NVMe I/O])."""

    def __init__(self, settings: AioSettings) -> None:
        self.settings = settings
        self._pool = ThreadPoolExecutor(max_workers=max(1, settings.threads), thread_name_prefix="hf_zero-nvme-io")

    def read(self, fd: int, view: memoryview, offset: int, path: str) -> IoRequest:
        """Fill ``view`` from byte ``offset`` of ``fd``."""
        return IoRequest([self._pool.submit(pread_all, fd, view[lo:hi], offset + lo, path)
                          for lo, hi in self._blocks(view.nbytes)], f"read {path}")

    def write(self, fd: int, data: memoryview, offset: int, path: str) -> IoRequest:
        """Write all of ``data`` at byte ``offset`` of ``fd``."""
        return IoRequest([self._pool.submit(pwrite_all, fd, data[lo:hi], offset + lo, path)
                          for lo, hi in self._blocks(data.nbytes)], f"write {path}")

    def _blocks(self, nbytes: int) -> list[tuple[int, int]]:
        size = max(1, self.settings.block_size)
        return [(lo, min(nbytes, lo + size)) for lo in range(0, nbytes, size)] or [(0, 0)]

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def pwrite_all(fd: int, data: memoryview, offset: int, path: str) -> None:
    """All of ``data`` at byte ``offset`` (Linux moves at most 2 GiB - 4 KiB per call)."""
    done = 0
    while done < data.nbytes:
        written = os.pwrite(fd, data[done:], offset + done)
        if written <= 0:
            raise OSError(f"short write to {path}: {done} of {data.nbytes} bytes at byte {offset} (disk full?)")
        done += written


def pread_all(fd: int, view: memoryview, offset: int, path: str) -> None:
    """Fill ``view`` from byte ``offset`` (a file shorter than that is an error)."""
    done = 0
    while done < view.nbytes:
        read = os.preadv(fd, [view[done:]], offset + done)
        if read <= 0:
            raise OSError(f"short read from {path}: {done} of {view.nbytes} bytes at byte {offset} "
                          "(the file was truncated or replaced while training)")
        done += read
