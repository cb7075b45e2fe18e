"""A lazily loaded model that no engine takes still works as a normal model.

[Note: materialising on first use]
While a stage-3 config is alive, ``from_pretrained`` returns a model whose parameters are on
the meta device (see [Note: lazy sharded loading] in hf_zero.integrations.zero3_loading).
``hf_zero.initialize`` reads each rank's shards into it. But a script may also use such a model
directly: a reference model for a loss comparison, the saved model checked after training (the
config is still alive then), a rank-0-only evaluation. So the model carries instance-level
wrappers of the methods that need real weights (``forward``, ``generate``, ``state_dict``,
``save_pretrained``, ``.to()`` and its relatives); the first call of any of them reads every
parameter whole from its files on this rank, with no collective (a model loaded by one rank
only works), logs one line, removes the wrappers and runs the method. ``initialize`` removes the
wrappers instead (:func:`disarm_materialisation`), so an engine's model never materialises.

``resize_token_embeddings`` before ``initialize`` materialises only the embeddings (they must
be real for transformers to copy and mean-initialise rows); ``initialize`` then takes those real
parameters as they are, rank 0's values broadcast (see ``initialize._agree_on_real_params``).
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any, Callable

import torch
from torch import nn

from hf_zero.engine.sharding.param_source import SOURCE_ATTRIBUTE, ParamSource

logger = logging.getLogger("hf_zero")

# Methods after which the model must hold real weights.
MATERIALISING_METHODS = ("forward", "generate", "state_dict", "save_pretrained", "to", "cuda", "cpu",
                         "half", "float", "bfloat16", "double")
_ARMED = "_hf_zero_materialise_on_use"  # the wrapped method names, in the instance __dict__
_WRAPPER = "_hf_zero_materialising_wrapper"  # set on each wrapper, so disarming removes only ours


# Every model armed here that is still alive: where a parameter's source is found from the
# parameter alone (hf_zero.compat.deepspeed's GatheredParameters before initialize).
_lazily_loaded: weakref.WeakSet = weakref.WeakSet()


def arm_materialisation(model: nn.Module) -> None:
    """Wrap the model's weight-reading methods; see [Note: materialising on first use]."""
    _lazily_loaded.add(model)
    names = [name for name in MATERIALISING_METHODS if hasattr(model, name)]
    for name in names:
        model.__dict__[name] = _materialising(model, getattr(model, name))
    if hasattr(model, "resize_token_embeddings"):
        model.__dict__["resize_token_embeddings"] = _resizing(model, model.resize_token_embeddings)
        names.append("resize_token_embeddings")
    model.__dict__[_ARMED] = names


def disarm_materialisation(model: nn.Module) -> None:
    """Remove the wrappers (an engine takes the model; its shards come from the files). A method
    that code patched over a wrapper since (TRL's fused LM head replaces ``forward``) is that
    code's and stays; a wrapper it captured finds no source left and just calls the method."""
    for module in model.modules():
        for name in module.__dict__.pop(_ARMED, []):
            if getattr(module.__dict__.get(name), _WRAPPER, False):
                module.__dict__.pop(name)


def is_armed(model: nn.Module) -> bool:
    return _ARMED in model.__dict__


def _materialising(model: nn.Module, method: Callable) -> Callable:
    # ``method`` is bound, so inspect.signature (the Trainer's column filter) sees no ``self``.
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        materialise(model, reason=method.__name__)
        return method(*args, **kwargs)

    setattr(call, _WRAPPER, True)
    return call


def _resizing(model: nn.Module, method: Callable) -> Callable:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        source = getattr(model, SOURCE_ATTRIBUTE)
        embeddings = [m for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None]
        names: dict[int, str] = {}  # a tied weight is saved under its first name
        for name, param in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), name)
        for module in embeddings:
            for param in module.parameters(recurse=False):
                _read_whole(source, names[id(param)], param)
        return method(*args, **kwargs)

    setattr(call, _WRAPPER, True)
    return call


def materialise(model: nn.Module, reason: str = "use") -> None:
    """Read every meta parameter of ``model`` whole from its files (this rank only, no
    collective) and make it an ordinary model again."""
    source = model.__dict__.get(SOURCE_ATTRIBUTE)
    disarm_materialisation(model)
    if source is None:
        return
    count = 0
    with torch.no_grad():
        for name, param in model.named_parameters():  # tied parameters once
            if param.is_meta:
                _read_whole(source, name, param)
                count += 1
        for name, buf in model.named_buffers():
            if source.has(name):
                source.fill_(name, tuple(buf.shape), 0, buf.numel(), buf.view(-1))
    delattr(model, SOURCE_ATTRIBUTE)
    logger.info("hf_zero: %s was loaded under a live stage-3 config but no engine took it; %s() "
                "made its %d parameters whole from %s on this rank", type(model).__name__, reason,
                count, source.description)


