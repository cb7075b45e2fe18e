"""Configs with comments and trailing commas load, as DeepSpeed loads them (it reads every config
with ``hjson``): the same dict as the strict JSON, the same checks, and one problem naming the
file and line when the text is neither JSON nor hjson."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hf_zero.cli import main
from hf_zero.config import HfZeroConfig, HfZeroConfigError

REPO = Path(__file__).resolve().parents[2]

# recipes/zero3.json as a DeepSpeed user writes it: every comment style hjson reads, trailing
# commas in objects and lists, an unquoted key.
COMMENTED_ZERO3 = """{
  // batch sizes come from the Trainer
  "train_micro_batch_size_per_gpu": "auto",
  "gradient_accumulation_steps": "auto",   # hash comments too
  "train_batch_size": "auto",
  "gradient_clipping": "auto",
  /* precision follows --bf16 / --fp16 */
  "bf16": {"enabled": "auto",},
  "fp16": {"enabled": "auto",},
  zero_optimization: {
    "stage": 3,
    "overlap_comm": true,
    "contiguous_gradients": true,
    "reduce_bucket_size": "auto",
    "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto",
    "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9,
    "stage3_gather_16bit_weights_on_model_save": false,
  },
}
"""


def _write(tmp_path: Path, text: str, name: str = "ds_config.json") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_commented_config_with_trailing_commas_is_the_strict_one(tmp_path: Path) -> None:
    strict = json.loads((REPO / "recipes" / "zero3.json").read_text())
    config = HfZeroConfig.checked(_write(tmp_path, COMMENTED_ZERO3))
    assert config.to_dict() == HfZeroConfig.checked(strict).to_dict()
    assert config.stage == 3 and config.auto_keys()


def test_hjson_config_is_checked_like_any_other(tmp_path: Path) -> None:
    text = '{\n  // a typo must still be caught\n  "zero_optimization": {"stage": 3, "overlap_com": true,},\n}'
    with pytest.raises(HfZeroConfigError, match="overlap_com") as info:
        HfZeroConfig.checked(_write(tmp_path, text))
    assert [p.path for p in info.value.problems] == ["zero_optimization.overlap_com"]


def test_duplicate_keys_in_hjson_are_problems(tmp_path: Path) -> None:
    text = '{\n  # stage twice\n  "zero_optimization": {"stage": 1, "stage": 2,},\n}'
    with pytest.raises(HfZeroConfigError) as info:
        HfZeroConfig.checked(_write(tmp_path, text))
    assert info.value.problems[0].path == "zero_optimization.stage"


def test_strict_json_is_read_as_json_first(tmp_path: Path) -> None:
    # hjson would read the unquoted Infinity (as transformers writes it) as the start of a
    # quoteless string running to the end of the line.
    config = HfZeroConfig.checked(_write(tmp_path, '{"steps_per_print": Infinity, "zero_optimization": {"stage": 1}}'))
    assert config.to_dict()["zero_optimization"]["stage"] == 1


def test_text_neither_json_nor_hjson_names_the_file_and_line(tmp_path: Path) -> None:
    path = _write(tmp_path, '{\n  "zero_optimization": {"stage": 2,,},\n}', "broken.json")
    with pytest.raises(HfZeroConfigError) as info:
        HfZeroConfig(path)
    (problem,) = info.value.problems
    assert problem.path == str(path)
    assert re.search(r"not valid JSON: .* line 2 column 36 \(nor hjson, .* line 2 column 36\)", problem.rule), problem.rule


def test_check_config_accepts_a_commented_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, COMMENTED_ZERO3)
    assert main(["check-config", str(path)]) == 0
    assert f"{path}: valid" in capsys.readouterr().out


def test_hjson_is_a_dependency() -> None:
    pyproject = (REPO / "pyproject.toml").read_text()
    dependencies = pyproject.split("dependencies = [", 1)[1].split("]", 1)[0]
    assert re.search(r'"hjson[>=<~ ]', dependencies), "hjson must be a runtime dependency (configs are read with it)"
