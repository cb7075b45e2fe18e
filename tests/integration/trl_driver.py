"""Runs on every rank of one 2-process torchrun launch: the TRL jobs of test_trl.py in one process
(importing transformers and TRL is the slow part). Each job is an ordinary TRL script, run
unmodified: plainly for the DDP baselines (the runner's Trainer patches undone first, so they run
transformers as shipped), or through ``hf_zero.run --zero_config`` as on the command line.

``torchrun --standalone --nproc_per_node 2 -m tests.integration.trl_driver PLAN.json``;
PLAN: {"jobs": [{"name", "script", "argv", "zero_config"?}], "out"}; every rank writes its results
(trainer_driver.run_plan), so a job failing on one rank only fails its test.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from typing import Any

from tests.integration.trainer_driver import run_plan

CONFIG_ENV = "HF_ZERO_CONFIG"


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    argv = list(job["argv"])
    os.environ.pop(CONFIG_ENV, None)
    if job.get("zero_config"):
        from hf_zero import run

        run.main([job["script"], *argv, "--zero_config", job["zero_config"]])
        os.environ.pop(CONFIG_ENV, None)
    else:
        from hf_zero.integrations.transformers import disable

        disable()
        sys.argv = [job["script"], *argv]
        runpy.run_path(job["script"], run_name="__main__")
    output_dir = argv[argv.index("--output_dir") + 1]
    with open(os.path.join(output_dir, "checkpoint-4", "trainer_state.json")) as f:
        history = [h for h in json.load(f)["log_history"] if "loss" in h]
    return {"loss": [h["loss"] for h in history], "grad_norm": [h["grad_norm"] for h in history],
            "learning_rate": [h["learning_rate"] for h in history], "output_dir": output_dir}


def main(plan_path: str) -> None:
    run_plan(plan_path, run_job)


if __name__ == "__main__":
    main(sys.argv[1])
