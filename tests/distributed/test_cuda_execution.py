"""The execution layer on a GPU ([Note: streams and events] in hf_zero.execution.streams): the
side streams exist and are used, the compute stream waits on events rather than the host, and a
stage-3 engine trains the same under late completion as without. Skips loudly without CUDA
(tests/cuda_suite.py)."""

from __future__ import annotations

import pytest
import torch

from tests.cuda_suite import require_cuda
from tests.distributed import scenarios as S


@pytest.fixture(autouse=True)
def _cuda() -> None:
    require_cuda()


def test_side_streams_are_distinct_from_the_compute_stream() -> None:
    from hf_zero.execution import bind_device, execution_for

    device = torch.device("cuda", 0)
    bind_device(device)
    execution = execution_for(device)
    compute = torch.cuda.current_stream(device)
    streams = execution.streams
    assert set(streams) == {"all_gather", "reduce_scatter", "copy_in", "copy_out"}
    assert len({s.cuda_stream for s in streams.values()} | {compute.cuda_stream}) == 5


def test_a_copy_in_is_ordered_before_the_collective_that_reads_it() -> None:
    """A pinned host tensor goes to the GPU on copy_in; the (world-1) all-gather depends on it
    through ``after``; the compute stream waits on the gather's event and reads the right values."""
    from hf_zero.comm import Communicator
    from hf_zero.execution import bind_device
    from hf_zero.transfer import to_compute_async, to_host

    device = torch.device("cuda", 0)
    bind_device(device)
    host = to_host(torch.arange(1 << 20, dtype=torch.float32), pin=True)
    assert host.is_pinned()
    shard, copied = to_compute_async(host, device)
    full = torch.empty(1 << 20, device=device)
    handle = Communicator().all_gather_into(full, shard, label="probe", async_op=True, after=(copied,))
    handle.wait()
    assert torch.equal(full.cpu(), torch.arange(1 << 20, dtype=torch.float32))


@pytest.mark.parametrize("late", [False, True])
def test_stage3_with_parameter_offload_trains_alike_with_and_without_late_completion(late: bool) -> None:
    from hf_zero.execution import checking

    plain = S.scenario("llama", 3, steps=3)
    offloaded = S.scenario("llama", 3, steps=3, zero={"offload_param": {"device": "cpu"},
                                                      "offload_optimizer": {"device": "cpu"}})
    with checking(late):
        a = S.train_engine(plain)
        b = S.train_engine(offloaded)
    for x, y in zip(a["losses"], b["losses"]):
        assert x == pytest.approx(y, abs=1e-5)
