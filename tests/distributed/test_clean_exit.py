"""A script that never destroys its gloo group still exits cleanly ([Note: leaving a gloo group]).

Unmodified Trainer and Accelerate scripts end without ``destroy_process_group``. On torch 2.13 a
gloo worker thread still waiting for the GIL when the interpreter finalizes aborts the process
after all its work is done (SIGABRT, "terminate called without an active exception"). The
script below ends the same way: an hf_zero engine, then a last all_reduce of the loss, then
nothing. A probe registered before hf_zero's exit hook runs after it (atexit is last in, first
out) and records what the hook left behind.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.distributed.launch import run_process_tree

SCRIPT = '''
import atexit, json, os, sys
import torch
import torch.distributed as dist

def probe():
    from hf_zero.comm import collectives
    with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump({"initialized": dist.is_initialized(), "own_groups": len(collectives._GRAD_GROUPS)}, f)

atexit.register(probe)  # before hf_zero registers its hook, so it runs after it

import hf_zero

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
engine, *_ = hf_zero.initialize(model=model, config=config)
for _ in range(2):
    loss = engine(torch.randn(2, 16)).sum()
    engine.backward(loss)
    engine.step()
mean_loss = loss.detach().clone()
dist.all_reduce(mean_loss)  # the last collective, as a Trainer's metric reduction
print("trained", flush=True)
'''

RUNS = 3


@pytest.mark.timeout(180)
def test_a_script_that_never_destroys_its_group_exits_cleanly(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    for run in range(RUNS):
        out = tmp_path / f"run{run}"
        out.mkdir()
        proc = run_process_tree(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
             str(script), str(out)],
            timeout=120,
        )
        log = proc.stdout + proc.stderr
        assert log.count("trained") == 2, log[-3000:]
        assert "terminate called" not in log and proc.returncode == 0, log[-3000:]
        for rank in range(2):
            left = json.loads((out / f"rank{rank}.json").read_text())
            # the hook destroyed every group and dropped hf_zero's own reference to the gradient group
            assert left == {"initialized": False, "own_groups": 0}, (rank, left)
