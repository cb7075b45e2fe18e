"""Checkpoints on real gloo process groups: bitwise resume, resume at another world size and stage,
atomic saves that fail half-way, corrupt checkpoints, export to a Hugging Face folder.

One spawn of three processes runs every scenario in three successive process groups (world
sizes 2, 3, then 2 again; see ``launch.in_group``); the checkpoints they write live in one temporary
directory, so each group reads what the one before wrote at another world size. This process
then exports the checkpoints and loads them with ``from_pretrained``.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
from typing import Any, Callable

import pytest
import torch

from tests.distributed import scenarios as S
from tests.distributed.launch import in_group, run_distributed
from tests.tiny_models import batch_for_step

FP32_ATOL = 1e-5
SCHEDULER = {"type": "WarmupDecayLR", "params": {
    "warmup_min_lr": 1e-4, "warmup_max_lr": 2e-3, "warmup_num_steps": 2, "total_num_steps": 6,
    "warmup_type": "linear"}}
STEPS, SAVE_AT = 6, 3
GLOBAL_ROWS = 6  # the cross-size runs keep the global batch: 2 ranks x 3 rows, 3 ranks x 2 rows
PROBE = batch_for_step(777, 2)  # the input whose logits the export tests compare


# ------------------------------------------------------------------ helpers run on every rank
def _config(sc: dict[str, Any], scheduler: bool = False) -> dict[str, Any]:
    config = S.make_config(sc)
    if scheduler:
        config["scheduler"] = SCHEDULER
    return config


def _engine(sc: dict[str, Any], seed: int = 0, scheduler: bool = False) -> Any:
    import hf_zero
    from tests.tiny_models import BUILDERS, freeze_some

    model = BUILDERS[sc["model"]](seed=seed)
    if sc["freeze"]:
        freeze_some(model)
    model.train()
    kwargs: dict[str, Any] = {}
    if sc["optimizer"] == "torch":  # with a torch scheduler, whose lr lives in the param groups
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                lr=S.LR, betas=S.BETAS, eps=S.EPS, weight_decay=S.WEIGHT_DECAY)
        kwargs = {"optimizer": opt, "lr_scheduler": lambda zero_opt: torch.optim.lr_scheduler.StepLR(zero_opt, 2, 0.5)}
    engine, *_ = hf_zero.initialize(model=model, config=_config(sc, scheduler), **kwargs)
    return engine


def _train(engine: Any, sc: dict[str, Any], steps: range) -> list[float]:
    """Per-step losses of this rank (the mean over its micro-steps), global batch = world x gas x micro."""
    losses = []
    world, rank, gas, micro = engine.world_size, engine.rank, sc["gas"], sc["micro"]
    for step in steps:
        batch = batch_for_step(step, world * gas * micro)
        total = 0.0
        for k in range(gas):
            start = (k * world + rank) * micro
            loss = S.model_loss(engine, sc["model"], batch[start:start + micro])
            engine.backward(loss)
            engine.step()
            total += loss.item()
        losses.append(total / gas)
    return losses


def _mean_over_ranks(engine: Any, losses: list[float]) -> list[float]:
    every = engine.comm.all_gather_objects(losses)
    return [sum(col) / len(col) for col in zip(*every)]


def _probe_logits(engine: Any) -> list[float]:
    with torch.no_grad():
        return engine(input_ids=PROBE).logits.float().reshape(-1).tolist()


def _snapshot(path: str) -> dict[str, str]:
    """Every file under ``path`` with a hash of its content: what "nothing changed" compares."""
    found = {}
    for root, _, names in os.walk(path):
        for name in names:
            full = os.path.join(root, name)
            with open(full, "rb") as handle:
                found[os.path.relpath(full, path)] = hashlib.sha1(handle.read()).hexdigest()
    return found


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def _error_of(fn: Callable[[], Any]) -> str:
    from hf_zero.checkpoint import CheckpointError

    try:
        fn()
    except CheckpointError as error:
        return str(error)
    return "no error"


# ------------------------------------------------------------------ same-size resume
BITWISE = {
    "gpt2_s3_sched": dict(sc=S.scenario("gpt2", 3, 2), scheduler=True),
    "llama_s2_torch_opt": dict(sc=S.scenario("llama", 2, 1, optimizer="torch")),
    "gpt2_s1_bf16_frozen": dict(sc=S.scenario("gpt2", 1, 1, dtype="bf16", freeze=True)),
    "llama_s0": dict(sc=S.scenario("llama", 0, 1)),
}


def _bitwise(root: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    sc, opts = spec["sc"], {k: v for k, v in spec.items() if k != "sc"}
    save_dir = os.path.join(root, name)
    engine = _engine(sc, **opts)
    _train(engine, sc, range(SAVE_AT))
    engine.save_checkpoint(save_dir, client_state={"epoch": 1, "note": name})
    params_at_save = S.full_params(engine)
    rng_after_save = torch.rand(4).tolist()
    reference = _train(engine, sc, range(SAVE_AT, STEPS))  # saving must not disturb the run
    engine.save_checkpoint(save_dir, tag="final")
    resumed = _engine(sc, seed=1, **opts)  # other initial weights: the load must replace them all
    path, client_state = resumed.load_checkpoint(save_dir, tag=f"global_step{SAVE_AT}")
    loaded_params = S.full_params(resumed)
    rng_after_load = torch.rand(4).tolist()
    counters = [resumed.global_steps, resumed.micro_steps, resumed.global_samples]
    continued = _train(resumed, sc, range(SAVE_AT, STEPS))
    return {
        "path": os.path.relpath(path, root), "client_state": client_state, "counters": counters,
        "params_equal_after_load": loaded_params == params_at_save,
        "rng_restored": rng_after_load == rng_after_save,
        "losses": reference, "resumed_losses": continued,
        "final_params_equal": S.full_params(resumed) == S.full_params(engine),
        "lr": [engine.get_lr(), resumed.get_lr()],
        "logits": _probe_logits(engine),
    }


# ------------------------------------------------------------------ cross-size / cross-stage resume
def _cross_sc(stage: int, world: int, **zero: Any) -> dict[str, Any]:
    return S.scenario("gpt2", stage, 1, micro=GLOBAL_ROWS // world, freeze=True, zero=zero)


def _cross_reference(root: str) -> dict[str, Any]:
    """World 2, stage 2, uninterrupted: the loss curve every resumed run must continue."""
    sc = _cross_sc(2, 2)
    engine = _engine(sc, scheduler=True)
    losses = _train(engine, sc, range(SAVE_AT))
    engine.save_checkpoint(os.path.join(root, "cross_w2_s2"))
    losses += _train(engine, sc, range(SAVE_AT, STEPS))
    return {"losses": _mean_over_ranks(engine, losses), "params": S.full_params(engine)}


def _resume(root: str, source: str, stage: int, **zero: Any) -> dict[str, Any]:
    sc = _cross_sc(stage, _world(), **zero)
    engine = _engine(sc, seed=1, scheduler=True)
    engine.load_checkpoint(os.path.join(root, source))
    losses = _train(engine, sc, range(SAVE_AT, STEPS))
    return {"losses": _mean_over_ranks(engine, losses), "params": S.full_params(engine),
            "global_steps": engine.global_steps}


def _world() -> int:
    return int(os.environ["WORLD_SIZE"])


# ------------------------------------------------------------------ failures
def _failing_saves(root: str) -> dict[str, Any]:
    """A save refused up front (client state that is not JSON on rank 1 only) and a save that
    fails half-way (rank 1's writer raises ENOSPC after writing part of its file): both raise on
    every rank and leave the previous checkpoint and ``latest`` as they were."""
    import hf_zero.checkpoint.save as save_module

    sc = S.scenario("gpt2", 3, 1)
    save_dir = os.path.join(root, "failing")
    engine = _engine(sc)
    _train(engine, sc, range(2))
    engine.save_checkpoint(save_dir)
    before = _snapshot(save_dir)
    _train(engine, sc, range(2, 3))
    state = {"ok": 1} if engine.rank == 0 else {"bad": object()}
    refused = _error_of(lambda: engine.save_checkpoint(save_dir, client_state=state))
    after_refused = _snapshot(save_dir)

    original = save_module._write_rank_file

    def half_then_full_disk(path: str, entries: list, metadata: dict) -> int:
        with open(path, "wb") as handle:
            handle.write(b"\0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    if engine.rank == 1:
        save_module._write_rank_file = half_then_full_disk
    try:
        disk_full = _error_of(lambda: engine.save_checkpoint(save_dir))
    finally:
        save_module._write_rank_file = original
    _barrier()
    after_disk_full = _snapshot(save_dir)
    full_at_latest = {tag: _error_of(lambda t=tag: _save_with_full_disk_at_latest(engine, save_dir, t))
                      for tag in ("global_step3", "global_step2")}  # a new tag, and one re-saved
    _barrier()
    after_full_at_latest = _snapshot(save_dir), sorted(os.listdir(save_dir))
    fresh = _engine(sc, seed=1)
    path, _ = fresh.load_checkpoint(save_dir)
    resave = engine.save_checkpoint(save_dir, tag="global_step2")  # overwriting a tag is atomic too
    return {
        "refused": refused, "disk_full": disk_full, "loaded": os.path.basename(path),
        "unchanged_after_refused": after_refused == before, "unchanged_after_disk_full": after_disk_full == before,
        "full_at_latest": full_at_latest,
        "after_full_at_latest": after_full_at_latest == (before, ["global_step2", "latest"]),
        "entries": sorted(os.listdir(save_dir)), "resaved": os.path.basename(resave),
    }


def _save_with_full_disk_at_latest(engine: Any, save_dir: str, tag: str) -> str:
    """The disk fills exactly when rank 0 replaces ``latest`` (everything else was written)."""
    real_replace = os.replace

    def full_at_latest(src: str, dst: str) -> None:
        if os.path.basename(dst) == "latest":
            raise OSError(errno.ENOSPC, "No space left on device")
        real_replace(src, dst)

    os.replace = full_at_latest
    try:
        return engine.save_checkpoint(save_dir, tag=tag)
    finally:
        os.replace = real_replace


def _corrupt_loads(root: str) -> dict[str, Any]:
    """Each broken checkpoint raises the same clear error on every rank and changes nothing."""
    source = os.path.join(root, "gpt2_s3_sched")
    broken = os.path.join(root, "broken")
    cases = {  # each damages the checkpoint "latest" names ("final")
        "missing_rank_file": lambda d: os.remove(os.path.join(d, "final", "rank-00001-of-00002.safetensors")),
        "truncated": lambda d: _truncate(os.path.join(d, "final", "rank-00000-of-00002.safetensors")),
        "missing_latest": lambda d: os.remove(os.path.join(d, "latest")),
        "missing_manifest": lambda d: os.remove(os.path.join(d, "final", "manifest.json")),
    }
    if _rank() == 0:
        for case, damage in cases.items():
            shutil.copytree(source, os.path.join(broken, case))
            damage(os.path.join(broken, case))
    _barrier()
    sc = S.scenario("gpt2", 3, 2)
    engine = _engine(sc, seed=1, scheduler=True)
    params_before = S.full_params(engine)
    before = _snapshot(root)
    errors = {case: _error_of(lambda c=case: engine.load_checkpoint(os.path.join(broken, c))) for case in cases}
    errors["no_such_tag"] = _error_of(lambda: engine.load_checkpoint(source, tag="global_step999"))
    llama = _engine(S.scenario("llama", 3, 1), seed=1)
    errors["other_model"] = _error_of(lambda: llama.load_checkpoint(source))
    return {"errors": errors, "disk_unchanged": _snapshot(root) == before,
            "engine_unchanged": S.full_params(engine) == params_before and engine.global_steps == 0}


def _truncate(path: str) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as handle:
        handle.truncate(size // 2)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


# ------------------------------------------------------------------ export and the estimator
def _big_checkpoint(root: str) -> dict[str, Any]:
    """A model far larger than one unit, for the export memory test (no training needed)."""
    import hf_zero
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=97, n_positions=16, n_embd=512, n_layer=8, n_head=8)
    model = GPT2LMHeadModel(config)
    engine, *_ = hf_zero.initialize(model=model, config=_config(S.scenario("gpt2", 3, 1)))
    engine.save_checkpoint(os.path.join(root, "big"))
    unit_bytes = max(sum(g.layout.numel for g in u.groups) for u in engine.units) * 4
    return {"model_bytes": sum(p.numel() for p in model.parameters()) * 4, "unit_bytes": unit_bytes}


ESTIMATED = [("gpt2", 1, "fp32", 0), ("gpt2", 2, "bf16", 0), ("gpt2", 3, "fp32", 0), ("gpt2", 3, "bf16", 100),
             ("llama", 1, "bf16", 0), ("llama", 2, "fp32", 0), ("llama", 3, "bf16", 0), ("llama", 3, "fp32", 100)]


def _memory_reports() -> list[dict[str, int]]:
    reports = []
    for model, stage, dtype, threshold in ESTIMATED:
        sc = S.scenario(model, stage, 1, dtype=dtype, steps=1,
                        zero={"stage3_param_persistence_threshold": threshold})
        engine = _engine(sc)
        _train(engine, sc, range(1))
        reports.append(engine.memory_report())
    return reports


# ------------------------------------------------------------------ one spawn, three process groups
def _phase_world2(root: str) -> dict[str, Any]:
    out: dict[str, Any] = {name: _bitwise(root, name, spec) for name, spec in BITWISE.items()}
    out["cross_reference"] = _cross_reference(root)
    out["failing_saves"] = _failing_saves(root)
    out["corrupt"] = _corrupt_loads(root)
    out["big"] = _big_checkpoint(root)
    out["memory"] = _memory_reports()
    return out


def _phase_world3(root: str) -> dict[str, Any]:
    sc = _cross_sc(3, 3, stage3_param_persistence_threshold=100)
    engine = _engine(sc, scheduler=True)
    first = _mean_over_ranks(engine, _train(engine, sc, range(SAVE_AT)))
    engine.save_checkpoint(os.path.join(root, "cross_w3_s3"))
    return {
        "first_losses": first,
        "w2s2_to_w3s2": _resume(root, "cross_w2_s2", 2),
        "w2s2_to_w3s3": _resume(root, "cross_w2_s2", 3, stage3_param_persistence_threshold=100),
        "memory": _memory_reports(),
    }


def _phase_world2_again(root: str) -> dict[str, Any]:
    return {
        "w3s3_to_w2s1": _resume(root, "cross_w3_s3", 1),
        "w2s2_to_w2s3": _resume(root, "cross_w2_s2", 3),
        "w3s3_to_w2s0": _resume(root, "cross_w3_s3", 0),
    }


def _all_phases(root: str) -> dict[str, Any]:
    return {
        "w2": in_group(2, _phase_world2, root),
        "w3": in_group(3, _phase_world3, root),
        "w2again": in_group(2, _phase_world2_again, root),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("checkpoints"))
    per_rank = run_distributed(_all_phases, 3, root)
    return {
        "root": root,
        2: [r["w2"] for r in per_rank[:2]],
        3: [r["w3"] for r in per_rank],
        "2again": [r["w2again"] for r in per_rank[:2]],
    }


# ------------------------------------------------------------------ tests: resume
@pytest.mark.parametrize("name", list(BITWISE))
def test_same_size_resume_is_bitwise(runs, name):
    for rank_result in runs[2]:
        r = rank_result[name]
        assert r["path"] == os.path.join(name, "global_step3")
        assert r["params_equal_after_load"], "every rank's full parameters equal the saved ones"
        assert r["resumed_losses"] == r["losses"]
        assert r["final_params_equal"]
        assert r["rng_restored"]
        assert r["client_state"] == {"epoch": 1, "note": name}
        sc = BITWISE[name]["sc"]
        assert r["counters"] == [SAVE_AT, SAVE_AT * sc["gas"], SAVE_AT * 2 * sc["gas"] * sc["micro"]]
        assert r["lr"][0] == r["lr"][1]


def test_checkpoint_layout_on_disk(runs):
    root = runs["root"]
    save_dir = os.path.join(root, "gpt2_s3_sched")
    assert sorted(os.listdir(save_dir)) == ["final", "global_step3", "latest"]
    with open(os.path.join(save_dir, "latest")) as handle:
        assert handle.read() == "final"
    files = sorted(os.listdir(os.path.join(save_dir, "global_step3")))
    assert files == ["manifest.json", "rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"]
    with open(os.path.join(save_dir, "global_step3", "manifest.json")) as handle:
        manifest = json.load(handle)
    assert manifest["world_size"] == 2 and manifest["stage"] == 3 and manifest["global_steps"] == 3
    assert manifest["lr_scheduler"]["state"] == {"last_batch_iteration": 2}
    assert len(manifest["rng"]) == 2 and "torch_cpu" in manifest["rng"][1] and "python" in manifest["rng"][1]
    assert manifest["config"]["zero_optimization"]["stage"] == 3
    assert manifest["model"]["config"]["model_type"] == "gpt2"
    from safetensors import safe_open

    with safe_open(os.path.join(save_dir, "global_step3", files[1]), framework="pt") as f:
        keys = set(f.keys())
    group = manifest["groups"][0]["group"]
    assert {f"{group}/param", f"{group}/optim.exp_avg", f"{group}/optim.exp_avg_sq"} <= keys
    # stage 0 keeps one copy: a single data file, whatever the world size
    assert sorted(os.listdir(os.path.join(root, "llama_s0", "global_step3")))[1:] == ["rank-00000-of-00001.safetensors"]


def test_frozen_groups_are_saved_for_export(runs):
    with open(os.path.join(runs["root"], "gpt2_s1_bf16_frozen", "global_step3", "manifest.json")) as handle:
        manifest = json.load(handle)
    frozen = [g for g in manifest["groups"] if not g["trainable"]]
    assert frozen and all(g["tensors"] == {"param": "BF16"} for g in frozen)
    assert all(g["tensors"]["param"] == "F32" for g in manifest["groups"] if g["trainable"])


def _assert_continues(resumed: dict[str, Any], reference: dict[str, Any]) -> None:
    assert resumed["global_steps"] == STEPS
    assert resumed["losses"] == pytest.approx(reference["losses"][SAVE_AT:], abs=FP32_ATOL)
    assert resumed["params"].keys() == reference["params"].keys()
    diff = max(abs(a - b) for n in reference["params"]
               for a, b in zip(resumed["params"][n], reference["params"][n], strict=True))
    assert diff <= FP32_ATOL


@pytest.mark.parametrize("phase,case", [(3, "w2s2_to_w3s2"), (3, "w2s2_to_w3s3"), ("2again", "w3s3_to_w2s1"),
                                        ("2again", "w2s2_to_w2s3"), ("2again", "w3s3_to_w2s0")])
def test_resume_at_another_world_size_and_stage_continues_the_curve(runs, phase, case):
    reference = runs[2][0]["cross_reference"]
    for rank_result in runs[phase]:
        _assert_continues(rank_result[case], reference)


def test_world3_run_matches_the_world2_curve_before_its_save(runs):
    reference = runs[2][0]["cross_reference"]["losses"][:SAVE_AT]
    assert runs[3][0]["first_losses"] == pytest.approx(reference, abs=FP32_ATOL)


# ------------------------------------------------------------------ tests: failures
def test_failed_saves_raise_everywhere_and_change_nothing(runs):
    for rank, rank_result in enumerate(runs[2]):
        r = rank_result["failing_saves"]
        assert "client_state" in r["refused"] and "object" in r["refused"] and "nothing was written" in r["refused"]
        assert "No space left on device" in r["disk_full"] and "rank-00001-of-00002.safetensors" in r["disk_full"]
        assert r["unchanged_after_refused"] and r["unchanged_after_disk_full"]
        for tag, error in r["full_at_latest"].items():  # neither an unreferenced checkpoint nor a temporary file
            assert "while publishing" in error and "No space left on device" in error, (tag, error)
        assert r["after_full_at_latest"], "a save that failed at 'latest' left files behind or changed the checkpoint"
        assert r["loaded"] == "global_step2"
    assert runs[2][0]["failing_saves"]["entries"] == ["global_step2", "latest"]  # no temporary directory left


def test_corrupt_checkpoints_name_the_file_and_change_nothing(runs):
    for rank_result in runs[2]:
        r = rank_result["corrupt"]
        errors = r["errors"]
        assert "rank-00001-of-00002.safetensors" in errors["missing_rank_file"] and "missing" in errors["missing_rank_file"]
        assert "rank-00000-of-00002.safetensors" in errors["truncated"] and "truncated" in errors["truncated"]
        assert "latest" in errors["missing_latest"] and "global_step3" in errors["missing_latest"]
        assert "manifest.json" in errors["missing_manifest"]
        assert "global_step999" in errors["no_such_tag"] and "final, global_step3" in errors["no_such_tag"]
        assert "different model" in errors["other_model"] and "manifest.json" in errors["other_model"]
        assert all("nothing was loaded" in e for e in errors.values())
        assert r["disk_unchanged"] and r["engine_unchanged"]


def test_errors_outside_a_process_group(tmp_path):
    from hf_zero.checkpoint import CheckpointNotFoundError, export_hf_model

    with pytest.raises(CheckpointNotFoundError, match="no such checkpoint directory"):
        export_hf_model(tmp_path / "nowhere", tmp_path / "out")
    with pytest.raises(CheckpointNotFoundError, match="latest: not found"):
        export_hf_model(tmp_path, tmp_path / "out")


# ------------------------------------------------------------------ tests: export
@pytest.mark.parametrize("name,dtype", [("gpt2_s3_sched", "fp32"), ("llama_s2_torch_opt", "fp32"),
                                        ("llama_s0", "fp32"), ("gpt2_s1_bf16_frozen", "bf16")])
def test_export_loads_with_from_pretrained_and_gives_the_same_logits(runs, tmp_path, name, dtype):
    from transformers import AutoModelForCausalLM

    from hf_zero.checkpoint import export_hf_model

    out = export_hf_model(os.path.join(runs["root"], name), tmp_path / "hf", dtype=dtype, max_shard_size="8KB")
    files = sorted(os.listdir(out))
    assert "config.json" in files and "model.safetensors.index.json" in files
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    with torch.no_grad():
        logits = model(input_ids=PROBE).logits.float().reshape(-1)
    expected = torch.tensor(runs[2][0][name]["logits"])
    assert torch.allclose(logits, expected, atol=1e-5, rtol=0)
    if name.startswith("gpt2"):
        assert model.lm_head.weight is model.transformer.wte.weight
        with open(os.path.join(out, "model.safetensors.index.json")) as handle:
            assert "lm_head.weight" not in json.load(handle)["weight_map"]  # tied: written once


_MEASURE = r"""
import json, resource, sys
import numpy, safetensors, torch  # imports are not the export's memory: the model check
from transformers import GPT2LMHeadModel  # imports transformers' model code (a fixed ~165 MiB) once
from hf_zero.checkpoint import export_hf_model
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
export_hf_model(sys.argv[1], sys.argv[2], dtype="fp32", max_shard_size="1GB")
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"peak_growth_bytes": (after - before) * 1024}))
"""


def test_export_peak_memory_is_about_one_unit_not_the_model(runs, tmp_path):
    big = runs[2][0]["big"]
    # glibc raises its mmap threshold after large frees and then keeps freed blocks in the heap;
    # a fixed threshold makes the peak the program's, not the allocator's history.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    done = subprocess.run([sys.executable, "-c", _MEASURE, os.path.join(runs["root"], "big"), str(tmp_path / "big")],
                          capture_output=True, text=True, check=True, env=env)
    growth = json.loads(done.stdout.strip().splitlines()[-1])["peak_growth_bytes"]
    assert big["model_bytes"] > 7 * big["unit_bytes"]
    # One parameter is assembled, written and dropped at a time; the model is written to one file.
    assert growth < 1.5 * big["unit_bytes"], (growth, big)
    assert os.path.getsize(tmp_path / "big" / "model.safetensors") >= big["model_bytes"]


# ------------------------------------------------------------------ tests: the estimator
@pytest.mark.parametrize("world", [2, 3])
def test_estimator_equals_the_engine_memory_report(runs, world):
    from hf_zero.estimator import model_state_bytes
    from tests.tiny_models import BUILDERS

    reports = runs[world][0]["memory"]
    for (model, stage, dtype, threshold), report in zip(ESTIMATED, reports):
        estimate = model_state_bytes(BUILDERS[model](), world_size=world, stage=stage, dtype=dtype,
                                     persistence_threshold=threshold)
        assert estimate == {k: report[k] for k in estimate}, (model, stage, dtype, threshold)
