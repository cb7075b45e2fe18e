"""The offloaded optimizer step runs on this rank's share of the cores whatever thread count the
launcher left torch with ([Note: host threads] in hf_zero.offload.threads): on a real gloo group
of 2 whose ranks stand for one rank per node (``LOCAL_WORLD_SIZE=1``) and start, as ``torchrun``
leaves them, on one torch thread, every call of the host Adam kernel (torch's fused CPU AdamW)
sees the count the rule gives, on the step's thread and on the overlapped step's worker, and
torch's count is one again after each step. The count is read inside the kernel call, so a step
that ignored the rule would show one thread."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
import torch

from hf_zero.offload.threads import host_step_threads
from tests.distributed import scenarios as S
from tests.distributed.launch import run_distributed

CASES = {
    "s2-clip": dict(stage=2, clip=1.0, share=0.8),
    "s3-overlapped": dict(stage=3, clip=0.0, share=0.8),  # no clipping: the step runs on a worker
    "s2-half": dict(stage=2, clip=1.0, share=0.5),
}


def _train(case: dict[str, Any]) -> dict[str, Any]:
    import hf_zero

    zero = {"offload_optimizer": {"device": "cpu", "cpuadam_cores_perc": case["share"]}}
    sc = S.scenario("gpt2", case["stage"], clip=case["clip"], zero=zero)
    seen: list[tuple[str, int]] = []
    original = torch._fused_adamw_

    def counting(*args: Any, **kwargs: Any) -> Any:
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        return original(*args, **kwargs)

    torch.set_num_threads(1)  # what torchrun leaves each of several ranks on a node
    engine, *_ = hf_zero.initialize(model=S.build_model(sc), config=S.make_config(sc))
    after = []
    torch._fused_adamw_ = counting
    try:
        for step in range(3):
            batch = S.learnable_batch(step, engine.world_size * sc["micro"])
            ids = batch[engine.rank * sc["micro"]:(engine.rank + 1) * sc["micro"]]
            engine.backward(S.model_loss(engine, "gpt2", ids))
            engine.step()
            after.append(torch.get_num_threads())
    finally:
        torch._fused_adamw_ = original
    return {"threads": sorted({t for _, t in seen}), "threads_seen": len(seen), "after": after,
            "on_worker": any(name.startswith("hf_zero-offload-step") for name, _ in seen),
            "expected": host_step_threads(case["share"])}


def _every_case() -> dict[str, Any]:
    os.environ["LOCAL_WORLD_SIZE"] = "1"  # one rank per node: the machine's cores are this rank's
    return {name: _train(case) for name, case in CASES.items()}


@pytest.fixture(scope="module")
def trained() -> list[dict[str, Any]]:
    if host_step_threads(0.8, len(os.sched_getaffinity(0))) < 2:
        pytest.skip("one core: the rule's count and torchrun's are the same")
    return run_distributed(_every_case, 2)


@pytest.mark.parametrize("name", list(CASES))
def test_the_host_step_runs_on_the_rank_s_share_of_the_cores(trained, name: str) -> None:
    for rank in trained:
        found = rank[name]
        assert found["threads_seen"] > 0
        assert found["threads"] == [found["expected"]], found
        assert found["after"] == [1, 1, 1]  # the script's own count, back after each step
    assert trained[0]["s3-overlapped"]["on_worker"]
