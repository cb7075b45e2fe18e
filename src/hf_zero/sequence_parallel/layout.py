"""Which ranks share a sequence: the sequence-parallel groups and the data-parallel index.

[Note: sequence-parallel layout]
With ``sequence_parallel_size: S`` the world splits into groups of S consecutive ranks (the GPUs
of a node, as launchers number them). The ranks of a group see the same samples and hold 1/S of
every sequence each; the data-parallel degree is world / S and a rank's data-parallel index is
``rank // S``. The model states stay sharded over all ranks: the S ranks of a group hold the same
parameters, so ZeRO shards over data x sequence, and the engine's gradient average over the whole
world is right once the loss is the group's (hf_zero.sequence_parallel.loss).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hf_zero.sequence_parallel.exchange import Counter, all_to_all


@dataclass(frozen=True)
class SequenceParallelLayout:
    size: int  # S: ranks per sequence
    rank: int  # this rank's place in its group: which slice of the sequence it holds
    data_parallel_rank: int  # which samples the group sees: global rank // S
    data_parallel_size: int  # world / S
    group: dist.ProcessGroup  # this rank's sequence-parallel group
    device: torch.device  # where the group's collectives take their tensors
    count: Counter | None = None  # counts the group's collectives into the engine's comm_stats()

    def all_to_all(self, chunks: torch.Tensor) -> torch.Tensor:
        """The group's differentiable all-to-all over dimension 0 ([Note: Ulysses attention])."""
        return all_to_all(chunks, self.group, self.count)


def configured_size(config: dict[str, Any]) -> int:
    """``sequence_parallel_size`` of a config dict (1 when absent, off or not yet valid)."""
    size = config.get("sequence_parallel_size", 1)
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 1 else 1


def check_size(size: int, world_size: int) -> None:
    if size < 1 or world_size % size:
        raise ValueError(
            f"sequence_parallel_size {size} must divide the world size {world_size}: the ranks form groups of "
            f"sequence_parallel_size consecutive ranks; launch a multiple of {size} processes, or set "
            f"sequence_parallel_size to a divisor of {world_size}")


def data_parallel_place(size: int, rank: int, world_size: int) -> tuple[int, int]:
    """``(data-parallel rank, data-parallel size)`` of ``rank``: arithmetic only, so that a
    dataloader can be sharded before any group exists."""
    check_size(size, world_size)
    return rank // size, world_size // size


def make_layout(size: int, device: torch.device, timeout_s: float | None = None,
                count: Counter | None = None) -> SequenceParallelLayout:
    """Make every rank's group (``new_group`` is collective: every rank makes all of them, in one
    order) and return this rank's layout."""
    world, me = dist.get_world_size(), dist.get_rank()
    check_size(size, world)
    kwargs = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    mine = None
    for start in range(0, world, size):
        made = dist.new_group(ranks=list(range(start, start + size)), **kwargs)
        if start <= me < start + size:
            mine = made
    assert mine is not None
    return SequenceParallelLayout(size=size, rank=me % size, data_parallel_rank=me // size,
                                  data_parallel_size=world // size, group=mine, device=device, count=count)
