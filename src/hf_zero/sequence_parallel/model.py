"""Sequence parallelism put on an unmodified Hugging Face causal LM.

``check_model`` says what stops a model from being split (before any rank waits on another);
``attach`` then registers the attention wrapper ([Note: Ulysses attention]), shards every
training call's inputs ([Note: sharding the batch]) and gives the causal-LM heads the group's
loss ([Note: the sequence-parallel loss]).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hf_zero.sequence_parallel.attention import SUPPORTED, AttentionCalls, attach, check_heads
from hf_zero.sequence_parallel.batch import shard_inputs
from hf_zero.sequence_parallel.fused_head import is_fused_output, whole_sequence_outputs
from hf_zero.sequence_parallel.layout import SequenceParallelLayout
from hf_zero.sequence_parallel.loss import SequenceParallelLossFunction


def _text_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        return config.get_text_config()
    return config


def causal_lm_heads(model: nn.Module) -> list[nn.Module]:
    """The modules that compute a causal LM's loss (the ``...ForCausalLM`` inside any wrapper)."""
    from transformers import PreTrainedModel

    return [m for m in model.modules() if isinstance(m, PreTrainedModel) and type(m).__name__.endswith("ForCausalLM")]


def _uses_sliding_window(config: Any) -> bool:
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return any("sliding" in str(kind) for kind in layer_types)
    return bool(getattr(config, "sliding_window", None)) and getattr(config, "use_sliding_window", True) is not False


def check_model(model: nn.Module, size: int) -> None:
    """Raise with every reason ``model`` cannot train with ``sequence_parallel_size: size``."""
    config = _text_config(model)
    if config is None:
        raise ValueError("sequence parallelism needs a Hugging Face model (one with a .config); "
                         f"{type(model).__name__} has none")
    problems = []
    if not causal_lm_heads(model):
        problems.append(f"{type(model).__name__} is not a causal language model (an ...ForCausalLM): sequence "
                        "parallelism splits the sequence of a causal LM and computes its loss over the group")
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in SUPPORTED:
        problems.append(f"attention implementation {implementation!r} is not one sequence parallelism wraps "
                        f"({', '.join(SUPPORTED)}): load the model with attn_implementation=\"sdpa\"")
    if _uses_sliding_window(config):
        problems.append("the model uses sliding-window attention, which the causal full-sequence attention of "
                        "sequence parallelism does not reproduce: set use_sliding_window=False (or sliding_window=None) "
                        "if the windows are longer than your sequences")
    problems += check_heads(config, size)
    if problems:
        raise ValueError("sequence_parallel_size " + str(size) + ": " + "; ".join(problems))


class SequenceParallel:
    """The hooks and the loss that make ``model`` train with its sequences split over ``layout``."""

    def __init__(self, model: nn.Module, layout: SequenceParallelLayout) -> None:
        self.layout = layout
        self.model = model
        config = _text_config(model)
        self.pad_token_id = getattr(config, "pad_token_id", None) or 0
        self._checked = False
        self._calls_at_start = 0
        self._fused_call: tuple[int, Any] | None = None  # (sequence length, num_items_in_batch) of a fused call
        attach(model, config._attn_implementation, layout)
        for head in causal_lm_heads(model):
            if not isinstance(head.loss_function, SequenceParallelLossFunction):
                head.loss_function = SequenceParallelLossFunction(head, layout, head.loss_function)
        self._handles = [model.register_forward_pre_hook(self._shard, with_kwargs=True),
                         model.register_forward_hook(self._after_forward)]

    def _shard(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not module.training:
            return None
        check, self._checked = not self._checked, True
        self._calls_at_start = AttentionCalls.count
        self._fused_call = None
        if kwargs.get("fused_lm_head"):  # [Note: TRL's fused head under sequence parallelism]
            tokens = kwargs.get("input_ids", args[0] if args else kwargs.get("inputs_embeds"))
            if torch.is_tensor(tokens):  # else shard_inputs says what is missing
                self._fused_call = (int(tokens.shape[1]), kwargs.get("num_items_in_batch"))
        return shard_inputs(self.layout, args, kwargs, self.pad_token_id, check)

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if not module.training:
            return None
        self._check_attention_ran(module)
        fused, self._fused_call = self._fused_call, None
        if fused is not None and is_fused_output(output):
            return whole_sequence_outputs(output, self.layout, *fused)
        return None

    def _check_attention_ran(self, module: nn.Module) -> None:
        if AttentionCalls.count == self._calls_at_start:
            raise RuntimeError(
                f"{type(module).__name__}'s attention did not go through hf_zero's sequence-parallel attention, "
                "so each rank attended only to its own slice of the sequence; this model calls its attention "
                "outside transformers' attention registry and cannot be trained with sequence_parallel_size > 1")
