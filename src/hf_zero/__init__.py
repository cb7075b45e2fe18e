"""hf_zero: a ZeRO engine native to Hugging Face Transformers and Accelerate.

>>> engine, optimizer, dataloader, lr_scheduler = hf_zero.initialize(model=model, config="zero3.json")

``import hf_zero`` imports neither torch nor transformers: ``initialize`` and ``ZeroEngine`` are
loaded on first use, so ``hf-zero --version`` and ``hf-zero check-config`` answer at once
([Note: the command imports torch late] in hf_zero.cli).
"""

import os
from typing import Any

from hf_zero.config import HfZeroConfig, HfZeroConfigError
from hf_zero.config.live import on_live_zero3_config
from hf_zero.log import configure_library_logger
from hf_zero.version import __version__


def _install_sharded_loading() -> None:
    # Imported only when a stage-3 config is created, so `import hf_zero` never imports
    # transformers (see config/live.py and integrations/zero3_loading.py).
    from hf_zero.integrations import zero3_loading

    zero3_loading.install()


on_live_zero3_config(_install_sharded_loading)
configure_library_logger(os.environ)


def __getattr__(name: str) -> Any:
    if name == "initialize":
        from hf_zero.engine.initialize import initialize

        return initialize
    if name == "ZeroEngine":
        from hf_zero.engine.engine import ZeroEngine

        return ZeroEngine
    raise AttributeError(f"module 'hf_zero' has no attribute {name!r}")


__all__ = ["HfZeroConfig", "HfZeroConfigError", "ZeroEngine", "initialize", "__version__"]
