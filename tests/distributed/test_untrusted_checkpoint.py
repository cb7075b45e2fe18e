"""Checkpoints as untrusted input: a corpus of edited checkpoints, each refused by the check meant
for it, with nothing changed and nothing outside the checkpoint folder looked at.

World size 1, in this process (as a notebook runs), so that every file the load opens or stats
can be traced: ``open`` audit events (``open``, ``os.open``, ``io.open_code``), ``os.stat``,
``os.lstat``, ``os.listdir`` and ``os.readlink`` (which ``os.path.isfile``, ``islink``,
``getsize`` and ``realpath`` go through) and safetensors' ``safe_open``. Each case lives in its
own save folder; a complete copy of the same checkpoint sits outside it (the decoy), so a load
that followed a path out would succeed silently instead of failing. The engine takes one torch
AdamW with a torch StepLR (whose ``load_state_dict`` turns keys into attributes).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from typing import Any, Callable

import pytest
import torch

from tests.distributed import scenarios as S
from tests.tiny_models import batch_for_step

TAG = "global_step2"
RANK0 = "rank-00000-of-00001.safetensors"
MANIFEST = "manifest.json"


# ------------------------------------------------------------------ tracing what a load touches
_TRACE: list[str] | None = None


def _audit(event: str, args: tuple) -> None:
    if _TRACE is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _TRACE.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)  # hooks cannot be removed: it records only while _TRACE is a list


def _traced(fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(path: Any, *args: Any, **kwargs: Any) -> Any:
        if _TRACE is not None and isinstance(path, (str, bytes, os.PathLike)):
            _TRACE.append(os.fsdecode(path))
        return fn(path, *args, **kwargs)
    return wrapper


def _touched(load: Callable[[], Any]) -> tuple[list[str], BaseException | None]:
    """Every path ``load`` opened or stat'ed (absolute), and what it raised."""
    global _TRACE
    from hf_zero.checkpoint import reader

    with pytest.MonkeyPatch.context() as mp:
        for name in ("stat", "lstat", "listdir", "readlink"):
            mp.setattr(os, name, _traced(getattr(os, name)))
        mp.setattr(reader, "safe_open", _traced(reader.safe_open))
        _TRACE, error = [], None
        try:
            load()
        except Exception as exc:
            error = exc
        finally:
            touched, _TRACE = [os.path.abspath(p) for p in _TRACE], None
    return touched, error


def _outside(touched: list[str], folder: str) -> list[str]:
    """Paths neither in ``folder`` nor on the way to it (the caller names the folder; reaching
    it goes through its parents), leaving out Python's imports (torch imports some modules on
    first use, e.g. to print a tensor in an error message)."""
    ancestors = {folder}
    path = folder
    while os.path.dirname(path) != path:
        path = os.path.dirname(path)
        ancestors.add(path)
    code = tuple(os.path.abspath(p) + os.sep for p in sys.path if p and os.path.isdir(p))
    assert not folder.startswith(code), "the checkpoint folder lies among Python's import paths"
    return sorted({p for p in touched
                   if p not in ancestors and not p.startswith(folder + os.sep) and not p.startswith(code)})


# ------------------------------------------------------------------ the engine and its state
def _engine(seed: int, dtype: str = "fp32") -> Any:
    import hf_zero
    from tests.tiny_models import BUILDERS

    model = BUILDERS["llama"](seed=seed).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=S.LR, betas=S.BETAS, eps=S.EPS, weight_decay=S.WEIGHT_DECAY)
    config = S.make_config(S.scenario("llama", 2, 1, optimizer="torch", dtype=dtype))
    engine, *_ = hf_zero.initialize(model=model, optimizer=optimizer, config=config,
                                    lr_scheduler=lambda zero_opt: torch.optim.lr_scheduler.StepLR(zero_opt, 2, 0.5))
    return engine


def _train(engine: Any, steps: range) -> None:
    for step in steps:
        engine.backward(S.model_loss(engine, "llama", batch_for_step(step, 2)))
        engine.step()


