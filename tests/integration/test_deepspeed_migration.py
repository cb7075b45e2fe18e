"""Resuming a DeepSpeed ZeRO checkpoint under hf_zero (issue 30), on checkpoints written by real
DeepSpeed on CPU over gloo.

One spawn of 2 processes trains with DeepSpeed at stages 2 and 3 (and 1 in bf16), saves, and
resumes its own checkpoint for the reference curve (deepspeed_migration_driver.py). This process imports each
checkpoint (``import_deepspeed_checkpoint``); one spawn of 3 processes then resumes it under
hf_zero at world size 3 and at 2, each at another stage, on the same global batches.

[Note: migration tolerance]
On the learnable batches, the 3 resumed steps move the loss by about 0.3 and the loss of the
first resumed step already depends on every byte of the fp32 masters. DeepSpeed and hf_zero
reduce the same fp32 numbers in different orders (ranks, buckets), which moves a loss by ~1e-6.
TOL = 1e-5 sits well below the signal; a resume that drops the Adam moments, the step counts or
the scheduler state must differ by more than 10 x TOL (each is checked, so the tolerance is
shown to catch a half-imported state).
"""

from __future__ import annotations

import math

import collections
import importlib.util
import os
import shutil
import subprocess
import sys
from typing import Any

import pytest
import torch

from tests.distributed.launch import run_distributed
from tests.integration import deepspeed_migration_driver as D
from tests.tiny_models import BUILDERS

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="deepspeed is not installed (pip install deepspeed: the test extra has it)")
os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before anything imports deepspeed

TOL = 1e-5  # see [Note: migration tolerance]


class ClientObject:
    """A class of a training script, written into client_state: must be refused by name."""

    def __init__(self) -> None:
        self.value = 1


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from hf_zero.checkpoint import import_deepspeed_checkpoint

    root = str(tmp_path_factory.mktemp("deepspeed"))
    deepspeed = run_distributed(D.deepspeed_phase, 2, root, skip_teardown=True)[0]  # DeepSpeed's exit can abort
    written = {}
    for name, run in D.DS_RUNS.items():
        written[name] = import_deepspeed_checkpoint(os.path.join(root, name), D.import_dir(root, name, None),
                                                    model=BUILDERS[run["model"]](seed=1))
    # for a torch AdamW passed to hf_zero.initialize (the Trainer's)
    import_deepspeed_checkpoint(os.path.join(root, "ds_s3_gpt2"), D.import_dir(root, "ds_s3_gpt2", "torch"),
                                optimizer_class="AdamW")
    per_rank = run_distributed(D.hf_zero_phases, 3, root)
    resumes = [r for world in D.RESUMES for r in per_rank[0][str(world)]]
    return {"root": root, "deepspeed": deepspeed, "written": written, "resumes": resumes,
            "all_ranks": per_rank}


def _max_diff(a: list[float], b: list[float]) -> float:
    """The largest difference; inf when a loss is not finite (``max`` skips nan: nan < x is False)."""
    diffs = [abs(x - y) for x, y in zip(a, b, strict=True)]
    return max(diffs) if all(math.isfinite(d) for d in diffs) else math.inf


def _resumes(runs: dict[str, Any], control: str | None = None) -> list[dict[str, Any]]:
    """The resumes of full state (``control=None``), or the negative controls that drop ``control``."""
    if control is None:
        return [r for r in runs["resumes"] if r["variant"] not in D.CONTROLS]
    return [r for r in runs["resumes"] if r["variant"] == control]


# ------------------------------------------------------------------ the curve
def test_resumed_losses_match_deepspeeds_own_resume(runs):
    compared = [r for r in _resumes(runs) if "resumed_losses" in runs["deepspeed"][r["name"]]]
    assert {(r["name"], r["world"]) for r in compared} >= {(n, w) for n in ("ds_s2_gpt2", "ds_s3_gpt2") for w in (2, 3)}
    for resume in compared:
        reference = runs["deepspeed"][resume["name"]]["resumed_losses"]
        where = f"{resume['name']} at world size {resume['world']}, stage {resume['stage']} ({resume['variant']})"
        assert _max_diff(resume["losses"], reference) <= TOL, (where, resume["losses"], reference)
        # a signal far above the tolerance: the loss moves while training on
        assert abs(reference[-1] - reference[0]) > 1000 * TOL, reference


