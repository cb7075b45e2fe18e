"""Pieces shared by the Triton kernels: the rounding cast, dtype names, launch sizing.

Importing this module imports triton; only ``hf_zero.kernels.dispatch`` does so, inside a guard.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

TL_DTYPES: dict[torch.dtype, tl.dtype] = {
    torch.float32: tl.float32,
    torch.bfloat16: tl.bfloat16,
    torch.float16: tl.float16,
}

# Programs per SM for the grid-stride kernels (pack, unpack, norm): enough to hide latency.
PROGRAMS_PER_SM = 4
# The interpreter runs programs one after another; a few keep it quick and still cover the loops.
INTERPRETER_PROGRAMS = 4


@triton.jit
def cast_rtne(x, DTYPE: tl.constexpr):
    """Cast fp32 ``x`` to ``DTYPE`` rounding to nearest even, bit-identical to torch's ``.to()``.

    [Note: bf16 rounding]
    Triton 3.9's interpreter truncates fp32 -> bf16 while GPUs round to
    nearest even, so a plain ``.to(tl.bfloat16)`` would make the interpreter tests check a
    different rounding than the GPU runs. Rounding by hand on the bits gives the same result on
    both (and torch's: NaN becomes the canonical quiet NaN 0x7FC0). A few integer ops per
    element cost nothing in these memory-bound kernels.
    """
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(x != x, 0x7FC0, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def grid_stride_programs(device: torch.device, max_blocks: int, interpret: bool, per_program: int = 1) -> int:
    """Programs for a grid-stride launch: no more than there are blocks of work, at least one.

    ``per_program`` divides the budget when the grid has a second axis (pack/unpack: ranks).
    """
    on_gpu = device.type == "cuda" and not interpret
    budget = PROGRAMS_PER_SM * _sm_count(device.index or 0) if on_gpu else INTERPRETER_PROGRAMS
    return max(1, min(max_blocks, budget // per_program))


# [Note: aligned variant]
# Pointers read from a table carry no alignment the compiler can see, so
# it emits 2- or 4-byte accesses. When the host has checked that every address is 16-byte aligned
# and every length/offset is a multiple of ALIGN_NUMEL elements (the usual case for padded flat
# shards), the kernels' ALIGNED variant states it with tl.multiple_of and gets 16-byte accesses.
ALIGN_NUMEL = tl.constexpr(8)  # constexpr: kernels read it as a compile-time global


def is_aligned(tensors: Sequence[torch.Tensor], numels: Sequence[int]) -> bool:
    """Whether the ALIGNED kernel variant may be used (see [Note: aligned variant])."""
    return all(t.data_ptr() % 16 == 0 for t in tensors) and all(n % ALIGN_NUMEL.value == 0 for n in numels)


# [Note: pointer tables]
# A table of pointers, numels and offsets lets one launch cover any number of tensors, but it has
# to reach the device, and a copy of a Python list from pageable memory may make the host wait
# for the GPU ([Note: host synchronisations] in hf_zero.execution.host_sync). The same tables
# come back every step (the gradient shards of a norm live for the run, a bucket's buffers come
# from the pool at the same addresses), so a table is kept on the device by its values and made
# again only for new ones, through pinned memory with a non-blocking copy (the caching host
# allocator keeps the staging buffer until the copy has run). A table holds values, not
# references: a cached one is right for any tensors at those addresses with those sizes.
_TABLES: dict[tuple[torch.device, tuple[tuple[int, ...], ...]], torch.Tensor] = {}
_MAX_TABLES = 512


def pointer_table(rows: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """An int64 [len(rows), n] table (pointers, numels, offsets) on ``device`` that a kernel
    reads per tensor ([Note: pointer tables])."""
    key = (device, tuple(tuple(row) for row in rows))
    table = _TABLES.get(key)
    if table is None:
        host = torch.tensor(rows, dtype=torch.int64)
        if device.type == "cuda":
            host = host.pin_memory()
        table = host.to(device, non_blocking=True)
        if len(_TABLES) >= _MAX_TABLES:
            _TABLES.pop(next(iter(_TABLES)))  # the oldest
        _TABLES[key] = table
    return table
