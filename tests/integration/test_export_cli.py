"""``hf-zero export`` and ``hf-zero estimate`` as a user runs them: real subprocesses on a
checkpoint written by a world-size-1 engine in this process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.distributed import scenarios as S
from tests.tiny_models import batch_for_step


def _hf_zero() -> list[str]:
    script = shutil.which("hf-zero")
    return [script] if script else [sys.executable, "-m", "hf_zero.cli"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[float]]:
    import hf_zero

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        os.environ.pop(name, None)
    sc = S.scenario("llama", 2, freeze=True)
    engine, *_ = hf_zero.initialize(model=S.build_model(sc), config=S.make_config(sc))
    for step in range(2):
        ids = batch_for_step(step, 2)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    save_dir = str(tmp_path_factory.mktemp("ckpt"))
    engine.save_checkpoint(save_dir)
    with torch.no_grad():
        logits = engine(input_ids=batch_for_step(99, 1)).logits.reshape(-1).tolist()
    return save_dir, logits


def test_export_then_from_pretrained_then_estimate(checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    save_dir, logits = checkpoint
    out = tmp_path / "hf"
    done = subprocess.run([*_hf_zero(), "export", save_dir, str(out), "--max-shard-size", "10KB"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "from_pretrained" in done.stdout
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and "lm_head.weight" in index["weight_map"]  # untied
    model = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        got = model(input_ids=batch_for_step(99, 1)).logits.reshape(-1)
    assert torch.allclose(got, torch.tensor(logits), atol=1e-5, rtol=0)

    done = subprocess.run([*_hf_zero(), "estimate", "--model", str(out), "--gpus-per-node", "2", "--nodes", "2"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("LlamaForCausalLM:") and "4 ranks" in lines[0]
    rows = [line for line in lines[3:] if "|" in line]
    assert [row.split("|")[0].strip() for row in rows] == ["1", "1", "2", "2", "3", "3", "3"]


def test_export_of_a_missing_checkpoint_fails_clearly(tmp_path):
    done = subprocess.run([*_hf_zero(), "export", str(tmp_path), str(tmp_path / "out"), "--tag", "global_step7"],
                          capture_output=True, text=True)
    assert done.returncode == 1
    assert "global_step7" in done.stderr and "no checkpoint with tag" in done.stderr
    assert not (tmp_path / "out").exists()


def _snapshot(path) -> dict[str, bytes]:
    return {name: (path / name).read_bytes() for name in sorted(os.listdir(path))}


def _mount_tmpfs(path, size_bytes: int) -> bool:
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    return done.returncode == 0


def test_export_into_a_full_disk_keeps_the_previous_export(checkpoint, tmp_path):
    """A real full disk: a tmpfs with room for one export, not two (the new export is written
    beside the old one). Where mounting is not allowed, a file-size limit (RLIMIT_FSIZE) makes
    the writes fail instead (EFBIG)."""
    import resource
    import signal

    from hf_zero.checkpoint import export_hf_model

    save_dir, _ = checkpoint
    probe = tmp_path / "probe"
    export_hf_model(save_dir, probe)
    pages = sum(-(-os.path.getsize(probe / n) // 4096) for n in os.listdir(probe))
    disk = tmp_path / "disk"
    mounted = _mount_tmpfs(disk, int(1.5 * pages + 1) * 4096)
    limit = None if mounted else os.path.getsize(probe / "model.safetensors") // 2

    def small_files() -> None:
        if limit is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    try:
        out = disk / "model"
        export_hf_model(save_dir, out)
        (out / "tokenizer.json").write_text("{}")  # a file export does not write: carried over, kept
        before = _snapshot(out)
        second = subprocess.run([*_hf_zero(), "export", save_dir, str(out), "--dtype", "fp32"],
                                capture_output=True, text=True, preexec_fn=small_files)
        assert second.returncode == 1
        assert "Traceback" not in second.stderr
        assert ("No space left on device" if mounted else "File too large") in second.stderr, second.stderr
        assert "the previous export there is untouched" in second.stderr
        assert _snapshot(out) == before
        assert sorted(os.listdir(disk)) == ["model"]  # no staging folder left
    finally:
        if mounted:
            subprocess.run(["umount", str(disk)], check=True)


def test_exporting_again_replaces_the_weights_and_keeps_other_files(checkpoint, tmp_path):
    from hf_zero.checkpoint import export_hf_model

    save_dir, _ = checkpoint
    out = tmp_path / "hf"
    export_hf_model(save_dir, out, max_shard_size="10KB")
    (out / "tokenizer.json").write_text("{}")
    export_hf_model(save_dir, out, dtype="bf16")
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert sorted(os.listdir(tmp_path)) == ["hf"]


def test_a_checkpoint_whose_names_differ_from_its_model_needs_skip_model_check(checkpoint, tmp_path):
    save_dir = str(tmp_path / "ckpt")
    shutil.copytree(checkpoint[0], save_dir)
    with open(os.path.join(save_dir, "latest")) as handle:
        manifest_path = os.path.join(save_dir, handle.read().strip(), "manifest.json")
    with open(manifest_path) as handle:
        manifest = json.load(handle)
    slot = next(s for g in manifest["groups"] for s in g["slots"] if s["name"] == "model.norm.weight")
    slot["name"] = "model.final_norm.weight"  # as if the model was changed after it was built from its config
    with open(manifest_path, "w") as handle:
        json.dump(manifest, handle)
    out = tmp_path / "hf"
    refused = subprocess.run([*_hf_zero(), "export", save_dir, str(out)], capture_output=True, text=True)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert "do not match the LlamaForCausalLM" in refused.stderr and "model.norm.weight: missing" in refused.stderr
    assert "--skip-model-check" in refused.stderr
    assert not out.exists()
    done = subprocess.run([*_hf_zero(), "export", save_dir, str(out), "--skip-model-check"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "check_model=False" in done.stderr  # the risk is named
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
