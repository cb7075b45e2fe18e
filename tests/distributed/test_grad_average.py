"""Where a gradient reduction divides by the world size ([Note: averaging gradients over ranks] in
hf_zero/engine/sharding/grad_average.py), on a real gloo group of 3 ranks.

Every parameter's gradient is known exactly: the model's Linear layers all read the same input x
and the loss is the sum of their outputs, so a weight's gradient is x in every row and a bias's
is 1. Each rank's x holds integers below 81, exact in bf16, and the sum of three of them (at most
240) is exact in bf16 too. The fp64 reference is the exact mean over ranks. Summed without a
pre-divide and divided in fp32, the fp32 gradient shard is within 2^-23 of it (the rounding of 1/3
and of one product); the old path divided each rank's gradient by 3 in bf16 first, a relative
error up to 2^-9 per element before the sum.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.distributed.launch import run_distributed

WORLD = 3
FEATURES = 7
TOL = 1e-6  # relative, per element: the new path's bound is 2^-23 = 1.2e-7
SIGNAL_MARGIN = 100  # the old path's error must exceed the tolerance this many times
FP16_TOL = 2e-3  # fp16 keeps its pre-divide: 2^-11 per rounding, a few of them

CASES: dict[str, dict[str, Any]] = {
    # compute dtype, stage, communication_data_type (None: the compute dtype), reduce_bucket_size
    "bf16_s2_packed_bucket": dict(dtype="bf16", stage=2),
    "bf16_s2_group_in_place": dict(dtype="bf16", stage=2, bucket=0),
    "bf16_s3": dict(dtype="bf16", stage=3),
    "bf16_s1": dict(dtype="bf16", stage=1),
    "bf16_s0_all_reduce": dict(dtype="bf16", stage=0),
    "fp32_bf16_comm_s2": dict(dtype="fp32", stage=2, comm="bf16"),
    "fp32_bf16_comm_s0": dict(dtype="fp32", stage=0, comm="bf16"),  # the fp32 buffer is the shard
    "bf16_fp32_comm_s2": dict(dtype="bf16", stage=2, comm="fp32"),
    "fp16_s2": dict(dtype="fp16", stage=2),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class SharedInput(nn.Module):
    """Linear layers of odd sizes that all read the input; the loss is the sum of their outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(FEATURES, 3), nn.Linear(FEATURES, 5), nn.Linear(FEATURES, 2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(layer(x).sum() for layer in self.layers)


def rank_input(rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randint(1, 81, (1, FEATURES), generator=generator).float()


def _config(case: dict[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": case["stage"], "stage3_param_persistence_threshold": 0,
                              "reduce_bucket_size": case.get("bucket", 10_000)},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "bf16": {"enabled": case["dtype"] == "bf16"},
    }
    if case["dtype"] == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 1.0}  # static 1: the gradient as it is
    if "comm" in case:
        config["communication_data_type"] = case["comm"]
    return config


def _reduced_gradients(case: dict[str, Any]) -> dict[str, Any]:
    """This rank's fp32 gradient shard of every group after one backward, with its layout."""
    import hf_zero

    torch.manual_seed(0)
    engine, *_ = hf_zero.initialize(model=SharedInput(), config=_config(case))
    x = rank_input(engine.rank).to(DTYPES[case["dtype"]])
    engine.backward(engine(x))
    groups = []
    for unit in engine.units:
        for group in unit.groups:
            groups.append({"slots": [(s.name, s.offset, s.numel) for s in group.layout.slots],
                           "world_size": group.layout.world_size,
                           "shard": group.grads.shard.tolist()})
    return {"groups": groups}


def _run_cases() -> dict[str, Any]:
    return {name: _reduced_gradients(case) for name, case in CASES.items()}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(_run_cases, WORLD)


def exact_mean() -> dict[str, torch.Tensor]:
    """The fp64 mean over ranks of every parameter's gradient, by name."""
    xs = torch.stack([rank_input(r)[0].double() for r in range(WORLD)])
    model = SharedInput()
    return {name: (xs.mean(0).expand(p.shape) if p.dim() == 2 else torch.ones(p.shape, dtype=torch.float64))
            for name, p in model.named_parameters()}


def pre_divide_mean(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What the old path gives: each rank's gradient divided by 3 in ``dtype``, then summed in
    ``dtype`` in rank order (gloo's reduce-scatter order)."""
    model = SharedInput()
    out = {}
    for name, p in model.named_parameters():
        parts = [(rank_input(r)[0].expand(p.shape) if p.dim() == 2 else torch.ones(p.shape)).to(dtype) / WORLD
                 for r in range(WORLD)]
        total = parts[0] + parts[1]
        for part in parts[2:]:
            total = total + part
        out[name] = total.double()
    return out


def engine_gradients(per_rank: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Each parameter's averaged gradient, reassembled from every rank's fp32 gradient shard."""
    grads = {}
    for index, group in enumerate(per_rank[0]["groups"]):
        if group["world_size"] == 1:  # stage 0: every rank holds the whole; they must agree
            flat = torch.tensor(group["shard"], dtype=torch.float64)
            for r in per_rank[1:]:
                assert r["groups"][index]["shard"] == group["shard"]
        else:
            flat = torch.cat([torch.tensor(r["groups"][index]["shard"], dtype=torch.float64) for r in per_rank])
        for name, offset, numel in group["slots"]:
            grads[name] = flat[offset:offset + numel]
    return grads


def max_relative_error(got: dict[str, torch.Tensor], exact: dict[str, torch.Tensor]) -> float:
    assert got.keys() == exact.keys()
    return max(float(((got[n].reshape(-1) - exact[n].reshape(-1)).abs() / exact[n].reshape(-1).abs()).max())
               for n in exact)


def test_the_inputs_are_exact_in_bf16():
    xs = torch.stack([rank_input(r) for r in range(WORLD)])
    assert torch.equal(xs.bfloat16().float(), xs) and float(xs.sum(0).max()) <= 256


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if "bf16" in (c["dtype"], c.get("comm"))
                                  and c.get("comm") != "fp32"])
def test_bf16_reduction_sums_then_divides_in_fp32(results, name):
    exact = exact_mean()
    old_error = max_relative_error(pre_divide_mean(torch.bfloat16), exact)
    error = max_relative_error(engine_gradients([r[name] for r in results]), exact)
    assert old_error > SIGNAL_MARGIN * TOL  # the case can tell the two paths apart
    assert error <= TOL, (error, old_error)
    assert old_error - error > TOL


def test_fp32_reduction_of_bf16_gradients(results):
    """communication_data_type fp32 with bf16 compute: the reduction runs in fp32."""
    error = max_relative_error(engine_gradients([r["bf16_fp32_comm_s2"] for r in results]), exact_mean())
    assert error <= TOL


def test_fp16_keeps_its_pre_divide(results):
    """fp16's range is small: on gloo (no AVG) each rank still divides before the sum, so the
    result is the pre-divide path's to the bit, close to the exact mean but not equal to it."""
    exact = exact_mean()
    got = engine_gradients([r["fp16_s2"] for r in results])
    expected = pre_divide_mean(torch.float16)
    assert all(torch.equal(got[n].reshape(-1), expected[n].reshape(-1)) for n in expected)
    assert TOL < max_relative_error(got, exact) <= FP16_TOL
