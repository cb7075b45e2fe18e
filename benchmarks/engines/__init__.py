"""One runner module per engine for ``benchmarks/bench_engines.py``.

Each runner module has ``build(workload, options, device) -> Runner`` (see ``base.Runner``); the
worker (``engines.worker``, started by torchrun) drives them all through the same timed loop.
Nothing here is imported by the ``hf_zero`` package: DeepSpeed is a benchmark-only dependency.
"""

from __future__ import annotations

# engine name -> (runner module, its options). Stage-numbered names pair up for the ratios.
ENGINES: dict[str, tuple[str, dict[str, object]]] = {
    "hf_zero1": ("hf_zero_runner", {"stage": 1}),
    "hf_zero2": ("hf_zero_runner", {"stage": 2}),
    "hf_zero3": ("hf_zero_runner", {"stage": 3}),
    "ddp": ("ddp_runner", {}),
    "fsdp2": ("fsdp2_runner", {}),
    "ds1": ("deepspeed_runner", {"stage": 1}),
    "ds2": ("deepspeed_runner", {"stage": 2}),
    "ds3": ("deepspeed_runner", {"stage": 3}),
    "nocomm": ("floor_runner", {}),
}


def family_of(engine: str) -> str:
    """"hf_zero", "ddp", "fsdp2", "deepspeed" or "floor" (no collectives: the compute floor)."""
    return {"hf_zero_runner": "hf_zero", "ddp_runner": "ddp", "fsdp2_runner": "fsdp2",
            "deepspeed_runner": "deepspeed", "floor_runner": "floor"}[ENGINES[engine][0]]


def stage_of(engine: str) -> int | None:
    stage = ENGINES[engine][1].get("stage")
    return int(stage) if stage is not None else None
