"""Engine behaviour beyond plain training, on a real 2-process gloo group."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed import scenarios as S
from tests.distributed.launch import run_distributed


def _modify_under_gathered_parameters() -> dict[str, Any]:
    import hf_zero

    # bf16: the fp32 master is a separate copy, so the change must be written into it too
    sc = S.scenario("gpt2", 3, dtype="bf16")
    engine, _, _, _ = hf_zero.initialize(model=S.build_model(sc), config=S.make_config(sc))
    wte = engine.module.transformer.wte.weight
    with engine.gathered_parameters(wte, modifier_rank=0):
        if engine.rank == 0:
            with torch.no_grad():
                wte.fill_(0.25)
        inside_shape = list(wte.shape)
    # Freed again outside the block, and every rank's shard (and master) took rank 0's change.
    freed = wte.untyped_storage().nbytes() == 0
    with engine.gathered_parameters():
        values = sorted(set(wte.detach().reshape(-1).tolist()))
    masters = [g.master_state.tensor for u in engine.units for g in u.groups if g.master_state.tensor is not None]
    return {"shape": inside_shape, "freed": freed, "values": values,
            "master_quarters": sum(int((m == 0.25).sum()) for m in masters)}


# 2^40 overflows fp16 gradients at once, and every halving (hysteresis 1) still overflows until
# the scale fits (about 2^17 for the tiny GPT-2): a long run of skipped steps, then training.
OVERFLOW_FP16 = {"enabled": True, "initial_scale_power": 40, "hysteresis": 1, "loss_scale_window": 4}
OVERFLOW_STEPS, OVERFLOW_SAVE_AT = 30, 26


def _fp16_overflow_engine() -> Any:
    import hf_zero

    sc = S.scenario("gpt2", 2)
    config = S.make_config(sc)
    config["fp16"] = dict(OVERFLOW_FP16)
    # the schedule advances on every applied step (and not on a skipped one)
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": S.LR / 10, "warmup_max_lr": S.LR,
                                                          "warmup_num_steps": OVERFLOW_STEPS, "warmup_type": "linear"}}
    engine, _, _, _ = hf_zero.initialize(model=S.build_model(sc), config=config)
    return engine


def _optimizer_digest(engine: Any) -> list[float]:
    """Every moment and step count of this rank's optimizer state, summed per tensor (and per
    list: the per-parameter step counts)."""
    state = engine.optimizer.state_dict()["state"]
    return [float(v.double().abs().sum()) if torch.is_tensor(v) else float(sum(v)) if isinstance(v, list) else float(v)
            for key in sorted(state) for _, v in sorted(state[key].items())]


def _fp16_step(engine: Any, step: int) -> dict[str, Any]:
    ids = S.learnable_batch(step, 4)[engine.rank * 2:(engine.rank + 1) * 2]
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return {"loss": loss.item(), "scale": engine.loss_scale, "applied": engine.was_step_applied(),
            "scheduler": _scheduler_state(engine), "params": S.full_params(engine), "moments": _optimizer_digest(engine)}


def _scheduler_state(engine: Any) -> list[float]:
    return [engine.lr_scheduler.last_batch_iteration, engine.get_lr()[0]]


def _fp16_overflow_is_skipped(root: str) -> dict[str, Any]:
    """Train through the overflowing steps, save at OVERFLOW_SAVE_AT, and resume a fresh engine
    from that checkpoint: the scaler's state must come back with the rest."""
    engine = _fp16_overflow_engine()
    before = {"params": S.full_params(engine), "moments": _optimizer_digest(engine), "scheduler": _scheduler_state(engine)}
    steps, saved_scaler = [], None
    for step in range(OVERFLOW_STEPS):
        if step == OVERFLOW_SAVE_AT:
            engine.save_checkpoint(root, tag="fp16")
            saved_scaler = engine.optimizer.loss_scaler.state_dict()
        steps.append(_fp16_step(engine, step))
    resumed = _fp16_overflow_engine()
    resumed.load_checkpoint(root, tag="fp16")
    loaded_scaler = resumed.optimizer.loss_scaler.state_dict()
    resumed_steps = [_fp16_step(resumed, step) for step in range(OVERFLOW_SAVE_AT, OVERFLOW_STEPS)]
    return {"before": before, "steps": steps, "skipped": engine.skipped_steps,
            "dtype": str(engine.module.transformer.wte.weight.dtype), "saved_scaler": saved_scaler,
            "loaded_scaler": loaded_scaler, "resumed": resumed_steps}


def _fp16_stuck_at_minimum() -> str:
    import hf_zero

    sc = S.scenario("gpt2", 2)
    config = S.make_config(sc)
    config["fp16"] = {"enabled": True, "initial_scale_power": 2, "hysteresis": 1, "min_loss_scale": 1}
    engine, _, _, _ = hf_zero.initialize(model=S.build_model(sc), config=config)
    try:
        for _ in range(10):
            ids = torch.randint(0, 97, (2, 12))
            loss = engine(input_ids=ids, labels=ids).loss * 1e30  # always overflows in fp16
            engine.backward(loss)
            engine.step()
    except RuntimeError as error:
        return str(error)
    return "no error"


