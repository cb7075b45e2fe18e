"""A steady-state training step makes no host synchronisation ([Note: host synchronisations] in
hf_zero.execution.host_sync, [Note: a step the host does not wait for] in
hf_zero.engine.optim.step_pipeline): on a real gloo group of 2, at every stage, in fp32, bf16 and
fp16, with and without clipping and gradient accumulation, the third optimizer step's forward,
backward and ``step()`` read no device value on the host, build no device tensor from a Python
list, and wait for no device work, counted from hf_zero's own frames. The phase check-ins still
run (they go over the host group, [Note: the host group] in hf_zero.comm), and asking for the
norm right after a step is one wait, so the counter sees what it counts. The ranks run without
the checking mode of [Note: late completion], whose comparisons read on the host by design.
(test_fake_world.py counts the stage-3 step of rank 5 and 0 of a fake world of 8 the same way,
on a GPU also under torch's sync debug mode.)"""

from __future__ import annotations

from typing import Any

import pytest

from hf_zero.execution import CHECK_ENV
from tests.distributed import scenarios as S
from tests.distributed.launch import in_group, run_distributed

CASES = {
    **{f"s{stage}-{dtype}": dict(model="gpt2", stage=stage, dtype=dtype)
       for stage in (0, 1, 2, 3) for dtype in ("fp32", "bf16", "fp16")},
    "s3-llama-bf16": dict(model="llama", stage=3, dtype="bf16"),
    "s3-bf16-no-clip": dict(model="gpt2", stage=3, dtype="bf16", clip=0.0),
    "s3-fp16-no-clip": dict(model="gpt2", stage=3, dtype="fp16", clip=0.0),
    "s1-fp32-gas2": dict(model="gpt2", stage=1, dtype="fp32", gas=2),
    "s3-bf16-gas2": dict(model="gpt2", stage=3, dtype="bf16", gas=2),
}
WARMUP_STEPS = 2


def _micro_step(engine: Any, sc: dict[str, Any], step: int) -> None:
    batch = S.learnable_batch(step, engine.world_size * sc["micro"])
    ids = batch[engine.rank * sc["micro"]:(engine.rank + 1) * sc["micro"]]
    engine.backward(S.model_loss(engine, sc["model"], ids))
    engine.step()


def _count(case: dict[str, Any]) -> dict[str, Any]:
    import hf_zero
    from hf_zero.execution.host_sync import HostSyncCounter

    sc = S.scenario(case["model"], case["stage"], case.get("gas", 1), dtype=case["dtype"],
                    **({"clip": case["clip"]} if "clip" in case else {}))
    engine, *_ = hf_zero.initialize(model=S.build_model(sc), config=S.make_config(sc))
    gas = sc["gas"]
    for step in range(WARMUP_STEPS * gas):
        _micro_step(engine, sc, step)
    trace: list[tuple[str, str]] = []
    engine.comm.trace = trace
    with HostSyncCounter(engine.device) as steady:
        for micro in range(gas):
            _micro_step(engine, sc, WARMUP_STEPS * gas + micro)
    engine.comm.trace = None
    with HostSyncCounter(engine.device) as asking:
        norm = engine.get_global_grad_norm()
    return {"steady": steady.by_place(), "check_ins": [label for kind, label in trace if kind == "phase"],
            "asking": asking.by_place(), "norm": norm, "steps": engine.global_steps}


def _every_case() -> dict[str, Any]:
    return {name: in_group(2, lambda _, c=case: _count(c), "") for name, case in CASES.items()}


@pytest.fixture(scope="module")
def counted() -> dict[str, list[dict[str, Any]]]:
    # Without [Note: late completion], whose checks compare every asynchronous input with its
    # snapshot on the host: the checking mode's own reads, not the engine's.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CHECK_ENV, "0")
        ranks = run_distributed(_every_case, 2)
    return {name: [rank[name] for rank in ranks] for name in CASES}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_steady_state_step_makes_no_host_synchronisation(counted, name: str) -> None:
    for rank, found in enumerate(counted[name]):
        assert found["steady"] == {}, f"rank {rank}, {name}: host synchronisations in a steady-state step"
        assert found["steps"] == WARMUP_STEPS + 1
        stage = CASES[name]["stage"]
        expected = ["forward", "backward"] * CASES[name].get("gas", 1) if stage == 3 else []
        assert found["check_ins"] == expected + ["optimizer step"], "the phase check-ins still run"


def test_reading_the_norm_right_after_a_step_is_one_wait(counted) -> None:
    """What a user asks for is read when asked: a wait for the device, counted as one."""
    for name in ("s3-bf16", "s0-fp32", "s3-fp16-no-clip"):
        for found in counted[name]:
            assert sum(found["asking"].values()) == 1, (name, found["asking"])
            assert next(iter(found["asking"])).startswith("wait(the last step's norm")
            assert found["norm"] > 0
