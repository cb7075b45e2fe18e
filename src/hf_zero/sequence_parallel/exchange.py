"""The two collectives of sequence parallelism, differentiable: the all-to-all that trades the
sequence for the heads around attention, and the sum over the group that makes the loss.

Both run on the sequence-parallel group only and inside autograd (a forward collective has its
adjoint in the backward): the engine's own collectives, labels and statistics are not involved.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    """Chunk ``i`` of dimension 0 goes to rank ``i``; chunk ``j`` of the result came from rank
    ``j``. The exchange is its own adjoint, so the backward is the same exchange."""

    @staticmethod
    def forward(ctx: Any, chunks: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        chunks = chunks.contiguous()
        out = torch.empty_like(chunks)  # contiguous: empty_like keeps a view's strides
        dist.all_to_all_single(out, chunks, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


class _SumOverGroup(torch.autograd.Function):
    """The sum over the group on every rank; the backward sums the ranks' gradients, because
    every rank's input reaches every rank's output."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        total = value.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        total = grad.clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None


def all_to_all(chunks: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable all-to-all over dimension 0, which must have one chunk per rank."""
    if chunks.shape[0] != dist.get_world_size(group):
        raise ValueError(f"all_to_all needs one chunk per rank on dimension 0, got {tuple(chunks.shape)}")
    return _AllToAll.apply(chunks, group)


def sum_over_group(value: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable sum of ``value`` over the ranks of ``group``."""
    return _SumOverGroup.apply(value, group)


def heads_to_sequence(states: torch.Tensor, size: int, send: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``[batch, heads, local_seq, dim]`` with this rank's slice of the sequence to
    ``[batch, heads / S, S * local_seq, dim]`` with the whole sequence and this rank's heads.

    Rank ``j`` of the group holds sequence chunk ``j``; it sends head chunk ``i`` to rank ``i``, so
    rank ``i`` receives its heads for every chunk of the sequence, in sequence order. ``send`` is
    the group's all-to-all over dimension 0 (``SequenceParallelLayout.all_to_all``)."""
    batch, heads, local_seq, dim = states.shape
    chunks = states.reshape(batch, size, heads // size, local_seq, dim).transpose(0, 1)
    received = send(chunks)  # [S (sequence chunk), batch, heads / S, local_seq, dim]
    return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // size, size * local_seq, dim)


def sequence_to_heads(output: torch.Tensor, size: int, send: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The way back for attention's output: ``[batch, seq, heads / S, dim]`` (the layout
    transformers' attention functions return) to ``[batch, seq / S, heads, dim]``."""
    batch, seq, local_heads, dim = output.shape
    chunks = output.reshape(batch, size, seq // size, local_heads, dim).transpose(0, 1)
    received = send(chunks)  # [S (head chunk), batch, seq / S, heads / S, dim]
    return received.permute(1, 2, 0, 3, 4).reshape(batch, seq // size, size * local_heads, dim)
