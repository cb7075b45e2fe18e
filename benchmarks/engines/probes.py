"""Measurements a rank takes of itself: model-state storage, RSS, CPU time, the machine's load.

[Note: model-state bytes]
Model states are params + fp32 master + grads + optimizer state held by one rank, taken after
backward and before the optimizer step of the last step (the point where gradients exist and
nothing has been freed by the step yet). Each engine names its own tensors (see its runner), and
they are counted here by *storage*: a storage reached twice (a view, an alias, a tied weight)
counts once, at its full allocated size, in the first category that reached it. Runners add
categories in the order params, master, grads, optimizer state, so a master that aliases the
parameters counts as parameters, as hf_zero's own ``memory_report`` does. Scratch buffers an
engine keeps (DDP buckets, DeepSpeed's reduce bucket) are reported apart as ``engine_buffers``,
with how much of them is resident (``/proc/self/pagemap``), since a buffer can be allocated and
never touched.
"""

from __future__ import annotations

import os
import resource
import struct
from collections import defaultdict
from typing import Iterable

import torch

MODEL_STATE_CATEGORIES = ("params", "master", "grads", "optim")
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), else the tensor itself."""
    return getattr(tensor, "_local_tensor", tensor)


class StorageTally:
    """Bytes by category, each storage counted once (see [Note: model-state bytes])."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, int]] = set()
        self.bytes: dict[str, int] = defaultdict(int)
        self.detail: dict[str, int] = defaultdict(int)
        self._storages: dict[str, list[tuple[int, int]]] = defaultdict(list)

    def add(self, category: str, source: str, tensors: Iterable[torch.Tensor | None]) -> None:
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor) or local_tensor(tensor).device.type == "meta":
                continue
            storage = local_tensor(tensor).untyped_storage()
            nbytes = storage.nbytes()
            key = (str(local_tensor(tensor).device), storage.data_ptr())
            if nbytes == 0 or key in self._seen:
                continue
            self._seen.add(key)
            self.bytes[category] += nbytes
            self.detail[f"{category}:{source}"] += nbytes
            self._storages[category].append((storage.data_ptr(), nbytes))

    def model_state(self) -> dict[str, int]:
        breakdown = {c: int(self.bytes.get(c, 0)) for c in MODEL_STATE_CATEGORIES}
        breakdown["total"] = sum(breakdown.values())
        return breakdown

    def resident_bytes(self, category: str) -> int | None:
        """Bytes of ``category``'s CPU storages that are backed by physical pages now."""
        try:
            return sum(resident_bytes(ptr, nbytes) for ptr, nbytes in self._storages.get(category, []))
        except OSError:
            return None


def resident_bytes(address: int, nbytes: int) -> int:
    """Resident bytes of [address, address + nbytes) from /proc/self/pagemap (bit 63: present)."""
    if nbytes == 0:
        return 0
    first, last = address // PAGE_BYTES, (address + nbytes - 1) // PAGE_BYTES
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(first * 8)
        raw = pagemap.read((last - first + 1) * 8)
    present = sum(1 for (entry,) in struct.iter_unpack("<Q", raw) if entry >> 63)
    return present * PAGE_BYTES


def rss_mib() -> float:
    """Current resident set size in MiB (VmRSS)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def peak_rss_mib() -> float:
    """``ru_maxrss`` (KiB on Linux) in MiB: the process's peak resident memory."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def process_cpu_s() -> float:
    """CPU seconds this process (all its threads: gloo's included) has used."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def machine_cpu_s() -> tuple[float, float] | None:
    """(busy, total) CPU seconds of the whole machine from /proc/stat, or None off Linux."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:]]
    except OSError:
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already inside user
    return (total - idle) / ticks, total / ticks
