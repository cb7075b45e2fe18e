"""The two-node recipe on one machine: two `torchrun --nnodes 2 --node_rank {0,1}` invocations
joined by c10d rendezvous on loopback (gloo; with c10d, torchrun ignores --node_rank and ranks
follow the joining order), each starting one process of the Trainer-less
example (recipes/examples/train_engine.py) at ZeRO stage 3."""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
    reference = _single_process_losses(model_dirs["gpt2"], world_size=2, train=True)
    assert nodes[0]["losses"] == pytest.approx(reference, abs=1e-5)
    # the recipe's random tokens teach little, but training moves the losses 100x the tolerance
    untrained = _single_process_losses(model_dirs["gpt2"], world_size=2, train=False)
    assert max(abs(a - b) for a, b in zip(reference, untrained, strict=True)) > 1e-3


def _single_process_losses(model_dir: str, world_size: int, train: bool) -> list[float]:
    """The recipe's run in one process: each micro-step's whole global batch (the rows every rank
    takes a slice of), loss / accumulation steps, clip, torch AdamW (no step when not ``train``);
    the mean loss per micro-step."""
    from transformers import AutoModelForCausalLM

    recipe = runpy.run_path(str(REPO / "recipes" / "examples" / "train_engine.py"))
    args = recipe["parse_args"](["--model_name_or_path", model_dir, "--zero_config", "unused"])
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.1)
    losses = []
    for micro_step in range(args.max_steps * args.gradient_accumulation_steps):
        ids = torch.cat([recipe["micro_batch"](micro_step, rank, world_size, args, model.config.vocab_size)
                         for rank in range(world_size)])
        loss = model(input_ids=ids, labels=ids).loss
        (loss / args.gradient_accumulation_steps).backward()
        losses.append(loss.item())
        if train and (micro_step + 1) % args.gradient_accumulation_steps == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad()
    return losses
