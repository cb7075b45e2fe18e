"""Full weights in and out of a ZeroEngine, for the Transformers and Accelerate integrations.

Nothing here imports transformers or accelerate: these are engine-level helpers that the
integrations call when they save a model folder, load one back, or hand a model back unsharded.

Which copy of the weights is saved: [Note: which copy of the weights is saved] in
hf_zero.engine.full_state.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hf_zero.engine.engine import ZeroEngine
from hf_zero.engine.full_state import gather_full_state_dict
from hf_zero.engine.sharding.flat_group import FlatParamGroup

logger = logging.getLogger("hf_zero")

# A model wrapped by an engine records it here (in the instance __dict__, so nn.Module does not
# register the engine as a submodule).
ENGINE_ATTR = "_hf_zero_engine"


def engine_of(model: nn.Module | None) -> ZeroEngine | None:
    """The engine that wraps ``model`` (or ``model`` itself when it is one), else None."""
    if model is None:
        return None
    if isinstance(model, ZeroEngine):
        return model
    return model.__dict__.get(ENGINE_ATTR)


def attach_engine(engine: ZeroEngine) -> None:
    """Record the engine on its module, and under stage 3 set the flag transformers reads to pass
    ``synced_gpus=True`` to ``generate`` (``is_deepspeed_zero3_enabled``, read by ``GenerationMixin``): a rank that has
    finished generating keeps running forwards, so the other ranks' unit gathers still complete.
    Under stage 3 the module's ``save_pretrained`` also gathers its weights first: see
    [Note: save_pretrained on a stage-3 module]."""
    engine.module.__dict__[ENGINE_ATTR] = engine
    if engine.stage == 3:
        engine.module._is_fsdp_managed_module = True
        _wrap_save_pretrained(engine)


# [Note: save_pretrained on a stage-3 module]
# Scripts save the model they unwrapped: ``accelerator.unwrap_model(model).save_pretrained(dir,
# is_main_process=accelerator.is_main_process, save_function=accelerator.save)`` on every rank
# (transformers' run_*_no_trainer.py examples). Under stage 3 that module's parameters are
# freed shards, so transformers' own ``save_pretrained`` would read empty storage (and fail in
# its shared-tensor check on a tied embedding). The engine's module therefore carries an
# instance-level ``save_pretrained`` that, when the caller passes no ``state_dict``, gathers the
# full weights unit by unit (gather_full_state_dict: collective, so every rank must call it, as
# these scripts do) and lets rank 0, which holds them, write the folder through the original
# method with its other arguments unchanged; the other ranks write nothing. A caller's own
# ``state_dict`` (``accelerator.get_state_dict(model)``, the Trainer's save) is passed through.
_SAVE_WRAPPER = "_hf_zero_gathering_save"  # set on the wrapper, so release_engine removes only ours


def _wrap_save_pretrained(engine: ZeroEngine) -> None:
    module = engine.module
    original = getattr(module, "save_pretrained", None)
    if original is None or getattr(original, _SAVE_WRAPPER, False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def save_pretrained(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        extra = bound.arguments.get("kwargs", {})  # PEFT's save_pretrained takes state_dict in **kwargs
        if bound.arguments.get("state_dict", extra.get("state_dict")) is not None:
            return original(*args, **kwargs)
        state_dict = gather_full_state_dict(engine)  # collective: see the Note
        if engine.rank != 0:
            return None
        if "state_dict" in signature.parameters:
            bound.arguments["state_dict"] = state_dict
        else:
            bound.arguments.setdefault("kwargs", {})["state_dict"] = state_dict
        return original(*bound.args, **bound.kwargs)

    setattr(save_pretrained, _SAVE_WRAPPER, True)
    module.__dict__["save_pretrained"] = save_pretrained


def _unwrap_save_pretrained(module: nn.Module) -> None:
    if getattr(module.__dict__.get("save_pretrained"), _SAVE_WRAPPER, False):
        module.__dict__.pop("save_pretrained")


def load_state_dict_into_engine(engine: ZeroEngine, state_dict: Mapping[str, torch.Tensor]) -> list[str]:
    """Copy full weights into the engine's parameters (shards and fp32 masters included).

    Collective. Every rank passes the same ``state_dict`` (for example each read the same
    safetensors file); rank 0's values are broadcast. Returns the parameter names the state dict
    did not have (they keep their current values).
    """
    names_of: dict[int, list[str]] = {}
    for name, param in engine.module.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    missing: list[str] = []
    for unit in engine.units:
        params = [p for group in unit.groups for p in group.params]
        if not params:
            continue
        with torch.no_grad(), engine.gathered_parameters(params, modifier_rank=0):
            for param in params:
                names = names_of.get(id(param), [])
                source = next((state_dict[n] for n in names if n in state_dict), None)
                if source is None:
                    missing.extend(names[:1])
                    continue
                param.copy_(source.to(param.device, param.dtype).reshape(param.shape))
        for group in unit.groups:
            _load_master_exactly(group, state_dict, names_of)
    buffers = dict(engine.module.named_buffers())
    with torch.no_grad():
        for name, buf in buffers.items():
            if name in state_dict:
                buf.copy_(state_dict[name].to(buf.device, buf.dtype))
    return missing


def _load_master_exactly(
    group: FlatParamGroup, state_dict: Mapping[str, torch.Tensor], names_of: dict[int, list[str]]
) -> None:
    """A separate fp32 master (16-bit compute) takes the state dict's values, not the 16-bit
    rounding that ``gathered_parameters`` refreshed it from."""
    if group.master_state.tensor is None or group.master_state.is_compute_shard:
        return
    master = group.master_state.read()  # a copy under offload_optimizer nvme, written back below
    lo, hi = group.layout.shard_range(group.comm.rank) if group.layout.world_size > 1 else (0, master.numel())
    for slot, param in zip(group.layout.slots, group.params):
        start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        source = next((state_dict[n] for n in names_of.get(id(param), []) if n in state_dict), None)
        if source is None or start >= end:
            continue
        flat = source.reshape(-1)[start - slot.offset : end - slot.offset]
        master[start - lo : end - lo].copy_(flat.to(master.device, torch.float32))
    group.master_state.write(master)


def release_engine(engine: ZeroEngine) -> nn.Module:
    """Give the module back as a plain, unsharded module and detach the engine from it.

    Used when an evaluation-only (optimizer-less) stage-3 engine must make way for a training
    engine: parameters become ordinary full tensors again (in the engine's compute dtype) and the
    hooks are removed. The engine must not be used afterwards.
    """
    module = engine.module
    with torch.no_grad(), engine.gathered_parameters():
        for param in module.parameters():
            param.data = param.data.clone()
            param.grad = None
    engine.protocol.remove()
    _unwrap_save_pretrained(module)
    module.__dict__.pop(ENGINE_ATTR, None)
    module.__dict__.pop("_is_fsdp_managed_module", None)
    return module
