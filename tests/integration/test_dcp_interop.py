"""Checkpoints shared with PyTorch FSDP2 through torch.distributed.checkpoint folders (issue 30),
both ways, on real gloo process groups (CPU).

One spawn of 3 processes runs every phase in turn (``in_group``): hf_zero trains a tiny Llama
at world size 3 (stage 3), saves after 3 steps and trains on; FSDP2 (``fully_shard`` per decoder
layer and the root, ``torch.optim.AdamW``) trains the same model at world size 2 on the same
global batches, saves ``{"model", "optim"}`` of ``get_state_dict`` with ``dcp.save`` and trains
on. Rank 0 then converts each checkpoint to the other format (``export_dcp_checkpoint``,
``import_dcp_checkpoint``), hf_zero resumes the FSDP2 save at world sizes 3 and 1, and FSDP2
resumes the hf_zero save at world size 2 (``dcp.load`` + ``set_state_dict``), each resuming
optimizer built with another lr and weight decay that the load must replace: every resumed
curve is compared with the run that saved, and every value with the saver's own full state.
The bad-input tests run on one process against DCP folders written without a process group.

[Note: interop tolerance]
On the learnable batches the 3 resumed steps move the loss by about 0.1 or more, and the first
resumed loss depends on every weight. hf_zero and FSDP2 reduce the same fp32 numbers in other
orders (ranks, fused kernels), which moves a loss by ~1e-7. TOL = 1e-5 sits far below the
signal; a resume whose moments or step counts were dropped moves the curve by more than
10 x TOL (the control runs check it).
"""

from __future__ import annotations

import io
import math
import os
import pickle
import re
import shutil
from typing import Any, Callable

import pytest
import torch

from tests.distributed.launch import in_group, run_distributed
from tests.tiny_models import learnable_batch, tiny_gpt2, tiny_llama

TOL = 1e-5  # see [Note: interop tolerance]
LR, BETAS, EPS, WEIGHT_DECAY = 2e-2, (0.9, 0.95), 1e-8, 0.1
SAVE_AT, STEPS = 3, 6
GLOBAL_ROWS = 6  # 3 ranks x 2 rows, 2 x 3, 1 x 6: the same global batch at every world size
HF_ZERO_SAVE = (2, 3)  # (world size, stage) of the hf_zero run that saves
HF_ZERO_RESUMES = ((1, 1, None), (2, 2, None), (1, 3, "moments"), (1, 3, "step"))  # world, stage, control
FSDP2_WORLD = 2
SPAWNED = 2  # processes: every phase runs on the first 1 or 2 (see every_phase)


# ------------------------------------------------------------------ shared by both sides
# A resuming optimizer is built with other hyperparameters: the curve matches only if the
# checkpoint's lr and weight decay replace them.
RESUMED_LR, RESUMED_WEIGHT_DECAY = LR / 4, 0.5


def param_groups(params: list[torch.nn.Parameter], weight_decay: float = WEIGHT_DECAY) -> list[dict[str, Any]]:
    """AdamW's usual two groups: no weight decay on norms."""
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def rows_of(step: int, rank: int, world: int) -> torch.Tensor:
    micro = GLOBAL_ROWS // world
    return learnable_batch(step, GLOBAL_ROWS)[rank * micro:(rank + 1) * micro]


def train(step_fn: Callable[[torch.Tensor], float], steps: range) -> list[float]:
    """Each step's loss, averaged over the ranks (each holds the same number of rows)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    local = [step_fn(rows_of(step, rank, world)) for step in steps]
    every: list[Any] = [None] * world
    dist.all_gather_object(every, local)
    return [sum(col) / len(col) for col in zip(*every)]


# ------------------------------------------------------------------ FSDP2
def fsdp2_model(seed: int, lr: float = LR,
                weight_decay: float = WEIGHT_DECAY) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    model = tiny_llama(seed=seed)
    model.train()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(param_groups(list(model.parameters()), weight_decay), lr=lr, betas=BETAS, eps=EPS)
    return model, optimizer


def fsdp2_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[torch.Tensor], float]:
    def step(ids: torch.Tensor) -> float:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()
    return step


def fsdp2_full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """FSDP2's own full view of its state (rank 0 writes it): ``<name>/param``, ``/exp_avg``..."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    if dist.get_rank() == 0:
        view = {f"{n}/param": t.clone() for n, t in model_sd.items()}
        view.update({f"{n}/{k}": t.clone() for n, state in optim_sd["state"].items() for k, t in state.items()})
        torch.save(view, path)