@pytest.mark.parametrize("drop", D.CONTROLS)
def test_dropping_part_of_the_state_leaves_the_curve(runs, drop):
    """The negative controls of [Note: migration tolerance]: TOL catches a half-imported state."""
    controls = _resumes(runs, drop)
    assert controls
    for resume in controls:
        reference = runs["deepspeed"][resume["name"]]["resumed_losses"]
        assert _max_diff(resume["losses"], reference) > 10 * TOL, (resume["name"], drop, resume["losses"], reference)


def test_run_state_is_carried_over(runs):
    for resume in _resumes(runs):
        assert resume["client_state"] == D.CLIENT_STATE
        assert resume["counters"] == [D.SAVE_AT, D.SAVE_AT, D.SAVE_AT * D.GLOBAL_ROWS]
        lrs = runs["deepspeed"][resume["name"]].get("resumed_lrs")
        if lrs:  # the learning rate of the first resumed step, as DeepSpeed's own resume has it
            assert resume["lr"] == pytest.approx(lrs[0], rel=1e-12)


# ------------------------------------------------------------------ the state, value by value
def test_import_holds_deepspeeds_masters_and_moments_exactly(runs):
    """Every parameter's fp32 master, exp_avg and exp_avg_sq in the imported rank file equal what
    DeepSpeed itself reports for it (safe_get_full_fp32_param / safe_get_full_optimizer_state)."""
    from safetensors import safe_open

    from hf_zero.checkpoint import read_manifest

    for name, path in runs["written"].items():
        reference = torch.load(os.path.join(runs["root"], f"{name}.reference.pt"), weights_only=True)
        manifest = read_manifest(path)
        seen = set()
        with safe_open(os.path.join(path, manifest["files"][0]["name"]), framework="pt") as handle:
            for group in manifest["groups"]:
                for slot in group["slots"]:
                    for key, tensor in (("param", "param"), ("exp_avg", "optim.exp_avg"),
                                        ("exp_avg_sq", "optim.exp_avg_sq")):
                        lo, hi = slot["offset"], slot["offset"] + slot["numel"]
                        flat = handle.get_slice(f"{group['group']}/{tensor}")[lo:hi]
                        assert torch.equal(flat.reshape(slot["shape"]), reference[f"{slot['name']}/{key}"]), (name, slot)
                    seen.add(slot["name"])
        assert seen == {k.rsplit("/", 1)[0] for k in reference}, name


def test_an_import_exports_to_a_hugging_face_folder(runs, tmp_path):
    """With model= the import records the model, so hf-zero export writes a from_pretrained folder."""
    from transformers import AutoModelForCausalLM

    from hf_zero.checkpoint import export_hf_model

    export_hf_model(runs["written"]["ds_s2_gpt2"], str(tmp_path / "hf"))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    reference = torch.load(os.path.join(runs["root"], "ds_s2_gpt2.reference.pt"), weights_only=True)
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), reference[f"{name}/param"]), name


def test_the_cli_converts_as_the_call_does(runs, tmp_path):
    """hf-zero import-deepspeed DS_DIR OUT_DIR --model FOLDER writes what the Python call writes."""
    from safetensors.torch import load_file

    from hf_zero.checkpoint import export_hf_model

    BUILDERS[D.DS_RUNS["ds_s2_gpt2"]["model"]](seed=1).save_pretrained(str(tmp_path / "model"))
    done = subprocess.run([sys.executable, "-m", "hf_zero.cli", "import-deepspeed", os.path.join(runs["root"], "ds_s2_gpt2"),
                           str(tmp_path / "cli"), "--model", str(tmp_path / "model")], capture_output=True, text=True)
    assert done.returncode == 0 and "engine.load_checkpoint(" in done.stdout, done.stderr
    exported = [export_hf_model(source, str(tmp_path / name))
                for source, name in ((str(tmp_path / "cli"), "from_cli"), (runs["written"]["ds_s2_gpt2"], "from_call"))]
    cli, call = (load_file(os.path.join(folder, "model.safetensors")) for folder in exported)
    assert cli.keys() == call.keys() and all(torch.equal(cli[k], call[k]) for k in call)
    failed = subprocess.run([sys.executable, "-m", "hf_zero.cli", "import-deepspeed", str(tmp_path / "missing"),
                             str(tmp_path / "never")], capture_output=True, text=True)
    assert failed.returncode == 1 and "no such DeepSpeed checkpoint" in failed.stderr and "Traceback" not in failed.stderr
    assert not (tmp_path / "never").exists()


