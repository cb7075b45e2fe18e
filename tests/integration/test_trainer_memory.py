"""Through an unmodified run_clm-shaped Trainer script (trainer_memory/clm_script.py, which loads
the model with run_clm's ``from_pretrained`` keywords) on a 134M-parameter Llama, 2 ranks, fp32,
every run under glibc's default allocator unless it says otherwise:

- hf_zero ZeRO-3 with the README's recipe peaks at most 0.75x the resident memory per rank of
  the same script under DDP, with the same losses (measured 0.71x: DDP 3446 MB, hf_zero 2433 MB; DeepSpeed ZeRO-3
  measures 0.95x in benchmarks/bench_trainer_memory.py). The engine changes no allocator
  setting ([Note: the buffer pool]). The recipe's reuse distance keeps every decoder layer
  gathered from its forward to its backward, as DeepSpeed does; what keeps the peak down is that
  a gathered unit's shard lends its memory to the gathered buffer ([Note: the shard lent to the
  gathered buffer]) and that the shards a rank keeps for the run live in mappings of their own,
  outside the heap the activations churn ([Note: memory kept for the run]): without both the run
  measured 0.77-0.79x. Sharding itself is what the bound checks too: states that were not
  sharded would put hf_zero at or above DDP (8 of DDP's 16 bytes per parameter are saved).
- With glibc's threshold fixed (``MALLOC_MMAP_THRESHOLD_=131072``, the memory-first opt-in that
  docs/loading.md describes) for hf_zero, its peak is at most 0.75x DDP's at the defaults
  (measured 0.66x)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.trainer_memory.runs import build_model, run_mode, write_configs

STEPS = 4
MAX_RATIO_AT_DEFAULTS = 0.75
MAX_RATIO_MEMORY_FIRST = 0.75
MEMORY_FIRST = {"MALLOC_MMAP_THRESHOLD_": "131072"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    work = Path(tmp_path_factory.mktemp("trainer_memory"))
    params = build_model(work / "model")
    assert params > 130e6  # a real-sized model: model states dominate the runtime's own memory
    configs = write_configs(work)
    runs = {mode: run_mode(mode, work / "model", work, STEPS, configs, timeout=420) for mode in ("ddp", "hf_zero3")}
    runs["memory_first"] = run_mode("hf_zero3", work / "model", work, STEPS, configs, timeout=420,
                                    allocator_env=MEMORY_FIRST, label="hf_zero3-memory-first")
    for name, run in runs.items():
        assert run["ok"], (name, run.get("error"))
    print(f"peak MB per rank: DDP {runs['ddp']['peak_rss_mb']}, hf_zero stage 3 {runs['hf_zero3']['peak_rss_mb']}, "
          f"with {MEMORY_FIRST} {runs['memory_first']['peak_rss_mb']}")
    return runs


def test_stage3_trainer_peak_is_below_ddp_at_the_allocator_defaults_with_the_same_losses(runs):
    ddp, zero = runs["ddp"], runs["hf_zero3"]
    assert len(zero["loss"]) == len(ddp["loss"]) == STEPS
    assert zero["loss"] == pytest.approx(ddp["loss"], abs=2e-4)  # the Trainer logs 4 decimals
    ratio = max(zero["peak_rss_mb"]) / max(ddp["peak_rss_mb"])
    assert ratio <= MAX_RATIO_AT_DEFAULTS, (zero["peak_rss_mb"], ddp["peak_rss_mb"])


def test_stage3_trainer_peak_with_the_memory_first_opt_in_is_at_most_0_75x_ddp(runs):
    ddp, zero = runs["ddp"], runs["memory_first"]
    assert zero["loss"] == pytest.approx(ddp["loss"], abs=2e-4)
    assert max(zero["peak_rss_mb"]) <= MAX_RATIO_MEMORY_FIRST * max(ddp["peak_rss_mb"]), (
        zero["peak_rss_mb"], ddp["peak_rss_mb"])
