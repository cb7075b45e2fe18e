"""``--zero_config`` and "auto": hf_zero fills a DeepSpeed-schema config from TrainingArguments
exactly as transformers' own code does, and reports every contradiction, all at once, when the
TrainingArguments object is built (transformers waits for ``train()``). One process, no launch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hf_zero.config import HfZeroConfigError
from hf_zero.run import extract_zero_config
from tests.integration.resolution import (
    AUTO_EXAMPLE,
    EXAMPLE_ARGS,
    EXAMPLE_HIDDEN,
    EXAMPLE_STEPS,
    hf_zero_resolution,
    transformers_resolution,
)

RESEARCH_JSON = Path(__file__).resolve().parents[3] / "shared" / "research" / "hf_resolved_config_example.json"


def _args(tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    return dict(EXAMPLE_ARGS, output_dir=str(tmp_path), max_steps=EXAMPLE_STEPS, **overrides)


def _documented_differences(theirs: dict[str, Any]) -> dict[str, Any]:
    """transformers' result with the two documented differences applied: hf_zero resolves
    ``amp.enabled: "auto"`` to false (transformers leaves it and Accelerate later raises), and
    leaves ``steps_per_print`` absent (Accelerate sets Infinity to silence DeepSpeed; absent
    already means never in hf_zero)."""
    expected = json.loads(json.dumps(theirs))
    expected["amp"]["enabled"] = False
    expected.pop("steps_per_print")
    return expected


def test_research_example_resolves_as_transformers_does(tmp_path: Path) -> None:
    args = _args(tmp_path)
    ours = hf_zero_resolution(AUTO_EXAMPLE, args, EXAMPLE_HIDDEN, EXAMPLE_STEPS)
    theirs = transformers_resolution(AUTO_EXAMPLE, args, EXAMPLE_HIDDEN, EXAMPLE_STEPS)
    if "unavailable" in theirs:
        pytest.skip(theirs["unavailable"])
    theirs = theirs["config"]
    if RESEARCH_JSON.exists():  # transformers' code still gives the research file's answer
        assert theirs == json.loads(RESEARCH_JSON.read_text())
    assert ours == _documented_differences(theirs)


def test_four_mismatches_are_named_together_when_arguments_are_built(tmp_path: Path) -> None:
    from hf_zero.integrations.transformers import HfZeroTrainingArguments

    config = json.loads(json.dumps(AUTO_EXAMPLE))
    config["gradient_clipping"] = 1.0  # vs max_grad_norm=0.5
    config["optimizer"]["params"].update(lr=1e-3, betas=[0.8, 0.99], weight_decay=0.0)  # vs 3e-4, (0.9, 0.999), 0.1
    with pytest.raises(HfZeroConfigError) as raised:
        HfZeroTrainingArguments(zero_config=json.dumps(config), **_args(tmp_path))
    paths = {problem.path for problem in raised.value.problems}
    expected = {"gradient_clipping", "optimizer.params.lr", "optimizer.params.betas", "optimizer.params.weight_decay"}
    assert paths == expected
    message = str(raised.value)
    for field in ("max_grad_norm", "learning_rate", "adam_beta1+adam_beta2", "weight_decay"):
        assert field in message
    # transformers finds the same four, but only at train time.
    theirs = transformers_resolution(config, _args(tmp_path), EXAMPLE_HIDDEN, EXAMPLE_STEPS)
    if "unavailable" in theirs:
        pytest.skip(theirs["unavailable"])
    assert {line.split("=")[0].removeprefix("- ds ") for line in theirs["mismatches"]} == expected


def test_step_count_mismatch_is_reported_when_max_steps_is_known(tmp_path: Path) -> None:
    from hf_zero.integrations.transformers import HfZeroTrainingArguments

    config = json.loads(json.dumps(AUTO_EXAMPLE))
    config["scheduler"]["params"]["total_num_steps"] = 50
    with pytest.raises(HfZeroConfigError) as raised:
        HfZeroTrainingArguments(zero_config=json.dumps(config), **_args(tmp_path))
    assert [p.path for p in raised.value.problems] == ["scheduler.params.total_num_steps"]


def test_bf16_argument_adds_the_missing_precision_section(tmp_path: Path) -> None:
    """As Accelerate's DeepSpeed plugin does for ``--bf16`` with no "bf16" section."""
    from hf_zero.integrations.transformers import HfZeroTrainingArguments

    config = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2}}
    args = HfZeroTrainingArguments(zero_config=json.dumps(config), **_args(tmp_path))
    assert args.hf_zero_config.get_value("bf16.enabled") is True
    assert args.place_model_on_device is False  # the engine places the shards


def test_runner_takes_zero_config_out_of_the_script_arguments() -> None:
    assert extract_zero_config(["--a", "1", "--zero_config", "z.json", "--b"]) == ("z.json", ["--a", "1", "--b"])
    assert extract_zero_config(["--zero_config=z.json", "--a"]) == ("z.json", ["--a"])
    assert extract_zero_config(["--a"]) == (None, ["--a"])


def test_zero_config_with_deepspeed_fails_before_transformers_touches_deepspeed(tmp_path: Path) -> None:
    from transformers.integrations import deepspeed as transformers_deepspeed

    from hf_zero.integrations.transformers import HfZeroTrainingArguments

    with pytest.raises(ValueError, match="--deepspeed"):
        HfZeroTrainingArguments(zero_config=json.dumps(AUTO_EXAMPLE), deepspeed=json.dumps(AUTO_EXAMPLE),
                                **_args(tmp_path))
    assert transformers_deepspeed._hf_deepspeed_config_weak_ref is None


def test_trainer_built_optimizer_sets_zero_allow_untested_optimizer(tmp_path: Path) -> None:
    """As transformers does for DeepSpeed: with no "optimizer" section the Trainer builds the
    optimizer, so an element-wise optimizer hf_zero does not know (``--optim`` choices from other
    packages) runs with a warning; shape-aware ones are still refused ([Note: element-wise
    optimizers])."""
    from hf_zero.integrations.transformers import HfZeroTrainingArguments

    without = {k: v for k, v in AUTO_EXAMPLE.items() if k not in ("optimizer", "scheduler")}
    args = HfZeroTrainingArguments(zero_config=json.dumps(without), **_args(tmp_path))
    assert args.hf_zero_config.zero_allow_untested_optimizer is True
    args = HfZeroTrainingArguments(zero_config=json.dumps(AUTO_EXAMPLE), **_args(tmp_path))
    assert args.hf_zero_config.zero_allow_untested_optimizer is False
