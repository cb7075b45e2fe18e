"""Training scenarios run on every rank of a real gloo group, and their single-process reference.

A scenario trains a tiny model for a few optimizer steps through ``hf_zero.initialize`` and
returns what the tests compare: the loss of every micro-step, the full parameters at the end,
``memory_report()``, ``comm_stats()`` per optimizer step and the flat layout.
"""

from __future__ import annotations

import copy
import functools
import json
import math
from typing import Any

import torch

from tests.tiny_models import SCENARIO_BUILDERS, freeze_some, learnable_batch

# [Note: parity signal]
# On the learnable batches (tests/tiny_models.learnable_batch), 6 steps at lr 2e-2 take the
# reference loss of the causal LMs from 4.57 to about 3.0 (BERT's classification loss: 1.10 to
# about 1.0) and move parameters by up to 0.12; every tolerance below is set against that signal.
# The tiny models' pre-clip gradient norms stay between 0.18 and 2.1 over those steps, so a clip
# value of 0.1 engages at every step of every scenario (the tests check it on the reference).
LR = 2e-2
BETAS = (0.9, 0.95)
EPS = 1e-8
WEIGHT_DECAY = 0.1
CLIP = 0.1
STEPS = 6
NUM_LABELS = 3
CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s and DeepSpeed's
# fp16 parity: the tiny models' scaled gradients overflow from a scale of about 2^17-2^18, where
# a rounding difference could flip the skip decision between the engine and the reference; from
# 2^12, growing every 2 clean steps, 6 steps reach 2^14 and never overflow, while the scale still
# moves as DeepSpeed moves it. Skipped steps are tested with a scale that overflows for sure
# (test_engine_api.py).
FP16 = {"initial_scale_power": 12, "loss_scale_window": 2, "hysteresis": 2, "min_loss_scale": 1}
LOW_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}


def scenario(model: str, stage: int, gas: int = 1, **overrides: Any) -> dict[str, Any]:
    base = dict(model=model, stage=stage, gas=gas, dtype="fp32", freeze=False, steps=STEPS, micro=2,
                checkpointing=False, zero={}, optimizer="config")
    base.update(overrides)
    if base["dtype"] == "fp16":
        base.setdefault("fp16", dict(FP16))
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
    if sc["dtype"] == "fp16":
        config["fp16"] = {"enabled": True, **sc["fp16"]}
    if sc["optimizer"] == "config":
        config["optimizer"] = {"type": "AdamW", "params": {
            "lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY}}
    config.update(sc.get("sections", {}))  # other top-level sections (aio, ...)
    return config


def model_loss(model: torch.nn.Module, kind: str, ids: torch.Tensor) -> torch.Tensor:
    if kind == "bert":
        labels = ids[:, 0] % NUM_LABELS
        return model(input_ids=ids, labels=labels).loss
    return model(input_ids=ids, labels=ids).loss


def stage3_llama_after_a_step() -> Any:
    """A stage-3 Llama engine after one step with nothing kept gathered: every parameter of a
    non-root unit is sharded (what reads outside the forward meet)."""
    import hf_zero

    sc = scenario("llama", 3)
    config = make_config(sc)
    config["zero_optimization"]["stage3_max_reuse_distance"] = 0  # nothing kept after forward
    engine, _, _, _ = hf_zero.initialize(model=build_model(sc), config=config)
    engine.backward(model_loss(engine, "llama", torch.randint(0, 97, (2, 12))))
    engine.step()
    return engine


def build_model(sc: dict[str, Any]) -> torch.nn.Module:
    model = SCENARIO_BUILDERS[sc["model"]](seed=0)
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
    losses, comm_per_step, overlap_per_step, loss_scales, applied = [], [], [], [], []
    overlapped = getattr(engine.optimizer, "overlapped", None)
    for step in range(sc["steps"]):
        engine.reset_comm_stats()
        batch = learnable_batch(step, world * gas * micro)
        step_losses = []
        for k in range(gas):
            start = (k * world + rank) * micro
            loss = model_loss(engine, sc["model"], batch[start:start + micro].to(engine.device))
            engine.backward(loss)
            engine.step()
            step_losses.append(loss.item())
        losses.append(step_losses)
        loss_scales.append(engine.loss_scale)  # the scale the next step will use
        applied.append(engine.was_step_applied())
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
        "layout": [{**{k: g[k] for k in ("unit", "trainable", "persistent", "numel", "padded_numel", "world_size")},
                    "params": len(g["slots"])} for g in engine.layout()],
        "buffer_bytes": sum(b.numel() * b.element_size() for b in engine.module.buffers()),
        "global_steps": engine.global_steps,
        "grad_norm": engine.get_global_grad_norm(),
        "loss_scales": loss_scales,
        "applied": applied,
    }


def run_scenarios(scenarios: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [train_engine(sc) for sc in scenarios]


# What the reference depends on: not the stage, the ZeRO options or activation checkpointing,
# which must not change the result; scenarios that differ only there share one reference run.
REFERENCE_KEYS = ("model", "gas", "micro", "steps", "dtype", "freeze", "clip", "fp16")


def train_reference(sc: dict[str, Any], world: int, device: str = "cpu") -> dict[str, Any]:
    """The same training in one process with torch.optim.AdamW: on the whole global batch in
    fp32, or as data parallelism computes it in bf16/fp16 (see train_low_precision_reference),
    on ``device``. The result is shared between callers: read it, do not change it."""
    return _cached_reference(json.dumps({k: sc.get(k) for k in REFERENCE_KEYS}, sort_keys=True), world, device)


@functools.lru_cache(maxsize=None)
def _cached_reference(key: str, world: int, device: str) -> dict[str, Any]:
    sc = scenario(stage=0, **{k: v for k, v in json.loads(key).items() if v is not None})
    if sc["dtype"] in LOW_PRECISION:
        return train_low_precision_reference(sc, world, device)
    return train_fp32_reference(sc, world, device)


def train_fp32_reference(sc: dict[str, Any], world: int, device: str = "cpu") -> dict[str, Any]:
    """fp32: the whole global batch at once, torch's clip_grad_norm_ and AdamW."""
    model = build_model(sc).to(device)
    initial = named_flat_params(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    losses, norms = [], []
    for step in range(sc["steps"]):
        batch = learnable_batch(step, world * sc["gas"] * sc["micro"]).to(device)
        loss = model_loss(model, sc["model"], batch)
        optimizer.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip_value(sc))))
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "grad_norms": norms, "initial": initial, "params": named_flat_params(model)}


