"""The ``hf-zero`` command explains itself: every subcommand's ``--help`` works and describes
every option, and every flag the README shows for a subcommand exists. ``--version`` and
``check-config`` answer without importing torch; the demo refuses a bad flag in one line before
starting any process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hf_zero.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
SUBCOMMANDS = ["demo", "doctor", "check-config", "export", "import-deepspeed", "export-dcp", "import-dcp", "estimate", "launch"]


def _subparsers() -> dict:
    parser = build_parser()
    action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return action.choices


@pytest.mark.parametrize("command", [[], *([c] for c in SUBCOMMANDS)], ids=lambda c: " ".join(c) or "hf-zero")
def test_every_help_exits_zero_and_describes_every_option(command):
    out = subprocess.run([sys.executable, "-m", "hf_zero.cli", *command, "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage: hf-zero" in out.stdout
    if command:
        for action in _subparsers()[command[0]]._actions:
            assert action.help, f"hf-zero {command[0]}: {action.dest} has no help text"
            for option in action.option_strings:
                assert option in out.stdout
            if action.required and action.help:  # a required option's default is never used: not shown
                assert f"{' '.join(action.help.split())} (default:" not in " ".join(out.stdout.split())
        text = " ".join(out.stdout.split())
        assert not re.search(r"\(default: [^()]*\) \(default:", text), "an option with two defaults in a row"
        assert "(default: None)" not in text and "(default: False)" not in text
    if command == ["estimate"]:
        assert "(DeepSpeed's default) (default: 100000)" in " ".join(out.stdout.split())


def test_demo_help_lists_the_demos_own_flags():
    demo = _subparsers()["demo"]
    flags = {s for a in demo._actions for s in a.option_strings}
    assert {"--nproc", "--device", "--stage", "--steps", "--dtype", "--json"} <= flags
    out = subprocess.run([sys.executable, "-m", "hf_zero.demo", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "usage: python -m hf_zero.demo" in out.stdout
    assert "ZeRO stage (default: 3)" in out.stdout
    # The help says which device the demo uses, and that --device chooses.
    help_text = " ".join(out.stdout.split())
    assert "cpu (over gloo; any GPU is hidden from the ranks) or cuda (over NCCL, one GPU per rank) (default: cpu)" \
        in help_text, help_text


def test_demo_passes_its_flags_on_and_keeps_nproc():
    from hf_zero.cli import _without_option

    assert _without_option(["--stage", "2", "--nproc", "3", "--steps", "5"], "--nproc") == ["--stage", "2", "--steps", "5"]
    assert _without_option(["--nproc=3", "--dtype", "bf16"], "--nproc") == ["--dtype", "bf16"]


def _readme_commands() -> list[tuple[str, list[str]]]:
    """(subcommand, flags) of every ``hf-zero <subcommand> ...`` line in the README and docs,
    up to the script a launcher runs (whose flags are the script's own)."""
    found = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for line in path.read_text().splitlines():
            for match in re.finditer(r"hf-zero ([a-z-]+)([^`\n]*)", line):
                words = match.group(2).split()
                before_script = []
                for word in words:
                    if word.endswith(".py"):
                        break
                    before_script.append(word)
                flags = [re.sub(r"[\[\]=].*", "", w.strip("[]")) for w in before_script if w.lstrip("[").startswith("--")]
                found.append((match.group(1), flags))
    return found


def test_every_flag_the_readme_shows_exists():
    commands = _readme_commands()
    parsers = _subparsers()
    assert {c for c, _ in commands} >= {"demo", "export", "estimate", "launch", "check-config"}
    for command, flags in commands:
        assert command in parsers, f"README names hf-zero {command}, which does not exist"
        known = {s for a in parsers[command]._actions for s in a.option_strings}
        for flag in flags:
            assert flag in known, f"README: hf-zero {command} {flag} does not exist"


def _hf_zero(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hf_zero.cli", *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("flags, error", [
    (["--nproc", "0"], "argument --nproc: must be at least 1, got 0"),
    (["--steps", "0"], "argument --steps: must be at least 1, got 0"),
    (["--steps", "x"], "argument --steps: expected an integer, got 'x'"),
    (["--micro-batch", "-1"], "argument --micro-batch: must be at least 1, got -1"),
    (["--seq", "1"], "argument --seq: must be at least 2, got 1"),
    (["--lr", "0"], "argument --lr: must be a finite number above 0, got 0"),
    (["--n-embd", "129"], "argument --n-embd: 129 is not divisible by its 2 heads"),
    (["--device", "cuda"], "argument --device: cuda, but torch "),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_demo_refuses_a_bad_flag_in_one_line_before_starting(flags: list[str], error: str) -> None:
    run = _hf_zero("demo", *flags, env={"CUDA_VISIBLE_DEVICES": ""})  # --device cuda fails on any machine
    assert run.returncode == 2, run.stdout + run.stderr
    assert "running:" not in run.stdout and "Traceback" not in run.stderr  # no torchrun, no per-rank tracebacks
    lines = run.stderr.strip().splitlines()
    assert lines[0].startswith("usage: hf-zero demo") and lines[-1].startswith("hf-zero demo: error: ")
    assert error in lines[-1], lines[-1]


def test_version() -> None:
    from hf_zero import __version__

    run = _hf_zero("--version")
    assert run.returncode == 0 and run.stdout.startswith(f"hf-zero {__version__} "), run.stdout + run.stderr


_IMPORTS_PROBE = """
import json, sys, time
start = time.perf_counter()
from hf_zero.cli import main
code = main(sys.argv[1:])
print(json.dumps({"code": code, "seconds": time.perf_counter() - start,
                  "imported": sorted(m for m in ("torch", "transformers", "accelerate") if m in sys.modules)}))
"""


@pytest.mark.parametrize("config", ["zero3.json", "zero2_offload.json", "zero3_nvme.json"])
def test_check_config_imports_no_torch_and_takes_under_a_second(config: str) -> None:
    run = subprocess.run([sys.executable, "-c", _IMPORTS_PROBE, "check-config", str(REPO / "recipes" / config)],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert run.returncode == 0, run.stderr
    probe = json.loads(run.stdout.strip().splitlines()[-1])
    assert probe["code"] == 0 and probe["imported"] == [], probe
    assert probe["seconds"] < 1.0, probe  # importing torch alone takes 1-20 s


def test_check_config_leaves_model_loading_alone() -> None:
    from hf_zero.cli import main
    from hf_zero.config import live

    made_live: list[bool] = []
    live.on_live_zero3_config(lambda: made_live.append(True))
    try:
        assert main(["check-config", str(REPO / "recipes" / "zero3.json")]) == 0
    finally:
        live._listeners.pop()
    assert not made_live, "check-config made its stage-3 config the live one (which hooks from_pretrained)"


@pytest.mark.parametrize("error,words", [
    (PermissionError(13, "Permission denied"), "PermissionError: [Errno 13] Permission denied"),
    (OSError(28, "No space left on device"), "OSError: [Errno 28] No space left on device"),
    (NotImplementedError("AMSGrad state cannot be converted"), "NotImplementedError: AMSGrad state cannot be converted"),
    (RecursionError("maximum recursion depth exceeded"), "RecursionError: the input is nested too deeply to read"),
    (MemoryError(), "MemoryError: the input is too large to read"),
], ids=["permission", "disk-full", "not-implemented", "recursion", "memory"])
def test_an_expected_failure_is_one_line_and_its_empty_output_folder_goes(error, words, tmp_path, capsys,
                                                                           monkeypatch) -> None:
    """[Note: one line per expected failure]: exit 1, one line naming the command, no traceback,
    and the output folder the command made removed when it stayed empty; a folder that was there stays."""
    from hf_zero import cli

    def failing(args, rest):  # noqa: ANN001, ANN202 - the command as it fails midway
        os.makedirs(args.out_dir, exist_ok=True)
        raise error

    monkeypatch.setattr(cli, "_import_deepspeed", failing)
    out = tmp_path / "converted"
    assert cli.main(["import-deepspeed", str(tmp_path), str(out)]) == 1
    err = capsys.readouterr().err
    assert err == f"hf-zero import-deepspeed: {words}\n"
    assert not out.exists()
    out.mkdir()
    assert cli.main(["import-deepspeed", str(tmp_path), str(out)]) == 1
    assert out.is_dir()  # the user's own folder is left as it was


def test_a_bug_keeps_its_traceback(monkeypatch) -> None:
    from hf_zero import cli

    def failing(args, rest):  # noqa: ANN001, ANN202
        raise RuntimeError("an internal error")  # not ours, not an input's: shown whole

    monkeypatch.setattr(cli, "_import_deepspeed", failing)
    with pytest.raises(RuntimeError, match="an internal error"):
        cli.main(["import-deepspeed", "a", "b"])


def test_an_unreadable_latest_is_a_checkpoint_error(tmp_path, monkeypatch) -> None:
    """As root a chmod 000 file stays readable, so the refusal of the read is injected at open."""
    import builtins

    from hf_zero.checkpoint import CheckpointError
    from hf_zero.checkpoint.manifest import read_latest

    (tmp_path / "latest").write_text("global_step1")
    real_open = builtins.open

    def refusing(path, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if str(path).endswith("latest"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", refusing)
    with pytest.raises(CheckpointError, match="latest: cannot be read \\(Permission denied\\); make it readable"):
        read_latest(str(tmp_path), str(tmp_path))


@pytest.mark.parametrize("layers,parameter_limit,words", [
    (2_000_000, None, "describes 2000000 layers (num_hidden_layers), more than 10,000"),
    (2, 20, "more than 20 parameter tensors"),  # a 2-layer Llama registers 21: the build is stopped
], ids=["layers", "parameter-tensors"])
def test_estimate_refuses_a_huge_skeleton_in_one_line_within_seconds(layers, parameter_limit, words, tmp_path,
                                                                     capsys, monkeypatch) -> None:
    """Issue 46: a --model config describing a model far beyond any trained one is refused before
    (layers) or while (parameter tensors) it is built on the meta device, not built for hours."""
    import time

    from hf_zero import cli, estimator

    if parameter_limit is not None:
        monkeypatch.setattr(estimator, "MAX_SKELETON_PARAMETERS", parameter_limit)
    config = {"model_type": "llama", "hidden_size": 8, "intermediate_size": 8, "num_attention_heads": 2,
              "num_key_value_heads": 2, "vocab_size": 16, "num_hidden_layers": layers}
    (tmp_path / "config.json").write_text(json.dumps(config))
    started = time.monotonic()
    assert cli.main(["estimate", "--model", str(tmp_path / "config.json")]) == 1
    assert time.monotonic() - started < 60
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1, err
