"""DeepSpeed ZeRO 1-3 through ``deepspeed.initialize``, with DeepSpeed's defaults.

A benchmark-only dependency (not in hf_zero's requirements): ``DS_BUILD_OPS=0 pip install
deepspeed``. On a CPU machine the driver sets ``DS_ACCELERATOR=cpu`` and the gloo backend;
DeepSpeed JIT-builds a small shared-memory comm op the first time it initialises (about 30 s,
then cached).

The optimizer is a client ``torch.optim.AdamW`` (DeepSpeed wraps it over its fp32 partitions;
its fused/CPU Adam ops would need a build), and clipping is the config's
``gradient_clipping``. ZeRO settings are DeepSpeed's defaults, recorded in ``zero_effective``:
they matter at this size (see peers_baseline.md: ``stage3_param_persistence_threshold`` keeps
small params replicated; ``max_live_parameters``/``max_reuse_distance`` of 1e9 mean no re-gather
in backward; a 5e8-element reduce bucket).

Model states are read from DeepSpeed's own storage: the module's ``p.data`` and ``p.ds_tensor``,
the base optimizer's state, and every tensor reachable from the ZeRO optimizer's attributes,
classified by attribute name (see ``_classify``).

Offload (``bench_offload.py``), all optional: ``offload_optimizer`` ("cpu"/"nvme"),
``offload_param`` ("cpu"/"nvme"), ``nvme_path``, ``pin_memory`` and ``max_in_cpu`` become the
config's ``offload_*`` sections (see ``engines/offload.py``). With optimizer offload the client
optimizer is ``offload_adam``: "ds_cpu_adam" (the default: ``DeepSpeedCPUAdam(adamw_mode=True)``,
the op DeepSpeed's offload is built around, JIT-compiled with the C++ compiler on first use) or
"torch" (the same ``torch.optim.AdamW`` as without offload, which DeepSpeed accepts only with
``zero_force_ds_cpu_optimizer: false``). On a CPU machine every tensor is in host memory, so
DeepSpeed's offload is the same bytes moved between ``cpu`` tensors; the tally counts them as
without offload.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from engines.base import Runner
from engines.offload import offload_sections
from engines.probes import StorageTally
from engines.workload import Workload, build_model


def ds_config(workload: Workload, options: dict[str, Any]) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": int(options["stage"])}
    if options.get("persistence_threshold") is not None:
        zero["stage3_param_persistence_threshold"] = int(options["persistence_threshold"])
    zero.update(options.get("zero_extra", {}))  # bench_engines --zero KEY=VALUE, both engines alike
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": workload.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": workload.clip,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if workload.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    zero.update(offload_sections(options))
    if options.get("offload_optimizer") and options.get("offload_adam") == "torch":
        config["zero_force_ds_cpu_optimizer"] = False
    return config


def client_optimizer(model: torch.nn.Module, workload: Workload, options: dict[str, Any]) -> torch.optim.Optimizer:
    """torch AdamW, or DeepSpeedCPUAdam when the optimizer is offloaded (see the module note)."""
    if options.get("offload_optimizer") and options.get("offload_adam", "ds_cpu_adam") == "ds_cpu_adam":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(model.parameters(), adamw_mode=True, **workload.adamw_kwargs())
    return torch.optim.AdamW(model.parameters(), **workload.adamw_kwargs())


def _classify(attr: str) -> str:
    """A ZeRO optimizer attribute's model-state category, from its name."""
    name = attr.lower()
    if "ipg" in name or "bucket" in name or ("buffer" in name and "grad" not in name):
        return "engine_buffers"
    if "grad" in name:
        return "grads"
    if "fp32" in name or "single_partition" in name or "master" in name:
        return "master"
    if "bit16" in name or "fp16" in name or "bf16" in name or "param" in name or "flat" in name:
        return "params"
    return "other"


