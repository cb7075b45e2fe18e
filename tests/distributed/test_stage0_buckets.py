"""Stage 0 reduces as DDP's reducer does: gradient buckets in backward order, each all-reduced as
soon as its units' gradients are final, while the rest of the backward runs; the averaged
gradients are DDP's bit for bit at world size 2 (a sum of two is exact in either order), and
within fp32 rounding at world size 3 (gloo's sum order may differ from DDP's bucket layout).

Both sides step with torch's SGD, which is element-wise and the same code on the flat master as on
DDP's parameters, so the parameters stay bit-identical step after step at world size 2.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests import divergent_models as M
from tests.distributed.launch import run_distributed

STEPS = 3
LR = 0.1


def _batch(step: int, rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {"ids": torch.randint(0, M.VOCAB, (2, M.SEQ), generator=g),  # every unit runs
            "images": torch.randn(2, M.DIM, generator=g)}


def _ddp(rank: int) -> list[dict[str, list[float]]]:
    from torch.nn.parallel import DistributedDataParallel

    model = M.build("layerdrop_tower")
    ddp = DistributedDataParallel(model, bucket_cap_mb=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for step in range(STEPS):
        ddp(**_batch(step, rank)).backward()
        out.append({n: p.grad.reshape(-1).tolist() for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    out.append({n: p.detach().reshape(-1).tolist() for n, p in model.named_parameters()})
    return out


def _grads(engine: Any) -> dict[str, list[float]]:
    found = {}
    for unit in engine.units:
        for group in unit.trainable_groups:
            for slot in group.layout.slots:
                found[slot.name] = slot.view_in(group.grads.shard).reshape(-1).tolist()
    return found


def _hf_zero(rank: int) -> dict[str, Any]:
    import hf_zero

    model = M.build("layerdrop_tower")
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": 0, "reduce_bucket_size": 200}}
    engine, *_ = hf_zero.initialize(model=model, config=config,
                                    optimizer=torch.optim.SGD(model.parameters(), lr=LR))
    engine.comm.trace = []
    launched_before_the_last_gradient: list[int] = []
    model.embed.weight.register_post_accumulate_grad_hook(  # the backward's last gradient
        lambda p: launched_before_the_last_gradient.append(sum(k == "all_reduce" for k, _ in engine.comm.trace)))
    out = []
    for step in range(STEPS):
        engine.backward(engine(**_batch(step, rank)))
        out.append(_grads(engine))
        engine.step()
    with engine.gathered_parameters():
        out.append({n: p.detach().reshape(-1).tolist() for n, p in engine.module.named_parameters()})
    reductions = sum(k == "all_reduce" for k, label in engine.comm.trace if label != "grad_norm")
    return {"steps": out, "launched_early": launched_before_the_last_gradient, "reductions": reductions}


def _worker() -> dict[str, Any]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    return {"ddp": _ddp(rank), "hf_zero": _hf_zero(rank)}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def runs(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    return request.param, run_distributed(_worker, request.param)


def test_stage0_gradients_and_parameters_are_ddps(runs):
    world, results = runs
    for result in results:
        for ddp, ours in zip(result["ddp"], result["hf_zero"]["steps"]):
            assert ddp.keys() == ours.keys()
            worst = max(max(abs(a - b) for a, b in zip(ddp[n], ours[n])) for n in ddp)
            assert worst == 0.0 if world == 2 else worst <= 1e-7, (world, worst)


def test_stage0_buckets_go_out_during_the_backward(runs):
    """Several buckets, and some all-reduced before the backward reached its last gradient."""
    _, results = runs
    for result in results:
        ours = result["hf_zero"]
        assert ours["reductions"] >= 3 * STEPS, ours["reductions"]  # several buckets per step
        assert len(ours["launched_early"]) == STEPS and all(n >= 2 for n in ours["launched_early"]), ours
