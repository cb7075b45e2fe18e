#!/usr/bin/env python
"""Supervised fine-tuning with TRL's ``SFTTrainer``: an ordinary TRL script, no hf_zero line in it.

On hf_zero it runs unchanged through the runner, with the ZeRO config where ``--deepspeed`` would go::

    torchrun --nproc_per_node 8 -m hf_zero.run recipes/examples/train_trl_sft.py --zero_config recipes/zero3.json \\
        --model_name_or_path MODEL --dataset_file train.jsonl --output_dir out --bf16

(on a machine without GPUs add ``--use_cpu``). ``--lora_r 8`` trains a LoRA adapter with PEFT
instead of the whole model; ``trainer.save_model`` then writes the adapter. Data: JSON lines with
a ``text`` field (or TRL's conversational ``messages``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser
from trl import SFTConfig, SFTTrainer


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(metadata={"help": "a model folder or hub id"})
    dataset_file: str = field(metadata={"help": "JSON lines with a text (or messages) field"})
    lora_r: int = field(default=0, metadata={"help": "LoRA rank; 0 trains the whole model"})
    lora_alpha: int = field(default=16)


def main() -> None:
    script_args, training_args = HfArgumentParser((ScriptArguments, SFTConfig)).parse_args_into_dataclasses()
    tokenizer = AutoTokenizer.from_pretrained(script_args.model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(script_args.model_name_or_path)
    peft_config = None
    if script_args.lora_r:
        from peft import LoraConfig

        peft_config = LoraConfig(r=script_args.lora_r, lora_alpha=script_args.lora_alpha, lora_dropout=0.0,
                                 target_modules="all-linear", task_type="CAUSAL_LM")
    dataset = load_dataset("json", data_files=script_args.dataset_file, split="train")
    trainer = SFTTrainer(model=model, args=training_args, train_dataset=dataset, processing_class=tokenizer,
                         peft_config=peft_config)
    trainer.train()
    trainer.save_model(training_args.output_dir)


if __name__ == "__main__":
    main()
