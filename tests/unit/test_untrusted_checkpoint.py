"""The checks that treat a checkpoint folder as untrusted input, one at a time and without an
engine (tests/distributed/test_untrusted_checkpoint.py runs them on real checkpoints): paths
confined to the folder, integrity decided by the reader, nothing decoded into a callable, run
state validated, and a state that is tried and refused leaving no attribute behind.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from hf_zero.checkpoint import CheckpointError
from hf_zero.checkpoint.load import _try_state
from hf_zero.checkpoint.manifest import (
    FORMAT, MAX_JSON_DEPTH, check_format_version, check_plain_json, decode_state, encode_state,
    read_manifest, resolve_checkpoint_dir,
)
from hf_zero.checkpoint.paths import is_plain_name, resolve_inside
from hf_zero.checkpoint.reader import RankFiles
from hf_zero.checkpoint.validate import run_state_problems, step_problem


# ------------------------------------------------------------------ paths
@pytest.mark.parametrize("name", ["/etc/passwd", "..", "../x", "a/b", ".hidden", "-x", "", "a\x00b", "x/../y", None])
def test_names_that_are_not_plain_are_refused(name):
    assert not is_plain_name(name)


def test_links_inside_are_followed_and_links_out_refused_without_touching_the_target(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "data").write_text("x")
    os.symlink("sub/data", root / "inside")
    os.symlink("sub/../sub/data", root / "inside_dotdot")
    os.symlink(str(root / "sub" / "data"), root / "inside_absolute")
    os.symlink(str(tmp_path / "secret"), root / "out_absolute")
    os.symlink("../secret", root / "out_relative")
    os.symlink("loop_b", root / "loop_a")
    os.symlink("loop_a", root / "loop_b")
    real = os.path.realpath(root)
    for name in ("inside", "inside_dotdot", "inside_absolute"):
        assert resolve_inside(real, name, name) == os.path.join(real, "sub", "data")
    looked_at = []
    real_lstat = os.lstat
    monkeypatch.setattr(os, "lstat", lambda p, *a, **k: looked_at.append(os.fspath(p)) or real_lstat(p, *a, **k))
    for name in ("out_absolute", "out_relative"):
        with pytest.raises(CheckpointError, match="which is outside"):
            resolve_inside(real, name, name)
    assert not any("secret" in path for path in looked_at), looked_at
    with pytest.raises(CheckpointError, match="symlinks to follow"):
        resolve_inside(real, "loop_a", "loop_a")


def _save_dir_with_latest(tmp_path, content: bytes) -> str:
    (tmp_path / "global_step1").mkdir()
    (tmp_path / "global_step1" / "manifest.json").write_text("{}")
    (tmp_path / "latest").write_bytes(content)
    return str(tmp_path)


@pytest.mark.parametrize("content", [b"../global_step1", b"/etc", b"global_step1/", b"latest", b"\xff\xfe",
                                     b"g" * 5000, b"global_step1\nglobal_step1"])
def test_latest_must_hold_a_tag_name(tmp_path, content):
    with pytest.raises(CheckpointError, match="which is not a tag name"):
        resolve_checkpoint_dir(_save_dir_with_latest(tmp_path, content), None)


def test_latest_holding_a_tag_and_a_newline_resolves(tmp_path):
    save_dir = _save_dir_with_latest(tmp_path, b"global_step1\n")
    assert resolve_checkpoint_dir(save_dir, None) == os.path.join(save_dir, "global_step1")


@pytest.mark.parametrize("tag", ["../global_step1", "/etc", "a/b", "latest"])
def test_a_tag_argument_obeys_the_rule_of_saving(tmp_path, tag):
    with pytest.raises(CheckpointError, match="not usable as a directory name"):
        resolve_checkpoint_dir(_save_dir_with_latest(tmp_path, b"global_step1"), tag)


def _manifest(version: int = 2, name: str = "rank-00000-of-00001.safetensors", records: bool = True) -> dict:
    file = {"name": name, "bytes": 8, **({"tensors": {}} if records else {})}
    return {"format": FORMAT, "format_version": version, "tag": "t", "save_id": "s", "world_size": 1, "stage": 1,
            "groups": [], "files": [file], "model": {"class": "M"}}


def test_the_reader_refuses_a_file_name_that_is_not_plain_before_looking_at_it(tmp_path):
    files = RankFiles(str(tmp_path), _manifest(name="/etc/passwd"))
    with pytest.raises(CheckpointError, match="not a plain file name"):
        files.check(0, {})


def test_read_manifest_refuses_a_file_name_that_is_not_plain(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps(_manifest(name="../../x.safetensors")))
    with pytest.raises(CheckpointError, match=r"files\[0\].name '../../x.safetensors' is not a plain file name"):
        read_manifest(str(tmp_path))


# ------------------------------------------------------------------ integrity is the reader's decision
@pytest.mark.parametrize("version,phrase", [(True, "format version True is not one"), (0, "format version 0 is not one"),
                                            ("2", "format version '2' is not one"), (3, "upgrade hf_zero"),
                                            (1, "allow_unverified=True")])
def test_format_versions_the_reader_refuses(version, phrase):
    with pytest.raises(CheckpointError, match=phrase):
        check_format_version(version, "m.json", allow_unverified=False)


@pytest.mark.parametrize("version", [True, 0, 3, 2.0])
def test_allow_unverified_does_not_admit_a_version_that_is_not_one(version):
    with pytest.raises(CheckpointError, match="is not one this hf_zero reads"):
        check_format_version(version, "m.json", allow_unverified=True)


def test_format_1_is_read_only_when_the_caller_accepts_the_risk(tmp_path):
    check_format_version(1, "m.json", allow_unverified=True)
    (tmp_path / "manifest.json").write_text(json.dumps(_manifest(version=1, records=False)))
    with pytest.raises(CheckpointError, match="records no checksums"):
        read_manifest(str(tmp_path))
    assert read_manifest(str(tmp_path), allow_unverified=True)["format_version"] == 1


def test_the_reader_refuses_a_tensor_without_checksum_unless_allowed(tmp_path):
    from hf_zero.checkpoint.safetensors_io import TensorEntry, write_safetensors

    path = tmp_path / "rank-00000-of-00001.safetensors"
    nbytes = write_safetensors(str(path), [TensorEntry.of("g/param", torch.ones(3))], {"save_id": "s", "rank": "0"})
    manifest = dict(_manifest(version=1, records=False), files=[{"name": path.name, "bytes": nbytes}])
    with pytest.raises(CheckpointError, match="has no checksum in the manifest"):
        RankFiles(str(tmp_path), manifest).check(0, {"g/param": 3})
    RankFiles(str(tmp_path), manifest, allow_unverified=True).check(0, {"g/param": 3})


# ------------------------------------------------------------------ decoding admits data only
@pytest.mark.parametrize("encoded", [
    {"__dtype__": "load"}, {"__dtype__": "Tensor"}, {"__dtype__": "float"}, {"__dtype__": ["float32"]},
    {"__tensor__": {"dtype": "load", "shape": [], "data": [1]}},
    {"__tensor__": {"dtype": "float32", "shape": [5000], "data": [0] * 5000}},
    {"__tensor__": {"dtype": "float32", "shape": [2], "data": [1]}},
    {"__tensor__": {"dtype": "float32", "shape": [1], "data": ["x"]}},
    {"__tensor__": {"dtype": "int8", "shape": [1], "data": [1000]}},
    {"__tuple__": 3}, {"__items__": [[{"__tuple__": [[1]]}, 2]]},
])
def test_decoding_refuses_anything_but_data(encoded):
    with pytest.raises(ValueError, match="state"):
        decode_state({"k": encoded})


def test_every_dtype_the_saver_writes_decodes_and_others_are_refused_when_saving():
    from hf_zero.checkpoint.safetensors_io import DTYPE_TAGS

    for dtype in DTYPE_TAGS:
        state = {"t": torch.zeros(2, dtype=dtype), "d": dtype}
        back = decode_state(json.loads(json.dumps(encode_state(state, "s"))))
        assert back["t"].dtype == dtype and back["d"] is dtype
    with pytest.raises(CheckpointError, match="cannot be stored in a checkpoint manifest"):
        encode_state({"c": torch.zeros(2, dtype=torch.complex64)}, "s")


def test_client_state_deeper_than_a_manifest_may_be_is_refused_when_saving():
    deep: list = []
    for _ in range(MAX_JSON_DEPTH):
        deep = [deep]
    with pytest.raises(CheckpointError, match="nested more than"):
        check_plain_json({"a": deep})


# ------------------------------------------------------------------ run state
@pytest.mark.parametrize("value", [0, 3, 3.0, torch.tensor(3.0), torch.tensor(3)])
def test_valid_steps(value):
    assert step_problem("step", value) is None


@pytest.mark.parametrize("value", [-1, 2.5, math.nan, math.inf, "3", True, None, torch.tensor([1.0, 2.0]),
                                   torch.tensor(-1.0)])
def test_invalid_steps(value):
    assert "expected a finite integer >= 0" in step_problem("step", value)


def _run_manifest(**hyper) -> dict:
    groups = [{"lr": 1e-3, "betas": {"__tuple__": [0.9, 0.99]}, "eps": 1e-8, "weight_decay": 0.0,
               "amsgrad": False, "foreach": None, **hyper}]
    return {"global_steps": 1, "micro_steps": 1, "global_samples": 2, "files": [{}],
            "optimizer": {"class": "AdamW", "param_groups": groups},
            "groups": [{"tensors": {"param": "F32", "optim.exp_avg": "F32"},
                        "optimizer_scalars": {"step": 1}}]}


CURRENT = [{"lr": 1e-3, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False, "foreach": None}]


def test_a_valid_run_state_has_no_problems():
    assert run_state_problems(_run_manifest(foreach=True, initial_lr=1e-3, param_names=["a"]), True, CURRENT) == []


@pytest.mark.parametrize("key,value", [("lr", "abc"), ("lr", -1), ("eps", math.nan), ("weight_decay", -0.1),
                                       ("betas", {"__tuple__": [0.9, 1.0]}), ("betas", [0.9]), ("amsgrad", 1),
                                       ("initial_lr", math.inf), ("extra", {"a": 1})])
def test_each_invalid_hyperparameter_is_named(key, value):
    problems = run_state_problems(_run_manifest(**{key: value}), True, CURRENT)
    assert len(problems) == 1 and problems[0].startswith(f"optimizer.param_groups[0].{key} ")


@pytest.mark.parametrize("slot_steps,phrase", [([1, 0], None), ([1], "expected a list of 2 step counts"),
                                               ("12", "expected a list of 2 step counts"),
                                               ([1, -1], "slot_steps[1] is -1: expected a finite integer >= 0"),
                                               ([1, math.nan], "slot_steps[1] is nan")])
def test_per_parameter_step_counts_are_checked(slot_steps, phrase):
    manifest = _run_manifest()
    manifest["groups"][0]["slots"] = [{"name": "a"}, {"name": "b"}]
    manifest["groups"][0]["optimizer_scalars"]["slot_steps"] = slot_steps
    problems = run_state_problems(manifest, True, CURRENT)
    assert problems == [] if phrase is None else (len(problems) == 1 and phrase in problems[0]), problems


def test_the_optimizer_part_is_checked_only_when_it_is_loaded():
    manifest = _run_manifest(lr="abc")
    manifest["global_steps"] = -1
    assert run_state_problems(manifest, counters=True, optimizer_groups=None) == [
        "global_steps is -1: expected an integer from 0 to 2**48"]
    assert run_state_problems(manifest, counters=False, optimizer_groups=None) == []


def test_a_counter_past_any_run_is_refused():
    """Issue 46: micro_steps = 2**64 + 1 loaded, and every later step (and reload) failed."""
    manifest = _run_manifest()
    manifest["micro_steps"] = 2**64 + 1
    assert run_state_problems(manifest, counters=True, optimizer_groups=None) == [
        f"micro_steps is {2**64 + 1}: expected an integer from 0 to 2**48"]
    manifest["micro_steps"] = 2**48
    assert run_state_problems(manifest, counters=True, optimizer_groups=None) == []


# ------------------------------------------------------------------ a tried state leaves nothing behind
class _Planting:
    """A state holder whose load_state_dict plants attributes, as torch's LRScheduler does."""

    def __init__(self) -> None:
        self.value = 1

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.__dict__.update(state)
        if state.get("fail"):
            raise ValueError("refused")


