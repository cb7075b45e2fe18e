"""hf_zero under Accelerate: ``HfZeroAccelerator(hf_zero_plugin=HfZeroPlugin(...))``.

Accelerate has no registry for outside backends (``DistributedType`` is a closed enum and the
launch yaml rejects unknown top-level keys), so hf_zero
enters as an ``Accelerator`` subclass plus a plugin dataclass shaped like Accelerate's
``DeepSpeedPlugin``::

    from hf_zero.integrations.accelerate import HfZeroAccelerator, HfZeroPlugin

    accelerator = HfZeroAccelerator(hf_zero_plugin=HfZeroPlugin(config="recipes/zero3.json"),
                                    gradient_accumulation_steps=2)
    model, optimizer, dataloader, scheduler = accelerator.prepare(model, optimizer, dataloader, scheduler)

Every plugin field left as None reads its ``HF_ZERO_<FIELD>`` environment variable, the way
``DeepSpeedPlugin`` reads ``ACCELERATE_DEEPSPEED_*``; that is how ``accelerate launch`` (which
copies the environment to every process) and ``hf-zero launch`` hand a config to the script.
With no plugin at all, ``HfZeroAccelerator`` builds one from the environment when
``HF_ZERO_CONFIG``, ``HF_ZERO_CONFIG_FILE`` or ``HF_ZERO_STAGE`` is set, and is otherwise a plain
``Accelerator``.
"""

from __future__ import annotations

from hf_zero.integrations._accelerator import HfZeroAccelerator
# The plugin lives in its own module, which _accelerator imports too (no import cycle).
from hf_zero.integrations._plugin import HfZeroPlugin, plugin_field_names, plugin_from_env

__all__ = ["HfZeroAccelerator", "HfZeroPlugin", "plugin_from_env", "plugin_field_names"]
