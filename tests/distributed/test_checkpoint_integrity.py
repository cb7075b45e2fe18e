"""A corruption corpus against real checkpoints on a real gloo group: every damaged checkpoint is
refused by ``load_checkpoint`` on every rank before any parameter, optimizer moment, scheduler
step or counter changes (checked bit for bit), with an error naming the damaged file; ``export``
refuses the same checkpoints. The undamaged checkpoint then loads.

One spawn of two processes: each saves (stage 3, so each rank file holds one rank's shards),
rank 0 damages copies, then both ranks try every copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from typing import Any, Callable

import pytest
import torch

from tests.distributed import scenarios as S
from tests.distributed.launch import run_distributed
from tests.tiny_models import batch_for_step

RANK0 = "rank-00000-of-00002.safetensors"
RANK1 = "rank-00001-of-00002.safetensors"
TAG = "global_step2"


# ------------------------------------------------------------------ the damage (rank 0, on copies)
def _header(path: str) -> tuple[int, dict[str, Any]]:
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        return length, json.loads(handle.read(length))


def _data_start(path: str, tensor: str) -> int:
    length, header = _header(path)
    return 8 + length + header[tensor]["data_offsets"][0]


def _first(path: str, suffix: str) -> str:
    _, header = _header(path)
    return next(name for name in header if name.endswith(suffix))


def _patch(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        handle.write(data)


def _flip_byte(path: str, suffix: str) -> None:
    offset = _data_start(path, _first(path, suffix)) + 5
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)[0]
    _patch(path, offset, bytes([byte ^ 0x10]))


def _nan(path: str) -> None:
    _patch(path, _data_start(path, _first(path, "/param")) + 4, struct.pack("<f", float("nan")))


def _replace_in_header(path: str, old: bytes, new: bytes) -> None:
    """Same-length edit inside the JSON header (the file keeps its size)."""
    assert len(old) == len(new)
    length, _ = _header(path)
    with open(path, "r+b") as handle:
        handle.seek(8)
        raw = handle.read(length)
        assert old in raw, (old, raw[:200])
        handle.seek(8)
        handle.write(raw.replace(old, new, 1))


def _swap_offsets(path: str) -> None:
    """Exchange the byte ranges of a group's parameter and its first moment (same size)."""
    _, header = _header(path)
    param = _first(path, "/param")
    moment = param.replace("/param", "/optim.exp_avg")
    a = json.dumps(header[param]["data_offsets"], separators=(",", ":")).encode()
    b = json.dumps(header[moment]["data_offsets"], separators=(",", ":")).encode()
    length, _ = _header(path)
    with open(path, "r+b") as handle:
        handle.seek(8)
        raw = handle.read(length)
        swapped = raw.replace(a, b"\0").replace(b, a).replace(b"\0", b)
        assert len(swapped) == len(raw) and swapped != raw
        handle.seek(8)
        handle.write(swapped)


def _swap_files(ckpt: str) -> None:
    os.rename(os.path.join(ckpt, RANK0), os.path.join(ckpt, "tmp"))
    os.rename(os.path.join(ckpt, RANK1), os.path.join(ckpt, RANK0))
    os.rename(os.path.join(ckpt, "tmp"), os.path.join(ckpt, RANK1))


def _edit_manifest(ckpt: str, edit: Callable[[dict[str, Any]], None]) -> None:
    path = os.path.join(ckpt, "manifest.json")
    with open(path) as handle:
        manifest = json.load(handle)
    edit(manifest)
    with open(path, "w") as handle:
        json.dump(manifest, handle)


