"""Sharded ``from_pretrained`` while a stage-3 HfZeroConfig is alive (see config/live.py).

[Note: lazy sharded loading]
DeepSpeed's ``zero.Init`` partitions parameters as modules are constructed, which needs patches
on every ``nn.Module.__init__`` and tensor constructor. hf_zero does less: ``from_pretrained``
builds the model with its *parameters* on the meta device (buffers stay real, so computed
buffers such as rotary frequencies are right), and attaches a :class:`SafetensorsSource` naming
the checkpoint files. Nothing is read yet. ``hf_zero.initialize`` then lays out each unit and
reads, parameter by parameter, only the element ranges this rank owns (its shard under stage 3)
from the memory-mapped files. The peak memory of a rank is its shards plus one parameter, and
every rank reads the same files, so no broadcast is needed.

The model returned is not runnable on its own (its parameters are meta) until it is passed to
``hf_zero.initialize``, as a DeepSpeed ZeRO-3 model is not runnable outside its engine.
Only local folders with safetensors weights take this path; anything else (a hub id, extra
positional arguments, ``device_map``, quantization) falls back to the normal loading, and
``initialize`` shards the fully built model.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger("hf_zero")

_installed = False
# from_pretrained keyword arguments the lazy path understands; anything else falls back.
_HUB_KWARGS = {"cache_dir", "force_download", "local_files_only", "revision", "token", "proxies",
               "subfolder", "trust_remote_code", "use_safetensors", "low_cpu_mem_usage", "_from_auto",
               "_commit_hash", "adapter_kwargs"}
_MODEL_KWARGS = {"config", "dtype", "torch_dtype", "attn_implementation"}


def install() -> None:
    """Patch ``PreTrainedModel.from_pretrained`` once; it defers to the original unless a stage-3
    config is alive."""
    global _installed
    if _installed:
        return
    from transformers import PreTrainedModel

    original = PreTrainedModel.from_pretrained.__func__

    def from_pretrained(cls: Any, pretrained_model_name_or_path: Any, *model_args: Any, **kwargs: Any) -> Any:
        if _takes_lazy_path(pretrained_model_name_or_path, model_args, kwargs):
            return lazy_from_pretrained(cls, str(pretrained_model_name_or_path), **kwargs)
        return original(cls, pretrained_model_name_or_path, *model_args, **kwargs)

    from_pretrained.__doc__ = original.__doc__
    PreTrainedModel.from_pretrained = classmethod(from_pretrained)
    _installed = True


def _takes_lazy_path(path: Any, model_args: tuple, kwargs: dict[str, Any]) -> bool:
    from hf_zero.config.live import live_zero3_config

    if live_zero3_config() is None or model_args or not os.path.isdir(str(path)):
        return False
    if set(kwargs) - _HUB_KWARGS - _MODEL_KWARGS:
        logger.info("hf_zero: from_pretrained(%s) with %s loads normally (not sharded)",
                    path, sorted(set(kwargs) - _HUB_KWARGS - _MODEL_KWARGS))
        return False
    subfolder = kwargs.get("subfolder") or ""
    folder = os.path.join(str(path), subfolder)
    return any(os.path.exists(os.path.join(folder, f))
               for f in ("model.safetensors", "model.safetensors.index.json"))


def lazy_from_pretrained(cls: Any, path: str, **kwargs: Any) -> Any:
    """The model with meta parameters and a weight source; see [Note: lazy sharded loading]."""
    from accelerate import init_empty_weights

    from hf_zero.engine.param_source import SOURCE_ATTRIBUTE, SafetensorsSource, safetensors_files

    folder = os.path.join(path, kwargs.get("subfolder") or "")
    config = kwargs.get("config")
    if config is None or isinstance(config, (str, os.PathLike)):
        config = cls.config_class.from_pretrained(folder if config is None else config)
    if kwargs.get("attn_implementation"):
        config._attn_implementation = kwargs["attn_implementation"]
    with init_empty_weights(include_buffers=False):
        model = cls(config)
    model.tie_weights()  # from_pretrained ties after loading; the meta model must share them too
    setattr(model, SOURCE_ATTRIBUTE,
            SafetensorsSource(safetensors_files(folder), getattr(cls, "base_model_prefix", "")))
    _load_generation_config(model, folder)
    model.eval()
    logger.info("hf_zero: %s from %s on the meta device; hf_zero.initialize reads each rank's shards",
                cls.__name__, folder)
    return model


def _load_generation_config(model: Any, folder: str) -> None:
    if not os.path.exists(os.path.join(folder, "generation_config.json")):
        return
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig.from_pretrained(folder)
