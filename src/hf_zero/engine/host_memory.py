"""Freed gather and reduce buffers go back to the operating system.

[Note: freed buffers and the host allocator]
Under stage 3 every unit's full parameters and full gradients are allocated for the unit's
forward or backward and freed right after (see [Note: views into flat buffers] in
flat_group.py): on the host, hundreds of MB come and go every step. glibc's malloc serves a
request of 128 KiB or more with its own ``mmap`` and unmaps it when freed, but the first time
such a block is freed it raises that threshold to the block's size (up to 32 MiB). From then on
unit-sized buffers come from the heap, and freed heap memory stays in the process: resident
memory swings by a step's worth of buffers and ends well above what the model state needs. On
a 33M-parameter Llama on 2 ranks, 8 steps of stage 3 end at 1305 MB per rank, climbing from
984 MB after the first.

A pool of reusable buffers (what FSDP2 and DeepSpeed get from the CUDA caching allocator) was
measured and left out. The views must keep their storage object (autograd's saved tensors refer
to it), but a storage can swap its allocation with a kept one (``UntypedStorage._swap_data_ptr_``).
Keeping freed decoder-layer buffers for the next layer made the 5.3M GPT-2 stage-3 step 3% faster
(0.380 to 0.367 s) and raised the Trainer peak below from 0.73x to 0.79x DDP's: the kept buffers
sit idle while the logits and the loss are alive. Two settings remain, and they trade memory
against time:

- Pinning glibc's mmap threshold at its starting value (``mallopt(M_MMAP_THRESHOLD, 128 KiB)``,
  which also stops the dynamic raise): every buffer of 128 KiB or more is mapped when allocated
  and unmapped when freed, so resident memory follows what is alive. On the 33M Llama, 742 MB
  after every step; through an unmodified Trainer on a 127M Llama, a peak of 2853 MB per rank.
  But every activation and gradient of that size becomes a fresh mapping, zero-filled page by
  page on first touch, every step: the 5.3M GPT-2 benchmark step goes from 0.28 s to 0.45 s.
- Trimming the heap once per optimizer step (``malloc_trim(0)``): within a step the heap is the
  pool (the next unit's buffers reuse the last one's), and between steps its free pages go
  back. Steps keep their speed and memory stays flat from step to step, but the peak inside a
  step carries the heap's fragmentation: 3937 MB in the same Trainer run (DDP: 3232 MB).

Stage 3 is chosen for memory, and is where buffers churn, so under stage 3 the engine pins the
threshold; at every stage it trims after each step. Both are set only when the user has not set
any ``MALLOC_*_`` variable of their own (their allocator settings win), only on glibc, and only
when the engine computes on the CPU (:func:`host_allocator_settings_apply`). On a GPU the
buffers that churn are device memory, which the CUDA caching allocator already reuses; what is
left on the host (offloaded state, pinned by torch's own host allocator, and the data loader's
batches) does not churn by unit, so the settings would cost every host allocation of a process
hf_zero does not own a fresh mapping or a heap walk, and buy nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os

import torch

logger = logging.getLogger("hf_zero")

_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
MMAP_THRESHOLD_BYTES = 128 << 10  # glibc's own default, kept from rising


def _glibc() -> ctypes.CDLL | None:
    if any(name in os.environ for name in _USER_SETTINGS):
        return None  # the user's own allocator settings win
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (glibc only: musl and others lack it)
        return libc
    except (OSError, AttributeError):
        return None


_libc = _glibc()
_pinned = False


def host_allocator_settings_apply(device: torch.device) -> bool:
    """Whether an engine computing on ``device`` changes the process's glibc allocator: only on
    the CPU, where the unit buffers of [Note: freed buffers and the host allocator] live."""
    return device.type == "cpu"


def pin_mmap_threshold(device: torch.device) -> bool:
    """Under stage 3 on the CPU: freed unit buffers are unmapped at once (see [Note: freed
    buffers and the host allocator]). Returns whether the setting is in effect."""
    global _pinned
    if not host_allocator_settings_apply(device):
        return False
    if not _pinned and _libc is not None:
        _pinned = bool(_libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
        if _pinned:
            logger.debug("hf_zero: glibc mmap threshold pinned at %d bytes", MMAP_THRESHOLD_BYTES)
    return _pinned


def return_freed_buffers_to_the_os(device: torch.device) -> bool:
    """At the end of an optimizer step on the CPU: hand the heap's free pages back (see [Note:
    freed buffers and the host allocator]). ``device`` is the engine's compute device. Returns
    whether anything was attempted."""
    if _libc is None or not host_allocator_settings_apply(device):
        return False
    _libc.malloc_trim(0)
    return True