def _truncate_json(ckpt: str) -> None:
    path = os.path.join(ckpt, "manifest.json")
    with open(path, "r+b") as handle:
        handle.truncate(os.path.getsize(path) // 2)


def _truncate(path: str) -> None:
    with open(path, "r+b") as handle:
        handle.truncate(os.path.getsize(path) - 7)


def _other_save(ckpt: str) -> None:
    shutil.copy(os.path.join(ckpt, "..", "..", "..", "good", "global_step1", RANK1), os.path.join(ckpt, RANK1))


def _group_key(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(manifest: dict[str, Any]) -> None:
        manifest["groups"][0][key] = value
    return edit


# case -> (damage of the checkpoint directory, the file the error must name)
CASES: dict[str, tuple[Callable[[str], None], str]] = {
    "flipped_byte_param": (lambda d: _flip_byte(os.path.join(d, RANK1), "/param"), RANK1),
    "flipped_byte_moment": (lambda d: _flip_byte(os.path.join(d, RANK0), "/optim.exp_avg_sq"), RANK0),
    "nan_data": (lambda d: _nan(os.path.join(d, RANK0)), RANK0),
    "header_dtype_f32_i32": (lambda d: _replace_in_header(os.path.join(d, RANK1), b'"F32"', b'"I32"'), RANK1),
    "rank_files_swapped": (_swap_files, RANK0),
    "offsets_swapped": (lambda d: _swap_offsets(os.path.join(d, RANK0)), RANK0),
    "truncated": (lambda d: _truncate(os.path.join(d, RANK1)), RANK1),
    "missing_rank_file": (lambda d: os.remove(os.path.join(d, RANK1)), RANK1),
    "empty_rank_file": (lambda d: open(os.path.join(d, RANK0), "wb").close(), RANK0),
    "file_of_another_save": (_other_save, RANK1),
    "manifest_not_json": (_truncate_json, "manifest.json"),
    "manifest_missing": (lambda d: os.remove(os.path.join(d, "manifest.json")), "manifest.json"),
    "manifest_group_without_slots": (lambda d: _edit_manifest(d, lambda m: m["groups"][0].pop("slots")), "manifest.json"),
    "manifest_slots_not_a_list": (lambda d: _edit_manifest(d, _group_key("slots", 7)), "manifest.json"),
    "manifest_world_size_3": (lambda d: _edit_manifest(d, _group_key("world_size", 3)), "manifest.json"),
    "manifest_files_cut": (lambda d: _edit_manifest(d, lambda m: m["files"].pop()), "manifest.json"),
    "manifest_scheduler_garbage": (lambda d: _edit_manifest(d, lambda m: m["lr_scheduler"].update(state=[1, 2])),
                                   "manifest.json"),
    "manifest_rng_garbage": (lambda d: _edit_manifest(d, lambda m: m["rng"][1].update(torch_cpu="AAAA")),
                             "manifest.json"),
}

# what the error must say besides the file, where one check is meant to catch the case
PHRASES = {"rank_files_swapped": "swapped", "header_dtype_f32_i32": "header was altered",
           "flipped_byte_param": "checksum", "offsets_swapped": "checksum", "file_of_another_save": "another save",
           "truncated": "truncated", "manifest_scheduler_garbage": "lr_scheduler", "manifest_rng_garbage": "RNG"}


def _damage_all(root: str) -> None:
    for case, (damage, _) in CASES.items():
        target = os.path.join(root, "broken", case)
        shutil.copytree(os.path.join(root, "good"), target)
        damage(os.path.join(target, TAG))


# ------------------------------------------------------------------ every rank
SCHEDULER = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 5}}


def _engine(seed: int) -> Any:
    import hf_zero
    from tests.tiny_models import BUILDERS

    sc = S.scenario("gpt2", 3, 1)
    config = dict(S.make_config(sc), scheduler=SCHEDULER)
    engine, *_ = hf_zero.initialize(model=BUILDERS["gpt2"](seed=seed).train(), config=config)
    return engine


def _train(engine: Any, steps: range) -> None:
    for step in steps:
        batch = batch_for_step(step, 2 * engine.world_size)
        rows = batch[engine.rank * 2:(engine.rank + 1) * 2]
        engine.backward(S.model_loss(engine, "gpt2", rows))
        engine.step()


