"""DeepSpeed's training API on hf_zero: a Trainer-less DeepSpeed script ports by one line.

    import deepspeed                                  # before
    import hf_zero.compat.deepspeed as deepspeed      # after; nothing else changes

    deepspeed.init_distributed()
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = AutoModelForCausalLM.from_config(config)       # built sharded under stage 3
    with deepspeed.zero.GatheredParameters(model.lm_head.weight, modifier_rank=0):
        if torch.distributed.get_rank() == 0:
            model.lm_head.weight.zero_()                       # custom weights before initialize
    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                           config=ds_config)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss); engine.step()
    engine.save_checkpoint(out); engine.load_checkpoint(out)

What is here: :func:`initialize` with DeepSpeed's signature (``mpu`` and ``mesh_param`` refused
with the reason), :func:`init_distributed`, :func:`add_config_arguments`, ``comm`` (DeepSpeed's
collectives are ``torch.distributed``'s), and :mod:`~hf_zero.compat.deepspeed.zero`'s ``Init``,
``GatheredParameters`` and ``register_external_parameter``. The engine is hf_zero's
:class:`~hf_zero.engine.engine.ZeroEngine`, whose methods follow DeepSpeed's (``backward``,
``step``, ``save_checkpoint``, ``load_checkpoint``, ``get_lr``, ``global_steps``...); a DeepSpeed
name it lacks is an AttributeError naming it. See docs/deepspeed-migration.md.
"""

from __future__ import annotations

import argparse
import os
import weakref
from datetime import timedelta
from typing import Any

from torch import distributed as comm  # deepspeed.comm's calls a script makes are torch.distributed's

from hf_zero.compat.deepspeed import zero

__all__ = ["add_config_arguments", "comm", "init_distributed", "initialize", "zero"]

# The engines made here, for zero.GatheredParameters after initialize (weak: a dropped engine goes).
_engines: weakref.WeakSet = weakref.WeakSet()


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True, distributed_port: int = 29500,
                     verbose: bool = True, timeout: timedelta | None = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config: Any = None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Join the default process group from the launcher's environment (torchrun, ``hf-zero
    launch``), as ``deepspeed.init_distributed`` does; nothing when it is joined already."""
    import torch.distributed as dist

    from hf_zero.comm.process_group import default_backend, default_device

    if dist.is_initialized() or dist_init_required is False:
        return
    kwargs: dict[str, Any] = {"backend": dist_backend or default_backend(default_device())}
    if init_method is not None:
        kwargs["init_method"] = init_method
    if rank >= 0 and world_size > 0:
        kwargs.update(rank=rank, world_size=world_size)
    if timeout is not None:
        kwargs["timeout"] = timeout
    dist.init_process_group(**kwargs)


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's ``--deepspeed`` switch and ``--deepspeed_config PATH`` on the script's parser
    (``hf_zero.run`` also reads them, [hf_zero.run])."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    return parser


def initialize(args: Any = None, model: Any = None, optimizer: Any = None, model_parameters: Any = None,
               training_data: Any = None, lr_scheduler: Any = None, distributed_port: int = 29500, mpu: Any = None,
               dist_init_required: bool | None = None, collate_fn: Any = None, config: Any = None,
               mesh_param: Any = None, config_params: Any = None) -> tuple[Any, Any, Any, Any]:
    """``deepspeed.initialize``: (engine, optimizer, training dataloader, lr scheduler) from
    :func:`hf_zero.initialize`. The config is ``config``, else ``config_params``, else
    ``args.deepspeed_config``."""
    import hf_zero

    if mpu is not None:
        raise NotImplementedError("deepspeed.initialize(mpu=...): a model-parallel unit (Megatron's tensor or "
                                  "pipeline groups) has no counterpart in hf_zero, which shards over every rank; "
                                  "drop mpu=")
    if mesh_param is not None:
        raise NotImplementedError("deepspeed.initialize(mesh_param=...): hf_zero has no device mesh for data x "
                                  "sequence parallelism here; set sequence_parallel_size in the config instead")
    if config is None:
        config = config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None)
    if config is None:  # the one hf_zero.run read from --zero_config or --deepspeed
        from hf_zero.integrations._accelerator import CONFIG_ENV

        config = os.environ.get(CONFIG_ENV) or None
    if config is None:
        raise ValueError("deepspeed.initialize needs a config: config=ds_config (a dict or a JSON path), or args "
                         "whose --deepspeed_config names one (add_config_arguments)")
    engine, engine_optimizer, loader, scheduler = hf_zero.initialize(
        model=model, config=config, optimizer=optimizer, model_parameters=model_parameters,
        training_data=training_data, lr_scheduler=lr_scheduler, collate_fn=collate_fn)
    _engines.add(engine)
    return engine, engine_optimizer, loader, scheduler


def engine_holding(params: list[Any]) -> Any:
    """The engine made by :func:`initialize` that holds any of ``params``, or None."""
    wanted = {id(p) for p in params}
    for engine in list(_engines):
        if any(id(p) in wanted for p in engine.module.parameters()):
            return engine
    return None
