"""Every parameter view and every shard of a flat buffer starts 16-byte aligned ([Note: alignment
in flat buffers] in hf_zero/partition.py), for every compute dtype and world size; no process group.
(tests/distributed/test_aligned_layout.py checks the engine at world sizes 2 and 3, and that
checkpoints saved with the earlier layout still load.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_zero import partition
from hf_zero.comm import Communicator
from hf_zero.engine.sharding.flat_group import FlatParamGroup, GroupKind
from hf_zero.engine.policy import ShardingPolicy
from hf_zero.partition import build_flat_layout

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def odd_model() -> nn.Module:
    """Parameters of 21, 3, 15, 5, 5, 5, 5 and 1 elements: none a multiple of 8."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 3), nn.Linear(3, 5), nn.LayerNorm(5), nn.Linear(5, 1))


def aligned(tensor: torch.Tensor) -> bool:
    return tensor.data_ptr() % 16 == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_view_and_shard_of_a_layout_is_16_byte_aligned(dtype, world):
    named = list(odd_model().named_parameters())
    layout = build_flat_layout(named, world)
    flat = torch.zeros(layout.padded_numel, dtype=dtype)
    assert aligned(flat)
    for slot in layout.slots:
        assert aligned(slot.view_in(flat)), (slot, dtype, world)
    for rank in range(world):
        lo, hi = layout.shard_range(rank)
        assert hi - lo == layout.shard_numel and aligned(flat[lo:hi]), (rank, dtype, world)
    ends = [(s.offset, s.offset + s.numel) for s in layout.slots]
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ends, ends[1:]))  # in order, disjoint
    assert ends[-1][1] <= layout.padded_numel and layout.padded_numel % world == 0
    assert layout.numel == sum(p.numel() for _, p in named)


def test_hand_calculation_of_the_odd_model():
    # 21 at 0; 3 at 24; 15 at 32; 5 at 48, 56, 64, 72; 1 at 80 -> ends at 81; padded to a multiple
    # of world x 8: 88 (world 1), 96 (world 2 and 3).
    named = list(odd_model().named_parameters())
    for world, padded in [(1, 88), (2, 96), (3, 96)]:
        layout = build_flat_layout(named, world)
        assert [s.offset for s in layout.slots] == [0, 24, 32, 48, 56, 64, 72, 80]
        assert layout.numel == 60 and layout.padded_numel == padded


def test_the_earlier_layout_is_the_same_rule_without_alignment(monkeypatch):
    """What tests/distributed/test_aligned_layout.py saves its old-layout checkpoint with:
    parameters back to back, padded to a multiple of world x 4 (hf_zero before alignment)."""
    monkeypatch.setattr(partition, "PARAM_ALIGNMENT", 1)
    monkeypatch.setattr(partition, "SHARD_ALIGNMENT", 4)
    layout = build_flat_layout(list(odd_model().named_parameters()), 3)
    assert [s.offset for s in layout.slots] == [0, 21, 24, 39, 44, 49, 54, 59]
    assert layout.numel == 60 and layout.padded_numel == 60


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_flat_group_binds_aligned_parameters_and_gradients(dtype, stage):
    model = odd_model()
    group = FlatParamGroup("odd#0", list(model.named_parameters()), GroupKind(True, False, 0), Communicator(),
                           ShardingPolicy.for_stage(stage), dtype, torch.device("cpu"))
    group.storage.unshard()  # stage 3: gather the full buffer (a no-op otherwise)
    group.grads.prepare()
    for name, param in model.named_parameters():
        assert param.dtype == dtype and aligned(param) and aligned(param.grad), (name, dtype, stage)