def fsdp2_save_phase(root: str) -> list[float]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer = fsdp2_model(seed=0)
    step = fsdp2_step(model, optimizer)
    train(step, range(SAVE_AT))
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(root, "fsdp2_dcp"))
    fsdp2_full_state(model, optimizer, os.path.join(root, "fsdp2_saved.pt"))
    return train(step, range(SAVE_AT, STEPS))


def fsdp2_resume_phase(root: str) -> list[float]:
    """The loading script of docs/checkpoints.md ('FSDP2 and DCP'), on hf_zero's export."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    # other initial weights and hyperparameters: the load must replace them
    model, optimizer = fsdp2_model(seed=1, lr=RESUMED_LR, weight_decay=RESUMED_WEIGHT_DECAY)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=os.path.join(root, "hf_zero_dcp"))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    fsdp2_full_state(model, optimizer, os.path.join(root, "fsdp2_loaded.pt"))
    return train(fsdp2_step(model, optimizer), range(SAVE_AT, STEPS))


# ------------------------------------------------------------------ hf_zero
def hf_zero_engine(stage: int, seed: int, lr: float = LR, weight_decay: float = WEIGHT_DECAY) -> Any:
    import hf_zero

    model = tiny_llama(seed=seed)
    model.train()
    world = int(os.environ["WORLD_SIZE"])
    config = {
        "train_micro_batch_size_per_gpu": GLOBAL_ROWS // world, "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0, "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": list(BETAS), "eps": EPS,
                                                  "weight_decay": weight_decay}},
    }
    groups = param_groups(list(model.parameters()), weight_decay)
    engine, *_ = hf_zero.initialize(model=model, config=config, model_parameters=groups)
    return engine


def hf_zero_step(engine: Any) -> Callable[[torch.Tensor], float]:
    def step(ids: torch.Tensor) -> float:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss.item()
    return step


def hf_zero_save_phase(root: str) -> list[float]:
    engine = hf_zero_engine(HF_ZERO_SAVE[1], seed=3)  # not FSDP2's: the two reference curves differ
    step = hf_zero_step(engine)
    train(step, range(SAVE_AT))
    engine.save_checkpoint(os.path.join(root, "hf_zero"))
    return train(step, range(SAVE_AT, STEPS))


def _drop(engine: Any, what: str | None) -> None:
    """A negative control: forget part of the loaded state, as a faulty import would."""
    for state in engine.optimizer.inner.state.values():
        if what == "moments":
            state["exp_avg"].zero_()
            state["exp_avg_sq"].zero_()
        elif what == "step":
            state["step"] = 0
            state["slot_steps"] = [0] * len(state["slot_steps"])


def hf_zero_resume_phase(stage: int, control: str | None) -> Callable[[str], dict[str, Any]]:
    def phase(root: str) -> dict[str, Any]:
        engine = hf_zero_engine(stage, seed=1, lr=RESUMED_LR, weight_decay=RESUMED_WEIGHT_DECAY)
        engine.load_checkpoint(os.path.join(root, "fsdp2_hf_zero"))
        counters = [engine.global_steps, engine.micro_steps, engine.global_samples]
        _drop(engine, control)
        return {"losses": train(hf_zero_step(engine), range(SAVE_AT, STEPS)), "counters": counters}
    return phase


# ------------------------------------------------------------------ the conversions (rank 0)
def convert_phase(root: str) -> dict[str, str]:
    from hf_zero.checkpoint import export_dcp_checkpoint, import_dcp_checkpoint

    return {
        "exported": export_dcp_checkpoint(os.path.join(root, "hf_zero"), os.path.join(root, "hf_zero_dcp")),
        "imported": import_dcp_checkpoint(os.path.join(root, "fsdp2_dcp"), os.path.join(root, "fsdp2_hf_zero"),
                                          model=tiny_llama(seed=2)),
    }


def every_phase(root: str) -> dict[str, Any]:
    """All phases on one spawn; ranks outside a phase's world skip it (``in_group``)."""
    phases = [("hf_zero_saved", HF_ZERO_SAVE[0], hf_zero_save_phase),
              ("fsdp2_saved", FSDP2_WORLD, fsdp2_save_phase),
              ("converted", 1, convert_phase),
              *((f"hf_zero_resumed.w{w}s{s}.{c}", w, hf_zero_resume_phase(s, c)) for w, s, c in HF_ZERO_RESUMES),
              ("fsdp2_resumed", FSDP2_WORLD, fsdp2_resume_phase)]
    return {name: in_group(world, phase, root) for name, world, phase in phases}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("dcp_interop"))
    results = run_distributed(every_phase, SPAWNED, root)
    return {"root": root, **results[0]}


