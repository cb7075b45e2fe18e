"""``hf-zero check-config`` on configs a user would want stopped or warned about: each is an
error (exit 1) or a warning (exit 0) naming the key, what is wrong and the fix."""

from __future__ import annotations

import json

import pytest

from hf_zero.cli import main

BASE = {"train_micro_batch_size_per_gpu": 1}


def _zero(stage: int = 3, **keys: object) -> dict:
    return {**BASE, "zero_optimization": {"stage": stage, **keys}}


def _nvme(path: str) -> dict:
    return _zero(offload_optimizer={"device": "nvme", "nvme_path": path})


ERRORS = {
    "reduce_bucket_size_1e30": (_zero(reduce_bucket_size=1e30), "zero_optimization.reduce_bucket_size"),
    "allgather_bucket_size_1e30": (_zero(2, allgather_bucket_size=1e30), "zero_optimization.allgather_bucket_size"),
    "initial_scale_power_4000": ({**BASE, "fp16": {"enabled": True, "initial_scale_power": 4000}}, "fp16.initial_scale_power"),
    "sub_group_size_0": (_zero(sub_group_size=0), "zero_optimization.sub_group_size"),
    "buffer_count_0": (_zero(offload_optimizer={"device": "cpu", "buffer_count": 0}),
                       "zero_optimization.offload_optimizer.buffer_count"),
    "min_loss_scale_above_initial": ({**BASE, "fp16": {"enabled": True, "initial_scale_power": 4, "min_loss_scale": 1024}},
                                     "fp16.min_loss_scale"),
    "null": (None, "the config is null"),
}
WARNINGS = {
    "reduce_bucket_size_0": (_zero(reduce_bucket_size=0), "zero_optimization.reduce_bucket_size = 0"),
    "stage3_max_live_parameters_0": (_zero(stage3_max_live_parameters=0), "zero_optimization.stage3_max_live_parameters = 0"),
    "total_below_warmup": ({**BASE, "scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_num_steps": 100, "total_num_steps": 10}}}, "scheduler.params.total_num_steps = 10"),
}


def _check(tmp_path, config: object, capsys) -> tuple[int, str]:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    code = main(["check-config", str(path)])
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.mark.parametrize("name", list(ERRORS))
def test_a_bad_value_is_an_error_naming_the_key_and_the_fix(tmp_path, capsys, name):
    config, key = ERRORS[name]
    code, said = _check(tmp_path, config, capsys)
    assert code == 1 and key in said and "Fix:" in said, said


@pytest.mark.parametrize("name", list(WARNINGS))
def test_a_doubtful_value_is_a_warning_naming_the_key_and_the_fix(tmp_path, capsys, name):
    config, key = WARNINGS[name]
    code, said = _check(tmp_path, config, capsys)
    assert code == 0 and f"warning: {key}" in said and "Fix:" in said and "1 warning above" in said, said


def test_nvme_path_a_file_or_missing_is_a_warning(tmp_path, capsys):
    """Warnings, not errors: check-config may run on another machine than training (which
    raises FileNotFoundError at initialize)."""
    a_file = tmp_path / "not_a_dir"
    a_file.write_text("")
    code, said = _check(tmp_path, _nvme(str(a_file)), capsys)
    assert code == 0 and "warning: zero_optimization.offload_optimizer.nvme_path" in said and "is a file" in said
    code, said = _check(tmp_path, _nvme(str(tmp_path / "missing")), capsys)
    assert code == 0 and "does not exist on this machine" in said


def test_an_ordinary_config_has_no_warning(tmp_path, capsys):
    code, said = _check(tmp_path, _zero(offload_optimizer={"device": "nvme", "nvme_path": str(tmp_path)}), capsys)
    assert code == 0 and "warning" not in said, said
