"""Shape-aware optimizers stepped whole by owner ranks ([Note: whole-parameter step]) match the
same optimizer in one process on the same global batch, at stages 1-3 and with CPU offload:
torch.optim.Adafactor passed in or from the config's "optimizer" section, and Muon for the hidden 2-D weights with AdamW for the rest
(the config's "optimizer": {"type": "Muon"}, or hf_zero's MuonWithAuxAdamW passed in) against
torch.optim.Muon plus torch.optim.AdamW. One spawn of 3 ranks runs every distributed case in turn,
each in a fresh group of its own world (``launch.in_group``; at world 2 the third rank waits)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hf_zero.engine.optim.muon import muon_param_groups
from hf_zero.engine.optim.whole_param_step import assign_owners
from tests.distributed import scenarios as S
from tests.distributed.launch import in_group, run_distributed
from tests.tiny_models import batch_for_step

LR = 2e-2  # not torch.optim.Adafactor's default (1e-2), so a config lr that is not passed on shows
STEPS = 3
CONFIGS = {"s1": (1, {}), "s2": (2, {}), "s3": (3, {}),
           "s2_offload": (2, {"offload_optimizer": {"device": "cpu"}}),
           "s3_offload": (3, {"offload_optimizer": {"device": "cpu"}})}


def _train_all(world: int) -> dict[str, Any]:
    import hf_zero

    results = {}
    runs = [(name, stage, zero, "passed") for name, (stage, zero) in CONFIGS.items()] + [("s2_config", 2, {}, "config")]
    for name, stage, zero, how in runs:
        sc = S.scenario("gpt2", stage, optimizer="none", zero=zero, steps=STEPS)
        model = S.build_model(sc)
        config = S.make_config(sc)
        if how == "config":  # the other keys' defaults are torch.optim.Adafactor's
            config["optimizer"] = {"type": "Adafactor", "params": {"lr": LR}}
            passed = None
        else:
            passed = torch.optim.Adafactor(model.parameters(), lr=LR)
        engine, optimizer, _, _ = hf_zero.initialize(model=model, config=config, optimizer=passed)
        for step in range(STEPS):
            batch = batch_for_step(step, world * sc["micro"])
            start = engine.rank * sc["micro"]
            engine.backward(S.model_loss(engine, "gpt2", batch[start:start + sc["micro"]]))
            engine.step()
        owned = sum(p.numel() for g in optimizer.param_groups for p in g["params"])
        results[name] = {"params": S.full_params(engine), "owned_numel": owned,
                         "fp32_master_bytes": engine.memory_report()["fp32_master"]}
    return results


def _reference(world: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    model = S.build_model(S.scenario("gpt2", 2))
    start = {n: p.detach().clone().reshape(-1) for n, p in model.named_parameters()}
    optimizer = torch.optim.Adafactor(model.parameters(), lr=LR)
    for step in range(STEPS):
        loss = S.model_loss(model, "gpt2", batch_for_step(step, world * 2))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), S.CLIP)
        optimizer.step()
    return start, {n: p.detach().reshape(-1) for n, p in model.named_parameters()}


def _every_case(root: str) -> dict[str, Any]:
    """Every distributed case of this file, in order (the save before the resume that reads it)."""
    cases = [(f"adafactor-{world}", world, lambda _, w=world: _train_all(w)) for world in (2, 3)]
    cases += [(f"muon-{world}", world, lambda _, w=world: _train_muon(w)) for world in (2, 3)]
    cases += [("torch-muon", 2, lambda _: _initialize_with_torch_muon(2)),
              ("save", 2, lambda r: _save_after_two_steps(2, r)), ("resume", 3, lambda r: _resume_third_step(3, r))]
    return {name: in_group(world, phase, root) for name, world, phase in cases}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    """Each case's results, one per rank of its world."""
    ranks = run_distributed(_every_case, 3, str(tmp_path_factory.mktemp("whole")))
    return {name: [rank[name] for rank in ranks if rank[name] is not None] for name in ranks[0]}


@pytest.mark.parametrize("world", [2, 3])
def test_adafactor_matches_one_process_at_every_stage_and_with_offload(runs, world):
    ranks = runs[f"adafactor-{world}"]
    assert len(ranks) == world
    start, reference = _reference(world)
    moved = max((reference[n] - start[n]).abs().max().item() for n in reference)
    assert moved > 1e-3  # the signal is far above the tolerance
    total = sum(v.numel() for v in reference.values())
    for name in [*CONFIGS, "s2_config"]:
        got = ranks[0][name]["params"]
        assert got.keys() == reference.keys()
        diff = max((torch.tensor(got[n]) - reference[n]).abs().max().item() for n in reference)
        assert diff <= 1e-5, f"{name}: {diff:.3e}"
        for rank in ranks[1:]:  # every rank holds the same model
            assert rank[name]["params"] == got
        # Each parameter's master lives on exactly one rank.
        assert sum(rank[name]["owned_numel"] for rank in ranks) == total
        # memory_report counts those masters, on the device: in fp32 the flat master is the
        # compute shard (counted as compute_params) or, offloaded, on the host, so the device's
        # fp32 masters are exactly the owners' full-shape copies.
        assert sum(rank[name]["fp32_master_bytes"] for rank in ranks) == 4 * total, name


