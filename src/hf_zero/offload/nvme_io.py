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
this thread backend does not have: they are accepted and do nothing.

[Note: direct I/O]
The step's tile reads and writes bypass the page cache (``O_DIRECT``), as DeepSpeed's libaio
swapper does: a page-cached state file would fill the host's memory with a copy of the optimizer
state that the drive already holds, and evict what the host needs. Direct I/O wants the buffer
address, the file offset and the length aligned (``DIRECT_ALIGNMENT``, 4 KiB: a drive's logical
block at most): tiles start at multiples of 1024 fp32 elements (``sub_group_size`` is rounded up
to one), each file is padded to a whole block, the tile buffers are allocated aligned
(:func:`aligned_empty`), the last tile of a file moves whole blocks (its tail is padding) and
requests are cut into blocks of a multiple of 4 KiB. The other reads and writes (loading a
checkpoint into the files, saving one, the undo copies) are few and at any offset: they use a
second, buffered descriptor of the same file, which the kernel keeps coherent with the direct one
(a direct read writes dirty cached pages back first, a direct write drops the cached pages it
overwrites). A filesystem that refuses ``O_DIRECT`` (at open, or at a first aligned write) gets
buffered I/O throughout, logged once.
"""

from __future__ import annotations

import logging
import mmap
import os
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass

import torch

logger = logging.getLogger("hf_zero")

DIRECT_ALIGNMENT = 4096  # bytes: [Note: direct I/O]
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_logged_fallback: list[str] = []


@dataclass(frozen=True)
class AioSettings:
    """The ``aio`` section, as the NVMe optimizer store uses it."""

    block_size: int = 1 << 20  # bytes per block of a request
    threads: int = 1  # intra_op_parallelism: threads that move one request's blocks
    pipeline: bool = False  # offload_optimizer.pipeline_read / pipeline_write: overlap tiles
    direct: bool = True  # the step's tiles past the page cache where allowed: [Note: direct I/O]


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
        if self.settings.direct:  # every block starts aligned: [Note: direct I/O]
            size = aligned_up(size, DIRECT_ALIGNMENT)
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


def aligned_up(count: int, alignment: int) -> int:
    return -(-count // alignment) * alignment


def aligned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised host tensor whose data starts at a ``DIRECT_ALIGNMENT`` boundary and whose
    byte length is a whole number of blocks ([Note: direct I/O]); views of it keep it alive."""
    nbytes = aligned_up(max(1, numel) * dtype.itemsize, DIRECT_ALIGNMENT)
    raw = torch.empty(nbytes + DIRECT_ALIGNMENT, dtype=torch.uint8)
    skip = -raw.data_ptr() % DIRECT_ALIGNMENT
    return raw[skip:skip + nbytes].view(dtype)[:numel]


def open_direct(path: str, what: str) -> int | None:
    """A second descriptor of ``path`` that bypasses the page cache, or None where the filesystem
    refuses it (logged once per reason): [Note: direct I/O]. A first aligned write of zeros over
    the file's start proves it: some filesystems accept the flag at open and refuse the I/O."""
    if not _O_DIRECT:
        return _refused(what, "this platform has no O_DIRECT")
    try:
        fd = os.open(path, os.O_RDWR | _O_DIRECT)
    except OSError as exc:
        return _refused(what, f"opening {path} with O_DIRECT failed ({exc.strerror})")
    probe = mmap.mmap(-1, DIRECT_ALIGNMENT)  # page-aligned and zero
    try:
        if os.path.getsize(path) >= DIRECT_ALIGNMENT:
            os.pwrite(fd, probe, 0)
    except OSError as exc:
        os.close(fd)
        return _refused(what, f"an O_DIRECT write to {path} failed ({exc.strerror})")
    finally:
        probe.close()
    return fd


def _refused(what: str, reason: str) -> None:
    if reason not in _logged_fallback:
        _logged_fallback.append(reason)
        logger.warning("hf_zero: %s goes through the page cache: %s", what, reason)
    return None
