"""The two-node recipe on one machine: two `torchrun --nnodes 2 --node_rank {0,1}` invocations
joined by c10d rendezvous on loopback (gloo; with c10d, torchrun ignores --node_rank and ranks
follow the joining order), each starting one process of the Trainer-less
example (recipes/examples/train_engine.py) at ZeRO stage 3."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.distributed.launch import free_port
from tests.integration.conftest import LAUNCH_TIMEOUT_S, REPO, subprocess_env


def test_two_node_launch_on_loopback_completes_a_zero3_run(model_dirs: dict[str, str], tmp_path: Path) -> None:
    port = free_port()
    procs = []
    for node_rank in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
               "--node_rank", str(node_rank), "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}",
               "--rdzv_id", "hf_zero_two_nodes",
               # both "nodes" resolve 127.0.0.1 as their own address, so say which one hosts the
               # rendezvous store (on real nodes torchrun works it out from the hostname)
               "--rdzv_conf", f"is_host={'true' if node_rank == 0 else 'false'}", str(REPO / "recipes" / "examples" / "train_engine.py"),
               "--model_name_or_path", model_dirs["gpt2"], "--zero_config", str(REPO / "recipes" / "zero3.json"),
               "--losses_out", str(tmp_path / f"node{node_rank}.json")]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=LAUNCH_TIMEOUT_S)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for node_rank, (proc, output) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"node {node_rank} failed:\n{output[-8000:]}"
    nodes = [json.loads((tmp_path / f"node{r}.json").read_text()) for r in (0, 1)]
    assert sorted(n["rank"] for n in nodes) == [0, 1]  # c10d assigns ranks in joining order
    assert all(n["world_size"] == 2 and n["global_steps"] == 6 for n in nodes)
    assert nodes[0]["losses"] == nodes[1]["losses"]  # all-reduced: the same on both nodes
    assert any("done: 6 steps, world size 2" in out for out in outputs)
