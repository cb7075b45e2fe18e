"""One rank of a simulated world of 8, 64, 512 and 4096 ranks, on real model shapes: torch's fake
process group (``torch.testing._internal.distributed.fake_pg``: one process plays rank r of N and
every collective completes at once without any other process) runs ``hf_zero.initialize`` on
Llama-3-8B, Llama-3-70B, Mixtral-8x7B and Qwen2-VL-7B configs built with ``from_config`` under a live stage-3
config, so loading is sharded ([Note: sharded initialisation] in hf_zero/engine/sharding/param_source.py).
Layer counts are cut to one (the per-layer figures are what is checked; the vocabulary, hidden
and expert sizes are the real ones), all in bf16.

Checked, at every world size and for every model, as rank N - 1 (the rank whose shards hold the
padded tails):
- ``initialize`` completes and the peak resident memory it adds stays under this rank's states
  plus the largest module's parameters (each module is materialised alone, then dropped);
- this rank's states (``engine.memory_report()``) equal the estimator's stage-3 row for the same
  config and world (``estimate_model_states``) within 1%: the categories ``initialize`` allocates
  at every world, the whole row after one step of the 8B shape at world 64;
- padding costs under 1% of the states ([Note: alignment in flat buffers] in partition.py);
- initialization time, printed per rank, does not grow with the world size.
One forward and backward of 16 tokens (values are meaningless: the fake reduce-scatter leaves this
rank's chunk of its input) at world 64, for the 8B and the Mixtral shapes, measures the peak
resident memory above the states: it equals the estimator's stage-3 "+working" column within 10%
([Note: stage-3 working memory] in hf_zero/estimator.py). The two shapes peak in different places:
the 8B one in the embedding's backward (the root's untied head gradient, the layer's gradients in
flight, the embedding's gradient and its dense backward), Mixtral in the layer's backward (its
fused experts' gradient made whole by autograd). The 70B step (27 s) runs with ``--step-every-model``
only, for the table of docs/memory-estimator.md.

Weights are filled with a constant instead of transformers' random draws: under the fake group
values mean nothing, and the draws (about 5 s per 525M elements on a CI core) cost the same at
every world size, so they would hide the world-size dependence this test looks for in CI's time
budget. Each module is still materialised whole and filled, as the real initialisation does.

All of it runs in one subprocess (the fake group must not meet the other tests, and importing
torch and transformers once saves more than parallel worlds would on 2 cores), with late
completion off: it measures memory and time. ``python -m tests.distributed.test_simulated_scale``
prints the tables of docs/memory-estimator.md."""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hf_zero.simulate import (largest_module_bytes, measure_step, rank_env, reset_peak, rss, skip_random_init,
                              state_bytes, state_padding)
from tests.distributed.launch import run_process_tree

WORLDS = (8, 64, 512, 4096)
DTYPE = "bf16"
PERSISTENCE_THRESHOLD = 100_000  # hf_zero's and DeepSpeed's default, passed to both sides
# (model type, the published shape with its layers cut to one)
MODELS: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=8,
                      tie_word_embeddings=False),
    "llama3-70b": dict(model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                       num_hidden_layers=1, num_attention_heads=64, num_key_value_heads=8,
                       tie_word_embeddings=False),
    "mixtral-8x7b": dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=8,
                         num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False),
    # Qwen2-VL-7B: a vision tower (one of its 32 blocks) and a merger beside the language model;
    # its attention projections have biases, small enough to stay whole on every rank while the
    # weights are sharded.
    "qwen2-vl-7b": dict(model_type="qwen2_vl", architectures=["Qwen2VLForConditionalGeneration"],
                        text_config=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                                         num_hidden_layers=1, num_attention_heads=28, num_key_value_heads=4,
                                         rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}),
                        vision_config=dict(depth=1, embed_dim=1280, hidden_size=3584, num_heads=16, mlp_ratio=4,
                                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
                        tie_word_embeddings=False),
}
# Forward, backward and step: 6-9 s for the 8B shape, 15 s for Mixtral, 27 s for 70B (run by
# --step-every-model only) on 2 busy cores. At world 4096 the fake all-gather alone takes 10 s: it
# writes every gathered buffer as 4096 copies of this rank's shard.
STEPS = (("llama3-8b", 64), ("mixtral-8x7b", 64), ("qwen2-vl-7b", 64))
EVERY_STEP = tuple((name, 64) for name in MODELS)
STEP_TOKENS = 16
# |estimate - measured| of the working set, as a fraction of the measurement: the 10%.
# Measured 0.1-1.2% (activations and the fp32 gradient shards the first step allocates are not in
# the estimate). Dropping autograd's whole gradient of the largest parameter from the estimate
# moved it 24-30%, and an engine that keeps each unit gathered until the end of the backward
# measured 41% more; terms under 10% of a peak (Mixtral's root gradient, 3%) are pinned by the
# hand calculations of tests/unit/test_estimator.py instead.
WORKING_RTOL = 0.10
STATES_RTOL = 0.01  # the "within 1%"; the estimator lays out the same groups, so it is exact
PADDING_LIMIT = 0.01  # padding per rank, as a fraction of the states
# Initialization at 4096 against 8: a rank's work is its shards plus one module at a time, which
# does not depend on N (8 is the slowest, with the largest shards). Twice, plus a second, in CPU
# seconds of this process: the wall clock on 2 shared cores moved by 1.5x between runs.
TIME_FACTOR, TIME_SLACK_S = 2.0, 1.0
# Peak resident growth of initialize over (states + the largest module): allocator and
# bookkeeping; measured within 4 MiB. Keeping every module real (a mutation run) went 860 MiB
# past the bound at the 8B shape.
INIT_PEAK_SLACK = 256 * 2**20
RESULT_MARK = "SIMULATED_SCALE_RESULT "
REPO = Path(__file__).resolve().parents[2]
COMPUTE_BYTES = 2  # bf16: [Note: memory formulas] in estimator.py