def test_owners_balance_elements_largest_first():
    assert assign_owners([10, 1, 1, 8, 2], 2) == [0, 0, 1, 1, 1]  # loads 11 and 11
    assert assign_owners([5, 5, 5], 3) == [0, 1, 2]
    assert assign_owners([3, 4], 1) == [0, 0]


MUON = dict(lr=2e-2, momentum=0.95, weight_decay=0.1, nesterov=True, ns_steps=5)
AUX_ADAMW = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.999), eps=1e-8)
MUON_SECTION = {"type": "Muon", "params": {"lr": MUON["lr"], "momentum": MUON["momentum"], "adam_lr": AUX_ADAMW["lr"],
                                           "weight_decay": MUON["weight_decay"]}}


def _train_muon(world: int) -> dict[str, Any]:
    """Every config through the config's Muon section, and stage 2 with MuonWithAuxAdamW passed in."""
    import hf_zero
    from hf_zero.engine.optim.muon import MuonWithAuxAdamW

    S.use_fp32_newton_schulz()
    runs = [(name, stage, zero, "config") for name, (stage, zero) in CONFIGS.items()] + [("s2_passed", 2, {}, "passed")]
    results = {}
    for name, stage, zero, how in runs:
        sc = S.scenario("gpt2", stage, optimizer="none", zero=zero, steps=STEPS)
        model = S.build_model(sc)
        config = S.make_config(sc)
        kwargs: dict[str, Any] = {}
        if how == "config":
            config["optimizer"] = MUON_SECTION
        else:
            kwargs["optimizer"] = MuonWithAuxAdamW(muon_param_groups(model, MUON, AUX_ADAMW))
        engine, optimizer, _, _ = hf_zero.initialize(model=model, config=config, **kwargs)
        for step in range(STEPS):
            batch = batch_for_step(step, world * sc["micro"])
            start = engine.rank * sc["micro"]
            engine.backward(S.model_loss(engine, "gpt2", batch[start:start + sc["micro"]]))
            engine.step()
        owned = {str(g["use_muon"]): sum(p.numel() for p in g["params"]) for g in optimizer.param_groups}
        results[name] = {"params": S.full_params(engine), "owned_numel": owned}
    return results


def _muon_reference(world: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, int]]:
    """torch's two optimizers, as torch.optim.Muon's documentation pairs them."""
    import torch.optim._muon

    torchs = S.use_fp32_newton_schulz()
    model = S.build_model(S.scenario("gpt2", 2))
    start = {n: p.detach().clone().reshape(-1) for n, p in model.named_parameters()}
    matrices, rest = (g["params"] for g in muon_param_groups(model, {}, {}))
    optimizers = [torch.optim.Muon(matrices, **MUON), torch.optim.AdamW(rest, **AUX_ADAMW)]
    try:
        for step in range(STEPS):
            loss = S.model_loss(model, "gpt2", batch_for_step(step, world * 2))
            for optimizer in optimizers:
                optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), S.CLIP)
            for optimizer in optimizers:
                optimizer.step()
    finally:
        torch.optim._muon._zeropower_via_newtonschulz = torchs
    sizes = {"True": sum(p.numel() for p in matrices), "False": sum(p.numel() for p in rest)}
    return start, {n: p.detach().reshape(-1) for n, p in model.named_parameters()}, sizes


@pytest.mark.parametrize("world", [2, 3])
def test_muon_with_adamw_matches_torch_at_every_stage_and_with_offload(runs, world):
    ranks = runs[f"muon-{world}"]
    assert len(ranks) == world
    start, reference, sizes = _muon_reference(world)
    assert sizes["True"] > 0 and sizes["False"] > 0  # both optimizers have work
    moved = max((reference[n] - start[n]).abs().max().item() for n in reference)
    assert moved > 1e-2  # the signal is far above the tolerance
    for name, got in ranks[0].items():
        assert got["params"].keys() == reference.keys()
        diff = max((torch.tensor(got["params"][n]) - reference[n]).abs().max().item() for n in reference)
        assert diff <= 1e-5, f"{name}: {diff:.3e}"
        for rank in ranks[1:]:  # every rank holds the same model
            assert rank[name]["params"] == got["params"]
        # Each parameter's master lives on exactly one rank, Muon's and AdamW's alike.
        for kind, size in sizes.items():
            assert sum(rank[name]["owned_numel"][kind] for rank in ranks) == size, (name, kind)


