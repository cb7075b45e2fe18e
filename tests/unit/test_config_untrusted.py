"""Configs as untrusted input (issue 28): a corpus of hostile or silently wrong configs.

Each case is refused with one HfZeroConfigError (never a RecursionError, UnicodeDecodeError or a
traceback), whose message names the source and the problem, holds one line per problem and stays
short however large the input. The silently wrong configs DeepSpeed accepts are errors or, where
tools generate them, warnings.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hf_zero.cli import main
from hf_zero.config import HfZeroConfig, HfZeroConfigError
from hf_zero.config.loading import MAX_DEPTH
from hf_zero.config.validate import config_warnings

# A message repeats at most 200 characters of any value; with the rule and the fix a problem line
# stays well under this.
MAX_LINE_CHARS = 1500
DEEP = 100_000  # the depth of the adversarial run's configs


def _nested(levels: int, leaf: Any = 1) -> Any:
    """`levels` dicts inside one another ({"x": {"x": ... leaf}}), built without recursion."""
    value = leaf
    for _ in range(levels):
        value = {"x": value}
    return value


def _in_opaque(levels: int) -> dict[str, Any]:
    """A config `levels` deep in total: the root, then tensor_parallel (passed through unread while
    every size is <= 1), then dicts down to the leaf."""
    return {"tensor_parallel": _nested(levels - 1)}


def _refused(config: Any) -> HfZeroConfigError:
    """The one error, checked for shape: a header naming the source, one bounded line per problem."""
    with pytest.raises(HfZeroConfigError) as info:
        HfZeroConfig(config)
    error = info.value
    lines = str(error).split("\n")
    assert lines[0].startswith(f"hf_zero config {error.source} has ")
    assert len(lines) == 1 + len(error.problems)
    for line, problem in zip(lines[1:], error.problems):
        assert line == f"  - {problem}" and len(line) < MAX_LINE_CHARS, line[:300]
    return error


def _write(tmp_path: Path, data: bytes | str) -> Path:
    path = tmp_path / "ds_config.json"
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


# ---- depth -----------------------------------------------------------------------------------

TOO_DEEP = f"nests more than {MAX_DEPTH} levels deep"


def _deep_json(levels: int) -> str:
    return '{"tensor_parallel": ' + '{"x": ' * (levels - 1) + "1" + "}" * levels


@pytest.mark.parametrize("levels", [MAX_DEPTH + 1, 500, DEEP])
def test_deep_json_file_is_one_error_naming_the_file(tmp_path: Path, levels: int) -> None:
    path = _write(tmp_path, _deep_json(levels))
    error = _refused(str(path))
    (problem,) = error.problems
    assert TOO_DEEP in problem.rule and error.source == str(path)


def test_deep_inline_json_is_one_error() -> None:
    (problem,) = _refused(_deep_json(DEEP)).problems
    assert TOO_DEEP in problem.rule


@pytest.mark.parametrize("levels", [MAX_DEPTH + 1, DEEP])
def test_deep_dict_gets_the_same_check(levels: int) -> None:
    (problem,) = _refused(_in_opaque(levels)).problems
    assert TOO_DEEP in problem.rule and problem.path.startswith("tensor_parallel.x.x")


def test_deep_list_is_counted_too() -> None:
    deep_list: Any = 1
    for _ in range(MAX_DEPTH):
        deep_list = [deep_list]
    (problem,) = _refused({"tensor_parallel": {"x": deep_list}}).problems
    assert TOO_DEEP in problem.rule and problem.path.startswith("tensor_parallel.x[0][0]")


def test_dict_that_contains_itself_is_too_deep_not_a_recursion_error() -> None:
    loop: dict[str, Any] = {}
    loop["x"] = loop
    (problem,) = _refused({"tensor_parallel": loop}).problems
    assert TOO_DEEP in problem.rule


def test_exactly_the_bound_loads() -> None:
    assert json.dumps(_in_opaque(MAX_DEPTH)) == _deep_json(MAX_DEPTH)
    HfZeroConfig(_in_opaque(MAX_DEPTH))
    HfZeroConfig(_deep_json(MAX_DEPTH))


# ---- encoding and JSON the parser cannot take -------------------------------------------------


def test_non_utf8_file_names_the_byte_and_its_offset(tmp_path: Path) -> None:
    data = b'{"train_batch_size": 8,\n "wall_clock_breakdown": "\xff"}'
    path = _write(tmp_path, data)
    (problem,) = _refused(path).problems
    offset = data.index(b"\xff")
    assert problem.path == str(path)
    assert problem.rule == f"is not UTF-8 text: byte 0xff at byte offset {offset} (line 2)"


def test_latin1_file_is_refused_at_its_first_bad_byte(tmp_path: Path) -> None:
    data = '{"wandb": {"project": "caf\u00e9", "team": "na\u00efve"}}'.encode("latin-1")
    (problem,) = _refused(_write(tmp_path, data)).problems
    assert f"is not UTF-8 text: byte 0xe9 at byte offset {data.index(0xE9)} (line 1)" in problem.rule


def test_integer_too_long_for_python_is_one_error() -> None:
    (problem,) = _refused('{"train_batch_size": 1' + "0" * 5000 + "}").problems
    assert "cannot be read as JSON" in problem.rule


# ---- size: values and keys echoed in bounded form ----------------------------------------------

HUGE = 1_000_000  # the adversarial run used 100 MB; the bound is the same, the test is faster


@pytest.mark.parametrize(
    ("config", "phrase"),
    [
        ({"train_batch_size": "9" * HUGE}, f"... ({HUGE} characters)"),  # a value of the wrong type
        ({"zero_optimization": {"offload_optimizer": {"device": "cpu\n" * (HUGE // 4)}}}, f"({HUGE} characters)"),
        ({"x" * HUGE: 1}, f"... ({HUGE} characters) = 1: unknown top-level key"),  # an unknown key
        ({"wandb": {"enabled": False, "project": ["p"] * HUGE}}, "characters): must be a string"),  # a long list
    ],
    ids=["value", "value_with_newlines", "key", "list"],
)
def test_huge_values_and_keys_are_cut_with_their_length(config: dict[str, Any], phrase: str) -> None:
    error = _refused(config)
    assert phrase in str(error) and len(str(error)) < 2 * MAX_LINE_CHARS


def test_control_characters_in_a_key_stay_on_one_line() -> None:
    (problem,) = _refused({"stage\n  - zero_optimization.stage = 3: looks like another problem\r": 1}).problems
    assert "unknown top-level key" in problem.rule and "stage\\n  - zero" in str(problem)


def test_huge_value_in_a_file_is_cut_too(tmp_path: Path) -> None:
    path = _write(tmp_path, json.dumps({"steps_per_print": "x" * HUGE}))
    error = _refused(path)
    assert f"({HUGE} characters)" in str(error) and len(str(error)) < 2 * MAX_LINE_CHARS
    assert error.problems[0].value == "x" * HUGE  # the problem keeps the value; only the message is cut


def test_huge_value_quoted_in_a_rule_is_cut() -> None:
    # The partial-offload rule quotes the device it found.
    config = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "d" * HUGE, "ratio": 0.5}}}
    error = _refused(config)
    assert len(error.problems) == 2 and len(str(error)) < 3 * MAX_LINE_CHARS


# ---- hf-zero check-config: the same error, never a traceback -----------------------------------


@pytest.mark.parametrize(
    ("data", "phrase"),
    [
        (_deep_json(DEEP).encode(), TOO_DEEP),
        (b'{"train_batch_size": "\xfe"}', "is not UTF-8 text: byte 0xfe at byte offset 22"),
        (json.dumps({"steps_per_print": "x" * HUGE}).encode(), f"({HUGE} characters)"),
    ],
    ids=["deep", "non_utf8", "huge"],
)
def test_check_config_prints_one_line_per_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  data: bytes, phrase: str) -> None:
    path = _write(tmp_path, data)
    assert main(["check-config", str(path)]) == 1
    said = capsys.readouterr().err
    assert said.splitlines()[0] == f"hf_zero config {path} has 1 problem:"
    assert len(said.splitlines()) == 2 and phrase in said and len(said) < MAX_LINE_CHARS
    assert "Traceback" not in said


# ---- configs DeepSpeed accepts silently --------------------------------------------------------

WARMUP_BACKWARDS = "the warmup would lower the learning rate"
NULL_SECTION = "null is not the same as leaving the key out"
MICRO, GAS = "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"
MAX_LR = "scheduler.params.warmup_max_lr"


def _sched(kind: str, **params: Any) -> dict[str, Any]:
    return {"scheduler": {"type": kind, "params": params}}


SILENT = {
    # name: (config, path of the problem, phrase of its rule)
    "micro_batch_1e18": ({MICRO: 1e18}, MICRO, "at most 2**31"),
    "micro_batch_2**31+1": ({MICRO: 2**31 + 1}, MICRO, "at most 2**31"),
    "grad_accum_1e18": ({MICRO: 1, GAS: 1e18}, GAS, "at most 2**31"),
    "train_batch_1e18": ({"train_batch_size": 1e18}, "train_batch_size", "at most 2**31"),
    "warmup_lr": (_sched("WarmupLR", warmup_min_lr=1e-3, warmup_max_lr=1e-5), MAX_LR, WARMUP_BACKWARDS),
    "warmup_decay_lr": (_sched("WarmupDecayLR", warmup_min_lr=1e-3, warmup_max_lr=1e-5, total_num_steps=100),
                        MAX_LR, WARMUP_BACKWARDS),
    "warmup_max_lr_default": (_sched("WarmupLR", warmup_min_lr=0.01), MAX_LR, "DeepSpeed's default 0.001"),
    "warmup_per_group": (_sched("WarmupLR", warmup_min_lr=[0.0, 1e-3], warmup_max_lr=[1e-3, 1e-4]),
                         MAX_LR, WARMUP_BACKWARDS),
    "warmup_cosine_ratio": (_sched("WarmupCosineLR", warmup_min_ratio=2.0, total_num_steps=100),
                            "scheduler.params.warmup_min_ratio", "lower it"),
    "optimizer_null": ({"optimizer": None}, "optimizer", NULL_SECTION),
    "scheduler_null": ({"scheduler": None}, "scheduler", NULL_SECTION),
}


@pytest.mark.parametrize("name", list(SILENT))
def test_silently_wrong_config_is_an_error(name: str) -> None:
    config, path, phrase = SILENT[name]
    (problem,) = _refused(config).problems
    assert problem.path == path and phrase in problem.rule and problem.fix


@pytest.mark.parametrize(
    "config",
    [
        {MICRO: 2**31},
        {MICRO: "auto"},
        _sched("WarmupLR", warmup_min_lr=1e-3, warmup_max_lr=1e-3),  # a constant learning rate
        _sched("WarmupLR", warmup_min_lr="auto", warmup_max_lr="auto"),
        _sched("WarmupLR", warmup_min_lr=0, warmup_max_lr=[1e-3, 1e-4]),
        _sched("WarmupCosineLR", warmup_min_ratio=1.0, total_num_steps=10),
        {},  # no optimizer / scheduler key: the Trainer's (or the caller's) are used
    ],
    ids=["micro_2**31", "micro_auto", "warmup_constant", "warmup_auto", "warmup_broadcast", "cosine_ratio_1", "absent"],
)
def test_the_limits_themselves_are_accepted(config: dict[str, Any]) -> None:
    HfZeroConfig(config)


def test_absent_optimizer_and_scheduler_mean_none() -> None:
    built = HfZeroConfig({})
    assert built.optimizer is None and built.scheduler is None


def test_warmup_max_lr_still_auto_is_checked_once_resolved() -> None:
    config = HfZeroConfig(_sched("WarmupLR", warmup_min_lr=1e-3, warmup_max_lr="auto"))
    with pytest.raises(HfZeroConfigError, match=WARMUP_BACKWARDS):
        config.resolve(warmup_max_lr=1e-5)


def test_all_silent_problems_are_listed_in_one_error() -> None:
    config: dict[str, Any] = {MICRO: 1e18, "optimizer": None}
    config["scheduler"] = SILENT["warmup_lr"][0]["scheduler"]
    config["train_batch_size"] = "7" * HUGE
    paths = [problem.path for problem in _refused(config).problems]
    assert sorted(paths) == sorted([MICRO, "optimizer", MAX_LR, "train_batch_size"])


# ---- stage3_* keys below stage 3: warnings, because tools write them -----------------------------

STAGE3_NO_EFFECT = "has no effect at ZeRO stage"


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_stage3_keys_below_stage_3_are_warnings(stage: int) -> None:
    zero = {"stage": stage, "stage3_max_live_parameters": 5e8, "max_reuse_distance": 5e8}  # an alias too
    warnings = config_warnings(HfZeroConfig({"zero_optimization": zero}).to_dict())
    assert len(warnings) == 2 and all(STAGE3_NO_EFFECT + f" {stage}" in w and "Fix:" in w for w in warnings)
    assert {w.split(" = ")[0] for w in warnings} == {
        "zero_optimization.stage3_max_live_parameters", "zero_optimization.stage3_max_reuse_distance"}


@pytest.mark.parametrize(
    "zero",
    [
        # Accelerate's DeepSpeedPlugin writes this key at every stage (its zero3_save_16bit_model).
        {"stage": 2, "stage3_gather_16bit_weights_on_model_save": False},
        {"stage": 2, "stage3_gather_16bit_weights_on_model_save": "auto"},
        {"stage": 1, "stage3_prefetch_bucket_size": "auto"},  # filled by the tools, not chosen
        {"stage": 3, "stage3_max_live_parameters": 5e8},
    ],
    ids=["accelerate_default", "accelerate_auto", "auto", "stage_3"],
)
def test_stage3_keys_that_are_not_reported(zero: dict[str, Any]) -> None:
    warnings = config_warnings(HfZeroConfig({"zero_optimization": zero}).to_dict())
    assert not [w for w in warnings if STAGE3_NO_EFFECT in w]


def test_check_config_shows_the_stage3_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, json.dumps({"zero_optimization": {"stage": 1, "stage3_param_persistence_threshold": 0}}))
    assert main(["check-config", str(path)]) == 0
    said = capsys.readouterr().err
    assert "warning: zero_optimization.stage3_param_persistence_threshold = 0 has no effect at ZeRO stage 1" in said


# Issue 46: files that are not configs, and bounds on the work before any rule is checked.

def _one_refusal(config: Any) -> str:
    error = _refused(config)
    assert len(error.problems) == 1, error
    return str(error)


def test_an_empty_file_is_an_error_not_a_valid_config(tmp_path: Path) -> None:
    for text in ("", "  \n\t\n"):
        (tmp_path / "empty.json").write_text(text)
        assert "is empty" in _one_refusal(str(tmp_path / "empty.json"))
    (tmp_path / "empty.json").write_text("{}")
    assert HfZeroConfig(str(tmp_path / "empty.json")).to_dict() == {}  # DeepSpeed's defaults, said so


def test_a_fifo_or_a_device_is_refused_without_reading_it(tmp_path: Path) -> None:
    import os
    import time

    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)  # no writer: an open that waits for one never returns
    started = time.monotonic()
    assert "is not a regular file" in _one_refusal(str(fifo))
    assert "is not a regular file" in _one_refusal("/dev/zero")  # read whole, it would fill the memory
    assert time.monotonic() - started < 5


def test_a_file_past_the_size_bound_is_refused_unread(tmp_path: Path) -> None:
    from hf_zero.config.loading import MAX_CONFIG_BYTES

    big = tmp_path / "big.json"
    big.write_text('{"train_batch_size": 8, "pad": "' + "x" * MAX_CONFIG_BYTES + '"}')
    assert f"larger than {MAX_CONFIG_BYTES >> 20} MiB" in _one_refusal(str(big))


def test_too_many_keys_is_one_error_before_any_suggestion_search() -> None:
    import time

    from hf_zero.config.loading import MAX_KEYS

    started = time.monotonic()
    message = _one_refusal({f"unknown_key_{i}": i for i in range(300_000)})
    assert f"more than {MAX_KEYS}" in message and time.monotonic() - started < 10
    HfZeroConfig({"zero_optimization": {"stage": 2}, "tensor_parallel": {f"k{i}": 1 for i in range(MAX_KEYS - 3)}})


def test_a_shard_group_larger_than_the_world_is_an_error() -> None:
    config = HfZeroConfig({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "mics_shard_size": 4}})
    with pytest.raises(HfZeroConfigError, match="mics_shard_size = 4: is larger than the world size 1"):
        config.resolve(world_size=1)
    assert config.resolve(world_size=8).zero.mics_shard_size == 4
