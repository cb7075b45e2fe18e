"""``hf-zero doctor`` verifies a GPU install: it prints what the machine has, refuses loudly
(exit 1) where CUDA is missing, and calls a suite run a pass only when nothing was skipped.

The no-CUDA refusal runs with ``CUDA_VISIBLE_DEVICES=""``, so it holds on a GPU machine too; the
verdict is checked on real pytest runs of small test files (the CUDA suite itself needs a GPU).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_zero.doctor import (
    PASS_LOOKS_LIKE,
    SUITE_MODULE,
    parse_counts,
    run_suite,
    suite_files,
    verdict,
)

REPO = Path(__file__).resolve().parents[2]


def _doctor(*flags: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-m", "hf_zero.cli", "doctor", *flags], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def test_doctor_without_cuda_prints_the_facts_and_fails_loudly() -> None:
    run = _doctor()
    assert run.returncode == 1, run.stdout + run.stderr
    for fact in ("torch ", "CUDA ", "NCCL ", "gloo ", "triton ", "pinned host memory ", "transformers "):
        assert any(line.startswith(fact) for line in run.stdout.splitlines()), (fact, run.stdout)
    assert "CUDA         NOT available: " in run.stdout
    assert "CUDA suite NOT RUN: no CUDA device: " in run.stderr
    assert PASS_LOOKS_LIKE in run.stderr
    assert "running:" not in run.stdout  # pytest is not started without CUDA
    assert "Traceback" not in run.stderr


def test_doctor_facts_only_exits_zero() -> None:
    run = _doctor("--facts-only")
    assert run.returncode == 0, run.stderr
    assert "CUDA suite" not in run.stdout + run.stderr


def test_suite_files_are_the_cuda_suites_and_exist() -> None:
    files = suite_files(REPO)
    assert "tests/kernels/test_cuda.py" in files and "tests/distributed/test_fake_world.py" in files
    assert all((REPO / f).is_file() for f in files), files
    assert (REPO / SUITE_MODULE).is_file()


def test_parse_counts_reads_pytest_summary_lines() -> None:
    assert parse_counts("....\n26 skipped in 0.23s\n") == {"skipped": 26}
    assert parse_counts("x\n3 failed, 55 passed, 2 skipped, 1 warning in 130.02s (0:02:10)\n") == {
        "failed": 3, "passed": 55, "skipped": 2, "warning": 1}
    assert parse_counts("ERROR collecting\n1 error in 0.5s\n") == {"error": 1}
    assert parse_counts("no summary here") == {}


def _suite(tmp_path: Path, body: str) -> tuple[bool, str]:
    (tmp_path / "test_suite_case.py").write_text("import pytest\n\n" + body)
    return verdict(run_suite(tmp_path, ["test_suite_case.py"]))


@pytest.mark.parametrize("body, passed, words", [
    ("def test_a():\n    pass\n", True, "CUDA suite PASSED: 1 passed in "),
    ("def test_a():\n    pass\n\n\ndef test_b():\n    pytest.skip('compiled triton is not available')\n",
     False, "a skipped test did not check its GPU path"),
    ("def test_a():\n    pytest.skip('CUDA suite NOT RUN: no CUDA device; run on a GPU machine with x')\n",
     False, "CUDA suite NOT RUN: no CUDA device"),
    ("def test_a():\n    assert False\n", False, "CUDA suite FAILED (pytest exit 1): 1 failed in "),
], ids=["passed", "skipped", "loud-skip", "failed"])
def test_only_a_run_with_nothing_skipped_is_a_pass(tmp_path: Path, body: str, passed: bool, words: str) -> None:
    ok, line = _suite(tmp_path, body)
    assert ok is passed and words in line, line


def test_readme_gpu_section_points_to_the_doctor() -> None:
    gpu = (REPO / "README.md").read_text().split("- **Two or more GPUs**", 1)[1].split("\n- **", 1)[0]
    assert "hf-zero doctor" in gpu
