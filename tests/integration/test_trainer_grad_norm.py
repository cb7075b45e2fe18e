"""The Trainer's logged ``grad_norm`` under hf_zero, against the same step's norm recomputed in fp64.

On a model with tensors of about a million elements, hf_zero's and DDP's logged norms part by
1e-5 relative and more, while their losses agree to 1e-7 (issue 30). The gradients are the same;
the squares are not summed the same way. hf_zero adds them in fp64 ([Note: accurate norms] in
hf_zero.kernels.cpu). The DDP Trainer's norm is torch's ``clip_grad_norm_``, whose CPU kernel
sums each tensor in a few fp32 lanes and comes out low. Here each step's gradient norm is
recomputed in fp64, in this single process, from the full weights the step started from and
the micro-batches of every rank (recorded by the ``grad_norm`` job of trainer_driver.py).
hf_zero's logged norm is within NORM_RTOL of it at stages 2 and 3; DDP's is further off than
that, so the tolerance tells the two summations apart. The figures are in docs/observability.md
("The Trainer's grad_norm beside DDP's").
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.conftest import merge_rank_results, run_launch, torchrun

STEPS = 6
# hf_zero's error is the fp32 gradient's own (its sum of squares is fp64, rounded once to fp32):
# measured, at most 2.3e-7 over these runs. DDP's logged norm is 6.5e-6 to 5.6e-5 below the fp64
# norm on this model (2 CPU cores, torch 2.13), the step-1 figure being the smallest.
NORM_RTOL = 1e-6
# The signal: DDP's largest error must exceed this multiple of NORM_RTOL (56x measured). Only the
# largest is required: how far torch's fp32 lanes fall short depends on the CPU's vector width.
SIGNAL_FACTOR = 10
# name -> (stage, whether the config has an "optimizer" section): without one the engine steps
# the Trainer's torch AdamW over its shards, with one its own fused Adam.
RUNS = {"ddp": None, "z2": (2, False), "z3": (3, False), "z3-adam": (3, True)}


def gpt2_wide_vocab(seed: int = 0) -> torch.nn.Module:
    """tests.tiny_models.tiny_gpt2 with a vocabulary of 65537: the tied embedding / lm_head holds
    983055 elements, on which torch's fp32 CPU norm comes out 6e-6 to 6e-5 low."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=65_537, n_positions=32, n_embd=15, n_layer=2, n_head=3,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
    return GPT2LMHeadModel(config).float()


def _zero_config(path: Path, stage: int, optimizer: bool) -> str:
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "gradient_clipping": "auto", "zero_optimization": {"stage": stage}}
    if optimizer:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                           "weight_decay": "auto"}}
    path.write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module")
def grad_norm_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """DDP and hf_zero stages 2 and 3, each recording its weights and batches, in one launch."""
    root = tmp_path_factory.mktemp("grad_norm")
    model_dir = str(root / "model")
    gpt2_wide_vocab().save_pretrained(model_dir)
    jobs = []
    for name, zero in RUNS.items():
        training_args = dict(
            output_dir=str(root / name), use_cpu=True, report_to="none", per_device_train_batch_size=2,
            gradient_accumulation_steps=2, max_steps=STEPS, logging_steps=1, learning_rate=5e-3,
            weight_decay=0.1, warmup_steps=2, max_grad_norm=1.0, save_strategy="no", seed=0, disable_tqdm=True,
        )
        jobs.append({"name": name, "kind": "grad_norm", "model_dir": model_dir, "train_samples": 48,
                     "zero_config": None if zero is None else _zero_config(root / f"{name}.json", *zero),
                     "training_args": training_args, "record_dir": str(root / f"{name}-record")})
    plan = {"jobs": jobs, "out": str(root / "results.json")}
    (root / "plan.json").write_text(json.dumps(plan))
    run_launch(torchrun("-m", "hf_zero.run", "-m", "tests.integration.trainer_driver", str(root / "plan.json")))
    runs = merge_rank_results(plan["out"], world_size=2)
    for name, run in runs.items():
        if "error" in run:
            pytest.fail(f"job {name} raised on rank {run['rank']}:\n{run['error']}")
    model = gpt2_wide_vocab().double()
    return {name: {**run, "fp64": fp64_norms(model, run["record_dir"])} for name, run in runs.items()}


