"""Ranks that drift apart are stopped with a message, not left to train wrong or hang
([Note: rank agreement], [Note: collective errors]): on a real gloo group of two processes, a
per-rank learning rate and accumulation count are refused by name, an error on one rank inside
``initialize`` reaches the other, ``save_checkpoint`` after an extra micro-step on one rank is
refused, and a rank that stops answering makes the other raise within the collective timeout
(``HF_ZERO_TIMEOUT``), naming the collective, its unit and the step."""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import pytest

from tests.distributed import scenarios as S
from tests.distributed.launch import run_distributed
from tests.tiny_models import batch_for_step

TIMEOUT_S = 3


def _engine(sc: dict[str, Any], edit: Callable[[dict[str, Any]], None] | None = None) -> Any:
    import hf_zero

    config = S.make_config(sc)
    if edit is not None:
        edit(config)
    engine, *_ = hf_zero.initialize(model=S.build_model(sc), config=config)
    return engine


def _error_of(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _rank() -> int:
    return int(os.environ["RANK"])


def _micro_step(engine: Any, step: int) -> None:
    ids = batch_for_step(step, 4)[engine.rank * 2:(engine.rank + 1) * 2]
    engine.backward(S.model_loss(engine, "gpt2", ids))
    engine.step()


def _per_rank_lr(config: dict[str, Any]) -> None:
    config["optimizer"]["params"]["lr"] = 1e-3 * (1 + _rank())


def _per_rank_gas(config: dict[str, Any]) -> None:
    config["gradient_accumulation_steps"] = 1 + _rank()


def _bad_on_rank1(config: dict[str, Any]) -> None:
    if _rank() == 1:
        config["zero_optimization"]["stage"] = 7


def _uneven_save(root: str) -> str:
    engine = _engine(S.scenario("gpt2", 1, 2))
    for step in range(2 + (1 if engine.rank == 0 else 0)):  # rank 0: one micro-step more
        _micro_step(engine, step)
    return _error_of(lambda: engine.save_checkpoint(os.path.join(root, "uneven")))


def _hung_rank() -> dict[str, Any]:
    """Rank 1 stops answering before its backward; rank 0 must not wait longer than the timeout."""
    engine = _engine(S.scenario("gpt2", 2, 1))
    _micro_step(engine, 0)
    if engine.rank == 1:
        time.sleep(TIMEOUT_S + 2)
    start = time.perf_counter()
    error = _error_of(lambda: _micro_step(engine, 1))
    return {"error": error, "waited_s": time.perf_counter() - start}


def _worker(root: str) -> dict[str, Any]:
    os.environ["HF_ZERO_TIMEOUT"] = str(TIMEOUT_S)  # read when initialize creates the process group
    sc = S.scenario("gpt2", 2, 1)
    out = {
        "lr": _error_of(lambda: _engine(sc, _per_rank_lr)),
        "gas": _error_of(lambda: _engine(sc, _per_rank_gas)),
        "one_rank_fails": _error_of(lambda: _engine(sc, _bad_on_rank1)),
        "same_config_works": _error_of(lambda: _micro_step(_engine(sc), 0)),
        "uneven_save": _uneven_save(root),
    }
    out["hung"] = _hung_rank()  # last: the group is unusable after a timeout
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(_worker, 2, str(tmp_path_factory.mktemp("agreement")))


def test_a_per_rank_learning_rate_is_refused_by_name_on_every_rank(results):
    for result in results:
        error = result["lr"]
        assert error.startswith("RankDisagreementError") and "optimizer.params.lr" in error, error
        assert "rank 0 = 0.001" in error and "rank 1 = 0.002" in error


def test_a_per_rank_accumulation_count_is_refused_by_name(results):
    for result in results:
        assert "gradient_accumulation_steps: rank 0 = 1, rank 1 = 2" in result["gas"], result["gas"]


def test_an_error_on_one_rank_inside_initialize_reaches_the_other(results):
    assert results[1]["one_rank_fails"].startswith("HfZeroConfigError") and "stage" in results[1]["one_rank_fails"]
    other = results[0]["one_rank_fails"]
    assert other.startswith("RankDisagreementError") and "rank 1: HfZeroConfigError" in other, other
    assert all(result["same_config_works"] == "no error" for result in results)  # the group is still usable


def test_save_after_an_extra_micro_step_on_one_rank_is_refused(results):
    for result in results:
        error = result["uneven_save"]
        assert "different steps" in error and "rank 0 at step 1 micro-step 3" in error, error
        assert "rank 1 at step 1 micro-step 2" in error


def test_a_rank_that_stops_answering_is_reported_within_the_timeout(results):
    hung = results[0]["hung"]
    assert hung["error"].startswith("CollectiveError"), hung["error"]
    assert hung["waited_s"] < 2.5 * TIMEOUT_S, hung
    assert f"within the {TIMEOUT_S:g} s collective timeout" in hung["error"]
    assert "optimizer step 2" in hung["error"]  # the step rank 0 was in
    assert "transformer" in hung["error"] or "grad_norm" in hung["error"]  # the unit (or the norm) it waited for
