"""The offloaded optimizer step overlapping the backward ([Note: overlapped offload step]).

Without gradient clipping, each group's host step starts as soon as its gradient shard is final;
training must be exactly the same as without offload, and the first step must have started before
the backward returned."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest

from tests.distributed import scenarios as S
from tests.distributed.launch import run_distributed

NVME_DIR = os.path.join(tempfile.gettempdir(), "hf_zero_test_nvme_overlap")
SMALL_BUCKETS = {"reduce_bucket_size": 2000}  # several buckets per backward: steps start early


def _case(model: str, stage: int, gas: int, device: str, **zero: Any) -> dict[str, Any]:
    offload = {"device": device, **({"nvme_path": NVME_DIR} if device == "nvme" else {})}
    return S.scenario(model, stage, gas, clip=0.0, zero={"offload_optimizer": offload, **zero})


CASES = {
    "cpu_s1": _case("gpt2", 1, 1, "cpu"),
    "cpu_s2": _case("gpt2", 2, 1, "cpu", **SMALL_BUCKETS),
    "cpu_s3_gas2": _case("llama", 3, 2, "cpu", **SMALL_BUCKETS, overlap_comm=True),
    "nvme_s3": _case("gpt2", 3, 1, "nvme", sub_group_size=1000, **SMALL_BUCKETS),
    "cpu_s2_one_bucket": _case("llama", 2, 1, "cpu"),
}


def _baseline(sc: dict[str, Any]) -> dict[str, Any]:
    zero = {k: v for k, v in sc["zero"].items() if k != "offload_optimizer"}
    return dict(sc, zero=zero)


ALL = list(CASES.values()) + [_baseline(sc) for sc in CASES.values()]


def _second_boundary_backward_without_step() -> str:
    import hf_zero

    sc = CASES["cpu_s2"]
    model = S.build_model(sc)
    engine, _, _, _ = hf_zero.initialize(model=model, config=S.make_config(sc))
    batch = S.learnable_batch(0, 2)
    engine.backward(S.model_loss(engine, sc["model"], batch))
    try:
        engine.backward(S.model_loss(engine, sc["model"], batch))
    except RuntimeError as error:
        return str(error)
    return "no error"


def _worker(scenarios: list[dict[str, Any]]) -> dict[str, Any]:
    os.makedirs(NVME_DIR, exist_ok=True)
    clipped = S.scenario("gpt2", 2, 1, zero={"offload_optimizer": {"device": "cpu"}})
    import hf_zero

    engine, _, _, _ = hf_zero.initialize(model=S.build_model(clipped), config=S.make_config(clipped))
    return {"runs": S.run_scenarios(scenarios), "misuse": _second_boundary_backward_without_step(),
            "clipped_overlaps": engine.optimizer.overlapped is not None}


@pytest.fixture(scope="module", params=[1, 2], ids=lambda w: f"world{w}")
def results(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return run_distributed(_worker, request.param, ALL)


def _pair(results: list[dict[str, Any]], name: str) -> list[tuple[dict, dict]]:
    sc = CASES[name]
    return [(r["runs"][ALL.index(sc)], r["runs"][ALL.index(_baseline(sc))]) for r in results]


@pytest.mark.parametrize("name", list(CASES))
def test_overlapped_step_trains_exactly_like_no_offload(results, name):
    for off, base in _pair(results, name):
        flat = [loss for step in off["losses"] for loss in step]
        assert flat == pytest.approx([loss for step in base["losses"] for loss in step], abs=1e-5)
        worst = max(max(abs(a - b) for a, b in zip(off["params"][n], base["params"][n])) for n in base["params"])
        assert worst <= 1e-5
        assert off["grad_norm"] == pytest.approx(base["grad_norm"], rel=1e-5)


@pytest.mark.parametrize("name", list(CASES))
def test_every_group_steps_on_the_worker_during_backward(results, name):
    trainable = None
    for off, _ in _pair(results, name):
        trainable = sum(1 for g in off["layout"] if g["trainable"])
        assert off["overlap_per_step"], "the overlapped step was not enabled"
        for record in off["overlap_per_step"]:
            assert record["groups"] == trainable  # every group was handed over before step()
            if name != "cpu_s1" and name != "cpu_s2_one_bucket":
                # Several buckets: the first steps run while the backward is still going. (Stage 1
                # reduces, and one bucket goes, only once the backward is done.)
                assert record["started_in_backward"], record


def test_clipping_keeps_the_step_after_the_backward(results):
    assert results[0]["clipped_overlaps"] is False


def test_a_second_boundary_backward_without_step_is_an_error(results):
    message = results[0]["misuse"]
    assert "engine.step()" in message and "accumulation boundary" in message, message
