"""hf_zero: a ZeRO engine native to Hugging Face Transformers and Accelerate.

>>> engine, optimizer, dataloader, lr_scheduler = hf_zero.initialize(model=model, config="zero3.json")
"""

from hf_zero.config import HfZeroConfig, HfZeroConfigError
from hf_zero.config.live import on_live_zero3_config
from hf_zero.engine.engine import ZeroEngine
from hf_zero.engine.initialize import initialize

__version__ = "0.1.0"


def _install_sharded_loading() -> None:
    # Imported only when a stage-3 config is created, so `import hf_zero` never imports
    # transformers (see config/live.py and integrations/zero3_loading.py).
    from hf_zero.integrations import zero3_loading

    zero3_loading.install()


on_live_zero3_config(_install_sharded_loading)

__all__ = ["HfZeroConfig", "HfZeroConfigError", "ZeroEngine", "initialize", "__version__"]
