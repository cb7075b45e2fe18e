"""MuonWithAuxAdamW as a plain torch optimizer: what schedulers and Accelerate do to it reaches
the two torch optimizers that step it ([Note: Muon with auxiliary AdamW])."""

from __future__ import annotations

import copy

import torch

from hf_zero.engine.optim.muon import MuonWithAuxAdamW


def _optimizer() -> tuple[MuonWithAuxAdamW, torch.nn.Parameter, torch.nn.Parameter]:
    torch.manual_seed(0)
    matrix, vector = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))
    optimizer = MuonWithAuxAdamW([dict(params=[matrix], use_muon=True, lr=0.1),
                                  dict(params=[vector], use_muon=False, lr=0.1)])
    return optimizer, matrix, vector


def _step(optimizer: MuonWithAuxAdamW, *params: torch.nn.Parameter, seed: int = 0) -> list[torch.Tensor]:
    """One step on a gradient drawn from ``seed`` (steps with different gradients make the
    optimizers' state matter); returns how far each parameter moved."""
    before = [p.detach().clone() for p in params]
    generator = torch.Generator().manual_seed(seed)
    sum((p * torch.randn(p.shape, generator=generator)).sum() for p in params).backward()
    optimizer.step()
    optimizer.zero_grad()
    return [(p.detach() - b).abs().max() for p, b in zip(params, before, strict=True)]


def test_a_scheduler_reaches_both_kinds_after_load_state_dict():
    """Accelerate's prepare() round-trips the optimizer through load_state_dict, which replaces
    the group dicts: a warm-up from lr 0 must still hold both parameters still."""
    optimizer, matrix, vector = _optimizer()
    optimizer.load_state_dict(optimizer.state_dict())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: float(step))
    assert [float(d) for d in _step(optimizer, matrix, vector)] == [0.0, 0.0]
    scheduler.step()
    assert all(float(d) > 1e-3 for d in _step(optimizer, matrix, vector))


def test_state_dict_holds_both_kinds_state_and_restores_it():
    optimizer, matrix, vector = _optimizer()
    _step(optimizer, matrix, vector)
    saved = copy.deepcopy(optimizer.state_dict())  # torch's state_dict shares the state tensors
    assert set(saved["state"]) == {0, 1}
    assert "momentum_buffer" in saved["state"][0] and "exp_avg" in saved["state"][1]
    other, matrix2, vector2 = _optimizer()
    other.load_state_dict(saved)
    with torch.no_grad():
        matrix2.copy_(matrix)
        vector2.copy_(vector)
    # The restored state is what steps next: both optimizers continue alike (with a fresh state
    # the second step differs by more than 10%).
    torch.testing.assert_close(_step(other, matrix2, vector2, seed=1), _step(optimizer, matrix, vector, seed=1),
                               rtol=1e-5, atol=0)
