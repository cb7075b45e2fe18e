"""Fused non-finite check and squared L2 norm over many flat tensors (overflow check, clipping).

One launch per dtype group: each program strides over every tensor of the group (pointers from
a table) and writes one fp32 partial sum and one flag; a final torch reduction over the few
partials (in fp64, rounded once to fp32) gives the 0-d results. Partials, not atomics, so the
sum is deterministic run to run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from hf_zero.kernels.triton_common import ALIGN_NUMEL
from hf_zero.kernels.triton_common import TL_DTYPES
from hf_zero.kernels.triton_common import grid_stride_programs
from hf_zero.kernels.triton_common import is_aligned
from hf_zero.kernels.triton_common import pointer_table

BLOCK_SIZE = 2048
NUM_WARPS = 8


@triton.jit
def _nonfinite_sqnorm_kernel(
    table_ptr, num_tensors, partial_ptr, flag_ptr,
    DTYPE: tl.constexpr, ALIGNED: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """partial[p] = sum of x*x in fp32, flag[p] = any x inf or nan, over program p's blocks."""
    program = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK_SIZE
    sqsum = tl.zeros([BLOCK_SIZE], dtype=tl.float32)
    bad = tl.zeros([BLOCK_SIZE], dtype=tl.int32)
    for t in range(num_tensors):
        base = tl.load(table_ptr + t).to(tl.pointer_type(DTYPE))
        numel = tl.load(table_ptr + num_tensors + t)
        if ALIGNED:  # see [Note: aligned variant]
            base = tl.multiple_of(base, 16)
            numel = tl.multiple_of(numel, ALIGN_NUMEL)
        for start in range(program * BLOCK_SIZE, numel, step):
            offsets = start + tl.arange(0, BLOCK_SIZE)
            x = tl.load(base + offsets, mask=offsets < numel, other=0.0).to(tl.float32)
            sqsum += x * x
            # Its own test, not read off the sum: finite values near 1e20 overflow x*x to inf.
            bad |= ((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32)
    tl.store(partial_ptr + program, tl.sum(sqsum, axis=0))
    tl.store(flag_ptr + program, tl.max(bad, axis=0))


def _dtype_groups(tensors: Sequence[torch.Tensor]) -> dict[torch.dtype, list[torch.Tensor]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        if tensor.numel() > 0:
            groups.setdefault(tensor.dtype, []).append(tensor)
    return groups


def nonfinite_and_sqnorm_triton(tensors: Sequence[torch.Tensor], *, interpret: bool = False
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher; same contract as ``reference.nonfinite_and_sqnorm``, arguments validated."""
    device = tensors[0].device
    groups = _dtype_groups(tensors)
    sizes = [grid_stride_programs(device, triton.cdiv(sum(t.numel() for t in group), BLOCK_SIZE), interpret)
             for group in groups.values()]
    # One slot per program of every launch; zeros so that no group at all still gives (False, 0).
    partials = torch.zeros(max(1, sum(sizes)), dtype=torch.float32, device=device)
    flags = torch.zeros(max(1, sum(sizes)), dtype=torch.int32, device=device)
    first = 0
    for (dtype, group), programs in zip(groups.items(), sizes):
        table = pointer_table([[t.data_ptr() for t in group], [t.numel() for t in group]], device)
        _nonfinite_sqnorm_kernel[(programs,)](
            table, len(group), partials[first:], flags[first:], DTYPE=TL_DTYPES[dtype],
            ALIGNED=is_aligned(group, [t.numel() for t in group]),
            BLOCK_SIZE=BLOCK_SIZE, num_warps=NUM_WARPS, enable_fp_fusion=False,
        )
        first += programs
    # The few partials are summed in fp64 and rounded once, as the reference does.
    return flags.any(), partials.sum(dtype=torch.float64).float()
