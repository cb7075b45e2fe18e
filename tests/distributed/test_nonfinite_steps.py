"""Non-finite gradients in fp32/bf16 ([Note: non-finite steps]): on a real gloo group, an inf
injected on rank 1 only, into the backward of the first block (so in the overlapped offload step
the later groups were already stepped when it arrives), drops that step on every rank; the run
then goes on, without zero_grad(), bit for bit like a run that never saw that batch: parameters,
masters, moments, step counts and the learning rate schedule."""

from __future__ import annotations

import hashlib
import os
import tempfile
from typing import Any

import pytest
import torch

from tests.distributed import scenarios as S
from tests.distributed.launch import run_distributed
from tests.tiny_models import batch_for_step

BAD_STEP, STEPS = 2, 5
SCHEDULER = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 10}}
NVME_DIR = os.path.join(tempfile.gettempdir(), "hf_zero_test_nvme_nonfinite")
SMALL_BUCKETS = {"reduce_bucket_size": 2000}  # several groups per backward: the worker steps some early


def _offload(device: str, stage: int, **zero: Any) -> dict[str, Any]:
    offload = {"device": device, **({"nvme_path": NVME_DIR} if device == "nvme" else {})}
    return S.scenario("gpt2", stage, 1, clip=0.0, zero={"offload_optimizer": offload, **SMALL_BUCKETS, **zero})


CASES: dict[str, dict[str, Any]] = {
    "fp32_s2_raises": S.scenario("gpt2", 2, 1),
    "bf16_s3_skips": S.scenario("gpt2", 3, 1, dtype="bf16", bf16_skip=True),
    "bf16_s1_raises": S.scenario("gpt2", 1, 1, dtype="bf16"),
    "cpu_overlapped_s2_raises": _offload("cpu", 2),
    "nvme_overlapped_s3_skips": dict(_offload("nvme", 3, sub_group_size=1000), dtype="bf16", bf16_skip=True),
}


class _InfGrad(torch.autograd.Function):
    """Identity forward; the gradient flowing back through it becomes inf."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("inf")


def _poison_first_block(module: torch.nn.Module, inputs: Any, output: Any) -> Any:
    if isinstance(output, tuple):
        return (_InfGrad.apply(output[0]),) + output[1:]
    return _InfGrad.apply(output)


def _engine(sc: dict[str, Any]) -> Any:
    import hf_zero

    config = dict(S.make_config(sc), scheduler=SCHEDULER)
    if sc.get("bf16_skip"):
        config["bf16"] = dict(config["bf16"], check_grad_overflow=True)
    engine, *_ = hf_zero.initialize(model=S.build_model(sc), config=config)
    return engine


def _digest(engine: Any) -> str:
    """This rank's state bit for bit: compute shards, masters, moments (in memory or NVMe files), step counts."""
    digest = hashlib.sha256()

    def add(tensor: torch.Tensor) -> None:
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())

    nvme = engine.optimizer.nvme
    for unit in engine.units:
        for group in unit.groups:
            add(group.storage.shard)
            if nvme is not None and group.master_state.nvme_index is not None:
                for state in ("master", "exp_avg", "exp_avg_sq"):
                    for tile in nvme.iter_tiles(group.master_state.nvme_index, state):
                        add(tile)
                digest.update(str(nvme.steps[group.master_state.nvme_index]).encode())
                continue
            if group.master_state.tensor is not None:
                add(group.master_state.tensor)
                for key, value in sorted(engine.optimizer.inner.state.get(group.master_state.tensor, {}).items()):
                    add(value) if isinstance(value, torch.Tensor) else digest.update(f"{key}={value}".encode())
    return digest.hexdigest()


