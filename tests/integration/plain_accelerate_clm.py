#!/usr/bin/env python
"""A plain-Accelerate causal-LM fine-tuning script that follows transformers'
examples/pytorch/language-modeling/run_clm_no_trainer.py step by step, with no hf_zero line in it.

test_plain_accelerate.py runs it unchanged under plain ``accelerate launch`` (DDP) and under
``hf_zero.run`` / ``hf-zero launch`` with a ZeRO config, and compares what it writes.
As run_clm_no_trainer.py it loads the config, the tokenizer and the model (resizing the
embeddings when the tokenizer is longer), builds two param groups with a ``no_decay`` list
(empty for Llama), a ``get_scheduler`` schedule whose step counts are multiplied by the number of
processes, prepares everything in one call, resumes from ``step_N`` / ``epoch_N`` folders, trains
under ``accelerator.accumulate`` with no clipping, evaluates the perplexity each epoch with
``gather_for_metrics``, and ends with its published save, on every rank::

    accelerator.wait_for_everyone()
    unwrapped_model = accelerator.unwrap_model(model)
    unwrapped_model.save_pretrained(args.output_dir, is_main_process=accelerator.is_main_process,
                                    save_function=accelerator.save)

What differs: the data are synthetic token rows instead of a tokenized dataset (no hub access),
and lines marked ``# test:`` record what the test compares (per-step losses and learning rates;
the gradient norms of ``clip_grad_norm_``, which the published script does not call, only when
``--max_grad_norm`` is given; the weights ``accelerator.get_state_dict`` returns, after the
published save).
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
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, default_data_collator, get_scheduler


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_name_or_path", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--per_device_train_batch_size", type=int, default=2)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=2)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--learning_rate", type=float, default=5e-3)
    parser.add_argument("--weight_decay", type=float, default=0.1)
    parser.add_argument("--num_train_epochs", type=int, default=3)
    parser.add_argument("--max_train_steps", type=int, default=5)
    parser.add_argument("--lr_scheduler_type", default="linear")
    parser.add_argument("--num_warmup_steps", type=int, default=2)
    parser.add_argument("--checkpointing_steps", default=None)
    parser.add_argument("--resume_from_checkpoint", default=None)
    parser.add_argument("--block_size", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    # test: not in run_clm_no_trainer.py
    parser.add_argument("--max_grad_norm", type=float, default=None)
    parser.add_argument("--train_samples", type=int, default=40)
    parser.add_argument("--eval_samples", type=int, default=7)
    return parser.parse_args()


def token_rows(vocab_size: int, samples: int, block_size: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """What run_clm_no_trainer.py's group_texts gives: blocks of ids, labels equal to them."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (samples, block_size), generator=generator)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def main() -> None:
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    if args.seed is not None:
        set_seed(args.seed)
    if accelerator.is_main_process and args.output_dir is not None:
        os.makedirs(args.output_dir, exist_ok=True)
    accelerator.wait_for_everyone()

    config = AutoConfig.from_pretrained(args.model_name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(
        args.model_name_or_path, from_tf=bool(".ckpt" in args.model_name_or_path), config=config,
        low_cpu_mem_usage=False, trust_remote_code=False)
    # We resize the embeddings only when necessary to avoid index errors.
    embedding_size = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > embedding_size:
        model.resize_token_embeddings(len(tokenizer))

    train_dataset = token_rows(config.vocab_size, args.train_samples, args.block_size, 1234)
    eval_dataset = token_rows(config.vocab_size, args.eval_samples, args.block_size, 4321)
    train_dataloader = DataLoader(train_dataset, shuffle=True, collate_fn=default_data_collator,
                                  batch_size=args.per_device_train_batch_size)
    eval_dataloader = DataLoader(eval_dataset, collate_fn=default_data_collator, batch_size=args.per_device_eval_batch_size)

    # Optimizer
    # Split weights in two groups, one with weight decay and the other not.
    no_decay = ["bias", "layer_norm.weight"]
    optimizer_grouped_parameters = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=args.learning_rate)

    # Scheduler and math around the number of training steps.
    overrode_max_train_steps = False
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
        overrode_max_train_steps = True
    lr_scheduler = get_scheduler(
        name=args.lr_scheduler_type, optimizer=optimizer,
        num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
        num_training_steps=args.max_train_steps if overrode_max_train_steps
        else args.max_train_steps * accelerator.num_processes,
    )

    # Prepare everything with our `accelerator`.
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)

    # We need to recalculate our total training steps as the size of the training dataloader may have changed.
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    if overrode_max_train_steps:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    # Afterwards we recalculate our number of training epochs
    args.num_train_epochs = math.ceil(args.max_train_steps / num_update_steps_per_epoch)

    # Figure out how many steps we should save the Accelerator states
    checkpointing_steps = args.checkpointing_steps
    if checkpointing_steps is not None and checkpointing_steps.isdigit():
        checkpointing_steps = int(checkpointing_steps)

    completed_steps = 0
    starting_epoch = 0
    resume_step = None

    # Potentially load in the weights and states from a previous save
    if args.resume_from_checkpoint:
        checkpoint_path = args.resume_from_checkpoint
        path = os.path.basename(args.resume_from_checkpoint.rstrip("/"))
        accelerator.print(f"Resumed from checkpoint: {checkpoint_path}")
        accelerator.load_state(checkpoint_path)
        # Extract `epoch_{i}` or `step_{i}`
        training_difference = os.path.splitext(path)[0]
        if "epoch" in training_difference:
            starting_epoch = int(training_difference.replace("epoch_", "")) + 1
            resume_step = None
            completed_steps = starting_epoch * num_update_steps_per_epoch
        else:
            # need to multiply `gradient_accumulation_steps` to reflect real steps
            resume_step = int(training_difference.replace("step_", "")) * args.gradient_accumulation_steps
            starting_epoch = resume_step // len(train_dataloader)
            completed_steps = resume_step // args.gradient_accumulation_steps
            resume_step -= starting_epoch * len(train_dataloader)

    losses_per_step, grad_norms, lrs = [], [], []  # test
    perplexity = float("nan")
    for epoch in range(starting_epoch, args.num_train_epochs):
        model.train()
        if args.resume_from_checkpoint and epoch == starting_epoch and resume_step is not None:
            # We skip the first `n` batches in the dataloader when resuming from a checkpoint
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        else:
            active_dataloader = train_dataloader
        for step, batch in enumerate(active_dataloader):
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                accelerator.backward(loss)
                if args.max_grad_norm is not None and accelerator.sync_gradients:  # test
                    grad_norms.append(float(accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)))
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            losses_per_step.append(accelerator.reduce(loss.detach(), "mean").item())  # test

            # Checks if the accelerator has performed an optimization step behind the scenes
            if accelerator.sync_gradients:
                completed_steps += 1
                lrs.append(lr_scheduler.get_last_lr()[0])  # test

            if isinstance(checkpointing_steps, int):
                if completed_steps % checkpointing_steps == 0 and accelerator.sync_gradients:
                    output_dir = f"step_{completed_steps}"
                    if args.output_dir is not None:
                        output_dir = os.path.join(args.output_dir, output_dir)
                    accelerator.save_state(output_dir)
            if completed_steps >= args.max_train_steps:
                break

        model.eval()
        losses = []
        for step, batch in enumerate(eval_dataloader):
            with torch.no_grad():
                outputs = model(**batch)

            loss = outputs.loss
            losses.append(accelerator.gather_for_metrics(loss.repeat(args.per_device_eval_batch_size)))

        losses = torch.cat(losses)
        try:
            eval_loss = torch.mean(losses)
            perplexity = math.exp(eval_loss)
        except OverflowError:
            perplexity = float("inf")
        accelerator.print(f"epoch {epoch}: perplexity: {perplexity} eval_loss: {eval_loss}")

        if args.checkpointing_steps == "epoch":
            output_dir = f"epoch_{epoch}"
            if args.output_dir is not None:
                output_dir = os.path.join(args.output_dir, output_dir)
            accelerator.save_state(output_dir)

    if args.output_dir is not None:
        accelerator.wait_for_everyone()
        unwrapped_model = accelerator.unwrap_model(model)
        unwrapped_model.save_pretrained(
            args.output_dir, is_main_process=accelerator.is_main_process, save_function=accelerator.save
        )
        if accelerator.is_main_process:
            tokenizer.save_pretrained(args.output_dir)
            with open(os.path.join(args.output_dir, "all_results.json"), "w") as f:
                json.dump({"perplexity": perplexity}, f)

    # test: what the run recorded, and the weights accelerator.get_state_dict gathers (collective)
    gathered = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        torch.save({name: tensor.clone() for name, tensor in gathered.items()},
                   os.path.join(args.output_dir, "get_state_dict.pt"))
        with open(os.path.join(args.output_dir, "run.json"), "w") as f:
            json.dump({"losses": losses_per_step, "grad_norms": grad_norms, "lrs": lrs, "eval_count": len(losses),
                       "perplexity": perplexity, "accelerator": type(accelerator).__name__,
                       "model": type(model).__name__}, f)
    accelerator.end_training()


if __name__ == "__main__":
    main()
