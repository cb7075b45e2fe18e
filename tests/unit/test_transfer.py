"""Device discipline, checked on a CPU-only machine ([Note: host-device transfers]).

On a GPU, a collective handed a host tensor fails on NCCL; on CPU it would silently work, so
host-store memory is registered and the communicator refuses it at any world size. These tests
run the real offloaded optimizer step and export through that check.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hf_zero
from hf_zero.comm import Communicator
from hf_zero.transfer import is_host_store, to_compute, to_host
from tests.distributed import scenarios as S


@pytest.fixture
def no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    assert not dist.is_initialized()


def test_host_store_memory_is_refused_by_every_collective(no_launcher_env):
    comm = Communicator()
    host = to_host(torch.ones(8), pin=False)
    assert is_host_store(host) and not is_host_store(torch.ones(8))
    out = torch.empty(8)
    for call in (lambda: comm.all_reduce_(host, label="x"), lambda: comm.broadcast_(host, 0, label="x"),
                 lambda: comm.all_gather_into(out, host, label="x"),
                 lambda: comm.reduce_scatter_into(out, host, label="x")):
        with pytest.raises(RuntimeError, match="host \\(offload\\) memory.*to_compute"):
            call()
    moved = to_compute(host, torch.device("cpu"))  # a copy that is no longer host-store memory
    assert comm.all_reduce_(moved, label="x").tolist() == [1.0] * 8


def test_to_host_never_aliases_the_callers_tensor():
    values = torch.arange(4.0)
    host = to_host(values, pin=False)
    values.add_(1)
    assert host.tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offloaded_clipped_step_moves_the_host_norm_to_the_compute_device(no_launcher_env, stage):
    """offload_optimizer cpu keeps the gradient shards in host memory; the clipped step needs
    the global norm through a collective, so the norm summed on the host must be moved first."""
    sc = S.scenario("gpt2", stage, dtype="bf16")
    config = S.make_config(sc)
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    engine, _, _, _ = hf_zero.initialize(model=S.build_model(sc), config=config)
    ids = torch.randint(0, 97, (2, 12))
    for _ in range(2):
        engine.backward(S.model_loss(engine, "gpt2", ids))
        engine.step()
    assert engine.get_global_grad_norm() > 0
    on_host = [is_host_store(g.grads.shard) for u in engine.units for g in u.groups if g.grads.shard is not None]
    assert on_host and all(on_host)
