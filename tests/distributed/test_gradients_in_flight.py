"""Which gradients a stage-3 backward still holds in flight ([Note: gradients in flight] in
hf_zero/engine/schedule/reduction_flight.py), seen from inside the backward of one rank of a fake world of 4 (torch's
fake process group). On torch 2.13 its reductions never report completion, so every bucket stays
in flight until the engine's bound finishes it, the most a real network could ever leave there,
and the large bucket finished early is the rule's doing. On torch 2.15 they report completion at
once, and the engine collects each finished bucket when the next goes out.

The model's units hold 512, 64, 64 and 512 weights in forward order (one bucket each). The
backward reduces the last unit's 512 first; when the next unit's 64 go out, those 512 are more
than one 64 bucket, so they are finished first. The two 64-element buckets may then be in
flight together, as equal buckets always may. Each unit's backward records which units'
gradients are in flight when it starts.

The fake group runs in a subprocess of its own, so that it never meets the other tests."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tests.distributed.launch import run_process_tree

RESULT_MARK = "GRADIENTS_IN_FLIGHT "
REPO = Path(__file__).resolve().parents[2]
UNITS = ("layers.0", "layers.1", "layers.2", "layers.3")


def _play() -> dict[str, list[str]]:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import hf_zero

    class LargeSmallSmallLarge(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(8, 64, bias=False), nn.Linear(8, 8, bias=False),
                                         nn.Linear(8, 8, bias=False), nn.Linear(8, 64, bias=False)])
            self.out = nn.Parameter(torch.ones(64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.layers[1](self.layers[0](x)[..., :8])
            x = self.layers[3](self.layers[2](x))
            return (x * self.out).sum()

    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=4)
    try:
        torch.manual_seed(0)
        model = LargeSmallSmallLarge()
        engine, *_ = hf_zero.initialize(model=model, config={
            "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 1,
                                  "stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0}})
        units = {u.name: u for u in engine.units}
        held: dict[str, list[str]] = {}

        def record(name: str) -> None:
            held[name] = [other for other in UNITS
                          if any(g.grads.full is not None and g.grads.full.untyped_storage().nbytes() > 0
                                 for g in units[other].groups)]

        for name in UNITS:
            module = engine.module.get_submodule(name)
            module.register_full_backward_pre_hook(lambda m, g, name=name: record(name))
        loss = engine(torch.ones(1, 8))
        engine.backward(loss)
        engine.step()
        return held
    finally:
        dist.destroy_process_group()


def test_a_large_bucket_is_not_held_through_the_smaller_units_after_it() -> None:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", HF_ZERO_CHECK_ASYNC="0",
               PYTHONPATH=os.pathsep.join([str(REPO), *sys.path]))
    run = run_process_tree([sys.executable, "-m", "tests.distributed.test_gradients_in_flight"], timeout=300,
                           env=env, cwd=REPO)
    lines = [line for line in run.stdout.splitlines() if line.startswith(RESULT_MARK)]
    assert run.returncode == 0 and lines, f"rc {run.returncode}\n{run.stdout[-4000:]}\n{run.stderr[-8000:]}"
    held = json.loads(lines[-1][len(RESULT_MARK):])
    # Backward order: layers.3, .2, .1, .0. A unit's own gradient is autograd's until its
    # reduction ([Note: a gradient autograd hands over] in grad_buffer.py): what is listed is in flight.
    assert held["layers.3"] == []
    assert held["layers.2"] == ["layers.3"]  # the 512 in flight while .2 runs
    assert held["layers.1"] == ["layers.2"]  # finished when .2's 64 went out
    # Two equal buckets may be in flight together; whether .2's still is depends on the torch
    # version's fake group (below).
    assert "layers.1" in held["layers.0"] and "layers.3" not in held["layers.0"]


if __name__ == "__main__":
    print(RESULT_MARK + json.dumps(_play()), flush=True)
