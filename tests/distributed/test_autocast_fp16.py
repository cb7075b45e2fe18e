"""float16 ``torch_autocast`` ([Note: torch_autocast] in hf_zero.config.hf_zero_config) against
what DDP's --fp16 runs: ``torch.autocast(float16)`` over fp32 weights with ``torch.amp.GradScaler``
at its defaults, on 2 gloo ranks.

The loss is multiplied by 1e4, so at GradScaler's first scale (2**16) the float16 backward
overflows: the reference skips its first steps, halving the scale each time, then trains. hf_zero
at stages 2 and 3 (reductions in fp32, ``lower_precision_safe_modules: []``, so that only the
precision rule is compared) must skip the same steps, hold the same scale at every step and give
the same losses to 1e-6; without a loss scale no step would be skipped, without the autocast the
first loss would differ by far more than that.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed.launch import run_distributed
from tests.tiny_models import VOCAB, tiny_llama

WORLD = 2
STEPS = 8
LOSS_FACTOR = 100.0  # large enough that 2**16 x the loss overflows float16 in the backward


def _batch(step: int, rank: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(10 * step + rank))
    return {"input_ids": ids, "labels": ids}


def _reference(rank: int) -> dict[str, list[float]]:
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(tiny_llama())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    scaler = torch.amp.GradScaler("cpu")
    losses, scales = [], []
    for step in range(STEPS):
        scales.append(scaler.get_scale())
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(**_batch(step, rank)).loss * LOSS_FACTOR
        losses.append(loss.item())
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return {"loss": losses, "scale": scales}


def _hf_zero(stage: int, rank: int, autocast: bool = True) -> dict[str, Any]:
    import hf_zero

    config = {
        "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
        "torch_autocast": {"enabled": autocast, "dtype": "float16", "lower_precision_safe_modules": []},
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
    }
    engine, *_ = hf_zero.initialize(model=tiny_llama(), config=config)
    losses, scales = [], []
    for step in range(STEPS):
        scales.append(engine.loss_scale)
        loss = engine(**_batch(step, rank)).loss * LOSS_FACTOR
        losses.append(loss.item())
        engine.backward(loss)
        engine.step()
    return {"loss": losses, "scale": scales, "skipped": engine.skipped_steps}


def _worker() -> dict[str, Any]:
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    runs = {f"z{stage}": _hf_zero(stage, rank) for stage in (2, 3)}
    runs["ddp"] = _reference(rank)
    return runs


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    return run_distributed(_worker, WORLD)[0]


def test_the_reference_overflows_first(runs):
    """The signal: GradScaler halves its scale over the first steps, then keeps it."""
    scales = runs["ddp"]["scale"]
    assert scales[0] == 2.0**16 and scales[-1] < scales[0] / 2, scales


@pytest.mark.parametrize("stage", [2, 3])
def test_fp16_autocast_scales_and_skips_as_grad_scaler(runs, stage):
    got, ddp = runs[f"z{stage}"], runs["ddp"]
    assert got["scale"] == ddp["scale"], (got["scale"], ddp["scale"])
    skipped = sum(1 for a, b in zip(ddp["scale"], ddp["scale"][1:]) if b < a)
    assert got["skipped"] == skipped > 0
    assert got["loss"] == pytest.approx(ddp["loss"], rel=1e-6), (got["loss"], ddp["loss"])
