"""The unit buffers the engine churns (gathered parameters, full gradients), owned by the engine.

[Note: the buffer pool]
Under stage 3 each unit's full parameters are allocated for its forward and again for its
backward, and its full gradients for its backward; stages 1-2 allocate every unit's full
gradients in each backward ([Note: views into flat buffers] in param_storage.py). On a GPU the
CUDA caching allocator reuses such blocks, which is what FSDP2 and DeepSpeed rely on. The host
has no such allocator: glibc either maps each large block fresh, zero-filled page by page on
first touch, or serves it from its heap, which then grows by a step's worth of buffers and keeps
them (a 33M Llama at stage 3 climbed from 984 to 1305 MB per rank over 8 steps). So on the CPU
the engine owns those buffers, and never changes the process's allocator:

- Each buffer is an anonymous mapping of its own, outside malloc's heap: when the pool lets one
  go it is unmapped, so the memory really goes back and the heap the user's code allocates
  from (activations, batches) is not fragmented by unit buffers.
- Sizes that several groups need (the decoder layers') are *reusable*: a freed buffer of such a
  size waits idle and the next unit of that size takes it, its pages already touched. A size
  that one group alone has (the embeddings, the head, the root), even for both its parameters
  and its gradients, is mapped for the use and unmapped after: kept, a head's parameter buffer
  would sit idle through the whole backward of the layers.
- Idle buffers are let go at the phase boundaries after which nothing takes them: when the
  forward has passed its last unit (the root's head and loss follow, whose logits are the
  step's largest activations, and kept buffers would sit idle beside them: a pool without this
  raised a Trainer peak from 0.73x to 0.79x DDP's), at the end of the backward (the optimizer
  step follows), and at the end of ``initialize``. Between boundaries the idle bytes are bounded
  by what the schedule can free before it allocates again: the prefetch bucket plus, per size,
  a unit's parameters, the next unit's, and the gradients of the buckets in flight.
- [Note: the buffer pool in the backward] A size two groups share is not always taken again:
  an untied head and the embedding have the same shape, but the embedding's backward gathers
  nothing and its gradient is autograd's own ([Note: a gradient autograd hands over] in
  grad_buffer.py). So when a unit is released in the backward, the idle buffers of every size
  that no later unit of the backward takes are let go (``release_idle(keep=...)``, the sizes
  computed once from the backward order): the head's parameter buffer was kept through the
  layers' and the embedding's backward, 1002 MiB per rank at the Llama-3-8B shape.
- Autograd's saved tensors and every ``.grad`` view refer to the flat buffer's storage object,
  so a buffer moves in and out of that object by swapping data pointers
  (``UntypedStorage._swap_data_ptr_``); the tensors never change.

On a GPU the pool hands every request to the caching allocator (resize the storage), which
already is this pool, and knows the streams.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Collection

import torch

from hf_zero.execution import poison_before_free
from hf_zero.host_memory import CAN_SWAP_STORAGE, mapped_storage


def storage_bytes(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().nbytes()


def free_storage(tensor: torch.Tensor) -> None:
    if storage_bytes(tensor) > 0:
        poison_before_free(tensor)  # [Note: late completion]: a stale alias reads poison
        tensor.untyped_storage().resize_(0)


def allocate_storage(tensor: torch.Tensor) -> bool:
    """Give a freed full-size tensor its storage back from the allocator that made it. Returns True if it was freed before."""
    needed = tensor.numel() * tensor.element_size()
    if storage_bytes(tensor) == needed:
        return False
    tensor.untyped_storage().resize_(needed)
    return True


class BufferPool:
    """Gives the full buffers of one engine's flat groups their memory ([Note: the buffer pool]).

    Groups call :meth:`register` with each buffer size they will churn, then :meth:`acquire` and
    :meth:`release` around each use; the unit protocol calls :meth:`release_idle` at phase
    boundaries."""

    def __init__(self, device: torch.device, prefetch_bytes: int = 0, buffers_in_flight: int = 0) -> None:
        self.device = device
        # On a GPU: the caching allocator; a torch that cannot swap a storage's memory runs on
        # glibc's allocator as is.
        self.owns_memory = device.type == "cpu" and CAN_SWAP_STORAGE
        self.prefetch_bytes = prefetch_bytes
        # Per reusable size, the buffers that may be freed before the next allocation of that size.
        self.idle_per_size = 2 + buffers_in_flight
        self._users: dict[int, set[int]] = defaultdict(set)  # ids of the groups that churn each size
        self._temporary_sizes: set[int] = set()  # sizes of buffers handed out by take()
        self._idle: dict[int, list[torch.UntypedStorage]] = defaultdict(list)
        self._mapped: dict[int, int] = {}  # data_ptr -> bytes of each mapping this pool made, in use or idle
        self._lock = threading.Lock()  # the overlapped optimizer step frees from a worker thread
        self.acquisitions = 0  # buffers handed out (statistics: how often a mapping was reused)
        self.mappings = 0  # of which freshly mapped
        self.temporaries = 0  # take() calls: reduction results that needed a buffer of their own

    # ----------------------------------------------------------------- sizes
    def register(self, nbytes: int, user: object) -> None:
        """``user`` (a flat group) will churn a buffer of ``nbytes``."""
        self._users[nbytes].add(id(user))

    def reusable(self, nbytes: int) -> bool:
        return len(self._users.get(nbytes, ())) > 1 or nbytes in self._temporary_sizes

    @property
    def idle_limit_bytes(self) -> int:
        largest = max((size for size in self._users if self.reusable(size)), default=0)
        return self.prefetch_bytes + self.idle_per_size * largest

    @property
    def idle_bytes(self) -> int:
        return sum(size * len(kept) for size, kept in self._idle.items())

    @property
    def mapped_bytes(self) -> int:
        """Host memory the pool holds: buffers in use and idle."""
        return sum(self._mapped.values())

    # ----------------------------------------------------------------- use
    def acquire(self, tensor: torch.Tensor) -> bool:
        """Give the freed flat buffer ``tensor`` (a whole storage, from offset 0) its memory back.
        Returns True if it was freed before; the contents are undefined."""
        needed = tensor.numel() * tensor.element_size()
        if not self.owns_memory or needed == 0 or storage_bytes(tensor) == needed:
            return allocate_storage(tensor)
        # The storage object stays: views and saved tensors hold it.
        tensor.untyped_storage()._swap_data_ptr_(self._buffer(needed))
        return True

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A new flat tensor for a temporary the engine makes for every unit (a reduction's
        output); :meth:`give_back` returns it. Its contents are undefined."""
        nbytes = numel * dtype.itemsize
        self.temporaries += 1
        if not self.owns_memory or nbytes == 0:
            return torch.empty(numel, dtype=dtype, device=self.device)
        with self._lock:
            self._temporary_sizes.add(nbytes)
        return torch.empty(0, dtype=dtype).set_(self._buffer(nbytes), 0, (numel,))

    def give_back(self, temporary: torch.Tensor) -> None:
        """The end of a :meth:`take` tensor's use. On a GPU the reference is simply dropped: the
        caching allocator frees it when no stream needs it any more."""
        if self.owns_memory:
            self.release(temporary)

    def _buffer(self, nbytes: int) -> torch.UntypedStorage:
        """An idle buffer of ``nbytes``, or a fresh mapping."""
        with self._lock:
            self.acquisitions += 1
            kept = self._idle.get(nbytes)
            if kept:
                return kept.pop()
            buffer = mapped_storage(nbytes)
            self._mapped[buffer.data_ptr()] = nbytes
            self.mappings += 1
            return buffer

    def release(self, tensor: torch.Tensor) -> None:
        """``tensor``'s storage gives its memory up: kept idle for the next unit of its size, or
        unmapped (or freed to the allocator that made it)."""
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0 or storage.data_ptr() not in self._mapped:  # made by the allocator (construction, a GPU)
            free_storage(tensor)
            return
        poison_before_free(tensor)  # [Note: late completion]: a stale alias reads poison
        with self._lock:
            holder = torch.UntypedStorage(0)
            holder._swap_data_ptr_(storage)  # the storage is empty again; the holder has the buffer
            if self.reusable(nbytes) and len(self._idle[nbytes]) < self.idle_per_size \
                    and self.idle_bytes + nbytes <= self.idle_limit_bytes:
                self._idle[nbytes].append(holder)
            else:
                del self._mapped[holder.data_ptr()]  # dropping the holder unmaps it

    def release_idle(self, keep: Collection[int] = ()) -> None:
        """A phase boundary: every idle buffer is unmapped, except those of the sizes in
        ``keep`` (what the rest of the phase will take again)."""
        with self._lock:
            for size in [size for size in self._idle if size not in keep]:
                for holder in self._idle.pop(size):
                    del self._mapped[holder.data_ptr()]
