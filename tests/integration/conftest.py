"""Shared set-up for the Trainer integration tests: tiny model folders, and one 2-process torchrun
launch that runs every Trainer job (see trainer_driver.py) and whose results several tests read.

Everything runs on CPU over gloo; ``--use_cpu`` makes Accelerate join the two processes (without
it, a CPU-only Trainer under torchrun trains each process alone)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.distributed.launch import run_process_tree
from tests.tiny_models import BUILDERS

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes" / "examples"
LAUNCH_TIMEOUT_S = 420

MODEL_CLASSES = {"gpt2": "AutoModelForCausalLM", "llama": "AutoModelForCausalLM",
                 "bert": "AutoModelForSequenceClassification"}
TASKS = {"gpt2": "causal_lm", "llama": "causal_lm", "bert": "sequence_classification"}
STEPS = 6


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    for name in ("HF_ZERO_CONFIG", "ACCELERATE_USE_DEEPSPEED", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                 "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def run_launch(cmd: list[str], timeout: int = LAUNCH_TIMEOUT_S) -> subprocess.CompletedProcess:
    proc = run_process_tree(cmd, cwd=REPO, env=subprocess_env(), timeout=timeout)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-12000:]
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{tail}")
    return proc


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]


def script_args(kind: str, model_dir: str, output_dir: str, *extra: str) -> list[str]:
    """The example script's arguments shared by every run of the same model (DDP or ZeRO)."""
    return [
        "--model_name_or_path", model_dir, "--task", TASKS[kind], "--output_dir", output_dir,
        "--do_train", "--do_eval", "--do_predict", "--use_cpu", "--report_to", "none",
        "--synthetic_train_samples", "48", "--synthetic_eval_samples", "8",
        "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2",
        "--gradient_accumulation_steps", "2", "--max_steps", str(STEPS), "--logging_steps", "1",
        "--learning_rate", "5e-3", "--weight_decay", "0.1", "--warmup_steps", "2", "--max_grad_norm", "1.0",
        "--save_strategy", "no", "--seed", "0", "--disable_tqdm", "true", *extra,
    ]


LEARNABLE_LR = 2e-2


def write_learnable_rows(path: Path, rows: int = 48) -> str:
    """A ``--train_file`` of Markov sequences (tests.tiny_models.learnable_batch): a model can
    learn them, so the loss falls by far more than precision noise."""
    from tests.tiny_models import learnable_batch

    path.write_text("".join(json.dumps({"input_ids": row}) + "\n" for row in learnable_batch(0, rows).tolist()))
    return str(path)


def write_config(path: Path, stage: int, **extra: Any) -> str:
    config = json.loads((RECIPES / f"zero{stage}.json").read_text())
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key].update(value)
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    dirs = {}
    for kind, build in BUILDERS.items():
        path = root / kind
        build(seed=0).save_pretrained(path)
        dirs[kind] = str(path)
    return dirs


