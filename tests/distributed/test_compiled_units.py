"""``engine.compile()`` ([Note: compiled units]): each unit's forward under torch.compile trains
exactly as eager at every stage, on 2 real gloo ranks, and its graphs survive the gathers and
frees of stage 3 (no recompilation after the first step).

The ``aot_eager`` backend traces through Dynamo and AOTAutograd, as inductor does, without
generating C++: the same graphs, seconds instead of minutes on a CPU runner."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed import scenarios as S
from tests.distributed.launch import run_distributed

STEPS = 4
VARIANTS = [dict(stage=0), dict(stage=1), dict(stage=2), dict(stage=3),
            dict(stage=3, checkpointing=True)]


def _train(sc: dict[str, Any], compiled: bool) -> dict[str, Any]:
    import hf_zero
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = S.build_model(sc)
    assert model.config.use_cache  # the training forward must not build a cache once compiled
    engine, _, _, _ = hf_zero.initialize(model=model, config=S.make_config(sc))
    if compiled:
        engine.compile(backend="aot_eager")
    losses, graphs = [], []
    for step in range(STEPS):
        batch = S.learnable_batch(step, engine.world_size * sc["micro"])
        start = engine.rank * sc["micro"]
        loss = S.model_loss(engine, "llama", batch[start:start + sc["micro"]])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        graphs.append(counters["stats"]["unique_graphs"])
    return {"losses": losses, "params": S.full_params(engine), "graphs": graphs,
            "is_compiled": engine.is_compiled, "units": len(engine.units)}


def _rank_fn() -> list[dict[str, Any]]:
    out = []
    for variant in VARIANTS:
        sc = S.scenario("llama", variant["stage"], steps=STEPS, checkpointing=variant.get("checkpointing", False))
        out.append({"eager": _train(sc, compiled=False), "compiled": _train(sc, compiled=True)})
    return out


@pytest.fixture(scope="module")
def results() -> list[list[dict[str, Any]]]:
    return run_distributed(_rank_fn, 2)


@pytest.mark.parametrize("index", range(len(VARIANTS)), ids=[str(v) for v in VARIANTS])
def test_compiled_units_train_as_eager(results: list[list[dict[str, Any]]], index: int) -> None:
    for rank_results in results:
        eager, compiled = rank_results[index]["eager"], rank_results[index]["compiled"]
        assert not eager["is_compiled"] and eager["graphs"] == [0] * STEPS
        assert compiled["is_compiled"]
        # tiny_llama: embedding, decoder layer (one graph for both identical layers), lm_head; a
        # KV cache in the training forward would add a graph per layer.
        assert compiled["graphs"][0] == 3, compiled["graphs"]
        assert compiled["graphs"] == [compiled["graphs"][0]] * STEPS  # no recompilation after step 1
        # Signal: 4 AdamW steps at the scenarios' lr move parameters by ~0.1, far above the tolerance.
        moved = max(abs(a - b) for name in eager["params"]
                    for a, b in zip(eager["params"][name], S.build_model(S.scenario("llama", 0)).state_dict()[name]
                                    .reshape(-1).tolist(), strict=True))
        assert moved > 1e-3
        assert max(abs(a - b) for a, b in zip(eager["losses"], compiled["losses"], strict=True)) <= 1e-6
        assert eager["params"].keys() == compiled["params"].keys()
        for name in eager["params"]:
            diff = max(abs(a - b) for a, b in zip(eager["params"][name], compiled["params"][name], strict=True))
            assert diff <= 1e-6, (name, diff)
