"""A resume with a passed ``torch.optim.AdamW(fused=True)`` (the Trainer's default optimizer).

Two ranks of a real gloo group, stages 1 and 3: a run saves after 2 steps and goes on; a fresh
engine with other initial weights loads the save and must take the next steps bit for bit as the
unbroken run did. The loaded ``step`` of every master must have the device and dtype torch's own
``load_state_dict`` gives it (for a fused group: the parameter's device, float32; on CUDA a CPU
step makes the fused kernel fail on the first step after a resume).
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch

from tests.distributed import scenarios as S
from tests.distributed.launch import run_distributed
from tests.tiny_models import batch_for_step

SAVE_AT, STEPS = 2, 4
STAGES = (1, 3)


def _engine(stage: int, seed: int) -> Any:
    import hf_zero
    from tests.tiny_models import BUILDERS

    model = BUILDERS["llama"](seed=seed).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=S.LR, betas=S.BETAS, eps=S.EPS,
                                  weight_decay=S.WEIGHT_DECAY, fused=True)
    config = S.make_config(S.scenario("llama", stage, 1, optimizer="torch"))
    engine, *_ = hf_zero.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _train(engine: Any, steps: range) -> list[float]:
    losses = []
    for step in steps:
        batch = batch_for_step(step, 2 * engine.world_size)
        loss = S.model_loss(engine, "llama", batch[engine.rank * 2:(engine.rank + 1) * 2])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _steps_as_torch_loads_them(engine: Any, saved: dict[str, Any]) -> list[str]:
    """Device and dtype of each master's ``step`` after torch's own ``load_state_dict`` of the
    state the unbroken run saved, into a fused AdamW over copies of this engine's masters."""
    inner = engine.optimizer.inner
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [p.detach().clone() for p in g["params"]]}
              for g in inner.param_groups]
    reference = torch.optim.AdamW(groups, fused=True)
    reference.load_state_dict(saved)
    return [f"{s['step'].device} {s['step'].dtype}" for s in reference.state.values()]


def _loaded_steps(engine: Any) -> list[str]:
    inner = engine.optimizer.inner
    masters = [p for g in inner.param_groups for p in g["params"] if p in inner.state]
    return [f"{inner.state[m]['step'].device} {inner.state[m]['step'].dtype}" for m in masters]


def _placed_on_meta(engine: Any, placed: list[tuple[str, str, str]]) -> Any:
    """A wrapper of the load's placement that also places each value for a ``meta`` copy of its
    master (a device other than the CPU, as a GPU is) and compares with torch's own rule for the
    master's group in the engine's optimizer: on a CPU-only machine, a step left on the CPU for a
    fused group is seen here, not in the losses."""
    from hf_zero.checkpoint import load

    place = load.optimizer_value_on

    def wrapper(param: torch.Tensor, key: Any, value: Any, param_group: Any) -> Any:
        if isinstance(value, torch.Tensor):
            meta = param.to("meta")
            ours = place(meta, key, value, param_group)
            group = next(g for g in engine.optimizer.inner.param_groups if any(p is param for p in g["params"]))
            flags = {k: group[k] for k in ("fused", "capturable") if k in group}
            theirs = torch.optim.Optimizer._process_value_according_to_param_policy(
                meta, value, 0, [{"params": [0], **flags}], key)
            placed.append((str(key), f"{ours.device} {ours.dtype}", f"{theirs.device} {theirs.dtype}"))
        return place(param, key, value, param_group)

    return wrapper


def _resume(root: str, stage: int) -> dict[str, Any]:
    save_dir = os.path.join(root, f"stage{stage}")
    engine = _engine(stage, seed=0)
    _train(engine, range(SAVE_AT))
    engine.save_checkpoint(save_dir)
    saved_state = copy.deepcopy(engine.optimizer.inner.state_dict())
    unbroken = _train(engine, range(SAVE_AT, STEPS))
    resumed = _engine(stage, seed=1)
    from hf_zero.checkpoint import load

    placed: list[tuple[str, str, str]] = []  # (key, where hf_zero puts it, where torch does)
    place, load.optimizer_value_on = load.optimizer_value_on, _placed_on_meta(resumed, placed)
    try:
        resumed.load_checkpoint(save_dir)
    finally:
        load.optimizer_value_on = place
    loaded_steps = _loaded_steps(resumed)
    torch_steps = _steps_as_torch_loads_them(resumed, saved_state)
    continued = _train(resumed, range(SAVE_AT, STEPS))  # a CPU step on CUDA fails here
    return {
        "fused": [g.get("fused") for g in resumed.optimizer.inner.param_groups],
        "loaded_steps": loaded_steps, "torch_steps": torch_steps, "placed_on_meta": placed,
        "unbroken": unbroken, "continued": continued,
        "params_equal": S.full_params(resumed) == S.full_params(engine),
    }


def _worker(root: str) -> dict[str, Any]:
    return {stage: _resume(root, stage) for stage in STAGES}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(_worker, 2, str(tmp_path_factory.mktemp("fused_resume")))


@pytest.mark.parametrize("stage", STAGES)
def test_fused_adamw_resume_takes_the_same_steps(runs, stage):
    for rank in runs:
        result = rank[str(stage)]
        assert result["fused"] and all(result["fused"])  # the rebuilt optimizer is still fused
        assert result["continued"] == result["unbroken"]  # bit for bit
        assert result["params_equal"]


@pytest.mark.parametrize("stage", STAGES)
def test_loaded_step_is_placed_as_torch_places_it(runs, stage):
    for rank in runs:
        result = rank[str(stage)]
        assert result["loaded_steps"], "the optimizer holds no state after the load"
        assert result["loaded_steps"] == result["torch_steps"]
        placed = result["placed_on_meta"]
        assert any(key == "step" for key, _, _ in placed), "the load placed no step"
        assert [(key, ours) for key, ours, _ in placed] == [(key, theirs) for key, _, theirs in placed]