def _max_diff(a: list[float], b: list[float]) -> float:
    """The largest difference; inf when a loss is not finite (``max`` skips nan: nan < x is False)."""
    diffs = [abs(x - y) for x, y in zip(a, b, strict=True)]
    return max(diffs) if all(math.isfinite(d) for d in diffs) else math.inf


# ------------------------------------------------------------------ the curves
def test_hf_zero_resumes_fsdp2s_save_at_other_world_sizes(runs):
    reference = runs["fsdp2_saved"]
    assert abs(reference[-1] - reference[0]) > 1000 * TOL, reference  # the signal: the loss moves
    for world, stage, control in HF_ZERO_RESUMES:
        if control is None:
            resumed = runs[f"hf_zero_resumed.w{world}s{stage}.None"]
            assert _max_diff(resumed["losses"], reference) <= TOL, (world, stage, resumed["losses"], reference)
            assert resumed["counters"] == [SAVE_AT, SAVE_AT, 0]


@pytest.mark.parametrize("control", ["moments", "step"])
def test_dropping_moments_or_steps_leaves_the_curve(runs, control):
    """The negative controls of [Note: interop tolerance]: TOL catches a half-imported state."""
    for world, stage, dropped in HF_ZERO_RESUMES:
        if dropped == control:
            losses = runs[f"hf_zero_resumed.w{world}s{stage}.{control}"]["losses"]
            assert _max_diff(losses, runs["fsdp2_saved"]) > 10 * TOL, (control, losses)


def test_fsdp2_resumes_hf_zeros_export(runs):
    reference = runs["hf_zero_saved"]
    assert abs(reference[-1] - reference[0]) > 1000 * TOL, reference
    assert _max_diff(reference, runs["fsdp2_saved"]) > 1000 * TOL  # a resume of the other save would show
    assert _max_diff(runs["fsdp2_resumed"], reference) <= TOL, (runs["fsdp2_resumed"], reference)


# ------------------------------------------------------------------ the state, value by value
def _hf_zero_values(ckpt_dir: str) -> dict[str, torch.Tensor]:
    """Every parameter's master and moments in an hf_zero checkpoint, cut from its rank files by
    hand (shard k of a group in rank file k, a slot at its offset), and its step count."""
    from safetensors.torch import load_file

    from hf_zero.checkpoint import read_manifest
    from hf_zero.checkpoint.manifest import decode_state

    manifest = read_manifest(ckpt_dir)
    files = [load_file(os.path.join(ckpt_dir, f["name"])) for f in manifest["files"]]
    values = {}
    for group in manifest["groups"]:
        scalars = decode_state(group["optimizer_scalars"])
        for key in group["tensors"]:
            flat = torch.cat([f[f"{group['group']}/{key}"] for f in files[:group["world_size"]]])
            for slot in group["slots"]:
                piece = flat[slot["offset"]:slot["offset"] + slot["numel"]].reshape(slot["shape"])
                values[f"{slot['name']}/{key.removeprefix('optim.')}"] = piece
        for slot, step in zip(group["slots"], scalars.get("slot_steps", [])):
            values[f"{slot['name']}/step"] = torch.tensor(float(step))
    return values


