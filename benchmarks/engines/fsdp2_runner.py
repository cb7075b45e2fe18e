"""PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``): each GPT-2 block is one parameter
group (one all-gather, one reduce-scatter), the root (embeddings, final LayerNorm, tied head)
another.

[Note: FSDP2 reshard_after_forward]
``fsdp_reshard_after_forward`` is passed to every ``fully_shard`` call:

- ``None`` (default, FSDP2's own default): blocks reshard after forward and are all-gathered
  again in backward (ZeRO-3 behaviour, 3Ψ of traffic for them); the root keeps its unsharded
  parameters from forward to backward, since backward needs them first.
- ``True``: every group, the root included, reshards after forward (pure ZeRO-3).
- ``False``: nothing reshards after forward, so no backward all-gather (ZeRO-2-like traffic,
  unsharded parameters live through backward).

Parameters, gradients and optimizer state are DTensors sharded on dim 0; the model-state probe
counts their local shards. GPU mode uses ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from engines.base import Runner, TorchLoopRunner
from engines.probes import local_tensor
from engines.workload import Workload, build_model


class Fsdp2Runner(TorchLoopRunner):
    name = "fsdp2"
    local = staticmethod(local_tensor)  # DTensor shards: this rank's local part
    tally_names = ("DTensor._local_tensor", "grad._local_tensor", "optimizer.state")

    def __init__(self, workload: Workload, options: dict[str, Any], device: torch.device) -> None:
        self.workload = workload
        self.reshard_after_forward = options.get("fsdp_reshard_after_forward")
        model = build_model(workload).to(device)
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": self.reshard_after_forward}
        if workload.dtype == "bf16":
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.transformer.h:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        self.model = self.forward_module = model
        self.optimizer = torch.optim.AdamW(model.parameters(), **workload.adamw_kwargs())

    def info(self) -> dict[str, Any]:
        raf = self.reshard_after_forward
        return {
            "parameter_groups": f"{len(self.model.transformer.h)} blocks + root",
            "reshard_after_forward": "auto (blocks True, root False)" if raf is None else raf,
            "optimizer": "torch.optim.AdamW (torch default implementation) over DTensor shards",
        }


def build(workload: Workload, options: dict[str, Any], device: torch.device) -> Runner:
    return Fsdp2Runner(workload, options, device)