def _state_digest(engine: Any) -> str:
    """This rank's whole training state, bit for bit: shards, masters, moments, scheduler, counters."""
    digest = hashlib.sha256()
    for unit in engine.units:
        for group in unit.groups:
            for tensor in (group.storage.shard, group.master_state.tensor):
                if tensor is not None:
                    digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            master = group.master_state.tensor
            state = engine.optimizer.inner.state.get(master, {}) if master is not None else {}
            for key in sorted(state):
                value = state[key]
                digest.update(key.encode())
                digest.update(value.cpu().contiguous().view(torch.uint8).numpy().tobytes()
                              if isinstance(value, torch.Tensor) else repr(value).encode())
    digest.update(repr(engine.lr_scheduler.state_dict()).encode())
    digest.update(repr([engine.global_steps, engine.micro_steps, engine.global_samples]).encode())
    digest.update(torch.get_rng_state().numpy().tobytes())
    return digest.hexdigest()


def _corpus(root: str) -> dict[str, Any]:
    import torch.distributed as dist

    from hf_zero.checkpoint import CheckpointError

    engine = _engine(seed=0)
    _train(engine, range(1))
    engine.save_checkpoint(os.path.join(root, "good"))  # global_step1: another save, for one case
    _train(engine, range(1, 2))
    engine.save_checkpoint(os.path.join(root, "good"))
    saved = _state_digest(engine)
    if engine.rank == 0:
        _damage_all(root)
    dist.barrier()
    fresh = _engine(seed=1)
    _train(fresh, range(5, 6))  # moments and a scheduler step of its own, all to be kept
    before = _state_digest(fresh)
    outcomes = {}
    for case in CASES:
        try:
            fresh.load_checkpoint(os.path.join(root, "broken", case))
            error = None
        except CheckpointError as exc:
            error = str(exc)
        except Exception as exc:  # recorded, so the test names the case instead of crashing
            error = f"not a CheckpointError: {type(exc).__name__}: {exc}"
        unchanged = _state_digest(fresh) == before
        outcomes[case] = {"error": error, "unchanged": unchanged}
        if not unchanged:  # garbage went in: start the next case from the same state again
            fresh = _engine(seed=1)
            _train(fresh, range(5, 6))
    fresh.load_checkpoint(os.path.join(root, "good"))
    return {"outcomes": outcomes, "good_loads": _state_digest(fresh) == saved}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("integrity"))
    return {"root": root, "ranks": run_distributed(_corpus, 2, root)}


@pytest.mark.parametrize("case", list(CASES))
def test_a_damaged_checkpoint_is_refused_before_anything_changes(corpus, case):
    for rank, result in enumerate(corpus["ranks"]):
        outcome = result["outcomes"][case]
        assert outcome["error"] is not None, f"rank {rank} loaded {case} without an error"
        assert not outcome["error"].startswith("not a CheckpointError"), outcome["error"]
        assert CASES[case][1] in outcome["error"], outcome["error"]
        said = outcome["error"].replace(os.path.join(corpus["root"], "broken", case), "<dir>")  # the case's name
        assert PHRASES.get(case, "") in said, outcome["error"]
        assert "nothing was loaded" in outcome["error"]
        assert outcome["unchanged"], f"rank {rank}: {case} changed the engine before failing"


def test_the_undamaged_checkpoint_still_loads_bitwise(corpus):
    assert all(result["good_loads"] for result in corpus["ranks"])


RUN_STATE_ONLY = ("manifest_scheduler_garbage", "manifest_rng_garbage")  # export never reads run state


@pytest.mark.parametrize("case", [c for c in CASES if c not in RUN_STATE_ONLY])
def test_export_refuses_the_same_checkpoints(corpus, case, tmp_path):
    from hf_zero.checkpoint import CheckpointError, export_hf_model

    with pytest.raises(CheckpointError) as info:
        export_hf_model(os.path.join(corpus["root"], "broken", case), tmp_path / "out")
    assert CASES[case][1] in str(info.value)
    assert not os.path.exists(tmp_path / "out")