def _assert_same_state(found: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert found.keys() == expected.keys(), sorted(found.keys() ^ expected.keys())
    for key, value in expected.items():
        assert torch.equal(found[key], value), key


def test_the_import_holds_fsdp2s_state_exactly(runs):
    """Every master, exp_avg, exp_avg_sq and step count of the import equals FSDP2's own full
    state at the save (get_state_dict with full_state_dict=True)."""
    saved = torch.load(os.path.join(runs["root"], "fsdp2_saved.pt"), weights_only=True)
    _assert_same_state(_hf_zero_values(runs["converted"]["imported"]), saved)
    assert all(saved[k].item() == SAVE_AT for k in saved if k.endswith("/step"))


def test_fsdp2_loads_the_export_exactly(runs):
    """FSDP2's full state after loading the export equals the hf_zero checkpoint's."""
    from hf_zero.checkpoint import resolve_checkpoint_dir

    loaded = torch.load(os.path.join(runs["root"], "fsdp2_loaded.pt"), weights_only=True)
    _assert_same_state(loaded, _hf_zero_values(resolve_checkpoint_dir(os.path.join(runs["root"], "hf_zero"), None)))


def test_the_export_has_the_layout_the_docs_give(runs):
    from hf_zero.checkpoint.dcp_interop import read_dcp_folder, read_value

    folder = read_dcp_folder(runs["converted"]["exported"])
    name = "model.layers.0.mlp.up_proj.weight"
    assert {f"model.{name}", f"optim.state.{name}.exp_avg", f"optim.state.{name}.exp_avg_sq",
            f"optim.state.{name}.step"} <= folder.tensors.keys()
    groups = {k.split(".")[2] for k in folder.objects if k.startswith("optim.param_groups.")}
    assert groups == {"0", "1"}
    assert read_value(folder.objects["optim.param_groups.0.weight_decay"], "") == WEIGHT_DECAY
    assert read_value(folder.objects["optim.param_groups.1.betas"], "") == BETAS


# ------------------------------------------------------------------ the command line
def test_the_cli_reports_a_bad_folder_in_one_line(tmp_path, capsys):
    from hf_zero.cli import build_parser, main

    (tmp_path / "no_model").mkdir()  # a folder without config.json (a missing one would be a Hub id)
    assert main(["import-dcp", str(tmp_path / "missing"), str(tmp_path / "never"), "--model",
                 str(tmp_path / "no_model")]) == 1
    assert "cannot build a model" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    tiny_gpt2().config.save_pretrained(str(tmp_path / "model"))
    assert main(["import-dcp", str(tmp_path / "empty"), str(tmp_path / "never"), "--model", str(tmp_path / "model")]) == 1
    reported = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hf-zero import-dcp:")]
    assert len(reported) == 1 and ".metadata: missing" in reported[0], reported
    assert main(["export-dcp", str(tmp_path / "missing"), str(tmp_path / "never")]) == 1
    assert "no such checkpoint directory" in capsys.readouterr().err
    assert not (tmp_path / "never").exists()
    action = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    for command in ("import-dcp", "export-dcp"):  # every option explained, as tests/unit/test_cli.py checks
        assert all(a.help for a in action.choices[command]._actions), command


# ------------------------------------------------------------------ one process: round trip and bad input
def _plain_dcp(path: str, optimizer: Callable[[list[dict[str, Any]]], torch.optim.Optimizer] | None = None,
               model: torch.nn.Module | None = None) -> str:
    """A DCP folder as FSDP2 writes it, from a plain model on one process (no process group)."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = model or tiny_gpt2(seed=0)
    make = optimizer or (lambda groups: torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS))
    opt = make(param_groups(list(model.parameters())))
    for step in range(2):
        ids = learnable_batch(step, 2)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    model_sd, optim_sd = get_state_dict(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the note that it saves from one process
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    return path


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A tied GPT-2 with two param groups, saved by DCP, and its import."""
    from hf_zero.checkpoint import import_dcp_checkpoint

    root = tmp_path_factory.mktemp("plain")
    dcp_dir = _plain_dcp(str(root / "dcp"))
    return {"dcp": dcp_dir, "root": str(root),
            "imported": import_dcp_checkpoint(dcp_dir, str(root / "hf_zero"), model=tiny_gpt2(seed=1))}


def _copy(plain: dict[str, str], tmp_path, name: str = "dcp") -> str:
    return shutil.copytree(plain[name], str(tmp_path / name))


def test_import_then_export_gives_back_every_key_and_value(plain, tmp_path):
    """Tied weights (written under both names, state under the first) and two param groups."""
    from hf_zero.checkpoint import export_dcp_checkpoint
    from hf_zero.checkpoint.dcp_interop import read_dcp_folder, read_tensor, read_value

    exported = export_dcp_checkpoint(os.path.dirname(plain["imported"]), str(tmp_path / "back"))
    before, after = read_dcp_folder(plain["dcp"]), read_dcp_folder(exported)
    assert "model.lm_head.weight" in before.tensors and "optim.state.lm_head.weight.step" not in before.tensors
    assert before.tensors.keys() == after.tensors.keys()
    for key, record in before.tensors.items():
        assert torch.equal(read_tensor(record), read_tensor(after.tensors[key])), key
    assert after.objects.keys() - before.objects.keys() == {"optim.param_groups.0.initial_lr",
                                                            "optim.param_groups.1.initial_lr"}
    for key, stored in before.objects.items():
        value, back = read_value(stored, key), read_value(after.objects[key], key)
        assert (sorted(value) == sorted(back)) if key.endswith(".params") else value == back, key


def test_the_import_exports_to_a_hugging_face_folder(plain, tmp_path):
    """model= is recorded, so hf-zero export writes a from_pretrained folder from the import."""
    from transformers import AutoModelForCausalLM

    from hf_zero.checkpoint import export_hf_model
    from hf_zero.checkpoint.dcp_interop import read_dcp_folder, read_tensor

    model = AutoModelForCausalLM.from_pretrained(export_hf_model(plain["imported"], str(tmp_path / "hf")))
    saved = read_dcp_folder(plain["dcp"]).tensors
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), read_tensor(saved[f"model.{name}"])), name


