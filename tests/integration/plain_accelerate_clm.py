#!/usr/bin/env python
"""A plain-Accelerate causal-LM fine-tuning script in the style of transformers'
examples/pytorch/language-modeling/run_clm_no_trainer.py, with no hf_zero line in it.

test_plain_accelerate.py runs it unchanged under plain ``accelerate launch`` (DDP) and under
``hf_zero.run`` / ``hf-zero launch`` with a ZeRO config, and compares what it writes.
Like run_clm_no_trainer.py it builds two param groups with a ``no_decay`` list (empty for Llama),
a ``get_scheduler`` schedule whose step counts are multiplied by the number of processes, and
saves with ``unwrap_model(model).save_pretrained(..., state_dict=accelerator.get_state_dict(model))``.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, get_scheduler


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_name_or_path", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--per_device_train_batch_size", type=int, default=2)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--learning_rate", type=float, default=5e-3)
    parser.add_argument("--weight_decay", type=float, default=0.1)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--num_warmup_steps", type=int, default=2)
    parser.add_argument("--max_train_steps", type=int, default=5)
    parser.add_argument("--checkpointing_steps", type=int, default=0)
    parser.add_argument("--resume_from_checkpoint", default=None)
    parser.add_argument("--block_size", type=int, default=12)
    parser.add_argument("--train_samples", type=int, default=40)
    parser.add_argument("--eval_samples", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def token_rows(vocab_size: int, samples: int, block_size: int, seed: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (samples, block_size), generator=generator)
    return [{"input_ids": row, "labels": row} for row in ids]


def main() -> None:
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    set_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path)
    vocab = model.config.vocab_size
    train_dataloader = DataLoader(token_rows(vocab, args.train_samples, args.block_size, 1234), shuffle=True,
                                  batch_size=args.per_device_train_batch_size)
    eval_dataloader = DataLoader(token_rows(vocab, args.eval_samples, args.block_size, 4321),
                                 batch_size=args.per_device_train_batch_size)

    no_decay = ["bias", "layer_norm.weight"]
    optimizer_grouped_parameters = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=args.learning_rate)
    lr_scheduler = get_scheduler(
        name="linear", optimizer=optimizer,
        num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
        num_training_steps=args.max_train_steps * accelerator.num_processes,
    )
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)

    completed_steps, resume_step = 0, 0
    if args.resume_from_checkpoint:
        accelerator.load_state(args.resume_from_checkpoint)
        completed_steps = int(os.path.basename(args.resume_from_checkpoint.rstrip("/")).split("_")[1])
        resume_step = completed_steps * args.gradient_accumulation_steps
    active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step) if resume_step else train_dataloader

    losses, grad_norms, lrs = [], [], []
    model.train()
    for batch in active_dataloader:
        with accelerator.accumulate(model):
            outputs = model(**batch)
            loss = outputs.loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                grad_norms.append(float(accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)))
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())
        if accelerator.sync_gradients:
            completed_steps += 1
            lrs.append(lr_scheduler.get_last_lr()[0])
            if args.checkpointing_steps and completed_steps % args.checkpointing_steps == 0:
                accelerator.save_state(os.path.join(args.output_dir, f"step_{completed_steps}"))
        if completed_steps >= args.max_train_steps:
            break

    model.eval()
    eval_losses = []
    for batch in eval_dataloader:
        with torch.no_grad():
            outputs = model(**batch)
        eval_losses.append(accelerator.gather_for_metrics(outputs.loss.repeat(len(batch["input_ids"]))))
    eval_losses = torch.cat(eval_losses)

    accelerator.wait_for_everyone()
    unwrapped_model = accelerator.unwrap_model(model)
    unwrapped_model.save_pretrained(args.output_dir, is_main_process=accelerator.is_main_process,
                                    save_function=accelerator.save, state_dict=accelerator.get_state_dict(model))
    if accelerator.is_main_process:
        with open(os.path.join(args.output_dir, "all_results.json"), "w") as f:
            json.dump({"losses": losses, "grad_norms": grad_norms, "lrs": lrs, "eval_count": len(eval_losses),
                       "perplexity": math.exp(eval_losses.mean().item()),
                       "accelerator": type(accelerator).__name__, "model": type(model).__name__}, f)
    accelerator.end_training()


if __name__ == "__main__":
    main()
