"""A Trainer-less training script written for DeepSpeed, as its users write them: the model built
under ``deepspeed.zero.Init`` (at stage 3), custom weights loaded into it with
``zero.GatheredParameters(..., modifier_rank=0)`` before ``deepspeed.initialize``, ``engine.backward``
and ``engine.step``, a checkpoint saved, and a fresh engine resuming it.

test_deepspeed_trainerless.py runs it under DeepSpeed as written and under hf_zero with its
``import deepspeed`` line replaced by ``import hf_zero.compat.deepspeed as deepspeed``, nothing else.

    python deepspeed_trainerless_script.py --model_dir M --data D --out O --deepspeed_config ds.json
"""

import argparse
import json
import os

import torch
import torch._dynamo  # noqa: F401  imported before zero.Init: DeepSpeed's patched constructors break its first import
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.generation import utils  # noqa: F401  the same, for the model's lazy import of it

import deepspeed

SAVE_AT, STEPS = 4, 8


def build_model(args, ds_config):
    config = AutoConfig.from_pretrained(args.model_dir)
    with deepspeed.zero.Init(config_dict_or_path=ds_config, enabled=ds_config["zero_optimization"]["stage"] == 3):
        model = AutoModelForCausalLM.from_config(config)
    # The pretrained weights, loaded by rank 0 into the model zero.Init built.
    state = load_file(os.path.join(args.model_dir, "model.safetensors"))
    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters(param, modifier_rank=0):
            if torch.distributed.get_rank() == 0:
                param.data.copy_(state[name])
    return model


def train(engine, batches, steps):
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    losses = []
    for step in steps:
        rows = batches[step]
        micro = len(rows) // world
        ids = rows[rank * micro:(rank + 1) * micro]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    with open(args.deepspeed_config) as f:
        ds_config = json.load(f)
    batches = torch.load(args.data)

    model = build_model(args, ds_config)
    resumed_model = build_model(args, ds_config)  # for a fresh engine that resumes the checkpoint
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    first = train(engine, batches, range(SAVE_AT))
    engine.save_checkpoint(os.path.join(args.out, "ckpt"), tag="step4", client_state={"epoch": 1})

    resumed, _, _, _ = deepspeed.initialize(args=args, model=resumed_model, model_parameters=resumed_model.parameters())
    _, client_state = resumed.load_checkpoint(os.path.join(args.out, "ckpt"), tag="step4")
    rest = train(resumed, batches, range(SAVE_AT, STEPS))
    with deepspeed.zero.GatheredParameters(list(resumed.module.parameters())):
        weight_norm = sum(float(p.double().pow(2).sum()) for p in resumed.module.parameters()) ** 0.5
    resumed.save_16bit_model(os.path.join(args.out, "model16"))
    result = {"first": first, "rest": rest, "client_state": client_state, "weight_norm": weight_norm,
              "global_steps": resumed.global_steps}
    with open(os.path.join(args.out, f"rank{torch.distributed.get_rank()}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