def _tensor_bytes(value: torch.Tensor) -> bytes:
    return value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _state_digest(engine: Any, rng: bool = True) -> str:
    """The whole training state, bit for bit, and every attribute of the optimizer and the
    scheduler: shards, masters, optimizer state and param groups, scheduler, counters, and the
    (process-wide) RNG unless ``rng`` is False (to compare two engines of one process)."""
    digest = hashlib.sha256()
    inner = engine.optimizer.inner
    for unit in engine.units:
        for group in unit.groups:
            for tensor in (group.storage.shard, group.master_state.tensor):
                if tensor is not None:
                    digest.update(_tensor_bytes(tensor))
            state = inner.state.get(group.master_state.tensor, {}) if group.master_state.tensor is not None else {}
            for key in sorted(state):
                value = state[key]
                digest.update(f"{key} {type(value).__name__} {getattr(value, 'dtype', '')}".encode())
                digest.update(_tensor_bytes(value) if isinstance(value, torch.Tensor) else repr(value).encode())
    digest.update(repr([{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]).encode())
    digest.update(repr(sorted(vars(inner))).encode())
    scheduler = vars(engine.lr_scheduler)
    digest.update(repr({k: v for k, v in sorted(scheduler.items()) if k != "optimizer"}).encode())
    digest.update(repr([engine.global_steps, engine.micro_steps, engine.global_samples]).encode())
    if rng:
        digest.update(torch.get_rng_state().numpy().tobytes())
    return digest.hexdigest()


# ------------------------------------------------------------------ the damage
def _edit(edit: Callable[[dict[str, Any]], None]) -> Callable[[str, str], None]:
    def damage(save_dir: str, decoy: str) -> None:
        path = os.path.join(save_dir, TAG, MANIFEST)
        with open(path) as handle:
            manifest = json.load(handle)
        edit(manifest)
        with open(path, "w") as handle:
            json.dump(manifest, handle)
    return damage


def _write_latest(content: Callable[[str], str]) -> Callable[[str, str], None]:
    def damage(save_dir: str, decoy: str) -> None:
        with open(os.path.join(save_dir, "latest"), "w") as handle:
            handle.write(content(decoy))
    return damage


def _link(name: str, target: Callable[[str], str], inside: str = TAG) -> Callable[[str, str], None]:
    """Replace ``save_dir/inside/name`` (or create it) by a symlink to ``target(decoy)``."""
    def damage(save_dir: str, decoy: str) -> None:
        path = os.path.join(save_dir, inside, name) if inside else os.path.join(save_dir, name)
        if os.path.lexists(path):
            os.remove(path)
        os.symlink(target(decoy), path)
    return damage


def _hyper(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(manifest: dict[str, Any]) -> None:
        manifest["optimizer"]["param_groups"][0][key] = value
    return edit


def _step(value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(manifest: dict[str, Any]) -> None:
        manifest["groups"][0]["optimizer_scalars"]["step"] = value
    return edit


def _scheduler(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(manifest: dict[str, Any]) -> None:
        manifest["lr_scheduler"]["state"][key] = value
    return edit


def _unverified(version: Any) -> Callable[[dict[str, Any]], None]:
    def edit(manifest: dict[str, Any]) -> None:
        manifest["format_version"] = version
        for record in manifest["files"]:
            record.pop("tensors")
    return edit


def _deep(levels: int) -> Any:
    value: Any = 0
    for _ in range(levels):
        value = [value]
    return value


def _deep_text(levels: int) -> Callable[[str, str], None]:
    """client_state nested ``levels`` deep, written as text (json.dump itself would recurse)."""
    def damage(save_dir: str, decoy: str) -> None:
        path = os.path.join(save_dir, TAG, MANIFEST)
        with open(path) as handle:
            text = handle.read()
        saved = '"client_state": {\n  "epoch": 1\n }'
        assert saved in text, text[-200:]
        with open(path, "w") as handle:
            handle.write(text.replace(saved, '"client_state": ' + "[" * levels + "]" * levels))
    return damage


def _swap_slots(group: int, first: int, second: int, key: str) -> Callable[[dict[str, Any]], None]:
    def edit(manifest: dict[str, Any]) -> None:
        slots = manifest["groups"][group]["slots"]
        assert slots[first]["shape"] == slots[second]["shape"], (slots[first], slots[second])
        slots[first][key], slots[second][key] = slots[second][key], slots[first][key]
    return edit


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda manifest: manifest.__setitem__(key, value)


def _decoy_tensor(dtype: str) -> dict[str, Any]:
    return {"__tensor__": {"dtype": dtype, "shape": [], "data": [2.0]}}


# case -> (damage(save_dir, decoy_save_dir), phrase of the check meant to catch it, file it names,
#          load keyword arguments)
CASES: dict[str, tuple[Callable[[str, str], None], str, str, dict[str, Any]]] = {
    # paths: see [Note: confined paths]
    "latest_dotdot": (_write_latest(lambda d: f"../../decoy/{TAG}"), "not a tag name", "latest", {}),
    "latest_absolute": (_write_latest(lambda d: os.path.join(d, TAG)), "not a tag name", "latest", {}),
    "latest_slash": (_write_latest(lambda d: f"{TAG}/."), "not a tag name", "latest", {}),
    "latest_nul": (_write_latest(lambda d: "global\x00step2"), "not a tag name", "latest", {}),
    "latest_symlink_out": (_link("latest", lambda d: os.path.join(d, "latest"), inside=""), "outside", "latest", {}),
    "tag_folder_symlink_out": (_link("elsewhere", lambda d: os.path.join(d, TAG), inside=""), "outside", "elsewhere",
                               {"tag": "elsewhere"}),
    "tag_argument_dotdot": (lambda s, d: None, "not usable as a directory name", "../", {"tag": f"../decoy/{TAG}"}),
    "manifest_names_etc_passwd": (_edit(lambda m: m["files"][0].update(name="/etc/passwd")),
                                  "malformed manifest (edited by hand or damaged): files[0].name", MANIFEST, {}),
    "manifest_names_dotdot": (_edit(lambda m: m["files"][0].update(name=f"../../../decoy/{TAG}/{RANK0}")),
                              "malformed manifest (edited by hand or damaged): files[0].name", MANIFEST, {}),
    "rank_file_symlink_out": (_link(RANK0, lambda d: os.path.join(d, TAG, RANK0)), "outside", RANK0, {}),
    "rank_file_symlink_dotdot": (_link(RANK0, lambda d: f"../../../decoy/{TAG}/{RANK0}"),
                                 "outside", RANK0, {}),
    "manifest_symlink_out": (_link(MANIFEST, lambda d: os.path.join(d, TAG, MANIFEST)), "outside", MANIFEST, {}),
    # integrity decided by the reader
    "format_1_no_checksums": (_edit(_unverified(1)), "records no checksums", MANIFEST, {}),
    "format_true_no_checksums": (_edit(_unverified(True)), "format version True is not one", MANIFEST, {}),
    "format_0": (_edit(_set("format_version", 0)), "format version 0 is not one", MANIFEST, {}),
    "format_2_no_checksums": (_edit(_unverified(2)), "sha256 of each tensor", MANIFEST, {}),
    # no names decoded into callables
    "scheduler_dtype_load": (_edit(_scheduler("gamma", {"__dtype__": "load"})), "not a dtype a checkpoint holds",
                             MANIFEST, {}),
    "step_tensor_dtype_load": (_edit(_step(_decoy_tensor("load"))), "not a dtype a checkpoint holds", MANIFEST, {}),
    "scheduler_key_step": (_edit(_scheduler("step", 1)), "does not have", MANIFEST, {}),
    "scheduler_key_dtype": (_edit(_scheduler("evil", {"__dtype__": "float32"})), "does not have", MANIFEST, {}),
    # values validated before anything is applied
    "lr_text": (_edit(_hyper("lr", "abc")), "optimizer.param_groups[0].lr", MANIFEST, {}),
    "lr_negative": (_edit(_hyper("lr", -1e-3)), "optimizer.param_groups[0].lr", MANIFEST, {}),
    "eps_nan": (_edit(_hyper("eps", float("nan"))), "optimizer.param_groups[0].eps", MANIFEST, {}),
    "betas_1_5": (_edit(_hyper("betas", {"__tuple__": [1.5, 0.95]})), "optimizer.param_groups[0].betas", MANIFEST, {}),
    "betas_one_value": (_edit(_hyper("betas", 0.9)), "optimizer.param_groups[0].betas", MANIFEST, {}),
    "weight_decay_inf": (_edit(_hyper("weight_decay", float("inf"))), "optimizer.param_groups[0].weight_decay",
                         MANIFEST, {}),
    "amsgrad_text": (_edit(_hyper("amsgrad", "yes")), "optimizer.param_groups[0].amsgrad", MANIFEST, {}),
    "step_nan": (_edit(_step({"__tensor__": {"dtype": "float32", "shape": [], "data": [float("nan")]}})),
                 "groups[0].optimizer_scalars.step", MANIFEST, {}),
    "step_negative": (_edit(_step(-10)), "groups[0].optimizer_scalars.step", MANIFEST, {}),
    "step_fraction": (_edit(_step(2.5)), "groups[0].optimizer_scalars.step", MANIFEST, {}),
    "global_steps_negative": (_edit(_set("global_steps", -5)), "global_steps", MANIFEST, {}),
    "global_steps_text": (_edit(_set("global_steps", "7")), "global_steps", MANIFEST, {}),
    "global_steps_fraction": (_edit(_set("global_steps", 2.9)), "global_steps", MANIFEST, {}),
    "micro_steps_past_int64": (_edit(_set("micro_steps", 2**64 + 1)), "micro_steps", MANIFEST, {}),
    "optim_dtype_bf16": (_edit(lambda m: m["groups"][0]["tensors"].update({"optim.exp_avg": "BF16"})),
                         "optimizer state is F32", MANIFEST, {}),
    "optim_dtype_i64": (_edit(lambda m: m["groups"][1]["tensors"].update({"optim.exp_avg_sq": "I64"})),
                        "optimizer state is F32", MANIFEST, {}),
    # the scheduler's values against the scheduler: [Note: validated scheduler state]
    "scheduler_step_size_0": (_edit(_scheduler("step_size", 0)), "lr_scheduler.state.step_size is 0", MANIFEST, {}),
    "scheduler_gamma_nan": (_edit(_scheduler("gamma", float("nan"))), "lr_scheduler.state.gamma", MANIFEST, {}),
    "scheduler_gamma_negative": (_edit(_scheduler("gamma", -1.0)), "lr_scheduler.state.gamma is -1.0", MANIFEST, {}),
    "scheduler_base_lrs_text": (_edit(_scheduler("base_lrs", "x")), "lr_scheduler.state.base_lrs is a text",
                                MANIFEST, {}),
    "scheduler_base_lrs_negative": (_edit(_scheduler("base_lrs", [-1.0])), "lr_scheduler.state.base_lrs[0]",
                                    MANIFEST, {}),
    "scheduler_base_lrs_three": (_edit(_scheduler("base_lrs", [1e-3] * 3)), "has 3 values", MANIFEST, {}),
    "scheduler_last_epoch_text": (_edit(_scheduler("last_epoch", "3")), "lr_scheduler.state.last_epoch is a text",
                                  MANIFEST, {}),
    "scheduler_last_epoch_minus_7": (_edit(_scheduler("last_epoch", -7)), "expected >= -1", MANIFEST, {}),
    "scheduler_last_epoch_past_2_48": (_edit(_scheduler("last_epoch", 2**64 + 1)), "at most 2**48", MANIFEST, {}),
    "scheduler_step_count_text": (_edit(_scheduler("_step_count", "a")), "lr_scheduler.state._step_count",
                                  MANIFEST, {}),
    "scheduler_step_count_fraction": (_edit(_scheduler("_step_count", 2.5)), "lr_scheduler.state._step_count",
                                      MANIFEST, {}),
    "scheduler_last_lr_nan": (_edit(_scheduler("_last_lr", [float("nan")])), "lr_scheduler.state._last_lr[0]",
                              MANIFEST, {}),
    "scheduler_is_initial_text": (_edit(_scheduler("_is_initial", "no")), "lr_scheduler.state._is_initial",
                                  MANIFEST, {}),
    "scheduler_base_lrs_missing": (_edit(lambda m: m["lr_scheduler"]["state"].pop("base_lrs")),
                                   "lr_scheduler.state.base_lrs is missing", MANIFEST, {}),
    # missing sections: an error unless the caller skips them
    "scheduler_missing": (_edit(lambda m: m.pop("lr_scheduler")), "holds no lr_scheduler state", MANIFEST, {}),
    "scheduler_null": (_edit(_set("lr_scheduler", None)), "load_lr_scheduler_states=False", MANIFEST, {}),
    "lr_missing": (_edit(lambda m: m["optimizer"]["param_groups"][0].pop("lr")),
                   "optimizer.param_groups[0].lr is missing", MANIFEST, {}),
    "betas_null": (_edit(_hyper("betas", None)), "optimizer.param_groups[0].betas", MANIFEST, {}),
    # optimizer records complete: [Note: complete optimizer records]
    "exp_avg_missing": (_edit(lambda m: m["groups"][0]["tensors"].pop("optim.exp_avg")),
                        "holds optimizer state ['exp_avg_sq'], the optimizer keeps", MANIFEST, {}),
    "optim_tensors_missing": (_edit(lambda m: m["groups"][2]["tensors"].update({"param": "F32"})
                                    or [m["groups"][2]["tensors"].pop(k) for k in ("optim.exp_avg", "optim.exp_avg_sq")]),
                              "groups[2] (model.layers.1#0) holds optimizer state []", MANIFEST, {}),
    "optim_step_missing": (_edit(lambda m: m["groups"][1]["optimizer_scalars"].pop("step")),
                           "groups[1].optimizer_scalars has no step count", MANIFEST, {}),
    "optim_scalars_empty": (_edit(lambda m: m["groups"][0].update(optimizer_scalars={})),
                            "groups[0].optimizer_scalars has no step count", MANIFEST, {}),
    "optim_record_amsgrad_key": (_edit(lambda m: m["groups"][0]["tensors"].update({"optim.max_exp_avg_sq": "F32"})),
                                 "the optimizer keeps ['exp_avg', 'exp_avg_sq']", MANIFEST, {}),
    # slots where the layout puts them: [Note: slots where the layout puts them]
    "offsets_overlap": (_edit(lambda m: m["groups"][1]["slots"][1].update(offset=128)),
                        "groups[1].slots[1] ('model.layers.0.self_attn.k_proj.weight') starts at 128", MANIFEST, {}),
    "offsets_swapped": (_edit(_swap_slots(1, 0, 3, "offset")), "groups[1].slots[0]", MANIFEST, {}),
    "numel_not_shape": (_edit(lambda m: m["groups"][1]["slots"][1].update(numel=100)), "its shape [8, 16] holds 128",
                        MANIFEST, {}),
    "group_numel_wrong": (_edit(lambda m: m["groups"][1].update(numel=7)), "groups[1].numel is 7", MANIFEST, {}),
    "slot_name_twice": (_edit(lambda m: m["groups"][1]["slots"][0].update(name="model.layers.0.mlp.up_proj.weight")),
                        "appear more than once", MANIFEST, {}),
    # depth
    "client_state_200_deep": (_edit(_set("client_state", _deep(200))), "nested more than", MANIFEST, {}),
    "client_state_200k_deep": (_deep_text(200_000), "nested more than", MANIFEST, {}),
}


def _run_case(root: str, case: str, fresh: Any) -> dict[str, Any]:
    from hf_zero.checkpoint import CheckpointError

    damage, _, _, kwargs = CASES[case]
    save_dir = os.path.join(root, "cases", case)
    shutil.copytree(os.path.join(root, "good"), save_dir, symlinks=True)
    damage(save_dir, os.path.join(root, "decoy"))
    before = _state_digest(fresh)
    touched, error = _touched(lambda: fresh.load_checkpoint(save_dir, **kwargs))
    return {
        "error": str(error) if isinstance(error, CheckpointError) else f"not a CheckpointError: {error!r}",
        "unchanged": _state_digest(fresh) == before,
        "outside": _outside(touched, save_dir),
        "save_dir": save_dir,
    }


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("untrusted"))
    with pytest.MonkeyPatch.context() as mp:
        for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
            mp.delenv(name, raising=False)
        engine = _engine(seed=0)
        _train(engine, range(2))
        engine.save_checkpoint(os.path.join(root, "good"), client_state={"epoch": 1})
        shutil.copytree(os.path.join(root, "good"), os.path.join(root, "decoy"))
        warm = _engine(seed=2)  # the first load imports what loading needs
        warm_touched, warm_error = _touched(lambda: warm.load_checkpoint(os.path.join(root, "good")))
        assert warm_error is None, warm_error
        fresh = _engine(seed=1)
        _train(fresh, range(5, 6))  # state of its own, all to be kept
        outcomes = {}
        for case in CASES:
            outcomes[case] = _run_case(root, case, fresh)
            if not outcomes[case]["unchanged"]:  # garbage went in: start the next case afresh
                fresh = _engine(seed=1)
                _train(fresh, range(5, 6))
        return {"root": root, "outcomes": outcomes, "saved": _state_digest(engine, rng=False),
                "warm": _state_digest(warm, rng=False),
                "warm_touched": warm_touched}


@pytest.mark.parametrize("case", list(CASES))
def test_an_untrusted_checkpoint_is_refused_by_its_check_and_changes_nothing(corpus, case):
    outcome = corpus["outcomes"][case]
    _, phrase, names, _ = CASES[case]
    error = outcome["error"]
    assert not error.startswith("not a CheckpointError"), error
    assert "nothing was loaded" in error, error
    assert phrase in error, error
    assert names in error, error
    assert outcome["unchanged"], f"{case} changed the engine"
    assert outcome["outside"] == [], f"{case}: the load looked outside {outcome['save_dir']}: {outcome['outside']}"


def test_the_good_checkpoint_loads_bit_for_bit_and_the_tracer_sees_its_files(corpus):
    assert corpus["warm"] == corpus["saved"]
    good = os.path.join(corpus["root"], "good", TAG)
    for name in (MANIFEST, RANK0, "../latest"):  # opened, stat'ed, and opened by safetensors
        assert os.path.normpath(os.path.join(good, name)) in corpus["warm_touched"]


def test_a_manifest_naming_etc_passwd_opens_and_stats_nothing_outside(corpus):
    outcome = corpus["outcomes"]["manifest_names_etc_passwd"]
    assert outcome["outside"] == []
    assert "/etc/passwd" in outcome["error"]  # named in the error, never looked at


# ------------------------------------------------------------------ what is still accepted
@pytest.fixture
def fresh_engine(monkeypatch: pytest.MonkeyPatch) -> Callable[[], Any]:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    return lambda: _engine(seed=1)


def _copy_good(corpus: dict[str, Any], name: str) -> str:
    save_dir = os.path.join(corpus["root"], "accepted", name)
    shutil.copytree(os.path.join(corpus["root"], "good"), save_dir, symlinks=True)
    return save_dir


def test_symlinks_that_stay_inside_are_followed(corpus, fresh_engine):
    save_dir = _copy_good(corpus, "links_inside")
    os.rename(os.path.join(save_dir, TAG, RANK0), os.path.join(save_dir, TAG, "stored.safetensors"))
    os.symlink("stored.safetensors", os.path.join(save_dir, TAG, RANK0))
    os.symlink(TAG, os.path.join(save_dir, "best"))
    _write_latest(lambda d: "best")(save_dir, "")
    engine = fresh_engine()
    engine.load_checkpoint(save_dir)
    assert _state_digest(engine, rng=False) == corpus["saved"]


def _nan_in_first_param(path: str) -> None:
    import struct

    with open(path, "r+b") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
        first = next(name for name in header if name.endswith("/param"))
        handle.seek(8 + length + header[first]["data_offsets"][0])
        handle.write(struct.pack("<f", float("nan")))


def test_an_unverified_checkpoint_loads_only_when_the_caller_says_so(corpus, fresh_engine, caplog):
    from hf_zero.checkpoint import CheckpointError, load_checkpoint

    save_dir = _copy_good(corpus, "format_1")
    _edit(_unverified(1))(save_dir, "")
    engine = fresh_engine()
    with pytest.raises(CheckpointError, match="allow_unverified=True"):
        load_checkpoint(engine, save_dir)
    with caplog.at_level("WARNING", logger="hf_zero"):
        load_checkpoint(engine, save_dir, allow_unverified=True)
    assert _state_digest(engine, rng=False) == corpus["saved"]
    assert "not checksummed (allow_unverified=True)" in caplog.text


def test_an_unverified_checkpoint_is_still_checked_for_nan(corpus, fresh_engine):
    from hf_zero.checkpoint import CheckpointError, load_checkpoint

    save_dir = _copy_good(corpus, "format_1_nan")
    _edit(_unverified(1))(save_dir, "")
    _nan_in_first_param(os.path.join(save_dir, TAG, RANK0))
    engine = fresh_engine()
    before = _state_digest(engine)
    with pytest.raises(CheckpointError, match="inf or nan"):
        load_checkpoint(engine, save_dir, allow_unverified=True)
    assert _state_digest(engine) == before


def test_export_confines_paths_and_verifies_unless_told(corpus, tmp_path):
    from hf_zero.checkpoint import CheckpointError, export_hf_model

    outside = _copy_good(corpus, "export_latest_out")
    _write_latest(lambda d: f"../../decoy/{TAG}")(outside, "")
    with pytest.raises(CheckpointError, match="not a tag name"):
        export_hf_model(outside, tmp_path / "out")
    unverified = _copy_good(corpus, "export_format_1")
    _edit(_unverified(1))(unverified, "")
    with pytest.raises(CheckpointError, match="records no checksums"):
        export_hf_model(unverified, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    export_hf_model(unverified, tmp_path / "out", allow_unverified=True)
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_a_missing_section_loads_when_the_caller_skips_it(corpus, fresh_engine):
    from hf_zero.checkpoint import CheckpointError

    no_scheduler = _copy_good(corpus, "no_scheduler")
    _edit(lambda m: m.pop("lr_scheduler"))(no_scheduler, "")
    incomplete = _copy_good(corpus, "incomplete_records")
    _edit(lambda m: m["groups"][0]["tensors"].pop("optim.exp_avg"))(incomplete, "")
    engine = fresh_engine()
    scheduler_before = dict(vars(engine.lr_scheduler))
    engine.load_checkpoint(no_scheduler, load_lr_scheduler_states=False)
    assert engine.global_steps == 2
    assert {k: v for k, v in vars(engine.lr_scheduler).items() if k != "optimizer"} == \
        {k: v for k, v in scheduler_before.items() if k != "optimizer"}
    engine.load_checkpoint(incomplete, load_optimizer_states=False)
    with pytest.raises(CheckpointError, match="incomplete optimizer state"):
        engine.load_checkpoint(incomplete)


def test_an_fp16_engine_refuses_a_checkpoint_without_a_loss_scaler_unless_told(corpus, fresh_engine):
    from hf_zero.checkpoint import CheckpointError

    engine = _engine(seed=1, dtype="fp16")  # fresh_engine: the environment of a single process
    scale = engine.optimizer.loss_scaler.state_dict()
    with pytest.raises(CheckpointError, match="holds no fp16 loss scaler state"):
        engine.load_checkpoint(os.path.join(corpus["root"], "good"))
    assert engine.global_steps == 0
    engine.load_checkpoint(os.path.join(corpus["root"], "good"), load_optimizer_states=False)
    assert engine.global_steps == 2 and engine.optimizer.loss_scaler.state_dict() == scale


def _replaced_at_first_read(monkeypatch: pytest.MonkeyPatch, path: str, replacement: str) -> None:
    """Replace the file at ``path`` (as a re-save does) just before the first read of any tensor."""
    from hf_zero.checkpoint.reader import RankFiles

    original, replaced = RankFiles.read, []

    def read(self, *args, **kwargs):
        if not replaced:
            replaced.append(path)
            os.replace(replacement, path)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(RankFiles, "read", read)


def test_a_rank_file_replaced_after_its_check_is_never_read(corpus, fresh_engine, tmp_path, monkeypatch):
    from hf_zero.checkpoint import CheckpointError, export_hf_model

    other = fresh_engine()
    _train(other, range(3, 5))
    other.save_checkpoint(str(tmp_path / "other"))  # global_step2 too: a re-save of the same tag
    for name in ("load", "export"):
        shutil.copy(tmp_path / "other" / TAG / RANK0, tmp_path / f"{name}.safetensors")
    # A load reads through the handles opened when each file was verified: the data it applies is
    # the data checked, whatever now sits at the path.
    loaded = _copy_good(corpus, "replaced_during_load")
    with monkeypatch.context() as patch:
        _replaced_at_first_read(patch, os.path.join(loaded, TAG, RANK0), str(tmp_path / "load.safetensors"))
        engine = fresh_engine()
        engine.load_checkpoint(loaded)
    assert _state_digest(engine, rng=False) == corpus["saved"]
    # Export unmaps a file after each parameter; a file opened again must be the one verified.
    exported = _copy_good(corpus, "replaced_during_export")
    with monkeypatch.context() as patch:
        _replaced_at_first_read(patch, os.path.join(exported, TAG, RANK0), str(tmp_path / "export.safetensors"))
        with pytest.raises(CheckpointError, match="changed during the load"):
            export_hf_model(exported, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ on every rank
TWO_RANK_CASES = ("latest_dotdot", "tag_folder_symlink_out", "manifest_names_etc_passwd", "format_1_no_checksums",
                  "scheduler_dtype_load", "lr_text", "step_negative", "optim_dtype_bf16", "client_state_200_deep",
                  "scheduler_gamma_nan", "scheduler_missing", "exp_avg_missing")


def _two_ranks(root: str) -> dict[str, Any]:
    import torch.distributed as dist

    from hf_zero.checkpoint import CheckpointError

    engine = _engine(seed=0)
    _train(engine, range(2))
    engine.save_checkpoint(os.path.join(root, "good"))
    if engine.rank == 0:
        shutil.copytree(os.path.join(root, "good"), os.path.join(root, "decoy"))
        for case in TWO_RANK_CASES:
            save_dir = os.path.join(root, "cases", case)
            shutil.copytree(os.path.join(root, "good"), save_dir, symlinks=True)
            CASES[case][0](save_dir, os.path.join(root, "decoy"))
    dist.barrier()
    fresh = _engine(seed=1)
    _train(fresh, range(5, 6))
    before, errors = _state_digest(fresh), {}
    for case in TWO_RANK_CASES:
        try:
            fresh.load_checkpoint(os.path.join(root, "cases", case), **CASES[case][3])
            errors[case] = "no error"
        except CheckpointError as exc:
            errors[case] = str(exc)
    return {"errors": errors, "unchanged": _state_digest(fresh) == before}


def test_every_rank_refuses_with_the_same_error_and_changes_nothing(tmp_path):
    from tests.distributed.launch import run_distributed

    ranks = run_distributed(_two_ranks, 2, str(tmp_path))
    for rank in ranks:
        assert rank["unchanged"]
        for case, error in rank["errors"].items():
            assert CASES[case][1] in error and "nothing was loaded" in error, (case, error)
    assert ranks[0]["errors"] == ranks[1]["errors"]