def test_a_refused_state_leaves_no_attribute_behind():
    holder = _Planting()
    with pytest.raises(CheckpointError, match="does not load"):
        _try_state("test state", "m.json", holder.state_dict(), holder.load_state_dict,
                   {"value": 2, "step": "planted", "fail": True}, owner=holder)
    assert vars(holder) == {"value": 1}


def test_eps_as_adafactor_holds_it_and_flags_that_may_be_none():
    current = [dict(CURRENT[0], eps=(None, 1e-3), foreach=None)]
    valid = _run_manifest(eps={"__tuple__": [None, 1e-3]}, foreach=True)
    assert run_state_problems(valid, True, current) == []
    for eps in ({"__tuple__": [None, -1.0]}, {"__tuple__": [math.nan, 1e-3]}, None):
        problems = run_state_problems(_run_manifest(eps=eps), True, current)
        assert len(problems) == 1 and problems[0].startswith("optimizer.param_groups[0].eps "), problems


_WRITE_INTO = """
import resource, signal, sys, torch
from hf_zero.checkpoint.converted import write_converted
from hf_zero.checkpoint.safetensors_io import TensorEntry
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # the rank file cannot be written: EFBIG
entry = TensorEntry("w", torch.float32, (65536,), lambda: torch.zeros(65536))
try:
    write_converted(sys.argv[1], "global_step1", "s1", [entry], {"format": "hf_zero"})
except OSError as error:
    print(error.strerror)
"""