def _bf16_communication() -> dict[str, Any]:
    import hf_zero

    sc = S.scenario("llama", 2)
    config = S.make_config(sc)
    config["communication_data_type"] = "bf16"
    engine, _, _, _ = hf_zero.initialize(model=S.build_model(sc), config=config)
    losses = []
    for step in range(sc["steps"]):
        engine.reset_comm_stats()
        batch = S.learnable_batch(step, engine.world_size * 2)
        loss = S.model_loss(engine, "llama", batch[engine.rank * 2:(engine.rank + 1) * 2])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "comm": engine.comm_stats(), "params": S.full_params(engine)}


def _all(root: str) -> dict[str, Any]:
    return {"modify": _modify_under_gathered_parameters(), "fp16": _fp16_overflow_is_skipped(root),
            "stuck": _fp16_stuck_at_minimum(), "bf16_comm": _bf16_communication()}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(_all, 2, str(tmp_path_factory.mktemp("fp16_checkpoint")))


def test_gathered_parameters_with_modifier_rank_updates_every_shard(results):
    for r in results:
        m = r["modify"]
        assert m["shape"] == [97, 15] and m["freed"]
        assert m["values"] == [0.25]  # every element of the gathered weight took rank 0's value
    # the ranks' master shards together hold each of the 97 x 15 elements once, all changed (no
    # other parameter of the freshly initialised model holds exactly 0.25)
    assert sum(r["modify"]["master_quarters"] for r in results) == 97 * 15


def test_fp16_overflow_skips_steps_then_trains(results):
    """A skipped step leaves parameters, Adam moments and step counts, and the scheduler as they
    were; the scale follows DeepSpeed's rule (an independent copy in scenarios.py); an applied
    step changes all three."""
    for r in (res["fp16"] for res in results):
        assert r["dtype"] == "torch.float16"
        applied = [s["applied"] for s in r["steps"]]
        assert not applied[0] and applied[-1] and applied.count(False) == r["skipped"] >= 10
        expected = S.DeepSpeedDynamicLossScale(40, OVERFLOW_FP16["loss_scale_window"], 1, 1.0)
        previous = r["before"]
        for step, now in enumerate(r["steps"]):
            expected.update(overflow=not now["applied"])
            assert now["scale"] == expected.scale, step
            unchanged = [now[k] == previous[k] for k in ("params", "moments", "scheduler")]
            assert unchanged == [not now["applied"]] * 3, (step, now["applied"], unchanged)
            previous = now
        assert r["steps"][-1]["scale"] < 2.0 ** 20 < r["steps"][0]["scale"]
    # the decision is global: every rank skipped the same steps and holds the same parameters
    per_rank = [[(s["scale"], s["applied"], s["params"]) for s in res["fp16"]["steps"]] for res in results]
    assert per_rank[0] == per_rank[1]


def test_fp16_loss_scaler_state_survives_save_and_load(results):
    """The scaler saved at step OVERFLOW_SAVE_AT (a scale far from its initial 2^40, skipped steps
    counted) comes back on load, and the resumed run repeats the original one step for step."""
    for r in (res["fp16"] for res in results):
        saved = r["saved_scaler"]
        assert saved["cur_scale"] < 2.0 ** 20 and saved["skipped_steps"] > 0 and saved["cur_iter"] == OVERFLOW_SAVE_AT
        assert r["loaded_scaler"] == saved
        original = r["steps"][OVERFLOW_SAVE_AT:]
        assert [s["scale"] for s in r["resumed"]] == [s["scale"] for s in original]
        assert [s["applied"] for s in r["resumed"]] == [s["applied"] for s in original]
        assert [s["loss"] for s in r["resumed"]] == pytest.approx([s["loss"] for s in original], abs=1e-6)
        assert r["resumed"][-1]["params"] == original[-1]["params"]


def test_fp16_stuck_at_minimum_is_a_clear_error(results):
    for r in results:
        assert "minimum" in r["stuck"] and "bf16" in r["stuck"]


# fp32 compute with bf16 gradients on the wire, against the fp32 reference: the loss falls by
# about 1.45 over the run (see [Note: parity signal]).
BF16_COMM_LOSS_ATOL = 1e-2  # measured 4.5e-4
BF16_COMM_UPDATE_RTOL = 0.05  # |Δengine - Δref| / |Δref| over all parameters; measured 1.7e-2


def test_communication_data_type_bf16_halves_bytes_and_stays_close(results):
    reference = S.train_reference(S.scenario("llama", 2), world=2)
    assert reference["losses"][0] - reference["losses"][-1] > 10 * BF16_COMM_LOSS_ATOL
    mean_losses = [(a + b) / 2 for a, b in zip(results[0]["bf16_comm"]["losses"], results[1]["bf16_comm"]["losses"],
                                                 strict=True)]
    assert mean_losses == pytest.approx(reference["losses"], abs=BF16_COMM_LOSS_ATOL)
    for r in (res["bf16_comm"] for res in results):
        rs = r["comm"]["reduce_scatter"]
        assert rs["bytes"] == 2 * rs["numel"]  # bf16 on the wire
        assert list(r["params"]) == list(reference["params"])
        error = S.update_error(r["params"], reference, list(reference["params"]))
        assert error <= BF16_COMM_UPDATE_RTOL, error
