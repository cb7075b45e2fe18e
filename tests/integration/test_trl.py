"""TRL's SFTTrainer and DPOTrainer, and PEFT LoRA through SFTTrainer, run unmodified on hf_zero.

One 2-process torchrun launch (trl_driver.py) runs each ordinary TRL script under plain DDP and
through ``hf_zero.run --zero_config``: recipes/examples/train_trl_sft.py (SFT, and LoRA with
``--lora_r``) and trl_dpo_script.py (DPO, whose reference model DPOTrainer builds itself and
prepares with ``accelerator.prepare_model(ref, evaluation_mode=True)``: an inference-only ZeRO-3
engine). Tiny Llama, a word-level tokenizer built here, 4 optimizer steps of accumulation 2.
``GRPOTrainer`` generates with the training model every step (trl_grpo_script.py).
``--bf16 false`` on both sides: TRL turns bf16 on by default, which under DDP is autocast over
fp32 weights and under hf_zero (as under DeepSpeed) bf16 weights with fp32 masters."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.conftest import REPO, merge_rank_results, run_launch, torchrun, write_config
from tests.tiny_models import VOCAB

SFT = str(REPO / "recipes" / "examples" / "train_trl_sft.py")
DPO = str(Path(__file__).with_name("trl_dpo_script.py"))
GRPO = str(Path(__file__).with_name("trl_grpo_script.py"))
STEPS = 4


def save_tiny_tokenizer(folder: str) -> None:
    """A word-level tokenizer over the tiny models' vocabulary: w0 ... w92 and four specials."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"w{i}" for i in range(VOCAB - 4)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                            unk_token="<unk>").save_pretrained(folder)


def write_data(root: Path) -> tuple[str, str, str]:
    rng = random.Random(0)
    words = lambda n: " ".join(f"w{rng.randrange(VOCAB - 4)}" for _ in range(n))  # noqa: E731
    sft, dpo = root / "sft.jsonl", root / "dpo.jsonl"
    sft.write_text("".join(json.dumps({"text": words(rng.randrange(5, 11))}) + "\n" for _ in range(32)))
    dpo.write_text("".join(json.dumps({"prompt": words(4), "chosen": words(rng.randrange(2, 6)),
                                       "rejected": words(rng.randrange(2, 6))}) + "\n" for _ in range(32)))
    grpo = root / "grpo.jsonl"
    grpo.write_text("".join(json.dumps({"prompt": words(4)}) + "\n" for _ in range(16)))
    return str(sft), str(dpo), str(grpo)


