"""The runner under a second launcher: ``accelerate launch -m hf_zero.run SCRIPT --zero_config``
with a standard multi-process accelerate yaml (no DeepSpeed section, no ACCELERATE_USE_DEEPSPEED).
(``torchrun -m hf_zero.run`` is how every job of conftest.trainer_runs is launched.)"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from tests.distributed.launch import free_port
from tests.integration.conftest import RECIPES, REPO, run_launch, script_args, write_config


def _losses(output_dir: Path) -> list[float]:
    history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    return [h["loss"] for h in history if "loss" in h]


def test_accelerate_launch_runs_an_unmodified_script_on_zero2(
    trainer_runs: dict[str, Any], model_dirs: dict[str, str], tmp_path: Path
) -> None:
    config = write_config(tmp_path / "zero2.json", 2)
    output_dir = tmp_path / "out"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(RECIPES / "accelerate_2proc.yaml"),
           "--main_process_port", str(free_port()), "-m", "hf_zero.run", str(REPO / "recipes" / "examples" / "run_trainer.py"),
           "--zero_config", config, *script_args("gpt2", model_dirs["gpt2"], str(output_dir))]
    run_launch(cmd)
    baseline = trainer_runs["gpt2-ddp"]
    assert "error" not in baseline, baseline.get("error")
    expected = baseline["loss"]
    got = _losses(output_dir)
    assert len(got) == len(expected)
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(got, expected)), (got, expected)
    assert (output_dir / "model.safetensors").exists()