def _initialize_with_torch_muon(world: int) -> str:
    import hf_zero

    sc = S.scenario("gpt2", 2, optimizer="none")
    model = S.build_model(sc)
    matrices = [p for p in model.parameters() if p.ndim == 2]
    try:
        hf_zero.initialize(model=model, config=S.make_config(sc), optimizer=torch.optim.Muon(matrices))
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_torch_muon_on_a_model_with_vectors_is_refused_before_any_step(runs):
    """torch.optim.Muon takes 2-D weights only; passed in for a model that trains biases and
    norms too, hf_zero names them and the two ways that work."""
    message = runs["torch-muon"][0]
    assert "torch.optim.Muon steps 2-D weights only" in message and "\"type\": \"Muon\"" in message, message
    assert "MuonWithAuxAdamW" in message


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_muon_takes_hidden_matrices_and_adamw_the_rest(kind):
    """Embeddings, the output projection (tied or not), biases and norms stay on AdamW."""
    from tests.tiny_models import BUILDERS

    model = BUILDERS[kind](seed=0)
    names = {id(p): n for n, p in model.named_parameters()}
    muon, aux = ([names[id(p)] for p in g["params"]] for g in muon_param_groups(model, {}, {}))
    assert set(muon) | set(aux) == set(names.values()) and not set(muon) & set(aux)
    hidden = {"gpt2": (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight"),
              "llama": ("_proj.weight",)}[kind]
    assert muon and all(n.endswith(hidden[0] if kind == "llama" else hidden) for n in muon), muon
    assert all(("embed" in n or "wte" in n or "wpe" in n or "lm_head" in n or dict(model.named_parameters())[n].ndim == 1)
               for n in aux), aux
    assert any(n.startswith(("lm_head", "model.embed_tokens", "transformer.wte")) for n in aux)


# Resuming: a run saved at world 2 and stage 2 goes on at world 3 and stages 1 and 3 (with CPU
# offload) exactly as if it had not stopped; the owners of each parameter differ between the two
# world sizes, so every owner reads state another rank wrote ([Note: whole-parameter state in
# checkpoints]). The global batch is 6 rows at both world sizes.
GLOBAL_ROWS = 6
RESUME_CONFIGS = {"s1": (1, {}), "s3_offload": (3, {"offload_optimizer": {"device": "cpu"}})}


def _engine_for(kind: str, stage: int, zero: dict[str, Any], world: int) -> Any:
    import hf_zero

    sc = S.scenario("gpt2", stage, optimizer="none", zero=zero, micro=GLOBAL_ROWS // world)
    model = S.build_model(sc)
    config = S.make_config(sc)
    if kind == "muon":
        config["optimizer"] = MUON_SECTION
        return hf_zero.initialize(model=model, config=config)[0]
    return hf_zero.initialize(model=model, config=config, optimizer=torch.optim.Adafactor(model.parameters(), lr=LR))[0]


def _train_steps(engine: Any, steps: range) -> None:
    micro = GLOBAL_ROWS // engine.world_size
    for step in steps:
        batch = batch_for_step(step, GLOBAL_ROWS)
        engine.backward(S.model_loss(engine, "gpt2", batch[engine.rank * micro:(engine.rank + 1) * micro]))
        engine.step()


def _save_after_two_steps(world: int, root: str) -> dict[str, Any]:
    S.use_fp32_newton_schulz()
    results = {}
    for kind in ("adafactor", "muon"):
        engine = _engine_for(kind, 2, {}, world)
        _train_steps(engine, range(2))
        engine.save_checkpoint(f"{root}/{kind}")
        _train_steps(engine, range(2, 3))
        results[kind] = S.full_params(engine)
    return results


def _resume_third_step(world: int, root: str) -> dict[str, Any]:
    S.use_fp32_newton_schulz()
    results = {}
    for kind in ("adafactor", "muon"):
        for name, (stage, zero) in RESUME_CONFIGS.items():
            for load_state in (True, False):
                engine = _engine_for(kind, stage, zero, world)
                engine.load_checkpoint(f"{root}/{kind}", load_optimizer_states=load_state)
                assert engine.global_steps == 2
                _train_steps(engine, range(2, 3))
                results[f"{kind}/{name}/{'state' if load_state else 'fresh'}"] = S.full_params(engine)
    return results


def test_resume_at_another_world_size_and_stage_continues_the_run(runs):
    continuous = runs["save"][0]
    resumed = runs["resume"]
    assert len(resumed) == 3
    for key, got in resumed[0].items():
        kind, _, how = key.split("/")
        want = continuous[kind]
        diff = max(max(abs(a - b) for a, b in zip(got[n], want[n], strict=True)) for n in want)
        if how == "state":
            assert diff <= 1e-5, f"{key}: {diff:.3e}"
            assert all(rank[key] == got for rank in resumed[1:])
        else:  # the saved state matters: without it the third step lands elsewhere
            assert diff > 1e-3, f"{key}: {diff:.3e}"