def materialise_params(params: list[nn.Parameter]) -> list[nn.Parameter]:
    """Read the meta ones of ``params`` whole from their lazily loaded model's source (this rank
    only, no collective); returns those read. ``initialize`` then takes them as real parameters
    (rank 0's values: ``initialize._agree_on_real_params``). A meta parameter of no lazily
    loaded model is an error."""
    wanted = {id(p): p for p in params if p.is_meta}
    read: list[nn.Parameter] = []
    with torch.no_grad():
        for model in list(_lazily_loaded):
            source = model.__dict__.get(SOURCE_ATTRIBUTE)
            if source is None:
                continue
            for name, param in model.named_parameters():
                if id(param) in wanted and param.is_meta:
                    _read_whole(source, name, param)
                    read.append(wanted.pop(id(param)))
    if wanted:
        raise ValueError(f"{len(wanted)} parameter(s) are on the meta device and belong to no model loaded under a "
                         "live stage-3 config, so there is nothing to read them from")
    return read


def _read_whole(source: Any, name: str, param: nn.Parameter) -> None:
    """Give a meta parameter its full value from ``source``, keeping the Parameter object (tied
    weights and optimizers built on it still refer to it)."""
    if not param.is_meta:
        return
    value = torch.empty(param.shape, dtype=param.dtype)
    source.fill_(name, tuple(param.shape), 0, param.numel(), value.view(-1))
    torch.utils.swap_tensors(param, nn.Parameter(value, requires_grad=param.requires_grad))


class WrappedModelSource:
    """The weight source of a lazily loaded model seen from a wrapper around it (a PEFT model):
    names lose the wrapper's prefix, and the ``.base_layer`` segment PEFT inserts when it wraps a
    layer with an adapter."""

    def __init__(self, source: ParamSource, prefix: str) -> None:
        self.source = source
        self.prefix = prefix + "." if prefix else ""

    def _inner(self, name: str) -> str:
        if self.prefix and name.startswith(self.prefix):
            name = name[len(self.prefix):]
        return name.replace(".base_layer.", ".")

    def has(self, name: str) -> bool:
        return self.source.has(self._inner(name))

    def fill_(self, name: str, shape: tuple[int, ...], start: int, stop: int, out: torch.Tensor) -> None:
        self.source.fill_(self._inner(name), shape, start, stop, out)

    def __getattr__(self, name: str) -> Any:  # description, agree_across_ranks
        return getattr(self.source, name)


def find_source(model: nn.Module) -> tuple[Any, nn.Module] | None:
    """(the weight source as ``model``'s parameter names see it, the module that carries it)."""
    for prefix, module in model.named_modules():
        source = module.__dict__.get(SOURCE_ATTRIBUTE)
        if source is not None:
            return (WrappedModelSource(source, prefix) if prefix else source), module
    return None


def initialise_new_adapters(model: nn.Module) -> list[str]:
    """Adapters added to a lazily loaded model (PEFT's LoRA layers) were created on the meta
    device next to their base weights, so they have no values, and the checkpoint has none for
    them: give them real storage and let the layer initialise them as PEFT would (``lora_B``
    zero, ``lora_A`` random; ``initialize`` then takes rank 0's values). Returns their names."""
    init_choice = {name: getattr(cfg, "init_lora_weights", True)
                   for name, cfg in getattr(model, "peft_config", {}).items()}
    made = []
    for module_name, module in model.named_modules():
        if not hasattr(module, "reset_lora_parameters"):
            continue
        for adapter in list(getattr(module, "lora_A", {})):
            parts = [getattr(module, attr)[adapter] for attr in ("lora_A", "lora_B") if adapter in getattr(module, attr, {})]
            if not any(p.is_meta for part in parts for p in part.parameters()):
                continue
            for part in parts:
                for param in part.parameters():
                    if param.is_meta:  # in place: an optimizer the Trainer built on it keeps it
                        real = nn.Parameter(torch.empty_like(param, device="cpu"), requires_grad=param.requires_grad)
                        torch.utils.swap_tensors(param, real)
            module.reset_lora_parameters(adapter, init_choice.get(adapter, True))
            made.append(f"{module_name}.lora_*.{adapter}")
    return made
