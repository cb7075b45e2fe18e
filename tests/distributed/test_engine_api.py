"""Engine behaviour beyond plain training, on a real 2-process gloo group."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed import scenarios as S
from tests.distributed.launch import run_distributed


def _modify_under_gathered_parameters() -> dict[str, Any]:
    import hf_zero

    sc = S.scenario("gpt2", 3)
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
    masters = [g.master for u in engine.units for g in u.groups if g.master is not None]
    return {"shape": inside_shape, "freed": freed, "values": values,
            "master_has_quarter": any(bool((m == 0.25).any()) for m in masters)}


def _fp16_overflow_is_skipped() -> dict[str, Any]:
    import hf_zero

    sc = S.scenario("gpt2", 2)
    config = S.make_config(sc)
    # 2^40 overflows fp16 gradients at once: DeepSpeed's behaviour is to skip the step, halve the
    # scale (after hysteresis), and train normally once the scale fits.
    config["fp16"] = {"enabled": True, "initial_scale_power": 40, "hysteresis": 1, "loss_scale_window": 1000}
    engine, _, _, _ = hf_zero.initialize(model=S.build_model(sc), config=config)
    scales, applied = [], []
    for step in range(30):
        ids = S.batch_for_step(step, 4)[engine.rank * 2:(engine.rank + 1) * 2]
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        scales.append(engine.loss_scale)
        applied.append(engine.was_step_applied())
    return {"scales": scales, "applied": applied, "skipped": engine.skipped_steps,
            "dtype": str(engine.module.transformer.wte.weight.dtype)}


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
        batch = S.batch_for_step(step, engine.world_size * 2)
        loss = S.model_loss(engine, "llama", batch[engine.rank * 2:(engine.rank + 1) * 2])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "comm": engine.comm_stats(), "params": S.full_params(engine)}


def _all(_: None) -> dict[str, Any]:
    return {"modify": _modify_under_gathered_parameters(), "fp16": _fp16_overflow_is_skipped(),
            "stuck": _fp16_stuck_at_minimum(), "bf16_comm": _bf16_communication()}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(_all, 2, None)


def test_gathered_parameters_with_modifier_rank_updates_every_shard(results):
    for r in results:
        m = r["modify"]
        assert m["shape"] == [97, 15] and m["freed"]
        assert m["values"] == [0.25] + [v for v in m["values"] if v != 0.25] and 0.25 in m["values"]
        assert m["master_has_quarter"]


def test_fp16_overflow_skips_steps_then_trains(results):
    r = results[0]["fp16"]
    assert r["dtype"] == "torch.float16"
    assert r["skipped"] > 0 and not r["applied"][0]
    assert r["scales"][0] == 2.0 ** 39
    assert r["applied"][-1] and r["scales"][-1] < 2.0 ** 30
    assert r["applied"].count(False) == r["skipped"]
    assert results[1]["fp16"]["scales"] == r["scales"]  # the decision is global


def test_fp16_stuck_at_minimum_is_a_clear_error(results):
    for r in results:
        assert "minimum" in r["stuck"] and "bf16" in r["stuck"]


def test_communication_data_type_bf16_halves_bytes_and_stays_close(results):
    r = results[0]["bf16_comm"]
    rs = r["comm"]["reduce_scatter"]
    assert rs["bytes"] == 2 * rs["numel"]  # bf16 on the wire
    reference = S.train_reference(S.scenario("llama", 2), world=2)
    mean_losses = [(a + b) / 2 for a, b in zip(results[0]["bf16_comm"]["losses"], results[1]["bf16_comm"]["losses"],
                                                 strict=True)]
    assert mean_losses == pytest.approx(reference["losses"], abs=1e-3)
    assert r["params"].keys() == reference["params"].keys()
    diffs = [abs(a - b) for n in reference["params"] for a, b in zip(r["params"][n], reference["params"][n], strict=True)]
    assert max(diffs) < 2e-2