def test_the_cli_converts_as_the_calls_do(plain, tmp_path, capsys):
    """hf-zero import-dcp / export-dcp write what the calls write (the GPT-2 of ``plain``: the
    main process then never imports Llama's modeling code, which costs seconds)."""
    from safetensors.torch import load_file

    from hf_zero.checkpoint import export_dcp_checkpoint, read_manifest
    from hf_zero.checkpoint.dcp_interop import read_dcp_folder, read_tensor
    from hf_zero.cli import main

    tiny_gpt2().config.save_pretrained(str(tmp_path / "model"))
    assert main(["import-dcp", plain["dcp"], str(tmp_path / "imported"), "--model", str(tmp_path / "model")]) == 0
    assert "engine.load_checkpoint(" in capsys.readouterr().out
    by_cli = str(tmp_path / "imported" / os.path.basename(plain["imported"]))
    call, cli = (load_file(os.path.join(d, read_manifest(d)["files"][0]["name"])) for d in (plain["imported"], by_cli))
    assert call.keys() == cli.keys() and all(torch.equal(call[k], cli[k]) for k in call)
    assert main(["export-dcp", str(tmp_path / "imported"), str(tmp_path / "by_cli")]) == 0
    assert "set_state_dict" in capsys.readouterr().out
    exported = export_dcp_checkpoint(plain["imported"], str(tmp_path / "by_call"))
    call, cli = (read_dcp_folder(d) for d in (exported, str(tmp_path / "by_cli")))
    assert call.tensors.keys() == cli.tensors.keys() and call.objects.keys() == cli.objects.keys()
    assert all(torch.equal(read_tensor(call.tensors[k]), read_tensor(cli.tensors[k])) for k in call.tensors)


def test_the_import_warns_once_that_tensor_data_is_unchecked(plain, tmp_path, caplog):
    """DCP writes no checksums, so the import says that it could not check the tensor bytes."""
    import logging

    from hf_zero.checkpoint import import_dcp_checkpoint

    with caplog.at_level(logging.WARNING, logger="hf_zero"):
        import_dcp_checkpoint(plain["dcp"], str(tmp_path / "out"), model=tiny_gpt2(seed=1))
    unchecked = [r for r in caplog.records if "tensor data is imported unchecked" in r.getMessage()]
    assert len(unchecked) == 1 and plain["dcp"] in unchecked[0].getMessage(), caplog.text
    assert "carries no checksums" in unchecked[0].getMessage()


