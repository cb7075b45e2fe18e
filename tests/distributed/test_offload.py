"""Offload of optimizer state (cpu, nvme, partial with ratio < 1) and of stage-3 parameters (cpu,
nvme): same training, the expected bytes moved off the device, optimizer state leaving the
resident set under NVMe, checkpoints of NVMe-offloaded state resuming without offload."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
from typing import Any

import pytest
import torch

from tests.distributed import scenarios as S
from tests.distributed.launch import run_distributed
from tests.distributed.parity_checks import check_fp32_parity, check_low_precision_parity

NVME_DIR = os.path.join(tempfile.gettempdir(), "hf_zero_test_nvme")


def _offload(optimizer: str = "none", params: str = "none", ratio: float = 1.0, pipeline_read: bool = False,
             pipeline_write: bool = False, **param_nvme: int) -> dict[str, Any]:
    zero: dict[str, Any] = {"sub_group_size": 1000}  # several NVMe tiles per group
    if optimizer != "none":
        zero["offload_optimizer"] = {"device": optimizer, **({"nvme_path": NVME_DIR} if optimizer == "nvme" else {})}
        if pipeline_read or pipeline_write:
            zero["offload_optimizer"].update(pipeline_read=pipeline_read, pipeline_write=pipeline_write)
        if ratio < 1.0:
            zero["offload_optimizer"]["ratio"] = ratio
    if params != "none":
        zero["offload_param"] = {"device": params}
    if params == "nvme":  # max_in_cpu 0 unless given: every shard in a file
        zero["offload_param"].update({"nvme_path": NVME_DIR, "max_in_cpu": 0, **param_nvme})
    return zero


CASES = {
    "opt_cpu_s1": S.scenario("gpt2", 1, 2, zero=_offload("cpu")),
    "opt_cpu_s2": S.scenario("llama", 2, 1, zero=_offload("cpu")),
    "opt_cpu_s3": S.scenario("gpt2", 3, 1, zero=_offload("cpu")),
    "opt_nvme_s2": S.scenario("gpt2", 2, 2, zero=_offload("nvme")),
    "opt_nvme_s3": S.scenario("llama", 3, 1, zero=_offload("nvme")),
    # the next tile read and this one written while a tile steps, blocks on two I/O threads
    "opt_nvme_pipelined_s2": S.scenario(
        "llama", 2, 2, zero=_offload("nvme", pipeline_read=True, pipeline_write=True),
        sections={"aio": {"block_size": 1024, "intra_op_parallelism": 2}}),
    "param_cpu_s3": S.scenario("gpt2", 3, 1, zero=_offload(params="cpu")),
    "both_cpu_s3": S.scenario("llama", 3, 2, zero=_offload("cpu", "cpu")),
    "bf16_opt_cpu_s3": S.scenario("gpt2", 3, 1, dtype="bf16", zero=_offload("cpu")),
    # buffer_count 1 < the units prefetched at once: the pool waits for the oldest gather
    "param_nvme_s3": S.scenario("gpt2", 3, 1, zero=_offload(params="nvme", buffer_count=1)),
    # max_in_cpu keeps the first shards on the host (one unit at world 1, two at world 2)
    "param_nvme_opt_cpu_s3": S.scenario("gpt2", 3, 2, zero=_offload("cpu", "nvme", max_in_cpu=3000, buffer_count=2)),
    "param_nvme_opt_nvme_s3": S.scenario("gpt2", 3, 1, freeze=True, zero=_offload("nvme", "nvme")),
    "bf16_param_nvme_s3": S.scenario("llama", 3, 1, dtype="bf16", zero=_offload(params="nvme")),
    "ratio_half_s3": S.scenario("gpt2", 3, 1, zero=_offload("cpu", ratio=0.5)),
    "ratio_half_s2": S.scenario("llama", 2, 2, zero=_offload("cpu", ratio=0.5)),
    # no clipping: the host step overlaps the backward ([Note: overlapped offload step]), and its
    # worker thread writes the NVMe parameter files / steps the groups kept on the device
    "param_nvme_overlap_s3": S.scenario("gpt2", 3, 1, clip=0.0, zero=dict(_offload("nvme", "nvme"), reduce_bucket_size=2000)),
    "ratio_overlap_s3": S.scenario("llama", 3, 2, clip=0.0, zero=dict(_offload("cpu", ratio=0.5), reduce_bucket_size=2000)),
}


def _baseline(sc: dict[str, Any]) -> dict[str, Any]:
    return {**{key: value for key, value in sc.items() if key != "sections"}, "zero": {"sub_group_size": 1000}}


ALL = list(CASES.values())
ALL += [b for i, b in enumerate(_baseline(sc) for sc in CASES.values()) if b not in ALL[: len(CASES) + i]]


def _worker(scenarios: list[dict[str, Any]]) -> list[dict[str, Any]]:
    os.makedirs(NVME_DIR, exist_ok=True)
    return S.run_scenarios(scenarios)


@pytest.fixture(scope="module", params=[1, 2], ids=lambda w: f"world{w}")
def runs(request: pytest.FixtureRequest) -> list[list[dict[str, Any]]]:
    return run_distributed(_worker, request.param, ALL)


def _pair(runs: list[list[dict[str, Any]]], name: str) -> tuple[list[dict], list[dict]]:
    sc = CASES[name]
    return [r[ALL.index(sc)] for r in runs], [r[ALL.index(_baseline(sc))] for r in runs]


@pytest.mark.parametrize("name", list(CASES))
def test_offload_trains_like_single_process_adamw(runs, name):
    """Against the independent torch reference of scenarios.py (fp32 on the whole batch; bf16 as
    data parallelism computes it), with the tolerances and signal checks of the parity tests."""
    sc = CASES[name]
    results = [r[ALL.index(sc)] for r in runs]
    if sc["dtype"] == "fp32":
        check_fp32_parity(results, sc, world=len(runs))
    else:
        check_low_precision_parity(results, sc, world=len(runs))


@pytest.mark.parametrize("name", ["param_nvme_overlap_s3", "ratio_overlap_s3"])
def test_overlapped_step_covers_nvme_params_and_ratio(runs, name):
    for off in _pair(runs, name)[0]:
        trainable = sum(g["trainable"] for g in off["layout"])
        assert off["overlap_per_step"] and all(
            s["groups"] == trainable and s["started_in_backward"] for s in off["overlap_per_step"])


def _shard_bytes(result: dict[str, Any], trainable: bool = True) -> int:
    return sum(4 * g["padded_numel"] // g["world_size"] for g in result["layout"] if g["trainable"] == trainable)


@pytest.mark.parametrize("name", ["opt_cpu_s1", "opt_cpu_s2", "opt_cpu_s3"])
def test_cpu_optimizer_offload_moves_master_grads_and_moments_to_the_host(runs, name):
    offloaded, baseline = _pair(runs, name)
    for off, base in zip(offloaded, baseline):
        m, b = off["memory"], base["memory"]
        assert (m["gradients"], m["fp32_master"], m["optimizer_state"]) == (0, 0, 0)
        assert m["host_gradients"] == b["gradients"] == _shard_bytes(off)
        assert m["host_optimizer_state"] == b["optimizer_state"] == 2 * _shard_bytes(off)
        assert m["host_fp32_master"] == _shard_bytes(off)  # fp32: a host copy, no longer the params
        assert m["compute_params"] == b["compute_params"]


def test_nvme_optimizer_offload_keeps_master_and_moments_in_files(runs):
    offloaded, baseline = _pair(runs, "opt_nvme_s3")
    for off, base in zip(offloaded, baseline):
        m = off["memory"]
        assert m["optimizer_state"] == m["fp32_master"] == m["host_optimizer_state"] == 0
        assert m["nvme"] == 3 * _shard_bytes(off)
        assert m["host_gradients"] == base["memory"]["gradients"]


def test_param_offload_keeps_stage3_shards_on_the_host(runs):
    offloaded, baseline = _pair(runs, "param_cpu_s3")
    for off, base in zip(offloaded, baseline):
        assert off["memory"]["compute_params"] == 0
        assert off["memory"]["host_params"] == base["memory"]["compute_params"]


# Which shards param_nvme_opt_cpu_s3 (max_in_cpu=3000 elements) keeps in host memory, by hand: the
# tiny GPT-2's blocks are padded to 2928 elements (see PADDED_PSI; shards of 2928 at world 1, 1464
# at world 2) and its root unit to 1968 (1968, 984); the first shards in model order that fit are
# kept. World 1: block 0 (2928 <= 3000; block 1 would make 5856, the root 4896). World 2: both
# blocks (2928), not the root (3912).
HOST_CACHED_UNITS = {1: {"transformer.h.0"}, 2: {"transformer.h.0", "transformer.h.1"}}


def _nvme_groups(result: dict[str, Any], max_in_cpu: int) -> tuple[list[dict], list[dict]]:
    """(groups whose shards stay in host memory, groups whose shards are in files)."""
    cached = HOST_CACHED_UNITS[result["layout"][0]["world_size"]] if max_in_cpu else set()
    return ([g for g in result["layout"] if g["unit"] in cached],
            [g for g in result["layout"] if g["unit"] not in cached])


def _bytes(groups: list[dict], itemsize: int) -> int:
    return sum(itemsize * g["padded_numel"] // g["world_size"] for g in groups)


@pytest.mark.parametrize("name", ["param_nvme_s3", "param_nvme_opt_cpu_s3", "param_nvme_opt_nvme_s3", "bf16_param_nvme_s3"])
def test_nvme_param_offload_puts_the_shards_in_files(runs, name):
    offloaded, baseline = _pair(runs, name)
    param = CASES[name]["zero"]["offload_param"]
    optimizer = CASES[name]["zero"].get("offload_optimizer", {}).get("device", "none")
    itemsize = 2 if CASES[name]["dtype"] == "bf16" else 4
    for off, base in zip(offloaded, baseline):
        m, b = off["memory"], base["memory"]
        cached, in_files = _nvme_groups(off, param["max_in_cpu"])
        assert in_files, "the case must put some shards in files"
        assert (name == "param_nvme_opt_cpu_s3") == bool(cached)
        pool = param.get("buffer_count", 5) * max(itemsize * g["padded_numel"] // g["world_size"] for g in in_files)
        assert m["compute_params"] == 0
        assert m["host_params"] == _bytes(cached, itemsize) + pool
        trainable = [g for g in off["layout"] if g["trainable"]]
        optimizer_files = 3 * _bytes(trainable, 4) if optimizer == "nvme" else 0
        assert m["nvme"] == _bytes(in_files, itemsize) + optimizer_files
        if optimizer == "none":  # a file-backed shard cannot be the master: a separate fp32 copy
            file_trainable = [g for g in in_files if g["trainable"]]
            assert m["fp32_master"] == b["fp32_master"] + (_bytes(file_trainable, 4) if itemsize == 4 else 0)
            assert m["optimizer_state"] == b["optimizer_state"]
        assert m["total"] + m["host_total"] + m["nvme"] > b["total"]  # nothing vanished


# The units ratio 0.5 offloads, by hand from [Note: partial optimizer offload] (a unit goes to the
# host when offloaded + numel / 2 <= 0.5 x total, in model order: the input embedding, the blocks,
# then the root; [Note: edge units]).
# GPT-2 (tied, so no edge unit): blocks 2895, 2895, root 1965, target 3877.5: block 0 (1447.5),
# not block 1 (4342.5), the root (3877.5, exactly the target). Llama (untied): embed_tokens 1552,
# blocks 2576, 2576, lm_head 1552, root (the final norm) 16, target 4136: embed_tokens (776),
# block 0 (2840), not block 1 (5416), not lm_head (4904), the root (4136, exactly the target).
HOSTED_AT_HALF = {"gpt2": {"transformer.h.0", "<root>"},
                  "llama": {"model.embed_tokens", "model.layers.0", "<root>"}}


@pytest.mark.parametrize("name", ["ratio_half_s3", "ratio_half_s2"])
def test_ratio_offloads_about_that_share_of_the_optimizer_state(runs, name):
    offloaded, baseline = _pair(runs, name)
    for off, base in zip(offloaded, baseline):
        m, b = off["memory"], base["memory"]
        hosted = HOSTED_AT_HALF[CASES[name]["model"]]
        on_host = [g for g in off["layout"] if g["trainable"] and g["unit"] in hosted]
        kept = [g for g in off["layout"] if g["trainable"] and g["unit"] not in hosted]
        assert on_host and kept
        assert 0.3 <= sum(g["numel"] for g in on_host) / sum(g["numel"] for g in on_host + kept) <= 0.7
        assert m["host_optimizer_state"] == 2 * _shard_bytes({"layout": on_host})
        assert m["optimizer_state"] == 2 * _shard_bytes({"layout": kept})
        assert m["host_fp32_master"] == m["host_gradients"] == _shard_bytes({"layout": on_host})
        assert m["gradients"] == _shard_bytes({"layout": kept}) and m["fp32_master"] == 0  # fp32: aliased
        assert m["optimizer_state"] + m["host_optimizer_state"] == b["optimizer_state"]
        assert m["compute_params"] == b["compute_params"]


# The tiny models' padded element counts Ψ, by hand ([Note: alignment in flat buffers]): every
# parameter starts at a multiple of 8 elements and every unit is padded to a multiple of 8 x the
# world size (1 or 2 here). GPT-2 (n_embd 15): a block's parameters, in order, are 15, 15, 675, 45,
# 225, 15, 15, 15, 900, 60, 900, 15 elements (2895), at offsets 0, 16, 32, 712, 760, 992, 1008,
# 1024, 1040, 1944, 2008, 2912: it ends at 2927 -> 2928. The root (wte 1455, wpe 480, ln_f 15 + 15)
# sits at 0, 1456, 1936, 1952 and ends at 1967 -> 1968. Llama: two blocks of 2576, the embedding
# and lm_head units of 1552 each and a root (the final norm) of 16: every size is a multiple of 16
# already.
PADDED_PSI = {"gpt2": 2928 + 2928 + 1968, "llama": 1552 + 2576 + 2576 + 1552 + 16}


def _hand_offload_bytes(sc: dict[str, Any], world: int) -> tuple[int, int]:
    """(device, host) bytes of fp32 model states per rank with optimizer offload to the CPU: the
    host holds the fp32 master, gradient shard and both moments (16 Ψ/N); the device the
    compute parameters, 4 Ψ (stages 1-2) or 4 Ψ/N (stage 3), which parameter offload moves to
    the host too."""
    psi = PADDED_PSI[sc["model"]]
    params = 4 * psi // world if sc["stage"] == 3 else 4 * psi
    host = 16 * psi // world
    if "offload_param" in sc["zero"]:
        return 0, host + params
    return params, host


@pytest.mark.parametrize("name", ["opt_cpu_s1", "opt_cpu_s2", "opt_cpu_s3", "both_cpu_s3"])
def test_estimator_offload_rows_equal_the_hand_calculation(runs, name):
    """The estimator's offload rows and the engine's report both equal the hand figures."""
    from hf_zero.estimator import estimate_model_states
    from tests.tiny_models import BUILDERS

    sc = CASES[name]
    world = len(runs)
    expected = _hand_offload_bytes(sc, world)
    rows = estimate_model_states(BUILDERS[sc["model"]](), num_gpus_per_node=world, dtype=sc["dtype"],
                                 stages=[sc["stage"]], persistence_threshold=0)
    row = next(r for r in rows if r.offload_optimizer and r.offload_param == ("offload_param" in sc["zero"]))
    assert (row.device_bytes, row.host_bytes) == expected
    for off in _pair(runs, name)[0]:
        m = off["memory"]
        assert (m["total"] - m["buffers"], m["host_total"]) == expected


# ------------------------------------------------------------------ NVMe resident memory
NVME_SCRIPT = textwrap.dedent("""
    import json, sys, torch, transformers, hf_zero
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=8192, n_positions=32, n_embd=512, n_layer=16, n_head=8))
    # Stage 2: full gradients exist one unit at a time, so the peak is set by the optimizer step
    # (moments + gradient shard), which is what NVMe offload changes; stage 1 at world size 1
    # peaks while the full gradients and the gradient shard coexist at the reduce.
    zero = {"stage": 2, "sub_group_size": 1 << 20}
    if sys.argv[1] != "none":
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": sys.argv[2]}
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    engine, *_ = hf_zero.initialize(model=model, config=config)
    ids = torch.randint(0, 8192, (1, 16))
    for _ in range(2):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    hwm = [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
    numel = sum(p.numel() for p in model.parameters())
    print(json.dumps({"peak_kib": hwm, "numel": numel, "files": sorted(__import__("os").listdir(sys.argv[2]))}))
""")


def _nvme_run(mode: str, nvme_path: str) -> dict[str, Any]:
    import json

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    # glibc raises its mmap threshold after large frees, after which freed buffers stay in the
    # heap and peak RSS depends on allocation history; a fixed threshold makes it repeatable.
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    # The engine's memory, not the ordering check's: its private results and input snapshots
    # ([Note: late completion]) add about 100 MiB to the NVMe run alone.
    env["HF_ZERO_CHECK_ASYNC"] = "0"
    done = subprocess.run([sys.executable, "-c", NVME_SCRIPT, mode, nvme_path], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_nvme_offload_takes_the_optimizer_state_out_of_the_resident_set(tmp_path):
    plain = _nvme_run("none", str(tmp_path))
    nvme = _nvme_run("nvme", str(tmp_path))
    assert plain["numel"] >= 50_000_000
    optimizer_state = 8 * plain["numel"]  # Adam's two fp32 moments
    dropped = (plain["peak_kib"] - nvme["peak_kib"]) * 1024
    assert dropped >= 0.7 * optimizer_state, f"peak RSS fell by {dropped / 2**20:.0f} MiB of {optimizer_state / 2**20:.0f}"
    assert nvme["files"] == ["hf_zero-rank0-pid" + nvme["files"][0].split("pid")[1]]  # one folder, clearly named
    assert os.listdir(tmp_path) == []  # removed at a clean exit


def test_bad_nvme_path_is_an_error_before_training(tmp_path):
    import torch

    import hf_zero

    config = S.make_config(S.scenario("gpt2", 2))
    missing = str(tmp_path / "nope")
    config["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": missing}
    with pytest.raises(FileNotFoundError, match="nvme_path"):
        hf_zero.initialize(model=S.build_model(S.scenario("gpt2", 2)), config=config)
    config["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(tmp_path)
    with pytest.raises(NotImplementedError, match="optimizer"):
        model = S.build_model(S.scenario("gpt2", 2))
        del config["optimizer"]
        hf_zero.initialize(model=model, config=config, optimizer=torch.optim.AdamW(model.parameters()))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("kind", ["Muon", "Adafactor"])
def test_nvme_optimizer_offload_with_a_shape_aware_config_optimizer_is_refused(tmp_path, kind):
    """NVMe offload steps hf_zero's Adam tile by tile: a Muon or Adafactor section would
    silently train with Adam."""
    import hf_zero

    config = S.make_config(S.scenario("gpt2", 2))
    config["optimizer"] = {"type": kind, "params": {"lr": 1e-3}}
    config["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": str(tmp_path)}
    with pytest.raises(NotImplementedError, match=rf"the config's optimizer is {kind} .*offload_optimizer.device \"cpu\""):
        hf_zero.initialize(model=S.build_model(S.scenario("gpt2", 2)), config=config)
    assert os.listdir(tmp_path) == []


def test_bad_nvme_path_for_param_offload_is_an_error_before_training(tmp_path, monkeypatch):
    import shutil

    import hf_zero
    from hf_zero.config import HfZeroConfigError

    sc = S.scenario("gpt2", 3)

    def initialize(**param: Any) -> Any:
        config = S.make_config(sc)
        config["zero_optimization"]["offload_param"] = {"device": "nvme", "max_in_cpu": 0, **param}
        return hf_zero.initialize(model=S.build_model(sc), config=config)

    with pytest.raises(FileNotFoundError, match="nvme_path"):
        initialize(nvme_path=str(tmp_path / "nope"))
    (tmp_path / "a_file").write_text("")
    with pytest.raises(FileNotFoundError, match="nvme_path"):
        initialize(nvme_path=str(tmp_path / "a_file"))
    drive = tmp_path / "drive"
    drive.mkdir()
    with pytest.raises(HfZeroConfigError, match="buffer_size") as info:
        initialize(nvme_path=str(drive), buffer_size=100)  # smaller than a unit's shard
    assert "set buffer_size to at least 2928" in str(info.value)  # a block's shard (PADDED_PSI)
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=1000))
    with pytest.raises(OSError, match="offloaded parameter shards of this rank needs"):
        initialize(nvme_path=str(drive))
    monkeypatch.undo()
    assert os.listdir(drive) == []  # the buffer_size failure removed the files it had written


# ------------------------------------------------------------------ files removed at exit
FILES_SCRIPT = textwrap.dedent("""
    import json, os, sys, torch, hf_zero
    sys.path.insert(0, sys.argv[2])
    from tests.distributed import scenarios as S
    def listing():
        return sorted(os.path.relpath(os.path.join(r, f), sys.argv[1]) for r, _, fs in os.walk(sys.argv[1]) for f in fs)
    sc = S.scenario("gpt2", 3)
    config = S.make_config(sc)
    nvme = {"device": "nvme", "nvme_path": sys.argv[1]}
    config["zero_optimization"].update(offload_optimizer=nvme, offload_param=dict(nvme, max_in_cpu=0))
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    first, *_ = hf_zero.initialize(model=S.build_model(sc), config=config)
    with_first = listing()
    config["zero_optimization"]["offload_optimizer"] = nvme
    engine, *_ = hf_zero.initialize(model=S.build_model(sc), config=config)  # another engine, its own folder
    ids = torch.randint(0, 97, (2, 12))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    print(json.dumps({"with_first": with_first, "with_both": listing(), "pid": os.getpid()}))
""")


def test_nvme_files_are_clearly_named_and_removed_at_exit(tmp_path):
    import json

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    done = subprocess.run([sys.executable, "-c", FILES_SCRIPT, str(tmp_path), root], capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    folder = f"hf_zero-rank0-pid{out['pid']}"
    params = [f"{folder}/{{}}/transformer.h.0#0.fp32", f"{folder}/{{}}/transformer.h.1#0.fp32", f"{folder}/{{}}/_root_#0.fp32"]
    optimizer = [f"{folder}/group{i:04d}.{state}.fp32" for i in range(3) for state in ("master", "exp_avg", "exp_avg_sq")]
    assert out["with_first"] == sorted(p.format("params") for p in params)
    assert out["with_both"] == sorted([p.format("params") for p in params] + [p.format("params-1") for p in params] + optimizer)
    assert os.listdir(tmp_path) == []  # everything removed at a clean exit


# ------------------------------------------------------------------ sharded loading into NVMe
def test_sharded_from_pretrained_writes_each_shard_to_its_file(tmp_path):
    import transformers

    import hf_zero
    from tests.tiny_models import BUILDERS

    BUILDERS["llama"](seed=3).save_pretrained(tmp_path / "model")
    drive = tmp_path / "drive"
    drive.mkdir()
    config = S.make_config(S.scenario("llama", 3))
    config["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": str(drive), "max_in_cpu": 0}
    live = hf_zero.HfZeroConfig(config)  # kept alive while loading: sharded from_pretrained
    lazy = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "model")
    assert all(p.is_meta for p in lazy.parameters())
    engine, *_ = hf_zero.initialize(model=lazy, config=config)
    del live
    plain = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "model").eval()
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    engine.eval()
    with torch.no_grad():
        assert torch.equal(engine(input_ids=ids).logits, plain(input_ids=ids).logits)
    memory = engine.memory_report()
    assert memory["compute_params"] == 0 and memory["nvme"] == 4 * sum(g["padded_numel"] for g in engine.layout())
    engine.train()
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    assert engine.global_steps == 1


# ------------------------------------------------------------------ checkpoints of NVMe-offloaded state
CKPT_STEPS, CKPT_SAVE_AT, CKPT_ROWS = 5, 3, 6  # the global batch is kept: 2 ranks x 3 rows, 1 rank x 6
NVME_BOTH = _offload("nvme", "nvme", buffer_count=2)
NVME_PARAMS_CPU_OPT = _offload("cpu", "nvme", max_in_cpu=1000)


def _ckpt_sc(world: int, zero: dict[str, Any]) -> dict[str, Any]:
    # frozen parameters: their compute shards are saved from (and loaded into) their files too
    return S.scenario("gpt2", 3, 1, micro=CKPT_ROWS // world, freeze=True, zero=zero)


def _ckpt_train(root: str, zero: dict[str, Any], load: str | None, save: str | None) -> dict[str, Any]:
    from tests.distributed.test_checkpoint import _engine, _mean_over_ranks, _train

    world = int(os.environ["WORLD_SIZE"])
    sc = _ckpt_sc(world, zero)
    engine = _engine(sc, seed=1 if load else 0, scheduler=True)
    losses: list[float] = []
    if load:
        engine.load_checkpoint(os.path.join(root, load))
    else:
        losses += _train(engine, sc, range(CKPT_SAVE_AT))
        engine.save_checkpoint(os.path.join(root, save))
    losses += _train(engine, sc, range(CKPT_SAVE_AT, CKPT_STEPS))
    return {"losses": _mean_over_ranks(engine, losses), "params": S.full_params(engine), "steps": engine.global_steps}


def _state_dict_roundtrip(zero: dict[str, Any]) -> float:
    """What the Trainer's save_model / load of a model folder do (bf16, so the fp32 master is
    separate): load a perturbed full state dict, gather it back in fp32, largest difference."""
    import hf_zero
    from hf_zero.integrations._weights import gather_full_state_dict, load_state_dict_into_engine

    sc = S.scenario("gpt2", 3, dtype="bf16", zero=zero)
    engine, *_ = hf_zero.initialize(model=S.build_model(sc), config=S.make_config(sc))
    generator = torch.Generator().manual_seed(5)
    wanted = {n: p.detach().float() + 1e-3 * torch.randn(p.shape, generator=generator)
              for n, p in S.build_model(sc).named_parameters()}
    load_state_dict_into_engine(engine, wanted)
    back = gather_full_state_dict(engine, dtype=torch.float32, rank0_only=False)
    return max(float((back[n] - wanted[n]).abs().max()) for n in wanted)


def _ckpt_world2(root: str) -> dict[str, Any]:
    return {
        "state_dict": {name: _state_dict_roundtrip(zero) for name, zero in
                       [("plain", {}), ("nvme_both", NVME_BOTH), ("nvme_optimizer", _offload("nvme")),
                        ("cpu_optimizer", _offload("cpu"))]},
        "plain": _ckpt_train(root, {"sub_group_size": 1000}, None, "plain"),
        "nvme": _ckpt_train(root, NVME_BOTH, None, "nvme"),
        "nvme_to_plain": _ckpt_train(root, {"sub_group_size": 1000}, "nvme", None),
        "plain_to_nvme": _ckpt_train(root, NVME_BOTH, "plain", None),
    }


def _ckpt_world1(root: str) -> dict[str, Any]:
    return {
        "nvme_to_plain": _ckpt_train(root, {"sub_group_size": 1000}, "nvme", None),
        "plain_to_nvme_params": _ckpt_train(root, NVME_PARAMS_CPU_OPT, "plain", None),
        "nvme_to_nvme": _ckpt_train(root, NVME_BOTH, "nvme", None),
    }


def _ckpt_phases(root: str) -> dict[str, Any]:
    from tests.distributed.launch import in_group

    os.makedirs(NVME_DIR, exist_ok=True)
    return {"w2": in_group(2, _ckpt_world2, root), "w1": in_group(1, _ckpt_world1, root)}


@pytest.fixture(scope="module")
def checkpoint_runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(_ckpt_phases, 2, str(tmp_path_factory.mktemp("nvme_ckpt")))


def _continues(resumed: dict[str, Any], reference: dict[str, Any]) -> None:
    assert resumed["steps"] == CKPT_STEPS
    assert resumed["losses"] == pytest.approx(reference["losses"][CKPT_SAVE_AT:], abs=1e-5)
    assert resumed["params"].keys() == reference["params"].keys()
    worst = max(max(abs(a - b) for a, b in zip(resumed["params"][n], reference["params"][n], strict=True))
                for n in reference["params"])
    assert worst <= 1e-5


def test_nvme_offloaded_run_matches_the_plain_one_across_its_save(checkpoint_runs):
    for rank in checkpoint_runs:
        w2 = rank["w2"]
        assert w2["nvme"]["losses"] == pytest.approx(w2["plain"]["losses"], abs=1e-5)


def test_full_state_dict_save_and_load_with_nvme_offload(checkpoint_runs):
    """gather_full_state_dict / load_state_dict_into_engine (Trainer save_model, Accelerate
    get_state_dict) read and write the fp32 master in the NVMe files."""
    for rank in checkpoint_runs:
        # cpu_optimizer: the host masters are moved to the compute device for the all-gather
        # (the communicator refuses host memory: [Note: host-device transfers]).
        assert rank["w2"]["state_dict"] == {"plain": 0.0, "nvme_both": 0.0, "nvme_optimizer": 0.0,
                                            "cpu_optimizer": 0.0}


@pytest.mark.parametrize("world,case", [("w2", "nvme_to_plain"), ("w2", "plain_to_nvme"), ("w1", "nvme_to_plain"),
                                        ("w1", "plain_to_nvme_params"), ("w1", "nvme_to_nvme")])
def test_checkpoint_with_nvme_offload_resumes_with_or_without_it(checkpoint_runs, world, case):
    reference = checkpoint_runs[0]["w2"]["plain"]
    for rank in checkpoint_runs[: 2 if world == "w2" else 1]:
        _continues(rank[world][case], reference)
