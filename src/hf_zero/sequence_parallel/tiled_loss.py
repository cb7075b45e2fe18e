"""A causal LM's logits and loss a tile of tokens at a time, each tile recomputed in the backward.

[Note: tiled logits and loss]
At long sequences the logits, ``[batch, sequence, vocab]`` in fp32 with their log-softmax and
gradient, are a step's largest activation (8192 tokens x 128K vocabulary: 4 GiB, three times over).
With ``tiled_loss_tokens: T`` the causal LM's forward runs its base model, then, for each T tokens,
the output projection and the cross entropy under activation checkpointing: the forward keeps
only the hidden states and the labels of a tile, the backward recomputes the tile's logits, so at
most one tile's logits exist at a time. The loss equals the untiled one (a sum of per-tile sums,
divided once); ``outputs.logits`` is None in training. Under sequence parallelism the sum runs
over the group as in [Note: the sequence-parallel loss]. Evaluation runs the model's own forward.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from hf_zero.sequence_parallel.batch import IGNORE_INDEX, shift_labels
from hf_zero.sequence_parallel.layout import SequenceParallelLayout
from hf_zero.sequence_parallel.loss import mean_over_tokens

# Config attributes of heads that transform the logits after the projection (Gemma 2's soft-capping,
# Cohere's and Granite's scaling): the tiled forward would skip it.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def _tile_loss(hidden: torch.Tensor, labels: torch.Tensor, head: nn.Module) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def tiled_cross_entropy_sum(hidden: torch.Tensor, labels: torch.Tensor, head: nn.Module, tile_tokens: int) -> torch.Tensor:
    """``sum(cross_entropy(head(hidden), labels))`` over every token, ``tile_tokens`` at a time."""
    flat, targets = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1).to(hidden.device)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, flat.shape[0], tile_tokens):
        part = slice(start, start + tile_tokens)
        total = total + checkpoint(_tile_loss, flat[part], targets[part], head, use_reentrant=False)
    return total


def check_tiling(model: nn.Module, heads: list[nn.Module]) -> None:
    """Raise when ``model`` has no causal LM head to tile, or one that changes its logits in a
    way the tiles skip."""
    if not heads:
        raise ValueError(f"tiled_loss_tokens: {type(model).__name__} is not a causal language model (an ...ForCausalLM), "
                         "whose logits and loss the tiles compute; set tiled_loss_tokens to 0")
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    found = [name for name in _LOGIT_TRANSFORMS if getattr(config, name, None) not in (None, 1, 1.0)]
    if found:
        raise ValueError(f"tiled_loss_tokens: the model's head transforms its logits ({', '.join(found)}), which the "
                         "tiled loss does not reproduce; set tiled_loss_tokens to 0 for this model")


class TiledCausalLMForward:
    """What a causal LM's ``forward`` becomes with ``tiled_loss_tokens`` ([Note: tiled logits and loss])."""

    def __init__(self, head: nn.Module, tile_tokens: int, layout: SequenceParallelLayout | None) -> None:
        self.head = head
        self.tile_tokens = tile_tokens
        self.layout = layout
        self.original: Callable[..., Any] = head.forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        labels = kwargs.get("labels")
        if not self.head.training or labels is None:
            return self.original(*args, **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        kwargs = dict(kwargs)
        for name in ("labels", "logits_to_keep", "shift_labels"):
            kwargs.pop(name, None)
        num_items = kwargs.pop("num_items_in_batch", None)
        kwargs["return_dict"] = True
        outputs = self.head.base_model(*args, **kwargs)
        if self.layout is None:  # [Note: sharding the batch] shifts them under sequence parallelism
            labels = shift_labels(labels)
        total = tiled_cross_entropy_sum(outputs.last_hidden_state, labels, self.head.get_output_embeddings(),
                                        self.tile_tokens)
        loss = mean_over_tokens(total, labels, num_items, self.layout)
        return CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=getattr(outputs, "past_key_values", None),
                                      hidden_states=getattr(outputs, "hidden_states", None),
                                      attentions=getattr(outputs, "attentions", None))


def install_tiled_loss(heads: list[nn.Module], tile_tokens: int, layout: SequenceParallelLayout | None) -> None:
    for head in heads:
        if not isinstance(getattr(head, "forward", None), TiledCausalLMForward):
            head.forward = TiledCausalLMForward(head, tile_tokens, layout)
