"""``HfZeroPlugin``: the hf_zero config of ``HfZeroAccelerator`` (hf_zero.integrations.accelerate).

Its own module, importing nothing of Accelerate: ``HfZeroAccelerator`` builds a plugin from the
environment when it is given none, and ``hf_zero.integrations.accelerate`` exports both, so
the plugin here is what both import (no import cycle between them). Every plugin field left as
None reads its ``HF_ZERO_<FIELD>`` environment variable, the way ``DeepSpeedPlugin`` reads
``ACCELERATE_DEEPSPEED_*``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

from hf_zero.config import HfZeroConfig
from hf_zero.config.errors import MISSING, ProblemList

__all__ = ["HfZeroPlugin", "plugin_from_env", "plugin_field_names"]

AUTO = "auto"
# Environment variables that name the config itself (HF_ZERO_CONFIG may also hold inline JSON).
CONFIG_ENVS = ("HF_ZERO_CONFIG", "HF_ZERO_CONFIG_FILE")

# plugin field -> dotted config path it sets (or must agree with).
FIELD_PATHS: dict[str, str] = {
    "zero_stage": "zero_optimization.stage",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "gradient_clipping",
    "offload_optimizer_device": "zero_optimization.offload_optimizer.device",
    "offload_optimizer_nvme_path": "zero_optimization.offload_optimizer.nvme_path",
    "offload_param_device": "zero_optimization.offload_param.device",
    "offload_param_nvme_path": "zero_optimization.offload_param.nvme_path",
    "zero3_save_16bit_model": "zero_optimization.stage3_gather_16bit_weights_on_model_save",
}


def _parse_env(name: str, raw: str) -> Any:
    """An ``HF_ZERO_<FIELD>`` string as the field's type ("auto" stays "auto")."""
    if raw == AUTO:
        return raw
    try:
        if name in ("zero_stage", "gradient_accumulation_steps"):
            return int(raw)
        if name == "gradient_clipping":
            return float(raw)
    except ValueError:
        raise ValueError(
            f"HF_ZERO_{name.upper()}={raw!r} is not a number; set it to a number or \"auto\", or unset it"
        ) from None
    if name == "zero3_save_16bit_model":
        if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
            raise ValueError(f"HF_ZERO_ZERO3_SAVE_16BIT_MODEL={raw!r}: expected true or false")
        return raw.lower() in ("1", "true", "yes")
    return raw


def _get(root: dict[str, Any], path: str) -> Any:
    node: Any = root
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return MISSING
        node = node[part]
    return node


