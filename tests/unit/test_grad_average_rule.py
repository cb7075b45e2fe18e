"""The rule of [Note: averaging gradients over ranks] (hf_zero/engine/sharding/grad_average.py), as a
table; no process group. tests/distributed/test_grad_average.py checks its numbers at world 3."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hf_zero.comm import Communicator
from hf_zero.engine.sharding.grad_average import GradAverage, average_for, plan_average, post_divisor

SUM, AVG = dist.ReduceOp.SUM, dist.ReduceOp.AVG


@pytest.mark.parametrize("dtype,world,collective_averages,expected", [
    # fp32: pre-divide, as always (bit-identical results), whether or not the collective could average
    (torch.float32, 3, False, GradAverage(3, SUM, 1)),
    (torch.float32, 3, True, GradAverage(3, SUM, 1)),
    # bf16: sum, then divide in fp32 when accumulating
    (torch.bfloat16, 3, False, GradAverage(1, SUM, 3)),
    (torch.bfloat16, 8, True, GradAverage(1, SUM, 8)),
    # fp16: divide before the sum; by the collective where it can (NCCL), else by each rank
    (torch.float16, 3, False, GradAverage(3, SUM, 1)),
    (torch.float16, 3, True, GradAverage(1, AVG, 1)),
    # one rank: nothing to divide
    (torch.bfloat16, 1, False, GradAverage(1, SUM, 1)),
    (torch.float16, 1, True, GradAverage(1, SUM, 1)),
])
def test_where_the_division_happens(dtype, world, collective_averages, expected):
    assert average_for(dtype, world, collective_averages) == expected


def test_every_rule_divides_exactly_once():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for averages in (False, True):
            rule = average_for(dtype, 4, averages)
            divided = rule.pre_divisor * rule.post_divisor * (4 if rule.op == AVG else 1)
            assert divided == 4, (dtype, averages, rule)
            assert post_divisor(dtype, 4) == rule.post_divisor


def test_cpu_and_a_single_rank_never_ask_the_communicator_for_an_op():
    """Off NCCL (and at world size 1) the op stays a sum: gloo has no AVG."""
    comm = Communicator()  # no process group: world size 1
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert plan_average(dtype, comm, torch.device("cpu")).op == SUM
