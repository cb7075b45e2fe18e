"""hf_zero.config: DeepSpeed's JSON schema, checked to the last key.

Import direction inside the package: errors -> kinds -> keys -> batch -> validate -> auto ->
schema -> hf_zero_config. Nothing here imports transformers or accelerate.
"""

from .errors import MISSING, ConfigProblem, HfZeroConfigError
from .hf_zero_config import HfZeroConfig
from .keys import KEY_TABLE, KeySpec, Status
from .reference import reference_markdown
from .schema import (
    Bf16Config,
    Fp16Config,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    OptimizerConfig,
    SchedulerConfig,
    ZeroConfig,
)

__all__ = [
    "HfZeroConfig",
    "HfZeroConfigError",
    "ConfigProblem",
    "MISSING",
    "ZeroConfig",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "Fp16Config",
    "Bf16Config",
    "OptimizerConfig",
    "SchedulerConfig",
    "KEY_TABLE",
    "KeySpec",
    "Status",
    "reference_markdown",
]
