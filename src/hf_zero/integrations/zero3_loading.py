"""Sharded ``from_pretrained`` while a stage-3 HfZeroConfig is alive (see config/live.py).

[Note: lazy sharded loading]
DeepSpeed's ``zero.Init`` partitions parameters as modules are constructed, which needs patches
on every ``nn.Module.__init__`` and tensor constructor. hf_zero does less: ``from_pretrained``
builds the model with its *parameters* on the meta device (buffers stay real, so computed
buffers such as rotary frequencies are right), and attaches a :class:`SafetensorsSource` naming
the checkpoint files. Nothing is read yet. ``hf_zero.initialize`` then lays out each unit and
reads, parameter by parameter, only the element ranges this rank owns (its shard under stage 3)
from the files. The peak memory of a rank is its shards plus one parameter, and every rank
reads the same files, so no broadcast is needed.

The model is named the ways users name it: a local folder or a hub id (resolved through
``huggingface_hub``'s cache with transformers' own ``cached_file``, so ``HF_HUB_OFFLINE``,
``cache_dir``, ``revision``, ``subfolder`` and ``token`` mean what they mean to a plain load),
with a single safetensors file or shards and their index. The keywords example scripts and TRL
pass (``config``, ``dtype``/``torch_dtype``, ``attn_implementation``, ``low_cpu_mem_usage``,
``trust_remote_code``, ``from_tf=False``, config attributes such as ``use_cache``...) keep this
path. What it cannot do as a plain load would (``.bin``-only weights, ``device_map``,
quantization, ``from_tf=True``, a checkpoint lacking some weights...) loads the whole model on
every rank, with a WARNING on every rank naming the reason; ``initialize`` then shards it.

A model loaded this way and never given to an engine is still a normal model: see
[Note: materialising on first use] in hf_zero.engine.sharding.deferred_load. PEFT adapters added to it
keep the values PEFT drew for them: see [Note: adapters on a lazily loaded base].
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_zero.engine.sharding.deferred_load import arm_materialisation
from hf_zero.engine.sharding.param_source import SOURCE_ATTRIBUTE, InitSource, SafetensorsSource

logger = logging.getLogger("hf_zero")

_installed = False

# Where the files are: passed to transformers' cached_file as a plain load passes them.
_DOWNLOAD_KWARGS = ("cache_dir", "force_download", "local_files_only", "revision", "token", "proxies",
                    "subfolder")
# Accepted and without effect on what is loaded (transformers ignores or only records them).
_NO_EFFECT_KWARGS = {"low_cpu_mem_usage", "trust_remote_code", "_from_auto", "_from_pipeline",
                     "_commit_hash", "weights_only", "disable_mmap", "mirror", "_fast_init",
                     "offload_state_dict", "tqdm_class", "adapter_name", "adapter_kwargs", "use_safetensors",
                     "output_loading_info", "generation_config", "config", "dtype", "torch_dtype",
                     "attn_implementation", "experts_implementation"}
# Meaningful only with a truthy / non-None value, which the sharded path cannot honour: the
# model is then loaded whole, with a warning naming the keyword.
_FULL_LOAD_KWARGS = ("from_tf", "from_flax", "state_dict", "device_map", "max_memory", "offload_folder",
                     "offload_buffers", "quantization_config", "load_in_8bit", "load_in_4bit", "gguf_file",
                     "tp_plan", "tp_size", "distributed_config", "device_mesh", "use_kernels", "kernel_config",
                     "fusion_config", "key_mapping", "variant", "ignore_mismatched_sizes")

SAFE_INDEX, SAFE_SINGLE = "model.safetensors.index.json", "model.safetensors"
BIN_INDEX, BIN_SINGLE = "pytorch_model.bin.index.json", "pytorch_model.bin"


@dataclass
class LazyPlan:
    """What a sharded load needs: the weight files and the config / model keywords."""

    files: list[str]
    download_kwargs: dict[str, Any]
    model_kwargs: dict[str, Any] = field(default_factory=dict)


def install() -> None:
    """Patch ``PreTrainedModel.from_pretrained`` once; it defers to the original unless a stage-3
    config is alive."""
    global _installed
    if _installed:
        return
    from transformers import PreTrainedModel

    original = PreTrainedModel.from_pretrained.__func__

    def from_pretrained(cls: Any, pretrained_model_name_or_path: Any, *model_args: Any, **kwargs: Any) -> Any:
        from hf_zero.config.live import live_zero3_config

        if live_zero3_config() is None or pretrained_model_name_or_path is None:
            return original(cls, pretrained_model_name_or_path, *model_args, **kwargs)
        plan = plan_lazy_load(str(pretrained_model_name_or_path), model_args, kwargs)
        if isinstance(plan, str):
            logger.warning("hf_zero: from_pretrained(%r) loads the whole model on this rank, not "
                           "sharded: %s", str(pretrained_model_name_or_path), plan)
            return original(cls, pretrained_model_name_or_path, *model_args, **kwargs)
        model = lazy_from_pretrained(cls, str(pretrained_model_name_or_path), plan, **kwargs)
        if isinstance(model, str):
            logger.warning("hf_zero: from_pretrained(%r) loads the whole model on this rank, not "
                           "sharded: %s", str(pretrained_model_name_or_path), model)
            return original(cls, pretrained_model_name_or_path, *model_args, **kwargs)
        return model

    from_pretrained.__doc__ = original.__doc__
    PreTrainedModel.from_pretrained = classmethod(from_pretrained)
    original_from_config = PreTrainedModel._from_config.__func__

    def _from_config(cls: Any, config: Any, **kwargs: Any) -> Any:
        from hf_zero.config.live import live_zero3_config

        if live_zero3_config() is None:
            return original_from_config(cls, config, **kwargs)
        return lazy_from_config(cls, config, **kwargs)

    _from_config.__doc__ = original_from_config.__doc__
    PreTrainedModel._from_config = classmethod(_from_config)
    _keep_new_adapter_values()
    _installed = True


# [Note: adapters on a lazily loaded base]
# PEFT makes each adapter layer (``lora_A`` / ``lora_B``...) on the CPU, initialises it from the
# global generator, then moves it to its base layer's device (the layer's
# ``_move_adapter_to_device_of_base_layer``, then the tuner's ``_replace_module``). On a lazily
# loaded base that device is meta, so the values were dropped and ``initialize`` drew new ones
# (deferred_load.initialise_new_adapters), later in the generator's stream than PEFT drew them:
# the same distribution as a plain load, other values, and a stage-3 LoRA run did not follow
# DDP's curve. While a stage-3 config is alive, the values PEFT made for an adapter whose base
# weight is on the meta device are kept when the layer moves it, and put back, in the base's
# dtype, when the injection ends (``BaseTuner.inject_adapter``): the adapters are then real
# tensors holding what a plain load holds, and ``initialize`` takes them as they are (rank 0's,
# as DDP broadcasts them).
_MADE_VALUES = "_hf_zero_made_adapter_values"


def _keep_new_adapter_values() -> None:
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        return
    from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer

    move, inject = BaseTunerLayer._move_adapter_to_device_of_base_layer, BaseTuner.inject_adapter

    def _move_adapter_to_device_of_base_layer(self: Any, adapter_name: str, device: Any = None) -> None:
        from hf_zero.config.live import live_zero3_config

        if device is None and live_zero3_config() is not None:
            _remember_values_before_meta(self, adapter_name)
        return move(self, adapter_name, device)

    def inject_adapter(self: Any, model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        result = inject(self, model, *args, **kwargs)
        _restore_remembered_values(model)
        return result

    _move_adapter_to_device_of_base_layer.__doc__, inject_adapter.__doc__ = move.__doc__, inject.__doc__
    BaseTunerLayer._move_adapter_to_device_of_base_layer = _move_adapter_to_device_of_base_layer
    BaseTuner.inject_adapter = inject_adapter


def _adapter_tensors(layer: Any, adapter_name: str) -> Iterator[tuple[tuple[str, str], torch.Tensor]]:
    """((holder attribute, parameter name), tensor) of one adapter of a PEFT layer."""
    for attr in (*layer.adapter_layer_names, *layer.other_param_names):
        holder = getattr(layer, attr, None)
        if isinstance(holder, torch.nn.ModuleDict) and adapter_name in holder:
            for name, param in holder[adapter_name].named_parameters():
                yield (attr, name), param
        elif isinstance(holder, torch.nn.ParameterDict) and adapter_name in holder:
            yield (attr, ""), holder[adapter_name]


def _remember_values_before_meta(layer: Any, adapter_name: str) -> None:
    """See [Note: adapters on a lazily loaded base]."""
    base = layer.get_base_layer()
    weight = getattr(base, "weight", None)
    if not isinstance(weight, torch.Tensor) or not weight.is_meta:
        return
    made = layer.__dict__.setdefault(_MADE_VALUES, {})
    for (attr, name), tensor in _adapter_tensors(layer, adapter_name):
        if not tensor.is_meta:
            made[(attr, adapter_name, name)] = tensor.detach().clone()


def _restore_remembered_values(model: torch.nn.Module) -> None:
    for layer in model.modules():
        made = layer.__dict__.pop(_MADE_VALUES, None)
        for (attr, adapter_name, name), value in (made or {}).items():
            holder = getattr(layer, attr)[adapter_name]
            param = holder.get_parameter(name) if name else holder
            if param.is_meta:  # in place: whatever refers to the Parameter keeps it
                real = torch.nn.Parameter(value.to(param.dtype), requires_grad=param.requires_grad)
                torch.utils.swap_tensors(param, real)


def plan_lazy_load(path: str, model_args: tuple, kwargs: dict[str, Any]) -> LazyPlan | str:
    """The sharded load of ``path``, or the reason it must be a full load."""
    if model_args:
        return f"{len(model_args)} positional model argument(s) after the path (pass them by keyword)"
    refused = [k for k in _FULL_LOAD_KWARGS if kwargs.get(k)]
    if (kwargs.get("adapter_kwargs") or {}).get("_adapter_model_path"):
        refused.append("adapter_kwargs")  # a PEFT adapter folder: transformers loads its base, then it
    if refused:
        return f"{', '.join(f'{k}={kwargs[k]!r}' for k in refused)} (the sharded path reads safetensors " \
               "weights as saved, onto no device map and without quantization)"
    if kwargs.get("use_safetensors") is False:
        return "use_safetensors=False (the sharded path reads safetensors only)"
    download = {k: kwargs[k] for k in _DOWNLOAD_KWARGS if kwargs.get(k) is not None}
    files = _safetensors_files(path, download)
    if isinstance(files, str):
        return files
    rest = {k: v for k, v in kwargs.items()
            if k not in _DOWNLOAD_KWARGS and k not in _NO_EFFECT_KWARGS and k not in _FULL_LOAD_KWARGS}
    return LazyPlan(files, download, rest)


def _cached(path: str, filename: str, download: dict[str, Any]) -> str | None:
    from transformers.utils import cached_file

    return cached_file(path, filename, _raise_exceptions_for_missing_entries=False,
                       _raise_exceptions_for_connection_errors=False, **download)


def _safetensors_files(path: str, download: dict[str, Any]) -> list[str] | str:
    """The checkpoint's safetensors files (local folder or the hub cache), or why there are none."""
    try:
        index = _cached(path, SAFE_INDEX, download)
        if index is not None:
            with open(index, encoding="utf-8") as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
            files = [_cached(path, name, download) for name in names]
            absent = [n for n, f in zip(names, files) if f is None]
            if absent:
                return f"{SAFE_INDEX} names {absent} but they are not available"
            return [f for f in files if f is not None]
        single = _cached(path, SAFE_SINGLE, download)
        if single is not None:
            return [single]
        if _cached(path, BIN_INDEX, download) or _cached(path, BIN_SINGLE, download):
            return ("the checkpoint has only PyTorch .bin weights; the sharded path reads safetensors "
                    "(re-save it once with save_pretrained(..., safe_serialization=True))")
    except (OSError, ValueError) as error:  # not found, no access: the full load says why
        return f"its files could not be resolved ({error})"
    return "no model.safetensors or model.safetensors.index.json was found"


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    if dtype.is_floating_point:
        torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _resolve_dtype(requested: Any, config: Any, source: SafetensorsSource) -> torch.dtype:
    """The parameters' dtype as a plain load picks it: a dtype or its name as given; "auto" is
    the config's ``dtype`` or else the checkpoint's first floating-point tensor's. Nothing given
    means "auto" from transformers 5 on, the default dtype before."""
    import transformers

    if requested is None:
        requested = "auto" if int(transformers.__version__.split(".")[0]) >= 5 else torch.get_default_dtype()
    if isinstance(requested, str) and requested != "auto":
        requested = getattr(torch, requested)
    if isinstance(requested, torch.dtype):
        return requested
    configured = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(configured, str):
        configured = getattr(torch, configured)
    return configured or source.first_floating_dtype() or torch.get_default_dtype()


