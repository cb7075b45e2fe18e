"""Ranks that take different paths through the model train exactly as DDP does.

Each rank skips a layer of its own per step, runs a side tower only on some steps, or routes its
tokens to a subset of experts (tests/divergent_models.py). In the same gloo group, the same model
is trained with torch DDP(find_unused_parameters=True) and torch.optim.AdamW: hf_zero at stages
0-3 must end within 1e-5 of it, and must not hang (every scenario runs under the test timeout).

DDP's semantics are the reference: a rank that did not use a parameter contributes zeros to its
average, and a parameter no rank used in a step keeps ``grad is None``, so AdamW leaves it, and
its moments, untouched.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests import divergent_models as M
from tests.distributed.launch import run_distributed

ATOL = 1e-5
STEPS = 6
LR = 1e-2
BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.1
CLIP = 1.0

SCENARIOS = [dict(model="layerdrop_tower", stage=s) for s in (0, 1, 2, 3)] + [
    dict(model="moe", stage=s) for s in (0, 1, 2, 3)
] + [
    # Stage 3 with prefetch off and with the reuse distance off, and gradient accumulation.
    dict(model="layerdrop_tower", stage=3, zero={"stage3_prefetch_bucket_size": 0}),
    dict(model="layerdrop_tower", stage=3, zero={"stage3_max_reuse_distance": 0}),
    dict(model="layerdrop_tower", stage=2, gas=2, zero={"overlap_comm": True}),
    dict(model="layerdrop_tower", stage=3, gas=2),
    dict(model="moe", stage=3, zero={"reduce_bucket_size": 10**9}),
    # One bucket per group: the order in which buckets go out is then what pairs them.
    dict(model="layerdrop_tower", stage=2, zero={"reduce_bucket_size": 0}),
    dict(model="layerdrop_tower", stage=3, zero={"reduce_bucket_size": 0}),
    dict(model="moe", stage=2, zero={"reduce_bucket_size": 0, "overlap_comm": True}),
    # Offloaded optimizer: without clipping its step starts during the backward for the groups
    # this rank used, and the rest are stepped at step() when some other rank used them.
    dict(model="layerdrop_tower", stage=2, clip=0.0, zero={"offload_optimizer": {"device": "cpu"}}),
    dict(model="moe", stage=3, clip=0.0, zero={"offload_optimizer": {"device": "cpu"}}),
    dict(model="layerdrop_tower", stage=3, zero={"offload_optimizer": {"device": "cpu"},
                                                 "offload_param": {"device": "cpu"}}),
]


def _config(sc: dict[str, Any]) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": sc.get("gas", 1),
        "gradient_clipping": sc.get("clip", CLIP),
        "zero_optimization": {"stage": sc["stage"], "stage3_param_persistence_threshold": 0,
                              **sc.get("zero", {})},
        "optimizer": ({"type": "Adafactor", "params": {"lr": LR}} if sc.get("optimizer") == "adafactor" else
                      {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": 1e-8,
                                                   "weight_decay": WEIGHT_DECAY}}),
    }


def _params(model: torch.nn.Module) -> dict[str, list[float]]:
    return {n: p.detach().reshape(-1).tolist() for n, p in model.named_parameters()}


def _train_ddp(sc: dict[str, Any], rank: int) -> dict[str, list[float]]:
    from torch.nn.parallel import DistributedDataParallel

    model = M.build(sc["model"])
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    optimizer = (torch.optim.Adafactor(model.parameters(), lr=LR) if sc.get("optimizer") == "adafactor" else
                 torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=1e-8, weight_decay=WEIGHT_DECAY))
    gas = sc.get("gas", 1)
    for step in range(STEPS):
        for k in range(gas):
            batch = M.rank_batch(sc["model"], step * gas + k, rank)
            context = ddp.no_sync() if k < gas - 1 else _nullcontext()
            with context:
                (ddp(**batch) / gas).backward()
        if sc.get("clip", CLIP) > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), sc.get("clip", CLIP))  # skips None grads
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return _params(model)


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _train_hf_zero(sc: dict[str, Any], rank: int) -> dict[str, list[float]]:
    import hf_zero

    engine, _, _, _ = hf_zero.initialize(model=M.build(sc["model"]), config=_config(sc))
    gas = sc.get("gas", 1)
    for step in range(STEPS):
        for k in range(gas):
            engine.backward(engine(**M.rank_batch(sc["model"], step * gas + k, rank)))
            engine.step()
    with engine.gathered_parameters():
        return _params(engine.module)


def _worker(scenarios: list[dict[str, Any]]) -> list[dict[str, Any]]:
    import torch.distributed as dist

    dist.init_process_group("gloo")  # from the launcher's variables; hf_zero joins it too
    rank = dist.get_rank()
    out = []
    for sc in scenarios:
        out.append({"ddp": _train_ddp(sc, rank), "hf_zero": _train_hf_zero(sc, rank)})
    return out


def _max_diff(a: dict[str, list[float]], b: dict[str, list[float]]) -> float:
    assert a.keys() == b.keys()
    return max(max(abs(x - y) for x, y in zip(a[n], b[n])) for n in a)


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def runs(request: pytest.FixtureRequest) -> list[list[dict[str, Any]]]:
    return run_distributed(_worker, request.param, SCENARIOS)


def _id(sc: dict[str, Any]) -> str:
    extra = "-".join(f"{k}={v['device'] if isinstance(v, dict) else v}" for k, v in sc.get("zero", {}).items())
    return (f"{sc['model']}-stage{sc['stage']}-gas{sc.get('gas', 1)}" + (f"-{extra}" if extra else "")
            + (f"-{sc['optimizer']}" if "optimizer" in sc else ""))


@pytest.mark.parametrize("index", range(len(SCENARIOS)), ids=[_id(s) for s in SCENARIOS])
def test_divergent_paths_match_ddp_find_unused(runs, index):
    for rank_results in runs:
        result = rank_results[index]
        assert _max_diff(result["hf_zero"], result["ddp"]) <= ATOL


def test_paths_really_diverge():
    """The schedule above makes ranks take different paths, and leaves some unit unused by every
    rank in some step (the case where DDP leaves ``grad`` None)."""
    for kind in ("layerdrop_tower", "moe"):
        model = M.build(kind)
        unit_names = [n for n, m in model.named_modules() if type(m).__name__ in model._no_split_modules]
        differs, unused_everywhere = False, False
        for step in range(STEPS):
            used = []
            for rank in range(2):
                model.zero_grad(set_to_none=True)
                model(**M.rank_batch(kind, step, rank)).backward()
                used.append({n for n in unit_names if model.get_submodule(n).fc.weight.grad is not None}
                            if kind != "moe" else
                            {n for n in unit_names if model.get_submodule(n).up.weight.grad is not None})
            differs |= used[0] != used[1]
            unused_everywhere |= len(used[0] | used[1]) < len(unit_names)
        assert differs and unused_everywhere, kind
