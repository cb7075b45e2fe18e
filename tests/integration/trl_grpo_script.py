#!/usr/bin/env python
"""An ordinary TRL GRPO script (no hf_zero line): ``GRPOTrainer`` generates completions with
transformers' ``generate`` on the training model every step and scores them with a reward
function (here: shorter is better). test_trl.py runs it under plain torchrun (DDP) and through
``hf_zero.run --zero_config``."""

from __future__ import annotations

from dataclasses import dataclass, field

from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser
from trl import GRPOConfig, GRPOTrainer


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(metadata={"help": "a model folder"})
    dataset_file: str = field(metadata={"help": "JSON lines with a prompt field"})


def reward_short(completions: list[str], **kwargs: object) -> list[float]:
    return [-float(len(completion.split())) for completion in completions]


def main() -> None:
    script_args, training_args = HfArgumentParser((ScriptArguments, GRPOConfig)).parse_args_into_dataclasses()
    tokenizer = AutoTokenizer.from_pretrained(script_args.model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(script_args.model_name_or_path)
    dataset = load_dataset("json", data_files=script_args.dataset_file, split="train")
    trainer = GRPOTrainer(model=model, reward_funcs=reward_short, args=training_args, train_dataset=dataset,
                          processing_class=tokenizer)
    trainer.train()


if __name__ == "__main__":
    main()