def update_error(params: dict[str, list[float]], reference: dict[str, Any], names: list[str]) -> float:
    """|engine update - reference update| / |reference update| over the parameters ``names``,
    both updates from the reference's initial (compute-dtype) values: 1.0 for an engine that
    never updates them, whatever their scale."""
    def flat(values: dict[str, list[float]]) -> torch.Tensor:
        return torch.cat([torch.tensor(values[n], dtype=torch.float64) for n in names])

    initial = flat(reference["initial"])
    expected = flat(reference["params"]) - initial
    return float((flat(params) - initial - expected).norm() / expected.norm())


def clip_value(sc: dict[str, Any]) -> float:
    """The scenario's max gradient norm; 0 turns clipping off (DeepSpeed's gradient_clipping)."""
    clip = sc.get("clip", CLIP)
    return clip if clip > 0 else math.inf


def named_flat_params(model: torch.nn.Module) -> dict[str, list[float]]:
    return {n: p.detach().float().reshape(-1).tolist() for n, p in model.named_parameters()}


class DeepSpeedDynamicLossScale:
    """DeepSpeed's dynamic fp16 loss scale (``DynamicLossScaler.update_scale`` with
    ``consecutive_hysteresis`` false), written out here from its definition so the engine's own
    scaler is not its own reference: an overflow cuts the scale by 2 once the hysteresis is
    spent (else spends one unit of it); the scale doubles, and the hysteresis refills, on a clean
    step preceded by a multiple of ``loss_scale_window`` clean steps since the last overflow."""

    def __init__(self, initial_scale_power: int, loss_scale_window: int, hysteresis: int,
                 min_loss_scale: float) -> None:
        self.scale = 2.0 ** initial_scale_power
        self.window, self.hysteresis, self.min_scale = loss_scale_window, hysteresis, min_loss_scale
        self.hysteresis_left = hysteresis
        self.iteration, self.last_overflow = 0, -1

    def update(self, overflow: bool) -> None:
        if overflow:
            if self.hysteresis == 1 or self.hysteresis_left == 1:
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow = self.iteration
        else:
            clean_before = self.iteration - self.last_overflow - 1
            if clean_before > 0 and clean_before % self.window == 0:
                self.scale *= 2
                self.hysteresis_left = self.hysteresis
        self.iteration += 1


