"""[Note: freed buffers and the host allocator]: the process-wide glibc settings (mmap threshold
pinned at stage 3, ``malloc_trim`` after each step) are applied only when the engine computes on
the CPU; on a GPU run the buffers that churn are device memory. No CUDA needed: the decision is
made from the device alone, and glibc is replaced by a recorder so this process's allocator is
left as it is."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hf_zero.engine import host_memory

CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)


class _RecordingLibc:
    """Stands in for glibc: records the allocator calls instead of making them."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append(("mallopt", param, value))
        return 1

    def malloc_trim(self, pad: int) -> int:
        self.calls.append(("malloc_trim", pad))
        return 1


@pytest.fixture
def libc(monkeypatch: pytest.MonkeyPatch) -> _RecordingLibc:
    recorder = _RecordingLibc()
    monkeypatch.setattr(host_memory, "_libc", recorder)
    monkeypatch.setattr(host_memory, "_pinned", False)
    return recorder


def test_only_a_cpu_engine_changes_the_host_allocator() -> None:
    assert host_memory.host_allocator_settings_apply(CPU)
    assert not host_memory.host_allocator_settings_apply(GPU)
    assert not host_memory.host_allocator_settings_apply(torch.device("cuda"))


def test_gpu_engine_leaves_the_mmap_threshold_alone(libc: _RecordingLibc) -> None:
    assert host_memory.pin_mmap_threshold(GPU) is False
    assert libc.calls == []
    assert host_memory.pin_mmap_threshold(CPU) is True
    assert libc.calls == [("mallopt", host_memory.M_MMAP_THRESHOLD, host_memory.MMAP_THRESHOLD_BYTES)]


def test_gpu_engine_does_not_trim_the_heap(libc: _RecordingLibc) -> None:
    assert host_memory.return_freed_buffers_to_the_os(GPU) is False
    assert libc.calls == []
    assert host_memory.return_freed_buffers_to_the_os(CPU) is True
    assert libc.calls == [("malloc_trim", 0)]