def test_frozen_parameters_and_parameters_without_state_yet(tmp_path):
    """A parameter in no param group is imported frozen; one in a group that has no state yet
    (it never had a gradient) gets zero moments and step 0, as torch's AdamW would start it."""
    from safetensors import safe_open

    from hf_zero.checkpoint import import_dcp_checkpoint, read_manifest
    from hf_zero.checkpoint.manifest import decode_state

    model = tiny_gpt2(seed=0)
    model.transformer.wpe.weight.requires_grad_(False)

    class NoGradForFinalNorm(torch.optim.AdamW):
        def step(self, closure=None):
            model.transformer.ln_f.bias.grad = None
            return super().step(closure)

    def optimizer(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        trainable = [dict(g, params=[p for p in g["params"] if p.requires_grad]) for g in groups]
        return NoGradForFinalNorm(trainable, lr=LR, betas=BETAS, eps=EPS)

    folder = _plain_dcp(str(tmp_path / "dcp"), optimizer, model)
    imported = import_dcp_checkpoint(folder, str(tmp_path / "out"), model=tiny_gpt2(seed=1))
    groups = {g["group"]: g for g in read_manifest(imported)["groups"]}
    assert [s["name"] for s in groups["dcp.frozen.float32"]["slots"]] == ["transformer.wpe.weight"]
    no_decay = groups["dcp.group1"]
    names = [s["name"] for s in no_decay["slots"]]
    steps = decode_state(no_decay["optimizer_scalars"])["slot_steps"]
    assert steps[names.index("transformer.ln_f.bias")] == 0 and set(steps) == {0, 2}
    with safe_open(os.path.join(imported, "rank-00000-of-00001.safetensors"), framework="pt") as handle:
        slot = no_decay["slots"][names.index("transformer.ln_f.bias")]
        for key in ("exp_avg", "exp_avg_sq"):
            moment = handle.get_slice(f"dcp.group1/optim.{key}")[slot["offset"]:slot["offset"] + slot["numel"]]
            assert not moment.any(), key


def _edit_metadata(folder: str, edit: Callable[[Any], None]) -> None:
    """Load our own test folder's metadata as DCP does (trusted here), edit it, write it back."""
    path = os.path.join(folder, ".metadata")
    with open(path, "rb") as handle:
        metadata = pickle.load(handle)
    edit(metadata)
    with open(path, "wb") as handle:
        pickle.dump(metadata, handle)


def _storage(metadata: Any, key: str) -> Any:
    return next(v for k, v in metadata.storage_data.items() if k.fqn == key)


class _RunsCode:
    """Unpickling it would create a folder: the import must refuse it without running it."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def _group_keyed_by_name(metadata: Any) -> None:
    """A param-group value keyed by a parameter's name, as torchtitan's flattened state is."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    key = "optim.param_groups.transformer.wte.weight.lr"
    metadata.state_dict_metadata[key] = metadata.state_dict_metadata["optim.param_groups.0.lr"]
    metadata.storage_data[MetadataIndex(key)] = _storage(metadata, "optim.param_groups.0.lr")


def _overlapping_chunks(folder: str) -> None:
    """Two chunks of the right dtypes and shapes whose sizes add up, but rows 7 twice and 14 never."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    stored = []
    with open(os.path.join(folder, "extra.distcp"), "wb") as handle:
        for rows in (8, 7):
            offset = handle.tell()
            torch.save(torch.zeros(rows, 60), handle)
            stored.append(_StorageInfo("extra.distcp", offset, handle.tell() - offset))

    def edit(metadata: Any) -> None:
        metadata.state_dict_metadata[WEIGHT].chunks = [
            ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([8, 60])),
            ChunkStorageMetadata(torch.Size([7, 0]), torch.Size([7, 60]))]
        for start, info in zip((0, 7), stored):
            metadata.storage_data[MetadataIndex(WEIGHT, [start, 0])] = info
    _edit_metadata(folder, edit)


def _break_tie(metadata: Any) -> None:
    """lm_head.weight stored apart from the embedding it is tied to, with other values."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    other = _storage(metadata, "optim.state.transformer.wte.weight.exp_avg")
    metadata.storage_data[MetadataIndex("model.lm_head.weight", [0, 0])] = other


def _truncate(folder: str) -> None:
    data = os.path.join(folder, "__0_0.distcp")
    os.truncate(data, os.path.getsize(data) // 2)


WEIGHT = "model.transformer.h.0.mlp.c_fc.weight"
BAD_FOLDERS = {
    "no_metadata": (lambda d: os.remove(os.path.join(d, ".metadata")), "CheckpointNotFoundError", ".metadata: missing"),
    "foreign_global": (lambda d: _edit_metadata(d, lambda m: setattr(m, "planner_data", _RunsCode(d + "/ran"))),
                       "CheckpointError", "posix.mkdir, which is not one of DCP's metadata classes"),
    "path_outside": (lambda d: _edit_metadata(d, lambda m: setattr(_storage(m, WEIGHT), "relative_path", "../x")),
                     "CheckpointError", "not a plain file name in the folder"),
    "truncated_file": (_truncate, "CheckpointError", "the file is truncated"),
    "chunk_outside": (lambda d: _edit_metadata(d, lambda m: setattr(m.state_dict_metadata[WEIGHT].chunks[0], "sizes",
                                                                    torch.Size([16, 60]))),
                      "CheckpointError", "is not inside [15, 60]"),
    "other_layout": (lambda d: _edit_metadata(d, _group_keyed_by_name), "CheckpointError",
                     "flatten_optimizer_state_dict=True"),
    "overlapping_chunks": (_overlapping_chunks, "CheckpointError", f"chunks of {WEIGHT} overlap at [7, 0]"),
    "broken_tie": (lambda d: _edit_metadata(d, _break_tie), "CheckpointError",
                   "model.lm_head.weight and model.transformer.wte.weight differ"),
}


@pytest.mark.parametrize("damage", BAD_FOLDERS)
def test_a_damaged_folder_is_refused_before_anything_is_written(plain, tmp_path, damage):
    from hf_zero.checkpoint import import_dcp_checkpoint

    edit, error, message = BAD_FOLDERS[damage]
    folder = _copy(plain, tmp_path)
    edit(folder)
    with pytest.raises(Exception) as caught:
        import_dcp_checkpoint(folder, str(tmp_path / "out"), model=tiny_gpt2(seed=1))
    assert type(caught.value).__name__ == error and message in str(caught.value), caught.value
    assert not os.path.exists(os.path.join(folder, "ran"))  # nothing in the metadata was run
    assert not os.path.exists(tmp_path / "out") or not os.listdir(tmp_path / "out")


def test_a_chunk_that_is_not_what_the_metadata_says_publishes_nothing(plain, tmp_path):
    """Chunks are checked as they are written: the temporary folder is removed, no 'latest', and
    the output folder the import made is gone too."""
    from hf_zero.checkpoint import CheckpointError, import_dcp_checkpoint

    folder = _copy(plain, tmp_path)
    _edit_metadata(folder, lambda m: setattr(m.state_dict_metadata[WEIGHT].properties, "dtype", torch.float64))
    with pytest.raises(CheckpointError, match="the metadata records torch.float64"):
        import_dcp_checkpoint(folder, str(tmp_path / "out"), model=tiny_gpt2(seed=1))
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("model, message", [
    (lambda: _gpt2(n_layer=3), "model.transformer.h.2.ln_1.weight [15] is missing"),
    (lambda: _gpt2(n_layer=1), "model.transformer.h.1.ln_1.weight [15] is not in the model"),
    (lambda: _gpt2(n_positions=40), "model.transformer.wpe.weight is [32, 15] in the checkpoint, [40, 15] in the model"),
])
def test_a_folder_of_another_model_is_refused(plain, tmp_path, model, message):
    from hf_zero.checkpoint import CheckpointError, import_dcp_checkpoint

    with pytest.raises(CheckpointError, match=re.escape(message)):
        import_dcp_checkpoint(plain["dcp"], str(tmp_path / "out"), model=model())
    assert not os.path.exists(tmp_path / "out")


def _gpt2(**changes: Any) -> torch.nn.Module:
    from transformers import GPT2LMHeadModel

    config = tiny_gpt2().config
    for key, value in changes.items():
        setattr(config, key, value)
    return GPT2LMHeadModel(config)


@pytest.mark.parametrize("optimizer, message", [
    (lambda groups: torch.optim.SGD(groups, lr=LR, momentum=0.9), "holds ['momentum_buffer'], not AdamW's"),
    (lambda groups: torch.optim.AdamW(groups, lr=LR, amsgrad=True), "has amsgrad=True"),
    (lambda groups: torch.optim.Adamax(groups, lr=LR), "holds ['exp_avg', 'exp_inf', 'step'], not AdamW's"),
])
def test_optimizer_state_other_than_adamw_is_refused(tmp_path, optimizer, message):
    """On a bare Linear (two parameters, two groups): the optimizer's kind is what is refused."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from hf_zero.checkpoint import import_dcp_checkpoint

    model = torch.nn.Linear(3, 2)
    opt = optimizer(param_groups(list(model.parameters())))
    for _ in range(2):
        model(torch.ones(4, 3)).square().mean().backward()
        opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the note that it saves from one process
        dcp.save(dict(zip(("model", "optim"), get_state_dict(model, opt))), checkpoint_id=str(tmp_path / "dcp"))
    with pytest.raises(NotImplementedError, match=re.escape(message)):
        import_dcp_checkpoint(str(tmp_path / "dcp"), str(tmp_path / "out"), model=torch.nn.Linear(3, 2))
    assert not os.path.exists(tmp_path / "out")


def _snapshot(folder: str) -> dict[str, bytes]:
    found = {}
    for base, _dirs, names in os.walk(folder):
        for name in names:
            with open(os.path.join(base, name), "rb") as handle:
                found[os.path.relpath(os.path.join(base, name), folder)] = handle.read()
    return found


def test_an_output_folder_that_holds_a_checkpoint_is_left_alone(plain, tmp_path):
    from hf_zero.checkpoint import CheckpointError, export_dcp_checkpoint, import_dcp_checkpoint

    held = os.path.dirname(plain["imported"])
    before = _snapshot(held)
    with pytest.raises(CheckpointError, match="already holds an hf_zero checkpoint"):
        import_dcp_checkpoint(plain["dcp"], held, model=tiny_gpt2(seed=1))
    assert _snapshot(held) == before
    dcp_before = _snapshot(plain["dcp"])
    with pytest.raises(CheckpointError, match="already holds a DCP checkpoint"):
        export_dcp_checkpoint(held, plain["dcp"])
    assert _snapshot(plain["dcp"]) == dcp_before and _snapshot(held) == before
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not an empty directory"):
        export_dcp_checkpoint(held, str(tmp_path / "busy"))
    assert os.listdir(tmp_path / "busy") == ["notes.txt"]


def _edited_import(plain: dict[str, str], tmp_path, edit: Callable[[dict[str, Any]], None]) -> str:
    import json

    copy = shutil.copytree(os.path.dirname(plain["imported"]), str(tmp_path / "ckpt"))
    manifest_path = os.path.join(copy, os.path.basename(plain["imported"]), "manifest.json")
    with open(manifest_path) as handle:
        manifest = json.load(handle)
    edit(manifest)
    with open(manifest_path, "w") as handle:
        json.dump(manifest, handle)
    return copy


@pytest.mark.parametrize("edit, error, message", [
    (lambda m: m["optimizer"].update({"class": "Adafactor"}), NotImplementedError, "not Adam/AdamW"),
    (lambda m: m.update(optimizer=None), "CheckpointError", "saved without an optimizer"),
    (lambda m: m["optimizer"]["param_groups"][0].update({"amsgrad": True}), NotImplementedError, "amsgrad=True"),
])
def test_an_export_of_other_optimizer_state_is_refused(plain, tmp_path, edit, error, message):
    from hf_zero.checkpoint import export_dcp_checkpoint

    with pytest.raises(Exception) as caught:
        export_dcp_checkpoint(_edited_import(plain, tmp_path, edit), str(tmp_path / "out"))
    expected = error if isinstance(error, str) else error.__name__
    assert type(caught.value).__name__ == expected and message in str(caught.value), caught.value
    assert not os.path.exists(tmp_path / "out")


def test_an_export_verifies_every_tensor_first(plain, tmp_path):
    """A rank file with flipped bytes is refused as load_checkpoint refuses it; nothing written."""
    from hf_zero.checkpoint import CheckpointError, export_dcp_checkpoint

    copy = shutil.copytree(os.path.dirname(plain["imported"]), str(tmp_path / "ckpt"))
    rank_file = os.path.join(copy, os.path.basename(plain["imported"]), "rank-00000-of-00001.safetensors")
    with open(rank_file, "r+b") as handle:
        handle.seek(-8, os.SEEK_END)
        handle.write(b"\x00\x00\x80\x3f" * 2)  # two float32 ones over the last two values
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        export_dcp_checkpoint(copy, str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")


def test_the_metadata_unpickler_finds_only_dcps_classes():
    from hf_zero.checkpoint.dcp_interop import _MetadataUnpickler

    with pytest.raises(pickle.UnpicklingError, match="collections.Counter"):
        _MetadataUnpickler(io.BytesIO(pickle.dumps(__import__("collections").Counter()))).load()
    assert _MetadataUnpickler(io.BytesIO(pickle.dumps(torch.Size([2, 3])))).load() == torch.Size([2, 3])
