"""What stage 3 holds between a unit's forward and its backward: a plain embedding unit, whose
backward reads no parameter, is freed after its forward even while the reuse distance keeps the
decoder layers gathered ([Note: units whose backward reads no parameter]), and the run still
matches single-process torch."""

from __future__ import annotations

from typing import Any

from tests.distributed import scenarios as S
from tests.distributed.launch import run_distributed
from tests.tiny_models import learnable_batch

SCENARIO = S.scenario("llama", 3, steps=3)


def _states_after_forward(world: int) -> dict[str, Any]:
    import hf_zero

    engine, *_ = hf_zero.initialize(model=S.build_model(SCENARIO), config=S.make_config(SCENARIO))
    micro, states = SCENARIO["micro"], {}
    for step in range(SCENARIO["steps"]):
        batch = learnable_batch(step, world * micro)
        loss = S.model_loss(engine, "llama", batch[engine.rank * micro:(engine.rank + 1) * micro])
        states = {f"{type(u.module).__name__}:{u.name}": u.param_state.value for u in engine.units if u.sharded_numel}
        engine.backward(loss)
        engine.step()
    return {"states": states, "params": S.full_params(engine)}


def test_embedding_unit_is_freed_after_its_forward_while_layers_are_kept():
    ranks = run_distributed(_states_after_forward, 2, 2)
    states = ranks[0]["states"]
    embeddings = {k: v for k, v in states.items() if k.startswith("Embedding:")}
    layers = {k: v for k, v in states.items() if k.startswith("LlamaDecoderLayer:")}
    assert embeddings and layers, states
    assert set(embeddings.values()) == {"sharded"}, states  # not held until its backward
    assert set(layers.values()) == {"gathered"}, states  # the reuse distance keeps these
    assert all(r["params"] == ranks[0]["params"] for r in ranks[1:])
    reference = S.train_reference(SCENARIO, 2)
    names = list(reference["params"])
    assert S.update_error(ranks[0]["params"], reference, names) <= 1e-5
