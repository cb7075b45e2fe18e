"""torch.compile of each unit's forward: what ``engine.compile()`` does.

[Note: compiled units]
Compiling the whole model would trace hf_zero's module hooks, which issue collectives, move
unit states and register gradient hooks: none of that belongs in a graph. So each unit module
that is not the root (the blocks, the input embedding and the head, see [Note: edge units] in
hf_zero.partition) has its ``forward`` replaced by ``torch.compile(forward)``: the hooks of
[Note: the unit protocol] still run eagerly around it, so the unit is gathered before its graph
runs and released after, and the gradient buckets fill as before. Dynamo lifts module
parameters into graph inputs (``inline_inbuilt_nn_modules``, the default since torch 2.5), so a
graph does not hold on to the storage that stage 3 frees and gathers again each step, and
identical blocks share one graph. What stays eager is the root's own code: the loss, the final
norm, position embeddings. This is Accelerate's "regional compilation" and the per-block
``torch.compile`` FSDP2 documents.

An HF model with ``config.use_cache`` true builds a KV cache even in a training forward; the
layers' graphs then guard on the cache's state and recompile for every layer, falling back to
eager past Dynamo's cache limit (8). A training forward never reads that cache, so once compiled
a training forward (module in train mode, grad enabled, no ``use_cache`` or ``past_key_values``
passed) runs with ``use_cache=False``, as Transformers itself does under gradient checkpointing;
evaluation and ``generate`` keep the cache, and the saved config is untouched.

[Note: a checkpoint inside a unit's graph]
Since transformers 5.2x a layer's gradient checkpointing lives in its ``forward``
(``GradientCheckpointingLayer``'s ``forward_with_checkpointing``), so the compiled forward of a
checkpointed block traces ``torch.utils.checkpoint`` as a higher-order op. Inside it the block
touches transformers' output-capture variable (``CompileableContextVar``, which turns into a plain
global under Dynamo), a mutation Dynamo refuses to trace in a checkpoint unless it may skip
replaying it in the backward's recomputation: with transformers 5.25 the graph broke and every
block ran eagerly (2 graphs instead of 3 for tiny_llama). That state only gathers outputs for the
forward's return value, which the recomputation discards, so each unit's compiled forward is
traced with ``skip_fwd_side_effects_in_bwd_under_checkpoint`` on, for its own calls only (the
user's other compiles keep Dynamo's default); test_compiled_units.py's checkpointed stage-3 case
compiles 3 graphs and trains to eager's losses and weights.

[Note: no CUDA graphs under stage 3]
A CUDA graph (``mode="reduce-overhead"`` and ``"max-autotune"``, inductor's
``options={"triton.cudagraphs": True}``, the ``cudagraphs`` backend) replays the kernels it
recorded on the memory addresses it recorded. Stage 3 gathers each unit's parameters into a
buffer allocated for that unit's forward and freed after it, at a new address every step (see
[Note: views into flat buffers] in param_storage.py): a replay would read whatever lives at the
old address by then. So ``engine.compile`` refuses these at stage 3, before compiling anything;
the other modes compile as above, and stages 0-2 keep their parameters in place.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

logger = logging.getLogger("hf_zero")

_MARK = "_hf_zero_eager_forward"
_SKIP_REPLAY = "skip_fwd_side_effects_in_bwd_under_checkpoint"  # [Note: a checkpoint inside a unit's graph]


def is_compiled(module: nn.Module) -> bool:
    return _MARK in module.__dict__


def cuda_graphs_requested(backend: str, compile_kwargs: dict[str, Any]) -> str | None:
    """What in a ``torch.compile`` call records CUDA graphs (as the user wrote it), or None."""
    if backend == "cudagraphs":
        return 'backend="cudagraphs"'
    if backend != "inductor":
        return None
    import torch._inductor.config  # what engine.compile imports anyway; not at hf_zero's import

    options = compile_kwargs.get("options") or {}
    if options.get("triton.cudagraphs"):
        return 'options={"triton.cudagraphs": True}'
    mode = compile_kwargs.get("mode")
    try:
        mode_options = torch._inductor.list_mode_options(mode) if mode else {}
    except RuntimeError:  # an unknown mode: torch.compile names the valid ones
        mode_options = {}
    if mode_options.get("triton.cudagraphs"):
        return f"mode={mode!r}"
    if "triton.cudagraphs" not in options and torch._inductor.config.triton.cudagraphs:
        return "torch._inductor.config.triton.cudagraphs = True"
    return None


def refuse_cuda_graphs_at_stage3(shards_params: bool, backend: str, compile_kwargs: dict[str, Any]) -> None:
    """[Note: no CUDA graphs under stage 3]: refused when the policy shards parameters."""
    requested = cuda_graphs_requested(backend, compile_kwargs)
    if shards_params and requested is not None:
        raise NotImplementedError(
            f"engine.compile with {requested} records CUDA graphs, which replay fixed memory addresses, but ZeRO "
            "stage 3 gathers every unit's parameters into a new buffer each step and frees it after the unit: "
            "CUDA graphs at stage 3 are not supported. Compile without them: engine.compile(compile_kwargs="
            "{'mode': 'default'}) or {'mode': 'max-autotune-no-cudagraphs'} (the Trainer: torch_compile_mode), "
            "with neither options['triton.cudagraphs'], torch._inductor.config.triton.cudagraphs nor "
            "backend='cudagraphs'; or train at stage 2, whose parameters stay in place.")


def compile_units(unit_modules: list[nn.Module], backend: str, compile_kwargs: dict[str, Any],
                  shards_params: bool) -> int:
    """Compile the forward of every unit module not compiled yet; returns how many were. Refuses
    CUDA graphs at stage 3 before compiling anything ([Note: no CUDA graphs under stage 3])."""
    refuse_cuda_graphs_at_stage3(shards_params, backend, compile_kwargs)
    compiled = 0
    for module in unit_modules:
        if is_compiled(module):
            continue
        eager = module.forward
        module.__dict__[_MARK] = eager
        compiled_forward = torch.compile(eager, backend=backend, **compile_kwargs)
        module.forward = _checkpoint_side_effects_not_replayed(eager, compiled_forward)
        compiled += 1
    return compiled


def _checkpoint_side_effects_not_replayed(eager: Any, compiled: Any) -> Any:
    """``compiled``, traced with [Note: a checkpoint inside a unit's graph]'s Dynamo setting."""
    if not hasattr(torch._dynamo.config, _SKIP_REPLAY):  # a torch without the setting traces as before
        return compiled

    @functools.wraps(eager)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with torch._dynamo.config.patch(**{_SKIP_REPLAY: True}):
            return compiled(*args, **kwargs)
    return forward


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
