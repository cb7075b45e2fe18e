"""The ``hf-zero`` command explains itself: every subcommand's ``--help`` works and describes
every option, and every flag the README shows for a subcommand exists."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from hf_zero.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
SUBCOMMANDS = ["demo", "check-config", "export", "estimate", "launch"]


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


def test_demo_help_lists_the_demos_own_flags():
    demo = _subparsers()["demo"]
    flags = {s for a in demo._actions for s in a.option_strings}
    assert {"--nproc", "--stage", "--steps", "--dtype", "--json"} <= flags
    out = subprocess.run([sys.executable, "-m", "hf_zero.demo", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "usage: python -m hf_zero.demo" in out.stdout
    assert "ZeRO stage (default: 3)" in out.stdout


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