@pytest.mark.parametrize("before", ["absent", "empty", "with a file"])
def test_a_failed_import_write_leaves_no_empty_folder_it_made(tmp_path, before):
    """Issue 46: a conversion that fails while writing removes the output folder it created, and
    leaves one that was there before (empty or not) as it was."""
    import subprocess
    import sys

    out = tmp_path / "converted"
    if before != "absent":
        out.mkdir()
    if before == "with a file":
        (out / "notes.txt").write_text("mine")
    done = subprocess.run([sys.executable, "-c", _WRITE_INTO, str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "File too large" in done.stdout, done.stdout + done.stderr
    if before == "absent":
        assert not out.exists()
    else:
        assert sorted(os.listdir(out)) == ([] if before == "empty" else ["notes.txt"])


# ------------------------------------------------------------------ scheduler state and records
class _ScaledLR(torch.optim.lr_scheduler.LRScheduler):
    """A user's scheduler: its own attribute ``scale``, which no named rule knows."""

    def __init__(self, optimizer: torch.optim.Optimizer, scale: float) -> None:
        self.scale = scale
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        return [base * self.scale for base in self.base_lrs]


def _adamw(**hyper) -> torch.optim.AdamW:
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=1e-3, **hyper)


def test_a_scheduler_state_is_tried_with_one_step_and_everything_put_back():
    from hf_zero.checkpoint.load import _scheduler_trial
    from hf_zero.checkpoint.scheduler_state import scheduler_state_problems

    optimizer = _adamw()
    scheduler = _ScaledLR(optimizer, 0.5)
    saved = dict(scheduler.state_dict(), scale=-2.0)
    assert scheduler_state_problems(saved, scheduler, 1) == []  # only the step finds it
    current, groups = dict(scheduler.state_dict()), [dict(g) for g in optimizer.param_groups]
    with pytest.raises(CheckpointError, match=r"its next step sets the learning rates \[-0.002\]"):
        _try_state("lr_scheduler state", "m.json", current, scheduler.load_state_dict, saved, owner=scheduler,
                   trial=_scheduler_trial(scheduler))
    assert scheduler.state_dict() == current and optimizer.param_groups == groups
    _try_state("lr_scheduler state", "m.json", current, scheduler.load_state_dict, dict(saved, scale=2.0),
               owner=scheduler, trial=_scheduler_trial(scheduler))
    assert scheduler.state_dict() == current and optimizer.param_groups == groups


def test_reduce_on_plateau_keeps_its_infinities_and_is_not_stepped():
    from hf_zero.checkpoint.scheduler_state import scheduler_state_problems, takes_a_plain_step

    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(_adamw())
    state = scheduler.state_dict()
    assert state["best"] == math.inf and scheduler_state_problems(state, scheduler, 1) == []
    assert not takes_a_plain_step(scheduler)
    assert scheduler_state_problems(dict(state, factor=0.0, patience=-1), scheduler, 1) == [
        "lr_scheduler.state.factor is 0.0: expected > 0",
        "lr_scheduler.state.patience is -1: expected a count >= 0"]


@pytest.mark.parametrize("hyper, kept", [
    ({}, ["exp_avg", "exp_avg_sq"]),
    ({"amsgrad": True}, ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"]),
])
def test_the_state_an_optimizer_keeps_is_probed_with_its_groups(hyper, kept):
    from hf_zero.checkpoint.optimizer_records import kept_state

    state = kept_state(torch.optim.AdamW, _adamw(**hyper).param_groups[0])
    assert sorted(state.elementwise) == kept and state.step
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    assert kept_state(torch.optim.SGD, sgd.param_groups[0]).elementwise == frozenset()
    momentum = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1, momentum=0.9)
    assert kept_state(torch.optim.SGD, momentum.param_groups[0]).elementwise == {"momentum_buffer"}
