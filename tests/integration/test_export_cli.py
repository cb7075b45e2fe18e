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
    assert [line.split("|")[0].strip() for line in lines[4:]] == ["1", "1", "2", "2", "3", "3", "3"]


def test_export_of_a_missing_checkpoint_fails_clearly(tmp_path):
    done = subprocess.run([*_hf_zero(), "export", str(tmp_path), str(tmp_path / "out"), "--tag", "global_step7"],
                          capture_output=True, text=True)
    assert done.returncode == 1
    assert "global_step7" in done.stderr and "no checkpoint with tag" in done.stderr
    assert not (tmp_path / "out").exists()
