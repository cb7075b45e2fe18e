"""Training scenarios run on every rank of a real gloo group, and their single-process reference.

A scenario trains a tiny model for a few optimizer steps through ``hf_zero.initialize`` and
returns what the tests compare: the loss of every micro-step, the full parameters at the end,
``memory_report()``, ``comm_stats()`` per optimizer step and the flat layout.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.tiny_models import BUILDERS, batch_for_step, freeze_some

LR = 1e-3
BETAS = (0.9, 0.95)
EPS = 1e-8
WEIGHT_DECAY = 0.1
CLIP = 1.0
NUM_LABELS = 3


def scenario(model: str, stage: int, gas: int = 1, **overrides: Any) -> dict[str, Any]:
    base = dict(model=model, stage=stage, gas=gas, dtype="fp32", freeze=False, steps=5, micro=2,
                checkpointing=False, zero={}, optimizer="config")
    base.update(overrides)
    return base


def make_config(sc: dict[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": sc["micro"],
        "gradient_accumulation_steps": sc["gas"],
        "gradient_clipping": sc.get("clip", CLIP),
        # Tiny models: every parameter would sit under DeepSpeed's default persistence threshold
        # (1e5 elements), so stage 3 would shard nothing; tests that want persistence set it.
        "zero_optimization": {"stage": sc["stage"], "stage3_param_persistence_threshold": 0, **sc["zero"]},
        "bf16": {"enabled": sc["dtype"] == "bf16"},
    }
    if sc["optimizer"] == "config":
        config["optimizer"] = {"type": "AdamW", "params": {
            "lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY}}
    return config


def model_loss(model: torch.nn.Module, kind: str, ids: torch.Tensor) -> torch.Tensor:
    if kind == "bert":
        labels = ids[:, 0] % NUM_LABELS
        return model(input_ids=ids, labels=labels).loss
    return model(input_ids=ids, labels=ids).loss


def build_model(sc: dict[str, Any]) -> torch.nn.Module:
    model = BUILDERS[sc["model"]](seed=0)
    if sc["freeze"]:
        freeze_some(model)
    if sc["checkpointing"]:
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    model.train()
    return model


def full_params(engine: Any) -> dict[str, list[float]]:
    with engine.gathered_parameters():
        return {n: p.detach().float().reshape(-1).tolist() for n, p in engine.module.named_parameters()}


def train_engine(sc: dict[str, Any]) -> dict[str, Any]:
    import hf_zero

    model = build_model(sc)
    kwargs: dict[str, Any] = {}
    if sc["optimizer"] == "torch":
        kwargs["optimizer"] = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    engine, _, _, _ = hf_zero.initialize(model=model, config=make_config(sc), **kwargs)
    world, rank, gas, micro = engine.world_size, engine.rank, sc["gas"], sc["micro"]
    losses, comm_per_step, overlap_per_step = [], [], []
    overlapped = getattr(engine.optimizer, "overlapped", None)
    for step in range(sc["steps"]):
        engine.reset_comm_stats()
        batch = batch_for_step(step, world * gas * micro)
        step_losses = []
        for k in range(gas):
            start = (k * world + rank) * micro
            loss = model_loss(engine, sc["model"], batch[start:start + micro].to(engine.device))
            engine.backward(loss)
            engine.step()
            step_losses.append(loss.item())
        losses.append(step_losses)
        comm_per_step.append(engine.comm_stats())
        if overlapped is not None:  # [Note: overlapped offload step]: did a step start in backward?
            first = overlapped.last_first_submit_s
            overlap_per_step.append({"groups": overlapped.overlapped_groups,
                                     "started_in_backward": first is not None and first < engine._last_backward_end_s})
    return {
        "losses": losses,
        "params": full_params(engine),
        "memory": engine.memory_report(),
        "comm_per_step": comm_per_step,
        "overlap_per_step": overlap_per_step if overlapped is not None else None,
        "layout": [{k: g[k] for k in ("unit", "trainable", "persistent", "numel", "padded_numel", "world_size")}
                   for g in engine.layout()],
        "buffer_bytes": sum(b.numel() * b.element_size() for b in engine.module.buffers()),
        "global_steps": engine.global_steps,
        "grad_norm": engine.get_global_grad_norm(),
    }


def run_scenarios(scenarios: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [train_engine(sc) for sc in scenarios]


def train_reference(sc: dict[str, Any], world: int) -> dict[str, Any]:
    """The same training in one process with torch.optim.AdamW on the whole global batch."""
    model = build_model(sc)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    losses, norms = [], []
    for step in range(sc["steps"]):
        batch = batch_for_step(step, world * sc["gas"] * sc["micro"])
        loss = model_loss(model, sc["model"], batch)
        optimizer.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, CLIP)))
        optimizer.step()
        losses.append(loss.item())
    return {
        "losses": losses,
        "grad_norms": norms,
        "params": {n: p.detach().reshape(-1).tolist() for n, p in model.named_parameters()},
    }
