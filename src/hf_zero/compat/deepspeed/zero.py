"""``deepspeed.zero`` on hf_zero: ``Init``, ``GatheredParameters``, ``register_external_parameter``.

[Note: deepspeed.zero before initialize]
DeepSpeed partitions a model as ``zero.Init`` builds it; hf_zero shards it in ``initialize``.
Under a stage-3 config ``Init`` makes that config the live one for its block, so a Hugging Face
model built there (``from_config``, ``from_pretrained``) has its parameters on the meta device and
is read slice by slice by ``initialize`` ([Note: lazy sharded loading] in
hf_zero.integrations.zero3_loading); a plain ``nn.Module`` built there is built whole, and
``initialize`` shards it. ``GatheredParameters`` before ``initialize`` reads the meta parameters
it is given whole on every rank (from the checkpoint, or the model's own initialisation), yields
them, and at exit broadcasts them from ``modifier_rank``, or, without one, puts back what was
read, as DeepSpeed discards changes then; ``initialize`` takes them as the real parameters they
now are. After ``initialize`` it is the engine's ``gathered_parameters``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hf_zero.config import HfZeroConfig
from hf_zero.config.live import live_zero3_config, restore_live_zero3_config, set_live_zero3_config

_REFUSED_INIT_ARGUMENTS = {
    "data_parallel_group": "hf_zero shards over the default group's ranks",
    "mpu": "hf_zero has no model-parallel unit",
    "zero_param_parallel_group": "set zero_hpz_partition_size in the config instead (hpZ groups are made from it)",
    "sequence_data_parallel_group": "set sequence_parallel_size in the config instead",
    "param_swapper": "NVMe offload is the config's offload_param section",
}


class Init:
    """``deepspeed.zero.Init``: models built in the block are sharded by ``initialize`` without
    first being built whole on every rank ([Note: deepspeed.zero before initialize])."""

    def __init__(self, module: nn.Module | None = None, data_parallel_group: Any = None,
                 mem_efficient_linear: bool = True, remote_device: str | None = None, pin_memory: bool = False,
                 config_dict_or_path: Any = None, config: Any = None, enabled: bool = True,
                 dtype: torch.dtype | None = None, mpu: Any = None, zero_param_parallel_group: Any = None,
                 zero_quantized_weights: bool = False, zero_quantized_nontrainable_weights: bool = False,
                 sequence_data_parallel_group: Any = None, param_swapper: Any = None) -> None:
        if module is not None:
            raise NotImplementedError("zero.Init(module=...) partitions a model already built; hf_zero shards it in "
                                      "initialize: pass the model to deepspeed.initialize as it is")
        given = {"data_parallel_group": data_parallel_group, "mpu": mpu,
                 "zero_param_parallel_group": zero_param_parallel_group,
                 "sequence_data_parallel_group": sequence_data_parallel_group, "param_swapper": param_swapper}
        for name, value in given.items():
            if value is not None:
                raise NotImplementedError(f"zero.Init({name}=...): {_REFUSED_INIT_ARGUMENTS[name]}")
        if zero_quantized_weights or zero_quantized_nontrainable_weights:
            raise NotImplementedError("zero.Init(zero_quantized_weights=...): hf_zero quantizes the gathers, not the "
                                      "stored weights; set zero_optimization.zero_quantized_weights: true in the "
                                      "config instead (MixZ++'s quantized frozen weights are not supported yet)")
        source = config_dict_or_path if config_dict_or_path is not None else config
        self._previous: Any = live_zero3_config()
        # Without a config DeepSpeed partitions with its defaults: stage 3 here too.
        self.config = HfZeroConfig(source if source is not None else {"zero_optimization": {"stage": 3}}) \
            if enabled else None
        restore_live_zero3_config(self._previous)  # a stage-3 config went live as it was built: only in the block

    def __enter__(self) -> "Init":
        self._previous = live_zero3_config()
        if self.config is not None and self.config.stage == 3:
            set_live_zero3_config(self.config)
        return self

    def __exit__(self, *exc: Any) -> None:
        restore_live_zero3_config(self._previous)


class GatheredParameters:
    """``deepspeed.zero.GatheredParameters``: the full parameters inside the block; with
    ``modifier_rank``, that rank's changes are every rank's at exit ([Note: deepspeed.zero
    before initialize])."""

    def __init__(self, params: Any, modifier_rank: int | None = None, fwd_module: nn.Module | None = None,
                 enabled: bool = True) -> None:
        if params is None:
            params = []
        self.params = [params] if isinstance(params, torch.Tensor) else list(params)
        self.modifier_rank = modifier_rank
        self.enabled = enabled and bool(self.params)
        self._engine_block: Any = None
        self._read: list[tuple[nn.Parameter, torch.Tensor]] = []

    def __enter__(self) -> "GatheredParameters":
        if not self.enabled:
            return self
        from hf_zero.compat.deepspeed import engine_holding

        engine = engine_holding(self.params)
        if engine is not None:
            self._engine_block = engine.gathered_parameters(self.params, modifier_rank=self.modifier_rank)
            self._engine_block.__enter__()
            return self
        from hf_zero.engine.sharding.deferred_load import materialise_params

        read = materialise_params(self.params)
        if self.modifier_rank is None:  # DeepSpeed discards changes made without a modifier rank
            self._read = [(p, p.detach().clone()) for p in read]
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.enabled:
            return
        if self._engine_block is not None:
            self._engine_block.__exit__(*exc)
            return
        import torch.distributed as dist

        with torch.no_grad():
            for param, value in self._read:
                param.copy_(value)
            if self.modifier_rank is not None and dist.is_initialized():
                for param in self.params:
                    dist.broadcast(param.data, src=self.modifier_rank)


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Nothing to register: inside the forward a stage-3 parameter read outside its own module is
    gathered on that read, and again in its backward (README, "Not supported yet", for reads
    outside the forward)."""
