"""HfZeroPlugin's fields and HF_ZERO_* environment defaults, and `hf-zero launch`'s handling of
the yaml (no process group, no launch: the launches are in test_accelerate.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from hf_zero.cli import _hf_zero_section_env, _split_launch_argv, main
from hf_zero.config import HfZeroConfigError
from hf_zero.integrations.accelerate import HfZeroPlugin, plugin_from_env

REPO = Path(__file__).resolve().parents[2]
ZERO2 = str(REPO / "recipes" / "zero2.json")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("HF_ZERO_"):
            monkeypatch.delenv(name)


def test_fields_default_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ZERO_CONFIG_FILE", ZERO2)
    monkeypatch.setenv("HF_ZERO_GRADIENT_CLIPPING", "0.25")
    monkeypatch.setenv("HF_ZERO_OFFLOAD_OPTIMIZER_DEVICE", "cpu")
    plugin = plugin_from_env()
    assert plugin is not None and plugin.config == ZERO2
    config = plugin.hf_zero_config
    assert config.stage == 2
    assert config.get_value("gradient_clipping") == 0.25
    assert config.zero.offload_optimizer.device == "cpu"


def test_explicit_arguments_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ZERO_GRADIENT_CLIPPING", "0.25")
    monkeypatch.setenv("HF_ZERO_STAGE", "1")
    plugin = HfZeroPlugin(zero_stage=3, gradient_clipping=2.0)
    assert plugin.hf_zero_config.stage == 3
    assert plugin.hf_zero_config.get_value("gradient_clipping") == 2.0


def test_no_config_gives_deepspeed_plugins_defaults() -> None:
    assert plugin_from_env() is None
    config = HfZeroPlugin().hf_zero_config
    assert config.stage == 2
    assert "train_micro_batch_size_per_gpu" in config.auto_keys()


def test_a_field_contradicting_the_config_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "z.json"
    path.write_text(json.dumps({"gradient_clipping": 1.0, "zero_optimization": {"stage": 2}}))
    with pytest.raises(HfZeroConfigError) as info:
        HfZeroPlugin(config=str(path), zero_stage=3, gradient_clipping=0.5)
    paths = [p.path for p in info.value.problems]
    assert paths == ["zero_optimization.stage", "gradient_clipping"]
    assert "HF_ZERO_STAGE" in str(info.value)
    # agreeing with the file, or filling an "auto", is fine
    assert HfZeroPlugin(config=str(path), zero_stage=2).hf_zero_config.stage == 2
    assert HfZeroPlugin(config=ZERO2, gradient_clipping=0.5).hf_zero_config.get_value("gradient_clipping") == 0.5


def test_a_bad_environment_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ZERO_STAGE", "three")
    with pytest.raises(ValueError, match="HF_ZERO_ZERO_STAGE|HF_ZERO_STAGE"):
        HfZeroPlugin()


def test_launch_takes_only_its_own_options_before_the_script() -> None:
    argv = ["--config_file", "a.yaml", "--num_processes", "2", "--zero_config=z.json",
            "train.py", "--config_file", "script.yaml", "--zero_config", "mine"]
    options, rest = _split_launch_argv(argv)
    assert options == {"config_file": "a.yaml", "zero_config": "z.json"}
    assert rest == ["--num_processes", "2", "train.py", "--config_file", "script.yaml", "--zero_config", "mine"]
    options, rest = _split_launch_argv(["--config_file", "a.yaml", "-m", "pkg.mod", "--config_file", "x"])
    assert options == {"config_file": "a.yaml"} and rest == ["-m", "pkg.mod", "--config_file", "x"]


def test_the_recipe_yaml_section_becomes_environment_variables() -> None:
    path = REPO / "recipes" / "accelerate" / "zero3_2proc.yaml"
    cluster = yaml.safe_load(path.read_text())
    env = _hf_zero_section_env(cluster.pop("hf_zero"), str(path))
    assert env == {"HF_ZERO_CONFIG": str(REPO / "recipes" / "accelerate" / "../zero3.json")}
    assert Path(env["HF_ZERO_CONFIG"]).resolve() == REPO / "recipes" / "zero3.json"
    more = _hf_zero_section_env({"zero_stage": 3, "zero3_save_16bit_model": True}, str(path))
    assert more == {"HF_ZERO_STAGE": "3", "HF_ZERO_ZERO3_SAVE_16BIT_MODEL": "true"}
    with pytest.raises(SystemExit, match="unknown hf_zero key"):
        _hf_zero_section_env({"stage": 3}, str(path))


def test_the_plain_accelerate_yaml_rejects_the_section_so_launch_strips_it() -> None:
    from accelerate.commands.config.config_args import ClusterConfig

    path = REPO / "recipes" / "accelerate" / "zero3_2proc.yaml"
    with pytest.raises(ValueError):
        ClusterConfig.from_yaml_file(str(path))
    for plain in (REPO / "recipes" / "accelerate").glob("multi_*.yaml"):
        ClusterConfig.from_yaml_file(str(plain))


def test_launch_without_any_config_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "--num_processes", "2", "train.py"]) == 2
    assert "no ZeRO config" in capsys.readouterr().err
