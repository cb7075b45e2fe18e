"""The loss of a sequence split over a group: the full sequence's mean over real tokens.

[Note: the sequence-parallel loss]
Each rank holds the logits of its slice and the labels shifted over the whole sequence
([Note: sharding the batch]). The loss is ``sum over the group of the token losses / the
group's real-token count`` (or ``/ num_items_in_batch`` when the caller counts the tokens of an
accumulated batch, as the Trainer does), so every rank of the group holds the same value, the
full-sequence loss, and logs it as such.

The sum over the group is differentiable (its backward sums again), so each rank's token losses
get S times the weight a lone rank would give them. That is what the engine's gradient average
needs: it divides by the whole world, D x S ranks, while the samples are only D groups' worth;
the factor S from the backward makes the average over the data-parallel groups exact, with no
change to the engine's reduction. (Trainer's ``num_items_in_batch`` counts each group's tokens
on all S ranks and the Trainer multiplies the loss by the world size: the S cancels the same way.)
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hf_zero.sequence_parallel.batch import IGNORE_INDEX
from hf_zero.sequence_parallel.exchange import sum_over_group
from hf_zero.sequence_parallel.layout import SequenceParallelLayout


def sequence_parallel_loss(layout: SequenceParallelLayout, logits: torch.Tensor, shifted_labels: torch.Tensor,
                           num_items_in_batch: Any = None, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """[Note: the sequence-parallel loss] for this rank's ``logits`` ``[batch, local_seq, vocab]``."""
    logits = logits.float()
    labels = shifted_labels.to(logits.device)
    local = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                            ignore_index=ignore_index, reduction="sum")
    return mean_over_tokens(local, labels, num_items_in_batch, layout, ignore_index)


def mean_over_tokens(local_sum: torch.Tensor, labels: torch.Tensor, num_items_in_batch: Any,
                     layout: SequenceParallelLayout | None, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """A token-loss sum divided by the real tokens (or ``num_items_in_batch``); with ``layout``
    both are the group's ([Note: the sequence-parallel loss])."""
    total = local_sum if layout is None else sum_over_group(local_sum, layout.group, layout.count)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch
    count = (labels != ignore_index).sum().to(device=total.device, dtype=torch.float32)
    if layout is not None:
        if layout.count is not None:
            layout.count("all_reduce", "sequence_parallel.tokens", count, layout.group)
        dist.all_reduce(count, group=layout.group)
    return total / count.clamp(min=1)


class SequenceParallelLossFunction:
    """What a causal LM's ``loss_function`` becomes: the group's loss in training mode, the
    model's own loss otherwise (evaluation on whole sequences)."""

    def __init__(self, model: nn.Module, layout: SequenceParallelLayout, original: Callable[..., Any]) -> None:
        self.model = model
        self.layout = layout
        self.original = original

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int | None = None,
                 num_items_in_batch: Any = None, ignore_index: int = IGNORE_INDEX, **kwargs: Any) -> torch.Tensor:
        if not self.model.training:
            return self.original(logits, labels, vocab_size=vocab_size, num_items_in_batch=num_items_in_batch,
                                 ignore_index=ignore_index, **kwargs)
        return sequence_parallel_loss(self.layout, logits, labels, num_items_in_batch, ignore_index)
