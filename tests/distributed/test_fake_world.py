"""One process plays rank r of a world of 8 (torch's fake process group): every path a world-8
rank takes (sharding, gathers, bucketed reduce-scatter, the step) runs on one machine, on the
CPU in CI and on one GPU where there is one.

The fake group completes every collective at once without talking to anyone: an all-gather fills
the output with copies of this rank's shard, a reduce-scatter keeps this rank's chunk, an
all-reduce leaves its input as it is. So values are not what a real world computes (the parity
tests of world 2 and 3 check those); what is checked is that the step completes, that each rank
holds its 1/8 share of the model state (a hand calculation from the model's parameter count,
within the padding of [Note: alignment in flat buffers]), and that the step issues the
collectives and volumes of a world-8 step (ZeRO's 2Ψ at stage 3 with the reuse distance).

Each device runs in a subprocess of its own, so the fake group never meets the other tests."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.cuda_suite import require_cuda
from tests.distributed.launch import run_process_tree

WORLD = 8
RANKS = (5, 0)
DTYPES = ("fp32", "bf16")
STEPS = 2
RESULT_MARK = "FAKE_WORLD_RESULT "
REPO = Path(__file__).resolve().parents[2]
# Bytes per element of this rank's shard, by category, after a step: fp32 masters alias the fp32
# compute shard ([Note: master aliasing]); gradient shards are fp32; AdamW keeps two fp32 moments.
BYTES_PER_ELEMENT = {
    "fp32": {"compute_params": 4, "gradients": 4, "fp32_master": 0, "optimizer_state": 8},
    "bf16": {"compute_params": 2, "gradients": 4, "fp32_master": 4, "optimizer_state": 8},
}


# ------------------------------------------------------------------ in the subprocess
def play_rank(rank: int, dtype: str) -> dict[str, Any]:
    """Rank ``rank`` of a fake world of WORLD: initialize at stage 3, STEPS training steps."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import hf_zero
    from tests.distributed import scenarios as S

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=WORLD)
    try:
        sc = S.scenario("llama", 3, dtype=dtype, steps=STEPS)
        model = S.build_model(sc)
        model_numel, slots = sum(p.numel() for p in model.parameters()), len(list(model.parameters()))
        engine, *_ = hf_zero.initialize(model=model, config=S.make_config(sc))
        at_init = engine.memory_report()
        comm, step_s, losses = [], [], []
        for step in range(STEPS):
            engine.reset_comm_stats()
            start = time.perf_counter()
            batch = S.learnable_batch(step, WORLD * sc["micro"])[rank * sc["micro"]:][:sc["micro"]]
            loss = S.model_loss(engine, "llama", batch.to(engine.device))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if engine.device.type == "cuda":
                torch.cuda.synchronize()
            step_s.append(time.perf_counter() - start)
            comm.append(engine.comm_stats())
        global_steps = engine.global_steps
        syncs = _count_host_syncs(engine, S, rank, sc)
        return {"rank": engine.rank, "world_size": engine.world_size, "device": engine.device.type,
                "global_steps": global_steps, "losses": losses, "step_s": step_s, "host_syncs": syncs,
                "model_numel": model_numel, "slots": slots, "memory_at_init": at_init,
                "memory": engine.memory_report(), "comm": comm,
                "layout": [{**{k: g[k] for k in ("trainable", "persistent", "numel", "padded_numel", "world_size")},
                            "params": len(g["slots"])} for g in engine.layout()]}
    finally:
        dist.destroy_process_group()


def _count_host_syncs(engine: Any, S: Any, rank: int, sc: dict[str, Any]) -> dict[str, int]:
    """One more step, counted ([Note: host synchronisations] in hf_zero.execution.host_sync), on a
    GPU also under torch's sync debug mode, whose warnings from hf_zero's files are added (the
    model's own, transformers' mask check, are not the engine's); without the checking mode of
    [Note: late completion], whose comparisons are host reads by design."""
    import warnings

    from hf_zero.execution import checking
    from hf_zero.execution.host_sync import HostSyncCounter

    batch = S.learnable_batch(STEPS, WORLD * sc["micro"])[rank * sc["micro"]:][:sc["micro"]]
    on_gpu = engine.device.type == "cuda"
    with checking(False), warnings.catch_warnings(record=True) as caught:
        # A step first, so that nothing the checking mode launched is still waited in the counted one.
        engine.backward(S.model_loss(engine, "llama", batch.to(engine.device)))
        engine.step()
        warnings.simplefilter("always")
        if on_gpu:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with HostSyncCounter(engine.device) as counter:
                engine.backward(S.model_loss(engine, "llama", batch.to(engine.device)))
                engine.step()
        finally:
            if on_gpu:
                torch.cuda.set_sync_debug_mode("default")
    found = counter.by_place()
    for warning in caught:
        if "synchroniz" in str(warning.message) and f"{os.sep}hf_zero{os.sep}" in warning.filename:
            where = f"cuda sync at {warning.filename}:{warning.lineno}"
            found[where] = found.get(where, 0) + 1
    return found


