"""The runner under other launchers: ``accelerate launch -m hf_zero.run SCRIPT --zero_config``
with a standard multi-process accelerate yaml (no DeepSpeed section, no ACCELERATE_USE_DEEPSPEED),
and a ``deepspeed`` job's command line with ``deepspeed`` replaced by ``hf-zero launch``: the
launcher's flags, a two-node hostfile on loopback, and the script's ``--deepspeed ds.json``.
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


def _assert_trains_like_ddp(trainer_runs: dict[str, Any], output_dir: Path) -> None:
    baseline = trainer_runs["gpt2-ddp"]
    assert "error" not in baseline, baseline.get("error")
    expected = baseline["loss"]
    got = _losses(output_dir)
    assert len(got) == len(expected)
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(got, expected)), (got, expected)
    assert (output_dir / "model.safetensors").exists()


def test_accelerate_launch_runs_an_unmodified_script_on_zero2(
    trainer_runs: dict[str, Any], model_dirs: dict[str, str], tmp_path: Path
) -> None:
    config = write_config(tmp_path / "zero2.json", 2)
    output_dir = tmp_path / "out"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(RECIPES / "accelerate_2proc.yaml"),
           "--main_process_port", str(free_port()), "-m", "hf_zero.run", str(REPO / "recipes" / "examples" / "run_trainer.py"),
           "--zero_config", config, *script_args("gpt2", model_dirs["gpt2"], str(output_dir))]
    run_launch(cmd)
    _assert_trains_like_ddp(trainer_runs, output_dir)


HF_ZERO_LAUNCH = [sys.executable, "-m", "hf_zero.cli", "launch"]
TRAINER_SCRIPT = str(REPO / "recipes" / "examples" / "run_trainer.py")


def test_a_deepspeed_command_line_runs_with_hf_zero_launch_in_place_of_deepspeed(
    trainer_runs: dict[str, Any], model_dirs: dict[str, str], tmp_path: Path
) -> None:
    """``deepspeed --num_gpus 2 run_trainer.py --deepspeed ds.json ...`` with only its first word
    changed: two processes, the config read from --deepspeed, DeepSpeed never started."""
    config = write_config(tmp_path / "ds.json", 2)
    output_dir = tmp_path / "out"
    proc = run_launch([*HF_ZERO_LAUNCH, "--num_gpus", "2", "--master_port", str(free_port()), TRAINER_SCRIPT,
                       "--deepspeed", config, *script_args("gpt2", model_dirs["gpt2"], str(output_dir))])
    _assert_trains_like_ddp(trainer_runs, output_dir)
    output = proc.stdout + proc.stderr
    assert f"--deepspeed {config} is read as --zero_config" in output
    assert "world size 2" in output and "ZeRO stage 2" in output


def test_a_two_node_hostfile_on_loopback_trains_as_one_job(
    trainer_runs: dict[str, Any], model_dirs: dict[str, str], tmp_path: Path
) -> None:
    """DeepSpeed's ``host slots=N`` hostfile, both hosts this machine: one torchrun per node, node
    ranks in the hostfile's order, one world of 2."""
    config = write_config(tmp_path / "ds.json", 3)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two nodes, one process each\nlocalhost slots=1\n127.0.0.1 slots=1\n")
    output_dir = tmp_path / "out"
    proc = run_launch([*HF_ZERO_LAUNCH, "--hostfile", str(hostfile), "--master_port", str(free_port()),
                       TRAINER_SCRIPT, f"--deepspeed={config}", *script_args("gpt2", model_dirs["gpt2"], str(output_dir))])
    _assert_trains_like_ddp(trainer_runs, output_dir)
    output = proc.stdout + proc.stderr
    assert "node 0 of 2 (localhost)" in output and "node 1 of 2 (127.0.0.1)" in output
    assert "world size 2" in output and "ZeRO stage 3" in output
