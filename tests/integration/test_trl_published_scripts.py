"""TRL's own published scripts, ``trl/scripts/sft.py`` and ``trl/scripts/dpo.py`` from the
installed package (what ``trl sft`` / ``trl dpo`` run), unmodified, at stages 2 and 3, with and
without ``--use_peft``, each against the same script under plain DDP.

Launching is the slow part, so one 2-process torchrun launch (trl_published_driver.py) runs every
job as its command line would (``torchrun -m trl.scripts.sft ...`` for DDP, ``torchrun -m
hf_zero.run -m trl.scripts.sft ... --zero_config zero3.json`` for hf_zero). The matrix covers each
script at both stages and both with and without LoRA, reusing one DDP reference per script and
PEFT setting:

    sft: stage 3, stage 2, stage 3 + LoRA          (DDP: sft, sft + LoRA)
    dpo: stage 3, stage 2 + LoRA, stage 3 + LoRA   (DDP: dpo, dpo + LoRA)

What each stage-3 job needs of hf_zero: ``SFTTrainer`` / ``DPOTrainer`` load the model from
``--model_name_or_path`` under the live stage-3 config (sharded) and name the tokenizer by its
``config._name_or_path``; DPO without PEFT builds its reference model from the same path (an
inference-only engine, see test_trl.py), with PEFT it uses the policy with its adapter disabled;
the LoRA adapters PEFT adds to the sharded base keep the values PEFT drew ([Note: adapters on a
lazily loaded base] in hf_zero.integrations.zero3_loading), so stage-3 LoRA follows DDP's curve
value by value.

A local tiny Llama with a word-level tokenizer, local jsonl folders as ``--dataset_name`` (read by
``load_dataset`` with no hub access), 4 optimizer steps of accumulation 2, ``--bf16 false`` on
both sides (see test_trl.py). Tolerances against the signal, measured with the DDP scripts at
learning rate 0: training moves the loss by at least 1.9e-5 relative at some step of every
curve (SFT + LoRA, step 3; 1.4e-4 or more elsewhere), hf_zero's loss equals DDP's to 1e-7 and
its gradient norm to 1.3e-7.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.conftest import (
    merge_rank_results,
    run_launch,
    torchrun,
    write_config,
)
from tests.integration.test_trl import check_adapter, save_tiny_tokenizer, write_data

STEPS = 6  # the six logged steps (the torch_autocast target)
LOSS_REL = 2e-6
GRAD_NORM_REL = 1e-5
# zero job -> its DDP reference
REFERENCES = {"sft-z3": "sft-ddp", "sft-z2": "sft-ddp", "sft-z3-lora": "sft-ddp-lora",
              "dpo-z3": "dpo-ddp", "dpo-z2-lora": "dpo-ddp-lora", "dpo-z3-lora": "dpo-ddp-lora",
              "sft-z3-sp": "sft-ddp-half"}
# DDP references between the hf_zero jobs: a stage-3 config leaking into a DDP job is caught
ORDER = ["sft-ddp", "sft-z3", "sft-z2", "sft-ddp-lora", "sft-z3-lora", "dpo-z3", "dpo-ddp", "dpo-z2-lora",
         "dpo-ddp-lora", "dpo-z3-lora", "sft-z3-autocast", "sft-ddp-bf16", "sft-z3-bf16", "sft-z3-sp", "sft-ddp-half"]
LORA = ["--use_peft", "--lora_r", "4"]


def _args(model: str, data: str, output_dir: str) -> list[str]:
    return ["--model_name_or_path", model, "--dataset_name", data, "--output_dir", output_dir, "--use_cpu",
            "--report_to", "none", "--max_steps", str(STEPS), "--logging_steps", "1", "--learning_rate", "5e-3",
            "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--max_length", "16",
            "--save_strategy", "steps", "--save_steps", str(STEPS), "--seed", "0", "--disable_tqdm", "true",
            "--bf16", "false"]


def _job(name: str, root: Path, model: Path, data: dict[str, Path], configs: dict[Any, str]) -> dict[str, Any]:
    """``script-where[-lora|-bf16|-autocast|-sp|-half]``: ``bf16`` and ``autocast`` keep TRL's
    default ``bf16=True``, ``autocast`` with torch_autocast in the config; ``sp``: the two ranks are
    one sequence-parallel group of 2 (one data-parallel rank), ``half``: one sample a rank, so that
    DDP's global batch is the ``sp`` run's."""
    script, where, *extra = name.split("-")
    argv = [*_args(str(model), str(data[script]), str(root / name)), *(LORA if "lora" in extra else [])]
    if "bf16" in extra or "autocast" in extra:
        argv = argv[:-2]  # TRL's default bf16=True
    if "half" in extra:
        argv[argv.index("--per_device_train_batch_size") + 1] = "1"
    job: dict[str, Any] = {"name": name, "module": f"trl.scripts.{script}", "argv": argv}
    if where != "ddp":
        job["zero_config"] = configs[(int(where[1:]), "sp" if "sp" in extra else "autocast" in extra)]
    return job


@pytest.fixture(scope="module")
def published_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from tests.tiny_models import tiny_llama

    root = tmp_path_factory.mktemp("trl_published")
    model = root / "llama"
    tiny_llama(seed=0).save_pretrained(model)
    save_tiny_tokenizer(str(model))
    data = {"sft": root / "sft-data", "dpo": root / "dpo-data"}
    for folder, written in zip(data.values(), write_data(root)[:2]):
        folder.mkdir()
        Path(written).rename(folder / "train.jsonl")  # a local folder: load_dataset(folder)["train"]
    configs = {(stage, False): write_config(root / f"zero{stage}.json", stage) for stage in (2, 3)}
    configs[(3, True)] = write_config(root / "zero3-autocast.json", 3, torch_autocast={"enabled": True})
    configs[(3, "sp")] = write_config(root / "zero3-sp.json", 3, sequence_parallel_size=2)
    plan = {"jobs": [_job(name, root, model, data, configs) for name in ORDER], "steps": STEPS,
            "out": str(root / "results.json")}
    (root / "plan.json").write_text(json.dumps(plan))
    run_launch(torchrun("-m", "tests.integration.trl_published_driver", str(root / "plan.json")))
    runs = merge_rank_results(plan["out"], 2)
    runs["model"], runs["root"] = str(model), str(root)
    return runs


def _ok(runs: dict[str, Any], name: str) -> dict[str, Any]:
    assert "error" not in runs[name], f"{name} failed on rank {runs[name].get('rank')}:\n{runs[name].get('error')}"
    return runs[name]


def _close(got: list[float], expected: list[float], rel: float) -> bool:
    return len(got) == len(expected) == STEPS and all(math.isclose(a, b, rel_tol=rel) for a, b in zip(got, expected))


@pytest.mark.parametrize("name", list(REFERENCES))
def test_published_trl_script_trains_as_ddp(published_runs: dict[str, Any], name: str) -> None:
    zero, ddp = _ok(published_runs, name), _ok(published_runs, REFERENCES[name])
    assert _close(zero["loss"], ddp["loss"], LOSS_REL), (zero["loss"], ddp["loss"])
    assert _close(zero["grad_norm"], ddp["grad_norm"], GRAD_NORM_REL), (zero["grad_norm"], ddp["grad_norm"])
    assert zero["learning_rate"] == ddp["learning_rate"]
    assert zero["engine"] and not ddp["engine"]  # hf_zero's engine ran every step, and only there
    if name.startswith("dpo"):  # the policy starts as its reference: log 2, then training moves it
        assert ddp["loss"][0] == pytest.approx(math.log(2), rel=1e-6)
        assert max(abs(loss - math.log(2)) for loss in ddp["loss"][1:]) > 10 * LOSS_REL * math.log(2)


def test_published_sft_with_its_default_bf16_follows_ddp_under_torch_autocast(published_runs: dict[str, Any]) -> None:
    """TRL defaults to bf16=True, which DDP runs as autocast over fp32 weights: with torch_autocast
    in the config hf_zero runs the same forward ([Note: torch_autocast]), its Linear gradients
    summed in bf16 ([Note: lower-precision-safe modules]: 2.7e-5 off DDP's curve, measured); the
    bf16 section's bf16 weights are another computation."""
    ddp, autocast = _ok(published_runs, "sft-ddp-bf16"), _ok(published_runs, "sft-z3-autocast")
    weights = _ok(published_runs, "sft-z3-bf16")
    assert _close(autocast["loss"], ddp["loss"], 1e-3), (autocast["loss"], ddp["loss"])  # the target
    assert autocast["loss"][0] == pytest.approx(ddp["loss"][0], rel=1e-6)  # the same first forward
    assert weights["loss"][0] != pytest.approx(ddp["loss"][0], rel=1e-6), (weights["loss"], ddp["loss"])
    assert autocast["engine"] and weights["engine"] and not ddp["engine"]
    print("sft bf16: DDP", ddp["loss"], "torch_autocast", autocast["loss"], "bf16 weights", weights["loss"])


def test_published_sft_under_sequence_parallelism_logs_ddp_metrics(published_runs: dict[str, Any]) -> None:
    """SFTTrainer's fused LM head under sequence_parallel_size 2 ([Note: TRL's fused head under
    sequence parallelism]): besides the loss and gradient norm (test above), its token accuracy
    and entropy are DDP's on the whole sequences, where each rank's slice alone gives others."""
    sp, ddp = _ok(published_runs, "sft-z3-sp"), _ok(published_runs, "sft-ddp-half")
    assert sp["mean_token_accuracy"] == pytest.approx(ddp["mean_token_accuracy"], rel=1e-6)
    assert sp["entropy"] == pytest.approx(ddp["entropy"], rel=1e-5)


@pytest.mark.parametrize("name", ["sft-z3", "sft-z2", "dpo-z3"])
def test_published_trl_script_saves_a_folder_plain_transformers_loads(published_runs: dict[str, Any],
                                                                      name: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    zero_dir, ddp_dir = _ok(published_runs, name)["output_dir"], _ok(published_runs, REFERENCES[name])["output_dir"]
    zero, ddp = AutoModelForCausalLM.from_pretrained(zero_dir), AutoModelForCausalLM.from_pretrained(ddp_dir)
    AutoTokenizer.from_pretrained(zero_dir)  # the script saved the processor it loaded by the model's name
    untrained = AutoModelForCausalLM.from_pretrained(published_runs["model"]).state_dict()
    for (key, a), (_, b) in zip(zero.state_dict().items(), ddp.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=key)
        assert not torch.equal(a, untrained[key]), key  # every weight trained


@pytest.mark.parametrize("name", ["sft-z3-lora", "dpo-z2-lora", "dpo-z3-lora"])
def test_published_trl_script_saves_the_lora_adapter_ddp_saves(published_runs: dict[str, Any], name: str) -> None:
    zero_dir = Path(_ok(published_runs, name)["output_dir"])
    ddp_dir = Path(_ok(published_runs, REFERENCES[name])["output_dir"])
    check_adapter(zero_dir, ddp_dir, published_runs["model"], rtol=1e-5)


def test_the_command_line_as_typed_runs_the_published_script(published_runs: dict[str, Any], tmp_path: Path) -> None:
    """The driver stands in for one launch per job; this job is launched exactly as a user types
    it, in a launch of its own: ``torchrun -m hf_zero.run -m trl.scripts.sft ... --use_peft
    --zero_config zero3.json`` (stage 3 with LoRA, the case that needed most of hf_zero)."""
    root, output_dir = Path(published_runs["root"]), tmp_path / "sft-z3-lora-command-line"
    run_launch(torchrun("-m", "hf_zero.run", "-m", "trl.scripts.sft",
                        *_args(published_runs["model"], str(root / "sft-data"), str(output_dir)), *LORA,
                        "--zero_config", str(root / "zero3.json")))
    state = json.loads((output_dir / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    logs = [h for h in state["log_history"] if "loss" in h]
    ddp = _ok(published_runs, "sft-ddp-lora")
    assert _close([h["loss"] for h in logs], ddp["loss"], LOSS_REL), ([h["loss"] for h in logs], ddp["loss"])
    assert _close([h["grad_norm"] for h in logs], ddp["grad_norm"], GRAD_NORM_REL)
    assert all("hf_zero/grad_norm" in h for h in logs)  # hf_zero's engine ran every step