def _main() -> None:
    results = {f"{dtype}_rank{rank}": play_rank(rank, dtype) for rank in RANKS for dtype in DTYPES}
    print(RESULT_MARK + json.dumps(results), flush=True)


# ------------------------------------------------------------------ the test
def _run(device: str) -> dict[str, dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *sys.path])
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the engine computes on a GPU whenever it sees one
    run = run_process_tree([sys.executable, "-m", "tests.distributed.test_fake_world"], timeout=300, env=env,
                           cwd=REPO)
    lines = [line for line in run.stdout.splitlines() if line.startswith(RESULT_MARK)]
    assert run.returncode == 0 and lines, f"rc {run.returncode}\n{run.stdout[-4000:]}\n{run.stderr[-8000:]}"
    return json.loads(lines[-1][len(RESULT_MARK):])


@pytest.fixture(scope="module", params=["cpu", "cuda"])
def played(request: pytest.FixtureRequest) -> tuple[str, dict[str, dict[str, Any]]]:
    if request.param == "cuda":
        require_cuda()
    return request.param, _run(request.param)


def _shard_numel(result: dict[str, Any]) -> int:
    return sum(g["padded_numel"] // g["world_size"] for g in result["layout"])


def test_a_rank_of_a_fake_world_of_8_trains(played) -> None:
    device, results = played
    for name, result in results.items():
        assert result["world_size"] == WORLD and result["rank"] == int(name.split("rank")[1])
        assert result["device"] == device and result["global_steps"] == STEPS
        assert all(g["world_size"] == WORLD for g in result["layout"])
        assert all(abs(loss) < float("inf") for loss in result["losses"]), result["losses"]


def test_a_steady_state_step_makes_no_host_synchronisation(played) -> None:
    """The stand-in of the GPU benchmark's rank 5 of 8: no host read in the engine's step (on a
    GPU, none that torch's sync debug mode sees either)."""
    _, results = played
    for name, result in results.items():
        assert result["host_syncs"] == {}, name


def test_each_rank_holds_its_eighth_of_the_model_state(played) -> None:
    from hf_zero import partition

    _, results = played
    for name, result in results.items():
        shard = _shard_numel(result)
        groups = len(result["layout"])
        # The hand calculation: Ψ/8 per rank, plus at most the padding of every group and every
        # parameter's aligned offset.
        padding = groups * (WORLD * partition.SHARD_ALIGNMENT - 1)
        padding += result["slots"] * (getattr(partition, "PARAM_ALIGNMENT", 1) - 1)
        assert result["model_numel"] <= shard * WORLD <= result["model_numel"] + padding, (name, shard)
        per_element = BYTES_PER_ELEMENT[name.split("_")[0]]
        memory = result["memory"]
        assert {k: memory[k] for k in per_element} == {k: b * shard for k, b in per_element.items()}, name
        assert result["memory_at_init"]["compute_params"] == memory["compute_params"]
        assert result["memory_at_init"]["gradients"] == 0  # stage 3: no gradient held between steps
    for dtype in DTYPES:  # every rank the same share
        assert len({json.dumps(results[f"{dtype}_rank{r}"]["memory"]) for r in RANKS}) == 1


def test_a_step_issues_the_collectives_of_a_world_of_8(played) -> None:
    _, results = played
    for name, result in results.items():
        padded = sum(g["padded_numel"] for g in result["layout"])
        for step_stats in result["comm"]:
            # Stage 3 with the reuse distance: every unit gathered once, every gradient
            # reduce-scattered once (2Ψ), one all-reduce of the step's norm and inf/nan flag
            # (which parameters some rank used goes over the host group, and only when one
            # has a parameter without a gradient: [Note: parameters no rank used]).
            flags = 2
            assert step_stats["all_gather"]["numel"] == padded, (name, step_stats)
            assert step_stats["all_gather"]["calls"] >= 1
            assert step_stats["reduce_scatter"]["numel"] == padded, (name, step_stats)
            assert step_stats["all_reduce"] == {"calls": 1, "numel": flags, "bytes": 4 * flags, "bytes_inside_node": 4 * flags,
                                                "bytes_between_nodes": 0}, (name, step_stats)  # one node
            assert set(step_stats) == {"all_gather", "reduce_scatter", "all_reduce"}


if __name__ == "__main__":
    _main()
