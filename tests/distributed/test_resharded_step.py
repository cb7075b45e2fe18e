"""[Note: one step count per group] in checkpoint/reshard.py: step counts follow the parameters
across layouts.

Stage 3 keeps a parameter under the persistence threshold in a group of its own; stage 2 puts it
back with the others. A parameter no rank used is not stepped ([Note: parameters no rank used]),
so a parameter the forward skips makes the two saved groups step apart. The config's Adam keeps a
step count per parameter: the merged group loads with each parameter's own count, and the next
step equals the one taken at the saved layout. A torch optimizer rebuilt over the shards keeps one
count per flat tensor, so that load is refused, naming the groups and their steps; the same
checkpoint loads at the layout it was saved with, and merged groups that agree load."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests.distributed.launch import run_distributed

WORLD = 2
STEPS = 3


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(16, 16, bias=False)  # 256 elements: sharded at stage 3
        self.small = nn.Linear(16, 1)  # 17 elements: persistent at stage 3 (threshold 100)

    def forward(self, x: torch.Tensor, use_small: bool) -> torch.Tensor:
        loss = self.big(x).pow(2).mean()
        return loss + self.small(x).mean() if use_small else loss


def _engine(stage: int, torch_optimizer: bool = False) -> Any:
    import hf_zero

    torch.manual_seed(0)
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 100
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero}
    model = _Toy()
    if torch_optimizer:
        return hf_zero.initialize(model=model, config=config,
                                  optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))[0]
    config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2}}
    return hf_zero.initialize(model=model, config=config)[0]


def _next_step_params(engine: Any) -> list[list[float]]:
    """One more step, with every parameter used; the parameters after it."""
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(99 + engine.rank))
    engine.backward(engine(x, use_small=True))
    engine.step()
    with engine.gathered_parameters():
        return [p.detach().reshape(-1).tolist() for p in engine.module.parameters()]


def _steps(engine: Any) -> dict[str, Any]:
    state = engine.optimizer.inner.state
    return {g.label: int(state[g.master_state.tensor]["step"])
            for u in engine.units for g in u.groups if g.master_state.tensor in state}


def _save(root: str, name: str, small_every_step: bool, torch_optimizer: bool = False) -> tuple[str, dict[str, Any]]:
    engine = _engine(3, torch_optimizer)
    for step in range(STEPS):
        x = torch.randn(2, 16, generator=torch.Generator().manual_seed(10 * step + engine.rank))
        engine.backward(engine(x, use_small=small_every_step or step == 0))
        engine.step()
    save_dir = f"{root}/{name}"
    engine.save_checkpoint(save_dir)
    return save_dir, _steps(engine)


def _error_of(engine: Any, save_dir: str, **kwargs: Any) -> str | None:
    from hf_zero.checkpoint import CheckpointError

    try:
        engine.load_checkpoint(save_dir, **kwargs)
    except CheckpointError as exc:
        return str(exc)
    return None


def _scenario(root: str) -> dict[str, Any]:
    apart, saved_steps = _save(root, "apart", small_every_step=False)
    merged = _engine(2)
    merged_error = _error_of(merged, apart)
    merged_slot_steps = [state.get("slot_steps") for state in merged.optimizer.inner.state.values()]
    same_layout = _engine(3)
    same_layout_error = _error_of(same_layout, apart)
    same_layout_steps = _steps(same_layout)
    torch_apart, torch_saved_steps = _save(root, "torch_apart", small_every_step=False, torch_optimizer=True)
    torch_merged = _engine(2, torch_optimizer=True)
    refused = _error_of(torch_merged, torch_apart)
    untouched = (torch_merged.global_steps, _steps(torch_merged))
    fresh_optimizer = _error_of(torch_merged, torch_apart, load_optimizer_states=False)
    together, _ = _save(root, "together", small_every_step=True, torch_optimizer=True)
    agreeing = _engine(2, torch_optimizer=True)
    agreeing_error = _error_of(agreeing, together)
    return {"saved_steps": saved_steps, "merged_error": merged_error, "merged_slot_steps": merged_slot_steps,
            "merged_next": _next_step_params(merged), "same_layout_error": same_layout_error,
            "same_layout_steps": same_layout_steps, "same_layout_next": _next_step_params(same_layout),
            "torch_saved_steps": torch_saved_steps, "refused": refused, "untouched": untouched,
            "fresh_optimizer": fresh_optimizer, "agreeing_error": agreeing_error, "agreeing_steps": _steps(agreeing)}


def test_step_counts_follow_the_parameters_into_a_merged_group(tmp_path):
    ranks = run_distributed(_scenario, WORLD, str(tmp_path))
    for rank, got in enumerate(ranks):
        assert got["saved_steps"] == {"<root>#0": STEPS, "<root>#1": 1}, rank
        assert got["merged_error"] is None, got["merged_error"]
        assert got["merged_slot_steps"] == [[STEPS, 1, 1]], got["merged_slot_steps"]  # big.weight, small.*
        # At the saved layout each group gets its own step back, and the next step is the same.
        assert got["same_layout_error"] is None and got["same_layout_steps"] == got["saved_steps"], rank
        for merged, same in zip(got["merged_next"], got["same_layout_next"]):
            assert max(abs(a - b) for a, b in zip(merged, same)) <= 1e-6, rank
        # A torch optimizer keeps one count per flat tensor: the merge is refused, naming both.
        assert got["torch_saved_steps"] == {"<root>#0": STEPS, "<root>#1": 1}, rank
        error = got["refused"]
        assert error is not None, f"rank {rank} loaded groups of steps {got['torch_saved_steps']} into one"
        assert "<root>#0: step=3" in error and "<root>#1: step=1" in error, error
        assert "Load at the layout the checkpoint was saved with (stage 3" in error, error
        assert got["untouched"] == [0, {}], rank  # refused before anything was applied
        assert got["fresh_optimizer"] is None, got["fresh_optimizer"]
        assert got["agreeing_error"] is None, got["agreeing_error"]
        assert got["agreeing_steps"] == {"<root>#0": STEPS}, rank
