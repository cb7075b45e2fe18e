"""Reduce-scatter bucketing: pack units rank-major (scale + cast fused) and unpack after all-gather.

[Note: rank-major bucket]
A bucket holds several units, each padded to a multiple of the world
size ws. Unit u (numel L_u, chunk c_u = L_u / ws) sits at column offset o_u = c_0 + ... + c_{u-1}
of every rank's segment, and rank r's segment starts at r * C with C = sum of c_u:

    buffer[r * C + o_u + j] = unit_u[r * c_u + j]      0 <= j < c_u

One launch per dtype group covers every unit: a table gives each unit's pointer, chunk and
offset, program (p, r) strides over rank r's chunk of each unit in turn. No integer division per
element, each element read once and written once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from hf_zero.kernels.triton_common import ALIGN_NUMEL
from hf_zero.kernels.triton_common import TL_DTYPES
from hf_zero.kernels.triton_common import cast_rtne
from hf_zero.kernels.triton_common import grid_stride_programs
from hf_zero.kernels.triton_common import is_aligned
from hf_zero.kernels.triton_common import pointer_table

BLOCK_SIZE = 2048
NUM_WARPS = 8


@triton.jit
def _unit_entry(table_ptr, num_units, u, UNIT_DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """Unit u's (pointer, chunk, column) from the table; see [Note: aligned variant]."""
    unit = tl.load(table_ptr + u).to(tl.pointer_type(UNIT_DTYPE))
    chunk = tl.load(table_ptr + num_units + u)
    column = tl.load(table_ptr + 2 * num_units + u)
    if ALIGNED:
        unit = tl.multiple_of(unit, 16)
        chunk = tl.multiple_of(chunk, ALIGN_NUMEL)
        column = tl.multiple_of(column, ALIGN_NUMEL)
    return unit, chunk, column


@triton.jit
def _pack_kernel(
    table_ptr, num_units, buffer_ptr, rank_stride, scale,
    UNIT_DTYPE: tl.constexpr, ALIGNED: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """buffer[r*C + o_u + j] = cast(float(unit_u[r*c_u + j]) * scale); table rows: ptr, c_u, o_u."""
    program = tl.program_id(0)
    rank = tl.program_id(1).to(tl.int64)
    step = tl.num_programs(0) * BLOCK_SIZE
    if ALIGNED:
        rank_stride = tl.multiple_of(rank_stride, ALIGN_NUMEL)
    for u in range(num_units):
        unit, chunk, column = _unit_entry(table_ptr, num_units, u, UNIT_DTYPE, ALIGNED)
        src = unit + rank * chunk
        dst = buffer_ptr + rank * rank_stride + column
        for start in range(program * BLOCK_SIZE, chunk, step):
            offsets = start + tl.arange(0, BLOCK_SIZE)
            mask = offsets < chunk
            x = tl.load(src + offsets, mask=mask).to(tl.float32) * scale
            tl.store(dst + offsets, cast_rtne(x, buffer_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _unpack_kernel(
    table_ptr, num_units, buffer_ptr, rank_stride,
    UNIT_DTYPE: tl.constexpr, ALIGNED: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """unit_u[r*c_u + j] = cast(buffer[r*C + o_u + j]); exact when the dtypes agree."""
    program = tl.program_id(0)
    rank = tl.program_id(1).to(tl.int64)
    step = tl.num_programs(0) * BLOCK_SIZE
    if ALIGNED:
        rank_stride = tl.multiple_of(rank_stride, ALIGN_NUMEL)
    for u in range(num_units):
        unit, chunk, column = _unit_entry(table_ptr, num_units, u, UNIT_DTYPE, ALIGNED)
        dst = unit + rank * chunk
        src = buffer_ptr + rank * rank_stride + column
        for start in range(program * BLOCK_SIZE, chunk, step):
            offsets = start + tl.arange(0, BLOCK_SIZE)
            mask = offsets < chunk
            x = tl.load(src + offsets, mask=mask)
            if UNIT_DTYPE != buffer_ptr.dtype.element_ty:
                x = cast_rtne(x.to(tl.float32), UNIT_DTYPE)
            tl.store(dst + offsets, x, mask=mask)


class _UnitGroup(NamedTuple):
    """Units of one dtype (one launch), with each unit's chunk and column offset."""

    units: list[torch.Tensor]
    chunks: list[int]
    columns: list[int]


def _unit_groups(units: Sequence[torch.Tensor], world_size: int) -> dict[torch.dtype, _UnitGroup]:
    groups: dict[torch.dtype, _UnitGroup] = {}
    column = 0
    for unit in units:
        chunk = unit.numel() // world_size
        if chunk > 0:
            group = groups.setdefault(unit.dtype, _UnitGroup([], [], []))
            group.units.append(unit)
            group.chunks.append(chunk)
            group.columns.append(column)
        column += chunk
    return groups


def _launch(kernel: triton.JITFunction, units: Sequence[torch.Tensor], world_size: int,
            buffer: torch.Tensor, interpret: bool, *scalars: float) -> None:
    rank_stride = buffer.numel() // world_size
    for dtype, group in _unit_groups(units, world_size).items():
        table = pointer_table([[u.data_ptr() for u in group.units], group.chunks, group.columns], buffer.device)
        max_blocks = triton.cdiv(max(group.chunks), BLOCK_SIZE)
        programs = grid_stride_programs(buffer.device, max_blocks, interpret, per_program=world_size)
        aligned = is_aligned([buffer, *group.units], [rank_stride, *group.chunks, *group.columns])
        kernel[(programs, world_size)](
            table, len(group.units), buffer, rank_stride, *scalars, UNIT_DTYPE=TL_DTYPES[dtype], ALIGNED=aligned,
            BLOCK_SIZE=BLOCK_SIZE, num_warps=NUM_WARPS, enable_fp_fusion=False,
        )


def pack_for_reduce_scatter_triton(grads: Sequence[torch.Tensor], world_size: int, out: torch.Tensor,
                                   scale: float = 1.0, *, interpret: bool = False) -> None:
    """Launcher; same contract as ``reference.pack_for_reduce_scatter``, arguments validated."""
    _launch(_pack_kernel, grads, world_size, out, interpret, float(scale))


def unpack_after_all_gather_triton(buffer: torch.Tensor, world_size: int, outs: Sequence[torch.Tensor],
                                   *, interpret: bool = False) -> None:
    """Launcher; same contract as ``reference.unpack_after_all_gather``, arguments validated."""
    _launch(_unpack_kernel, outs, world_size, buffer, interpret)
