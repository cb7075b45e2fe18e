"""One engine, one torchrun: ``python -m torch.distributed.run --nproc_per_node 2 -m engines.worker
--spec SPEC.json`` (``benchmarks/`` on PYTHONPATH; ``bench_engines.py`` writes the spec and starts
it). Every rank trains the workload under the named engine; rank 0 writes every rank's raw
figures to the spec's ``out`` path. The driver turns them into the table.

[Note: the timed step]
Each step starts after a barrier (so every rank starts the clock together; the barrier is not
timed) and is timed as forward + backward, then optimizer step (clip, step, zero grads), with the
model-state probe of the last step between the two and outside both timings. On a GPU each
phase ends with ``torch.cuda.synchronize``. The loss is read (``.item()``) after the step, outside
the timing. The first ``warmup`` steps are left out of every figure.
"""

from __future__ import annotations

# The collective counter goes in before anything that might cache torch.distributed functions
# (see [Note: where the wrapper sits] in comm_counter.py).
from engines.comm_counter import COUNTER, totals  # noqa: I001  (must come first)

COUNTER.install()

import argparse  # noqa: E402
import gc  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from engines import ENGINES  # noqa: E402
from engines import probes  # noqa: E402
from engines.base import Runner  # noqa: E402
from engines.workload import Workload, make_batches  # noqa: E402

PROFILE_STEPS = 3


def _device(workload: Workload) -> torch.device:
    if workload.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _comm_entry(by_op: dict[str, dict[str, int]]) -> dict[str, Any]:
    return {"by_op": by_op, **totals(by_op)}


def train(runner: Runner, workload: Workload, batches: list[torch.Tensor], device: torch.device) -> dict[str, Any]:
    """The timed loop (see [Note: the timed step]); this rank's raw figures."""
    out: dict[str, Any] = {"loss": [], "fwd_bwd_s": [], "opt_s": [], "comm": [], "engine_comm": []}
    window: dict[str, Any] = {}
    for step in range(workload.steps):
        dist.barrier()
        if step == workload.warmup:
            window.update(wall=time.perf_counter(), cpu=probes.process_cpu_s(), machine=probes.machine_cpu_s())
        COUNTER.reset()
        runner.reset_engine_comm_stats()
        start = time.perf_counter()
        loss = runner.forward_backward(batches[step])
        _sync(device)
        fwd_bwd_end = time.perf_counter()
        if step == workload.steps - 1:
            tally = runner.model_state()
            out["model_state"] = tally.model_state()
            out["model_state_detail"] = dict(tally.detail)
            out["engine_buffers_bytes"] = int(tally.bytes.get("engine_buffers", 0))
            out["engine_buffers_resident_bytes"] = tally.resident_bytes("engine_buffers") if device.type == "cpu" else None
        opt_start = time.perf_counter()
        runner.optimizer_step()
        _sync(device)
        end = time.perf_counter()
        out["comm"].append(_comm_entry(COUNTER.snapshot()))
        engine_comm = runner.engine_comm_stats()
        # An engine that issued no collective (world size 1) counts zero bytes, not "not counted".
        out["engine_comm"].append(None if engine_comm is None else _comm_entry(engine_comm))
        out["fwd_bwd_s"].append(fwd_bwd_end - start)
        out["opt_s"].append(end - opt_start)
        out["loss"].append(float(loss.float().item()))
    out["model_state_post_step"] = runner.model_state().model_state()
    out["window"] = {
        "wall_s": time.perf_counter() - window["wall"], "cpu_s": probes.process_cpu_s() - window["cpu"],
        "machine_start": window["machine"], "machine_end": probes.machine_cpu_s(),
    }
    return out


def profile(runner: Runner, batches: list[torch.Tensor], directory: str, label: str, device: torch.device) -> str:
    """A few more steps under torch.profiler, exported as a chrome trace (after the timed loop,
    so the trace's overhead touches no figure)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{label}_rank{dist.get_rank()}.json")
    with torch.profiler.profile(activities=activities) as prof:
        for batch in batches:
            with torch.profiler.record_function("bench::step"):
                runner.forward_backward(batch)
                runner.optimizer_step()
            _sync(device)
    prof.export_chrome_trace(path)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one engine of bench_engines.py (run under torchrun)")
    parser.add_argument("--spec", required=True, help="JSON written by bench_engines.py")
    spec = json.loads(open(parser.parse_args(argv).spec).read())
    workload = Workload.from_dict(spec["workload"])
    torch.set_num_threads(int(spec.get("threads", 1)))
    device = _device(workload)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank()
    rss_base = probes.rss_mib()
    extra = PROFILE_STEPS if spec.get("profile_dir") else 0
    batches = make_batches(workload, rank, workload.steps + extra, device)

    module_name, engine_options = ENGINES[spec["engine"]]
    module = importlib.import_module(f"engines.{module_name}")
    COUNTER.reset()
    runner: Runner = module.build(workload, {**engine_options, **spec.get("options", {})}, device)
    comm_init = _comm_entry(COUNTER.snapshot())
    result: dict[str, Any] = {
        "rank": rank, "rss_base_mib": rss_base, "rss_after_init_mib": probes.rss_mib(),
        "comm_init": comm_init, "unwrapped_refs": COUNTER.unwrapped_refs(),
    }
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    result.update(train(runner, workload, batches, device))
    result["peak_rss_mib"] = probes.peak_rss_mib()
    if device.type == "cuda":
        result["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    if extra and runner.supports_profile:
        result["profile_trace"] = profile(runner, batches[workload.steps:], spec["profile_dir"], spec["label"], device)
    result["info"] = runner.info() if rank == 0 else None
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(spec["out"], "w") as handle:
            json.dump({"engine": spec["engine"], "world_size": dist.get_world_size(), "ranks": gathered},
                      handle, default=str)
    dist.barrier()
    # DDP's reducer keeps the gloo group alive past destroy_process_group; at interpreter exit its
    # threads were then torn down joinable ("terminate called without an active exception",
    # SIGABRT, about one DDP run in six on a 2-core machine), failing a run whose results were
    # already written. Drop the engine first, then the group.
    del runner
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Everything is written; skip the interpreter teardown where the abort above happened.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
