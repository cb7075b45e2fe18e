"""torch.compile of each unit's forward: what ``engine.compile()`` does.

[Note: compiled units]
Compiling the whole model would trace hf_zero's module hooks, which issue collectives, move
unit states and register gradient hooks: none of that belongs in a graph. So each unit module
that is not the root (the blocks and the input embedding, see [Note: edge units] in
hf_zero.partition) has its ``forward`` replaced by ``torch.compile(forward)``: the hooks of
[Note: the unit protocol] still run eagerly around it, so the unit is gathered before its graph
runs and released after, and the gradient buckets fill as before. Dynamo lifts module
parameters into graph inputs (``inline_inbuilt_nn_modules``, the default since torch 2.5), so a
graph does not hold on to the storage that stage 3 frees and gathers again each step, and
identical blocks share one graph. What stays eager is the root's own code: the loss, the final
norm, lm_head, position embeddings. This is Accelerate's "regional compilation" and the per-block
``torch.compile`` FSDP2 documents.

An HF model with ``config.use_cache`` true builds a KV cache even in a training forward; the
layers' graphs then guard on the cache's state and recompile for every layer, falling back to
eager past Dynamo's cache limit (8). A training forward never reads that cache, so once compiled
a training forward (module in train mode, grad enabled, no ``use_cache`` or ``past_key_values``
passed) runs with ``use_cache=False``, as Transformers itself does under gradient checkpointing;
evaluation and ``generate`` keep the cache, and the saved config is untouched.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

logger = logging.getLogger("hf_zero")

_MARK = "_hf_zero_eager_forward"


def is_compiled(module: nn.Module) -> bool:
    return _MARK in module.__dict__


def compile_units(unit_modules: list[nn.Module], backend: str, compile_kwargs: dict[str, Any]) -> int:
    """Compile the forward of every unit module not compiled yet; returns how many were."""
    compiled = 0
    for module in unit_modules:
        if is_compiled(module):
            continue
        eager = module.forward
        module.__dict__[_MARK] = eager
        module.forward = torch.compile(eager, backend=backend, **compile_kwargs)
        compiled += 1
    return compiled


def _no_cache_in_training(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    if module.training and torch.is_grad_enabled() and "use_cache" not in kwargs and "past_key_values" not in kwargs:
        kwargs = {**kwargs, "use_cache": False}
    return args, kwargs


def training_without_cache(model: nn.Module) -> RemovableHandle | None:
    """The root hook of [Note: compiled units] for models whose forward takes ``use_cache``."""
    try:
        takes_cache = "use_cache" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        takes_cache = False
    if not takes_cache:
        return None
    return model.register_forward_pre_hook(_no_cache_in_training, with_kwargs=True)