@pytest.fixture(scope="module")
def trl_runs(model_dirs: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("trl_runs")
    model = model_dirs["llama"]
    save_tiny_tokenizer(model)
    sft_data, dpo_data, grpo_data = write_data(root)
    common = ["--model_name_or_path", model, "--use_cpu", "--report_to", "none", "--max_steps", str(STEPS),
              "--logging_steps", "1", "--learning_rate", "5e-3", "--save_strategy", "steps", "--save_steps", str(STEPS),
              "--seed", "0", "--disable_tqdm", "true", "--bf16", "false"]
    batches = ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--max_length", "16"]
    # GRPO: 4 completions of up to 6 tokens per prompt, generated every step
    grpo = ["--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "6"]
    configs = {stage: write_config(root / f"zero{stage}.json", stage) for stage in (2, 3)}

    def job(name: str, script: str, data: str, stage: int | None, *extra: str) -> dict[str, Any]:
        argv = [*common, *(grpo if script == GRPO else batches), "--dataset_file", data, "--output_dir", str(root / name),
                *extra]
        return {"name": name, "script": script, "argv": argv, **({"zero_config": configs[stage]} if stage else {})}

    memory = lambda name: ("--memory_report", str(root / f"{name}-memory.json"))  # noqa: E731
    jobs = [job("sft-ddp", SFT, sft_data, None), job("dpo-ddp", DPO, dpo_data, None, *memory("dpo-ddp")),
            job("lora-ddp", SFT, sft_data, None, "--lora_r", "4"),
            job("sft-z3", SFT, sft_data, 3),
            job("dpo-z3", DPO, dpo_data, 3, *memory("dpo-z3")), job("lora-z2", SFT, sft_data, 2, "--lora_r", "4"),
            job("lora-z3", SFT, sft_data, 3, "--lora_r", "4"),
            job("grpo-ddp", GRPO, grpo_data, None), job("grpo-z3", GRPO, grpo_data, 3),
            job("grpo-z2", GRPO, grpo_data, 2)]
    plan = {"jobs": jobs, "out": str(root / "results.json")}
    (root / "plan.json").write_text(json.dumps(plan))
    run_launch(torchrun("-m", "tests.integration.trl_driver", str(root / "plan.json")))
    results = merge_rank_results(plan["out"], 2)
    results["root"] = str(root)
    return results


def _ok(runs: dict[str, Any], name: str) -> dict[str, Any]:
    assert "error" not in runs[name], runs[name].get("error")
    return runs[name]


def _close(got: list[float], expected: list[float], rel: float = 1e-5) -> bool:
    return len(got) == len(expected) and all(math.isclose(a, b, rel_tol=rel) for a, b in zip(got, expected))


# SFT and DPO at stage 2 run as TRL publishes them in test_trl_published_scripts.py.
@pytest.mark.parametrize("name", ["sft-z3", "dpo-z3", "lora-z2", "lora-z3", "grpo-z3", "grpo-z2"])
def test_trl_loss_curves_equal_ddp(trl_runs: dict[str, Any], name: str) -> None:
    zero, ddp = _ok(trl_runs, name), _ok(trl_runs, name.split("-")[0] + "-ddp")
    assert len(ddp["loss"]) == STEPS
    assert _close(zero["loss"], ddp["loss"]), (zero["loss"], ddp["loss"])
    assert _close(zero["grad_norm"], ddp["grad_norm"], rel=1e-4), (zero["grad_norm"], ddp["grad_norm"])
    assert zero["learning_rate"] == ddp["learning_rate"]


def test_dpo_reference_model_is_a_sharded_inference_engine(trl_runs: dict[str, Any], model_dirs: dict[str, str]) -> None:
    from safetensors.torch import load_file

    _ok(trl_runs, "dpo-z3")
    full_bytes = sum(t.numel() * 4 for t in load_file(Path(model_dirs["llama"]) / "model.safetensors").values())
    ddp = json.loads((Path(trl_runs["root"]) / "dpo-ddp-memory.json").read_text())
    zero = json.loads((Path(trl_runs["root"]) / "dpo-z3-memory.json").read_text())
    assert [r["reference"]["compute_params"] for r in ddp] == [full_bytes, full_bytes]  # replicated under DDP
    for rank in zero:
        reference = rank["reference"]
        assert reference["engine"] and reference["gradients"] == 0 and reference["optimizer_state"] == 0
        # sharded as the policy is: half of each sharded tensor (and the small persistent ones whole)
        assert reference["compute_params"] == rank["policy"]["compute_params"] < 0.6 * full_bytes
        assert rank["policy"]["engine"] and rank["policy"]["optimizer_state"] > 0


def check_adapter(zero_dir: Path, ddp_dir: Path, base_model_dir: str, rtol: float) -> None:
    """The adapter saved under hf_zero equals DDP's (at stage 3 too: the values PEFT drew on the
    sharded base are kept, [Note: adapters on a lazily loaded base] in
    hf_zero.integrations.zero3_loading), trained, and ``PeftModel.from_pretrained`` loads it onto
    the plain base model and changes its outputs."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    zero, ddp = load_file(zero_dir / "adapter_model.safetensors"), load_file(ddp_dir / "adapter_model.safetensors")
    assert set(zero) == set(ddp) and any("lora_B" in k for k in ddp)
    for key, tensor in ddp.items():
        torch.testing.assert_close(zero[key], tensor, rtol=rtol, atol=1e-6, msg=key)
    assert max(t.abs().max().item() for k, t in zero.items() if "lora_B" in k) > 1e-3  # lora_B starts at zero
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_model_dir), zero_dir)
    ids = torch.arange(4, 14).unsqueeze(0)
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        with model.disable_adapter():
            base = model(input_ids=ids).logits
    assert (adapted - base).abs().max() > 1e-4


@pytest.mark.parametrize("name", ["lora-z2", "lora-z3"])
def test_lora_adapter_saved_under_zero_loads_and_equals_ddp(trl_runs: dict[str, Any], model_dirs: dict[str, str],
                                                            name: str) -> None:
    zero_dir, ddp_dir = Path(_ok(trl_runs, name)["output_dir"]), Path(_ok(trl_runs, "lora-ddp")["output_dir"])
    check_adapter(zero_dir, ddp_dir, model_dirs["llama"], rtol=1e-4)