# ------------------------------------------------------------------ in the subprocess
def _build(shape: dict[str, Any]) -> Any:
    """``from_config`` under the live config: the model is on the meta device."""
    import torch

    from hf_zero.estimator import meta_model

    return skip_random_init(meta_model(shape, dtype=torch.bfloat16))


# A vision-language step sees one image of 4 x 4 patches (one temporal patch), merged 2 x 2 into
# 4 image tokens among the STEP_TOKENS: every unit, the vision tower's included, runs and gets
# gradients, so every state category is allocated.
IMAGE_GRID = (1, 4, 4)


def _step(engine: Any) -> dict[str, Any]:
    """One forward, backward and step of STEP_TOKENS tokens: peak resident growth over the states."""
    import torch

    config = engine.module.config
    ids = torch.arange(STEP_TOKENS).reshape(1, -1)
    if getattr(config, "vision_config", None) is None:
        return measure_step(engine, ids)
    vision = config.vision_config
    t, h, w = IMAGE_GRID
    image_tokens = t * h * w // vision.spatial_merge_size ** 2
    ids[0, 2] = config.vision_start_token_id
    ids[0, 3:3 + image_tokens] = config.image_token_id
    ids[0, 3 + image_tokens] = config.vision_end_token_id
    patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    return measure_step(engine, ids, pixel_values=torch.zeros(t * h * w, patch, dtype=torch.bfloat16),
                        image_grid_thw=torch.tensor([IMAGE_GRID]),
                        mm_token_type_ids=(ids == config.image_token_id).int())


