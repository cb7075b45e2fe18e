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
import torch

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


def _save_contents(root: str) -> list[str]:
    return sorted(os.listdir(root)) if os.path.isdir(root) else []


def _stage3_extra_micro_step(root: str) -> dict[str, Any]:
    """Rank 0 runs a third micro-step while rank 1 saves: a stage-3 forward's gathers met the
    save's exchange (a gloo abort) before [Note: phases in step]."""
    engine = _engine(S.scenario("gpt2", 3, 2))
    for step in range(2):
        _micro_step(engine, step)
    target = os.path.join(root, "extra")
    if engine.rank == 0:
        error = _error_of(lambda: _micro_step(engine, 2))
    else:
        error = _error_of(lambda: engine.save_checkpoint(target))
    return {"error": error, "saved": _save_contents(target)}


def _stage3_save_on_one_rank(root: str) -> dict[str, Any]:
    engine = _engine(S.scenario("gpt2", 3, 1))
    _micro_step(engine, 0)
    target = os.path.join(root, "alone")
    if engine.rank == 0:
        error = _error_of(lambda: engine.save_checkpoint(target))
    else:
        error = _error_of(lambda: _micro_step(engine, 1))
    return {"error": error, "saved": _save_contents(target)}


def _stage3_skipped_step(root: str) -> dict[str, Any]:
    """Rank 1 does not call step() at a boundary and goes on to the next forward."""
    engine = _engine(S.scenario("gpt2", 3, 1))
    ids = batch_for_step(0, 4)[engine.rank * 2:(engine.rank + 1) * 2]
    engine.backward(S.model_loss(engine, "gpt2", ids))
    params_before = [p.detach().clone() for p in engine.optimizer.param_groups[0]["params"]]
    if engine.rank == 0:
        error = _error_of(engine.step)
    else:
        error = _error_of(lambda: _micro_step(engine, 1))
    unchanged = all(torch.equal(a, b) for a, b in zip(params_before, engine.optimizer.param_groups[0]["params"]))
    return {"error": error, "steps": [engine.global_steps, engine.micro_steps], "unchanged": unchanged}


def _stage3_skipped_backward(root: str) -> str:
    """Rank 1 drops its loss and runs the next forward while rank 0 runs the backward."""
    engine = _engine(S.scenario("gpt2", 3, 1))
    ids = batch_for_step(0, 4)[engine.rank * 2:(engine.rank + 1) * 2]
    loss = S.model_loss(engine, "gpt2", ids)
    if engine.rank == 0:
        return _error_of(lambda: engine.backward(loss))
    return _error_of(lambda: S.model_loss(engine, "gpt2", ids))


def _stage3_in_step_after_refusal(root: str) -> str:
    """The same engine trains on once the ranks are back in step (the check-in left nothing half done)."""
    engine = _engine(S.scenario("gpt2", 3, 1))
    _micro_step(engine, 0)
    if engine.rank == 0:
        _error_of(lambda: engine.save_checkpoint(os.path.join(root, "again")))
    else:
        _error_of(lambda: _micro_step(engine, 1))
    return _error_of(lambda: (_micro_step(engine, 1), engine.save_checkpoint(os.path.join(root, "again"))))


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
        "stage3_extra_micro_step": _stage3_extra_micro_step(root),
        "stage3_save_on_one_rank": _stage3_save_on_one_rank(root),
        "stage3_skipped_step": _stage3_skipped_step(root),
        "stage3_skipped_backward": _stage3_skipped_backward(root),
        "stage3_back_in_step": _stage3_in_step_after_refusal(root),
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
        assert "out of step" in error and "rank 0 at step 1 micro-step 3, in save_checkpoint" in error, error
        assert "rank 1 at step 1 micro-step 2, in save_checkpoint" in error


def test_stage3_an_extra_micro_step_on_one_rank_meets_the_others_save_with_an_error(results):
    """No gloo abort (the worker returned at all), a documented error on both ranks, nothing saved."""
    forward, save = results[0]["stage3_extra_micro_step"], results[1]["stage3_extra_micro_step"]
    assert forward["error"].startswith("RankDisagreementError: forward refused"), forward["error"]
    assert save["error"].startswith("CheckpointError: save_checkpoint(") and "nothing was written" in save["error"]
    for error in (forward["error"], save["error"]):
        assert "rank 0 at step 1 micro-step 2, starting a forward" in error, error
        assert "rank 1 at step 1 micro-step 2, in save_checkpoint" in error, error
    assert save["saved"] == [] and forward["saved"] == []


def test_stage3_a_save_on_one_rank_only_is_refused_on_both(results):
    save, forward = results[0]["stage3_save_on_one_rank"], results[1]["stage3_save_on_one_rank"]
    assert save["error"].startswith("CheckpointError") and "out of step" in save["error"], save["error"]
    assert forward["error"].startswith("RankDisagreementError") and "in save_checkpoint" in forward["error"]
    assert save["saved"] == []


def test_stage3_a_skipped_step_is_refused_before_anything_moves(results):
    step, forward = results[0]["stage3_skipped_step"], results[1]["stage3_skipped_step"]
    assert step["error"].startswith("RankDisagreementError: optimizer step refused"), step["error"]
    assert "rank 0 at step 0 micro-step 0, starting an optimizer step" in step["error"]
    assert "rank 1 at step 0 micro-step 0, starting a forward" in forward["error"], forward["error"]
    for result in (step, forward):
        assert result["unchanged"] and result["steps"] == [0, 0], result


def test_stage3_a_skipped_backward_meets_the_next_forward_with_an_error(results):
    backward, forward = results[0]["stage3_skipped_backward"], results[1]["stage3_skipped_backward"]
    assert backward.startswith("RankDisagreementError: backward refused"), backward
    assert "rank 0 at step 0 micro-step 0, starting a backward" in forward, forward
    assert "rank 1 at step 0 micro-step 0, starting a forward" in backward, backward


def test_stage3_ranks_back_in_step_train_and_save(results):
    assert all(result["stage3_back_in_step"] == "no error" for result in results), results


def test_a_rank_that_stops_answering_is_reported_within_the_timeout(results):
    hung = results[0]["hung"]
    assert hung["error"].startswith("CollectiveError"), hung["error"]
    assert hung["waited_s"] < 2.5 * TIMEOUT_S, hung
    assert f"within the {TIMEOUT_S:g} s collective timeout" in hung["error"]
    assert "optimizer step 2" in hung["error"]  # the step rank 0 was in
    assert "transformer" in hung["error"] or "grad_norm" in hung["error"]  # the unit (or the norm) it waited for


def _hung_save_worker(root: str) -> str:
    """Rank 1 stops answering while rank 0 saves: the error names the save, not a training step."""
    os.environ["HF_ZERO_TIMEOUT"] = str(TIMEOUT_S)
    engine = _engine(S.scenario("gpt2", 3, 1))
    _micro_step(engine, 0)
    if engine.rank == 1:
        time.sleep(TIMEOUT_S + 2)
        return "slept"
    return _error_of(lambda: engine.save_checkpoint(os.path.join(root, "hung")))


def test_a_rank_that_stops_answering_during_a_save_is_reported_as_the_save(tmp_path):
    error = run_distributed(_hung_save_worker, 2, str(tmp_path))[0]
    assert error.startswith("CollectiveError"), error
    assert f"while at save_checkpoint({os.path.join(str(tmp_path), 'hung')!r}, tag='global_step1') after optimizer step 1" in error, error
