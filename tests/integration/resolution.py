"""The same DeepSpeed-schema config resolved by hf_zero and by transformers' own code.

transformers' side runs its real ``HfTrainerDeepSpeedConfig.trainer_config_process`` /
``trainer_config_finalize`` and Accelerate's real ``DeepSpeedPlugin``, but builds the config
object without ``HfDeepSpeedConfig.__init__``: that constructor would set transformers' DeepSpeed
weak reference and require the deepspeed package, and neither is needed to fill a dict.
"""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace
from typing import Any

# A LLaMA-Factory-style ZeRO-3 config before transformers filled it (what HfTrainerDeepSpeedConfig resolves).
AUTO_EXAMPLE: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto", "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
    "amp": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto",
                          "stage3_gather_16bit_weights_on_model_save": "auto"},
}  # fmt: skip

# The TrainingArguments of research exp1 (GPT2Config(n_embd=768), 100 steps, one rank).
EXAMPLE_ARGS: dict[str, Any] = dict(
    per_device_train_batch_size=4, gradient_accumulation_steps=2, max_grad_norm=0.5, learning_rate=3e-4,
    weight_decay=0.1, bf16=True, use_cpu=True, warmup_steps=10, report_to="none",
)
EXAMPLE_HIDDEN = 768
EXAMPLE_STEPS = 100


def _model(hidden_size: int) -> Any:
    from transformers import GPT2Config

    return SimpleNamespace(config=GPT2Config(n_embd=hidden_size))


def hf_zero_resolution(config: dict[str, Any], training_args: dict[str, Any], hidden_size: int,
                       steps: int) -> dict[str, Any]:
    """hf_zero's Trainer integration: TrainingArguments time, then train start."""
    from hf_zero.integrations.transformers import HfZeroTrainingArguments, resolve_zero_config

    args = HfZeroTrainingArguments(zero_config=json.dumps(config), **training_args)
    return resolve_zero_config(args, _model(hidden_size), steps).to_dict()


def transformers_reference_unavailable() -> str | None:
    """Why transformers' own DeepSpeed config code cannot run here, or None. Without the
    deepspeed package transformers swaps its base class for ``object`` (a stub)."""
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    if hasattr(HfTrainerDeepSpeedConfig, "set_stage_and_offload"):
        return None
    return ("transformers' HfTrainerDeepSpeedConfig is a stub without the deepspeed package, so its "
            "resolution cannot be run as the reference (install deepspeed to compare)")


def transformers_resolution(config: dict[str, Any], training_args: dict[str, Any], hidden_size: int,
                            steps: int) -> dict[str, Any]:
    """transformers + Accelerate, as a ``--deepspeed`` Trainer run fills the config. Returns
    ``{"config": ...}``, ``{"error": ..., "mismatches": [...]}`` or ``{"unavailable": why}``."""
    reason = transformers_reference_unavailable()
    if reason is not None:
        return {"unavailable": reason}
    from accelerate.utils import DeepSpeedPlugin
    from accelerate.utils.deepspeed import HfDeepSpeedConfig as AccelerateHfDeepSpeedConfig
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    args = TrainingArguments(**training_args)
    hf_config = HfTrainerDeepSpeedConfig.__new__(HfTrainerDeepSpeedConfig)
    AccelerateHfDeepSpeedConfig.__init__(hf_config, copy.deepcopy(config))
    hf_config._dtype, hf_config.mismatches = None, []
    hf_config.trainer_config_process(args)  # at TrainingArguments time
    DeepSpeedPlugin(hf_ds_config=hf_config)  # Accelerate's fills (16-bit save flag, steps_per_print)
    try:
        hf_config.trainer_config_finalize(args, _model(hidden_size), steps)  # at train start
    except ValueError as err:
        return {"error": str(err), "mismatches": list(hf_config.mismatches)}
    return {"config": json.loads(json.dumps(hf_config.config))}
