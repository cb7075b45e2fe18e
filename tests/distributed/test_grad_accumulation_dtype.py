"""bf16 gradients accumulate over micro-steps in fp32 at stages 0 and 1, as DeepSpeed's bf16
optimizer does (``data_types.grad_accum_dtype``, default fp32; the compute dtype on request).

Over 16 micro-steps of a bf16 model on 2 gloo ranks (reductions in fp32, so that only the
accumulation differs), the averaged gradient at the boundary must equal the fp64 sum of the same
per-micro-step bf16 gradients, computed by a plain torch copy of the model, to 1e-6 relative.
Summing them in bf16 instead is off by about 1e-3 relative, which the opt-in shows.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from tests import divergent_models as M
from tests.distributed.launch import run_distributed

GAS = 16
WORLD = 2


def _batch(micro_step: int, rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(100 * micro_step + rank)
    return {"ids": torch.randint(0, M.VOCAB, (2, M.SEQ), generator=g)}


def _reference_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every rank's micro-steps' bf16 gradients (of loss / GAS), summed in fp64 and averaged."""
    total = {n: torch.zeros(p.shape, dtype=torch.float64) for n, p in model.named_parameters()}
    for rank in range(WORLD):
        for k in range(GAS):
            model.zero_grad(set_to_none=True)
            (model(**_batch(k, rank)) / GAS).backward()
            for n, p in model.named_parameters():
                if p.grad is not None:  # the side tower and the adapter: not run here
                    total[n] += p.grad.double()
    return {n: t / WORLD for n, t in total.items()}


def _engine_grads(engine: Any) -> dict[str, torch.Tensor]:
    """The fp32 gradient at the boundary, gathered whole from every rank's shard."""
    import torch.distributed as dist

    found = {}
    for unit in engine.units:
        for group in unit.trainable_groups:
            shard = group.grads.shard
            full = torch.empty(group.layout.padded_numel, dtype=shard.dtype)
            if group.layout.world_size > 1:
                dist.all_gather_into_tensor(full, shard.contiguous())
            else:
                full.copy_(shard)
            for slot in group.layout.slots:
                found[slot.name] = slot.view_in(full).double()
    return found


def _relative_error(stage: int, accum: str | None) -> float:
    import hf_zero

    model = M.build("root_tower")
    reference = _reference_grads(copy.deepcopy(model).to(torch.bfloat16))
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.0,
        "bf16": {"enabled": True}, "communication_data_type": "fp32",
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    if accum is not None:
        config["data_types"] = {"grad_accum_dtype": accum}
    engine, *_ = hf_zero.initialize(model=model, config=config)
    for k in range(GAS):
        engine.backward(engine(**_batch(k, engine.rank)))
        if k < GAS - 1:
            engine.step()  # counts the micro-step; the boundary's gradients are read before the step
    got = _engine_grads(engine)
    scale = max(t.abs().max().item() for t in reference.values())
    return max((got[n] - reference[n]).abs().max().item() for n in reference) / scale


def _worker() -> dict[str, float]:
    return {f"stage{stage}-{accum}": _relative_error(stage, accum)
            for stage in (0, 1) for accum in (None, "bf16")}


@pytest.fixture(scope="module")
def errors() -> dict[str, float]:
    return run_distributed(_worker, WORLD)[0]


@pytest.mark.parametrize("stage", [0, 1])
def test_bf16_gradients_accumulate_in_fp32_by_default(errors, stage):
    assert errors[f"stage{stage}-None"] <= 1e-6, errors


@pytest.mark.parametrize("stage", [0, 1])
def test_the_compute_dtype_on_request_loses_what_fp32_keeps(errors, stage):
    """The signal the test above checks: a bf16 sum over 16 micro-steps is far off."""
    assert errors[f"stage{stage}-bf16"] >= 1e-4, errors
