"""The collectives of sequence parallelism, differentiable: the all-to-all that trades the
sequence for the heads around attention, the sum over the group that makes the loss, and the
gather of per-token outputs along the sequence (TRL's fused head).

Both run on the sequence-parallel group only and inside autograd (a forward collective has its
adjoint in the backward), outside the engine's communicator; ``count`` (the engine's
``Communicator.count_issued_elsewhere``) adds each one, forward and backward, to
``comm_stats()``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    """Chunk ``i`` of dimension 0 goes to rank ``i``; chunk ``j`` of the result came from rank
    ``j``. The exchange is its own adjoint, so the backward is the same exchange."""

    @staticmethod
    def forward(ctx: Any, chunks: torch.Tensor, group: dist.ProcessGroup, count: Counter | None) -> torch.Tensor:
        ctx.group, ctx.count = group, count
        chunks = chunks.contiguous()
        out = torch.empty_like(chunks)  # contiguous: empty_like keeps a view's strides
        _counted(count, "all_to_all", "sequence_parallel.attention", chunks, group)
        dist.all_to_all_single(out, chunks, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        _counted(ctx.count, "all_to_all", "sequence_parallel.attention.backward", grad, ctx.group)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None, None


class _SumOverGroup(torch.autograd.Function):
    """The sum over the group on every rank; the backward sums the ranks' gradients, because
    every rank's input reaches every rank's output."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, group: dist.ProcessGroup, count: Counter | None) -> torch.Tensor:
        ctx.group, ctx.count = group, count
        total = value.clone()
        _counted(count, "all_reduce", "sequence_parallel.loss", total, group)
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        total = grad.clone()
        _counted(ctx.count, "all_reduce", "sequence_parallel.loss.backward", total, ctx.group)
        dist.all_reduce(total, group=ctx.group)
        return total, None, None


class _GatherSequence(torch.autograd.Function):
    """Every rank's ``[batch, local]`` slice, concatenated along dimension 1 in rank order. Each
    rank's output reads every rank's input, so the backward sums the ranks' gradients and keeps
    this rank's slice (a reduce-scatter, as an all-reduce: the tensors are per-token scalars)."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, group: dist.ProcessGroup, count: Counter | None) -> torch.Tensor:
        ctx.group, ctx.count, ctx.local = group, count, value.shape[1]
        ctx.rank = dist.get_rank(group)
        parts = [torch.empty_like(value) for _ in range(dist.get_world_size(group))]
        _counted(count, "all_gather", "sequence_parallel.fused_head", value, group)
        dist.all_gather(parts, value.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        total = grad.contiguous().clone()
        _counted(ctx.count, "all_reduce", "sequence_parallel.fused_head.backward", total, ctx.group)
        dist.all_reduce(total, group=ctx.group)
        return total.narrow(1, ctx.rank * ctx.local, ctx.local), None, None


Counter = Callable[[str, str, torch.Tensor, dist.ProcessGroup], None]  # Communicator.count_issued_elsewhere


def _counted(count: Counter | None, kind: str, label: str, tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    if count is not None:
        count(kind, label, tensor, group)


def all_to_all(chunks: torch.Tensor, group: dist.ProcessGroup, count: Counter | None = None) -> torch.Tensor:
    """Differentiable all-to-all over dimension 0, which must have one chunk per rank."""
    if chunks.shape[0] != dist.get_world_size(group):
        raise ValueError(f"all_to_all needs one chunk per rank on dimension 0, got {tuple(chunks.shape)}")
    return _AllToAll.apply(chunks, group, count)


def sum_over_group(value: torch.Tensor, group: dist.ProcessGroup, count: Counter | None = None) -> torch.Tensor:
    """Differentiable sum of ``value`` over the ranks of ``group``."""
    return _SumOverGroup.apply(value, group, count)


def gather_sequence(value: torch.Tensor, group: dist.ProcessGroup, count: Counter | None = None) -> torch.Tensor:
    """Every rank's ``[batch, local, ...]`` slice of ``group`` along dimension 1, differentiable
    for a tensor that requires grad (bool tensors travel as bytes)."""
    if value.requires_grad:
        return _GatherSequence.apply(value, group, count)
    with torch.no_grad():
        moved = value.to(torch.uint8) if value.dtype == torch.bool else value
        gathered = _GatherSequence.apply(moved, group, count)
    return gathered.bool() if value.dtype == torch.bool else gathered


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
