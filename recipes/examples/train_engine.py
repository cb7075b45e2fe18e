#!/usr/bin/env python
"""Train a causal LM with hf_zero's engine directly: no Trainer, no Accelerate.

    torchrun --nproc_per_node 2 recipes/examples/train_engine.py --model_name_or_path MODEL \\
        --zero_config recipes/zero3.json

Two nodes (run on each node, NODE_RANK 0 or 1; HOST0 is node 0's address):

    torchrun --nnodes 2 --nproc_per_node 8 --node_rank $NODE_RANK --rdzv_backend c10d \\
        --rdzv_endpoint $HOST0:29500 --rdzv_id job1 recipes/examples/train_engine.py ...

The loop is DeepSpeed's: ``loss = engine(...)``, ``engine.backward(loss)``, ``engine.step()``
every micro-step (the engine steps the optimizer at the accumulation boundary). "auto" values in
the config are filled here from the command line before ``hf_zero.initialize``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

import hf_zero
from hf_zero.config import HfZeroConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_name_or_path", required=True)
    parser.add_argument("--zero_config", required=True)
    parser.add_argument("--per_device_batch_size", type=int, default=2)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--learning_rate", type=float, default=5e-3)
    parser.add_argument("--max_steps", type=int, default=6, help="optimizer steps")
    parser.add_argument("--block_size", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--losses_out", default=None, help="write this rank's losses as JSON here")
    parser.add_argument("--save_dir", default=None, help="engine.save_checkpoint here at the end")
    return parser.parse_args(argv)


def micro_batch(step: int, rank: int, world_size: int, args: argparse.Namespace, vocab: int) -> torch.Tensor:
    """This rank's slice of micro-step ``step``'s global batch (the same data at any node layout)."""
    generator = torch.Generator().manual_seed(args.seed * 100_003 + step)
    rows = args.per_device_batch_size * world_size
    batch = torch.randint(0, vocab, (rows, args.block_size), generator=generator)
    return batch[rank * args.per_device_batch_size:(rank + 1) * args.per_device_batch_size]


def main() -> None:
    args = parse_args()
    from transformers import AutoModelForCausalLM

    # Keep the config alive before from_pretrained: a stage-3 config makes loading sharded.
    config = HfZeroConfig(args.zero_config)
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    resolved = config.resolve(
        world_size=world_size, hidden_size=model.config.hidden_size, train_micro_batch_size_per_gpu=args.per_device_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps, gradient_clipping=args.max_grad_norm,
        fp16=False, bf16=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.1)
    engine, _, _, _ = hf_zero.initialize(model=model, config=resolved, optimizer=optimizer)

    vocab = model.config.vocab_size
    losses = []
    for micro_step in range(args.max_steps * args.gradient_accumulation_steps):
        ids = micro_batch(micro_step, engine.rank, engine.world_size, args, vocab).to(engine.device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / engine.world_size)
    if args.save_dir:
        engine.save_checkpoint(args.save_dir)
    if args.losses_out:
        with open(args.losses_out, "w") as f:
            json.dump({"rank": engine.rank, "world_size": engine.world_size, "losses": losses,
                       "global_steps": engine.global_steps}, f)
    if engine.rank == 0:
        print(f"done: {engine.global_steps} steps, world size {engine.world_size}, final loss {losses[-1]:.6f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
