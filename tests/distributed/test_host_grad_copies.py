"""Reduced gradients reach host gradient shards without the backward waiting for the copies
([Note: gradients copied to the host] in hf_zero/offload/grad_copies.py): under late completion
the copies still in flight at the end of the backward hold poison until the step lands them, and
the training equals the same run without offload."""

from __future__ import annotations

import math
from typing import Any

import torch

from tests.distributed import scenarios as S
from tests.distributed.launch import run_distributed

# Clipping on: the step runs after the backward (no overlapped worker), so every landing is the
# step's. One collective per group: many reductions, each a copy to the host.
_ZERO = {"reduce_bucket_size": 0}


def _train(offload: bool) -> dict[str, Any]:
    import hf_zero
    from hf_zero.execution import checking
    from hf_zero.offload.grad_copies import IN_FLIGHT

    zero = dict(_ZERO, **({"offload_optimizer": {"device": "cpu"}} if offload else {}))
    sc = S.scenario("llama", 2, steps=3, zero=zero)
    engine, *_ = hf_zero.initialize(model=S.build_model(sc), config=S.make_config(sc))
    copies = next(iter(engine.units)).groups[0].offload.grad_copies
    in_flight, poisoned = [], []
    with checking(True):
        for step in range(sc["steps"]):
            batch = S.learnable_batch(step, engine.world_size * sc["micro"])
            ids = batch[engine.rank * sc["micro"]:(engine.rank + 1) * sc["micro"]]
            engine.backward(S.model_loss(engine, "llama", ids))
            if copies is not None:
                in_flight.append(copies.in_flight())
                poisoned.append(all(bool(torch.isnan(c.staging).all()) for c in copies._queue))
            engine.step()
    return {"in_flight": in_flight, "poisoned": poisoned, "params": S.full_params(engine),
            "bound": IN_FLIGHT}


def _both() -> dict[str, Any]:
    return {"offload": _train(True), "plain": _train(False)}


def test_the_backward_leaves_the_last_copies_in_flight_and_the_step_lands_them() -> None:
    for result in run_distributed(_both, 2):
        offload, plain = result["offload"], result["plain"]
        assert offload["in_flight"] == [offload["bound"]] * 3  # issued, not waited for, in the backward
        assert all(offload["poisoned"])  # not landed: under late completion they are still poison
        worst = max(abs(a - b) for name in plain["params"]
                    for a, b in zip(offload["params"][name], plain["params"][name]))
        assert worst < 1e-6, worst
        assert not any(math.isnan(x) for values in offload["params"].values() for x in values)
