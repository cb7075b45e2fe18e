"""One rank of a simulated world, measured: what ``hf-zero estimate --simulate`` runs and what
tests/distributed/test_simulated_scale.py measures with (one implementation of both).

[Note: simulated rank]
torch's fake process group (``torch.testing._internal.distributed.fake_pg``) lets one process
play rank r of N: every collective completes at once and moves nothing, so the values a forward
computes are meaningless, but the buffers are the real ones. The model is built with
``from_config`` under a live stage-3 config (sharded initialisation: each module is materialised
alone, filled and dropped to this rank's shards), ``hf_zero.initialize`` runs, then one forward,
backward and step. Measured: the rank's states (``engine.memory_report()``), padding, the time
of each phase and the peak resident growth of the forward and backward over the states (Linux
``VmHWM``, restarted through ``/proc/self/clear_refs``). Weights are filled with a constant, not
transformers' random draws, which cost the same at every world size and mean nothing here.

``python -m hf_zero.simulate SPEC_JSON`` runs one rank in this process and prints ``PROGRESS``
lines and one ``RESULT`` line; ``hf-zero estimate --simulate`` starts it in a subprocess with
CUDA hidden (the engine computes on a GPU whenever it sees one), so that the fake group never
meets a real one. Nothing here imports torch at module level: the CLI imports this module.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

PROGRESS_MARK = "PROGRESS "
RESULT_MARK = "RESULT "
STATE_CATEGORIES = ("compute_params", "gradients", "fp32_master", "optimizer_state")
COMPUTE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
ADAM_STATE_BYTES = 8
# Python, torch and transformers imported, before any model: about 0.6 GB resident, rounded up.
INTERPRETER_BYTES = 1 << 30
# Variables a launcher sets; the simulated rank must not read them (they name a real group).
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# ------------------------------------------------------------------ measuring (in the rank)
def rss(field: str = "VmRSS") -> int:
    """``VmRSS`` or ``VmHWM`` (the peak since the last ``reset_peak``) of this process, in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def reset_peak() -> int:
    """Restart VmHWM from the current resident size; returns that size."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss("VmRSS")


def measure_step(engine: Any, input_ids: Any, **inputs: Any) -> dict[str, Any]:
    """One forward, backward and step on ``input_ids`` (its own labels): the peak resident growth
    of the forward and backward over what the rank held before (its states), the time of all
    three, and ``memory_report()`` after the step (every state category allocated). ``inputs``:
    the model's other inputs (an image for a vision-language model). The fp32 gradient shards,
    which the step's first reductions would allocate, are allocated before the measurement: they
    are states (the estimator's gradients), not working memory, and at full depth they are a
    sizeable part of a rank's states (0.47 GiB at the Llama-3-8B shape on 64 ranks)."""
    for unit in engine.units:
        for group in unit.trainable_groups:
            group.grads.ensure_shard()
    engine.reset_comm_stats()
    before = reset_peak()
    start = time.perf_counter()
    loss = engine(input_ids=input_ids, labels=input_ids, **inputs).loss
    engine.backward(loss)
    peak = rss("VmHWM") - before
    engine.step()
    return {"peak_above_states": peak, "fwd_bwd_step_s": time.perf_counter() - start,
            "memory": engine.memory_report(), "comm": engine.comm_stats()}


def state_bytes(memory: dict[str, int]) -> int:
    """The model states of a ``memory_report()``: what the estimator's device column counts."""
    return sum(memory[k] for k in STATE_CATEGORIES)


def state_padding(layout: list[dict[str, Any]], compute_bytes: int) -> tuple[float, float]:
    """(padded, unpadded) bytes of a rank's stage-3 states after a step, from ``engine.layout()``:
    a persistent group's full buffer on every rank, every shard 1/N of its group ([Note: memory
    formulas] in estimator.py: fp32 gradient shard, fp32 master unless c = 4, Adam's moments)."""
    trainable_shard_bytes = 4 + (4 if compute_bytes != 4 else 0) + ADAM_STATE_BYTES
    padded = unpadded = 0.0
    for g in layout:
        world = g["world_size"]
        per_shard = trainable_shard_bytes * g["trainable"] + compute_bytes * (not g["persistent"])
        full = compute_bytes * g["persistent"]
        padded += full * g["padded_numel"] + per_shard * g["padded_numel"] // world
        unpadded += full * g["numel"] + per_shard * g["numel"] / world
    return padded, unpadded


def fill_constant(module: Any) -> None:
    """Stands in for ``_init_weights`` (see the module docstring): the module is real and whole."""
    for param in module.parameters(recurse=False):
        param.fill_(0.01)


def skip_random_init(model: Any) -> Any:
    """``model`` with every ``_init_weights`` replaced by ``fill_constant``."""
    import transformers

    for module in model.modules():
        if isinstance(module, transformers.PreTrainedModel):
            module._init_weights = fill_constant
    return model


def largest_module_bytes(model: Any, compute_bytes: int) -> int:
    """The most parameter bytes one module holds directly: what sharded initialisation
    materialises at once."""
    return max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()) * compute_bytes


