"""hf_zero stages 1-3 through ``hf_zero.initialize``, configured as a user would (DeepSpeed schema).

The optimizer comes from the config's ``optimizer`` section (hf_zero's fused AdamW over the fp32
shards); clipping from ``gradient_clipping``. ``overlap`` ("on"/"off") sets
``zero_optimization.overlap_comm``; unset, hf_zero's default applies (DeepSpeed's rule: on for
stage 3 only). ``persistence_threshold`` sets ``stage3_param_persistence_threshold`` (unset:
hf_zero's default, DeepSpeed's 1e5). Model-state bytes come from ``engine.memory_report()`` and
communication from ``engine.comm_stats()``, both counted the way the benchmark counts the peers
(storages once; logical collective sizes).

Offload (``bench_offload.py``), all optional: ``offload_optimizer`` ("cpu"/"nvme"),
``offload_param`` ("cpu"/"nvme", stage 3), ``nvme_path``, ``pin_memory`` and ``max_in_cpu``
become the config's ``offload_*`` sections (see ``engines/offload.py``). The model-state tally
then keeps only what ``memory_report`` leaves on the compute device; the host categories and the
``nvme`` file bytes go into the tally's detail as ``offload:memory_report.<category>`` (only when
offload is on, so runs without it report exactly as before).
"""

from __future__ import annotations

from typing import Any

import torch

from engines.base import Runner
from engines.offload import offload_sections
from engines.probes import StorageTally
from engines.workload import Workload, build_model

# memory_report category -> the benchmark's model-state category
_CATEGORY = {"compute_params": "params", "fp32_master": "master", "gradients": "grads", "optimizer_state": "optim"}
# memory_report's offloaded categories (host memory, then bytes in NVMe files)
OFFLOAD_CATEGORIES = ("host_params", "host_gradients", "host_fp32_master", "host_optimizer_state", "nvme")


def zero_config(workload: Workload, options: dict[str, Any]) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": int(options["stage"])}
    overlap = options.get("overlap")
    if overlap is not None:
        zero["overlap_comm"] = overlap == "on"
    if options.get("persistence_threshold") is not None:
        zero["stage3_param_persistence_threshold"] = int(options["persistence_threshold"])
    zero.update(options.get("zero_extra", {}))  # bench_engines --zero KEY=VALUE, both engines alike
    zero.update(offload_sections(options))
    return {
        "train_micro_batch_size_per_gpu": workload.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": workload.clip,
        "bf16": {"enabled": workload.dtype == "bf16"},
        "optimizer": {"type": "AdamW", "params": {
            "lr": workload.lr, "betas": list(workload.betas), "eps": workload.eps,
            "weight_decay": workload.weight_decay}},
        "zero_optimization": zero,
        "steps_per_print": 0,
    }


class HfZeroRunner(Runner):
    supports_profile = True

    def __init__(self, workload: Workload, options: dict[str, Any], device: torch.device) -> None:
        import hf_zero

        self.name = f"hf_zero{options['stage']}"
        self.config = zero_config(workload, options)
        self.offloaded = bool(offload_sections(options))
        model = build_model(workload)
        self.engine, _, _, _ = hf_zero.initialize(model=model, config=self.config)
        if options.get("compile"):  # bench_engines --compile BACKEND: [Note: compiled units]
            self.engine.compile(backend=options["compile"])

    def forward_backward(self, batch: torch.Tensor) -> torch.Tensor:
        loss = self.engine(input_ids=batch, labels=batch).loss
        self.engine.backward(loss)
        return loss.detach()

    def optimizer_step(self) -> None:
        self.engine.step()  # unscale, clip, step, zero grads

    def model_state(self) -> StorageTally:
        tally = StorageTally()
        report = self.engine.memory_report()
        for source, category in _CATEGORY.items():
            tally.bytes[category] += int(report.get(source, 0))
            tally.detail[f"{category}:memory_report.{source}"] += int(report.get(source, 0))
        tally.detail["buffers:memory_report.buffers"] += int(report.get("buffers", 0))
        if self.offloaded:
            for source in OFFLOAD_CATEGORIES:
                tally.detail[f"offload:memory_report.{source}"] += int(report.get(source, 0))
        return tally

    def engine_comm_stats(self) -> dict[str, dict[str, int]]:
        return self.engine.comm_stats()

    def reset_engine_comm_stats(self) -> None:
        self.engine.reset_comm_stats()

    def info(self) -> dict[str, Any]:
        zero = self.engine.config.zero
        return {
            "config": self.config,
            "units": len(self.engine.units),
            "unit_rule": self.engine.unit_rule,
            "zero_effective": {
                "overlap_comm": zero.overlap_comm,
                "stage3_param_persistence_threshold": int(zero.stage3_param_persistence_threshold),
                "stage3_prefetch_bucket_size": int(zero.stage3_prefetch_bucket_size),
                "stage3_max_live_parameters": int(zero.stage3_max_live_parameters),
                "reduce_bucket_size": int(zero.reduce_bucket_size),
                **({"sub_group_size": int(zero.sub_group_size)} if self.offloaded else {}),
            },
            "optimizer": "hf_zero ZeroAdam (config optimizer AdamW)",
        }


def build(workload: Workload, options: dict[str, Any], device: torch.device) -> Runner:
    return HfZeroRunner(workload, options, device)
