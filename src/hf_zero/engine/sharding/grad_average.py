"""Where a gradient reduction divides by the world size: the one place that decides it.

[Note: averaging gradients over ranks]
A gradient reduction averages the ranks' gradients: it sums them and divides by the world size
N (every rank: with hybrid sharding, the shard group's size times the replicas). Where the division happens depends on the dtype the reduction runs in (the reduce dtype,
``communication_data_type``; null means the compute dtype):

- fp32: every rank divides its input by N before the sum (``div_`` in its own buffer, or the
  pack kernel's scale of 1/N), as hf_zero always did: fp32 reductions stay bit-identical.
- bf16: the sum is taken without a pre-divide, and the reduced shard is divided by N in fp32 when
  it is added into the fp32 gradient shard (a multiply by 1/N in fp32: exact for powers of two,
  otherwise within one fp32 rounding, 2^-24, far below bf16's 2^-9). bf16 has fp32's exponent
  range, so the sum cannot overflow; a pre-divide would round every rank's g/N to 8 significant
  bits before the sum even starts (tests/distributed/test_grad_average.py shows the difference).
- fp16: its range is small (65504 at most), so the inputs are still divided before the sum. On
  NCCL the collective divides (``ReduceOp.AVG``, no separate pass over the buffer); gloo has no
  AVG, so there each rank divides its input first, as for fp32.

At stage 0 the all-reduce runs in place in the 16-bit gradient buffer, so after a bf16 reduction
the parameters' ``.grad`` views hold the sum until the step; the gradient the optimizer reads is
the fp32 gradient shard, which holds the average.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from hf_zero.comm import Communicator


@dataclass(frozen=True)
class GradAverage:
    """How one reduction averages (see [Note: averaging gradients over ranks])."""

    pre_divisor: int  # every rank divides its input by this before the collective (1: not at all)
    op: dist.ReduceOp.RedOpType  # the collective's reduce op: SUM, or AVG (fp16 on NCCL)
    post_divisor: int  # the reduced result is divided by this in fp32 when accumulated (1: not at all)


def average_for(reduce_dtype: torch.dtype, world_size: int, collective_averages: bool) -> GradAverage:
    """The rule of the note: ``collective_averages`` says whether the collective can take
    ``ReduceOp.AVG`` here (NCCL)."""
    if world_size == 1:
        return GradAverage(1, dist.ReduceOp.SUM, 1)
    if reduce_dtype == torch.bfloat16:
        return GradAverage(1, dist.ReduceOp.SUM, world_size)
    if reduce_dtype == torch.float16 and collective_averages:
        return GradAverage(1, dist.ReduceOp.AVG, 1)
    return GradAverage(world_size, dist.ReduceOp.SUM, 1)


def post_divisor(reduce_dtype: torch.dtype, world_size: int) -> int:
    """What a reduced result of ``reduce_dtype`` still has to be divided by (whatever the op)."""
    return average_for(reduce_dtype, world_size, collective_averages=False).post_divisor


def plan_average(reduce_dtype: torch.dtype, comm: Communicator, device: torch.device) -> GradAverage:
    """The averaging of a gradient all-reduce (stage 0) or reduce-scatter on ``comm``: over every
    rank, the replicas of hybrid sharding included ([Note: hybrid sharding] in collectives.py)."""
    return average_for(reduce_dtype, comm.data_parallel_size, _on_nccl(comm, device))


def _on_nccl(comm: Communicator, device: torch.device) -> bool:
    """Whether a gradient collective on ``device`` runs on NCCL (a backend string such as
    ``"cpu:gloo,cuda:nccl"`` gives CUDA tensors to NCCL)."""
    return comm.active and device.type == "cuda" and "nccl" in str(dist.get_backend(comm.grad_group))