def fp64_grad_norm(model: torch.nn.Module, weights: dict[str, torch.Tensor], step_batches: list[list[dict]]) -> float:
    """The global gradient norm of one optimizer step, all in fp64 in this one process.

    The objective is the Trainer's for a causal LM with ``average_tokens_across_devices``: the
    summed token cross-entropy of every micro-batch of every rank, over the ``num_items_in_batch``
    the Trainer counted for the step (the same on every rank; for GPT-2 it counts all label
    positions, 12 per row, though 11 are predicted). DDP's average over ranks undoes the
    Trainer's ``* num_processes``. ``model`` is an fp64 copy of the architecture; ``weights``
    are loaded into it.
    """
    import torch.nn.functional as F

    model.load_state_dict(weights)
    model.zero_grad(set_to_none=True)
    micro_batches = [batch for rank_batches in step_batches for batch in rank_batches]
    divisors = {batch["num_items_in_batch"] for batch in micro_batches}
    assert len(divisors) == 1 and None not in divisors, divisors  # one count for the whole step
    count = divisors.pop()
    for batch in micro_batches:
        logits = model(input_ids=torch.tensor(batch["input_ids"]),
                       attention_mask=torch.tensor(batch["attention_mask"])).logits[:, :-1]
        shifted = torch.tensor(batch["labels"])[:, 1:]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shifted.reshape(-1), ignore_index=-100,
                               reduction="sum") / count
        loss.backward()
    return math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters() if p.grad is not None))


def fp64_norms(model: torch.nn.Module, record_dir: str) -> list[float]:
    with open(os.path.join(record_dir, "batches.json")) as f:
        batches = json.load(f)
    norms = []
    for step, step_batches in enumerate(batches, start=1):
        weights = torch.load(os.path.join(record_dir, f"step{step}.pt"), weights_only=True)
        norms.append(fp64_grad_norm(model, weights, step_batches))
    return norms


def _relative_errors(run: dict[str, Any]) -> list[float]:
    return [(logged - exact) / exact for logged, exact in zip(run["grad_norm"], run["fp64"], strict=True)]


@pytest.mark.parametrize("name", ["z2", "z3", "z3-adam"])
def test_logged_grad_norm_equals_the_fp64_norm(grad_norm_runs: dict[str, Any], name: str) -> None:
    """Every step's logged ``grad_norm`` within NORM_RTOL of the fp64 recomputation."""
    run = grad_norm_runs[name]
    assert run["step"] == list(range(1, STEPS + 1)) and len(run["fp64"]) == STEPS
    errors = _relative_errors(run)
    assert max(abs(e) for e in errors) <= NORM_RTOL, (name, errors, run["grad_norm"], run["fp64"])


def test_ddp_norm_is_further_off_than_the_tolerance(grad_norm_runs: dict[str, Any]) -> None:
    """The signal: DDP's logged norm (torch's fp32 ``clip_grad_norm_``) is below the fp64 norm at
    every step, and by more than SIGNAL_FACTOR x NORM_RTOL at its worst, while the hf_zero runs
    train the same (losses within 1e-6). Should torch's CPU norm become accurate, this fails:
    then update the figures in docs/observability.md."""
    ddp = grad_norm_runs["ddp"]
    errors = _relative_errors(ddp)
    assert all(e < -NORM_RTOL for e in errors) and min(errors) < -SIGNAL_FACTOR * NORM_RTOL, errors
    for name in ("z2", "z3"):
        zero = grad_norm_runs[name]
        assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(zero["loss"], ddp["loss"], strict=True))


def test_a_trainer_step_makes_no_host_synchronisation_of_hf_zeros(grad_norm_runs: dict[str, Any]) -> None:
    """From the third optimizer step on, the Trainer's step under hf_zero with the config's Adam
    (two micro-batches, the clipping, the step, ``optimizer_step_was_skipped``, the learning
    rate) waits for no device value from hf_zero's frames ([Note: a step the host does not wait
    for]); the logged norm is read by the Trainer's log, after the step. With the Trainer's own
    torch AdamW stepped over the shards, the host reads the norm and the inf/nan flag before the
    step, once, as it must to hand a torch optimizer its clip coefficient and to skip a step.
    Step 1 builds state; step 2 is the first whose predecessor's outcome is pending."""
    fused = grad_norm_runs["z3-adam"]["host_syncs"]
    assert len(fused) == STEPS, fused
    assert fused[2:] == [{}] * (STEPS - 2), fused
    for name in ("z2", "z3"):
        per_step = grad_norm_runs[name]["host_syncs"]
        read_terms = [{place: 1} for found in per_step[2:] for place in found
                      if place.startswith("tolist at hf_zero/engine/optim/step_pipeline.py:")]  # StepPipeline.read_terms
        assert len(per_step) == STEPS and per_step[2:] == read_terms, (name, per_step)

