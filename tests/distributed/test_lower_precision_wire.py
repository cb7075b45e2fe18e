"""``torch_autocast.lower_precision_safe_modules`` on 2 gloo ranks ([Note: lower-precision-safe
modules] in hf_zero.engine.lower_precision): the parameters of Linear modules travel in bf16, the
others in fp32, and only the wire copy is rounded.

- A stage-3 gather of a Linear's weight hands the forward bf16 values (widened to fp32); with
  the list empty the same weights are fp32 values that bf16 cannot hold.
- A gradient reduced in bf16 lands in the fp32 shard as a bf16 value; the RMSNorm weights'
  (reduced in fp32) do not.
- The traffic: each element of a safe group is 2 bytes on the wire, 4 with the list empty; the
  gathers and reductions send exactly that many fewer bytes.
- ``gathered_parameters`` (saves, exports, modifiers) returns the exact fp32 shards, also for a
  unit the schedule left gathered in bf16; a checkpoint saved with the list resumes without
  autocast to the same parameters.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from tests.distributed.launch import run_distributed
from tests.tiny_models import VOCAB, tiny_llama

WORLD = 2


def _config(stage: int, safe: list[str] | None) -> dict[str, Any]:
    autocast: dict[str, Any] = {"enabled": True}
    if safe is not None:
        autocast["lower_precision_safe_modules"] = safe
    return {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
        "torch_autocast": autocast,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 500,
                              **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    }


def _batch(step: int, rank: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(10 * step + rank))
    return {"input_ids": ids, "labels": ids}


def _is_bf16(t: torch.Tensor) -> bool:
    return bool(torch.equal(t, t.to(torch.bfloat16).float()))


def _run(stage: int, safe: list[str] | None, tmp: str | None = None) -> dict[str, Any]:
    import hf_zero

    model = tiny_llama()
    engine, *_ = hf_zero.initialize(model=model, config=_config(stage, safe))
    q_proj = engine.module.model.layers[0].self_attn.q_proj
    seen: dict[str, bool] = {}
    hook = q_proj.register_forward_pre_hook(lambda m, _: seen.update(q_proj=_is_bf16(m.weight.detach())) and None)
    engine.reset_comm_stats()
    engine.backward(engine(**_batch(0, engine.rank)).loss)
    stats = engine.comm_stats()
    wire = {g.label: g.kind.wire_dtype for u in engine.units for g in u.groups}
    shard_is_bf16 = {}
    for unit in engine.units:
        for group in unit.trainable_groups:
            names = {s.name for s in group.layout.slots}
            shard = group.grads.shard.float()
            if "model.layers.0.self_attn.q_proj.weight" in names:
                shard_is_bf16["q_proj"] = _is_bf16(shard)
            if "model.layers.0.input_layernorm.weight" in names:
                shard_is_bf16["norm"] = _is_bf16(shard)
    engine.step()
    hook.remove()
    safe_numel = sum(g.layout.padded_numel for u in engine.units for g in u.groups
                     if g.kind.wire_dtype is torch.bfloat16)
    out: dict[str, Any] = {
        "forward_q_proj_bf16": seen["q_proj"], "grad_shard_bf16": shard_is_bf16, "stats": stats,
        "safe_padded_numel": safe_numel, "wire_groups": sorted(str(v) for v in wire.values() if v is not None),
    }
    if stage == 3:
        unit = next(u for u in engine.units if any(p is q_proj.weight for g in u.groups for p in g.params))
        unit.unshard()  # as the schedule gathers: in bf16
        out["scheduled_gather_bf16"] = _is_bf16(q_proj.weight.detach())
        with engine.gathered_parameters():
            out["exact_gather_bf16"] = _is_bf16(q_proj.weight.detach())
            exact = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        unit.reshard()
        if tmp is not None:
            engine.save_checkpoint(tmp, tag="t")
            resumed, *_ = hf_zero.initialize(model=tiny_llama(seed=5), config={
                **_config(3, None), "torch_autocast": {"enabled": False}})
            resumed.load_checkpoint(tmp, tag="t")
            with resumed.gathered_parameters():
                again = {n: p.detach().clone() for n, p in resumed.module.named_parameters()}
            out["resumed_equal"] = all(torch.equal(exact[n], again[n]) for n in exact)
    return out


def _worker(tmp: str) -> dict[str, Any]:
    return {f"{stage}-{'default' if safe is None else 'none'}": _run(stage, safe, tmp if safe is None else None)
            for stage in (0, 2, 3) for safe in (None, [])}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_distributed(_worker, WORLD, str(tmp_path_factory.mktemp("lp")))[0]


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_linear_gradients_are_reduced_in_bf16(runs, stage):
    default, none = runs[f"{stage}-default"], runs[f"{stage}-none"]
    assert default["grad_shard_bf16"] == {"q_proj": True, "norm": False}, default["grad_shard_bf16"]
    assert none["grad_shard_bf16"] == {"q_proj": False, "norm": False}, none["grad_shard_bf16"]
    assert default["wire_groups"] and set(default["wire_groups"]) == {"torch.bfloat16"}
    assert none["wire_groups"] == []


def test_stage3_gathers_linear_weights_in_bf16(runs):
    assert runs["3-default"]["forward_q_proj_bf16"] is True
    assert runs["3-none"]["forward_q_proj_bf16"] is False
    assert runs["3-default"]["scheduled_gather_bf16"] is True


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_safe_groups_send_half_the_bytes(runs, stage):
    """Each safe element is 2 bytes fewer in its gradient reduction and (stage 3) in its gather;
    everything else is unchanged."""
    default, none = runs[f"{stage}-default"], runs[f"{stage}-none"]
    safe = default["safe_padded_numel"]
    reduce_kind = "all_reduce" if stage == 0 else "reduce_scatter"
    saved = none["stats"][reduce_kind]["bytes"] - default["stats"][reduce_kind]["bytes"]
    assert saved == 2 * safe, (saved, safe, default["stats"], none["stats"])
    if stage == 3:
        gathered = none["stats"]["all_gather"]["bytes"] - default["stats"]["all_gather"]["bytes"]
        # One gather per unit: the default reuse distance keeps it from the forward to the backward.
        assert gathered == 2 * safe, (gathered, safe)


def test_exact_gathers_and_checkpoints_keep_fp32(runs):
    default = runs["3-default"]
    assert default["exact_gather_bf16"] is False
    assert default["resumed_equal"] is True
