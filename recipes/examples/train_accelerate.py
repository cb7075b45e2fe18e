#!/usr/bin/env python
"""A custom Accelerate training loop on hf_zero's ZeRO engine (causal LM).

The loop is ordinary Accelerate code; the only hf_zero line is the accelerator::

    accelerator = HfZeroAccelerator(gradient_accumulation_steps=2)   # config from HF_ZERO_CONFIG

Run it:

    HF_ZERO_CONFIG=recipes/zero3.json accelerate launch --config_file recipes/accelerate/multi_gpu_2proc.yaml \\
        recipes/examples/train_accelerate.py --model_name_or_path MODEL --output_dir out

    hf-zero launch --config_file recipes/accelerate/zero3_2proc.yaml recipes/examples/train_accelerate.py \\
        --model_name_or_path MODEL --output_dir out

On a machine without GPUs put ``ACCELERATE_USE_CPU=true`` in front of either (without it
Accelerate stops and asks for it), so that the processes join over gloo:

    ACCELERATE_USE_CPU=true HF_ZERO_CONFIG=recipes/zero3.json accelerate launch \\
        --config_file recipes/accelerate/multi_gpu_2proc.yaml recipes/examples/train_accelerate.py \\
        --model_name_or_path MODEL --output_dir out --synthetic_samples 16

``--zero_config z.json`` / ``--zero_stage N`` set the plugin explicitly instead; with no config at
all the same script runs Accelerate's plain DDP. Data: JSON lines with ``input_ids``
(``--train_file``), or ``--synthetic_samples N`` random sequences.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any

import torch
from torch.utils.data import DataLoader

from hf_zero.integrations.accelerate import HfZeroAccelerator, HfZeroPlugin


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_name_or_path", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--zero_config", default=None, help="hf_zero JSON config (default: HF_ZERO_CONFIG)")
    parser.add_argument("--zero_stage", type=int, default=None, help="HfZeroPlugin(zero_stage=...)")
    parser.add_argument("--train_file", default=None)
    parser.add_argument("--synthetic_samples", type=int, default=64)
    parser.add_argument("--eval_samples", type=int, default=7)
    parser.add_argument("--block_size", type=int, default=12)
    parser.add_argument("--per_device_batch_size", type=int, default=2)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--learning_rate", type=float, default=5e-3)
    parser.add_argument("--warmup_steps", type=int, default=2)
    parser.add_argument("--max_steps", type=int, default=6, help="optimizer steps")
    parser.add_argument("--save_state_at", type=int, default=0, help="accelerator.save_state after this step")
    parser.add_argument("--resume_from", default=None, help="a save_state folder to resume from")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu", action="store_true", help="Accelerator(cpu=True): join CPU processes over gloo")
    return parser.parse_args(argv)


def token_data(args: argparse.Namespace, vocab_size: int, samples: int, seed: int) -> list[dict[str, torch.Tensor]]:
    if args.train_file and samples == args.synthetic_samples:
        with open(args.train_file) as f:
            rows = [json.loads(line)["input_ids"] for line in f if line.strip()]
        return [{"input_ids": torch.tensor(r)} for r in rows]
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (samples, args.block_size), generator=generator)
    return [{"input_ids": row} for row in ids]


def build_plugin(args: argparse.Namespace) -> HfZeroPlugin | None:
    """An explicit plugin from the flags; None lets HfZeroAccelerator read HF_ZERO_* itself."""
    if args.zero_config is None and args.zero_stage is None:
        return None
    return HfZeroPlugin(config=args.zero_config, zero_stage=args.zero_stage, gradient_clipping=args.max_grad_norm)


def train(args: argparse.Namespace, plugin: HfZeroPlugin | None = None) -> dict[str, Any]:
    """The whole loop; returns the per-micro-step mean losses and the evaluation summary."""
    from transformers import AutoModelForCausalLM, set_seed

    # step_scheduler_with_optimizer=False + stepping at sync points: one scheduler step per
    # optimizer step, which is what an engine-owned scheduler does under hf_zero (and DeepSpeed).
    accelerator = HfZeroAccelerator(hf_zero_plugin=plugin, gradient_accumulation_steps=args.gradient_accumulation_steps,
                                    step_scheduler_with_optimizer=False, cpu=args.cpu)
    set_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path)
    vocab = model.config.vocab_size
    train_loader = DataLoader(token_data(args, vocab, args.synthetic_samples, 1234), batch_size=args.per_device_batch_size)
    eval_loader = DataLoader(token_data(args, vocab, args.eval_samples, 4321), batch_size=args.per_device_batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.1)
    warmup = max(args.warmup_steps, 1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler)

    start_step = 0
    if args.resume_from:
        accelerator.load_state(args.resume_from)
        start_step = int(json.load(open(os.path.join(args.resume_from, "hf_zero_step.json")))["step"])
    batches = accelerator.skip_first_batches(train_loader, start_step * args.gradient_accumulation_steps)

    losses, norms, step = [], [], start_step
    model.train()
    for batch in batches:
        with accelerator.accumulate(model):
            loss = model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                norms.append(float(norm) if norm is not None else None)
            optimizer.step()
            if accelerator.sync_gradients:
                scheduler.step()
            optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())
        if accelerator.sync_gradients:
            step += 1
            if step == args.save_state_at:
                location = accelerator.save_state(os.path.join(args.output_dir, f"state-{step}"))
                if accelerator.is_main_process:
                    json.dump({"step": step}, open(os.path.join(location, "hf_zero_step.json"), "w"))
            if step >= args.max_steps:
                break

    model.eval()
    per_sample = []
    for batch in eval_loader:
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"]).logits
        token_loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, vocab), batch["input_ids"][:, 1:].reshape(-1), reduction="none")
        per_sample.append(accelerator.gather_for_metrics(token_loss.view(len(batch["input_ids"]), -1).mean(1)))
    eval_losses = torch.cat(per_sample)
    accelerator.save_model(model, os.path.join(args.output_dir, "model"))
    result = {"losses": losses, "grad_norms": norms, "eval_count": len(eval_losses),
              "eval_loss": eval_losses.mean().item(), "lr": scheduler.get_last_lr()[0]}
    accelerator.wait_for_everyone()
    accelerator.free_memory()
    return result


def main() -> None:
    args = parse_args()
    result = train(args, build_plugin(args))
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(result))
        print(f"final loss {result['losses'][-1]:.6f} eval loss {result['eval_loss']:.6f}"
              f" ({result['eval_count']} samples) ppl {math.exp(result['eval_loss']):.2f}")


if __name__ == "__main__":
    main()
