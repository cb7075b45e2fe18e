"""[Note: edge units] and [Note: parameters read without their module]: an untied output
projection is a stage-3 unit of its own (gathered for its forward and its backward, freed
between and after), and a fused loss that reads ``lm_head.weight`` inside the model's forward
without calling ``lm_head`` gathers it on that read. 2 gloo ranks, tiny Llama (untied head),
against the same model trained by single-process AdamW. One spawn runs every case, each in a
fresh process group of its own (``launch.in_group``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed import scenarios as S
from tests.distributed.launch import in_group, run_distributed

STEPS = 3
REUSE_DISTANCES = (0, 1e9)
PREFETCHES = (None, 0)


def _fused_llama():
    """The tiny Llama whose forward computes the loss from ``lm_head.weight`` directly, as Liger's
    fused linear cross-entropy and TRL's fused LM head do: ``lm_head`` itself is never called."""
    from transformers import LlamaForCausalLM
    from transformers.modeling_outputs import CausalLMOutputWithPast

    class FusedHeadLlama(LlamaForCausalLM):
        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, **kwargs: Any) -> Any:
            hidden = self.model(input_ids=input_ids).last_hidden_state
            logits = torch.nn.functional.linear(hidden, self.lm_head.weight)
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1))
            return CausalLMOutputWithPast(loss=loss)

    model = S.build_model(S.scenario("llama", 3))
    model.__class__ = FusedHeadLlama
    return model


def _train(fused: bool, reuse_distance: float) -> dict[str, Any]:
    import hf_zero

    sc = S.scenario("llama", 3, steps=STEPS)
    config = S.make_config(sc)
    config["zero_optimization"]["stage3_max_reuse_distance"] = reuse_distance
    config["zero_optimization"]["stage3_prefetch_bucket_size"] = 0  # each unit gathered where it runs
    model = _fused_llama() if fused else S.build_model(sc)
    engine, _, _, _ = hf_zero.initialize(model=model, config=config)
    head = next(u for u in engine.units if u.module is engine.module.lm_head)
    root = engine.units[-1]
    seen: dict[str, Any] = {}

    def layer0_starts(module: torch.nn.Module, args: Any) -> None:
        seen.setdefault("head gathered during layer 0's forward", head.is_unsharded)

    def layer0_done(module: torch.nn.Module, args: Any, output: Any) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        def reached(grad: torch.Tensor) -> None:  # once layer 1's backward is done
            seen.setdefault("head gathered in the layers' backward", head.is_unsharded)

        if hidden.requires_grad:
            hidden.register_hook(reached)

    engine.module.model.layers[0].register_forward_pre_hook(layer0_starts)
    engine.module.model.layers[0].register_forward_hook(layer0_done)
    losses = []
    for step in range(STEPS):  # the reference's global batch, this rank's part of it
        batch = S.learnable_batch(step, engine.world_size * sc["micro"])
        ids = batch[engine.rank * sc["micro"]:(engine.rank + 1) * sc["micro"]]
        loss = S.model_loss(engine, "llama", ids)
        seen.setdefault("head gathered after the forward", head.is_unsharded)
        engine.backward(loss)
        seen.setdefault("head gathered after the backward", head.is_unsharded)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "params": S.full_params(engine), "seen": seen,
            "units": [u.name for u in engine.units],
            "root_params": [name for group in root.groups for name in (s.name for s in group.layout.slots)]}


def _every_case() -> dict[str, Any]:
    """Every case of this file on one spawn, each in a fresh 2-rank group."""
    cases = [(f"train-{fused}-{reuse}", lambda _, f=fused, r=reuse: _train(f, r))
             for reuse in REUSE_DISTANCES for fused in (False, True)]
    cases += [(f"dpo-{prefetch}", lambda _, p=prefetch: _train_dpo_shaped(p)) for prefetch in PREFETCHES]
    return {name: in_group(2, phase, "") for name, phase in cases}


@pytest.fixture(scope="module")
def runs() -> dict[str, list[Any]]:
    """Each case's per-rank results."""
    ranks = run_distributed(_every_case, 2)
    return {name: [rank[name] for rank in ranks] for name in ranks[0]}


@pytest.mark.parametrize("reuse_distance", REUSE_DISTANCES)
def test_the_head_is_a_unit_and_a_fused_loss_that_reads_its_weight_trains_like_adamw(runs, reuse_distance):
    reference = S.train_reference(S.scenario("llama", 3, steps=STEPS), world=2)
    for fused in (False, True):
        ranks = runs[f"train-{fused}-{reuse_distance}"]
        mean_losses = [sum(step) / len(ranks) for step in zip(*(r["losses"] for r in ranks))]
        assert mean_losses == pytest.approx(reference["losses"], abs=1e-5), (fused, reuse_distance)
        for rank in ranks:
            assert rank["units"][-2:] == ["lm_head", "<root>"]  # its own unit, last before the root
            assert rank["root_params"] == ["model.norm.weight"]
            assert rank["seen"]["head gathered during layer 0's forward"] is False  # not held by the root
            assert rank["seen"]["head gathered in the layers' backward"] is False  # freed after its own
            assert rank["seen"]["head gathered after the backward"] is False
            for name, values in reference["params"].items():
                error = max(abs(a - b) for a, b in zip(rank["params"][name], values, strict=True))
                assert error <= 1e-5, (fused, reuse_distance, name, error)


