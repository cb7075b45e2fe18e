"""The engine's full weights gathered unit by unit: what a model folder and
``engine.save_16bit_model`` are written from.

[Note: which copy of the weights is saved]
A model folder is written from the fp32 master weights unless the config asks for 16-bit
(``zero_optimization.stage3_gather_16bit_weights_on_model_save``), in which case the compute copy
(bf16 / fp16, or fp32 when the run computes in fp32) is saved, as DeepSpeed does. With fp32
compute the master *is* the compute shard (see [Note: master aliasing] in master_state.py), so
both choices give the same bytes. With 16-bit compute the fp32 masters are all-gathered group by
group; frozen parameters have no master and are saved from their compute copy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from hf_zero.engine.sharding.flat_group import FlatParamGroup
from hf_zero.transfer import to_compute

if TYPE_CHECKING:
    from hf_zero.engine.engine import ZeroEngine


def save_dtype(engine: ZeroEngine) -> torch.dtype:
    """See [Note: which copy of the weights is saved]."""
    if engine.config.zero.stage3_gather_16bit_weights_on_model_save:
        return engine.config.compute_dtype
    return torch.float32


def _master_flat(engine: ZeroEngine, group: FlatParamGroup) -> torch.Tensor | None:
    """The group's fp32 master as one full flat tensor, or None when the compute copy is exact."""
    if group.master_state.tensor is None or group.master_state.is_compute_shard:
        return None  # frozen, or fp32 compute: the master is the compute copy
    master = group.master_state.read()  # from the NVMe files under offload_optimizer nvme
    if group.layout.world_size == 1:
        return master  # stage 0: the master is already full
    # An offloaded master lives on the host: the all-gather runs on the compute device.
    master = to_compute(master, group.storage.full.device)
    full = torch.empty(group.layout.padded_numel, dtype=torch.float32, device=master.device)
    engine.comm.all_gather_into(full, master, label=f"{group.label}.export")
    return full


@contextlib.contextmanager
def _gathered_unit(engine: ZeroEngine, unit_params: list[torch.Tensor]) -> Iterator[None]:
    if unit_params:
        with engine.gathered_parameters(unit_params):
            yield
    else:
        yield


def gather_full_state_dict(
    engine: ZeroEngine, dtype: torch.dtype | None = None, rank0_only: bool = True
) -> dict[str, torch.Tensor]:
    """The module's full state dict (parameters and persistent buffers) as CPU tensors.

    Collective: every rank must call it. Units are gathered one at a time, so beyond the result
    a rank holds at most one unit's full parameters. With ``rank0_only`` the other ranks return
    an empty dict. Tied parameters stay one tensor under each of their names, so
    ``save_pretrained`` recognises them. ``dtype`` defaults to :func:`save_dtype`.
    """
    dtype = save_dtype(engine) if dtype is None else dtype
    keep = engine.rank == 0 or not rank0_only
    by_param: dict[int, torch.Tensor] = {}
    for unit in engine.units:
        params = [p for group in unit.groups for p in group.params]
        with torch.no_grad(), _gathered_unit(engine, params):
            for group in unit.groups:
                master = _master_flat(engine, group) if dtype == torch.float32 else None
                if not keep:
                    continue
                for slot, param in zip(group.layout.slots, group.params):
                    source = param if master is None else master[slot.offset : slot.offset + slot.numel]
                    by_param[id(param)] = source.detach().reshape(slot.shape).to("cpu", dtype).clone()
    if not keep:
        return {}
    state: dict[str, torch.Tensor] = {}
    for name, value in engine.module.state_dict(keep_vars=True).items():
        tensor = by_param.get(id(value))
        if tensor is None:  # a buffer: replicated, never sharded
            tensor = value.detach().to("cpu").clone()
        state[name] = tensor
    return state
