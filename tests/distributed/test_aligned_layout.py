"""Aligned flat layouts on real gloo groups ([Note: alignment in flat buffers] in
hf_zero/partition.py): every parameter and gradient view of the engine is 16-byte aligned at
world sizes 2 and 3 in fp32, bf16 and fp16, and a checkpoint saved with the earlier layout
(parameters back to back, padding to world x 4) loads into the aligned one, at the same world
size and at another, and training continues on the same curve.

One spawn of three processes: a world-3 group, then a world-2 group of the first two processes
(as tests/distributed/test_checkpoint.py does), so the world-2 engine reads what world 3 wrote.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import pytest
import torch

from tests.distributed import scenarios as S
from tests.distributed.launch import in_group, run_distributed
from tests.distributed.parity_checks import max_param_diff

GLOBAL_ROWS = 6  # 3 ranks x 2 rows, 2 ranks x 3 rows: the same global batch at both sizes
SAVE_AT, STEPS = 2, 4
FP32_ATOL = 1e-5  # as test_checkpoint's cross-size resumes: another layout sums the norm in another order
ALIGNMENT_CASES = [(dtype, stage) for dtype in ("fp32", "bf16", "fp16") for stage in (1, 3)]


def _engine(stage: int, dtype: str = "fp32", on_grad: Callable[[str, torch.Tensor], None] | None = None) -> Any:
    """The tiny GPT-2 (15-element norms and biases: misaligned when packed back to back); with
    ``on_grad``, called with each parameter's name and its ``.grad`` as autograd fills it (hooks
    registered before the engine's, so they see the gradient view before any reduction)."""
    import hf_zero

    sc = S.scenario("gpt2", stage, dtype=dtype, micro=GLOBAL_ROWS // int(os.environ["WORLD_SIZE"]))
    model = S.build_model(sc)
    if on_grad is not None:
        for name, param in model.named_parameters():
            param.register_post_accumulate_grad_hook(lambda p, name=name: on_grad(name, p.grad))
    engine, *_ = hf_zero.initialize(model=model, config=S.make_config(sc))
    return engine


def _train(engine: Any, steps: range) -> list[float]:
    """Each step's loss, the mean over ranks (equal rows per rank: the global batch's mean)."""
    losses = []
    rows = GLOBAL_ROWS // engine.world_size
    for step in steps:
        batch = S.learnable_batch(step, GLOBAL_ROWS)[engine.rank * rows:(engine.rank + 1) * rows]
        loss = S.model_loss(engine, "gpt2", batch)
        engine.backward(loss)
        engine.step()
        every = engine.comm.all_gather_objects(loss.item())
        losses.append(sum(every) / len(every))
    return losses


def _alignment(dtype: str, stage: int) -> dict[str, Any]:
    """How many parameter views (gathered) and gradient views (as autograd filled them) are not
    16-byte aligned, over one training step."""
    seen_grads: list[str] = []
    misaligned_grads: list[str] = []

    def check(name: str, grad: torch.Tensor) -> None:
        seen_grads.append(name)
        if grad.data_ptr() % 16:
            misaligned_grads.append(name)

    engine = _engine(stage, dtype, on_grad=check)
    _train(engine, range(1))
    with engine.gathered_parameters():
        params = list(engine.module.named_parameters())
        misaligned = [n for n, p in params if p.data_ptr() % 16]
    return {"params": len(params), "misaligned": misaligned, "grads": len(set(seen_grads)),
            "misaligned_grads": misaligned_grads,
            "dtype": str(params[0][1].dtype)}


def _old_layout_save(root: str) -> dict[str, Any]:
    """Train and save with the layout hf_zero had before alignment, then go on training."""
    from hf_zero import partition

    aligned = partition.PARAM_ALIGNMENT, partition.SHARD_ALIGNMENT
    partition.PARAM_ALIGNMENT, partition.SHARD_ALIGNMENT = 1, 4
    try:
        engine = _engine(stage=2)
    finally:
        partition.PARAM_ALIGNMENT, partition.SHARD_ALIGNMENT = aligned
    offsets = [s["offset"] for g in engine.layout() for s in g["slots"]]
    _train(engine, range(SAVE_AT))
    engine.save_checkpoint(os.path.join(root, "old_layout"))
    saved = S.full_params(engine)
    return {"offsets": offsets, "saved": saved, "continued": _train(engine, range(SAVE_AT, STEPS)),
            "params": S.full_params(engine)}


def _resume_old(root: str, stage: int) -> dict[str, Any]:
    engine = _engine(stage)
    engine.load_checkpoint(os.path.join(root, "old_layout"))
    loaded = S.full_params(engine)
    offsets = [s["offset"] for g in engine.layout() for s in g["slots"]]
    return {"offsets": offsets, "loaded": loaded, "continued": _train(engine, range(SAVE_AT, STEPS)),
            "params": S.full_params(engine)}


def _phase_world3(root: str) -> dict[str, Any]:
    out: dict[str, Any] = {f"{d}_s{s}": _alignment(d, s) for d, s in ALIGNMENT_CASES}
    out["old"] = _old_layout_save(root)
    out["resumed_s3"] = _resume_old(root, stage=3)
    return out


def _phase_world2(root: str) -> dict[str, Any]:
    out: dict[str, Any] = {f"{d}_s{s}": _alignment(d, s) for d, s in ALIGNMENT_CASES}
    out["resumed_s1"] = _resume_old(root, stage=1)
    return out


def _all_phases(root: str) -> dict[str, Any]:
    return {"w3": in_group(3, _phase_world3, root), "w2": in_group(2, _phase_world2, root)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict[str, Any]]]:
    root = str(tmp_path_factory.mktemp("aligned"))
    per_rank = run_distributed(_all_phases, 3, root)
    return {3: [r["w3"] for r in per_rank], 2: [r["w2"] for r in per_rank[:2]]}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype,stage", ALIGNMENT_CASES)
def test_every_parameter_and_gradient_view_is_16_byte_aligned(runs, world, dtype, stage):
    for rank_result in runs[world]:
        found = rank_result[f"{dtype}_s{stage}"]
        assert found["dtype"] == str(S.LOW_PRECISION.get(dtype, torch.float32))
        assert found["params"] > 0 and found["misaligned"] == []
        assert found["grads"] == found["params"] and found["misaligned_grads"] == []


def test_the_old_checkpoint_had_the_old_layout(runs):
    old = runs[3][0]["old"]["offsets"]
    assert any(offset % 8 for offset in old)  # back to back: GPT-2's 15-element norms misalign the rest
    for world, key in [(3, "resumed_s3"), (2, "resumed_s1")]:
        assert all(offset % 8 == 0 for offset in runs[world][0][key]["offsets"])


@pytest.mark.parametrize("world,key", [(3, "resumed_s3"), (2, "resumed_s1")])
def test_an_old_layout_checkpoint_loads_and_continues_the_curve(runs, world, key):
    old = runs[3][0]["old"]
    for rank_result in runs[world]:
        resumed = rank_result[key]
        assert resumed["loaded"] == old["saved"]  # every parameter, to the bit
        assert resumed["continued"] == pytest.approx(old["continued"], abs=FP32_ATOL)
        assert max_param_diff(resumed["params"], old["params"]) <= FP32_ATOL