# ------------------------------------------------------------------ the rank (in the subprocess)
def live_config(spec: dict[str, Any]) -> dict[str, Any]:
    """The stage-3 config of the estimate's flags."""
    zero = {"stage": 3, "stage3_param_persistence_threshold": spec["persistence_threshold"],
            "reduce_bucket_size": spec["reduce_bucket_size"],
            "stage3_max_reuse_distance": spec["max_reuse_distance"],
            "stage3_max_live_parameters": spec["max_live_parameters"],
            "stage3_prefetch_bucket_size": spec["prefetch_bucket_size"],
            "mics_shard_size": spec.get("shard_group_size") or -1,
            "zero_quantized_weights": bool(spec.get("quantized_weights")),
            "zero_hpz_partition_size": spec.get("hpz_partition_size") or 1,
            "zero_quantized_gradients": bool(spec.get("quantized_gradients"))}
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": spec["micro_batch"],
                              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": zero}
    if spec["dtype"] != "fp32":
        config[spec["dtype"]] = {"enabled": True}
    return config


def play_rank(spec: dict[str, Any], progress: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Rank ``spec['rank']`` of a fake world of ``spec['world']``: build, initialize, one step."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import hf_zero
    from hf_zero.activations import enable_checkpointing
    from hf_zero.estimator import meta_model

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[spec["dtype"]]
    # The simulated rank's node ([Note: bytes between nodes] in hf_zero.comm.collectives).
    os.environ["LOCAL_WORLD_SIZE"] = str(spec.get("gpus_per_node") or spec["world"])
    dist.init_process_group("fake", store=FakeStore(), rank=spec["rank"], world_size=spec["world"])
    try:
        live = hf_zero.HfZeroConfig(live_config(spec))  # alive: from_config builds on the meta device
        progress("[1/3] building the model with from_config under a live stage-3 config")
        start = time.perf_counter()
        model = skip_random_init(meta_model(spec["model"], dtype=dtype))
        if spec.get("gradient_checkpointing"):
            enable_checkpointing(model)
        build_s = time.perf_counter() - start
        progress(f"[2/3] hf_zero.initialize as rank {spec['rank']} of {spec['world']} "
                 f"(each module materialised alone, then sharded; built in {build_s:.1f} s)")
        gc.collect()
        before = reset_peak()
        start = time.perf_counter()
        engine, *_ = hf_zero.initialize(model=model, config=live)
        init_s, init_peak = time.perf_counter() - start, rss("VmHWM") - before
        vocab = getattr(model.config, "vocab_size", None) or 2
        progress(f"[3/3] one forward+backward+step of {spec['micro_batch']} x {spec['seq']} random tokens "
                 f"(initialized in {init_s:.1f} s)")
        ids = torch.randint(0, vocab, (spec["micro_batch"], spec["seq"]), generator=torch.Generator().manual_seed(0))
        at_init = engine.memory_report()
        step = measure_step(engine, ids)
        return {"rank": engine.rank, "world_size": engine.world_size, "model_class": type(model).__name__,
                "build_s": build_s, "init_s": init_s, "init_peak": init_peak, "memory_at_init": at_init,
                "layout": engine.layout(), "seq": spec["seq"],
                "gradient_checkpointing": bool(spec.get("gradient_checkpointing")), **step}
    finally:
        dist.destroy_process_group()


def _main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    result = play_rank(spec, lambda line: print(PROGRESS_MARK + line, flush=True))
    print(RESULT_MARK + json.dumps(result), flush=True)
    return 0


# ------------------------------------------------------------------ the caller's side (no torch)
def available_host_bytes() -> int | None:
    """``MemAvailable`` of /proc/meminfo, or None where there is none (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None


def rank_env() -> dict[str, str]:
    """The environment of a simulated rank's process: this one's, less a launcher's variables."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env["CUDA_VISIBLE_DEVICES"] = ""  # the engine computes on a GPU whenever it sees one
    env["HF_ZERO_CHECK_ASYNC"] = "0"  # the checking mode writes every freed buffer: it would be measured
    # Every allocation of 64 KiB or more its own mapping, returned at free: the resident peak then
    # follows the live tensors. glibc's default raises the threshold up to 32 MiB after a free, and
    # freed buffers under it stay in the heap: +2.2% of the peak at a 134M-parameter Llama's shape.
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    return env


def run_rank_subprocess(spec: dict[str, Any], progress: Callable[[str], None]) -> dict[str, Any]:
    """``play_rank`` in a fresh interpreter with CUDA hidden; ``progress`` gets each phase's line
    as it starts. Raises RuntimeError with the rank's stderr tail when it fails."""
    env = rank_env()
    result = None
    # stderr to a file: transformers' warnings must not fill a pipe nobody reads while stdout is read
    with tempfile.TemporaryFile("w+") as errors:
        proc = subprocess.Popen([sys.executable, "-m", "hf_zero.simulate", json.dumps(spec)], env=env,
                                stdout=subprocess.PIPE, stderr=errors, text=True)
        for line in proc.stdout or ():
            if line.startswith(PROGRESS_MARK):
                progress(line[len(PROGRESS_MARK):].rstrip("\n"))
            elif line.startswith(RESULT_MARK):
                result = json.loads(line[len(RESULT_MARK):])
        proc.wait()
        errors.seek(0)
        stderr = errors.read()
    if proc.returncode != 0 or result is None:
        raise RuntimeError(f"the simulated rank failed (exit status {proc.returncode}):\n{stderr[-4000:]}")
    return result


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
