"""Runs of an unmodified run_clm-shaped Trainer script (clm_script.py here) under DDP, hf_zero
ZeRO-3 and DeepSpeed ZeRO-3, each rank's peak resident memory recorded at exit by the
sitecustomize.py next to this file. Used by tests/integration/test_trainer_memory.py and
benchmarks/bench_trainer_memory.py."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
SCRIPT = HERE / "clm_script.py"
MODES = ("ddp", "hf_zero3", "deepspeed3")
WORLD = 2


def build_model(folder: Path, layers: int = 12, hidden: int = 768, intermediate: int = 2048, vocab: int = 32000) -> int:
    """A Llama (untied lm_head; 134M parameters at the defaults) saved in 150 MB shards."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, vocab_size=vocab,
                         max_position_embeddings=512, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder, max_shard_size="150MB")
    return sum(p.numel() for p in model.parameters())


def write_configs(work: Path, zero_extra: dict[str, Any] | None = None) -> dict[str, Path]:
    """The README's ZeRO-3 recipe (recipes/examples/zero3.json, "auto" values filled from the
    Trainer's arguments), for hf_zero and DeepSpeed alike, with ``zero_extra`` overrides."""
    recipe = json.loads((REPO / "recipes" / "examples" / "zero3.json").read_text())
    recipe["zero_optimization"].update(zero_extra or {})
    paths = {"hf_zero3": work / "zero3.json", "deepspeed3": work / "ds_zero3.json"}
    paths["hf_zero3"].write_text(json.dumps(recipe))
    # On a CPU machine transformers fills DeepSpeed's "auto" train_batch_size with a world size
    # of 1; without the key DeepSpeed derives it from the micro batch and its own world size.
    paths["deepspeed3"].write_text(json.dumps({k: v for k, v in recipe.items() if k != "train_batch_size"}))
    return paths


def command(mode: str, model: Path, out: Path, steps: int, configs: dict[str, Path]) -> list[str]:
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(WORLD)]
    script = [str(SCRIPT), "--model_name_or_path", str(model), "--output_dir", str(out), "--do_train",
              "--use_cpu", "--report_to", "none", "--per_device_train_batch_size", "2", "--max_steps", str(steps),
              "--logging_steps", "1", "--learning_rate", "1e-4", "--max_grad_norm", "1.0", "--save_strategy", "no",
              "--seed", "0", "--disable_tqdm", "true", "--train_samples", str(2 * WORLD * steps)]
    if mode == "ddp":
        return launch + script
    if mode == "hf_zero3":
        return launch + ["-m", "hf_zero.run"] + script + ["--zero_config", str(configs["hf_zero3"])]
    # DeepSpeed picks its CPU accelerator from DS_ACCELERATOR and initialises the process group
    # itself; with --use_cpu the Trainer would leave it to Accelerate, after from_pretrained's
    # zero.Init has already read a world size of 1.
    return launch + [a for a in script if a != "--use_cpu"] + ["--deepspeed", str(configs["deepspeed3"])]


def run_mode(mode: str, model: Path, work: Path, steps: int, configs: dict[str, Path], sample_s: float = 0.0,
             timeout: float | None = None, allocator_env: dict[str, str] | None = None,
             label: str | None = None) -> dict[str, Any]:
    """One launch: every rank's peak RSS (MB), optional RSS samples, and the logged losses. glibc's
    allocator runs at its defaults unless ``allocator_env`` sets ``MALLOC_*_`` variables; ``label``
    names the run's folders (default: the mode)."""
    from tests.distributed.launch import run_process_tree

    out, rss = work / f"out-{label or mode}", work / f"rss-{label or mode}"
    rss.mkdir()
    env = dict(os.environ, TRAINER_MEMORY_OUT=str(rss), TRAINER_MEMORY_SAMPLE_S=str(sample_s), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(HERE), str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", "")]),
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    for name in ("HF_ZERO_CONFIG", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    for name in [n for n in env if n.startswith("MALLOC_")]:
        env.pop(name)
    env.update(allocator_env or {})
    if mode == "deepspeed3":
        env["DS_ACCELERATOR"] = "cpu"
    proc = run_process_tree(command(mode, model, out, steps, configs), env=env, timeout=timeout)
    if proc.returncode != 0:
        return {"ok": False, "error": (proc.stdout + proc.stderr)[-4000:]}
    ranks = [json.loads((rss / f"rank{r}.json").read_text()) for r in range(WORLD)]
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return {"ok": True, "peak_rss_mb": [r["peak_rss_mb"] for r in ranks], "samples": [r["samples"] for r in ranks],
            "loss": [h["loss"] for h in history if "loss" in h]}