def test_loaded_parameters_are_deepspeeds_masters(runs):
    for resume in _resumes(runs):
        reference = torch.load(os.path.join(runs["root"], f"{resume['name']}.reference.pt"), weights_only=True)
        name = f"{resume['name']}.w{resume['world']}s{resume['stage']}{resume['variant'] or ''}.params.pt"
        params = torch.load(os.path.join(runs["root"], name), weights_only=True)
        for n, value in params.items():
            assert torch.equal(value, reference[f"{n}/param"]), (resume["name"], n)


def test_loading_the_deepspeed_folder_names_the_conversion(runs):
    for rank_result in runs["all_ranks"]:
        for resume in (r for world in D.RESUMES for r in (rank_result[str(world)] or [])):
            assert resume["refused"].startswith("CheckpointError"), resume["refused"]
            assert "is a DeepSpeed ZeRO checkpoint" in resume["refused"]
            assert "import_deepspeed_checkpoint(" in resume["refused"]


# ------------------------------------------------------------------ untrusted files
def _copy(runs: dict[str, Any], tmp_path, name: str = "ds_s2_gpt2") -> str:
    copy = str(tmp_path / name)
    shutil.copytree(os.path.join(runs["root"], name), copy)
    return copy


def _rewrite(path: str, edit) -> None:
    """Load a DeepSpeed file as DeepSpeed does (it is our own test file), edit it, save it back."""
    state = torch.load(path, weights_only=False)
    edit(state)
    torch.save(state, path)


def _tag_dir(copy: str) -> str:
    with open(os.path.join(copy, "latest")) as handle:
        return os.path.join(copy, handle.read().strip())


@pytest.mark.parametrize("value, named", [
    (collections.Counter({"a": 1}), "collections.Counter"),
    (ClientObject(), f"{__name__}.ClientObject"),
])
def test_a_file_with_another_class_is_refused_by_name(runs, tmp_path, value, named):
    from hf_zero.checkpoint import CheckpointError, import_deepspeed_checkpoint

    copy = _copy(runs, tmp_path)
    model_states = os.path.join(_tag_dir(copy), "mp_rank_00_model_states.pt")
    _rewrite(model_states, lambda state: state.update(extra=value))
    out = str(tmp_path / "out")
    with pytest.raises(CheckpointError) as error:
        import_deepspeed_checkpoint(copy, out)
    assert named in str(error.value) and model_states in str(error.value)
    assert not os.path.exists(out) or not os.listdir(out)


def test_a_flipped_byte_in_tensor_data_is_refused_naming_the_file_and_member(runs, tmp_path):
    """torch.load(mmap=True) checks no CRC-32: the import does, for every member of every file.
    (The fixture's intact copies import: ``runs["written"]``.)"""
    import zipfile

    from hf_zero.checkpoint import CheckpointError, import_deepspeed_checkpoint

    copy = _copy(runs, tmp_path)
    path = os.path.join(_tag_dir(copy), "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with zipfile.ZipFile(path) as archive:
        member = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "r+b") as handle:  # a stored member: its bytes follow the 30-byte header, name and extra field
        handle.seek(member.header_offset + 26)
        name_len, extra_len = int.from_bytes(handle.read(2), "little"), int.from_bytes(handle.read(2), "little")
        handle.seek(member.header_offset + 30 + name_len + extra_len + member.file_size // 2)
        byte = handle.read(1)[0]
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte ^ 0x10]))
    out = str(tmp_path / "out")
    with pytest.raises(CheckpointError, match="the file is damaged: member ") as error:
        import_deepspeed_checkpoint(copy, out)
    assert f"{path}: the file is damaged: member {member.filename} fails its CRC-32" in str(error.value)
    assert not os.path.exists(out) or not os.listdir(out)


def test_deepspeeds_pickles_are_far_below_the_scan_limits(runs):
    """The bounds of [Note: DeepSpeed's pickles] leave a margin of 1000x over what DeepSpeed writes."""
    import io
    import pickletools

    from hf_zero.checkpoint import deepspeed_files as F

    for name in D.DS_RUNS:
        tag_dir = _tag_dir(os.path.join(runs["root"], name))
        for file in sorted(os.listdir(tag_dir)):
            data = F._pickle_bytes(os.path.join(tag_dir, file))
            opcodes = sum(1 for _ in pickletools.genops(io.BytesIO(data)))
            assert 1000 * len(data) < F._MAX_PICKLE_BYTES and 1000 * opcodes < F._MAX_PICKLE_OPCODES, (file, len(data))