def _plan(model_dirs: dict[str, str], root: Path) -> dict[str, Any]:
    out = lambda name: str(root / name)  # noqa: E731
    configs = {stage: write_config(root / f"zero{stage}.json", stage) for stage in (1, 2, 3)}
    jobs: list[dict[str, Any]] = []
    # DDP baselines: the unmodified script with no zero_config (and the runner's patches undone).
    for kind in BUILDERS:
        jobs.append({"name": f"{kind}-ddp", "kind": "script", "argv": script_args(kind, model_dirs[kind], out(f"{kind}-ddp"))})
    eval_only = [a for a in script_args("gpt2", model_dirs["gpt2"], out("gpt2-ddp-eval")) if a not in ("--do_train", "--do_predict")]
    jobs.append({"name": "gpt2-ddp-eval", "kind": "script", "argv": eval_only})
    explicit_args = dict(
        output_dir=out("explicit"), use_cpu=True, report_to="none", per_device_train_batch_size=2,
        per_device_eval_batch_size=2, gradient_accumulation_steps=2, max_steps=STEPS, logging_steps=1,
        learning_rate=5e-3, weight_decay=0.1, warmup_steps=2, max_grad_norm=1.0, save_strategy="no",
        seed=0, disable_tqdm=True,
    )
    jobs.append({"name": "explicit", "kind": "explicit", "model_dir": model_dirs["gpt2"], "zero_config": configs[3],
                 "training_args": explicit_args, "train_samples": 48, "eval_samples": 8,
                 "save_dir": out("explicit-saved"), "max_new_tokens": [3, 9]})
    seq2seq_args = dict(output_dir=out("seq2seq"), use_cpu=True, report_to="none", per_device_eval_batch_size=2,
                        predict_with_generate=True, disable_tqdm=True)
    jobs.append({"name": "seq2seq", "kind": "seq2seq", "model_dir": model_dirs["gpt2"], "zero_config": configs[3],
                 "training_args": seq2seq_args, "eval_samples": 8, "max_length": 16})
    best_args = dict(explicit_args, output_dir=out("best"), eval_strategy="steps", eval_steps=2,
                     save_strategy="steps", save_steps=2, load_best_model_at_end=True,
                     metric_for_best_model="countdown", greater_is_better=True)
    jobs.append({"name": "best", "kind": "best", "model_dir": model_dirs["gpt2"], "zero_config": configs[2],
                 "training_args": best_args, "train_samples": 48, "eval_samples": 8})
    for kind in BUILDERS:
        for stage in (1, 2, 3):
            jobs.append({"name": f"{kind}-z{stage}", "kind": "script", "zero_config": configs[stage],
                         "argv": script_args(kind, model_dirs[kind], out(f"{kind}-z{stage}"))})
    jobs.append({"name": "llama-z3-ckpt", "kind": "script", "zero_config": configs[3],
                 "argv": script_args("llama", model_dirs["llama"], out("llama-z3-ckpt"), "--gradient_checkpointing")})
    # The Trainer's torch_compile: each unit's forward compiled ([Note: compiled units]).
    jobs.append({"name": "llama-z3-compile", "kind": "script", "zero_config": configs[3],
                 "argv": script_args("llama", model_dirs["llama"], out("llama-z3-compile"),
                                     "--torch_compile_backend", "aot_eager")})
    sections = write_config(root / "zero2-sections.json", 2, optimizer={
        "type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
        scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                  "warmup_num_steps": "auto", "warmup_type": "linear"}})
    jobs.append({"name": "gpt2-z2-config-optimizer", "kind": "script", "zero_config": sections,
                 "argv": script_args("gpt2", model_dirs["gpt2"], out("gpt2-z2-config-optimizer"))})
    # DDP at learning rate 0: the untrained model's loss on each step's batch
    jobs.append({"name": "gpt2-ddp-lr0", "kind": "script",
                 "argv": script_args("gpt2", model_dirs["gpt2"], out("gpt2-ddp-lr0"), "--learning_rate", "0.0")})
    # Mixed precision through the Trainer, on learnable data with a learning rate at which the
    # loss falls far more than bf16/fp16 rounding moves it (see test_mixed_precision_trains_like_fp32).
    learnable = ["--train_file", write_learnable_rows(root / "markov.jsonl"), "--learning_rate", str(LEARNABLE_LR)]
    jobs.append({"name": "gpt2-ddp-learnable", "kind": "script",
                 "argv": script_args("gpt2", model_dirs["gpt2"], out("gpt2-ddp-learnable"), *learnable)})
    bf16 = write_config(root / "zero3-bf16.json", 3, zero_optimization={"stage3_gather_16bit_weights_on_model_save": True})
    jobs.append({"name": "gpt2-z3-bf16", "kind": "script", "zero_config": bf16,
                 "argv": script_args("gpt2", model_dirs["gpt2"], out("gpt2-z3-bf16"), *learnable, "--bf16")})
    # ZeRO++ through the unmodified script: qwZ's int8 gathers, qgZ's 4-bit reduction (one node:
    # one exchange over both ranks), and hpZ, which at world 2 is one node group of both ranks and
    # keeps no secondary shards ([Note: secondary shards]).
    zeropp = write_config(root / "zero3-bf16-zeropp.json", 3, zero_optimization={
        "zero_quantized_weights": True, "zero_quantized_gradients": True, "zero_hpz_partition_size": 2})
    jobs.append({"name": "gpt2-z3-bf16-zeropp", "kind": "script", "zero_config": zeropp,
                 "argv": script_args("gpt2", model_dirs["gpt2"], out("gpt2-z3-bf16-zeropp"), *learnable, "--bf16")})
    jobs.append({"name": "gpt2-z2-fp16", "kind": "script", "zero_config": configs[2],
                 "argv": script_args("gpt2", model_dirs["gpt2"], out("gpt2-z2-fp16"), *learnable, "--fp16")})
    for stage in (1, 2, 3):
        full = out(f"resume-z{stage}-full")
        jobs.append({"name": f"resume-z{stage}-full", "kind": "script", "zero_config": configs[stage],
                     "argv": script_args("gpt2", model_dirs["gpt2"], full, "--save_strategy", "steps", "--save_steps", "3")})
        jobs.append({"name": f"resume-z{stage}-resumed", "kind": "script", "zero_config": configs[stage],
                     "argv": script_args("gpt2", model_dirs["gpt2"], out(f"resume-z{stage}-resumed"),
                                         "--resume_from_checkpoint", os.path.join(full, "checkpoint-3"))})
    # Shape-aware optimizers ([Note: whole-parameter step]) on learnable data: the Trainer's
    # --optim adafactor (transformers' Adafactor) against DDP, and resumed at stage 3 from a
    # stage-2 checkpoint; the config's Muon section against MuonWithAuxAdamW under DDP.
    adafactor = [*learnable, "--optim", "adafactor"]
    jobs.append({"name": "gpt2-ddp-adafactor", "kind": "script",
                 "argv": script_args("gpt2", model_dirs["gpt2"], out("gpt2-ddp-adafactor"), *adafactor)})
    adafactor_full = out("gpt2-z2-adafactor")
    jobs.append({"name": "gpt2-z2-adafactor", "kind": "script", "zero_config": configs[2],
                 "argv": script_args("gpt2", model_dirs["gpt2"], adafactor_full, *adafactor,
                                     "--save_strategy", "steps", "--save_steps", "3")})
    jobs.append({"name": "gpt2-z3-adafactor-resumed", "kind": "script", "zero_config": configs[3],
                 "argv": script_args("gpt2", model_dirs["gpt2"], out("gpt2-z3-adafactor-resumed"), *adafactor,
                                     "--resume_from_checkpoint", os.path.join(adafactor_full, "checkpoint-3"))})
    muon_adam_lr = 1e-2
    muon_section = {"type": "Muon", "params": {"lr": "auto", "weight_decay": "auto", "adam_lr": muon_adam_lr}}
    for name, config in (("gpt2-ddp-muon", None),
                         ("gpt2-z3-muon", write_config(root / "zero3-muon.json", 3, optimizer=muon_section))):
        jobs.append({"name": name, "kind": "muon", "model_dir": model_dirs["gpt2"], "zero_config": config,
                     "adam_lr": muon_adam_lr, "train_samples": 48,
                     "training_args": dict(explicit_args, output_dir=out(name), learning_rate=LEARNABLE_LR)})
    from tests.integration.resolution import AUTO_EXAMPLE, EXAMPLE_ARGS, EXAMPLE_HIDDEN, EXAMPLE_STEPS

    jobs.append({"name": "resolve-world2", "kind": "resolve", "config": AUTO_EXAMPLE,
                 "training_args": dict(EXAMPLE_ARGS, output_dir=out("resolve"), max_steps=EXAMPLE_STEPS),
                 "hidden_size": EXAMPLE_HIDDEN, "steps": EXAMPLE_STEPS})
    return {"jobs": jobs, "out": str(root / "results.json")}


@pytest.fixture(scope="session")
def trainer_runs(model_dirs: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every Trainer job of the integration tests, in one 2-process launch."""
    root = tmp_path_factory.mktemp("trainer_runs")
    plan = _plan(model_dirs, root)
    plan_path = root / "plan.json"
    plan_path.write_text(json.dumps(plan))
    run_launch(torchrun("-m", "hf_zero.run", "-m", "tests.integration.trainer_driver", str(plan_path)))
    return merge_rank_results(plan["out"], world_size=2)


def merge_rank_results(out: str, world_size: int) -> dict[str, Any]:
    """Rank 0's results, with any job that raised on some rank replaced by that rank's error
    (``{"error": traceback, "rank": rank}``)."""
    from tests.integration.trainer_driver import rank_results_path

    per_rank = [json.loads(Path(rank_results_path(out, rank)).read_text()) for rank in range(world_size)]
    merged = dict(per_rank[0])
    for rank, results in enumerate(per_rank):
        assert results.keys() == merged.keys(), f"rank {rank} ran other jobs: {sorted(results)}"
        for name, result in results.items():
            if "error" in result and "rank" not in merged[name]:  # the lowest failing rank's error
                merged[name] = {"error": result["error"], "rank": rank}
    return merged