def _set(root: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    node = root
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    return a == b


@dataclass
class HfZeroPlugin:
    """What ``HfZeroAccelerator`` needs to run hf_zero, shaped like Accelerate's ``DeepSpeedPlugin``.

    Each field left as None reads ``HF_ZERO_<FIELD>`` from the environment. A field that is set
    (by argument or environment) fills the config key it names when that key is absent or
    "auto"; one that contradicts a value the config file sets is an HfZeroConfigError (the same
    rule as DeepSpeedPlugin's "config file and launcher fields both set"). After construction
    ``hf_zero_config`` is the validated :class:`HfZeroConfig` (it may still hold "auto" values,
    which ``accelerator.prepare`` fills from the dataloader, the accumulation steps and the model).
    """

    config: str | os.PathLike[str] | dict | HfZeroConfig | None = None
    """A JSON path, inline JSON, a dict or an HfZeroConfig. Env: HF_ZERO_CONFIG, then
    HF_ZERO_CONFIG_FILE. With neither, a config is built from the fields below (stage 2 by
    default, as DeepSpeedPlugin does)."""
    zero_stage: int | None = None
    """zero_optimization.stage (0-3). Env: HF_ZERO_STAGE."""
    gradient_accumulation_steps: int | str | None = None
    """gradient_accumulation_steps or "auto" (the accelerator's value). Env: HF_ZERO_GRADIENT_ACCUMULATION_STEPS."""
    gradient_clipping: float | str | None = None
    """gradient_clipping or "auto" (clip where the script calls ``clip_grad_norm_``, at its
    ``max_norm``, as under DDP; Accelerate's DeepSpeed plugin uses 1.0). Env: HF_ZERO_GRADIENT_CLIPPING."""
    offload_optimizer_device: str | None = None
    """zero_optimization.offload_optimizer.device: "none", "cpu" or "nvme". Env: HF_ZERO_OFFLOAD_OPTIMIZER_DEVICE."""
    offload_optimizer_nvme_path: str | None = None
    """zero_optimization.offload_optimizer.nvme_path. Env: HF_ZERO_OFFLOAD_OPTIMIZER_NVME_PATH."""
    offload_param_device: str | None = None
    """zero_optimization.offload_param.device: "none", "cpu" or "nvme" (stage 3). Env: HF_ZERO_OFFLOAD_PARAM_DEVICE."""
    offload_param_nvme_path: str | None = None
    """zero_optimization.offload_param.nvme_path. Env: HF_ZERO_OFFLOAD_PARAM_NVME_PATH."""
    zero3_save_16bit_model: bool | None = None
    """stage3_gather_16bit_weights_on_model_save. Env: HF_ZERO_ZERO3_SAVE_16BIT_MODEL."""
    is_train_batch_min: bool = True
    """For an "auto" train_micro_batch_size_per_gpu, the shuffled (training) dataloader of a prepare()
    gives the batch size; only among several shuffled ones is it the smallest (False: the largest),
    as DeepSpeedPlugin's rule for all of them."""
    hf_zero_config: HfZeroConfig = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.config is None:
            self.config = next((os.environ[n] for n in CONFIG_ENVS if os.environ.get(n)), None)
        for name in FIELD_PATHS:
            env = "HF_ZERO_STAGE" if name == "zero_stage" else f"HF_ZERO_{name.upper()}"
            if getattr(self, name) is None and os.environ.get(env):
                setattr(self, name, _parse_env(name, os.environ[env]))
        raw, source = self._base_config()
        problems = ProblemList()
        for name, path in FIELD_PATHS.items():
            self._apply_field(raw, name, path, problems)
        problems.raise_if_any(source)
        self.hf_zero_config = HfZeroConfig(raw)

    def _base_config(self) -> tuple[dict[str, Any], str]:
        if self.config is None:  # DeepSpeedPlugin's config when no file is given
            return ({"train_micro_batch_size_per_gpu": AUTO, "train_batch_size": AUTO,
                     "gradient_accumulation_steps": AUTO, "gradient_clipping": AUTO,
                     "zero_optimization": {"stage": 2 if self.zero_stage is None else self.zero_stage}},
                    "<HfZeroPlugin fields>")
        loaded = self.config if isinstance(self.config, HfZeroConfig) else HfZeroConfig(self.config)
        source = str(self.config) if isinstance(self.config, (str, os.PathLike)) else "<HfZeroPlugin config>"
        return loaded.to_dict(), source

    def _apply_field(self, raw: dict[str, Any], name: str, path: str, problems: ProblemList) -> None:
        value = getattr(self, name)
        if value is None:
            return
        current = _get(raw, path)
        if current is MISSING or current == AUTO:
            _set(raw, path, value)
        elif value != AUTO and not _same(current, value):
            env = "HF_ZERO_STAGE" if name == "zero_stage" else f"HF_ZERO_{name.upper()}"
            problems.add(path, current, f"HfZeroPlugin.{name}={value!r} (argument or {env}) contradicts the config",
                         f'set {path} to "auto" or to {value!r} in the config, or drop the plugin field')


def plugin_from_env() -> HfZeroPlugin | None:
    """A plugin built from the environment, or None when no HF_ZERO config variable is set."""
    if any(os.environ.get(n) for n in (*CONFIG_ENVS, "HF_ZERO_STAGE")):
        return HfZeroPlugin()
    return None


def plugin_field_names() -> list[str]:
    return [f.name for f in fields(HfZeroPlugin) if f.init]
