"""A run_clm-shaped Trainer script, unmodified, with ``sequence_parallel_size: 2`` in its
``--zero_config`` (stage 3) or Accelerate's ``parallelism_config_sp_size: 2`` from the launcher's
environment (stage 2) on 4 ranks logs the same losses as the script under DDP on 2 ranks (the same
global batch: 2 data-parallel groups of 2 sequence ranks). The 8 samples are two global batches of
4, trained on twice: the loss falls, far more than the tolerance. The 4 ranks without sequence
parallelism would take all 8 samples in each step, and log other losses."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.distributed.launch import run_process_tree

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "integration" / "trainer_memory" / "clm_script.py"
STEPS = 4


def _build_model(folder: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(folder)


def _run(tmp: Path, model: Path, label: str, world: int, zero_config: dict | None,
         launcher_env: dict[str, str] | None = None) -> list[float]:
    out = tmp / f"out-{label}"
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world)]
    script = [str(SCRIPT), "--model_name_or_path", str(model), "--output_dir", str(out), "--do_train",
              "--use_cpu", "--report_to", "none", "--per_device_train_batch_size", "2", "--max_steps", str(STEPS),
              "--logging_steps", "1", "--learning_rate", "5e-3", "--max_grad_norm", "1.0", "--save_strategy", "no",
              "--seed", "0", "--disable_tqdm", "true", "--train_samples", "8", "--block_size", "30"]
    if zero_config is not None:
        path = tmp / f"{label}.json"
        path.write_text(json.dumps(zero_config))
        cmd = launch + ["-m", "hf_zero.run"] + script + ["--zero_config", str(path)]
    else:
        cmd = launch + script
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", "")]))
    for name in ("HF_ZERO_CONFIG", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env.update(launcher_env or {})
    done = run_process_tree(cmd, timeout=600, env=env, cwd=tmp)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return [h["loss"] for h in history if "loss" in h]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[float]]:
    tmp = tmp_path_factory.mktemp("trainer_sp")
    model = tmp / "model"
    _build_model(model)
    zero = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto"}
    # What `accelerate launch` exports for an accelerate config with parallelism_config_sp_size: 2
    # ([Note: parallelism_config]): the stage-2 run takes S from there, not from its zero config.
    accelerate_sp = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_SP_SIZE": "2",
                     "PARALLELISM_CONFIG_SP_BACKEND": "deepspeed", "PARALLELISM_CONFIG_DP_SHARD_SIZE": "1",
                     "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "1", "PARALLELISM_CONFIG_TP_SIZE": "1",
                     "PARALLELISM_CONFIG_CP_SIZE": "1"}
    return {
        "ddp": _run(tmp, model, "ddp", 2, None),
        "sp_stage3": _run(tmp, model, "sp3", 4, {**zero, "sequence_parallel_size": 2, "zero_optimization": {"stage": 3}}),
        "sp_stage2": _run(tmp, model, "sp2", 4, {**zero, "zero_optimization": {"stage": 2}}, accelerate_sp),
    }


@pytest.mark.parametrize("label", ["sp_stage3", "sp_stage2"])
def test_trainer_with_sequence_parallel_logs_the_ddp_losses(runs: dict[str, list[float]], label: str) -> None:
    ddp, ours = runs["ddp"], runs[label]
    assert len(ddp) == len(ours) == STEPS
    assert ddp[-1] < ddp[0] - 1e-2 * ddp[0]  # the signal: far more than the tolerance
    for theirs, mine in zip(ddp, ours):
        assert abs(mine - theirs) <= 1e-4 * abs(theirs), (ours, ddp)
