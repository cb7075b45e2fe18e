"""Loaded optimizer state goes where ``torch.optim.Optimizer.load_state_dict`` puts it.

The masters live on the ``meta`` device: a device other than the CPU that exists on every
machine, so a placement that leaves ``step`` on the CPU for a fused or capturable group (which a
CUDA fused AdamW refuses on its first step after a resume) is caught without a GPU.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hf_zero.checkpoint.manifest import optimizer_value_on, param_group_of

GROUP_FLAGS = {
    "plain": {},
    "fused": {"fused": True},
    "capturable": {"capturable": True},
    "fused_false_capturable_none": {"fused": False, "capturable": None},
    "foreach": {"foreach": True},
}
MASTERS = {
    "meta_fp32": lambda: torch.empty(8, device="meta"),
    "meta_bf16": lambda: torch.empty(8, device="meta", dtype=torch.bfloat16),
    "meta_int64": lambda: torch.empty(8, device="meta", dtype=torch.int64),
    "cpu_fp32": lambda: torch.zeros(8),
}
# What a manifest decodes to: tensors on the CPU (decode_state builds them there) and plain numbers.
VALUES = {
    "step_fp32": ("step", lambda: torch.tensor(3.0)),
    "step_int64": ("step", lambda: torch.tensor(3)),
    "step_fp64": ("step", lambda: torch.tensor(3.0, dtype=torch.float64)),
    "step_int": ("step", lambda: 3),
    "scalar_fp64": ("eta", lambda: torch.tensor(0.5, dtype=torch.float64)),
    "scalar_int32": ("count", lambda: torch.tensor(2, dtype=torch.int32)),
    "small_fp16": ("prev", lambda: torch.ones(3, dtype=torch.float16)),
    "number": ("mu", lambda: 1.0),
}


def _torch_placement(param: torch.Tensor, key: str, value: Any, flags: dict[str, Any]) -> Any:
    """What torch itself does for one loaded value (non-tensors are copied as they are)."""
    if not isinstance(value, torch.Tensor):
        return value
    groups = [{"params": [0], **flags}]
    return torch.optim.Optimizer._process_value_according_to_param_policy(param, value, 0, groups, key)


def _where(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (value.device, value.dtype, tuple(value.shape))
    return (type(value), value)


@pytest.mark.parametrize("value_case", list(VALUES))
@pytest.mark.parametrize("master_case", list(MASTERS))
@pytest.mark.parametrize("flags_case", list(GROUP_FLAGS))
def test_placement_matches_torch_load_state_dict(flags_case, master_case, value_case):
    flags, master = GROUP_FLAGS[flags_case], MASTERS[master_case]()
    key, make = VALUES[value_case]
    ours = optimizer_value_on(master, key, make(), {"params": [master], **flags})
    theirs = _torch_placement(master, key, make(), flags)
    assert _where(ours) == _where(theirs)


@pytest.mark.parametrize("flags_case", ["fused", "capturable"])
def test_step_of_a_fused_or_capturable_group_goes_to_the_masters_device_as_fp32(flags_case):
    master = torch.empty(8, device="meta")
    step = optimizer_value_on(master, "step", torch.tensor(7), {"params": [master], **GROUP_FLAGS[flags_case]})
    assert step.device.type == "meta" and step.dtype == torch.float32


def test_step_of_a_plain_group_stays_on_the_cpu_with_its_dtype():
    master = torch.empty(8, device="meta")
    step = torch.tensor(7.0)
    assert optimizer_value_on(master, "step", step, {"params": [master]}) is step


def test_nested_state_is_walked_as_torch_walks_it():
    master = torch.empty(8, device="meta")
    value = {"step": torch.tensor(1.0), "inner": [torch.tensor(1.0, dtype=torch.float64)]}
    placed = optimizer_value_on(master, "extra", value, {"params": [master], "fused": True})
    assert placed["step"].device.type == "meta"
    assert _where(placed["inner"][0]) == (torch.device("meta"), torch.float32, ())


def test_param_group_of_finds_the_group_by_identity():
    a, b = torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)
    optimizer = torch.optim.AdamW([{"params": [a]}, {"params": [b], "lr": 0.5}])
    assert param_group_of(optimizer, b) is optimizer.param_groups[1]
    with pytest.raises(RuntimeError, match="no param group"):
        param_group_of(optimizer, torch.zeros(2))
