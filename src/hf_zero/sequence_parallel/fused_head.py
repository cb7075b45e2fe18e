"""TRL's fused LM head under sequence parallelism: its per-token outputs over the whole sequence.

[Note: TRL's fused head under sequence parallelism]
TRL's trainers (``SFTTrainer``, ``DPOTrainer``) call the model with ``fused_lm_head=True``
(``trl.trainer.utils.add_fused_lm_head``): the forward returns per-token ``log_probs`` (and
``entropy``, ``is_top1``, ``label_mask``...) instead of logits, and the trainer computes its loss
and metrics from them. Under sequence parallelism each rank's forward scores only its slice, so
a loss made from those would count 1/S of every sequence on each rank. The call therefore gets
its labels pre-shifted as ``shift_labels`` (which the fused head scores without shifting again:
[Note: sharding the batch] in batch.py), and after the forward every per-token field is gathered
along the sequence over the group and cut to the ``length - 1`` positions the fused head gives on
a whole sequence (the last position and the padding carry no label). Every rank of a group then
holds the whole sequences' outputs, as without sequence parallelism. The gather is differentiable
and its backward sums the group's gradients, which gives each rank's tokens S times the weight
a lone rank would: the factor the engine's average over all D x S ranks needs, exactly as the sum
in [Note: the sequence-parallel loss] gives it. ``loss`` is recomputed from the gathered values
(the fused head's own rule: the token sum over ``num_items_in_batch`` or the real tokens).
"""

from __future__ import annotations

from typing import Any

import torch

from hf_zero.sequence_parallel.exchange import gather_sequence
from hf_zero.sequence_parallel.layout import SequenceParallelLayout

PER_TOKEN_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")


def is_fused_output(output: Any) -> bool:
    """A ``FusedCausalLMOutput``: per-token log-probabilities and their mask, no logits."""
    return torch.is_tensor(getattr(output, "log_probs", None)) and torch.is_tensor(getattr(output, "label_mask", None))


def whole_sequence_outputs(output: Any, layout: SequenceParallelLayout, length: int,
                           num_items_in_batch: Any) -> Any:
    """``output``'s per-token fields over the group's whole sequences of ``length`` tokens, and
    its loss from them ([Note: TRL's fused head under sequence parallelism])."""
    for name in PER_TOKEN_FIELDS:
        value = getattr(output, name, None)
        if torch.is_tensor(value):
            output[name] = gather_sequence(value, layout.group, layout.count)[:, :length - 1]
    tokens = output.label_mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    output["loss"] = -output.log_probs.sum() / tokens
    return output
