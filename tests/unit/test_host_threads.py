"""[Note: host threads] in hf_zero.offload.threads: the offloaded step's thread count from this
rank's cores and ``offload_optimizer.cpuadam_cores_perc``, and torch's count put back after it."""

from __future__ import annotations

import pytest
import torch

from hf_zero.offload.threads import host_step_threads, rank_cores, running_on


@pytest.mark.parametrize("affinity, node, local, cores", [
    (64, 64, 8, 8),    # torchrun, unbound: the machine divided among the node's ranks
    (64, 64, 1, 64),   # one rank per node
    (8, 64, 8, 8),     # numactl / taskset: eight cores of its own each
    (16, 64, 8, 2),    # a cpuset of 16 that 8 ranks cannot each own: shared
    (2, 2, 2, 1),      # this machine under torchrun --nproc_per_node 2
    (3, 64, 8, 3),
    (4, 4, 8, 1),      # more ranks than cores: still one thread
])
def test_rank_cores(affinity: int, node: int, local: int, cores: int) -> None:
    assert rank_cores(affinity, node, local) == cores


@pytest.mark.parametrize("share, cores, threads", [(0.8, 8, 6), (0.8, 2, 2), (0.8, 1, 1), (1.0, 8, 8),
                                                    (0.5, 2, 1), (0.0, 8, 1), (0.1, 64, 6)])
def test_the_share_of_the_cores(share: float, cores: int, threads: int) -> None:
    assert host_step_threads(share, cores) == threads


def test_running_on_sets_the_count_back() -> None:
    before = torch.get_num_threads()
    target = 1 if before > 1 else 2
    with running_on(target):
        assert torch.get_num_threads() == target
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError):
        with running_on(target):
            raise ValueError("inside")
    assert torch.get_num_threads() == before
    with running_on(0):  # nothing on the host: left alone
        assert torch.get_num_threads() == before