def train_low_precision_reference(sc: dict[str, Any], world: int, device: str = "cpu") -> dict[str, Any]:
    """bf16/fp16 mixed precision as data parallelism does it, in one process: a bf16/fp16 copy
    of the model computes each rank's micro-batch loss and gradients (``loss / gas * scale``);
    they are averaged over ranks and summed over micro-steps in fp32; then unscale, clip by the
    global norm, fp32 torch.optim.AdamW on fp32 master weights, and the new master rounded into
    the compute copy. fp16 skips a step whose gradients overflow, as DeepSpeed does."""
    dtype = LOW_PRECISION[sc["dtype"]]
    master = build_model(sc).to(device)
    compute = copy.deepcopy(master).to(dtype)
    initial = named_flat_params(compute)
    master_params = {n: p for n, p in master.named_parameters() if p.requires_grad}
    compute_params = dict(compute.named_parameters())
    optimizer = torch.optim.AdamW(master_params.values(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    scaler = DeepSpeedDynamicLossScale(**sc["fp16"]) if sc["dtype"] == "fp16" else None
    gas, micro = sc["gas"], sc["micro"]
    losses, norms, loss_scales, applied = [], [], [], []
    for step in range(sc["steps"]):
        scale = scaler.scale if scaler is not None else 1.0
        batch = learnable_batch(step, world * gas * micro).to(device)
        grads = {n: torch.zeros_like(p) for n, p in master_params.items()}
        step_loss = 0.0
        for k in range(gas):
            for rank in range(world):
                start = (k * world + rank) * micro
                loss = model_loss(compute, sc["model"], batch[start:start + micro])
                compute.zero_grad(set_to_none=True)
                scaled = loss / gas if gas > 1 else loss
                (scaled * scale if scale != 1.0 else scaled).backward()
                for n, g in grads.items():
                    if compute_params[n].grad is not None:
                        g.add_(compute_params[n].grad.float() / world)
                step_loss += loss.item()
        losses.append(step_loss / (world * gas))
        overflow = not all(bool(torch.isfinite(g).all()) for g in grads.values())
        applied.append(not overflow)
        if overflow:  # skipped: master, moments and the step count stay as they were
            norms.append(math.inf)
        else:
            norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values())) / scale
            norms.append(norm)
            coef = min(1.0, clip_value(sc) / (norm + CLIP_EPS))
            for n, p in master_params.items():
                p.grad = grads[n] * (coef / scale)
            optimizer.step()
            with torch.no_grad():
                for n, p in master_params.items():
                    compute_params[n].copy_(p)
        if scaler is not None:
            scaler.update(overflow)
            loss_scales.append(scaler.scale)
    return {"losses": losses, "grad_norms": norms, "initial": initial, "params": named_flat_params(compute),
            "loss_scales": loss_scales, "applied": applied}


# torch.optim.Muon runs its Newton-Schulz iteration in bf16, which turns the fp32 rounding of a
# different gradient reduction order (1e-7 relative, as any data-parallel run has, DDP
# included) into parameter differences of 1.2e-3 after 3 steps. Parity tests swap in the
# same iteration in fp32 on both sides (its sensitivity to that rounding: 6e-7), so 1e-5 checks
# the distributed step itself: ownership, gathers, the update and its all-reduce.
def fp32_newton_schulz(grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int,
                        eps: float) -> torch.Tensor:
    a, b, c = ns_coefficients
    wide = grad.size(0) > grad.size(1)
    x = grad.float().T if wide else grad.float()
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if wide else x


def use_fp32_newton_schulz() -> Any:
    """Install the fp32 iteration; returns torch's, to put back."""
    import torch.optim._muon

    torchs = torch.optim._muon._zeropower_via_newtonschulz
    torch.optim._muon._zeropower_via_newtonschulz = fp32_newton_schulz
    return torchs
