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
984 MB after the first; with the threshold pinned, 742 MB after every step.

A pool of reusable buffers (what FSDP2 and DeepSpeed get from the CUDA caching allocator) is not
possible here without re-pointing every parameter view at each gather: the views must keep their
storage object, because autograd's saved tensors refer to it. So the engine pins glibc's mmap
threshold at glibc's own starting value instead (``mallopt(M_MMAP_THRESHOLD, 128 KiB)``, which
also stops the dynamic raise): each buffer of 128 KiB or more is mapped when allocated and
unmapped when freed, and resident memory follows what is alive. (Pinned at 1 MiB, the same run
still climbed by 70 MB.) It is set once, when an engine is built, and only when the user
has not set any ``MALLOC_*_`` variable of their own; on a C library other than glibc nothing
changes. Device memory is not concerned (the CUDA caching allocator already reuses it).
"""

from __future__ import annotations

import ctypes
import logging
import os

logger = logging.getLogger("hf_zero")

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
MMAP_THRESHOLD_BYTES = 128 << 10  # glibc's own default, kept from rising
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")

_pinned = False


def return_freed_buffers_to_the_os() -> bool:
    """Pin glibc's mmap threshold (see [Note: freed buffers and the host allocator]). Returns
    whether the setting is in effect after the call."""
    global _pinned
    if _pinned:
        return True
    if any(name in os.environ for name in _USER_SETTINGS):
        return False  # the user's own allocator settings win
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (glibc only: musl and others lack it)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    _pinned = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    if _pinned:
        logger.debug("hf_zero: glibc mmap threshold pinned at %d bytes", MMAP_THRESHOLD_BYTES)
    return _pinned