def _run(sc: dict[str, Any], bad_step: int | None) -> dict[str, Any]:
    engine = _engine(sc)
    errors, error_steps, applied, skipped = [], [], [], []
    digest_before_bad, digest_after_bad, lr_before_bad, lr_after_bad = None, None, None, None
    for step in range(STEPS):
        if step == bad_step:
            digest_before_bad, lr_before_bad = _digest(engine), engine.get_lr()
        elif bad_step is None and step == BAD_STEP:
            continue  # the reference never sees this batch
        hook = None
        if step == bad_step and engine.rank == 1:
            hook = engine.module.transformer.h[0].register_forward_hook(_poison_first_block)
        ids = batch_for_step(step, 4)[engine.rank * 2:(engine.rank + 1) * 2]
        engine.backward(S.model_loss(engine, "gpt2", ids))
        try:
            engine.step()
        except FloatingPointError as error:
            errors.append(str(error))
            error_steps.append(step)
        if hook is not None:
            hook.remove()
        # Read as a user reads it; it also reads the outcome of a step taken on the device
        # ([Note: a step the host does not wait for]) before the digest looks at the host's records.
        skipped.append(engine.optimizer.skipped)  # what Accelerate's optimizer_step_was_skipped asks
        applied.append(engine.was_step_applied())
        if step == bad_step:
            digest_after_bad, lr_after_bad = _digest(engine), engine.get_lr()
    return {
        "errors": errors, "error_steps": error_steps, "applied": applied, "skipped_flags": skipped,
        "digest": _digest(engine), "lr": engine.get_lr(), "skipped": engine.skipped_steps,
        "unchanged_by_bad_step": digest_before_bad == digest_after_bad and lr_before_bad == lr_after_bad,
        "params": hashlib.sha256(repr(S.full_params(engine)).encode()).hexdigest(),
    }


def _worker() -> dict[str, Any]:
    os.makedirs(NVME_DIR, exist_ok=True)
    return {name: {"bad": _run(sc, BAD_STEP), "reference": _run(sc, None)} for name, sc in CASES.items()}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(_worker, 2)


@pytest.mark.parametrize("name", list(CASES))
def test_a_non_finite_step_changes_nothing_and_the_run_goes_on_as_without_that_batch(results, name):
    for rank, per_rank in enumerate(results):
        bad, reference = per_rank[name]["bad"], per_rank[name]["reference"]
        assert bad["unchanged_by_bad_step"], f"rank {rank}: the bad step changed the state"
        assert bad["digest"] == reference["digest"], f"rank {rank}: the run diverged from the one without the batch"
        assert bad["params"] == reference["params"]
        assert bad["lr"] == reference["lr"]  # the scheduler did not step for the dropped step
        assert reference["errors"] == [] and reference["skipped"] == 0


@pytest.mark.parametrize("name", list(CASES))
def test_raises_or_skips_as_configured_on_every_rank(results, name):
    skips = bool(CASES[name].get("bf16_skip"))
    # The host learns the outcome of a step taken on the device after it (here, from
    # was_step_applied right after it); the error comes from the next step, which was taken.
    on_device = "overlapped" not in name
    for per_rank in results:
        bad = per_rank[name]["bad"]
        assert len(bad["errors"]) == (0 if skips else 1)
        assert bad["skipped"] == (1 if skips else 0)
        assert bad["applied"] == [step != BAD_STEP for step in range(STEPS)]
        # a skip is a skip; under the raise policy the error reports the dropped step instead
        assert bad["skipped_flags"] == [skips and step == BAD_STEP for step in range(STEPS)]
        if not skips:
            assert bad["error_steps"] == [BAD_STEP + 1 if on_device else BAD_STEP]
            assert ("an earlier step" in bad["errors"][0]) == on_device


def test_the_error_does_not_suggest_clipping_when_clipping_is_on(results):
    with_clipping = results[0]["fp32_s2_raises"]["bad"]["errors"][0]
    assert "non-finite gradients" in with_clipping and "nothing" not in with_clipping
    assert f"gradient_clipping ({S.CLIP:g}) cannot help" in with_clipping and "enable" not in with_clipping
    without_clipping = results[0]["cpu_overlapped_s2_raises"]["bad"]["errors"][0]
    assert "unchanged on every rank" in without_clipping
