"""[Note: the shard lent to the gathered buffer]: while a stage-3 unit is gathered its shard has no
memory of its own (the gathered buffer's chunk holds the values), it gets them back when the unit
is freed, a checkpoint saved while units are gathered is the one saved after, and the run still
matches single-process torch."""

from __future__ import annotations

import os
from typing import Any

import torch

from tests.distributed import scenarios as S
from tests.distributed.launch import run_distributed
from tests.tiny_models import learnable_batch

SCENARIO = S.scenario("llama", 3, steps=3)


def _lent_shards_through_training(world: int, out_dir: str) -> dict[str, Any]:
    import hf_zero
    from safetensors.torch import load_file

    engine, *_ = hf_zero.initialize(model=S.build_model(SCENARIO), config=S.make_config(SCENARIO))
    micro = SCENARIO["micro"]
    seen: dict[str, Any] = {"gathered_lent": [], "gathered_values_right": [], "sharded_own_memory": []}
    for step in range(SCENARIO["steps"]):
        batch = learnable_batch(step, world * micro)
        loss = S.model_loss(engine, "llama", batch[engine.rank * micro:(engine.rank + 1) * micro])
        for unit in engine.units:  # the decoder layers stay gathered until their backward
            for group in unit.groups:
                storage = group.storage
                if not storage.sharded_between_uses:
                    continue
                if storage.is_unsharded:
                    lo, hi = storage.shard_range
                    seen["gathered_lent"].append(storage.shard.untyped_storage().nbytes() == 0)
                    seen["gathered_values_right"].append(torch.equal(storage.read_shard(), storage.full[lo:hi]))
        engine.backward(loss)
        engine.step()
        for unit in engine.units:
            for group in unit.groups:
                shard = group.storage.shard
                if group.storage.sharded_between_uses:
                    seen["sharded_own_memory"].append(shard.untyped_storage().nbytes() == shard.numel() * shard.element_size())
    # A checkpoint saved while every unit is gathered (every shard lent) is the one saved after.
    with engine.gathered_parameters():
        lent = [g.storage.shard.untyped_storage().nbytes() == 0 for u in engine.units for g in u.groups
                if g.storage.sharded_between_uses]
        engine.save_checkpoint(out_dir, tag="while_gathered")
    engine.save_checkpoint(out_dir, tag="after")
    name = f"rank-{engine.rank:05d}-of-{world:05d}.safetensors"
    inside = load_file(os.path.join(out_dir, "while_gathered", name))
    after = load_file(os.path.join(out_dir, "after", name))
    seen["saved_while_lent"] = all(lent) and bool(lent)
    seen["same_checkpoint"] = sorted(inside) == sorted(after) and all(torch.equal(inside[k], after[k]) for k in after)
    seen["params"] = S.full_params(engine)
    return seen


def test_gathered_units_lend_their_shards_and_get_them_back_exactly(tmp_path):
    ranks = run_distributed(_lent_shards_through_training, 2, 2, str(tmp_path))
    for rank in ranks:
        assert rank["gathered_lent"] and all(rank["gathered_lent"]), rank["gathered_lent"]
        assert all(rank["gathered_values_right"])
        assert rank["sharded_own_memory"] and all(rank["sharded_own_memory"])
        assert rank["saved_while_lent"]
        assert rank["same_checkpoint"]
    assert ranks[1]["params"] == ranks[0]["params"]
    reference = S.train_reference(SCENARIO, 2)
    assert S.update_error(ranks[0]["params"], reference, list(reference["params"])) <= 1e-5
