"""Ulysses attention through transformers' attention interface.

[Note: Ulysses attention]
Outside attention every rank holds 1/S of the sequence and all the heads. A model's attention
module computes q, k and v for its slice and calls the attention function its config names
(``config._attn_implementation``) through ``ALL_ATTENTION_FUNCTIONS``. hf_zero puts a wrapper
under that same name, around the function that was there (for "eager", the model's own
``eager_attention_forward``): an all-to-all turns q, k, v into the whole sequence for 1/S of the
heads, the core attention runs on that as it would without sequence parallelism, and a second
all-to-all turns the output back into this rank's slice with all the heads. Keeping the name
keeps every branch transformers takes on it (mask creation, flash's special cases).

- Masks: the model made its mask for the local slice, which does not fit the whole sequence.
  sdpa and flash run causal with no mask (``is_causal``); eager gets a causal mask of the full
  length. Padding must therefore be on the right, where causal attention never looks
  (hf_zero.sequence_parallel.batch checks it on the first batch).
- Grouped-query attention: with at least S key/value heads each rank takes its share of them;
  with fewer, each is repeated S / kv_heads times so that every rank holds the one its query
  heads use, and the module's ``num_key_value_groups`` is set for the call.
- A module that is not attached (another model) or in eval mode gets the wrapped function
  unchanged: evaluation and generation run on whole sequences.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch
from torch import nn

from hf_zero.sequence_parallel.exchange import heads_to_sequence, sequence_to_heads
from hf_zero.sequence_parallel.layout import SequenceParallelLayout

ATTACHED = "_hf_zero_sequence_parallel"  # module attribute: the attention's SequenceParallelLayout
SUPPORTED = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flash_attention_4")

_wrapped: dict[str, Callable[..., Any] | None] = {}  # implementation -> the function wrapped


class AttentionCalls:
    """How many attention calls went through the exchange: a model whose attention bypasses the
    registry would otherwise train on local attention without a word."""

    count = 0


def _core(implementation: str, module: nn.Module) -> Callable[..., Any]:
    core = _wrapped.get(implementation)
    if core is not None:
        return core
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise NotImplementedError(
            f"{type(module).__name__} has no eager_attention_forward in its module; load the model with "
            "attn_implementation=\"sdpa\" for sequence parallelism")
    return eager


def _causal_mask(length: int, like: torch.Tensor) -> torch.Tensor:
    blocked = torch.ones(length, length, dtype=torch.bool, device=like.device).triu(1)
    return torch.zeros(length, length, dtype=like.dtype, device=like.device).masked_fill(
        blocked, torch.finfo(like.dtype).min)[None, None]


def _kv_for_group(states: torch.Tensor, size: int) -> torch.Tensor:
    heads = states.shape[1]
    if heads % size == 0:
        return states
    return states.repeat_interleave(size // heads, dim=1)  # [Note: Ulysses attention], grouped-query


def _make_wrapper(implementation: str) -> Callable[..., Any]:
    def ulysses_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
        layout: SequenceParallelLayout | None = getattr(module, ATTACHED, None)
        core = _core(implementation, module)
        if layout is None or not module.training:
            return core(module, query, key, value, attention_mask, *args, **kwargs)
        AttentionCalls.count += 1
        size, send = layout.size, layout.all_to_all
        query = heads_to_sequence(query, size, send)
        key = heads_to_sequence(_kv_for_group(key, size), size, send)
        value = heads_to_sequence(_kv_for_group(value, size), size, send)
        kwargs.pop("position_ids", None)  # local positions; the core attention runs causal instead
        mask = _causal_mask(query.shape[2], query) if implementation == "eager" else None
        groups = getattr(module, "num_key_value_groups", None)
        if groups is not None:
            module.num_key_value_groups = query.shape[1] // key.shape[1]
        try:
            output, _ = core(module, query, key, value, mask, *args, **kwargs)
        finally:
            if groups is not None:
                module.num_key_value_groups = groups
        return sequence_to_heads(output, size, send), None

    ulysses_attention.hf_zero_sequence_parallel = True  # type: ignore[attr-defined]
    return ulysses_attention


def register(implementation: str) -> None:
    """Put the wrapper under ``implementation`` in transformers' attention registry (once)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if implementation in _wrapped:
        return
    current = ALL_ATTENTION_FUNCTIONS[implementation] if implementation in ALL_ATTENTION_FUNCTIONS else None
    if getattr(current, "hf_zero_sequence_parallel", False):
        return
    _wrapped[implementation] = current
    ALL_ATTENTION_FUNCTIONS[implementation] = _make_wrapper(implementation)


def attach(model: nn.Module, implementation: str, layout: SequenceParallelLayout) -> None:
    """Register the wrapper under ``implementation`` and point ``model``'s attention modules at ``layout``."""
    register(implementation)
    for module in model.modules():
        if "Attention" in type(module).__name__:
            setattr(module, ATTACHED, layout)


def check_heads(config: Any, size: int) -> list[str]:
    """What about the model's heads stops a split over ``size`` ranks, as sentences with the fix."""
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads is None:
        return ["the model's config has no num_attention_heads"]
    problems = []
    if heads % size:
        problems.append(f"{heads} attention heads are not divisible by sequence_parallel_size {size}: "
                        f"choose a sequence_parallel_size that divides {heads}")
    if kv_heads % size and size % kv_heads:
        problems.append(f"{kv_heads} key/value heads and sequence_parallel_size {size}: one must divide the "
                        "other (each rank takes kv_heads / S heads, or each head is repeated S / kv_heads times)")
    return problems
