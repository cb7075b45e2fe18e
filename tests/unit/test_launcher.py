"""``hf-zero launch`` with the deepspeed launcher's flags (hf_zero.launcher): which nodes and slots a
command line chooses, as DeepSpeed's launcher chooses them, and the refusals that name the fix;
the runner's reading of DeepSpeed's config flags (hf_zero.run). The launches themselves are in
tests/integration/test_launchers.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_zero import launcher
from hf_zero.launcher import LaunchError, Node, parse_args, plan_nodes, uses_deepspeed_flags
from hf_zero.run import LOCAL_RANK_ARG_ENV, extract_zero_config


def _hostfile(tmp_path: Path, text: str) -> str:
    path = tmp_path / "hostfile"
    path.write_text(text)
    return str(path)


def _plan(argv: list[str]) -> list[Node]:
    return plan_nodes(parse_args([*argv, "train.py"])[0])


def test_deepspeed_flags_are_told_from_accelerate_launch_options() -> None:
    assert uses_deepspeed_flags(["--num_gpus", "2", "train.py"])
    assert uses_deepspeed_flags(["--hostfile=h", "-m", "pkg.train"])
    assert not uses_deepspeed_flags(["--config_file", "a.yaml", "train.py", "--num_gpus", "2"])
    assert not uses_deepspeed_flags(["--num_processes", "2", "-m", "pkg.train"])


def test_the_script_and_its_arguments_are_kept_whole() -> None:
    options, program = parse_args(["--num_gpus=2", "--no_ssh", "--node_rank", "0", "train.py", "--num_gpus", "9"])
    assert options == {"num_gpus": "2", "no_ssh": True, "node_rank": "0"}
    assert program == ["train.py", "--num_gpus", "9"]
    assert parse_args(["--module", "pkg.train", "--x"])[1] == ["-m", "pkg.train", "--x"]


def test_num_gpus_on_one_machine_without_a_hostfile(tmp_path: Path) -> None:
    missing = str(tmp_path / "none")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(launcher, "DEFAULT_HOSTFILE", missing)
        assert _plan(["--num_gpus", "2"]) == [Node("localhost", (0, 1))]
        patch.setattr(launcher, "_local_device_count", lambda: 0)
        with pytest.raises(LaunchError, match="no GPU: give --num_gpus N"):
            _plan([])
    with pytest.raises(LaunchError, match="no such file"):
        _plan(["--hostfile", missing])


def test_a_hostfile_narrowed_by_num_nodes_num_gpus_include_and_exclude(tmp_path: Path) -> None:
    hostfile = _hostfile(tmp_path, "# a comment\nworker-0 slots=4\n\nworker-1 slots=4  # trailing\nworker-2 slots=4\n")
    every = _plan(["--hostfile", hostfile])
    assert every == [Node(f"worker-{i}", (0, 1, 2, 3)) for i in range(3)]
    assert _plan(["--hostfile", hostfile, "--num_nodes", "2", "--num_gpus", "2"]) == \
        [Node("worker-0", (0, 1)), Node("worker-1", (0, 1))]
    assert _plan(["--hostfile", hostfile, "--include", "worker-1:1,3@worker-2:0,2"]) == \
        [Node("worker-1", (1, 3)), Node("worker-2", (0, 2))]
    assert _plan(["--hostfile", hostfile, "-e", "worker-0@worker-1:0,1@worker-2:2,3"]) == \
        [Node("worker-1", (2, 3)), Node("worker-2", (0, 1))]


@pytest.mark.parametrize("text, flags, message", [
    ("worker-0 4\n", [], "line 1: 'worker-0 4' is not `HOSTNAME slots=N`"),
    ("worker-0 slots=2\nworker-0 slots=2\n", [], "host worker-0 is listed twice"),
    ("# nothing\n", [], "lists no host"),
    ("worker-0 slots=2\n", ["--include", "worker-9"], "host worker-9 is not in the hostfile"),
    ("worker-0 slots=2\n", ["--include", "worker-0:5"], "worker-0 has no slot 5"),
    ("worker-0 slots=2\n", ["--include", "worker-0", "--exclude", "worker-0:1"], "mutually exclusive"),
    ("worker-0 slots=2\n", ["--include", "worker-0", "--num_gpus", "1"], "drop --num_gpus and --num_nodes"),
    ("worker-0 slots=2\n", ["--num_nodes", "2"], "--num_nodes 2, but the hostfile lists 1 host"),
    ("worker-0 slots=2\n", ["--num_gpus", "3"], "--num_gpus 3, but worker-0 has 2 slot"),
    ("worker-0 slots=2\n", ["--exclude", "worker-0"], "no slot is left"),
    ("worker-0 slots=2\nworker-1 slots=1\n", [], "these differ \\(worker-0: 2, worker-1: 1\\)"),
    ("worker-0 slots=2\n", ["--num_gpus", "two"], "--num_gpus 'two': expected a positive integer"),
])
def test_a_bad_hostfile_or_filter_is_refused_with_the_fix(tmp_path: Path, text: str, flags: list[str],
                                                         message: str) -> None:
    with pytest.raises(LaunchError, match=message):
        _plan(["--hostfile", _hostfile(tmp_path, text), *flags])


@pytest.mark.parametrize("argv, message", [
    (["--launcher", "slurm", "train.py"], "--launcher is not supported: .*srun torchrun"),
    (["--num_processes", "2", "--num_gpus", "2", "train.py"], "--num_processes: not a flag of DeepSpeed's launcher"),
    (["--num_gpus", "2"], "no script"),
])
def test_what_this_launcher_cannot_do_names_the_torchrun_way(argv: list[str], message: str) -> None:
    with pytest.raises(LaunchError, match=message):
        parse_args(argv)


def test_another_machine_is_refused_with_each_nodes_torchrun_command(tmp_path: Path) -> None:
    hostfile = _hostfile(tmp_path, "worker-0 slots=2\nworker-1 slots=2\n")
    with pytest.raises(LaunchError) as refused:
        launcher.launch(["--hostfile", hostfile, "train.py", "--deepspeed", "ds.json"], {})
    text = str(refused.value)
    assert "starts no process over ssh: add --no_ssh --node_rank R" in text
    for rank in (0, 1):
        assert (f"on worker-{rank}: CUDA_VISIBLE_DEVICES=0,1 {sys.executable} -m torch.distributed.run --nnodes 2 "
                f"--node_rank {rank} --nproc_per_node 2 --master_addr worker-0 --master_port 29500 "
                "-m hf_zero.run train.py --deepspeed ds.json") in text
    with pytest.raises(LaunchError, match="--no_ssh needs --node_rank R"):
        launcher.launch(["--hostfile", hostfile, "--no_ssh", "train.py"], {})
    with pytest.raises(LaunchError, match="--node_rank 2, but the job has 2 node"):
        launcher.launch(["--hostfile", hostfile, "--no_ssh", "--node_rank", "2", "train.py"], {})
    with pytest.raises(LaunchError, match="--node_rank goes with --no_ssh"):
        launcher.launch(["--hostfile", hostfile, "--node_rank", "1", "train.py"], {})
    mixed = _hostfile(tmp_path, "localhost slots=1\nworker-1 slots=1\n")
    with pytest.raises(LaunchError, match="give --master_addr"):
        launcher.launch(["--hostfile", mixed, "train.py"], {})


def test_the_runner_reads_deepspeeds_config_flags_as_zero_config() -> None:
    assert extract_zero_config(["--deepspeed", "ds.json", "--bf16"]) == ("ds.json", ["--bf16"])
    assert extract_zero_config(["--deepspeed=ds.json"]) == ("ds.json", [])
    # deepspeed.add_config_arguments: a --deepspeed switch, the path in --deepspeed_config, both
    # left for the script, which reads them itself
    assert extract_zero_config(["--deepspeed", "--deepspeed_config", "ds.json", "--x"]) == (
        "ds.json", ["--deepspeed", "--deepspeed_config", "ds.json", "--x"])
    assert extract_zero_config(["--deepspeed_config=ds.json"]) == ("ds.json", ["--deepspeed_config=ds.json"])
    assert extract_zero_config(["--x", "--deepspeed"]) == (None, ["--x", "--deepspeed"])
    assert extract_zero_config(["--zero_config", "ds.json", "--deepspeed", "./ds.json"])[0] == "ds.json"
    with pytest.raises(SystemExit, match="two configs were given \\(--zero_config a.json, --deepspeed b.json\\)"):
        extract_zero_config(["--zero_config", "a.json", "--deepspeed", "b.json"])
    with pytest.raises(SystemExit, match="--deepspeed_config needs a value"):
        extract_zero_config(["--deepspeed_config"])
    with pytest.raises(SystemExit, match="--zero_config= needs a value"):
        extract_zero_config(["--zero_config="])


def test_the_script_gets_local_rank_first_as_under_deepspeeds_launcher(tmp_path: Path) -> None:
    script = tmp_path / "argv.py"
    script.write_text("import json, os, sys\n"
                      f"json.dump([sys.argv[1:], os.environ.get('HF_ZERO_CONFIG')], open({str(tmp_path / 'seen')!r}, 'w'))\n")
    config = tmp_path / "ds.json"
    config.write_text("{}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_ZERO_")}
    run = subprocess.run([sys.executable, "-m", "hf_zero.run", str(script), "--deepspeed", str(config), "--x"],
                         env={**env, LOCAL_RANK_ARG_ENV: "1", "LOCAL_RANK": "3"}, capture_output=True, text=True)
    assert json.loads((tmp_path / "seen").read_text()) == [["--local_rank=3", "--x"], str(config)]
    assert "finished without preparing a model with hf_zero" in run.stderr  # it trained nothing


def test_the_first_node_to_fail_stops_the_others(tmp_path: Path) -> None:
    """Node 1's program exits 3 at once; node 0's would sleep 10 minutes: the launch ends in
    seconds with node 1's status, node 0 stopped (its torchrun and its worker)."""
    import time

    from tests.distributed.launch import free_port

    script = tmp_path / "fail_on_node_1.py"
    marker = tmp_path / "node0-finished"
    script.write_text("import os, sys, time\n"
                      "if os.environ['GROUP_RANK'] == '1':\n    sys.exit(3)\n"
                      f"time.sleep(600)\nopen({str(marker)!r}, 'w').close()\n")
    config = tmp_path / "ds.json"
    config.write_text("{}")
    hostfile = _hostfile(tmp_path, "localhost slots=1\n127.0.0.1 slots=1\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_ZERO_", "RANK", "WORLD_SIZE", "MASTER_"))}
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "hf_zero.cli", "launch", "--hostfile", hostfile, "--master_port",
                          str(free_port()), str(script), "--deepspeed", str(config)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0, run.stdout + run.stderr
    assert time.monotonic() - start < 120, "node 0 was left running"
    assert not marker.exists()