def _walk(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors reachable from a ZeRO optimizer attribute: through containers and DeepSpeed's
    own small objects (the stage-3 reduce bucket lives in ``ipg_buckets[dtype].buffer``)."""
    if isinstance(value, torch.Tensor):
        yield value
        if value.grad is not None:
            yield value.grad
    elif depth >= 4 or isinstance(value, (torch.nn.Module, type, str, bytes)):
        return
    elif isinstance(value, (list, tuple, set)):
        for item in value:
            yield from _walk(item, depth + 1)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _walk(item, depth + 1)
    elif depth < 2 and type(value).__module__.startswith("deepspeed") and hasattr(value, "__dict__"):
        for item in vars(value).values():
            yield from _walk(item, depth + 1)


class DeepSpeedRunner(Runner):
    def __init__(self, workload: Workload, options: dict[str, Any], device: torch.device) -> None:
        import deepspeed

        self.name = f"ds{options['stage']}"
        self.stage = int(options["stage"])
        self.config = ds_config(workload, options)
        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
        model = build_model(workload)
        optimizer = client_optimizer(model, workload, options)
        self.client_optimizer = f"{type(optimizer).__module__}.{type(optimizer).__name__}".replace(
            "torch.optim.adamw.", "torch.optim.")
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=self.config)
        self.version = deepspeed.__version__

    def forward_backward(self, batch: torch.Tensor) -> torch.Tensor:
        loss = self.engine(input_ids=batch, labels=batch).loss
        self.engine.backward(loss)  # stages 1-2 reduce gradients at the end of backward
        return loss.detach()

    def optimizer_step(self) -> None:
        self.engine.step()  # clip, step, all-gather updated partitions (stages 1-2), zero grads

    def model_state(self) -> StorageTally:
        tally = StorageTally()
        params = list(self.engine.module.parameters())
        tally.add("params", "module.param.data", (p.data for p in params))
        tally.add("params", "param.ds_tensor", (getattr(p, "ds_tensor", None) for p in params))
        base = getattr(self.optimizer, "optimizer", self.optimizer)
        # The attributes first, so the fp32 partitions the base optimizer steps count as master.
        found: list[tuple[str, str, torch.Tensor]] = []
        for attr, value in vars(self.optimizer).items():
            if attr == "optimizer":
                continue
            found += [(_classify(attr), attr, t) for t in _walk(value)]
        for category in ("params", "master", "grads", "engine_buffers", "other"):
            for cat, attr, tensor in found:
                if cat == category:
                    tally.add(category, attr, [tensor])
        tally.add("optim", "base_optimizer.state",
                  (v for s in base.state.values() for v in s.values() if isinstance(v, torch.Tensor)))
        tally.add("grads", "module.param.grad", (p.grad for p in params))
        return tally

    def info(self) -> dict[str, Any]:
        zero = self.engine.zero_optimization()
        effective = {}
        cfg = getattr(self.engine, "_config", None)
        zc = getattr(cfg, "zero_config", None)
        keys = ["overlap_comm", "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size",
                "use_multi_rank_bucket_allreduce"]
        if self.stage == 3:  # DeepSpeedZeroConfig names them without the stage3_ prefix
            keys += ["param_persistence_threshold", "prefetch_bucket_size", "max_live_parameters", "max_reuse_distance"]
        for key in keys:
            if zc is not None and hasattr(zc, key):
                value = getattr(zc, key)
                shown = key if key in keys[:5] else f"stage3_{key}"
                effective[shown] = value if isinstance(value, (bool, int, float, str)) or value is None else str(value)
        return {
            "deepspeed": self.version, "config": self.config, "zero_enabled": bool(zero),
            "zero_effective": effective,
            "optimizer": f"{type(self.optimizer).__name__} over {self.client_optimizer}",
        }


def build(workload: Workload, options: dict[str, Any], device: torch.device) -> Runner:
    return DeepSpeedRunner(workload, options, device)
