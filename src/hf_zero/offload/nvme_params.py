"""Stage-3 compute shards in files (``offload_param.device: "nvme"``), read through a bounded
pool of host buffers.

[Note: NVMe parameter offload]
Each sharded stage-3 flat group of a rank keeps its compute shard (compute dtype, one shard
long) in ``<nvme_path>/hf_zero-rank<r>-pid<pid>/params/<group label>.<dtype>``; the group's
``storage.shard`` is then an empty placeholder. The first groups whose shards fit in
``max_in_cpu`` elements (per rank, in model order) stay in host memory instead, exactly as with
``offload_param.device: "cpu"``.

- Gather (``ParamStorage.unshard``): the shard is read synchronously into one of
  ``buffer_count`` host buffers, then the all-gather is issued from that buffer, asynchronously
  when it is a prefetch. The buffer is handed back when the gather is waited for (at once on a
  GPU, where the shard is first copied to the device). When every buffer is held by a gather in
  flight, the oldest gather is waited for first, so at most ``buffer_count`` shards are in host
  memory at any time. Each buffer holds the largest file-backed shard; ``buffer_size`` is the
  ceiling (a larger shard is an error at ``initialize``).
- Update: after the optimizer step the new compute copy (the cast of the fp32 master, or of
  each NVMe optimizer tile) is written back to the file, through a transient host copy when it
  must be cast or copied off the device (not a pool buffer: the overlapped offload step writes
  from a worker thread, and the pool belongs to the gathers on the main thread). A file-backed
  group therefore always has a separate fp32 master, even with fp32 compute.
- The files are removed at a clean exit (or when the store is garbage-collected, or when
  ``initialize`` fails after creating them); a second engine in the same process gets its own
  ``params-<n>`` folder. A missing, read-only or too small ``nvme_path`` is an error before
  anything is written.
"""

from __future__ import annotations

import os
import re
import shutil
import weakref
from collections import OrderedDict
from typing import Callable, Iterator

import torch

from hf_zero.config.errors import ConfigProblem, HfZeroConfigError
from hf_zero.execution import DONE, Completion
from hf_zero.offload.nvme import byte_view, check_nvme_path
from hf_zero.offload.nvme_io import pread_all, pwrite_all
from hf_zero.transfer import to_compute_async

DTYPE_SUFFIX = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_UNSAFE = re.compile(r"[^A-Za-z0-9._#-]")


