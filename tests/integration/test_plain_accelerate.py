"""An unmodified plain-``Accelerator`` script (plain_accelerate_clm.py, in the style of
run_clm_no_trainer.py) on hf_zero, in real 2-process CPU launches.

The same script runs three times: under plain ``accelerate launch`` (DDP), under
``accelerate launch -m hf_zero.run ... --zero_config zero2.json`` and under ``hf-zero launch``
with a yaml whose hf_zero section names a stage-3 config. Llama's parameters match none of the
script's ``no_decay`` names, so its second param group is empty ([Note: param groups keep their
places]); its linear schedule is stepped as Accelerate steps it ([Note: who steps the script's
scheduler]); clipping at 0.5 engages; the stage-3 run saves its state at step 2 and a fourth
launch resumes from it with ``accelerator.load_state``. CPU multi-process launches need ``--multi_gpu`` with
ACCELERATE_USE_CPU=true (``--cpu`` alone starts one process)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tests.distributed.launch import free_port, run_process_tree
from tests.integration.conftest import LAUNCH_TIMEOUT_S, REPO, subprocess_env

SCRIPT = str(Path(__file__).with_name("plain_accelerate_clm.py"))
CLIP = 0.5
STAGES = (2, 3)


def _run(cmd: list[str], **env: str) -> subprocess.CompletedProcess:
    full_env = dict(subprocess_env(), ACCELERATE_USE_CPU="true", **env)
    proc = run_process_tree(cmd, cwd=REPO, env=full_env, timeout=LAUNCH_TIMEOUT_S)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-8000:]}")
    return proc


def _config(path: Path, stage: int) -> str:
    path.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": CLIP, "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}))
    return str(path)


@pytest.fixture(scope="module")
def runs(model_dirs: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("plain_accelerate")
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    script_args = lambda name: ["--model_name_or_path", model_dirs["llama"], "--output_dir", str(root / name),  # noqa: E731
                                "--max_grad_norm", str(CLIP)]
    ddp_pythonpath = os.pathsep.join([str(Path(__file__).with_name("ddp_exit_guard")), subprocess_env()["PYTHONPATH"]])
    _run([*launch, "--main_process_port", str(free_port()), SCRIPT, *script_args("ddp")], PYTHONPATH=ddp_pythonpath)
    _run([*launch, "--main_process_port", str(free_port()), "-m", "hf_zero.run", SCRIPT,
          "--zero_config", _config(root / "zero2.json", 2), *script_args("z2")],
         HF_ZERO_MEMORY_REPORT=str(root / "memory-z2"))
    cluster = yaml.safe_load((REPO / "recipes" / "accelerate" / "zero3_2proc.yaml").read_text())
    cluster["hf_zero"] = {"config_file": _config(root / "zero3.json", 3)}
    (root / "zero3.yaml").write_text(yaml.safe_dump(cluster))
    _run([sys.executable, "-m", "hf_zero.cli", "launch", "--config_file", str(root / "zero3.yaml"),
          "--main_process_port", str(free_port()), SCRIPT, *script_args("z3"), "--checkpointing_steps", "2"],
         HF_ZERO_MEMORY_REPORT=str(root / "memory-z3"))
    # load_state: the stage-3 run resumed from its step-2 state (in the script's own way)
    _run([*launch, "--main_process_port", str(free_port()), "-m", "hf_zero.run", SCRIPT,
          "--zero_config", str(root / "zero3.json"), *script_args("z3-resumed"),
          "--resume_from_checkpoint", str(root / "z3" / "step_2")])
    results = {name: json.loads((root / name / "all_results.json").read_text())
               for name in ("ddp", "z2", "z3", "z3-resumed")}
    results["root"] = str(root)
    return results


def _close(got: list[float], expected: list[float], rel: float = 1e-5) -> bool:
    return len(got) == len(expected) and all(math.isclose(a, b, rel_tol=rel) for a, b in zip(got, expected))


@pytest.mark.parametrize("stage", STAGES)
def test_unmodified_script_matches_plain_ddp(runs: dict[str, Any], stage: int) -> None:
    ddp, zero = runs["ddp"], runs[f"z{stage}"]
    assert (ddp["accelerator"], ddp["model"]) == ("Accelerator", "DistributedDataParallel")
    assert (zero["accelerator"], zero["model"]) == ("HfZeroAccelerator", "ZeroEngine")
    assert len(zero["losses"]) == 10  # 5 optimizer steps x accumulation 2
    assert _close(zero["losses"], ddp["losses"]), (zero["losses"], ddp["losses"])
    assert _close(zero["grad_norms"], ddp["grad_norms"]), (zero["grad_norms"], ddp["grad_norms"])
    assert max(ddp["grad_norms"]) > CLIP  # clipping engages
    # warmup 2 x 2 processes then linear decay over 5 x 2: the schedule moves as under DDP
    assert _close(zero["lrs"], ddp["lrs"], rel=1e-9) and ddp["lrs"][:2] == [0.0025, 0.005]
    assert zero["eval_count"] == ddp["eval_count"] == 7
    assert math.isclose(zero["perplexity"], ddp["perplexity"], rel_tol=1e-5)


@pytest.mark.parametrize("stage", STAGES)
def test_per_rank_memory_report_shows_sharded_states(runs: dict[str, Any], model_dirs: dict[str, str],
                                                     stage: int) -> None:
    from safetensors.torch import load_file

    full_bytes = sum(t.numel() * 4 for t in load_file(Path(model_dirs["llama"]) / "model.safetensors").values())
    folder = Path(runs["root"]) / f"memory-z{stage}"
    reports = [json.loads((folder / f"memory-rank{r}.json").read_text()) for r in (0, 1)]
    for report in reports:
        memory = report["memory"]
        assert (report["stage"], report["world_size"]) == (stage, 2)
        # Adam's two moments of this rank's half, not of the whole model (flat groups pad to 2)
        assert full_bytes < memory["optimizer_state"] < full_bytes + 64 * 2 * 4
        if stage == 3:  # parameters and gradients sharded too
            assert memory["compute_params"] < 0.55 * full_bytes and memory["gradients"] < 0.55 * full_bytes
        else:  # stage 2: full parameters, gradients reduced into shards (the full buffer is freed)
            assert memory["compute_params"] >= full_bytes


def test_saved_model_and_state(runs: dict[str, Any]) -> None:
    from safetensors.torch import load_file

    root = Path(runs["root"])
    ddp = load_file(root / "ddp" / "model.safetensors")
    for stage in STAGES:
        zero = load_file(root / f"z{stage}" / "model.safetensors")
        assert set(zero) == set(ddp)
        for name, tensor in ddp.items():
            torch.testing.assert_close(zero[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
    state = root / "z3" / "step_2"
    assert sorted(p.name for p in (state / "pytorch_model").glob("rank-*")) == [
        "rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"]
    assert (state / "scheduler.bin").exists()  # the script's scheduler, saved by Accelerate


def test_load_state_resumes_the_unmodified_script(runs: dict[str, Any]) -> None:
    full, resumed = runs["z3"], runs["z3-resumed"]
    assert len(resumed["losses"]) == 6  # steps 3-5 x accumulation 2
    assert _close(resumed["losses"], full["losses"][4:]), (resumed["losses"], full["losses"][4:])
    assert _close(resumed["grad_norms"], full["grad_norms"][2:])
    assert _close(resumed["lrs"], full["lrs"][2:], rel=1e-9)


def test_a_config_the_script_never_uses_is_an_error(tmp_path: Path) -> None:
    script = tmp_path / "no_model.py"
    script.write_text("import torch\nmodel = torch.nn.Linear(2, 2)\nprint('trained without any accelerator')\n")
    proc = subprocess.run([sys.executable, "-m", "hf_zero.run", str(script), "--zero_config",
                           str(REPO / "recipes" / "zero2.json")],
                          cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "finished without preparing a model with hf_zero" in proc.stderr, proc.stderr[-3000:]
