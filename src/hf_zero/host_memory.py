"""Host memory the engine keeps for the whole run, in mappings of its own outside glibc's heap.

[Note: memory kept for the run]
A rank keeps some tensors for the whole run: its parameter shards, its gradient shards and its
optimizer's moments. glibc serves allocations under its mmap threshold (128 KiB at first, raised
to the size of each large block freed, up to 32 MiB) from one heap that only shrinks from the
top, so a shard or a moment allocated there pins every page below it. Most of these arrive in the
middle of a step: the gradient shards in the first backward, the moments in the first step, in
the holes the freed activations left. The next steps' activations then have to fit around them,
and the heap holds hundreds of MB of free but resident pages at the step's peak (measured on a
134M Llama through the Trainer at 2 ranks: 560 MB of the heap's 1.4 GB free at the peak).

So on the CPU what the engine keeps is allocated in an anonymous mapping of its own
(:func:`lasting_zeros`, from 1 MiB up: smaller ones would spend a mapping each on a few pages),
and the heap holds only what a step allocates and frees. A torch optimizer makes its own state,
in the heap, in its first step; :func:`settle_optimizer_state` moves it into such mappings after
that step (and after a checkpoint load replaced it). Then, once, it hands the heap's free pages
back ([Note: the heap after loading]): the first step's freed activations would otherwise stay
resident beside state that no longer fills their holes. That is a call, not a setting, and later
allocations behave as glibc's defaults say. On a GPU these tensors come from the device's caching allocator as before.

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


def lasting_zeros_like(tensor: torch.Tensor) -> torch.Tensor:
    """Zeros of ``tensor``'s shape, dtype and device (contiguous), kept for the run."""
    like = lasting_zeros(tensor.numel(), tensor.dtype, tensor.device).view(tensor.shape)
    setattr(like, _LASTING, True)
    return like


def is_lasting(tensor: torch.Tensor) -> bool:
    return getattr(tensor, _LASTING, False)


def settle_optimizer_state(optimizer: torch.optim.Optimizer, first_step: bool) -> None:
    """After an optimizer step: move the host tensors a torch optimizer made in the heap (its
    moments, from its first step or a loaded checkpoint) into mappings of their own, and hand the
    heap's free pages back once when that moved anything or this was the run's first step (whose
    freed activations are what fills the heap; later steps reuse those pages)."""
    moved = _move_state_out_of_the_heap(optimizer)
    if moved or first_step:  # the old tensors are gone now (no reference outlives the call above)
        hand_back_free_heap_pages()


def _move_state_out_of_the_heap(optimizer: torch.optim.Optimizer) -> bool:
    """A tensor that shares its storage with another, or holds part of one, stays where it is:
    a copy would split it."""
    candidates: dict[int, list[tuple[dict, str]]] = {}
    for state in optimizer.state.values():
        for key, value in state.items():
            if (isinstance(value, torch.Tensor) and value.device.type == "cpu" and not is_lasting(value)
                    and value.numel() * value.element_size() >= MIN_MAPPED_BYTES):
                candidates.setdefault(value.untyped_storage().data_ptr(), []).append((state, key))
    moved = False
    for uses in candidates.values():
        state, key = uses[0]
        value = state[key]
        whole = value.untyped_storage().nbytes() == value.numel() * value.element_size()
        if len(uses) == 1 and whole and value.is_contiguous():
            state[key] = lasting_zeros_like(value).copy_(value)
            moved = True
    return moved


def hand_back_free_heap_pages() -> bool:
    """Once, after loading ([Note: the heap after loading]) or after the heap's long-lived blocks
    moved out ([Note: memory kept for the run]). Returns whether glibc did it."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim  # glibc only: musl and others lack it
    except (OSError, AttributeError):
        return False
    trim(0)
    return True
