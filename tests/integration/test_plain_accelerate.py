"""An unmodified plain-``Accelerator`` script (plain_accelerate_clm.py, which follows
run_clm_no_trainer.py step by step, its final save included) on hf_zero, in real 2-process CPU
launches.

Llama, with the script's ``clip_grad_norm_(..., 0.5)`` call added (``--max_grad_norm``): under
plain ``accelerate launch`` (DDP), under ``accelerate launch -m hf_zero.run ... --zero_config
zero2.json`` whose ``"gradient_clipping": "auto"`` takes the script's 0.5, and under ``hf-zero
launch`` with a yaml whose hf_zero section names a stage-3 config that sets 0.5 itself. Llama's
parameters match none of the script's ``no_decay`` names, so its second param group is empty
([Note: param groups keep their places]); its linear schedule is stepped as Accelerate steps it
([Note: who steps the script's scheduler]); clipping at 0.5 engages; the stage-3 run saves its
state at step 2 and a fourth launch resumes from it with ``accelerator.load_state``.

GPT-2 (tied embeddings, initialised wider so its gradient norms exceed 1), as published: no
clipping call. Under DDP, at stage 3 with ``"gradient_clipping": "auto"`` (which must not clip:
[Note: "auto" clipping follows the script]) and at stage 3 with 1.0 (the value "auto" had, which
would clip). Every run ends with the published ``unwrap_model(model).save_pretrained(output_dir,
is_main_process=..., save_function=accelerator.save)`` on every rank ([Note: save_pretrained on
a stage-3 module]). CPU multi-process launches need ``--multi_gpu`` with ACCELERATE_USE_CPU=true
(``--cpu`` alone starts one process)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tests.distributed.launch import free_port, run_process_tree
from tests.integration.conftest import LAUNCH_TIMEOUT_S, REPO, subprocess_env
from tests.integration.test_trl import save_tiny_tokenizer
from tests.tiny_models import VOCAB

SCRIPT = str(Path(__file__).with_name("plain_accelerate_clm.py"))
CLIP = 0.5
STAGES = (2, 3)
RUNS = ("ddp", "z2", "z3", "z3-resumed", "gpt2-ddp", "gpt2-z3-auto", "gpt2-z3-clip1")


def _run(cmd: list[str], **env: str) -> subprocess.CompletedProcess:
    full_env = dict(subprocess_env(), ACCELERATE_USE_CPU="true", **env)
    proc = run_process_tree(cmd, cwd=REPO, env=full_env, timeout=LAUNCH_TIMEOUT_S)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-8000:]}")
    return proc


def _config(path: Path, stage: int, clipping: float | str = CLIP) -> str:
    path.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": clipping, "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}))
    return str(path)


def _wide_gpt2(folder: Path) -> str:
    """tests.tiny_models.tiny_gpt2 initialised with std 0.2: its gradient norms are 1.2-1.5, so
    clipping at 1.0 changes its steps."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=15, n_layer=2, n_head=3, resid_pdrop=0.0,
                               embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
                               initializer_range=0.2)).save_pretrained(folder)
    save_tiny_tokenizer(str(folder))
    return str(folder)


