"""The state enums of a flat group's three parts and their checked transitions: the parameter
storage (SHARDED / GATHERING / GATHERED), the gradient buffer (EMPTY / ACCUMULATING / REDUCING)
and the master (its placement, with the NVMe store bound once). World size 1: no process group."""

from __future__ import annotations

import pytest
import torch

from hf_zero.comm import Communicator
from hf_zero.engine.sharding.flat_group import FlatParamGroup, GroupKind
from hf_zero.engine.sharding.grad_buffer import GradBufferState
from hf_zero.engine.sharding.master_state import MasterPlacement, MasterState
from hf_zero.engine.sharding.param_storage import StorageState
from hf_zero.engine.policy import ShardingPolicy
from hf_zero.offload import OffloadSettings


def _group(stage: int, dtype: torch.dtype = torch.float32) -> FlatParamGroup:
    model = torch.nn.Linear(4, 3)
    return FlatParamGroup("g#0", list(model.named_parameters()), GroupKind(True, False, 0), Communicator(),
                          ShardingPolicy.for_stage(stage), dtype, torch.device("cpu"))


def test_storage_gathers_and_frees_through_its_states() -> None:
    storage = _group(3).storage
    assert storage.state is StorageState.SHARDED
    with pytest.raises(RuntimeError, match=r"g#0: cannot free the full buffer: its parameter storage is sharded, expected gathered"):
        storage.free()
    with pytest.raises(RuntimeError, match="cannot finish a gather: its parameter storage is sharded"):
        storage.finish_gather()
    storage.unshard(async_op=True)
    assert storage.state is StorageState.GATHERING and not storage.is_unsharded
    storage.unshard(async_op=True)  # idempotent: no second gather
    with pytest.raises(RuntimeError, match="cannot free the full buffer: its parameter storage is gathering"):
        storage.free()
    storage.wait_unshard()
    assert storage.state is StorageState.GATHERED and storage.is_unsharded
    with pytest.raises(RuntimeError, match="cannot start a gather: its parameter storage is gathered, expected sharded"):
        storage.start_gather(async_op=False)
    storage.reshard()
    assert storage.state is StorageState.SHARDED and storage.full.untyped_storage().nbytes() == 0


def test_a_replicated_storage_stays_gathered() -> None:
    storage = _group(2).storage
    storage.unshard()
    storage.reshard()
    assert storage.state is StorageState.GATHERED


def test_gradients_reduce_once_at_a_time() -> None:
    grads = _group(2).grads
    assert grads.state is GradBufferState.EMPTY  # sharded gradients: no memory until a backward
    grads.prepare(for_backward=True)
    assert grads.state is GradBufferState.ACCUMULATING and grads.has_grads()
    with pytest.raises(RuntimeError, match="cannot finish a gradient reduction: its gradients are accumulating"):
        grads.finish_reduce(None)  # type: ignore[arg-type]
    pending = grads.start_reduce(torch.float32, async_op=False)
    assert grads.state is GradBufferState.REDUCING
    with pytest.raises(RuntimeError, match="g#0: cannot start a gradient reduction: one is already in flight"):
        grads.start_reduce(torch.float32, async_op=False)
    grads.finish_reduce(pending)
    assert grads.state is GradBufferState.EMPTY and not grads.has_grads()  # freed into the shard


def test_stage0_gradients_keep_their_buffer_across_the_reduction() -> None:
    grads = _group(0).grads
    assert grads.state is GradBufferState.ACCUMULATING
    grads.finish_reduce(grads.start_reduce(torch.float32, async_op=False))
    assert grads.state is GradBufferState.ACCUMULATING and grads.full.untyped_storage().nbytes() > 0


def test_a_frozen_group_has_no_gradients_and_no_master() -> None:
    model = torch.nn.Linear(4, 3)
    group = FlatParamGroup("frozen#0", list(model.named_parameters()), GroupKind(False, False, 0), Communicator(),
                           ShardingPolicy.for_stage(2), torch.float32, torch.device("cpu"))
    assert group.grads.state is GradBufferState.EMPTY and group.grads.start_reduce(torch.float32, False) is None
    assert group.master_state.placement is MasterPlacement.NONE and group.master_state.tensor is None


@pytest.mark.parametrize(("dtype", "placement"), [(torch.float32, MasterPlacement.ALIASED),
                                                  (torch.bfloat16, MasterPlacement.DEVICE)])
def test_the_master_is_placed_by_precision(dtype: torch.dtype, placement: MasterPlacement) -> None:
    group = _group(2, dtype)
    assert group.master_state.placement is placement
    assert group.master_state.is_compute_shard == (placement is MasterPlacement.ALIASED)


def test_the_nvme_store_is_bound_once_before_use() -> None:
    shard = torch.ones(4)
    master = MasterState("g#0", shard, torch.float32, OffloadSettings(optimizer="nvme"), separate=False)
    assert master.placement is MasterPlacement.UNBOUND_NVME
    with pytest.raises(RuntimeError, match=r"g#0: cannot read the master: its master is unbound_nvme \(initialize binds"):
        master.read()
    store = object()
    master.bind_nvme(store, 3)  # type: ignore[arg-type]
    assert master.placement is MasterPlacement.NVME and master.nvme_index == 3 and master.nvme_store is store
    with pytest.raises(RuntimeError, match="cannot bind an NVMe store: its master is nvme, expected unbound_nvme"):
        master.bind_nvme(store, 3)  # type: ignore[arg-type]
    on_device = MasterState("g#1", shard, torch.float32, OffloadSettings(), separate=False)
    with pytest.raises(RuntimeError, match="cannot bind an NVMe store: its master is aliased"):
        on_device.bind_nvme(store, 0)  # type: ignore[arg-type]
