"""Runs on every rank of one 2-process torchrun launch: TRL's published scripts from the installed
package (``trl.scripts.sft``, ``trl.scripts.dpo``, what ``trl sft`` / ``trl dpo`` run), unmodified,
one job after the other in one process (importing transformers, TRL and PEFT is the slow part).

Each job runs its script as its command line would:
- with a ``zero_config``: ``hf_zero.run.main(["-m", module, *argv, "--zero_config", config])``,
  the code behind ``torchrun ... -m hf_zero.run -m trl.scripts.sft ... --zero_config zero3.json``;
- without one (the DDP reference): the runner's patches undone, then ``runpy.run_module`` as
  ``torchrun ... -m trl.scripts.sft ...`` does.

The scripts end with ``trainer.end()``, which destroys the process group. Before each job this
driver joins a fresh group on a store prefix of its own (a group rebuilt on the old prefix would
read the previous group's rendezvous keys) and resets Accelerate's shared state, so every script
starts as in a new launch. A stage-3 config left alive by the previous job would make the next
DDP job load sharded: that is an error here.

``torchrun --standalone --nproc_per_node 2 -m tests.integration.trl_published_driver PLAN.json``;
PLAN: {"jobs": [{"name", "module", "argv", "zero_config"?}], "steps", "out"}; every rank writes
its results (trainer_driver.run_plan), so a job failing on one rank only fails its test.
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import sys
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from tests.integration.trainer_driver import run_plan

CONFIG_ENV = "HF_ZERO_CONFIG"
_JOBS_STARTED = [0]


def _fresh_process_group() -> None:
    """A new default group for the next script when the last one destroyed its own."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    _JOBS_STARTED[0] += 1
    if dist.is_initialized():
        return
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=120))
    store = dist.PrefixStore(f"trl_published_job{_JOBS_STARTED[0]}", agent)
    dist.init_process_group("gloo", store=store, rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))


def _undo_runner_patches() -> None:
    from hf_zero.integrations import plain_accelerator, transformers

    transformers.disable()
    plain_accelerator.disable()
    os.environ.pop(CONFIG_ENV, None)
    gc.collect()
    from hf_zero.config.live import live_zero3_config

    if live_zero3_config() is not None:
        raise RuntimeError("a stage-3 config of an earlier job is still alive: this job would load sharded")


def _history(output_dir: str, steps: int) -> list[dict[str, Any]]:
    with open(os.path.join(output_dir, f"checkpoint-{steps}", "trainer_state.json")) as f:
        return [h for h in json.load(f)["log_history"] if "loss" in h]


def run_job(job: dict[str, Any], steps: int) -> dict[str, Any]:
    started = time.perf_counter()
    _undo_runner_patches()
    _fresh_process_group()
    argv = list(job["argv"])
    if job.get("zero_config"):
        from hf_zero import run

        run.main(["-m", job["module"], *argv, "--zero_config", job["zero_config"]])
    else:
        sys.argv = [job["module"], *argv]
        runpy.run_module(job["module"], run_name="__main__", alter_sys=True)
    _undo_runner_patches()
    output_dir = argv[argv.index("--output_dir") + 1]
    history = _history(output_dir, steps)
    return {"loss": [h["loss"] for h in history], "grad_norm": [h["grad_norm"] for h in history],
            "learning_rate": [h["learning_rate"] for h in history],
            **{metric: [h.get(metric) for h in history] for metric in ("mean_token_accuracy", "entropy")},
            "engine": all("hf_zero/grad_norm" in h for h in history), "output_dir": output_dir,
            "seconds": time.perf_counter() - started}


def main(plan_path: str) -> None:
    with open(plan_path) as f:
        steps = json.load(f)["steps"]
    run_plan(plan_path, lambda job: run_job(job, steps))


if __name__ == "__main__":
    main(sys.argv[1])
