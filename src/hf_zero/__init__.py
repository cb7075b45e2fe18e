"""hf_zero: a ZeRO engine native to Hugging Face Transformers and Accelerate.

>>> engine, optimizer, dataloader, lr_scheduler = hf_zero.initialize(model=model, config="zero3.json")
"""

from hf_zero.config import HfZeroConfig, HfZeroConfigError
from hf_zero.engine.engine import ZeroEngine
from hf_zero.engine.initialize import initialize

__version__ = "0.1.0"

__all__ = ["HfZeroConfig", "HfZeroConfigError", "ZeroEngine", "initialize", "__version__"]
