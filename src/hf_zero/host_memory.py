"""Host memory kept for the whole run: the shards in mappings of their own, outside glibc's heap.

[Note: memory kept for the run]
A rank keeps some tensors for the whole run: its parameter shards, its gradient shards and its
optimizer's moments. glibc serves allocations under its mmap threshold (128 KiB at first, raised
to the size of each large block freed, up to 32 MiB) from one heap that only shrinks from the
top, so a block allocated there pins the pages around it. The gradient shards arrive in the
middle of the first backward, in the holes the freed activations left; every later step's
activations then have to fit around them, and the heap held hundreds of MB of free but resident
pages at the step's peak (measured on a 134M Llama through the Trainer at 2 ranks: 560 MB of the
heap's 1.4 GB free at the peak).

So on the CPU the parameter and gradient shards are allocated in an anonymous mapping of their own
(:func:`lasting_zeros`, from 1 MiB up: smaller ones would spend a mapping each on a few pages), and
the heap holds what a step allocates and frees. The optimizer's moments stay in the heap (hf_zero's
Adam makes them with ``torch.zeros_like``, as a torch optimizer does): they are made in the first
optimizer step, after the backward freed that step's activations, so in the heap they take pages
that are resident already, where a mapping of their own adds pages beside the freed ones until the
trim below. Both were measured on the three-size benchmark's GPT-2 and the Trainer's Llama: with
the moments in mappings too, the peak per rank was 1.5-2% higher at 5.3M and 29.5M (29.5M:
1280-1318 MiB against 1246-1267), and the Trainer's 0.70x DDP instead of 0.71x. Once, after the
first optimizer step, the engine hands the heap's free pages back ([Note: the heap after loading]):
the first step's freed activations would otherwise stay resident beside what no longer fills their
holes. That is a call, not a setting, and later allocations behave as glibc's defaults say. On a
GPU these tensors come from the device's caching allocator as before.

[Note: the heap after loading]
Loading leaves the heap full of free pages: sharded loading reads each rank's ranges through
temporaries interleaved with the shards it keeps, and glibc keeps the freed temporaries'
pages resident (about 800 MB per rank on a 134M Llama through the Trainer, where the shards
are 268 MB). Nothing after loading needs them back at once, so ``initialize`` hands the heap's
free pages back once, with ``malloc_trim(0)``, when it returns. That is a single call, not a
setting: later allocations behave as glibc's defaults say, in the user's code and in the
engine's.
"""

from __future__ import annotations

import ctypes
import mmap

import torch

# Below this a tensor stays in the heap: a mapping costs a kernel object and whole pages, and the
# process has a limit on how many it may have.
MIN_MAPPED_BYTES = 1 << 20

# Moving memory in and out of a storage object that views and autograd hold (the buffer pool,
# a gradient autograd hands over, a lent shard) swaps data pointers, a private method of torch's
# storages (torch 2.13 and 2.15 have it); a torch without it keeps that memory where it is.
CAN_SWAP_STORAGE = hasattr(torch.UntypedStorage, "_swap_data_ptr_")

# Mappings at least this large ask for transparent huge pages (Linux; elsewhere nothing).
HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)

# The attribute that marks a tensor as living in a mapping made here.
_LASTING = "_hf_zero_lasting"


def mapped_storage(nbytes: int) -> torch.UntypedStorage:
    """``nbytes`` of zeroed, page-aligned host memory in an anonymous mapping of its own; the
    mapping is unmapped when the returned storage's data is freed."""
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if nbytes >= HUGE_PAGE_BYTES and _MADV_HUGEPAGE is not None:
        # First touch zero-fills the whole mapping: in 2 MiB pages that is 2.4x faster than in
        # 4 KiB ones (13.5 MB: 1.5 ms instead of 3.7), where the kernel allows them ("madvise").
        region.madvise(_MADV_HUGEPAGE)
    return torch.frombuffer(region, dtype=torch.uint8).untyped_storage()


def lasting_storage(nbytes: int, device: torch.device | str) -> torch.UntypedStorage:
    """Memory for a tensor kept for the run ([Note: memory kept for the run]); zeroed on the
    host, undefined on a GPU."""
    device = torch.device(device)
    if device.type == "cpu" and nbytes >= MIN_MAPPED_BYTES:
        return mapped_storage(nbytes)
    return torch.empty(nbytes, dtype=torch.uint8, device=device).untyped_storage()


def lasting_zeros(numel: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero 1-D tensor kept for the run ([Note: memory kept for the run])."""
    storage = lasting_storage(numel * dtype.itemsize, device)
    tensor = torch.empty(0, dtype=dtype, device=storage.device).set_(storage, 0, (numel,))
    if storage.device.type != "cpu" or storage.nbytes() < MIN_MAPPED_BYTES:
        tensor.zero_()  # a fresh mapping is zero already
    setattr(tensor, _LASTING, True)
    return tensor


def is_lasting(tensor: torch.Tensor) -> bool:
    return getattr(tensor, _LASTING, False)


def hand_back_free_heap_pages() -> bool:
    """Once, after loading ([Note: the heap after loading]) and after the first optimizer step
    ([Note: memory kept for the run]). Returns whether glibc did it."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim  # glibc only: musl and others lack it
    except (OSError, AttributeError):
        return False
    trim(0)
    return True
