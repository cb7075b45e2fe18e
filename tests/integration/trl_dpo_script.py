#!/usr/bin/env python
"""An ordinary TRL DPO script (no hf_zero line): ``DPOTrainer`` builds its own frozen reference
model from the policy's folder. test_trl.py runs it under plain torchrun (DDP) and through
``hf_zero.run --zero_config``; with ``--memory_report FILE`` rank 0 also writes every rank's
memory for the policy and the reference model (read through the public engine API when the
models are hf_zero engines)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser
from trl import DPOConfig, DPOTrainer


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(metadata={"help": "a model folder"})
    dataset_file: str = field(metadata={"help": "JSON lines with prompt, chosen and rejected"})
    memory_report: str = field(default="", metadata={"help": "write per-rank model memory here (rank 0)"})


def model_memory(model) -> dict:
    """This rank's bytes for a model: hf_zero's memory_report for an engine, else its tensors."""
    if hasattr(model, "memory_report"):
        return {"engine": True, **model.memory_report()}
    return {"engine": False, "compute_params": sum(p.numel() * p.element_size() for p in model.parameters())}


def main() -> None:
    script_args, training_args = HfArgumentParser((ScriptArguments, DPOConfig)).parse_args_into_dataclasses()
    tokenizer = AutoTokenizer.from_pretrained(script_args.model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(script_args.model_name_or_path)
    dataset = load_dataset("json", data_files=script_args.dataset_file, split="train")
    trainer = DPOTrainer(model=model, args=training_args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    if script_args.memory_report:
        import torch.distributed as dist

        mine = {"policy": model_memory(trainer.model_wrapped), "reference": model_memory(trainer.ref_model)}
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        if dist.get_rank() == 0:
            with open(script_args.memory_report, "w") as f:
                json.dump(every, f)
    trainer.save_model(training_args.output_dir)


if __name__ == "__main__":
    main()
