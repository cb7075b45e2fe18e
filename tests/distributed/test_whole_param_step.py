"""torch.optim.Adafactor stepped whole by owner ranks ([Note: whole-parameter step]) matches the
same Adafactor in one process on the same global batch, at stages 1-3 and with CPU offload."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hf_zero.engine.whole_param_step import assign_owners
from tests.distributed import scenarios as S
from tests.distributed.launch import run_distributed
from tests.tiny_models import batch_for_step

LR = 1e-2
STEPS = 3
CONFIGS = {"s1": (1, {}), "s2": (2, {}), "s3": (3, {}),
           "s2_offload": (2, {"offload_optimizer": {"device": "cpu"}}),
           "s3_offload": (3, {"offload_optimizer": {"device": "cpu"}})}


def _train_all(world: int) -> dict[str, Any]:
    import hf_zero

    results = {}
    for name, (stage, zero) in CONFIGS.items():
        sc = S.scenario("gpt2", stage, optimizer="none", zero=zero, steps=STEPS)
        model = S.build_model(sc)
        engine, optimizer, _, _ = hf_zero.initialize(
            model=model, config=S.make_config(sc), optimizer=torch.optim.Adafactor(model.parameters(), lr=LR))
        for step in range(STEPS):
            batch = batch_for_step(step, world * sc["micro"])
            start = engine.rank * sc["micro"]
            engine.backward(S.model_loss(engine, "gpt2", batch[start:start + sc["micro"]]))
            engine.step()
        owned = sum(p.numel() for g in optimizer.param_groups for p in g["params"])
        results[name] = {"params": S.full_params(engine), "owned_numel": owned}
    return results


def _reference(world: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    model = S.build_model(S.scenario("gpt2", 2))
    start = {n: p.detach().clone().reshape(-1) for n, p in model.named_parameters()}
    optimizer = torch.optim.Adafactor(model.parameters(), lr=LR)
    for step in range(STEPS):
        loss = S.model_loss(model, "gpt2", batch_for_step(step, world * 2))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), S.CLIP)
        optimizer.step()
    return start, {n: p.detach().reshape(-1) for n, p in model.named_parameters()}


@pytest.mark.parametrize("world", [2, 3])
def test_adafactor_matches_one_process_at_every_stage_and_with_offload(world):
    ranks = run_distributed(_train_all, world, world)
    start, reference = _reference(world)
    moved = max((reference[n] - start[n]).abs().max().item() for n in reference)
    assert moved > 1e-3  # the signal is far above the tolerance
    total = sum(v.numel() for v in reference.values())
    for name in CONFIGS:
        got = ranks[0][name]["params"]
        assert got.keys() == reference.keys()
        diff = max((torch.tensor(got[n]) - reference[n]).abs().max().item() for n in reference)
        assert diff <= 1e-5, f"{name}: {diff:.3e}"
        for rank in ranks[1:]:  # every rank holds the same model
            assert rank[name]["params"] == got
        # Each parameter's master lives on exactly one rank.
        assert sum(rank[name]["owned_numel"] for rank in ranks) == total


def test_owners_balance_elements_largest_first():
    assert assign_owners([10, 1, 1, 8, 2], 2) == [0, 0, 1, 1, 1]  # loads 11 and 11
    assert assign_owners([5, 5, 5], 3) == [0, 1, 2]
    assert assign_owners([3, 4], 1) == [0, 0]