def play(name: str, world: int, steps: tuple[tuple[str, int], ...] = STEPS) -> dict[str, Any]:
    """Rank ``world - 1`` of a fake world: initialize (one step at ``steps``) and what it holds."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import hf_zero
    from hf_zero.estimator import estimate_model_states

    rank = world - 1
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        live = hf_zero.HfZeroConfig({
            "train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": PERSISTENCE_THRESHOLD}})
        model = _build(MODELS[name])
        largest_module = largest_module_bytes(model, COMPUTE_BYTES)
        gc.collect()
        before = reset_peak()
        start, start_cpu = time.perf_counter(), time.process_time()
        engine, *_ = hf_zero.initialize(model=model, config=live)
        init_s, init_cpu_s = time.perf_counter() - start, time.process_time() - start_cpu
        init_peak = rss("VmHWM") - before
        row = next(e for e in estimate_model_states(MODELS[name], num_gpus_per_node=world, dtype=DTYPE, stages=(3,),
                                                    persistence_threshold=PERSISTENCE_THRESHOLD)
                   if not e.offload_optimizer and not e.offload_param)
        out = {"model": name, "world": world, "rank": engine.rank, "world_size": engine.world_size,
               "numel": sum(g.layout.numel for u in engine.units for g in u.groups),
               "init_s": init_s, "init_cpu_s": init_cpu_s, "init_peak": init_peak, "largest_module": largest_module,
               "memory_at_init": engine.memory_report(), "layout": engine.layout(),
               "estimate": {"breakdown": row.breakdown, "device": row.device_bytes, "working": row.working_bytes}}
        if (name, world) in steps:
            out["step"] = _step(engine)
        del engine, model
        gc.collect()
        return out
    finally:
        dist.destroy_process_group()


def _main() -> None:
    steps = EVERY_STEP if "--step-every-model" in sys.argv else STEPS
    results = []
    for name in MODELS:
        for world in WORLDS:
            results.append(play(name, world, steps))
            print(f"{name} world {world}: initialize {results[-1]['init_s']:.2f} s "
                  f"({results[-1]['init_cpu_s']:.2f} s CPU)", file=sys.stderr, flush=True)
    print(RESULT_MARK + json.dumps(results), flush=True)
    print(table(results))


# ------------------------------------------------------------------ arithmetic on the results
def states(memory: dict[str, int]) -> int:
    return state_bytes(memory)


def padding(layout: list[dict[str, Any]]) -> tuple[float, float]:
    """(padded, unpadded) bytes of a bf16 rank's states after a step, from the engine's layout."""
    return state_padding(layout, COMPUTE_BYTES)


def table(results: list[dict[str, Any]]) -> str:
    """The measured table of docs/memory-estimator.md (MiB = 2^20 bytes)."""
    lines = ["| model (1 layer, bf16) | world | params + master at init: measured | estimator | "
             "estimator's stage-3 row | padding in it | initialize | peak added by initialize |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        padded, unpadded = padding(r["layout"])
        at_init = r["memory_at_init"]["compute_params"] + r["memory_at_init"]["fp32_master"]
        estimate = r["estimate"]["breakdown"]["compute_params"] + r["estimate"]["breakdown"]["fp32_master"]
        lines.append(f"| {r['model']} | {r['world']} | {at_init / 2**20:.2f} MiB | {estimate / 2**20:.2f} MiB | "
                     f"{r['estimate']['device'] / 2**20:.2f} MiB | {(padded - unpadded) / 2**10:.1f} KiB "
                     f"({100 * (padded - unpadded) / padded:.3f}%) | {r['init_s']:.2f} s "
                     f"({r['init_cpu_s']:.2f} s CPU) | {r['init_peak'] / 2**20:.0f} MiB |")
    lines += ["", f"| model (1 layer, bf16) | world | states after one step: measured | estimated | "
              f"forward+backward of {STEP_TOKENS} tokens: peak above the states | estimator's +working | "
              "estimate / measured | fwd+bwd+step |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "step" in r:
            step, working = r["step"], r["estimate"]["working"]
            lines.append(f"| {r['model']} | {r['world']} | {states(step['memory']) / 2**20:.2f} MiB | "
                         f"{r['estimate']['device'] / 2**20:.2f} MiB | {step['peak_above_states'] / 2**20:.0f} MiB | "
                         f"{working / 2**20:.0f} MiB | {working / step['peak_above_states']:.3f} | "
                         f"{step['fwd_bwd_step_s']:.1f} s |")
    return "\n".join(lines)


# ------------------------------------------------------------------ the tests
@pytest.fixture(scope="module")
def played() -> dict[tuple[str, int], dict[str, Any]]:
    env = rank_env()  # CUDA hidden, checking mode off: the environment hf-zero estimate --simulate gives its rank
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *sys.path])
    run = run_process_tree([sys.executable, "-m", "tests.distributed.test_simulated_scale"], timeout=600,
                           env=env, cwd=REPO)
    lines = [line for line in run.stdout.splitlines() if line.startswith(RESULT_MARK)]
    assert run.returncode == 0 and lines, f"rc {run.returncode}\n{run.stdout[-4000:]}\n{run.stderr[-8000:]}"
    results = json.loads(lines[-1][len(RESULT_MARK):])
    print("\n" + table(results))
    return {(r["model"], r["world"]): r for r in results}


def test_persistent_groups_are_padded_to_a_multiple_of_the_world_size_only() -> None:
    """[Note: alignment in flat buffers] by hand, no process group: a Llama-3-8B layer's two norms
    (2 x 4096 elements) and a 100-element bias kept whole on every rank, against the same norms
    sharded (each shard a multiple of 8 elements)."""
    import torch
    from torch import nn

    from hf_zero.partition import build_flat_layout

    norms = [(f"norm{i}", nn.Parameter(torch.empty(4096, device="meta"))) for i in range(2)]
    bias = [("bias", nn.Parameter(torch.empty(100, device="meta")))]
    persistent_norms = {8: 8192, 64: 8192, 512: 8192, 4096: 8192}
    persistent_bias = {8: 104, 64: 128, 512: 512, 4096: 4096}
    sharded_norms = {8: 8192, 64: 8192, 512: 8192, 4096: 32768}
    for world in WORLDS:
        assert build_flat_layout(norms, world, persistent=True).padded_numel == persistent_norms[world]
        assert build_flat_layout(bias, world, persistent=True).padded_numel == persistent_bias[world]
        assert build_flat_layout(norms, world).padded_numel == sharded_norms[world]


def test_initialize_completes_as_the_last_rank_of_every_world(played) -> None:
    assert set(played) == {(name, world) for name in MODELS for world in WORLDS}
    for (name, world), r in played.items():
        assert (r["world_size"], r["rank"]) == (world, world - 1), name
        assert all(g["world_size"] == world for g in r["layout"]), name
        assert r["numel"] == sum(g["numel"] for g in r["layout"])


def test_model_states_equal_the_estimators_stage3_row(played) -> None:
    for (name, world), r in played.items():
        estimate, at_init = r["estimate"]["breakdown"], r["memory_at_init"]
        # initialize allocates the compute shards (and persistent groups whole) and the fp32
        # masters; gradient shards and moments come with the first step.
        for category in ("compute_params", "fp32_master"):
            assert at_init[category] == pytest.approx(estimate[category], rel=STATES_RTOL), (name, world, category)
        assert at_init["gradients"] == 0 and at_init["optimizer_state"] == 0, (name, world)
    for at in STEPS:
        stepped = played[at]["step"]["memory"]
        estimate = played[at]["estimate"]
        for category, value in estimate["breakdown"].items():
            assert stepped[category] == pytest.approx(value, rel=STATES_RTOL), (at, category)
        assert states(stepped) == pytest.approx(estimate["device"], rel=STATES_RTOL), at


def test_padding_costs_under_one_percent_of_the_states(played) -> None:
    for (name, world), r in played.items():
        padded, unpadded = padding(r["layout"])
        assert padded == pytest.approx(r["estimate"]["device"], rel=STATES_RTOL), (name, world)
        assert (padded - unpadded) / padded < PADDING_LIMIT, (name, world, padded - unpadded, padded)


def test_initialization_time_does_not_grow_with_the_world_size(played) -> None:
    for name in MODELS:
        wall = {world: played[(name, world)]["init_s"] for world in WORLDS}
        cpu = {world: played[(name, world)]["init_cpu_s"] for world in WORLDS}
        print(f"{name}: initialize per rank "
              + ", ".join(f"N={w} {wall[w]:.2f} s ({cpu[w]:.2f} s CPU)" for w in WORLDS))
        assert cpu[WORLDS[-1]] <= TIME_FACTOR * cpu[WORLDS[0]] + TIME_SLACK_S, (name, cpu)


def test_initialize_materialises_one_module_at_a_time(played) -> None:
    for (name, world), r in played.items():
        bound = states(r["memory_at_init"]) + r["largest_module"] + INIT_PEAK_SLACK
        assert r["init_peak"] <= bound, (name, world, r["init_peak"] / 2**20, bound / 2**20)


def test_a_forward_and_backward_peaks_at_the_working_estimate(played) -> None:
    """[Note: stage-3 working memory] in estimator.py against the peak resident growth of a real
    forward and backward over the states, within WORKING_RTOL of the measurement."""
    for at in STEPS:
        step = played[at]["step"]
        measured, working = step["peak_above_states"], played[at]["estimate"]["working"]
        print(f"{at}: forward+backward of {STEP_TOKENS} tokens, peak above the states {measured / 2**20:.0f} MiB, "
              f"estimator +working {working / 2**20:.0f} MiB ({working / measured:.3f}x), "
              f"{step['fwd_bwd_step_s']:.1f} s")
        assert abs(working - measured) <= WORKING_RTOL * measured, (at, measured, working)


if __name__ == "__main__":
    _main()