def _load_config(cls: Any, path: str, plan: LazyPlan, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """(config, model keywords) as a plain load makes them: config attributes among the keywords
    update the config; the others go to the model's constructor."""
    from transformers import PretrainedConfig

    config = kwargs.get("config")
    if isinstance(config, PretrainedConfig):
        return copy.deepcopy(config), dict(plan.model_kwargs)
    config, model_kwargs = cls.config_class.from_pretrained(
        path if config is None else config, return_unused_kwargs=True, **plan.download_kwargs,
        **plan.model_kwargs)
    return config, model_kwargs


def lazy_from_pretrained(cls: Any, path: str, plan: LazyPlan, **kwargs: Any) -> Any:
    """The model with meta parameters and a weight source (see [Note: lazy sharded loading]),
    or why it must be loaded whole."""
    from accelerate import init_empty_weights

    config, model_kwargs = _load_config(cls, path, plan, kwargs)
    for name in ("attn_implementation", "experts_implementation"):
        if kwargs.get(name):
            setattr(config, f"_{name}", kwargs[name])
    source = SafetensorsSource(plan.files, getattr(cls, "base_model_prefix", ""))
    dtype = _resolve_dtype(kwargs.get("dtype", kwargs.get("torch_dtype")), config, source)
    config.dtype = dtype
    config.name_or_path = path  # as a plain load: TRL and the Trainer read it back (tokenizer, model card)
    with init_empty_weights(include_buffers=False), _default_dtype(dtype):
        model = cls(config, **model_kwargs)
    _keep_in_fp32(model, dtype)
    _tie_as_loaded(model, source)  # from_pretrained ties after loading; the meta model must share them too
    missing = [name for name, p in model.named_parameters() if p.is_meta and not source.has(name)]
    if missing:
        # A head on a base checkpoint: a full load initialises the new weights.
        return f"the checkpoint lacks {len(missing)} weight(s) of the model ({missing[:4]}), which a full load initialises"
    mismatched = [(name, source.stored_shape(name), tuple(p.shape)) for name, p in model.named_parameters()
                  if source.stored_shape(name) != tuple(p.shape)]
    if mismatched:
        # transformers raises, or re-initialises them under ignore_mismatched_sizes=True
        name, stored, expected = mismatched[0]
        return (f"{len(mismatched)} weight(s) of the checkpoint have another shape than the model's "
                f"({name}: {stored} in the files, {expected} in the model), which a full load reports")
    setattr(model, SOURCE_ATTRIBUTE, source)
    _finish_as_loaded(model, path, plan, kwargs)
    model.eval()
    arm_materialisation(model)
    logger.info("hf_zero: %s from %s on the meta device; hf_zero.initialize reads each rank's shards",
                cls.__name__, os.path.dirname(plan.files[0]))
    if kwargs.get("output_loading_info"):
        # What a full load reports; missing or mismatched weights took the full load above.
        return model, {"missing_keys": set(), "unexpected_keys": _unexpected_keys(cls, model, source),
                       "mismatched_keys": set(), "error_msgs": []}
    return model


def _unexpected_keys(cls: Any, model: torch.nn.Module, source: SafetensorsSource) -> set[str]:
    """The checkpoint's tensors no parameter or buffer of the model reads, less the patterns the
    class declares it ignores (``_keys_to_ignore_on_load_unexpected``), as transformers does."""
    used = {source.key_for(name) for name, _ in model.named_parameters(remove_duplicate=False)}
    used |= {source.key_for(name) for name, _ in model.named_buffers(remove_duplicate=False)}
    ignored = [re.compile(p) for p in getattr(cls, "_keys_to_ignore_on_load_unexpected", None) or []]
    return {key for key in source.keys() if key not in used and not any(p.search(key) for p in ignored)}


def lazy_from_config(cls: Any, config: Any, **kwargs: Any) -> Any:
    """``from_config`` on the meta device, initialised unit by unit by ``initialize`` (see
    [Note: sharded initialisation] in hf_zero.engine.sharding.param_source)."""
    from accelerate import init_empty_weights

    config = copy.deepcopy(config)
    dtype = kwargs.pop("dtype", None) or kwargs.pop("torch_dtype", None) or getattr(config, "dtype", None)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else (dtype or torch.get_default_dtype())
    config.dtype = dtype
    for name in ("attn_implementation", "experts_implementation"):
        if name in kwargs:
            setattr(config, f"_{name}", kwargs.pop(name))
    with init_empty_weights(include_buffers=False), _default_dtype(dtype):
        model = cls(config, **kwargs)
    model.tie_weights()
    base_seed = int(torch.randint(0, 2**62, (1,)).item())  # replaced by rank 0's in initialize
    setattr(model, SOURCE_ATTRIBUTE, InitSource(model, _transformers_init(model), base_seed))
    arm_materialisation(model)
    logger.info("hf_zero: %s from a config on the meta device; hf_zero.initialize initialises each "
                "rank's shards one module at a time", cls.__name__)
    return model


def _transformers_init(model: Any) -> Any:
    """``init_module(name, module)``: the ``_init_weights`` of the nearest PreTrainedModel above
    ``name`` (composite models initialise their parts their own way)."""
    from transformers import PreTrainedModel

    def init_module(name: str, module: torch.nn.Module) -> None:
        owner = model
        parts = name.split(".") if name else []
        for i in range(len(parts)):
            candidate = model.get_submodule(".".join(parts[: i + 1]))
            if isinstance(candidate, PreTrainedModel):
                owner = candidate
        owner._init_weights(module)

    return init_module


def _keep_in_fp32(model: Any, dtype: torch.dtype) -> None:
    """Give the parameters a plain load keeps in fp32 (``_keep_in_fp32_modules`` under fp16,
    ``_keep_in_fp32_modules_strict`` under fp16 and bf16) their fp32 meta tensors: their shards
    are then read in fp32, and a model no engine takes materialises them in fp32."""
    plan = model._get_dtype_plan(dtype) if hasattr(model, "_get_dtype_plan") else {}
    if not plan:
        return
    # transformers matches the patterns as one alternation searched in each parameter name
    patterns = [(re.compile(glob.replace("*", ".*")), kept) for glob, kept in plan.items()]
    for name, param in model.named_parameters():
        kept = next((kept for pattern, kept in patterns if pattern.search(name)), None)
        if kept is not None and param.dtype != kept:
            torch.utils.swap_tensors(param, torch.nn.Parameter(torch.empty_like(param, dtype=kept),
                                                               requires_grad=param.requires_grad))


def _tie_as_loaded(model: Any, source: SafetensorsSource) -> None:
    """Tie the weights as ``from_pretrained`` does after reading the checkpoint: a pair whose two
    names the files both hold is tied only when the stored values are equal; otherwise
    transformers warns, leaves them apart and drops the pair from ``all_tied_weights_keys``."""
    tied = getattr(model, "all_tied_weights_keys", None)
    if tied is None or "missing_keys" not in inspect.signature(model.tie_weights).parameters:
        model.tie_weights()  # transformers 4: ties whatever the config says
        return
    missing = {name for name, _ in model.named_parameters(remove_duplicate=False) if not source.has(name)}
    for target, tied_to in list(tied.items()):
        if target in missing or tied_to in missing:
            continue
        if _stored_equal(source, target, tied_to, model.get_parameter(target)):
            missing.add(target)  # tie_weights ties a pair of meta tensors only when one side is absent
        else:
            logger.warning("hf_zero: %s and %s are both in the checkpoint with different values, so they are "
                           "not tied (as transformers does)", tied_to, target)
            tied.pop(target)
    model.tie_weights(missing_keys=missing, recompute_mapping=False)


def _stored_equal(source: SafetensorsSource, first: str, second: str, like: torch.Tensor,
                  chunk_numel: int = 1 << 22) -> bool:
    """Whether two stored tensors are equal in the parameter's dtype, read a chunk at a time."""
    shape = source.stored_shape(first)
    if shape != source.stored_shape(second) or shape != tuple(like.shape):
        return False
    numel = like.numel()
    for start in range(0, numel, chunk_numel):
        stop = min(numel, start + chunk_numel)
        a, b = (torch.empty(stop - start, dtype=like.dtype) for _ in range(2))
        source.fill_(first, shape, start, stop, a)
        source.fill_(second, shape, start, stop, b)
        if not torch.equal(a, b):
            return False
    return True


def _finish_as_loaded(model: Any, path: str, plan: LazyPlan, kwargs: dict[str, Any]) -> None:
    """What ``from_pretrained`` sets after reading the weights: the generation config (and a
    custom ``generate``) through the model's own ``adjust_generation_fn``, the kernels flag, and
    the weight conversions it applied: none, since the sharded path reads each parameter under
    its own name (a checkpoint needing a conversion lacks the model's names and loads whole)."""
    if hasattr(model, "set_use_kernels"):
        model.set_use_kernels(False)
    if hasattr(model, "get_expanded_tied_weights_keys"):  # transformers 5: save_pretrained reverts these
        model._weight_conversions = []
    if not getattr(model, "can_generate", lambda: False)():
        return
    if not hasattr(model, "adjust_generation_fn"):
        _load_generation_config(model, path, plan, kwargs.get("generation_config"))
        return
    download = {name: plan.download_kwargs.get(name) for name in
                ("cache_dir", "force_download", "proxies", "local_files_only", "token", "revision")}
    download["subfolder"] = plan.download_kwargs.get("subfolder", "")
    model.adjust_generation_fn(kwargs.get("generation_config"), kwargs.get("_from_auto", False),
                               kwargs.get("_from_pipeline"), path, trust_remote_code=kwargs.get("trust_remote_code"),
                               **download, **plan.model_kwargs)


def _load_generation_config(model: Any, path: str, plan: LazyPlan, given: Any) -> None:
    if given is not None:
        model.generation_config = given
        return
    if not getattr(model, "can_generate", lambda: False)():
        return
    if _cached(path, "generation_config.json", plan.download_kwargs) is None:
        return
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig.from_pretrained(path, **plan.download_kwargs)