class SwapBufferPool:
    """``count`` host buffers of ``nbytes`` bytes. A holder that keeps a buffer beyond the call
    that took it (a gather in flight) registers how to make it give the buffer back."""

    def __init__(self, count: int, nbytes: int, pin: bool) -> None:
        # Staging buffers, not a host store: on a CPU-only machine the all-gather reads them in
        # place; on a GPU swap_in copies them to the device first.
        pinned = pin and torch.cuda.is_available()
        self.buffers = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned) for _ in range(count)]
        self.free = list(range(count))[::-1]
        self.holders: OrderedDict[int, Callable[[], None]] = OrderedDict()

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def acquire(self, reclaim: Callable[[], None]) -> int:
        """A free buffer's index; when none is free, ``reclaim`` of the oldest holder is called
        first (it waits for that gather, which releases its buffer)."""
        if not self.free and self.holders:
            self.holders[next(iter(self.holders))]()
        if not self.free:
            raise RuntimeError(
                f"all {len(self.buffers)} NVMe parameter swap buffers are in use and none could be "
                "reclaimed; raise zero_optimization.offload_param.buffer_count")
        index = self.free.pop()
        self.holders[index] = reclaim
        return index

    def view(self, index: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        return self.buffers[index].view(dtype)[:numel]

    def release(self, index: int) -> None:
        del self.holders[index]
        self.free.append(index)


def _remove_files(fds: dict[str, int], folder: str) -> None:
    for fd in fds.values():
        os.close(fd)
    fds.clear()
    shutil.rmtree(folder, ignore_errors=True)
    try:
        os.rmdir(os.path.dirname(folder))  # the rank folder, unless an optimizer store still uses it
    except OSError:
        pass


class NvmeShard:
    """One flat group's compute shard in a file: see [Note: NVMe parameter offload]."""

    def __init__(self, store: NvmeParamStore, path: str, fd: int, numel: int, dtype: torch.dtype) -> None:
        self.store = store
        self.path = path
        self.fd = fd
        self.numel = numel
        self.dtype = dtype
        self._held: int | None = None  # the pool buffer a gather in flight reads
        self._copy: Completion = DONE  # the copy out of that buffer to the GPU
        self._placeholder: torch.Tensor | None = None

    location = "nvme"  # a shard store: see [Note: shard stores] in hf_zero.offload.shard_store

    @property
    def file_bytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def placeholder(self) -> torch.Tensor:
        """What the group keeps as its ``storage.shard`` while the values are in the file."""
        return torch.empty(0, dtype=self.dtype)

    @property
    def tensor(self) -> torch.Tensor:
        if self._placeholder is None:
            self._placeholder = self.placeholder()
        return self._placeholder

    def gather_input(self, device: torch.device, reclaim: Callable[[], None]) -> tuple[torch.Tensor, Completion]:
        return self.swap_in(device, reclaim)

    def gather_done(self) -> None:
        self.release()

    # ----------------------------------------------------------------- raw file access
    def _pwrite(self, start: int, values: torch.Tensor) -> None:
        pwrite_all(self.fd, byte_view(values), start * self.dtype.itemsize, self.path)

    def read_into(self, out: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Elements [start, start + out.numel()) of the shard into the host tensor ``out``."""
        pread_all(self.fd, byte_view(out), start * self.dtype.itemsize, self.path)
        return out

    # ----------------------------------------------------------------- whole-shard and tiled access
    def write(self, values: torch.Tensor, start: int = 0) -> None:
        """New values (any dtype, any device) for elements [start, start + values.numel()).

        Values that must be cast or copied off the device go through a transient host copy, not
        the pool: the overlapped offload step writes from its worker thread while the backward
        gathers through the pool on the main thread (see [Note: overlapped offload step])."""
        values = values.detach().reshape(-1)
        if values.device.type != "cpu" or values.dtype != self.dtype or not values.is_contiguous():
            values = values.to("cpu", self.dtype).contiguous()  # at most one shard, transient
        self._pwrite(start, values)

    def read(self) -> torch.Tensor:
        """The whole shard, in a new host tensor."""
        return self.read_into(torch.empty(self.numel, dtype=self.dtype))

    def iter_tiles(self, tile_numel: int) -> Iterator[torch.Tensor]:
        """The shard in tiles of at most ``tile_numel`` elements; each tile is valid until the
        next one is produced (one reused buffer)."""
        buffer = torch.empty(max(1, min(tile_numel, self.numel)), dtype=self.dtype)
        for lo in range(0, self.numel, buffer.numel()):
            yield self.read_into(buffer[: min(buffer.numel(), self.numel - lo)], lo)

    # ----------------------------------------------------------------- the gather
    def swap_in(self, device: torch.device, reclaim: Callable[[], None]) -> tuple[torch.Tensor, Completion]:
        """The shard read into a pool buffer (or, on a GPU, copied on to ``device`` from one on
        the copy-in stream), ready to be the input of the all-gather, and the completion of that
        copy. ``reclaim`` finishes that gather; the pool calls it when it needs the buffer back.
        Pair with :meth:`release`."""
        pool = self.store.pool
        index = pool.acquire(reclaim)
        try:
            shard = self.read_into(pool.view(index, self.dtype, self.numel))
        except BaseException:
            pool.release(index)
            raise
        self._held = index
        if device.type == "cpu":
            self._copy = DONE
            return shard, DONE
        copied, self._copy = to_compute_async(shard, device)
        return copied, self._copy

    def release(self) -> None:
        """The gather that read the buffer of :meth:`swap_in` is done. Idempotent. The host
        reads the next file into the buffer, so it first waits for the copy out of it (a stream
        dependency of the gather is not enough for a host write)."""
        if self._held is not None:
            self._copy.wait_on_host()
            index, self._held, self._copy = self._held, None, DONE
            self.store.pool.release(index)


class NvmeParamStore:
    """The files of one rank's file-backed compute shards, and the pool of host buffers they are
    read through; see [Note: NVMe parameter offload]."""

    def __init__(self, nvme_path: str | None, rank: int, buffer_count: int, buffer_numel: int,
                 max_in_cpu: int, pin_memory: bool, needed_bytes: int) -> None:
        check_nvme_path(nvme_path, needed_bytes, what="the offloaded parameter shards of this rank")
        rank_dir = os.path.join(str(nvme_path), f"hf_zero-rank{rank}-pid{os.getpid()}")
        self.dir = os.path.join(rank_dir, "params")
        suffix = 0
        while os.path.exists(self.dir):  # a second engine in this process gets its own folder
            suffix += 1
            self.dir = os.path.join(rank_dir, f"params-{suffix}")
        os.makedirs(self.dir)
        self.buffer_count = buffer_count
        self.buffer_numel = buffer_numel
        self.max_in_cpu = max_in_cpu
        self.pin_memory = pin_memory
        self.cached_numel = 0  # elements kept in host memory under max_in_cpu
        self.shards: list[NvmeShard] = []
        self._pool: SwapBufferPool | None = None
        self._fds: dict[str, int] = {}
        self._finalizer = weakref.finalize(self, _remove_files, self._fds, self.dir)

    @property
    def file_bytes(self) -> int:
        return sum(s.file_bytes for s in self.shards)

    @property
    def buffer_bytes(self) -> int:
        return self._pool.nbytes if self._pool is not None else 0

    @property
    def pool(self) -> SwapBufferPool:
        if self._pool is None:
            raise RuntimeError("NvmeParamStore.allocate_buffers() must run before shards are read")
        return self._pool

    def register(self, label: str, shard: torch.Tensor) -> NvmeShard | None:
        """Take a group's compute shard: None when it stays in host memory (within
        ``max_in_cpu``), else the handle of the file it will be written to (by the group, with
        :meth:`NvmeShard.write`, once its fp32 master exists)."""
        if self._pool is not None:
            raise RuntimeError("shards must be registered before NvmeParamStore.allocate_buffers()")
        if self.cached_numel + shard.numel() <= self.max_in_cpu:
            self.cached_numel += shard.numel()
            return None
        dtype = shard.dtype
        name = _UNSAFE.sub("_", label) + "." + DTYPE_SUFFIX.get(dtype, str(dtype).removeprefix("torch."))
        path = os.path.join(self.dir, name)
        if path in self._fds:
            raise ValueError(f"two flat groups are both labelled {label!r}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self._fds[path] = fd
        handle = NvmeShard(self, path, fd, shard.numel(), dtype)
        self.shards.append(handle)
        return handle

    def allocate_buffers(self) -> None:
        """Once every group is registered: check ``buffer_size`` and allocate the pool (each
        buffer the size of the largest file-backed shard)."""
        largest = max(self.shards, key=lambda s: s.file_bytes, default=None)
        if largest is not None and largest.numel > self.buffer_numel:
            raise HfZeroConfigError([ConfigProblem(
                "zero_optimization.offload_param.buffer_size", self.buffer_numel,
                f"each NVMe swap buffer must hold a whole parameter shard, and {largest.path} holds "
                f"{largest.numel} elements", f"set buffer_size to at least {largest.numel}")])
        nbytes = largest.file_bytes if largest is not None else 0
        self._pool = SwapBufferPool(self.buffer_count if largest is not None else 0, nbytes, self.pin_memory)

    def close(self) -> None:
        self._finalizer()
