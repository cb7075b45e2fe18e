"""The README's main job, ``hf-zero demo`` with its defaults: a real 2-process run whose logged
loss never rises above the first step's, that holds the ZeRO formula's model states, prints
nothing but its progress bar and summary, says what it showed and what its JSON counts, and
leaves nothing in the temporary directory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.integration.conftest import REPO, subprocess_env


SUMMARY_LINES = ("hf_zero demo: ", "loss ", "memory per rank (MiB): ", "what this showed: ")


def test_demo_learns_holds_the_formula_and_says_so(tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**subprocess_env(), "TMPDIR": str(tmp)}
    del env["OMP_NUM_THREADS"]  # as a user's shell has it: torchrun would print a banner
    run = subprocess.run([sys.executable, "-m", "hf_zero.cli", "demo", "--json", str(out)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    # The saved model (21 MB) and torchrun's log folders are removed; torch's own inductor
    # cache folder may stay.
    assert not [p.name for p in tmp.iterdir() if p.name.startswith(("hf_zero_demo", "torchelastic_"))]
    # Nothing but the bar (on stderr, redrawn with carriage returns) and the summary: no
    # launcher banner, no saving or loading bars, no DeepSpeed or transformers warnings.
    noise = [line for line in run.stderr.replace("\r", "\n").splitlines() if line and not line.startswith("ZeRO-3 x2:")]
    assert not noise, noise
    rank_lines = [line for line in run.stdout.splitlines() if line.startswith("  ")]
    assert len(rank_lines) == 2, run.stdout
    other = [line for line in run.stdout.splitlines() if line and line not in rank_lines]
    assert len(other) == 4 and all(line.startswith(prefix) for line, prefix in zip(other, SUMMARY_LINES)), run.stdout
    assert "padding" not in run.stdout  # the states equal the formula here: no excess to explain
    summary = json.loads(out.read_text())
    # The loss starts near ln(8192) = 9.05 and ends near 3.9; the bar shows rank 0's, the summary
    # the ranks' mean: neither rises above its first step's ([Note: the demo's schedule]).
    assert summary["loss_first"] - summary["loss_last"] > 4.0
    steps = len(summary["per_rank"][0]["loss"])
    assert steps == 40
    mean = [sum(r["loss"][i] for r in summary["per_rank"]) / 2 for i in range(steps)]
    rank0 = summary["per_rank"][0]["loss"]
    assert max(mean[1:]) < mean[0] - 0.01 and max(rank0[1:]) < rank0[0] - 0.01, (mean, rank0)
    for rank in summary["per_rank"]:
        m = rank["memory"]
        states = m["compute_params"] + m["gradients"] + m["fp32_master"] + m["optimizer_state"]
        assert summary["formula"] == "16Ψ/N"
        assert 1.0 <= states / summary["formula_bytes"] < 1.01  # padding only
    assert "what this showed: the loss fell by" in run.stdout
    assert "ZeRO-3, 2 processes on cpu, fp32" in run.stdout and summary["device"] == "cpu"
    comm = summary["comm"]  # what the JSON counts is named, and per_step is per step
    assert comm["steps"] == 40 and "over the 40 training steps (initialize excluded)" in comm["counts"]
    for kind, total in comm["total"].items():
        assert {k: v * 40 for k, v in comm["per_step"][kind].items()} == total
    assert comm["per_step"]["reduce_scatter"]["calls"] >= 1 and "comm_per_step" not in summary
