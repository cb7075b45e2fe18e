"""Each rank's slice of a batch: labels shifted first, positions kept, padded to a multiple of S.

[Note: sharding the batch]
A forward pre-hook on the model (in training mode) turns the whole batch, which every rank of a
sequence-parallel group receives, into this rank's slice along the sequence:
- ``labels`` are shifted over the whole sequence first (the target of the last token of one
  slice is the first token of the next), then sliced; the loss reads them as already shifted.
- ``position_ids`` are made (``arange``, what transformers makes without them) before slicing, so
  that rotary and absolute position embeddings see global positions.
- a length that S does not divide is padded on the right (labels -100, attention mask 0).
- ``attention_mask`` is dropped: attention runs causal over the whole sequence
  ([Note: Ulysses attention]), which is the same as the mask when padding is on the right.
The first batch of a run is checked (one host read, once): that the group's ranks got the same
samples, and that padding is on the right.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hf_zero.sequence_parallel.layout import SequenceParallelLayout

IGNORE_INDEX = -100
_PAD_VALUES = {"labels": IGNORE_INDEX, "attention_mask": 0}


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Position i's target is token i + 1; the last position has none."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def _pad(tensor: torch.Tensor, extra: int, value: float) -> torch.Tensor:
    if extra == 0:
        return tensor
    pad = [0, 0] * (tensor.dim() - 2) + [0, extra]
    return F.pad(tensor, pad, value=value)


def shard_inputs(layout: SequenceParallelLayout, args: tuple[Any, ...], kwargs: dict[str, Any],
                 pad_token_id: int, check: bool) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """This rank's slice of a model call's inputs ([Note: sharding the batch])."""
    kwargs = dict(kwargs)
    if args and torch.is_tensor(args[0]) and "input_ids" not in kwargs:
        kwargs["input_ids"], args = args[0], args[1:]
    if args:
        raise ValueError(
            f"sequence parallelism shards keyword inputs; call the model with input_ids=..., labels=... "
            f"(got {len(args)} more positional argument(s))")
    tokens = kwargs.get("input_ids")
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    if tokens is None:
        raise ValueError("sequence parallelism needs input_ids or inputs_embeds in the model call")
    batch, length = tokens.shape[0], tokens.shape[1]
    if kwargs.get("fused_lm_head") and kwargs.get("shift_labels") is not None:
        raise ValueError("sequence parallelism shifts the labels itself: call the model with labels=..., "
                         "not shift_labels=...")
    if kwargs.get("past_key_values") is not None:
        raise ValueError("sequence parallelism trains on whole sequences; a call with past_key_values "
                         "(generation) must run in eval mode (model.eval())")
    mask = kwargs.pop("attention_mask", None)
    if check:
        _check_batch(layout, tokens, mask)
    if kwargs.get("position_ids") is None:
        kwargs["position_ids"] = torch.arange(length, device=tokens.device).unsqueeze(0).expand(batch, -1)
    if kwargs.get("labels") is not None:
        kwargs["labels"] = shift_labels(kwargs["labels"])
    extra = -length % layout.size
    local = (length + extra) // layout.size
    start = layout.rank * local
    for name, value in list(kwargs.items()):
        if not torch.is_tensor(value) or value.dim() < 2 or tuple(value.shape[:2]) != (batch, length):
            continue
        if name == "position_ids" and extra:
            value = torch.cat([value, value[:, -1:] + torch.arange(1, extra + 1, device=value.device)], dim=1)
        else:
            value = _pad(value, extra, _PAD_VALUES.get(name, pad_token_id if name == "input_ids" else 0))
        kwargs[name] = value[:, start:start + local]
    if kwargs.get("fused_lm_head") and kwargs.get("labels") is not None:
        # TRL's fused head scores shift_labels as they are ([Note: TRL's fused head under
        # sequence parallelism] in fused_head.py); labels it would shift again.
        kwargs["shift_labels"] = kwargs.pop("labels")
    return (), kwargs


def _check_batch(layout: SequenceParallelLayout, tokens: torch.Tensor, mask: torch.Tensor | None) -> None:
    """The group's ranks must hold the same batch, padded on the right ([Note: sharding the batch])."""
    flat = tokens.reshape(tokens.shape[0], -1).to(layout.device, torch.float64)
    weights = torch.arange(1, flat.shape[1] + 1, device=flat.device, dtype=torch.float64)
    mine = torch.stack([torch.tensor(float(flat.numel()), device=flat.device, dtype=torch.float64),
                        (flat * weights).sum()])
    every = [torch.empty_like(mine) for _ in range(layout.size)]
    dist.all_gather(every, mine, group=layout.group)
    if any(not torch.equal(other, every[0]) for other in every):
        raise ValueError(
            "the ranks of a sequence-parallel group got different batches: they must see the same samples "
            "(each then takes 1/S of every sequence). Shard the data over the data-parallel ranks: "
            "DistributedSampler(dataset, num_replicas=engine.data_parallel_world_size, "
            "rank=engine.data_parallel_rank), or pass training_data= to hf_zero.initialize")
    if mask is not None and mask.dim() == 2 and bool((mask[:, 1:] > mask[:, :-1]).any()):
        raise ValueError(
            "sequence parallelism needs padding on the right (attention runs causal over the whole sequence); "
            "this batch's attention_mask has padding before tokens: set tokenizer.padding_side = \"right\"")