class _RecomputingLinear(torch.autograd.Function):
    """``hidden @ weight.T`` whose backward reads the weight again, as TRL's chunked log-prob
    recomputes its tiles from ``lm_head.weight`` in the backward."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(hidden, weight)
        return hidden @ weight.t()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, weight = ctx.saved_tensors
        return grad @ weight, grad.flatten(0, -2).t() @ hidden.flatten(0, -2)


def _recomputing_llama():
    from transformers import LlamaForCausalLM
    from transformers.modeling_outputs import CausalLMOutputWithPast

    class RecomputingHeadLlama(LlamaForCausalLM):
        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, **kwargs: Any) -> Any:
            hidden = self.model(input_ids=input_ids).last_hidden_state
            logits = _RecomputingLinear.apply(hidden, self.lm_head.weight)
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
            return CausalLMOutputWithPast(loss=loss)

    model = S.build_model(S.scenario("llama", 3))
    model.__class__ = RecomputingHeadLlama
    return model


def _dpo_shaped_steps(model: torch.nn.Module, step_loss: Any, rank: int, world: int, micro: int) -> list[float]:
    """Per step, as DPOTrainer with a shared reference runs one: a forward with autograd on the
    first half of this rank's rows, a forward without autograd (the reference), a forward with
    autograd on the second half, and one backward of the sum."""
    losses = []
    for step in range(STEPS):
        batch = S.learnable_batch(step, 2 * world * micro)
        halves = [batch[(2 * rank + k) * micro:(2 * rank + k + 1) * micro] for k in range(2)]
        first = model(input_ids=halves[0], labels=halves[0]).loss
        with torch.no_grad():
            model(input_ids=halves[0], labels=halves[0])
        second = model(input_ids=halves[1], labels=halves[1]).loss
        losses.append(step_loss(first + second))
    return losses


def _train_dpo_shaped(prefetch: int | None) -> dict[str, Any]:
    import hf_zero

    sc = S.scenario("llama", 3, steps=STEPS)
    config = S.make_config(sc)
    if prefetch is not None:
        config["zero_optimization"]["stage3_prefetch_bucket_size"] = prefetch
    engine, _, _, _ = hf_zero.initialize(model=_recomputing_llama(), config=config)

    def step_loss(loss: torch.Tensor) -> float:
        engine.backward(loss)
        engine.step()
        return loss.item()

    losses = _dpo_shaped_steps(engine, step_loss, engine.rank, engine.world_size, sc["micro"])
    return {"losses": losses, "params": S.full_params(engine)}


def _reference_dpo_shaped(world: int) -> dict[str, Any]:
    """One process: each rank's two halves summed, averaged over the ranks (what averaging the
    ranks' gradients gives), clipped, AdamW."""
    sc = S.scenario("llama", 3, steps=STEPS)
    model = _recomputing_llama()
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=S.LR, betas=S.BETAS, eps=S.EPS, weight_decay=S.WEIGHT_DECAY)
    losses: list[list[float]] = [[] for _ in range(world)]
    for step in range(STEPS):
        optimizer.zero_grad()
        batch = S.learnable_batch(step, 2 * world * sc["micro"])
        halves = batch.split(sc["micro"])  # rank r's halves are rows 2r and 2r+1 of these
        for rank in range(world):
            loss = sum(model(input_ids=h, labels=h).loss for h in halves[2 * rank:2 * rank + 2])
            (loss / world).backward()
            losses[rank].append(loss.item())
        torch.nn.utils.clip_grad_norm_(params, S.clip_value(sc))
        optimizer.step()
    return {"losses": losses, "params": S.named_flat_params(model)}


@pytest.mark.parametrize("prefetch", PREFETCHES)
def test_a_loss_whose_backward_reads_the_head_again_trains_like_adamw_across_two_forwards(runs, prefetch):
    """Two forwards with autograd and a reference pass without it before one backward, with a
    loss whose backward reads ``lm_head.weight`` again after the backward has passed the head
    ([Note: parameters read without their module]). With the default prefetch the head's gather
    is still in flight when the loss reads it: under late completion (this folder's mode) a read
    that did not wait would see poison."""
    reference = _reference_dpo_shaped(world=2)
    ranks = runs[f"dpo-{prefetch}"]
    for rank, result in enumerate(ranks):
        assert result["losses"] == pytest.approx(reference["losses"][rank], abs=1e-5), prefetch
        for name, values in reference["params"].items():
            error = max(abs(a - b) for a, b in zip(result["params"][name], values, strict=True))
            assert error <= 1e-5, (prefetch, name, error)
