"""TRL's own published SFT script (``trl/scripts/sft.py`` from the installed package, what ``trl sft``
runs), unmodified, at stage 3 on 2 processes, against the same script under plain DDP.

The script names its tokenizer by the loaded model's ``config._name_or_path``
(``AutoProcessor.from_pretrained``), so it starts only when a sharded load keeps the path as a
plain load does (test_sharded_load_attributes.py compares the rest). A local tiny Llama with a
word-level tokenizer, a local jsonl folder as ``--dataset_name`` (``load_dataset`` reads it with
no hub access), 4 optimizer steps of accumulation 2, ``--bf16 false`` on both sides (see
test_trl.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.conftest import run_launch, torchrun, write_config
from tests.integration.test_trl import save_tiny_tokenizer, write_data

STEPS = 4


def _args(model: str, data: str, output_dir: str) -> list[str]:
    return ["--model_name_or_path", model, "--dataset_name", data, "--output_dir", output_dir, "--use_cpu",
            "--report_to", "none", "--max_steps", str(STEPS), "--logging_steps", "1", "--learning_rate", "5e-3",
            "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--max_length", "16",
            "--save_strategy", "steps", "--save_steps", str(STEPS), "--seed", "0", "--disable_tqdm", "true",
            "--bf16", "false"]


def _history(output_dir: Path) -> list[dict[str, Any]]:
    state = json.loads((output_dir / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    return [h for h in state["log_history"] if "loss" in h]


@pytest.fixture(scope="module")
def sft_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tests.tiny_models import tiny_llama

    root = tmp_path_factory.mktemp("trl_sft_script")
    model = root / "llama"
    tiny_llama(seed=0).save_pretrained(model)
    save_tiny_tokenizer(str(model))
    data = root / "data"
    data.mkdir()
    Path(write_data(root)[0]).rename(data / "train.jsonl")
    config = write_config(root / "zero3.json", 3)
    out = {"ddp": root / "ddp", "z3": root / "z3"}
    run_launch(torchrun("-m", "trl.scripts.sft", *_args(str(model), str(data), str(out["ddp"]))))
    run_launch(torchrun("-m", "hf_zero.run", "-m", "trl.scripts.sft", *_args(str(model), str(data), str(out["z3"])),
                        "--zero_config", config))
    return out


def test_trl_sft_script_at_stage3_trains_as_ddp(sft_runs: dict[str, Path]) -> None:
    zero, ddp = _history(sft_runs["z3"]), _history(sft_runs["ddp"])
    assert len(ddp) == STEPS
    for key, rel in (("loss", 1e-5), ("grad_norm", 1e-4), ("learning_rate", 0.0)):
        got, expected = [h[key] for h in zero], [h[key] for h in ddp]
        assert len(got) == STEPS and all(math.isclose(a, b, rel_tol=rel) for a, b in zip(got, expected)), \
            (key, got, expected)
    assert "hf_zero/grad_norm" in zero[0] and "hf_zero/grad_norm" not in ddp[0]  # the engine really ran


def test_trl_sft_script_saves_a_folder_plain_transformers_loads(sft_runs: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    zero = AutoModelForCausalLM.from_pretrained(sft_runs["z3"])
    ddp = AutoModelForCausalLM.from_pretrained(sft_runs["ddp"])
    AutoTokenizer.from_pretrained(sft_runs["z3"])  # the script saved the processor it loaded by name
    for (name, a), (_, b) in zip(zero.state_dict().items(), ddp.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)