@pytest.fixture(scope="module")
def runs(model_dirs: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("plain_accelerate")
    save_tiny_tokenizer(model_dirs["llama"])  # run_clm_no_trainer.py loads one from the model folder
    gpt2 = _wide_gpt2(root / "gpt2-wide")
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    script_args = lambda name: ["--model_name_or_path", model_dirs["llama"], "--output_dir", str(root / name),  # noqa: E731
                                "--max_grad_norm", str(CLIP)]
    ddp_pythonpath = os.pathsep.join([str(Path(__file__).with_name("ddp_exit_guard")), subprocess_env()["PYTHONPATH"]])
    _run([*launch, "--main_process_port", str(free_port()), SCRIPT, *script_args("ddp")], PYTHONPATH=ddp_pythonpath)
    _run([*launch, "--main_process_port", str(free_port()), "-m", "hf_zero.run", SCRIPT,
          "--zero_config", _config(root / "zero2.json", 2, clipping="auto"), *script_args("z2")],
         HF_ZERO_MEMORY_REPORT=str(root / "memory-z2"))
    cluster = yaml.safe_load((REPO / "recipes" / "accelerate" / "zero3_2proc.yaml").read_text())
    cluster["hf_zero"] = {"config_file": _config(root / "zero3.json", 3)}
    (root / "zero3.yaml").write_text(yaml.safe_dump(cluster))
    _run([sys.executable, "-m", "hf_zero.cli", "launch", "--config_file", str(root / "zero3.yaml"),
          "--main_process_port", str(free_port()), SCRIPT, *script_args("z3"), "--checkpointing_steps", "2"],
         HF_ZERO_MEMORY_REPORT=str(root / "memory-z3"))
    # load_state: the stage-3 run resumed from its step-2 state (in the script's own way)
    _run([*launch, "--main_process_port", str(free_port()), "-m", "hf_zero.run", SCRIPT,
          "--zero_config", str(root / "zero3.json"), *script_args("z3-resumed"),
          "--resume_from_checkpoint", str(root / "z3" / "step_2")])
    # GPT-2 as published (no clip_grad_norm_ call): DDP, stage 3 with "auto", stage 3 with 1.0
    published = lambda name: ["--model_name_or_path", gpt2, "--output_dir", str(root / name)]  # noqa: E731
    _run([*launch, "--main_process_port", str(free_port()), SCRIPT, *published("gpt2-ddp")], PYTHONPATH=ddp_pythonpath)
    for name, clipping in (("gpt2-z3-auto", "auto"), ("gpt2-z3-clip1", 1.0)):
        _run([*launch, "--main_process_port", str(free_port()), "-m", "hf_zero.run", SCRIPT,
              "--zero_config", _config(root / f"{name}.json", 3, clipping=clipping), *published(name)])
    results = {name: json.loads((root / name / "run.json").read_text()) for name in RUNS}
    results["root"] = str(root)
    return results


def _close(got: list[float], expected: list[float], rel: float = 1e-5) -> bool:
    return len(got) == len(expected) and all(math.isclose(a, b, rel_tol=rel) for a, b in zip(got, expected))


@pytest.mark.parametrize("stage", STAGES)
def test_unmodified_script_matches_plain_ddp(runs: dict[str, Any], stage: int) -> None:
    ddp, zero = runs["ddp"], runs[f"z{stage}"]
    assert (ddp["accelerator"], ddp["model"]) == ("Accelerator", "DistributedDataParallel")
    assert (zero["accelerator"], zero["model"]) == ("HfZeroAccelerator", "ZeroEngine")
    assert len(zero["losses"]) == 10  # 5 optimizer steps x accumulation 2
    assert _close(zero["losses"], ddp["losses"]), (zero["losses"], ddp["losses"])
    assert _close(zero["grad_norms"], ddp["grad_norms"]), (zero["grad_norms"], ddp["grad_norms"])
    assert max(ddp["grad_norms"]) > CLIP  # clipping engages
    # warmup 2 x 2 processes then linear decay over 5 x 2: the schedule moves as under DDP
    assert _close(zero["lrs"], ddp["lrs"], rel=1e-9) and ddp["lrs"][:2] == [0.0025, 0.005]
    assert zero["eval_count"] == ddp["eval_count"] == 7
    assert math.isclose(zero["perplexity"], ddp["perplexity"], rel_tol=1e-5)


@pytest.mark.parametrize("stage", STAGES)
def test_per_rank_memory_report_shows_sharded_states(runs: dict[str, Any], model_dirs: dict[str, str],
                                                     stage: int) -> None:
    from safetensors.torch import load_file

    full_bytes = sum(t.numel() * 4 for t in load_file(Path(model_dirs["llama"]) / "model.safetensors").values())
    folder = Path(runs["root"]) / f"memory-z{stage}"
    reports = [json.loads((folder / f"memory-rank{r}.json").read_text()) for r in (0, 1)]
    for report in reports:
        memory = report["memory"]
        assert (report["stage"], report["world_size"]) == (stage, 2)
        # Adam's two moments of this rank's half, not of the whole model (flat groups pad to 2)
        assert full_bytes < memory["optimizer_state"] < full_bytes + 64 * 2 * 4
        if stage == 3:  # parameters and gradients sharded too
            assert memory["compute_params"] < 0.55 * full_bytes and memory["gradients"] < 0.55 * full_bytes
        else:  # stage 2: full parameters, gradients reduced into shards (the full buffer is freed)
            assert memory["compute_params"] >= full_bytes


def test_saved_model_and_state(runs: dict[str, Any]) -> None:
    """The published save (no ``state_dict``) writes DDP's weights; see also
    test_published_save_writes_the_gathered_weights."""
    from safetensors.torch import load_file

    root = Path(runs["root"])
    ddp = load_file(root / "ddp" / "model.safetensors")
    for stage in STAGES:
        zero = load_file(root / f"z{stage}" / "model.safetensors")
        assert set(zero) == set(ddp)
        for name, tensor in ddp.items():
            torch.testing.assert_close(zero[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
    state = root / "z3" / "step_2"
    assert sorted(p.name for p in (state / "pytorch_model").glob("rank-*")) == [
        "rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"]
    assert (state / "scheduler.bin").exists()  # the script's scheduler, saved by Accelerate


def test_load_state_resumes_the_unmodified_script(runs: dict[str, Any]) -> None:
    full, resumed = runs["z3"], runs["z3-resumed"]
    assert len(resumed["losses"]) == 6  # steps 3-5 x accumulation 2
    assert _close(resumed["losses"], full["losses"][4:]), (resumed["losses"], full["losses"][4:])
    assert _close(resumed["grad_norms"], full["grad_norms"][2:])
    assert _close(resumed["lrs"], full["lrs"][2:], rel=1e-9)


def test_a_config_the_script_never_uses_is_an_error(tmp_path: Path) -> None:
    script = tmp_path / "no_model.py"
    script.write_text("import torch\nmodel = torch.nn.Linear(2, 2)\nprint('trained without any accelerator')\n")
    proc = subprocess.run([sys.executable, "-m", "hf_zero.run", str(script), "--zero_config",
                           str(REPO / "recipes" / "zero2.json")],
                          cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "finished without preparing a model with hf_zero" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("name", ["z2", "z3", "gpt2-z3-auto"])
def test_published_save_writes_the_gathered_weights(runs: dict[str, Any], name: str) -> None:
    """``unwrap_model(model).save_pretrained(dir, is_main_process=..., save_function=accelerator.save)``
    on every rank writes a folder that plain transformers loads, holding exactly the weights
    ``accelerator.get_state_dict(model)`` gathers (full, as under DeepSpeed), tied GPT-2 included."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(runs["root"]) / name
    gathered = torch.load(folder / "get_state_dict.pt", weights_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder)  # no live config here: a plain load
    loaded = model.state_dict()
    assert set(loaded) == set(gathered)
    for key, tensor in gathered.items():
        assert tensor.shape == loaded[key].shape and tensor.numel() > 0, key
        assert torch.equal(loaded[key], tensor), key
    if name.startswith("gpt2"):
        assert model.lm_head.weight is model.transformer.wte.weight
    AutoTokenizer.from_pretrained(folder)
    assert json.loads((folder / "all_results.json").read_text())["perplexity"] == runs[name]["perplexity"]


def test_auto_clipping_follows_a_script_that_does_not_clip(runs: dict[str, Any]) -> None:
    """run_clm_no_trainer.py never calls clip_grad_norm_, so DDP does not clip: "auto" at stage 3
    equals DDP to 1e-6, where clipping at 1.0 (what "auto" used to become) is 100x further off."""
    ddp, auto, clip1 = (runs[name]["losses"] for name in ("gpt2-ddp", "gpt2-z3-auto", "gpt2-z3-clip1"))
    assert runs["gpt2-z3-auto"]["model"] == "ZeroEngine" and len(ddp) == len(auto) == 10
    worst = lambda got: max(abs(a - b) / abs(b) for a, b in zip(got, ddp))  # noqa: E731
    assert worst(auto) < 1e-6, (auto, ddp)
    assert worst(clip1) > 1e-4, (clip1, ddp)
    assert runs["gpt2-z3-auto"]["lrs"] == runs["gpt2-ddp"]["lrs"]
