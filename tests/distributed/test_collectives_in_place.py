"""A group of IN_PLACE_NUMEL elements or more is reduce-scattered alone and in place, and (stages
1-2) all-gathered alone and in place after the step; only the smaller groups share a bucket
([Note: buckets]). The model trains as in one process."""

from __future__ import annotations

from typing import Any

import torch

from hf_zero.engine.schedule.buckets import IN_PLACE_NUMEL
from tests.distributed.launch import run_distributed

LR = 1e-2


def _model() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    # Each block holds 12 x 320^2 = 1.23M elements (above the threshold); the root (tiny
    # vocabulary, positions, final norm) is far below it.
    return GPT2LMHeadModel(GPT2Config(n_embd=320, n_layer=2, n_head=4, vocab_size=64, n_positions=16,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(step))


def _train(world: int) -> dict[str, Any]:
    import hf_zero

    config = {"train_micro_batch_size_per_gpu": 4 // world, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}, "zero_optimization": {"stage": 2}}
    engine, *_ = hf_zero.initialize(model=_model(), config=config)
    micro = 4 // world
    for step in range(3):
        engine.reset_comm_stats()
        ids = _batch(step)[engine.rank * micro:(engine.rank + 1) * micro]
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    big = sum(1 for u in engine.units for g in u.groups if g.layout.padded_numel >= IN_PLACE_NUMEL)
    small = sum(1 for u in engine.units for g in u.groups if g.layout.padded_numel < IN_PLACE_NUMEL)
    stats = engine.comm_stats()
    return {"all_gathers": stats["all_gather"]["calls"], "reduce_scatters": stats["reduce_scatter"]["calls"],
            "big": big, "small": small,
            "params": {n: p.detach().reshape(-1).tolist() for n, p in engine.module.named_parameters()}}


def test_large_groups_are_reduced_and_gathered_alone_and_the_model_trains_as_in_one_process():
    ranks = run_distributed(_train, 2, 2)
    first = ranks[0]
    assert first["big"] == 2 and first["small"] >= 1, first
    # Each large group alone, the rest in one bucket (the default buckets hold the whole model).
    assert first["reduce_scatters"] == first["big"] + 1
    assert first["all_gathers"] == first["big"] + 1
    assert all(r["params"] == first["params"] for r in ranks[1:])
    model = _model()
    initial = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    for step in range(3):
        ids = _batch(step)
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    names = [n for n, _ in model.named_parameters()]
    expected = torch.cat([p.detach().reshape(-1) for p in model.parameters()]) - initial
    got = torch.cat([torch.tensor(first["params"][n]) for n in names]) - initial
    # Relative to the update (Adam turns reduction-order rounding of near-zero gradients into
    # sign flips of single elements, so an element-wise bound would measure noise).
    assert float((got - expected).norm() / expected.norm()) <= 1e-4
