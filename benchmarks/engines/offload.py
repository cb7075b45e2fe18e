"""The ``zero_optimization.offload_*`` sections both ZeRO runners build from the same options.

Options (all optional, set by ``bench_offload.py``): ``offload_optimizer`` ("cpu" or "nvme"),
``nvme_path`` (with "nvme"), ``offload_param`` ("cpu" or "nvme"; stage 3), ``pin_memory`` (both
sections), ``max_in_cpu`` (``offload_param.max_in_cpu``: 0 puts every parameter shard in a file),
``nvme_pipeline`` (``offload_optimizer.pipeline_read`` and ``pipeline_write``).
hf_zero and DeepSpeed read the same DeepSpeed schema, so one translation serves both.
"""

from __future__ import annotations

from typing import Any

OFFLOAD_KEYS = ("offload_optimizer", "offload_param")


def offload_sections(options: dict[str, Any]) -> dict[str, Any]:
    """The offload sections the options ask for; {} when none (the config is then unchanged)."""
    sections: dict[str, Any] = {}
    for key in OFFLOAD_KEYS:
        device = options.get(key)
        if not device or device == "none":
            continue
        section: dict[str, Any] = {"device": device}
        if device == "nvme":
            section["nvme_path"] = options["nvme_path"]
        if key == "offload_optimizer" and options.get("nvme_pipeline"):
            section.update(pipeline_read=True, pipeline_write=True)
        if options.get("pin_memory") is not None:
            section["pin_memory"] = bool(options["pin_memory"])
        if key == "offload_param" and options.get("max_in_cpu") is not None:
            section["max_in_cpu"] = int(options["max_in_cpu"])
        sections[key] = section
    return sections