def _nan_in_master(tag_dir: str) -> None:
    path = os.path.join(tag_dir, "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    groups = lambda s: s["optimizer_state_dict"]["single_partition_of_fp32_groups"]  # noqa: E731
    _rewrite(path, lambda s: groups(s).__setitem__(0, torch.where(torch.arange(len(groups(s)[0])) == 5, float("nan"),
                                                                  groups(s)[0].detach())))


def _short_partition(tag_dir: str) -> None:
    path = os.path.join(tag_dir, "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    groups = lambda s: s["optimizer_state_dict"]["single_partition_of_fp32_groups"]  # noqa: E731
    _rewrite(path, lambda s: groups(s).__setitem__(0, groups(s)[0][:-1].clone()))


def _other_step(tag_dir: str) -> None:
    path = os.path.join(tag_dir, "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    _rewrite(path, lambda s: s["optimizer_state_dict"]["base_optimizer_state"]["state"][0].__setitem__(
        "step", torch.tensor(7.0)))


def _write_latest(tag_dir: str, text: str) -> None:
    with open(os.path.join(os.path.dirname(tag_dir), "latest"), "w") as handle:
        handle.write(text)


DAMAGED = {
    "nan_in_master": (_nan_in_master, "holds inf or nan"),
    "short_partition": (_short_partition, "different sizes"),
    "ranks_at_other_steps": (_other_step, "different optimizer steps"),
    "missing_rank_file": (lambda d: os.remove(os.path.join(d, "zero_pp_rank_1_mp_rank_00_optim_states.pt")),
                          "optimizer files are present"),
    "latest_outside": (lambda d: _write_latest(d, "../elsewhere"), "not a tag name"),
}


@pytest.mark.parametrize("case", list(DAMAGED))
def test_damaged_checkpoints_are_refused_and_nothing_is_written(runs, tmp_path, case):
    from hf_zero.checkpoint import CheckpointError, import_deepspeed_checkpoint

    damage, expected = DAMAGED[case]
    copy = _copy(runs, tmp_path)
    damage(_tag_dir(copy))
    out = str(tmp_path / "out")
    with pytest.raises(CheckpointError, match=expected):
        import_deepspeed_checkpoint(copy, out)
    assert not os.path.exists(out) or not os.listdir(out)


def test_another_model_is_refused_by_name(runs, tmp_path):
    from hf_zero.checkpoint import CheckpointError, import_deepspeed_checkpoint

    with pytest.raises(CheckpointError, match="different model"):
        import_deepspeed_checkpoint(os.path.join(runs["root"], "ds_s2_gpt2"), str(tmp_path / "out"),
                                    model=BUILDERS["llama"](seed=0))


def test_fp16_loss_scaler_state_is_carried_over(runs, tmp_path):
    """DeepSpeed on CPU cannot train in fp16, so its dynamic loss scaler (a real DeepSpeed object,
    pickled with its dtype) is written into the stage-2 checkpoint of the fixture."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler as DeepSpeedScaler

    from hf_zero.checkpoint import import_deepspeed_checkpoint, read_manifest
    from hf_zero.engine.optim.loss_scaler import build_loss_scaler

    scaler = DeepSpeedScaler(init_scale=2.0**10, scale_window=4, min_scale=1, delayed_shift=2,
                             consecutive_hysteresis=False)
    scaler.cur_iter, scaler.last_overflow_iter, scaler.cur_hysteresis = 7, 3, 1
    copy = _copy(runs, tmp_path)
    tag_dir = _tag_dir(copy)
    for rank in range(2):
        _rewrite(os.path.join(tag_dir, f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"),
                 lambda s: s["optimizer_state_dict"].update(loss_scaler=scaler, dynamic_loss_scale=True))
    _rewrite(os.path.join(tag_dir, "mp_rank_00_model_states.pt"),
             lambda s: s.update(skipped_steps=2, ds_config=dict(s["ds_config"], fp16={"enabled": True})))
    manifest = read_manifest(import_deepspeed_checkpoint(copy, str(tmp_path / "out")))
    assert manifest["loss_scaler"] == {"class": "DynamicLossScaler", "state": {
        "dynamic": True, "cur_scale": 1024.0, "cur_iter": 7, "last_overflow_iter": 3, "cur_hysteresis": 1,
        "skipped_steps": 2}}
    ours = build_loss_scaler(enabled=True, loss_scale=0, initial_scale_power=16, loss_scale_window=4, hysteresis=2,
                             consecutive_hysteresis=False, min_loss_scale=1)
    ours.load_state_dict(manifest["loss_scaler"]["state"])
    assert (ours.cur_scale, ours.cur_iter, ours.last_overflow_iter, ours.skipped_steps) == (1024.0, 7, 3, 2)
